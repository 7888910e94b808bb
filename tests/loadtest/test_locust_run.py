"""Short, real headless locust runs of loadtest/locustfile.py against live gRPC servers.

One run targets riskserve itself (skipped until its CLI exists); the others target the
stand-in in fake_server.py, so the load test's own accounting is checked on any machine.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
FAKE_SERVER = Path(__file__).with_name("fake_server.py")
LOCUST = Path(sys.executable).with_name("locust")
TASK_NAMES = {"Score", "ScoreBatch", "Score (long history)", "ModelInfer", "Score (invalid)"}
# 10 users at 15 task runs a second each: a 5 s run offers about 700 runs, some 14 of them
# invalid (2 %); fewer than the 2 the share check needs comes about once in 50 000 runs.


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serving(target: str, timeout_s: float, server: subprocess.Popen[bytes]) -> bool:
    """Whether the server came up SERVING (False: it exited, or never did in `timeout_s`)."""
    # Retry the connection often: gRPC's default backoff would notice the server a second late.
    options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def up() -> bool:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        try:
            wait_until(lambda: server.poll() is not None or up(), timeout_s)
        except AssertionError:
            return False
    return server.poll() is None


@contextmanager
def _server(
    command: list[str], port: int, log: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    target = f"127.0.0.1:{port}"
    with log.open("wb") as sink:
        server = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        if not _serving(target, 120.0, server):
            pytest.fail(f"server on {target} never became SERVING:\n{log.read_text()[-3000:]}")
        yield target
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _locust(
    target: str, prefix: Path, run_time_s: int, extra: tuple[str, ...] = ()
) -> tuple[int, dict[str, dict[str, str]]]:
    """Run locust headless; its exit status and run_stats.csv rows by request name (its
    output goes to `prefix`.out)."""
    command = [
        str(LOCUST), "-f", str(LOCUSTFILE), "--headless", "-u", "10", "-r", "10",
        "--rps-per-user", "15", "--run-time", f"{run_time_s}s", "--host", target,
        "--csv", str(prefix), "--exit-code-on-error", "1", "--only-summary",
        "--stop-timeout", "5", *extra,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=run_time_s + 60
    )
    prefix.with_name(prefix.name + ".out").write_text(done.stdout + done.stderr)
    stats_path = prefix.with_name(prefix.name + "_stats.csv")
    assert stats_path.exists(), done.stdout + done.stderr
    with stats_path.open(newline="") as handle:
        rows = {row["Name"]: row for row in csv.DictReader(handle)}
    return done.returncode, rows


def _assert_clean_mix(status: int, rows: dict[str, dict[str, str]]) -> None:
    assert rows.keys() >= TASK_NAMES, f"missing request types: {TASK_NAMES - rows.keys()}"
    for name in TASK_NAMES:
        assert int(rows[name]["Request Count"]) > 0, name
        assert int(rows[name]["Failure Count"]) == 0, (name, rows[name])
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    # INVALID_ARGUMENT answers to deliberately invalid requests counted as successes, at ~2%.
    share = int(rows["Score (invalid)"]["Request Count"]) / int(rows["Aggregated"]["Request Count"])
    assert 0.003 < share < 0.08, share
    assert status == 0


def test_locust_mix_against_stand_in_server(tmp_path: Path) -> None:
    port = _free_port()
    command = [sys.executable, str(FAKE_SERVER), "--port", str(port)]
    with _server(command, port, tmp_path / "server.log") as target:
        status, rows = _locust(target, tmp_path / "run", run_time_s=5)
    _assert_clean_mix(status, rows)
    # One verdict line: 10 users x 15 req/s offered, nothing refused, late or failed.
    assert re.search(
        r"verdict: [\d,]+ answers/s of 150 req/s offered; refused 0, deadline exceeded 0, "
        r"other failures 0; p99 [\d.]+ ms, (within|over) the 10 ms budget",
        (tmp_path / "run.out").read_text(),
    )


def test_locust_mix_from_two_processes(tmp_path: Path) -> None:
    """`--processes` (LOADTEST_PROCESSES): the users are shared out over the workers, and the
    master adds up their counts."""
    port, master = _free_port(), str(_free_port())
    command = [sys.executable, str(FAKE_SERVER), "--port", str(port)]
    workers = ("--processes", "2", "--master-bind-host", "127.0.0.1")
    workers += ("--master-bind-port", master, "--master-port", master)
    # A budget every call is over: the workers' counts of calls over it reach the master.
    workers += ("--budget-ms", "0.001")
    with _server(command, port, tmp_path / "server.log") as target:
        status, rows = _locust(target, tmp_path / "run", run_time_s=5, extra=workers)
    _assert_clean_mix(status, rows)
    found = re.search(r"over the 0.001 ms budget \(([\d,]+) calls over it\)", _verdict(
        tmp_path / "run.out"))  # fmt: skip
    assert found, _verdict(tmp_path / "run.out")
    # The final tally; the CSV, written once a second, may miss the last second's.
    assert int(found[1].replace(",", "")) >= int(rows["Aggregated"]["Request Count"]) > 0


def test_each_user_calls_on_a_connection_of_its_own(tmp_path: Path) -> None:
    """As callers from many hosts do: a server running one process per core spreads
    connections over its processes (SO_REUSEPORT), not calls."""
    port = _free_port()
    command = [sys.executable, str(FAKE_SERVER), "--port", str(port)]
    run = [
        str(LOCUST), "-f", str(LOCUSTFILE), "--headless", "-u", "10", "-r", "10",
        "--rps-per-user", "5", "--run-time", "20s", "--only-summary",
    ]  # fmt: skip
    with _server(command, port, tmp_path / "server.log") as target:
        locust = subprocess.Popen(
            [*run, "--host", target], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        most = 0

        def connected() -> bool:
            # Until the ten users have connected, or locust has ended (at its run time, with
            # its users on fewer connections).
            nonlocal most
            most = max(most, _connections_to(port))
            return most >= 10 or locust.poll() is not None

        try:
            wait_until(connected, 60)
            assert most >= 10, f"10 locust users held at most {most} connection(s)"
        finally:
            locust.terminate()
            locust.wait(timeout=30)


def _connections_to(port: int) -> int:
    """Established TCP connections whose far end is 127.0.0.1:`port`."""
    return sum(
        1
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == port
    )


def test_invalid_requests_answered_ok_are_failures(tmp_path: Path) -> None:
    port = _free_port()
    command = [sys.executable, str(FAKE_SERVER), "--port", str(port), "--lenient"]
    with _server(command, port, tmp_path / "server.log") as target:
        status, rows = _locust(target, tmp_path / "run", run_time_s=4)
    invalid = rows["Score (invalid)"]
    assert int(invalid["Request Count"]) > 0
    assert int(invalid["Failure Count"]) == int(invalid["Request Count"])
    assert int(rows["Score"]["Failure Count"]) == 0
    assert status == 1
    # The verdict is the final tally; the CSV, written once a second, may miss the last one.
    found = re.search(
        r"refused 0, deadline exceeded 0, other failures ([\d,]+);", _verdict(tmp_path / "run.out")
    )
    assert found and int(found[1].replace(",", "")) >= int(rows["Aggregated"]["Failure Count"])


def _verdict(output: Path) -> str:
    return next(line for line in output.read_text().splitlines() if "verdict:" in line)


def test_the_verdict_counts_calls_the_server_refused(tmp_path: Path) -> None:
    port = _free_port()
    env = {
        **os.environ,
        "RISKSERVE_PORT": str(port),
        "RISKSERVE_METRICS_PORT": "none",
        "RISKSERVE_BUDGET_MS": "1000",
        "RISKSERVE_MAX_REQUESTS_IN_PROGRESS": "1",  # a second call at a time is refused
        "RISKSERVE_ENGINE_INLINE_MAX_US": "0",  # batches on an engine thread: calls overlap
        # Each call waits 5 ms for company: at 150 calls a second most overlap another.
        "RISKSERVE_MAX_QUEUE_DELAY_US": "5000",
        **_small_sequence_model(tmp_path / "models"),
    }
    command = [
        sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())",
        "serve", "--port", str(port),
    ]  # fmt: skip
    with _server(command, port, tmp_path / "server.log", env=env) as target:
        status, _ = _locust(target, tmp_path / "run", run_time_s=4, extra=("--deadline-ms", "500"))
    with (tmp_path / "run_failures.csv").open(newline="") as handle:
        refused = sum(
            int(row["Occurrences"]) for row in csv.DictReader(handle)
            if "got RESOURCE_EXHAUSTED" in row["Error"]
        )  # fmt: skip
    assert refused > 0 and status == 1
    line = _verdict(tmp_path / "run.out")
    found = re.search(
        r"refused ([\d,]+) \(RESOURCE_EXHAUSTED ([\d,]+)\), deadline exceeded 0, "
        r"other failures 0;",
        line,
    )
    assert found and found[1] == found[2], line
    # The final tally; the CSV, written once a second, may miss the last second's.
    assert int(found[1].replace(",", "")) >= refused
    assert "the 500 ms budget" in line  # the deadline, where the run sets one


def _small_sequence_model(root: Path) -> dict[str, str]:
    """Without the demo model, serve the test suite's small sequence model instead."""
    try:
        from modelkit import write_sequence_model  # tests/support, on sys.path via conftest
    except ImportError:
        pytest.skip("no model under models/ (python -m demo.train writes the demo model)")
    folder = write_sequence_model(root, max_length=256)
    return {"RISKSERVE_MODELS_DIR": str(root), "RISKSERVE_DEFAULT_MODEL": folder.parent.name}


