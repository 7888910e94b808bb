"""Loaders for ONNX Runtime sessions: small callables that build a session when called."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.base import EngineUnavailable

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = ["SessionFromPath", "available_providers", "default_providers"]

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise EngineUnavailable(f"ONNX Runtime is not installed: {exc}") from exc
    return onnxruntime


def available_providers() -> tuple[str, ...]:
    """Execution providers this ONNX Runtime build offers (not proof that a device exists)."""
    return tuple(_ort().get_available_providers())


def default_providers() -> tuple[str, ...]:
    """CUDA first where the build offers it, CPU always last as ONNX Runtime's own fallback."""
    return (CUDA, CPU) if CUDA in available_providers() else (CPU,)


@dataclass(frozen=True)
class SessionFromPath:
    """Build an `InferenceSession` for one ONNX file with deliberately chosen options.

    Sequential execution with one inter-op thread keeps a small model's latency flat; the
    intra-op thread count is the knob worth measuring per host (see docs/engines.md).
    `require_providers` refuses a session that silently fell back to another provider, which
    onnxruntime-gpu does on a machine without a usable CUDA device.
    """

    path: Path
    providers: Sequence[str] | None = None
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    provider_options: dict[str, dict[str, str]] = field(default_factory=dict)
    require_providers: bool = False
    extra_outputs: Sequence[str] = ()
    """Inner tensors to fetch as well as the graph's outputs (the tensor a ZipMap output is
    made from, see `engines.output`): the session is built from a copy of the graph that
    declares them as outputs."""

    def __call__(self) -> ort.InferenceSession:
        ort_mod = _ort()
        options = ort_mod.SessionOptions()
        options.graph_optimization_level = ort_mod.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort_mod.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = self.inter_op_threads
        options.intra_op_num_threads = self.intra_op_threads
        wanted = tuple(self.providers) if self.providers is not None else default_providers()
        # Asking for a provider this build lacks only warns; leave those out and report below.
        offered = set(ort_mod.get_available_providers())
        provider_list: list[Any] = [
            (name, self.provider_options[name]) if name in self.provider_options else name
            for name in wanted
            if name in offered
        ]
        try:
            source: str | bytes = (
                _with_outputs(Path(self.path), self.extra_outputs)
                if self.extra_outputs
                else str(self.path)
            )
            session = ort_mod.InferenceSession(
                source, sess_options=options, providers=provider_list
            )
        except Exception as exc:
            raise EngineUnavailable(f"cannot load {Path(self.path).name}: {exc}") from exc
        got = tuple(session.get_providers())
        missing = [name for name in wanted if name not in got]
        if missing:
            message = (
                f"ONNX Runtime session for {Path(self.path).name} asked for {list(wanted)} "
                f"but runs on {list(got)}"
            )
            if self.require_providers:
                raise EngineUnavailable(message)
            log.warning("%s", message)
        return session


def _with_outputs(path: Path, names: Sequence[str]) -> bytes:
    """The model at `path`, serialized with `names` added to its graph's outputs, and without
    the ZipMap nodes that map them: their sequences of maps would be built on every run and
    never fetched."""
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in graph.value_info}
    for name in names:
        if name not in {o.name for o in graph.output}:
            elem = types.get(name, onnx.TensorProto.FLOAT)
            graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    consumed = {i for node in graph.node for i in node.input}
    mapped = [
        n
        for n in graph.node
        if n.op_type == "ZipMap" and n.input[0] in names and not consumed & set(n.output)
    ]
    dropped = {output for node in mapped for output in node.output}
    for node in mapped:
        graph.node.remove(node)
    kept = [o for o in graph.output if o.name not in dropped]
    del graph.output[:]
    graph.output.extend(kept)
    return model.SerializeToString()
