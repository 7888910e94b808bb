"""ModelStreamInfer driven by NVIDIA's tritonclient (start_stream / async_stream_infer), run as
a separate process; prints what the callback received as JSON."""

from __future__ import annotations

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def inputs_for(arrays: dict[str, np.ndarray], row: int) -> list:
    made = []
    for name, array in arrays.items():
        part = np.ascontiguousarray(array[row : row + 1])
        tensor = grpcclient.InferInput(name, list(part.shape), "FP32")
        tensor.set_data_from_numpy(part.astype(np.float32))
        made.append(tensor)
    return made


def main(target: str, model: str, npz: str) -> None:
    with np.load(npz) as data:
        arrays = {k: data[k] for k in data.files}
    rows = len(arrays["features"])
    answers: queue.Queue = queue.Queue()

    def callback(result, error):
        answers.put((result, error))

    client = grpcclient.InferenceServerClient(target)
    client.start_stream(callback=callback)
    sent = []
    for row in range(rows):
        if row == 3:
            # A failing request in the middle: the stream must answer it and stay open.
            client.async_stream_infer("no-such-model", inputs_for(arrays, row), request_id="bad-1")
            sent.append("bad-1")
        if row == 5:
            # A deadline of 1 µs (Triton's per-request `timeout` parameter) cannot be met.
            client.async_stream_infer(
                model, inputs_for(arrays, row), request_id="late-1", timeout=1
            )
            sent.append("late-1")
        client.async_stream_infer(model, inputs_for(arrays, row), request_id=f"r{row}")
        sent.append(f"r{row}")
    got: dict[str, dict] = {}
    for _ in sent:
        result, error = answers.get(timeout=60)
        if error is not None:
            # Triton puts the failed request's id in the (otherwise empty) infer_response.
            response = error  # InferenceServerException: no id; matched by message below
            got.setdefault("errors", []).append(str(response.message()))
        else:
            rid = result.get_response().id
            got[rid] = {"score": float(result.as_numpy("score").reshape(-1)[0])}
    client.stop_stream()
    client.close()
    print(json.dumps({"sent": sent, "got": got}))


if __name__ == "__main__":
    main(*sys.argv[1:])
