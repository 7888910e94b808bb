"""Every shell command in the README and docs/shadow.md runs as written, in order.

Each ```sh block of a page is read line by line, as a user pastes it into one shell with the
ports exported (RISKSERVE_PORT and RISKSERVE_METRICS_PORT, free ones, before the page's own
`export` lines, which win). `export` lines set the variables of the lines after them. `make
serve` starts the server in the background, as a second shell holds it (stopping the one
before), and the next lines run once it answers health checks; `make loadtest` with its own
server runs with the served one stopped, as its comment says. Every other line runs in bash
from the repository root and must exit 0, except the few listed in SKIPPED (with why) and
REFUSED (a documented one-line refusal where this machine lacks what they need), and a load
test whose only failed calls were refused or late, which passes with a warning.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from liveserver import REPO
from waiting import port_open, wait_until

from bench.servers import free_port

SKIPPED = {
    "make test": "the suite this test is part of",
    "python3 -m venv .venv-train && .venv-train/bin/pip install -e '.[cpu,train]'": (
        "installs PyTorch into a second environment (minutes, gigabytes)"
    ),
    ".venv-train/bin/python -m demo.train --out models/fraud-demo/1 --seed 0": (
        "retrains the committed model (tests/demo checks the training script)"
    ),
    ".venv/bin/python -m engines.precision models/fraud-demo/1": (
        "rewrites the committed variants (tests/engines/test_precision.py runs it on a copy)"
    ),
    ".venv/bin/riskserve validate models/fraud-demo/1": (
        "rewrites the committed validation.json (tests/service/test_validation.py: on a copy)"
    ),
    "python3 -m venv .venv && .venv/bin/pip install -e '.[gpu]'": (
        "the GPU install: never beside the CPU one"
    ),
    ".venv/bin/pip install -e '.[report]'": "the test environment has the report extra",
    "bench/peers/setup.sh && .venv/bin/python -m bench.compare --help": (
        "downloads Triton and MLServer (bench/peers)"
    ),
}
# Lines that must fail in one line on a machine without what they need.
REFUSED = {
    ".venv/bin/riskserve build-engines models/fraud-demo/1": "TensorRT",
}
PAGES = ("README.md", "docs/shadow.md")
# `make loadtest` reads LOADTEST_TIME from the environment. Long enough that the server's first
# second (new shapes, cold caches) is not the p99 the run's verdict holds to the budget.
LOADTEST_TIME = "10s"


def commands(page: str) -> Iterator[str]:
    """The page's shell lines in order, comments and blank lines left out."""
    text = (REPO / page).read_text()
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        for line in block.splitlines():
            line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if line and not line.startswith("#"):
                yield line


# The load test's verdict line (loadtest/grpc_user.py): its failures that were not refusals
# or calls past their deadline.
_OTHER_FAILURES = re.compile(r"verdict: .* other failures ([\d,]+);")


def _only_load_failed(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether a load test that failed ran to its verdict and failed only calls that the load
    on this machine refused or made late: locust exits 1 on any failed call, and how many the
    front refuses when a shared machine stalls the server is a timing, which tests leave to
    benchmarks. A wrong answer, any other failure or a server that died still fails the line.
    Warns with the verdict."""
    output = done.stdout + done.stderr
    found = _OTHER_FAILURES.search(output)
    if found is None or found.group(1) != "0" or "harness: the server died" in output:
        return False
    warnings.warn(f"the load test refused or was late on calls: {found.group(0)}", stacklevel=2)
    return True


class Shell:
    """One user's shell: its variables, and the server it started in the background."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env = env
        self.tmp = tmp
        self.server: subprocess.Popen[bytes] | None = None
        self.ran: list[str] = []

    def run(self, line: str) -> None:
        if line.startswith("export "):
            for assignment in shlex.split(line)[1:]:
                name, _, value = assignment.partition("=")
                self.env[name] = value
        elif line == "make serve":
            self.start_server()
        elif line in SKIPPED:
            return
        else:
            if line.startswith("make loadtest") and "LOADTEST_SERVER=" not in line:
                self.stop_server()  # it starts its own on RISKSERVE_PORT
            elif line.startswith("make loadtest") and self.server is None:
                self.start_server()
            done = subprocess.run(
                ["bash", "-c", line], cwd=REPO, env=self.env, capture_output=True, text=True,
                timeout=300, check=False,
            )  # fmt: skip
            if line in REFUSED:
                assert done.returncode != 0 or self._has(REFUSED[line]), line
                if done.returncode:
                    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
                    assert REFUSED[line] in done.stderr, done.stderr
            elif done.returncode and not (
                line.startswith("make loadtest") and _only_load_failed(done)
            ):
                assert done.returncode == 0, f"{line!r} failed:\n{done.stdout}\n{done.stderr}"
        self.ran.append(line)

    def _has(self, package: str) -> bool:
        probe = [str(REPO / ".venv" / "bin" / "python"), "-c", f"import {package.lower()}"]
        return subprocess.run(probe, capture_output=True, check=False).returncode == 0

    def start_server(self) -> None:
        self.stop_server()
        port = int(self.env.get("RISKSERVE_PORT", "50051"))
        assert not port_open(port), f"something else listens on {port}"
        with (self.tmp / "server.log").open("ab") as log:
            self.server = subprocess.Popen(
                ["make", "serve"], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        server = self.server
        wait_until(lambda: port_open(port) or server.poll() is not None, timeout_s=120)
        assert server.poll() is None, (self.tmp / "server.log").read_text()

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            self.server.wait(timeout=60)
        self.server = None


@pytest.fixture()
def shell(tmp_path: Path) -> Iterator[Shell]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RISKSERVE_", "MAKE"))}
    env.pop("MFLAGS", None)
    env.update(
        RISKSERVE_PORT=str(free_port()),
        RISKSERVE_METRICS_PORT=str(free_port()),
        # What the server writes relative to its working directory goes to the test's folder.
        RISKSERVE_SHADOW_LOG_PREFIX=str(tmp_path / "shadow-logs"),
        RISKSERVE_TRACE_FILE="none",
        LOADTEST_TIME=LOADTEST_TIME,
        LOADTEST_REPORTS=str(tmp_path / "reports"),
    )
    user = Shell(env, tmp_path)
    try:
        yield user
    finally:
        user.stop_server()
        (REPO / "request.json").unlink(missing_ok=True)


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.filterwarnings("default:the load test refused:UserWarning")
def test_every_shell_command_of_the_page_runs_as_written(page: str, shell: Shell) -> None:
    lines = list(commands(page))
    assert lines
    for line in lines:
        shell.run(line)
    assert set(shell.ran) == set(lines) - set(SKIPPED)


def test_skipped_and_refused_lines_are_still_on_the_pages() -> None:
    written = {line for page in PAGES for line in commands(page)}
    assert set(SKIPPED) <= written and set(REFUSED) <= written
