"""A locust User for riskserve's gRPC APIs: the domain API and the Open Inference Protocol.

Every call goes through `GrpcClient.call`, which times it and fires locust's ``request`` event
(request_type ``grpc``). A call can name the status code it expects: a request built to be
invalid that comes back INVALID_ARGUMENT is a success, and one that comes back OK is a failure.

Pacing is open loop: each user's task runs are due at a fixed interval (1 / --rps-per-user),
at a phase of its own, whatever the calls take, and a call's latency counts from its task's due
time, so a run that starts late because its process was busy is charged with the wait (no
coordinated omission). The phases matter: users spawned at a steady pace would otherwise share
a few phases of the interval and send in bursts (docs/benchmarks.md, the load-test section).
"""

from __future__ import annotations

import logging
import queue
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, events
from locust.exception import StopUser
from locust.runners import WorkerRunner

from inference import grpc_service_pb2, grpc_service_pb2_grpc
from riskscoring.v1 import risk_scoring_pb2, risk_scoring_pb2_grpc

# locust has patched the standard library by now; gRPC's C core must cooperate with gevent
# before the first channel exists, or every call blocks the whole worker.
grpc_gevent.init_gevent()

__all__ = [
    "DEFAULT_HOST",
    "GrpcClient",
    "GrpcUser",
    "ModelSchema",
    "OipInput",
    "RpcStatusError",
    "ScoreStreamMux",
    "verdict",
]

DEFAULT_HOST = "127.0.0.1:50051"
_SCHEMA_TIMEOUT_S = 10.0
# How long a call waits for its answer when the run sets no deadline, so that none waits without
# end (the server's budget, far shorter, still applies).
_LONGEST_WAIT_S = 10.0
# gevent's timers fire up to about a millisecond late (its loop waits in whole milliseconds), so
# a user wakes this much before its task is due; a run that starts early is timed from its start.
_TIMER_SLACK_S = 0.001
_CONNECT_TIMEOUT_S = 10.0
_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

logger = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("riskserve gRPC")
    group.add_argument(
        "--rps-per-user",
        type=float,
        default=10.0,
        env_var="LOCUST_RPS_PER_USER",
        help="Task runs per second per user, on a fixed schedule; total rate = users x this.",
    )
    group.add_argument(
        "--deadline-ms",
        type=float,
        default=0.0,
        env_var="LOCUST_DEADLINE_MS",
        help="gRPC deadline per call in ms; 0 sends none, so the server's budget applies.",
    )
    group.add_argument(
        "--budget-ms",
        type=float,
        default=0.0,
        env_var="LOCUST_BUDGET_MS",
        help="The p99 the verdict line compares with; 0: the deadline, else 10 ms.",
    )
    group.add_argument(
        "--model",
        default="",
        env_var="LOCUST_MODEL",
        help="Model to score; empty selects the server's default model.",
    )
    group.add_argument(
        "--streaming",
        action="store_true",
        default=False,
        env_var="LOCUST_STREAMING",
        help="Send the Score tasks on one ScoreStream per process that all users share.",
    )
    group.add_argument(
        "--tls-ca",
        default="",
        env_var="LOCUST_TLS_CA",
        help="PEM file of root certificates: connect with TLS (a grpcs:// host uses system roots).",
    )


class RpcStatusError(Exception):
    """A call ended with a status code other than the one the task expected."""


