"""The ``riskserve`` command: serve, score, info, build-engines, validate, shadow-report."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]


def _serve(args: argparse.Namespace) -> int:
    from service.config import Settings
    from service.server import serve, serve_processes

    overrides: dict[str, Any] = {
        k: v
        for k, v in {"host": args.host, "port": args.port, "models_dir": args.models_dir}.items()
        if v is not None
    }
    settings = Settings(**overrides)
    if settings.processes > 1:
        return serve_processes(settings)
    asyncio.run(serve(settings))
    return 0


def _read_json(source: str) -> Any:
    if source == "-":
        return json.load(sys.stdin)
    if source.lstrip().startswith(("{", "[")):
        return json.loads(source)
    return json.loads(Path(source).read_text())


def _score(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from riskscoring.v1 import risk_scoring_pb2 as pb
    from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

    payload = _read_json(args.request)
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        try:
            if isinstance(payload, list) or "requests" in payload:
                body = {"requests": payload} if isinstance(payload, list) else payload
                batch = json_format.ParseDict(body, pb.ScoreBatchRequest())
                reply: Any = stub.ScoreBatch(batch, timeout=args.timeout_s)
            else:
                request = json_format.ParseDict(payload, pb.ScoreRequest())
                reply = stub.Score(request, timeout=args.timeout_s)
        except grpc.RpcError as exc:
            print(json.dumps({"code": exc.code().name, "message": exc.details()}), file=sys.stderr)
            return 1
    print(json.dumps(json_format.MessageToDict(reply), indent=2))
    return 0


def _info(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from riskscoring.v1 import risk_scoring_pb2 as pb
    from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        info = stub.GetModelInfo(pb.ModelInfoRequest(model=args.model), timeout=args.timeout_s)
    print(json.dumps(json_format.MessageToDict(info), indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="riskserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the models over gRPC")
    serve.add_argument("--host", help="bind address (RISKSERVE_HOST)")
    serve.add_argument("--port", type=int, help="gRPC port, 0 for any (RISKSERVE_PORT)")
    serve.add_argument("--models-dir", type=Path, help="models root (RISKSERVE_MODELS_DIR)")
    serve.set_defaults(run=_serve)

    for name, run, text in (
        ("score", _score, "score a JSON request (a ScoreRequest, or a list for ScoreBatch)"),
        ("info", _info, "print a model's schema, thresholds and engines"),
    ):
        client = sub.add_parser(name, help=text)
        client.add_argument("--target", default="127.0.0.1:50051")
        client.add_argument("--timeout-s", type=float, default=5.0)
        if name == "score":
            client.add_argument("request", help="JSON text, a file, or - for stdin")
        else:
            client.add_argument("--model", default="")
        client.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run: Command = args.run
    return run(args)
