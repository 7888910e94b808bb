"""The floors: gRPC servers that answer riskserve's RPCs doing no work, or only the model's.

It answers ModelInfer (and each request of ModelStreamInfer) with zero scores of the shape
riskserve returns, computing nothing, so what it costs is the floor that gRPC's Python server
costs on the machine; riskserve's excess over it is its own work. It describes the demo model
as riskserve does (ModelMetadata, ModelConfig), so perf_analyzer can drive it too.

It also answers riskserve's own service (Score, ScoreBatch, ScoreStream, GetModelInfo) with a
fixed score, so that `make loadtest`'s mix can run against it (`bench.loadtest_sweep
--configs floor`). Of a Score request it reads only the feature names and values, to answer
an unknown feature or a NaN with INVALID_ARGUMENT as the mix expects.

`grpc-floor-sync` is the same servicer on gRPC's other Python server, `grpc.server` with a
thread pool. `grpc-floor-lane` is the grpc.aio one behind HAProxy as riskserve deploys a worker
(`service.front`): unary calls and streams reach it on a call lane, HTTP/1.1 on a Unix socket
(`service.api.http1`). `grpc-floor-engine` adds the bare engine to the bare transport: it
scores each request's own rows with the demo model in ONNX Runtime (one thread, as riskserve's
sessions), on the event loop, and nothing more (no batching across requests, no deadlines,
metrics or traces, no range checks). `bench.compare` and `bench.streaming` start them by these
names; alone:

    .venv/bin/python -m bench.rpc_floor --grpc-port 8011 [--sync | --engine]
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.model_io import DEMO_MODEL_PATH, REPO_ROOT, ModelIO, read_model_io
from bench.servers import ServerSpec, serve_alone
from engines.manifest import Manifest, load_manifest
from inference import grpc_service_pb2 as oip
from inference import grpc_service_pb2_grpc as oip_grpc
from inference import model_config_pb2 as mc
from riskscoring.v1 import risk_scoring_pb2 as pb
from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

# Threads of the sync server: one per call it holds, streams included.
SYNC_WORKERS = 64


class _Answers:
    """Every answer the floor gives, computed from the request alone: zeros, or with a
    `session`, the model's scores of the request's own rows."""

    def __init__(self, io: ModelIO, manifest: Manifest, session: Any = None) -> None:
        self._io = io
        self._manifest = manifest
        self._features = frozenset(manifest.features)
        self._session = session

    def model_metadata(self, request: oip.ModelMetadataRequest) -> oip.ModelMetadataResponse:
        meta = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(
            name=request.name,
            versions=["1"],
            inputs=[
                meta(name=n, datatype="FP32", shape=[-1, *dims]) for n, dims in _dims(self._io)
            ],
            outputs=[meta(name=self._io.output, datatype="FP32", shape=[-1, 1])],
        )

    def model_config(self, request: oip.ModelConfigRequest) -> oip.ModelConfigResponse:
        config = mc.ModelConfig(
            name=request.name,
            max_batch_size=64,
            input=[
                mc.ModelInput(name=n, data_type=mc.TYPE_FP32, dims=dims)
                for n, dims in _dims(self._io)
            ],
            output=[mc.ModelOutput(name=self._io.output, data_type=mc.TYPE_FP32, dims=[1])],
        )
        return oip.ModelConfigResponse(config=config)

    def infer(self, request: oip.ModelInferRequest) -> oip.ModelInferResponse:
        # Zero scores of riskserve's output shape: perf_analyzer counts a reply without them
        # as no reply.
        rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
        response = oip.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name=self._io.output, datatype="FP32", shape=[rows, 1])
        if self._session is None:
            response.raw_output_contents.append(bytes(4 * rows))
            return response
        feed = {
            tensor.name: np.frombuffer(raw, dtype="<f4").reshape(tuple(tensor.shape))
            for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True)
        }
        response.raw_output_contents.append(self._run(feed).astype("<f4").tobytes())
        return response

    def _run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self._session.run([self._io.output], feed)[0].reshape(-1)

    def _scores(self, requests: Sequence[pb.ScoreRequest]) -> np.ndarray:
        """The model's scores of Score requests' rows, their histories padded to the longest;
        zeros without a session."""
        if self._session is None:
            return np.zeros(len(requests), dtype=np.float32)
        names = self._manifest.features
        features = np.array([[r.features[n] for n in names] for r in requests], dtype=np.float32)
        length = max(1, max((len(r.history) for r in requests), default=0))
        history = np.zeros((len(requests), length, self._io.n_history_fields), dtype=np.float32)
        mask = np.zeros((len(requests), length), dtype=np.float32)
        for i, r in enumerate(requests):
            if r.history:
                history[i, : len(r.history)] = [row.values for row in r.history]
                mask[i, : len(r.history)] = 1.0
        io = self._io
        return self._run(
            {io.features_input: features, io.history_input: history, io.mask_input: mask}
        )

    def model_info(self, request: pb.ModelInfoRequest) -> pb.ModelInfo:
        manifest = self._manifest
        history = manifest.history
        return pb.ModelInfo(
            model=manifest.name,
            model_version=manifest.version,
            versions=[manifest.version],
            feature_names=manifest.features,
            history_fields=history.fields if history is not None else [],
            max_history_length=history.max_length if history is not None else 0,
            max_batch_size=manifest.max_batch_size,
            nan_policy=manifest.nan_policy,
        )

    def _problem(self, request: pb.ScoreRequest) -> str | None:
        """What is wrong with the request's features, if anything."""
        for name, value in request.features.items():
            if name not in self._features:
                return f"features[{name!r}]: unknown feature"
            if not math.isfinite(value):
                return f"features[{name!r}]: NaN or infinite"
        return None

    def _reply(self, request: pb.ScoreRequest, score: float) -> pb.ScoreResponse:
        thresholds = self._manifest.thresholds
        decision = pb.APPROVE
        if score >= thresholds.decline:
            decision = pb.DECLINE
        elif score >= thresholds.review:
            decision = pb.REVIEW
        return pb.ScoreResponse(
            request_id=request.request_id,
            score=score,
            decision=decision,
            model=self._manifest.name,
            model_version=self._manifest.version,
            engine="none" if self._session is None else "onnxruntime",
        )

    def score(self, request: pb.ScoreRequest) -> pb.ScoreResponse | str:
        """The request's score, or what is wrong with its features."""
        problem = self._problem(request)
        if problem is not None:
            return problem
        return self._reply(request, float(self._scores([request])[0]))

    def score_batch(self, request: pb.ScoreBatchRequest) -> pb.ScoreBatchResponse | str:
        items = request.requests
        for i, item in enumerate(items):
            problem = self._problem(item)
            if problem is not None:
                return f"requests[{i}].{problem}"
        scores = self._scores(items)
        return pb.ScoreBatchResponse(
            responses=[self._reply(item, float(s)) for item, s in zip(items, scores, strict=True)]
        )

    def score_message(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        answer = self.score(request)
        if isinstance(answer, str):
            code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            return pb.ScoreResponse(
                request_id=request.request_id, status=pb.Status(code=code, message=answer)
            )
        return answer


class _Echo(oip_grpc.GRPCInferenceServiceServicer):
    """OIP on grpc.aio."""

    def __init__(self, answers: _Answers) -> None:
        self._answers = answers

    async def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return oip.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(name="grpc.aio echo", version="0")

    async def ModelMetadata(self, request, context):
        return self._answers.model_metadata(request)

    async def ModelConfig(self, request, context):
        return self._answers.model_config(request)

    async def ModelInfer(self, request, context):
        return self._answers.infer(request)

    async def ModelStreamInfer(self, request_iterator, context):
        # One answer per request as it is read: the least a Python stream can cost.
        async for request in request_iterator:
            yield oip.ModelStreamInferResponse(infer_response=self._answers.infer(request))


class _ScoringEcho(pb_grpc.RiskScoringServicer):
    """riskserve's own service on grpc.aio."""

    def __init__(self, answers: _Answers) -> None:
        self._answers = answers

    async def GetModelInfo(self, request, context):
        return self._answers.model_info(request)

    async def Score(self, request, context):
        return await _or_abort(self._answers.score(request), context)

    async def ScoreBatch(self, request, context):
        return await _or_abort(self._answers.score_batch(request), context)

    async def ScoreStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context
    ) -> AsyncIterator[pb.ScoreResponse]:
        async for request in request_iterator:
            yield self._answers.score_message(request)


