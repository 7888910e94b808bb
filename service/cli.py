"""The ``riskserve`` command: serve, score, info, stats, build-engines, validate, shadow-report.

Every subcommand reads the same settings as the server (``RISKSERVE_*`` variables and the file
named by ``RISKSERVE_CONFIG_FILE``): the clients find the server at its host and port, talk TLS
when the server has a certificate, send its bearer token, and scrape its metrics port. A flag
overrides a setting for one call. Errors are one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

    from riskclient import Connection
    from service.config import Settings

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]

# Exit statuses: the server answered with an error status; the call could not be made.
EXIT_STATUS = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """A failure the command reports as one line, exiting with `status`."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


def _settings(**overrides: Any) -> Settings:
    """The process's settings (environment, config file, defaults) with `overrides` on top."""
    from pydantic import ValidationError

    from service.config import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'settings'}: {error['msg']}"
            for error in exc.errors()
        )
        raise CommandError(f"invalid settings: {problems}") from None
    except (OSError, ValueError) as exc:  # an unreadable or malformed RISKSERVE_CONFIG_FILE
        raise CommandError(f"cannot read the settings: {exc}") from None


def _serve(args: argparse.Namespace) -> int:
    from service.front import find_haproxy, serve_with_front

    settings = _settings(host=args.host, port=args.port, models_dir=args.models_dir)
    haproxy = find_haproxy() if settings.front is not None else None
    if haproxy is not None:
        return serve_with_front(settings, haproxy)
    if settings.front == "haproxy":
        raise CommandError("RISKSERVE_FRONT=haproxy, but no haproxy executable was found")
    if settings.front == "auto":
        logging.getLogger(__name__).warning(
            "no haproxy found: serving without the front, so calls beyond capacity wait in "
            "gRPC's core until their deadlines pass (docs/reliability.md)"
        )
    from service.server import serve, serve_processes  # the front's own process needs none

    if settings.processes > 1:
        return serve_processes(settings)
    asyncio.run(serve(settings))
    return 0


def _read_json(source: str) -> Any:
    try:
        if source == "-":
            return json.load(sys.stdin)
        if source.lstrip().startswith(("{", "[")):
            return json.loads(source)
        return json.loads(Path(source).read_text())
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read the request: {exc}") from None


def _reachable(host: str, port: int) -> str:
    """`host:port` as a client on this host reaches a server bound there: the same rule as
    the Python client's default target, which reads the same two settings."""
    from riskclient._connection import reachable

    return reachable(host, port)


def _channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to the server: TLS when the server has a certificate or a CA is given."""
    import grpc

    settings = _settings()
    target = args.target or _reachable(settings.host, settings.port)
    tls_ca: Path | None = args.tls_ca or settings.tls_ca_file
    if tls_ca is None and settings.tls_cert_file is None:
        channel = grpc.insecure_channel(target)
    else:
        try:
            roots = tls_ca.read_bytes() if tls_ca is not None else None
        except OSError as exc:
            raise CommandError(f"cannot read the CA bundle: {exc}") from None
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(roots))
    args.resolved_target = target
    return channel


def _call_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The bearer token to send: --token, else RISKSERVE_AUTH_TOKEN; none when neither."""
    token = args.token if args.token is not None else _settings().auth_token
    return (("authorization", f"Bearer {token}"),) if token else ()


def _connection(args: argparse.Namespace) -> Connection:
    """How `score` reaches the server: the settings' address, TLS and token, or the flags."""
    from riskclient import Connection

    settings = _settings()
    target = args.target or _reachable(settings.host, settings.port)
    tls_ca: Path | None = args.tls_ca or settings.tls_ca_file
    token = args.token if args.token is not None else settings.auth_token
    args.resolved_target = target
    secure = tls_ca is not None or settings.tls_cert_file is not None
    return Connection(target, tls=secure, tls_ca_file=tls_ca, auth_token=token or None)


def _score_call(connection: Connection, payload: Any, args: argparse.Namespace) -> Any:
    """The transport of `score`, through the project's client: one Score (an object) or
    ScoreBatch (a list, or an object with `requests`) call; returns the reply as JSON-ready
    data."""
    from google.protobuf import json_format

    from riskclient import RiskClient, ScoreBatchRequest, ScoreRequest, ScoringError
    from riskscoring.v1.risk_scoring_pb2 import EXPLAIN_ALWAYS

    try:
        client = RiskClient(connection=connection, timeout_s=args.timeout_s)
    except OSError as exc:
        raise CommandError(f"cannot read the TLS files: {exc}") from None
    with client:
        try:
            if _is_batch(payload):
                body = {"requests": payload} if isinstance(payload, list) else payload
                batch = json_format.ParseDict(body, ScoreBatchRequest())
                replies = client.score_batch(
                    batch.requests, model=batch.model, model_version=batch.model_version
                )
                return {"responses": [json_format.MessageToDict(r) for r in replies]}
            request = json_format.ParseDict(payload, ScoreRequest())
            if args.explain:
                request.explain_top_k, request.explain_when = args.top_k, EXPLAIN_ALWAYS
            reply = client.score(request)
        except ScoringError as exc:
            details = exc.message
            if exc.code.name == "UNAVAILABLE":
                details = f"cannot reach {args.resolved_target}: {details}"
            raise CommandError(f"{exc.code.name}: {details}", EXIT_STATUS) from None
    return json_format.MessageToDict(reply)


