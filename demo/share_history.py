"""Let the exported `fraud-demo` graph score many feature rows against one history.

The network encodes the history (a Transformer over its rows, then pooling) apart from the
tabular features and joins the two only at the head's input, a Concat of
``[tabular, mean, peak, log1p(count)]``. This edit puts an Expand to the features' batch on the
three history terms before that Concat, and gives the history inputs a batch dimension of their
own (``history_batch``). With equal batches nothing changes (the Expand copies nothing); with a
history batch of 1 and N feature rows, every row is scored with that one history, and the
Transformer runs once instead of N times. The manifest says so with ``history.broadcast``, and
the server then computes an explained request's history once (docs/explanations.md).

``demo.train`` applies it after export; on a model already exported::

    python -m demo.share_history models/fraud-demo/1/model.onnx

then ``python -m engines.precision`` to make the FP16 and INT8 variants from it again.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["HEAD_CONCAT", "HISTORY_BATCH", "share_history"]

HEAD_CONCAT = "/net/Concat"
"""The exporter's name for the Concat at the head's input (``torch.cat`` in FraudNet.forward)."""
HISTORY_BATCH = "history_batch"
_PREFIX = "/net/share_history"


def share_history(
    model: onnx.ModelProto, history_inputs: Sequence[str] = ("history", "history_mask")
) -> onnx.ModelProto:
    """Edit `model` in place (and return it); a model already edited is returned unchanged."""
    graph = model.graph
    if any(node.name.startswith(_PREFIX) for node in graph.node):
        return model
    position = next((i for i, n in enumerate(graph.node) if n.name == HEAD_CONCAT), None)
    if position is None:
        raise ValueError(f"no node {HEAD_CONCAT!r}: not a graph exported by demo.train")
    concat = graph.node[position]
    if len(concat.input) != 4:
        raise ValueError(f"{HEAD_CONCAT} has {len(concat.input)} inputs, expected 4")
    rows, one, shape = f"{_PREFIX}/rows", f"{_PREFIX}/one", f"{_PREFIX}/shape"
    graph.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), one))
    added = [
        # The batch of the tabular term, which has the features' batch.
        helper.make_node(
            "Shape", [concat.input[0]], [rows], name=f"{_PREFIX}/Shape", start=0, end=1
        ),
        helper.make_node("Concat", [rows, one], [shape], name=f"{_PREFIX}/Concat", axis=0),
    ]
    for k in (1, 2, 3):
        expanded = f"{_PREFIX}/expanded_{k}"
        added.append(
            helper.make_node(
                "Expand", [concat.input[k], shape], [expanded], name=f"{_PREFIX}/Expand_{k}"
            )
        )
        concat.input[k] = expanded
    for offset, node in enumerate(added):
        graph.node.insert(position + offset, node)
    for value in graph.input:
        if value.name in history_inputs:
            dim = value.type.tensor_type.shape.dim[0]
            dim.ClearField("dim_value")
            dim.dim_param = HISTORY_BATCH
    onnx.checker.check_model(model)
    return model


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m demo.share_history", description=__doc__)
    parser.add_argument("model", type=Path, help="an ONNX file exported by demo.train")
    args = parser.parse_args(argv)
    model = share_history(onnx.load(str(args.model)))
    onnx.save(model, str(args.model))
    print(f"{args.model}: history terms expand to the features' batch")


if __name__ == "__main__":
    main()
