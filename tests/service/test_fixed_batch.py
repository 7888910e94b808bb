"""A model exported with a fixed batch of one row (`[1, F]`, a common export): ONNX Runtime takes
one row a call, and a job of several rows (an explained request's block, a ScoreBatch, a
stream's messages scored together) is scored row by row, as each row alone would be."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import onnx
from loaders import small_loader
from modelkit import write_tabular_model

from service.batching.rows import RowBatch


def test_a_model_of_fixed_batch_one_scores_a_job_of_several_rows(tmp_path):
    folder = write_tabular_model(tmp_path)
    model = onnx.load(str(folder / "model.onnx"))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 1  # replaces the symbolic batch
    onnx.save(model, folder / "model.onnx")
    version = small_loader(warmup_iterations=1).build(folder)
    rows = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)

    async def score() -> tuple[np.ndarray, list[np.ndarray]]:
        version.batcher.start()
        try:
            deadline = time.monotonic() + 10
            together = await version.batcher.submit([RowBatch(rows, None, None)], deadline)
            alone = [
                (await version.batcher.submit([RowBatch(row[None], None, None)], deadline)).scores
                for row in rows
            ]
            return together.scores, alone
        finally:
            await version.batcher.close(1.0)

    together, alone = asyncio.run(score())
    np.testing.assert_allclose(together, np.concatenate(alone), rtol=1e-6)
