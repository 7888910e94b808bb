"""A version loader as the tests build models with it: batches of up to 16 rows, one engine
worker, no wait for company, ONNX Runtime FP32 alone unless another factory is given."""

from __future__ import annotations

from service.models.loader import EngineFactory, VersionLoader, default_engines


def small_loader(
    factory: EngineFactory | None = None, *, warmup_iterations: int = 0
) -> VersionLoader:
    if factory is None:
        factory = default_engines(1, 1, tensorrt=False, onnx_variants=False)
    return VersionLoader(
        factory,
        max_batch_rows=16,
        max_queue_rows=64,
        workers=1,
        max_queue_delay_s=0.0,
        warmup_iterations=warmup_iterations,
        degrade_on_deadline=False,
    )