def _score(args: argparse.Namespace) -> int:
    payload = _read_json(args.request)
    if not isinstance(payload, dict | list):
        raise CommandError("the request must be a JSON object or a list of them")
    if args.explain and _is_batch(payload):
        # ScoreBatch refuses explain_top_k; scoring each request alone instead would be a
        # different call, with its own budget each, than the batch the file asks for.
        raise CommandError(
            "--explain takes one request, not a batch (ScoreBatch gives no reasons): "
            "score the requests one at a time"
        )
    reply = _score_call(_connection(args), payload, args)
    print(json.dumps(reply, indent=2))  # with --explain, the reasons are in it
    return 0


def _is_batch(payload: Any) -> bool:
    return isinstance(payload, list) or "requests" in payload


def _info(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from riskscoring.v1 import risk_scoring_pb2 as pb
    from riskscoring.v1 import risk_scoring_pb2_grpc as pb_grpc

    with _channel(args) as channel:
        stub = pb_grpc.RiskScoringStub(channel)
        try:
            info = stub.GetModelInfo(
                pb.ModelInfoRequest(model=args.model),
                timeout=args.timeout_s,
                metadata=_call_metadata(args),
            )
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                _unless_answering(channel, exc, args.timeout_s)
            raise
    print(json.dumps(json_format.MessageToDict(info), indent=2))
    return 0


def _unless_answering(channel: grpc.Channel, exc: grpc.Call, timeout_s: float) -> None:
    """Where the server itself said UNAVAILABLE (it answers health checks), its reason:
    the model is not ready, e.g. its serving version is not loaded; else nothing."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s
        )
    except grpc.RpcError:
        return  # not reached: said as such by `_describe`
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    raise CommandError(f"UNAVAILABLE: {exc.details()} (server health: {status})", EXIT_STATUS)


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
            tuple(args.precision or ("fp16", "int8")),
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


def _metrics_url(settings: Settings) -> str:
    if settings.metrics_port is None:
        raise CommandError("the server's metrics are off (RISKSERVE_METRICS_PORT=none): give --url")
    return f"http://{_reachable(settings.metrics_host, settings.metrics_port)}/metrics"


def _stats(args: argparse.Namespace) -> int:
    from service.telemetry import fetch_stats, format_stats

    url = args.url or _metrics_url(_settings())
    try:
        snapshot = fetch_stats(url, window_s=args.window_s)
    except OSError as exc:
        raise CommandError(f"cannot scrape {url}: {getattr(exc, 'reason', exc)}") from None
    print(format_stats(snapshot))
    return 0


def _shadow_report(args: argparse.Namespace) -> int:
    # The only import of riskreport in service/: offline analytics stay out of the server.
    try:
        from riskreport import shadow_report_main
    except ModuleNotFoundError as exc:
        raise CommandError(
            f"needs the report extra ({exc.name} is not installed): pip install 'riskserve[report]'"
        ) from None
    return shadow_report_main(args.report_args)


def _front_config(args: argparse.Namespace) -> int:
    from service import front

    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    if not workers:
        raise CommandError("--workers names no address", EXIT_USAGE)
    settings = _settings()
    out = args.out.resolve()  # the paths in the file are HAProxy's to open, from anywhere
    out.mkdir(parents=True, exist_ok=True)
    # The same configuration `serve` writes: TLS where the settings give it (the PEM HAProxy
    # reads is written beside the file), the front's metrics endpoint where it is on.
    tls = front.front_tls(settings, out)
    metrics_port = settings.front_metrics_port_resolved
    print(front.write(out, settings, workers, metrics_port=metrics_port, tls=tls))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="riskserve", description=__doc__)
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    )
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
    build.add_argument(
        "--precision",
        action="append",
        choices=("fp32", "fp16", "int8"),
        help="a precision to build; repeat for several (default: fp16 and int8)",
    )
    build.add_argument("--contexts", type=int, default=2, help="profiles: concurrent contexts")
    build.add_argument("--workspace-mib", type=int, default=1024)
    build.add_argument("--rebuild", action="store_true", help="rebuild current plans too")
    build.set_defaults(run=_build_engines, precision=None)

    front = sub.add_parser(
        "front-config", help="write the HAProxy front's configuration from the settings"
    )
    front.add_argument("--out", type=Path, required=True, help="folder for haproxy.cfg")
    front.add_argument(
        "--workers",
        required=True,
        help="the workers' gRPC addresses, host:port, comma-separated",
    )
    front.set_defaults(run=_front_config)

    stats = sub.add_parser("stats", help="live p50/p99 per stage from a server's /metrics")
    stats.add_argument(
        "--url", help="metrics page (default: RISKSERVE_METRICS_HOST and RISKSERVE_METRICS_PORT)"
    )
    stats.add_argument("--window-s", type=float, default=1.0, help="time between two scrapes")
    stats.set_defaults(run=_stats)

    # The report (the `report` extra) parses its own options: `main` hands them on unread, so
    # no other command loads it.
    report = sub.add_parser(
        _REPORT, help="compare champion and challenger logs (riskserve[report])", add_help=False
    )
    report.set_defaults(run=_shadow_report, report_args=[])

    for name, run, text in (
        ("score", _score, "score a JSON request (a ScoreRequest, or a list for ScoreBatch)"),
        ("info", _info, "print a model's schema, thresholds and engines"),
    ):
        client = sub.add_parser(name, help=text)
        client.add_argument(
            "--target", help="host:port of the server (default: RISKSERVE_HOST and RISKSERVE_PORT)"
        )
        client.add_argument(
            "--tls-ca",
            type=Path,
            help="PEM roots to verify the server with; talk TLS (RISKSERVE_TLS_CA_FILE; TLS is "
            "also used when RISKSERVE_TLS_CERT_FILE is set)",
        )
        client.add_argument("--token", help="bearer token to send (RISKSERVE_AUTH_TOKEN)")
        client.add_argument("--timeout-s", type=float, default=5.0)
        if name == "score":
            client.add_argument("request", help="JSON text, a file, or - for stdin")
            client.add_argument(
                "--explain",
                action="store_true",
                help="ask for reason codes, printed in the JSON reply (one request, not a batch)",
            )
            client.add_argument("--top-k", type=int, default=3, help="reasons with --explain")
        else:
            client.add_argument("--model", default="")
        client.set_defaults(run=run)
    return parser


_CLIENTS = ("score", "info")
_REPORT = "shadow-report"
# How grpc's add_insecure_port and add_secure_port report an address they cannot bind.
_BIND_FAILED = "Failed to bind to address"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == _REPORT:
        args.report_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run: Command = args.run
    # gRPC's core reads GRPC_VERBOSITY when grpc is first imported (below, in the command);
    # unset, it leaves absl's default, INFO, and logs a line for every failed TLS handshake:
    # a server would write one per plaintext or port-scanning connection, a client one beside
    # the status the command reports. An exported GRPC_VERBOSITY (e.g. INFO) still wins.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE" if args.command in _CLIENTS else "ERROR")
    try:
        return run(args)
    except CommandError as exc:
        return _fail(args, str(exc), exc.status)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", 130)
    except Exception as exc:  # a command fails with one line, never a traceback
        message, status = _describe(exc, args)
        logging.getLogger(__name__).debug("riskserve %s failed", args.command, exc_info=True)
        return _fail(args, message, status)


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    line = " ".join(message.split())  # one line, whatever the message held
    print(f"riskserve {args.command}: {line}", file=sys.stderr)
    return status


def _describe(exc: Exception, args: argparse.Namespace) -> tuple[str, int]:
    """One line for what went wrong, and the exit status."""
    import grpc
    from google.protobuf import json_format

    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        code = exc.code()
        details = exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            target = getattr(args, "resolved_target", "the server")
            return f"UNAVAILABLE: cannot reach {target}: {details}", EXIT_STATUS
        return f"{code.name}: {details}", EXIT_STATUS
    if isinstance(exc, json_format.ParseError):
        return f"invalid request: {exc}", EXIT_USAGE
    if isinstance(exc, RuntimeError) and str(exc).startswith(_BIND_FAILED):
        address = str(exc).removeprefix(_BIND_FAILED).split(";")[0].strip()
        return (
            f"cannot listen on {address}: the port is in use or the address is not this host's; "
            "choose another port (RISKSERVE_PORT or --port)",
            EXIT_USAGE,
        )
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else ""), EXIT_USAGE
    text = str(exc) or type(exc).__name__
    return f"{text} (--log-level DEBUG shows where)", EXIT_USAGE
