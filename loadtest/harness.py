"""Run a locust command against riskserve, optionally starting the server and watching it.

    python loadtest/harness.py wait --target 127.0.0.1:50051
    python loadtest/harness.py run --server "riskserve serve --port 50051" -- locust -f ...
    python loadtest/harness.py run --server "..." --soak-csv loadtest/reports/soak.csv -- locust ...

`run` starts the server (when --server is given) with its output in --server-log, waits until
the standard gRPC health service answers SERVING, runs the command, then stops the server with
SIGTERM (SIGKILL after --stop-grace-s). When something already listens on --target it refuses
to start a server (the load would go to that other process): stop it, choose another port, or
leave --server empty to load what is running.

With --soak-csv it samples the server's resident memory and open file descriptors (the process
and its children) every --interval-s seconds and fails when either grew, from just after
--warmup-s to the end, by more than its bound.

Exit status: the command's, else 1 when a bound was exceeded or the server died during the
run, 2 when the port was taken, the server never became healthy or the run was too short to
judge growth.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
_MIB = 1024 * 1024
_EDGE_SAMPLES = 3  # the baseline and the end are medians of this many samples


def _channel(target: str, tls_ca: str) -> grpc.Channel:
    """A channel to a locust-style host: host:port, grpc://, grpcs:// or dns:///."""
    tls = bool(tls_ca) or target.startswith("grpcs://")
    for scheme in ("grpcs://", "grpc://"):
        target = target.removeprefix(scheme)
    if not tls:
        return grpc.insecure_channel(target)
    roots = Path(tls_ca).read_bytes() if tls_ca else None
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))


def listening(target: str) -> bool:
    """Whether something accepts TCP connections at `target` (host:port, maybe a grpc://)."""
    for scheme in ("grpcs://", "grpc://"):
        target = target.removeprefix(scheme)
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def wait_until_serving(
    target: str,
    timeout_s: float,
    server: subprocess.Popen[bytes] | None = None,
    tls_ca: str = "",
) -> bool:
    """Poll grpc.health.v1.Health/Check until SERVING; give up early if the server exits."""
    deadline_s = time.monotonic() + timeout_s
    with _channel(target, tls_ca) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline_s:
            if server is not None and server.poll() is not None:
                return False
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    return False


@dataclass(frozen=True)
class Sample:
    elapsed_s: float
    rss_bytes: int
    open_fds: int
    threads: int
    processes: int


