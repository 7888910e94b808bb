"""The shadow worker process: ``python -m service.shadow.worker --fd N``.

Started by `ShadowRunner` at the lowest CPU priority (SCHED_IDLE where the kernel has it, and
nice 19), so it runs only on CPU the server leaves idle, under its own GIL. It reads jobs from
the socket `N`, scores whatever has arrived in one pass (`ChallengerScorer`), at most one pass
per pass interval, writes the challenger records under the experiment log prefix as its own
replica, and acknowledges each pass with counts. At end of input (the server closing, or
dying) it scores what is left, flushes its log and exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.shadow.channel import FrameDecoder, decode_job, frame
from service.shadow.job import ShadowJob
from service.shadow.log import ExperimentLog
from service.shadow.priority import lower_priority
from service.shadow.scorer import ChallengerScorer

__all__ = ["main", "serve"]

MAX_JOBS_PER_PASS = 1024
_RECV_BYTES = 1 << 20

_log = logging.getLogger("service.shadow.worker")


class _Reader:
    """Blocks for the first message of a pass, then takes what has already arrived."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._decoder = FrameDecoder()
        self.eof = False

    def read(self, limit: int) -> list[tuple[Any, ...]]:
        messages = self._decoder.messages(limit)
        while not messages and not self.eof:
            self._fill(block=True)
            messages = self._decoder.messages(limit)
        while len(messages) < limit and not self.eof and self._fill(block=False):
            messages += self._decoder.messages(limit - len(messages))
        return messages

    def _fill(self, *, block: bool) -> bool:
        try:
            data = self._sock.recv(_RECV_BYTES, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except ConnectionError:
            data = b""
        if not data:
            self.eof = True
            return False
        self._decoder.feed(data)
        return True


class _ThreadCpu:
    """The scoring thread's time on a CPU and waiting for one (``/proc/thread-self/schedstat``;
    zeros where the kernel has no such file), as differences since the last call."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        try:
            run, wait, _ = Path("/proc/thread-self/schedstat").read_text().split()
        except (OSError, ValueError):
            return 0, 0
        return int(run), int(wait)

    def since_last(self) -> tuple[int, int]:
        now = self._read()
        run, wait = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        return run, wait


def _take(
    messages: list[tuple[Any, ...]], scorer: ChallengerScorer
) -> tuple[list[ShadowJob], Counter[str], bool]:
    """A pass's jobs, its unreadable jobs by model, and whether a roll was asked for; the
    versions it announces are added to `scorer`."""
    jobs: list[ShadowJob] = []
    unreadable = Counter[str]()
    rolling = False
    for message in messages:
        if message[0] == "version":
            scorer.add_version(message[1], message[2], Path(message[3]))
        elif message[0] == "roll":
            rolling = True
        elif message[0] == "job":
            try:
                jobs.append(decode_job(message))
            except Exception:  # one bad job must not end the worker
                _log.exception("unreadable shadow job for %s", message[1])
                unreadable[message[1]] += 1
    return jobs, unreadable, rolling


def serve(sock: socket.socket) -> None:
    reader = _Reader(sock)
    first = reader.read(1)
    if not first or first[0][0] != "config":
        _log.error("shadow worker: no configuration received; exiting")
        return
    _, prefix, replica_id, flush_interval_s, pass_interval_s, rolling = first[0]
    log = ExperimentLog(
        prefix, replica_id=replica_id, flush_interval_s=flush_interval_s, **rolling
    ).start()
    scorer = ChallengerScorer(log)
    cpu = _ThreadCpu()
    acknowledging = True
    try:
        while messages := reader.read(MAX_JOBS_PER_PASS):
            started = time.monotonic()
            jobs, unreadable, rolling = _take(messages, scorer)
            outcome = scorer.score(jobs)
            if rolling:
                # Only now that the pass's jobs are scored and their records logged: the rolled
                # files hold every job sent before the roll (and the rest of this pass's).
                log.roll()
            outcome.failed.update(unreadable)
            if not outcome.completed and not outcome.failed:
                continue
            run_ns, wait_ns = cpu.since_last()
            ack = (
                "done",
                dict(outcome.completed),
                dict(outcome.failed),
                outcome.decision_flips,
                run_ns,
                wait_ns,
            )
            if acknowledging:
                try:
                    sock.sendall(frame(ack))
                except OSError:  # the server is gone: finish what arrived, log it, exit
                    acknowledging = False
            if not reader.eof:
                # Few wake-ups and merged batches: on a small machine every burst of the
                # worker's, even at idle priority, shows in the champion's tail latency.
                time.sleep(max(0.0, started + pass_interval_s - time.monotonic()))
    finally:
        scorer.close()
        log.close()


def main(argv: Sequence[str] | None = None) -> int:
    lower_priority()
    # A terminal's Ctrl-C or a signal to the server's process group must not cut the worker
    # short: it stops when its input ends, after logging everything it accepted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m service.shadow.worker")
    parser.add_argument("--fd", type=int, required=True, help="connected socket to the server")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s shadow-worker %(name)s: %(message)s"
    )
    with socket.socket(fileno=args.fd) as sock:
        sock.setblocking(True)
        serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