async def _or_abort(answer, context):
    if isinstance(answer, str):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, answer)
    return answer


class _SyncEcho(oip_grpc.GRPCInferenceServiceServicer):
    """OIP on the thread-pool server (perf_analyzer's calls only)."""

    def __init__(self, answers: _Answers) -> None:
        self._answers = answers

    def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):
        return oip.ModelReadyResponse(ready=True)

    def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(name="grpc thread-pool echo", version="0")

    def ModelMetadata(self, request, context):
        return self._answers.model_metadata(request)

    def ModelConfig(self, request, context):
        return self._answers.model_config(request)

    def ModelInfer(self, request, context):
        return self._answers.infer(request)

    def ModelStreamInfer(self, request_iterator, context) -> Iterator[oip.ModelStreamInferResponse]:
        for request in request_iterator:
            yield oip.ModelStreamInferResponse(infer_response=self._answers.infer(request))


def _dims(io: ModelIO) -> list[tuple[str, list[int]]]:
    """Each input's shape after the batch dimension (-1: any length), as riskserve gives it."""
    return [
        (io.features_input, [io.n_features]),
        (io.history_input, [-1, io.n_history_fields]),
        (io.mask_input, [-1]),
    ]


def _answers(engine: bool = False) -> _Answers:
    session = None
    if engine:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(
            str(DEMO_MODEL_PATH), options, providers=["CPUExecutionProvider"]
        )
    io = read_model_io(DEMO_MODEL_PATH)
    return _Answers(io, load_manifest(DEMO_MODEL_PATH.parent), session)