@pytest.fixture(scope="module")
def riskserve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`riskserve serve` in its own process, shared by the unary and the streaming run."""
    if importlib.util.find_spec("service.cli") is None:
        pytest.skip("service.cli (the `riskserve serve` command) does not exist yet")
    tmp_path = tmp_path_factory.mktemp("riskserve")
    models_dir = Path(os.environ.get("RISKSERVE_MODELS_DIR", REPO / "models"))
    extra: dict[str, str] = {}
    if not any(models_dir.glob("*/*/manifest.json")):
        extra = _small_sequence_model(tmp_path / "models")
    port = _free_port()
    env = {
        **os.environ,
        **extra,
        "RISKSERVE_PORT": str(port),
        "RISKSERVE_METRICS_PORT": str(_free_port()),
        # This checks the traffic mix and its accounting, not latency: on a small shared
        # machine the default 10 ms budget sheds some requests (DEADLINE_EXCEEDED) by design.
        "RISKSERVE_BUDGET_MS": "1000",
    }
    command = [
        sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())",
        "serve", "--port", str(port),
    ]  # fmt: skip
    with _server(command, port, tmp_path / "server.log", env=env) as target:
        yield target


@pytest.mark.parametrize("mode", [(), ("--streaming",)], ids=["unary", "streaming"])
def test_locust_mix_against_riskserve(
    riskserve: str, tmp_path: Path, mode: tuple[str, ...]
) -> None:
    status, rows = _locust(riskserve, tmp_path / "run", run_time_s=5, extra=mode)
    _assert_clean_mix(status, rows)


def test_harness_refuses_a_port_already_in_use(tmp_path: Path) -> None:
    """With a server already on the port, the harness starts none and says why, at once."""
    marker = tmp_path / "started"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        target = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run(
            [
                sys.executable,
                str(REPO / "loadtest" / "harness.py"),
                "run",
                "--target",
                target,
                "--server",
                f"{sys.executable} -c \"open('{marker}', 'w')\"",
                "--",
                sys.executable,
                "-c",
                "pass",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2
    assert f"{target} is already in use" in done.stderr
    assert "LOADTEST_SERVER=" in done.stderr
    assert not marker.exists()
