"""The `grpc-floor` server: a grpc.aio server that answers riskserve's RPCs and does no work.

It answers ModelInfer (and each request of ModelStreamInfer) with zero scores of the shape
riskserve returns, computing nothing, so what it costs is the floor that gRPC's Python server
costs on the machine; riskserve's excess over it is its own work. It describes the demo model
as riskserve does (ModelMetadata, ModelConfig), so perf_analyzer can drive it too.

It also answers riskserve's own service (Score, ScoreBatch, ScoreStream, GetModelInfo) with a
fixed score, so that `make loadtest`'s mix can run against it (`bench.loadtest_sweep
--configs floor`). Of a Score request it reads only the feature names and values, to answer
an unknown feature or a NaN with INVALID_ARGUMENT as the mix expects.

`grpc-floor-sync` is the same servicer on gRPC's other Python server, `grpc.server` with a
thread pool. `bench.compare` and `bench.streaming` start them by these names; alone:

    .venv/bin/python -m bench.rpc_floor --grpc-port 8011 [--sync]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent import futures

import grpc

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
    """Every answer the floor gives, computed from the request alone."""

    def __init__(self, io: ModelIO, manifest: Manifest) -> None:
        self._io = io
        self._manifest = manifest
        self._features = frozenset(manifest.features)

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
        response.raw_output_contents.append(bytes(4 * rows))
        return response

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

    def score(self, request: pb.ScoreRequest) -> pb.ScoreResponse | str:
        """A fixed score, or what is wrong with the request's features."""
        for name, value in request.features.items():
            if name not in self._features:
                return f"features[{name!r}]: unknown feature"
            if not math.isfinite(value):
                return f"features[{name!r}]: NaN or infinite"
        return pb.ScoreResponse(
            request_id=request.request_id,
            score=0.0,
            decision=pb.APPROVE,
            model=self._manifest.name,
            model_version=self._manifest.version,
            engine="none",
        )

    def score_batch(self, request: pb.ScoreBatchRequest) -> pb.ScoreBatchResponse | str:
        answers = []
        for i, item in enumerate(request.requests):
            answer = self.score(item)
            if isinstance(answer, str):
                return f"requests[{i}].{answer}"
            answers.append(answer)
        return pb.ScoreBatchResponse(responses=answers)

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


def _answers() -> _Answers:
    return _Answers(read_model_io(DEMO_MODEL_PATH), load_manifest(DEMO_MODEL_PATH.parent))


def echo_spec(port: int, *, sync: bool = False) -> ServerSpec:
    """The do-nothing server as a process on `port`: grpc.aio, or the thread-pool server."""
    call = f"f._serve_echo_sync({port})" if sync else f"asyncio.run(f._serve_echo({port}))"
    return ServerSpec(
        "grpc thread-pool echo" if sync else "grpc.aio echo",
        (sys.executable, "-c", f"import asyncio, bench.rpc_floor as f; {call}"),
        port,
        "fraud-demo",
        cwd=REPO_ROOT,
    )


async def _serve_echo(port: int) -> None:
    server = grpc.aio.server()
    answers = _answers()
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(_Echo(answers), server)
    pb_grpc.add_RiskScoringServicer_to_server(_ScoringEcho(answers), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _serve_echo_sync(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=SYNC_WORKERS))
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(_SyncEcho(_answers()), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-port", type=int, default=8011, help="listens on 127.0.0.1")
    parser.add_argument("--sync", action="store_true", help="gRPC's thread-pool server")
    parser.add_argument("--serve-s", type=float, default=600.0, help="stop after this long")
    args = parser.parse_args(argv)
    name = "grpc-floor-sync" if args.sync else "grpc-floor"
    log_path = REPO_ROOT / "bench" / "results" / "logs" / f"{name}.log"
    return serve_alone(echo_spec(args.grpc_port, sync=args.sync), log_path, args.serve_s)


if __name__ == "__main__":
    sys.exit(main())