def echo_spec(
    port: int, *, sync: bool = False, engine: bool = False, lane: bool = False
) -> ServerSpec:
    """The do-nothing server as a process on `port`: grpc.aio, or the thread-pool server;
    with `engine`, the grpc.aio one that runs the model on each request's rows; with `lane`,
    the grpc.aio one behind HAProxy as riskserve deploys a worker (calls and streams on a call
    lane)."""
    if sync:
        name, call = "grpc thread-pool echo", f"f._serve_echo_sync({port})"
    elif lane:
        name, call = "grpc.aio echo behind the front", f"asyncio.run(f._serve_lane({port}))"
    else:
        name, call = "grpc.aio echo", f"asyncio.run(f._serve_echo({port}, {engine}))"
    return ServerSpec(
        f"{name} with the model" if engine else name,
        (sys.executable, "-c", f"import asyncio, bench.rpc_floor as f; {call}"),
        port,
        "fraud-demo",
        cwd=REPO_ROOT,
    )


async def _serve_echo(port: int, engine: bool = False) -> None:
    server = grpc.aio.server()
    answers = _answers(engine)
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(_Echo(answers), server)
    pb_grpc.add_RiskScoringServicer_to_server(_ScoringEcho(answers), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_lane(port: int) -> None:
    """The do-nothing servicer as a worker behind the front: HAProxy on `port` (configured by
    `service.front`, no limit on calls), unary calls and streams on a call lane (HTTP/1.1,
    `service.api.http1`), the rest on the worker's gRPC socket."""
    from service.api.http1 import CallLane
    from service.api.registration import generic_handler
    from service.config import Settings
    from service.front import find_haproxy, write

    haproxy = find_haproxy()
    if haproxy is None:
        raise SystemExit("grpc-floor-lane needs HAProxy")
    folder = Path(tempfile.mkdtemp(prefix="floor-lane-"))
    grpc_socket, lane_socket = folder / "grpc.sock", folder / "calls.sock"
    handlers = (
        generic_handler(_Echo(_answers()), oip.DESCRIPTOR.services_by_name["GRPCInferenceService"]),
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(handlers)
    server.add_insecure_port(f"unix:{grpc_socket}")
    await server.start()
    lane = CallLane(handlers)
    await lane.start(str(lane_socket))
    settings = Settings.model_validate(
        {"port": port, "metrics_port": None, "max_requests_in_progress": 10_000}
    )
    config = write(folder, settings, [str(grpc_socket)], call_lanes=[str(lane_socket)])
    proxy = subprocess.Popen([haproxy, "-db", "-f", str(config)])  # in this process's group
    try:
        await server.wait_for_termination()
    finally:
        proxy.terminate()
        shutil.rmtree(folder, ignore_errors=True)


def _serve_echo_sync(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=SYNC_WORKERS))
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(_SyncEcho(_answers()), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-port", type=int, default=8011, help="listens on 127.0.0.1")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--sync", action="store_true", help="gRPC's thread-pool server")
    kind.add_argument("--engine", action="store_true", help="run the model on each request")
    parser.add_argument("--serve-s", type=float, default=600.0, help="stop after this long")
    args = parser.parse_args(argv)
    name = "grpc-floor-sync" if args.sync else "grpc-floor-engine" if args.engine else "grpc-floor"
    log_path = REPO_ROOT / "bench" / "results" / "logs" / f"{name}.log"
    spec = echo_spec(args.grpc_port, sync=args.sync, engine=args.engine)
    return serve_alone(spec, log_path, args.serve_s)


if __name__ == "__main__":
    sys.exit(main())
