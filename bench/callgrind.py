"""A riskserve server process under valgrind's callgrind: counting on and off, the totals.

Callgrind counts the instructions a process executes, a figure the machine's speed and the
other work on it change far less than time. The server starts with counting off
(`--instr-atstart=no`); a benchmark switches it on around the requests it wants counted and
reads the total callgrind writes for that span. Under valgrind a server runs over a hundred
times slower, so its start-up and shutdown get minutes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

from bench.servers import ServerSpec

_TOTALS = re.compile(r"^(?:totals|summary):\s+(\d+)", re.MULTILINE)
STOP_GRACE_S = 300.0  # callgrind writes its file as the process exits


def missing_tools() -> str | None:
    """What to install when valgrind is absent, or None."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install valgrind)"
    return None


def under_callgrind(spec: ServerSpec, out_file: Path) -> ServerSpec:
    """`spec` (a `riskserve serve ...` command) run under callgrind, writing to `out_file`."""
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.unlink(missing_ok=True)
    # The riskserve script is a Python entry point: run its module under valgrind directly.
    python = Path(spec.argv[0]).with_name("python")
    argv = (
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_file}",
        str(python),
        "-m",
        "service",
        *spec.argv[1:],
    )
    return replace(spec, argv=argv, startup_timeout_s=900.0)


def control(pid: int, option: str, value: str) -> None:
    """callgrind_control: switch counting on or off (`-i on|off`) or dump the counts (`-d name`)."""
    done = subprocess.run(
        ["callgrind_control", option, value, str(pid)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"callgrind_control {option} {value} {pid}: {done.stdout}{done.stderr}")


def total(out_file: Path) -> int:
    """The instruction total callgrind wrote in `out_file`."""
    found = _TOTALS.findall(out_file.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"no totals in {out_file}")
    return int(found[-1])
