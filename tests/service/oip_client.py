"""Drive a live server with tritonclient, a client this project did not write.

Run as a separate process: tritonclient's generated protobuf modules define the same
`inference.*` symbols as riskserve's, and one process can hold only one of them.
Prints one JSON object with what each call returned.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as triton


def main(target: str, model: str, npz: str) -> None:
    client = triton.InferenceServerClient(url=target)
    arrays = np.load(npz)
    inputs = []
    for name in ("features", "history", "history_mask"):
        tensor = triton.InferInput(name, list(arrays[name].shape), "FP32")
        tensor.set_data_from_numpy(arrays[name])
        inputs.append(tensor)
    result = client.infer(model, inputs, outputs=[triton.InferRequestedOutput("score")])
    metadata = client.get_model_metadata(model, as_json=True)
    config = client.get_model_config(model, as_json=True)
    server = client.get_server_metadata(as_json=True)
    try:
        client.get_model_metadata("no-such-model")
        missing = "no error"
    except triton.InferenceServerException as exc:
        missing = exc.status()
    print(
        json.dumps(
            {
                "live": client.is_server_live(),
                "ready": client.is_server_ready(),
                "model_ready": client.is_model_ready(model),
                "unknown_model_ready": client.is_model_ready("no-such-model"),
                "server": server,
                "metadata": metadata,
                "config": config,
                "scores": result.as_numpy("score").reshape(-1).tolist(),
                "missing_status": missing,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