def sample_tree(pid: int, elapsed_s: float) -> Sample | None:
    """Resident memory, descriptors and threads of a process and all its children."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    rss = fds = threads = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return Sample(elapsed_s, rss, fds, threads, len(procs))


def judge_growth(
    samples: list[Sample], warmup_s: float, max_rss_growth_mib: float, max_fd_growth: int
) -> tuple[int, str]:
    """Compare the end of the run with just after warm-up; (exit status, one-line verdict)."""
    steady = [s for s in samples if s.elapsed_s >= warmup_s]
    if len(steady) < 2 * _EDGE_SAMPLES:
        return 2, f"too few samples after warm-up to judge growth ({len(steady)})"
    first, last = steady[:_EDGE_SAMPLES], steady[-_EDGE_SAMPLES:]
    rss_growth_mib = (
        statistics.median(s.rss_bytes for s in last) - statistics.median(s.rss_bytes for s in first)
    ) / _MIB
    fd_growth = statistics.median(s.open_fds for s in last) - statistics.median(
        s.open_fds for s in first
    )
    verdict = (
        f"RSS growth {rss_growth_mib:+.1f} MiB (bound {max_rss_growth_mib}), "
        f"open fd growth {fd_growth:+.0f} (bound {max_fd_growth}) "
        f"over {steady[-1].elapsed_s - steady[0].elapsed_s:.0f} s after warm-up"
    )
    exceeded = rss_growth_mib > max_rss_growth_mib or fd_growth > max_fd_growth
    return (1 if exceeded else 0), verdict


def _stop(server: subprocess.Popen[bytes], grace_s: float) -> None:
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        print(f"harness: server still up {grace_s:.0f} s after SIGTERM; killing it", flush=True)
        server.kill()
        server.wait()


def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("harness: nothing to run (give the command after --)", file=sys.stderr)
        return 2
    if args.soak_csv and not args.server:
        print("harness: --soak-csv needs --server (a process to watch)", file=sys.stderr)
        return 2
    server = None
    if args.server and listening(args.target):
        print(
            f"harness: {args.target} is already in use, so the server to load cannot start "
            "there: stop what listens on it, choose another port (make loadtest "
            "LOADTEST_PORT=...), or load that server (make loadtest LOADTEST_SERVER=)",
            file=sys.stderr,
        )
        return 2
    if args.server:
        Path(args.server_log).parent.mkdir(parents=True, exist_ok=True)
        with open(args.server_log, "wb") as log:
            server = subprocess.Popen(
                shlex.split(args.server), stdout=log, stderr=subprocess.STDOUT
            )
    try:
        if not wait_until_serving(args.target, args.startup_timeout_s, server, args.tls_ca):
            print(f"harness: {args.target} never became SERVING; see {args.server_log}")
            return 2
        return _drive(args, command, server)
    finally:
        if server is not None:
            _stop(server, args.stop_grace_s)
            print(f"harness: server exited with status {server.returncode}", flush=True)


def _drive(args: argparse.Namespace, command: list[str], server: subprocess.Popen[bytes] | None):
    samples: list[Sample] = []
    start_s = time.monotonic()
    runner = subprocess.Popen(command)
    while runner.poll() is None:
        if args.soak_csv and server is not None:
            sample = sample_tree(server.pid, time.monotonic() - start_s)
            if sample is not None:
                samples.append(sample)
        with contextlib.suppress(subprocess.TimeoutExpired):
            runner.wait(timeout=args.interval_s)
    status = runner.returncode
    if server is not None and server.poll() is not None:
        print(f"harness: the server died during the run (status {server.returncode})")
        status = status or 1
    if args.soak_csv:
        _write_samples(Path(args.soak_csv), samples)
        verdict_status, verdict = judge_growth(
            samples, args.warmup_s, args.max_rss_growth_mib, args.max_fd_growth
        )
        print(f"harness: soak: {verdict}; samples in {args.soak_csv}", flush=True)
        status = status or verdict_status
    return status


def _write_samples(path: Path, samples: list[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["elapsed_s", "rss_bytes", "open_fds", "threads", "processes"])
        for s in samples:
            writer.writerow([f"{s.elapsed_s:.1f}", s.rss_bytes, s.open_fds, s.threads, s.processes])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    wait = sub.add_parser("wait", help="wait until the gRPC health service answers SERVING")
    wait.add_argument("--target", default=DEFAULT_TARGET)
    wait.add_argument("--timeout-s", type=float, default=60.0)
    wait.add_argument("--tls-ca", default="", help="PEM roots: health-check over TLS")

    run = sub.add_parser("run", help="run a command against a (started) server")
    run.add_argument("--target", default=DEFAULT_TARGET, help="host:port to health-check")
    run.add_argument("--tls-ca", default="", help="PEM roots: health-check over TLS")
    run.add_argument("--server", default="", help="server command line; empty: already running")
    run.add_argument("--server-log", default="loadtest/reports/server.log")
    run.add_argument("--startup-timeout-s", type=float, default=120.0)
    run.add_argument("--stop-grace-s", type=float, default=30.0)
    run.add_argument("--soak-csv", default="", help="sample the server into this CSV")
    run.add_argument("--interval-s", type=float, default=5.0)
    run.add_argument("--warmup-s", type=float, default=60.0)
    run.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    run.add_argument("--max-fd-growth", type=int, default=16)
    run.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.action == "wait":
        ok = wait_until_serving(args.target, args.timeout_s, tls_ca=args.tls_ca)
        print(f"{args.target}: {'SERVING' if ok else 'not serving'}")
        return 0 if ok else 2
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
