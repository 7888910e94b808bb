"""The load test's verdict line, from calls fired into a locust environment as GrpcClient fires
them. Run in a process of its own: importing locust patches the standard library with gevent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys, types
sys.path[:0] = ["loadtest"]
from locust import events
from locust.env import Environment
import grpc_user

class Caller(grpc_user.User):
    abstract = False

env = Environment(user_classes=[Caller], events=events, parsed_options=types.SimpleNamespace(
    deadline_ms=0.0, budget_ms=10.0, rps_per_user=10.0))
env.create_local_runner()
env.runner.target_user_count = 1
env.events.init.fire(environment=env, runner=env.runner, web_ui=None)
print(grpc_user.verdict(env))
for _ in range({calls}):
    env.events.request.fire(request_type="grpc", name="Score", response_time={ms},
                            response_length=0, response=None, context={{}}, exception=None)
print(grpc_user.verdict(env))
"""


def _verdicts(calls: int, ms: float) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(calls=calls, ms=ms)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def test_a_p99_just_over_the_budget_is_over_it_though_locust_rounds_it_down():
    before, after = _verdicts(1000, 10.4)
    assert before == "verdict: no call was made; the run ended before the first one was due"
    assert after.endswith("p99 10 ms, over the 10 ms budget (1,000 calls over it)"), after


def test_a_p99_within_the_budget_is_within_it():
    _, after = _verdicts(1000, 9.6)
    assert after.endswith("p99 10 ms, within the 10 ms budget (0 calls over it)"), after
