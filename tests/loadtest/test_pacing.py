"""The load-test user's open-loop pacing and how it times calls, checked in a fresh interpreter
(importing locust patches the standard library with gevent, which this process must not get)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import argparse
    import time

    import locust
    from locust.env import Environment

    import grpc_user
    from riskscoring.v1 import risk_scoring_pb2

    options = argparse.Namespace(rps_per_user=10.0, deadline_ms=0.0, model="", tls_ca="")
    env = Environment(events=locust.events, parsed_options=options)
    fired = []
    env.events.request.add_listener(lambda **kw: fired.append(kw))


    class User(grpc_user.GrpcUser):
        host = "127.0.0.1:1"  # the channel connects lazily; no call goes to it

        @locust.task
        def nothing(self):
            pass


    user = User(env)
    timeouts = []

    def answer(request, timeout=None):
        timeouts.append(timeout)
        return risk_scoring_pb2.ScoreResponse(score=0.5)

    # Each user's first task run is due at a random point of the first interval (0.1 s), so
    # users spawned at a steady pace do not send in step.
    first_waits = [User(env).wait_time() for _ in range(40)]
    assert all(0.0 <= w <= 0.1 for w in first_waits), first_waits
    assert max(first_waits) - min(first_waits) > 0.05, first_waits

    # The schedule is open loop: each task run is due one interval after the last was due,
    # however late the runs are.
    user.wait_time()
    first_due = user._due_s
    user._due_s = time.perf_counter() - 0.35  # the process was busy for 350 ms
    behind = user._due_s
    assert user.wait_time() == 0.0  # late: run at once
    assert user._due_s == behind + 0.1
    assert user.wait_time() == 0.0
    assert abs(user._due_s - (behind + 0.2)) < 1e-9

    # A call is timed from its task's due time, not from when it was sent.
    user.client.due_s = time.perf_counter() - 0.05
    user.client.call(answer, risk_scoring_pb2.ScoreRequest(), name="late")
    assert fired[-1]["response_time"] >= 50.0, fired[-1]["response_time"]
    assert user.client.due_s is None  # one call per due time
    # With no deadline set, a unary call still waits for a bounded time only.
    assert timeouts[-1] == grpc_user._LONGEST_WAIT_S, timeouts
    print("pacing ok", first_due > 0)
    """
)


def test_pacing_is_open_loop_and_calls_are_timed_from_their_due_time() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        cwd=REPO / "loadtest",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pacing ok True" in done.stdout
