"""Open Inference Protocol (KServe v2) over gRPC: the one request every server receives.

The load generators send a pre-serialized ``ModelInferRequest`` (the same bytes every time)
through a generic unary call, so the client spends no CPU on protobuf per request.
"""

from __future__ import annotations

import time

import grpc
import numpy as np

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc

__all__ = [
    "MODEL_INFER_METHOD",
    "build_infer_request",
    "decode_output",
    "wait_model_ready",
]

MODEL_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


def build_infer_request(
    model_name: str, arrays: dict[str, np.ndarray], output_name: str = "score"
) -> pb.ModelInferRequest:
    """A ModelInfer request carrying every array as FP32 raw_input_contents, in dict order."""
    request = pb.ModelInferRequest(model_name=model_name)
    for name, array in arrays.items():
        request.inputs.add(name=name, datatype="FP32", shape=list(array.shape))
        request.raw_input_contents.append(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    request.outputs.add(name=output_name)
    return request


def decode_output(response: pb.ModelInferResponse, name: str = "score") -> np.ndarray:
    """The named FP32 output of a ModelInfer response, from raw contents or typed contents."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name != name:
            continue
        if response.raw_output_contents:
            flat = np.frombuffer(response.raw_output_contents[index], dtype=np.float32)
        else:
            flat = np.asarray(tensor.contents.fp32_contents, dtype=np.float32)
        return flat.reshape(tuple(tensor.shape))
    raise KeyError(f"no output {name!r} in response")


def wait_model_ready(target: str, model_name: str, timeout_s: float, is_alive=None) -> None:
    """Polls ServerReady and ModelReady until both say ready; raises TimeoutError otherwise.

    `is_alive`, when given, is called between polls so a server that died stops the wait early.
    """
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            if is_alive is not None and not is_alive():
                raise RuntimeError(f"server for {target} exited before it was ready")
            try:
                if (
                    stub.ServerReady(pb.ServerReadyRequest(), timeout=1.0).ready
                    and stub.ModelReady(pb.ModelReadyRequest(name=model_name), timeout=1.0).ready
                ):
                    return
                last_error = "not ready yet"
            except grpc.RpcError as exc:
                last_error = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.25)
    raise TimeoutError(
        f"{target} model {model_name!r} not ready after {timeout_s:.0f} s ({last_error})"
    )
