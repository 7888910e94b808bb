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
    from google.protobuf import json_format

    from riskclient import RiskClient, ScoreBatchRequest, ScoreRequest, ScoringError
    from riskscoring.v1.risk_scoring_pb2 import EXPLAIN_ALWAYS

    try:
        payload = _read_json(args.request)
    except (OSError, ValueError) as exc:
        print(f"riskserve score: cannot read the request: {exc}", file=sys.stderr)
        return 2
    scored = None
    with RiskClient(args.target, timeout_s=args.timeout_s) as client:
        try:
            if isinstance(payload, list) or "requests" in payload:
                body = {"requests": payload} if isinstance(payload, list) else payload
                request = json_format.ParseDict(body, ScoreBatchRequest())
                batch = client.score_batch(
                    request.requests, model=request.model, model_version=request.model_version
                )
                reply: Any = {"responses": [json_format.MessageToDict(r) for r in batch]}
            else:
                request = json_format.ParseDict(payload, ScoreRequest())
                if args.explain:
                    request.explain_top_k, request.explain_when = args.top_k, EXPLAIN_ALWAYS
                scored = client.score(request)
                reply = json_format.MessageToDict(scored)
        except ScoringError as exc:
            print(json.dumps({"code": exc.code.name, "message": exc.message}), file=sys.stderr)
            return 1
    print(json.dumps(reply, indent=2))
    if scored is not None:  # reasons readable beside the JSON, which keeps stdout
        for reason in scored.reasons:
            names = ", ".join(reason.features)
            print(
                f"{reason.code}  {reason.contribution:+.3f}  {reason.text}  ({names})",
                file=sys.stderr,
            )
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


def _held_out(args: argparse.Namespace, model_dir: Path) -> tuple[dict[str, Any], Any]:
    """Validation data: an npz of model inputs plus `labels`, else the demo generator's."""
    import numpy as np

    if args.data is not None:
        with np.load(args.data) as arrays:
            data = {k: arrays[k] for k in arrays.files}
        return {k: v for k, v in data.items() if k != "labels"}, data["labels"]
    from demo.generator import generate, model_inputs

    held_out = generate(args.rows, seed=args.seed)
    return model_inputs(held_out), held_out.labels


def _validate(args: argparse.Namespace) -> int:
    from engines.validation import validate_model, write_report

    model_dir: Path = args.model_dir
    inputs, labels = _held_out(args, model_dir)
    report = validate_model(model_dir, inputs, labels)
    print(report.to_table())
    if args.json is not None:
        args.json.write_text(report.to_json() + "\n")
    path = write_report(model_dir, report)
    print(f"wrote {path}")
    failed = [v.precision for v in report.variants if not v.passes(report.tolerance)]
    if failed:
        print(f"refused (outside the manifest's tolerance): {', '.join(failed)}")
    return 0


def _build_engines(args: argparse.Namespace) -> int:
    from engines.base import EngineUnavailable
    from engines.trt import build_engines

    try:
        plans = build_engines(
            args.model_dir,
            tuple(args.precision),
            contexts=args.contexts,
            workspace_bytes=args.workspace_mib * 1024 * 1024,
            rebuild=args.rebuild,
        )
    except EngineUnavailable as exc:
        print(f"riskserve build-engines: {exc}", file=sys.stderr)
        return 2
    for plan in plans:
        print(plan)
    return 0


def _stats(args: argparse.Namespace) -> int:
    from service.telemetry import fetch_stats, format_stats

    print(format_stats(fetch_stats(args.url, window_s=args.window_s)))
    return 0


def _shadow_report(args: argparse.Namespace) -> int:
    from service.shadow import run_shadow_report

    return run_shadow_report(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="riskserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the models over gRPC")
    serve.add_argument("--host", help="bind address (RISKSERVE_HOST)")
    serve.add_argument("--port", type=int, help="gRPC port, 0 for any (RISKSERVE_PORT)")
    serve.add_argument("--models-dir", type=Path, help="models root (RISKSERVE_MODELS_DIR)")
    serve.set_defaults(run=_serve)

    validate = sub.add_parser(
        "validate", help="compare FP16 and INT8 variants with FP32 on held-out data"
    )
    validate.add_argument("model_dir", type=Path, help="models/<name>/<version>")
    validate.add_argument("--data", type=Path, help="npz of model inputs and `labels`")
    validate.add_argument("--rows", type=int, default=20000, help="generated rows (demo model)")
    validate.add_argument("--seed", type=int, default=31337, help="generator seed (demo model)")
    validate.add_argument("--json", type=Path, help="also write the report here")
    validate.set_defaults(run=_validate)

    build = sub.add_parser("build-engines", help="build TensorRT plans (needs TensorRT and a GPU)")
    build.add_argument("model_dir", type=Path, help="models/<name>/<version>")
    build.add_argument("--precision", action="append", choices=("fp32", "fp16", "int8"))
    build.add_argument("--contexts", type=int, default=2, help="profiles: concurrent contexts")
    build.add_argument("--workspace-mib", type=int, default=1024)
    build.add_argument("--rebuild", action="store_true", help="rebuild current plans too")
    build.set_defaults(run=_build_engines, precision=None)

    stats = sub.add_parser("stats", help="live p50/p99 per stage from a server's /metrics")
    stats.add_argument("--url", default="http://127.0.0.1:9464/metrics")
    stats.add_argument("--window-s", type=float, default=1.0, help="time between two scrapes")
    stats.set_defaults(run=_stats)

    from service.shadow import configure_parser

    report = sub.add_parser("shadow-report", help="compare champion and challenger logs")
    configure_parser(report)
    report.set_defaults(run=_shadow_report)

    for name, run, text in (
        ("score", _score, "score a JSON request (a ScoreRequest, or a list for ScoreBatch)"),
        ("info", _info, "print a model's schema, thresholds and engines"),
    ):
        client = sub.add_parser(name, help=text)
        client.add_argument("--target", default="127.0.0.1:50051")
        client.add_argument("--timeout-s", type=float, default=5.0)
        if name == "score":
            client.add_argument("request", help="JSON text, a file, or - for stdin")
            client.add_argument(
                "--explain", action="store_true", help="ask for reasons, printed to stderr"
            )
            client.add_argument("--top-k", type=int, default=3, help="reasons with --explain")
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