@dataclass(frozen=True)
class OipInput:
    """One input tensor of the model as the OIP ModelMetadata call describes it."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelSchema:
    """What a client must know to build valid requests, read from the server at start."""

    model: str
    model_version: str
    feature_names: tuple[str, ...]
    history_fields: tuple[str, ...]
    max_history_length: int
    max_score_batch_requests: int
    nan_policy: str
    oip_inputs: tuple[OipInput, ...]

    @classmethod
    def fetch(cls, channel: grpc.Channel, model: str) -> ModelSchema:
        scoring = risk_scoring_pb2_grpc.RiskScoringStub(channel)
        info = scoring.GetModelInfo(
            risk_scoring_pb2.ModelInfoRequest(model=model), timeout=_SCHEMA_TIMEOUT_S
        )
        oip = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        meta = oip.ModelMetadata(
            grpc_service_pb2.ModelMetadataRequest(name=info.model), timeout=_SCHEMA_TIMEOUT_S
        )
        return cls(
            model=info.model,
            model_version=info.model_version,
            feature_names=tuple(info.feature_names),
            history_fields=tuple(info.history_fields),
            max_history_length=info.max_history_length,
            max_score_batch_requests=info.max_score_batch_requests,
            nan_policy=info.nan_policy,
            oip_inputs=tuple(
                OipInput(name=t.name, datatype=t.datatype, shape=tuple(t.shape))
                for t in meta.inputs
            ),
        )


_schema_lock = threading.Lock()  # a gevent lock once locust has patched threading
_schemas: dict[tuple[str, str], ModelSchema] = {}

# What served the requests, reported when the run ends: shows whether the fallback path ran.
served_by: Counter[str] = Counter()


@events.test_stop.add_listener
def _report_engines(**_kwargs: Any) -> None:
    if served_by:
        logger.info("responses by engine/fallback reason: %s", dict(served_by.most_common()))


def parse_target(host: str) -> tuple[str, bool]:
    """Split a locust --host into a gRPC target and whether it asks for TLS."""
    for scheme, tls in (("grpcs://", True), ("grpc://", False), ("dns:///", False)):
        if host.startswith(scheme):
            rest = host[len(scheme) :]
            return (f"dns:///{rest}" if scheme == "dns:///" else rest), tls
    return host, False


class StreamStatus(grpc.RpcError):
    """A streamed request's non-OK answer, read like a unary call's error."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class ScoreStreamMux:
    """One ScoreStream call that every user of the process shares, one waiter per request_id.

    `score` has a unary stub method's shape, so `GrpcClient.call` times it the same way. A
    stream that ends fails the requests waiting on it; the next `score` opens a new one.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._stub = risk_scoring_pb2_grpc.RiskScoringStub(channel)
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[threading.Event, list[Any]]] = {}
        self._outbox: queue.Queue[Any] | None = None
        self.answered = 0

    def score(
        self, request: risk_scoring_pb2.ScoreRequest, timeout: float | None = None
    ) -> risk_scoring_pb2.ScoreResponse:
        if timeout is not None:
            request.timeout_us = max(1, int(timeout * 1e6))
        answered = threading.Event()
        slot: list[Any] = []
        with self._lock:
            if self._outbox is None:
                self._open()
            assert self._outbox is not None
            self._waiting[request.request_id] = (answered, slot)
            self._outbox.put(request)
        if not answered.wait(_LONGEST_WAIT_S if timeout is None else timeout):
            with self._lock:
                self._waiting.pop(request.request_id, None)
            raise StreamStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within the deadline")
        reply = slot[0]
        if isinstance(reply, StreamStatus):
            raise reply
        if reply.status.code:
            raise StreamStatus(_CODES[reply.status.code], reply.status.message)
        return reply

    def close(self) -> None:
        with self._lock:
            if self._outbox is not None:
                self._outbox.put(None)  # half-close: the server answers what it holds
                self._outbox = None
        self._channel.close()

    def _open(self) -> None:
        outbox: queue.Queue[Any] = queue.Queue()
        self._outbox = outbox
        call = self._stub.ScoreStream(iter(outbox.get, None))
        threading.Thread(target=self._read, args=(call, outbox), daemon=True).start()

    def _read(self, call: Any, outbox: queue.Queue[Any]) -> None:
        ended = StreamStatus(grpc.StatusCode.UNAVAILABLE, "the stream ended")
        try:
            for reply in call:
                with self._lock:
                    self.answered += 1
                    waiter = self._waiting.pop(reply.request_id, None)
                if waiter is not None:
                    waiter[1].append(reply)
                    waiter[0].set()
        except grpc.RpcError as exc:
            ended = StreamStatus(exc.code(), exc.details() or "")
        with self._lock:
            if self._outbox is outbox:
                self._outbox = None
            waiting, self._waiting = self._waiting, {}
        for answered, slot in waiting.values():
            slot.append(ended)
            answered.set()


_streams: dict[str, ScoreStreamMux] = {}


@events.test_stop.add_listener
def _close_streams(**_kwargs: Any) -> None:
    for host, mux in _streams.items():
        logger.info("the shared ScoreStream to %s carried %d answers", host, mux.answered)
        mux.close()
    _streams.clear()


# The status a failed call ended with, from its message ("expected OK, got CODE: ...").
_GOT_CODE = re.compile(r"got ([A-Z_]+)")
_REFUSED = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")
_DEFAULT_BUDGET_MS = 10.0


# Calls that took longer than the budget, counted exactly: locust keeps response times rounded
# (to whole milliseconds below 100 ms, to tens below a second), so its p99 of a 10.4 ms run reads
# 10. A worker process sends its count to the master with its stats, and starts again from 0.
_over_budget = [0]


def _budget_ms(options: Any) -> float:
    """The budget the verdict holds the p99 to: --budget-ms, else --deadline-ms, else 10 ms."""
    deadline_ms = float(getattr(options, "deadline_ms", 0.0) or 0.0)
    budget_ms = float(getattr(options, "budget_ms", 0.0) or 0.0) or deadline_ms
    return budget_ms or _DEFAULT_BUDGET_MS


@events.init.add_listener
def _count_calls_over_budget(environment: Any, **_kwargs: Any) -> None:
    def counted(response_time: float, **_request: Any) -> None:
        if response_time > budget_ms:
            _over_budget[0] += 1

    budget_ms = _budget_ms(environment.parsed_options)
    environment.events.request.add_listener(counted)


@events.report_to_master.add_listener
def _send_calls_over_budget(data: dict[str, Any], **_kwargs: Any) -> None:
    data["over_budget"], _over_budget[0] = _over_budget[0], 0


@events.worker_report.add_listener
def _add_calls_over_budget(data: dict[str, Any], **_kwargs: Any) -> None:
    _over_budget[0] += int(data.get("over_budget", 0))


@events.quitting.add_listener
def _report_verdict(environment: Any, **_kwargs: Any) -> None:
    """One line for the run: answers a second against the rate offered, calls refused and
    past their deadline, and the p99 against the budget. Made from locust's own totals, so the
    master of several processes says it once for all of them, at its quitting: its test stops
    before its workers have sent their last counts."""
    if isinstance(environment.runner, WorkerRunner):
        return
    logger.info(verdict(environment))


def verdict(environment: Any) -> str:
    stats = environment.stats
    total = stats.total
    if total.last_request_timestamp is None:  # the run ended before its first call was due
        return "verdict: no call was made; the run ended before the first one was due"
    elapsed_s = max(total.last_request_timestamp - total.start_time, 1e-9)
    codes: Counter[str] = Counter()
    for error in stats.errors.values():
        found = _GOT_CODE.search(str(error.error))
        codes[found.group(1) if found else "bad response"] += error.occurrences
    options = environment.parsed_options
    budget_ms = _budget_ms(options)
    users = int(getattr(environment.runner, "target_user_count", 0) or 0)
    offered = users * float(getattr(options, "rps_per_user", 0.0) or 0.0)
    answered = total.num_requests - total.num_failures
    refused = sum(codes[c] for c in _REFUSED)
    late = codes["DEADLINE_EXCEEDED"]
    other = total.num_failures - refused - late
    p99_ms = total.get_response_time_percentile(0.99) if total.num_requests else 0.0
    # The p99 is within the budget where at most 1 % of the calls took longer than it.
    over = _over_budget[0]
    within = over <= 0.01 * total.num_requests
    refusals = ", ".join(f"{c} {codes[c]:,}" for c in _REFUSED if codes[c])
    return (
        f"verdict: {answered / elapsed_s:,.0f} answers/s of {offered:,.0f} req/s offered; "
        f"refused {refused:,}{f' ({refusals})' if refusals else ''}, "
        f"deadline exceeded {late:,}, other failures {other:,}; "
        f"p99 {p99_ms:g} ms, {'within' if within else 'over'} the {budget_ms:g} ms budget "
        f"({over:,} calls over it)"
    )


class GrpcClient:
    """Times unary calls and reports each to locust as one request."""

    def __init__(self, environment: Any, channel: grpc.Channel, deadline_s: float | None) -> None:
        self._events = environment.events
        self._deadline_s = deadline_s
        # When the next call was due (time.perf_counter()); its latency counts from then.
        self.due_s: float | None = None
        self.scoring = risk_scoring_pb2_grpc.RiskScoringStub(channel)
        self.inference = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def call(
        self,
        method: Callable[..., Any],
        request: Any,
        *,
        name: str,
        expect: grpc.StatusCode = grpc.StatusCode.OK,
        check: Callable[[Any], str | None] | None = None,
    ) -> Any:
        """Call one stub method; a wrong status code or a failed `check` is a failure."""
        response = None
        code = grpc.StatusCode.OK
        details = ""
        start_s = time.perf_counter()
        if self.due_s is not None:
            start_s, self.due_s = min(start_s, self.due_s), None
        wait_s = self._deadline_s
        if wait_s is None and not isinstance(getattr(method, "__self__", None), ScoreStreamMux):
            wait_s = _LONGEST_WAIT_S
        try:
            response = method(request, timeout=wait_s)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        elapsed_ms = (time.perf_counter() - start_s) * 1000.0

        failure: Exception | None = None
        if code != expect:
            # Short, stable text: locust groups failures by their message.
            failure = RpcStatusError(f"expected {expect.name}, got {code.name}: {details[:160]}")
        elif response is not None and check is not None:
            problem = check(response)
            if problem:
                failure = RpcStatusError(f"bad response: {problem}")
        self._events.request.fire(
            request_type="grpc",
            name=name,
            response_time=elapsed_ms,
            response_length=response.ByteSize() if response is not None else 0,
            response=response,
            context={"code": code.name},
            exception=failure,
        )
        return response


class GrpcUser(User):
    """Base user: one channel (one HTTP/2 connection) per simulated client."""

    abstract = True
    host = DEFAULT_HOST

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        options = environment.parsed_options
        self.rps_per_user = float(getattr(options, "rps_per_user", 10.0))
        deadline_ms = float(getattr(options, "deadline_ms", 0.0))
        self.model_name = str(getattr(options, "model", ""))
        target, tls = parse_target(self.host or DEFAULT_HOST)
        self.channel = self._open_channel(target, tls, str(getattr(options, "tls_ca", "")))
        self.client = GrpcClient(environment, self.channel, deadline_ms / 1000.0 or None)
        self._due_s: float | None = None

    @staticmethod
    def _open_channel(target: str, tls: bool, ca_path: str) -> grpc.Channel:
        options = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.lb_policy_name", "round_robin"),
            # A connection of its own: gRPC otherwise shares one among every channel of the
            # process with the same target and options, so all users would send on one
            # connection, and every call would reach one process of a server that runs one
            # per core (SO_REUSEPORT spreads connections, not calls).
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if tls or ca_path:
            roots = None
            if ca_path:
                with open(ca_path, "rb") as handle:
                    roots = handle.read()
            creds = grpc.ssl_channel_credentials(root_certificates=roots)
            return grpc.secure_channel(target, creds, options=options)
        return grpc.insecure_channel(target, options=options)

    def wait_time(self) -> float:
        """Open loop at --rps-per-user: the next task run is due one interval after the last
        one was due, however long that took (the first at a random point of the first
        interval); a late run starts at once, and its call's latency counts from the due
        time."""
        now_s = time.perf_counter()
        interval_s = 1.0 / self.rps_per_user
        if self._due_s is None:
            # A random phase: users spawned at a steady pace would otherwise share a few phases
            # of the interval and send their tasks in bursts.
            self._due_s = now_s + random.uniform(0.0, interval_s)
        else:
            self._due_s += interval_s
        self.client.due_s = self._due_s
        return max(0.0, self._due_s - now_s - _TIMER_SLACK_S)

    def schema(self) -> ModelSchema:
        """The model's schema, fetched once per process and shared by all users."""
        key = (self.host or DEFAULT_HOST, self.model_name)
        with _schema_lock:
            if key not in _schemas:
                try:
                    _schemas[key] = ModelSchema.fetch(self.channel, self.model_name)
                except grpc.RpcError as exc:
                    # Counted as a failed request, so the run cannot pass without a schema.
                    self.environment.events.request.fire(
                        request_type="grpc",
                        name="GetModelInfo",
                        response_time=0.0,
                        response_length=0,
                        response=None,
                        context={"code": exc.code().name},
                        exception=RpcStatusError(f"schema: {exc.code().name}"),
                    )
                    raise StopUser() from exc
            return _schemas[key]

    def score_method(self) -> Callable[..., Any]:
        """Score as a unary call, or on the process's shared stream with --streaming."""
        if not getattr(self.environment.parsed_options, "streaming", False):
            return self.client.scoring.Score
        key = self.host or DEFAULT_HOST
        with _schema_lock:
            if key not in _streams:
                target, tls = parse_target(key)
                ca = str(getattr(self.environment.parsed_options, "tls_ca", ""))
                _streams[key] = ScoreStreamMux(self._open_channel(target, tls, ca))
            return _streams[key].score

    def on_start(self) -> None:
        """Connect before the first task: a decision system calls on connections it already
        holds, so setting one up is not what the load test times. A user that cannot connect
        counts one failure and stops."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=_CONNECT_TIMEOUT_S)
        except grpc.FutureTimeoutError as exc:
            self.environment.events.request.fire(
                request_type="grpc",
                name="connect",
                response_time=_CONNECT_TIMEOUT_S * 1000.0,
                response_length=0,
                response=None,
                context={"code": "UNAVAILABLE"},
                exception=RpcStatusError(f"no connection within {_CONNECT_TIMEOUT_S:g} s"),
            )
            raise StopUser() from exc

    def on_stop(self) -> None:
        self.channel.close()
