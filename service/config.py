"""Settings: read once, in the composition root, from RISKSERVE_* variables and a config file.

Precedence, highest first: keyword arguments, environment variables, the JSON or TOML file named
by ``RISKSERVE_CONFIG_FILE``, the defaults below. The standard ``OTEL_*`` variables are left to
the OpenTelemetry SDK, which reads them itself.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

__all__ = ["Settings", "parse_cpu_list"]

_CONFIG_FILE_VAR = "RISKSERVE_CONFIG_FILE"


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Values from the JSON or TOML file named by RISKSERVE_CONFIG_FILE, if set."""

    def __init__(self, settings_cls: type[BaseSettings], path: str | None) -> None:
        super().__init__(settings_cls)
        self._path = path

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if not self._path:
            return {}
        path = Path(self._path)
        text = path.read_text()
        data: dict[str, Any] = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        return data


class Settings(BaseSettings):
    """Every knob of a riskserve process."""

    # Every float setting is a duration, a size or a share: `inf` passes a lower bound and then
    # overflows where it becomes a timeout, and NaN compares false with every limit.
    model_config = SettingsConfigDict(
        env_prefix="RISKSERVE_",
        extra="forbid",
        frozen=True,
        env_parse_none_str="none",
        allow_inf_nan=False,
    )

    host: str = Field("127.0.0.1", description="Address the gRPC server binds.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    models_dir: Path = Field(Path("models"), description="Root of models/<name>/<version>/.")
    default_model: str = Field("fraud-demo", description="Model used when a request names none.")
    budget_ms: float = Field(10.0, gt=0, description="Deadline for requests that carry none.")
    max_batch_size: int = Field(64, ge=1, description="Most rows in one engine batch; 1 = off.")
    max_queue_rows: int = Field(2048, ge=1, description="Rows waiting per model before shedding.")
    max_queue_delay_us: int = Field(
        0,
        ge=0,
        description="Extra wait for a fuller batch when the engine is idle, where the earliest "
        "queued deadline has room for it.",
    )
    engine_inline_max_us: int = Field(
        3000,
        ge=0,
        description="Batches expected to run at most this long run on the event loop instead of "
        "an engine thread while calls do not overlap (engines that cannot hang only); 0 = every "
        "batch on an engine thread.",
    )
    gather_us: int = Field(
        0,
        ge=0,
        description="How long a batch the event loop would start with one unary request waits "
        "for more, where recent waits found company (helps many closed-loop callers, costs "
        "open-loop traffic latency); 0 = never waits.",
    )
    engine_workers: int = Field(
        0, ge=0, description="Batches in flight per model; 0 = half the CPU cores (1 to 4)."
    )
    switch_interval_us: int = Field(
        0,
        ge=0,
        description="The interpreter's thread switch interval (sys.setswitchinterval): how long "
        "a thread that finished its engine run may wait for the busy event loop to let it "
        "report back; 0 = Python's default (5,000 µs).",
    )
    processes: int = Field(
        1,
        ge=1,
        description="Server processes: behind the front, each on Unix sockets of its own (its "
        "gRPC port, and a call lane for calls and streams); without it, sharing the port "
        "(SO_REUSEPORT; needs a fixed port). 'auto': one per CPU core.",
    )
    front: Literal["haproxy", "auto"] | None = Field(
        None,
        description="A front before the server processes: HAProxy binds host:port, holds each "
        "process to a few calls at a time, balances calls (not connections) over them and "
        "answers what waited past a quarter of the budget RESOURCE_EXHAUSTED itself; 'auto': "
        "HAProxy where it is installed; none: the processes bind the port themselves.",
    )
    front_metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="The front's Prometheus endpoint (HAProxy's: its refusals, queue and calls "
        "per process); 0 = none; unset: metrics_port + processes (none where metrics_port is "
        "none or 0).",
    )
    tensorrt: bool = Field(True, description="Load validated TensorRT plans where TensorRT runs.")
    onnx_variants: bool = Field(
        True, description="Offer validated FP16/INT8 ONNX variants; the fastest measured serves."
    )
    engine_threads: int = Field(1, ge=1, description="Intra-op threads of each ONNX Runtime run.")
    degrade_on_deadline: bool = Field(
        False, description="Answer late requests with the fallback decision instead of failing."
    )
    max_message_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Largest gRPC message.")
    shutdown_grace_s: float = Field(5.0, ge=0, description="Drain time after SIGTERM.")
    reflection: bool = Field(False, description="Serve gRPC server reflection.")
    allow_insecure: bool = Field(
        False, description="Permit plaintext gRPC on a non-loopback address."
    )
    tls_cert_file: Path | None = Field(None, description="PEM certificate chain for TLS.")
    tls_key_file: Path | None = Field(None, description="PEM private key for TLS.")
    tls_client_ca_file: Path | None = Field(None, description="CA bundle; set to require mTLS.")
    tls_ca_file: Path | None = Field(
        None,
        description="CA bundle the riskserve CLI verifies the server's certificate with "
        "(the CLI talks TLS when this or tls_cert_file is set); unset: the system's roots.",
    )
    tls_reload_interval_s: float = Field(
        1.0, ge=0, description="Least time between checks of the TLS files for a new mtime."
    )
    auth_token: str | None = Field(
        None, description="Bearer token callers must send; unset (and no file) disables."
    )
    auth_tokens_file: Path | None = Field(
        None, description="File of accepted bearer tokens, one a line; re-read when it changes."
    )
    auth_client_names: tuple[str, ...] = Field(
        (), description="mTLS client certificate names (CN or SAN) allowed; empty allows any."
    )
    max_concurrent_streams: int = Field(
        100, ge=1, description="Concurrent calls one client connection may have open."
    )
    max_stream_in_flight: int = Field(
        256, ge=1, description="Messages scored at once per stream; more get RESOURCE_EXHAUSTED."
    )
    max_requests_in_progress: int = Field(
        0,
        ge=0,
        description="Scoring calls one process admits at once, the rest RESOURCE_EXHAUSTED, "
        "and the front's limit for each worker; 0 = what it finishes within the budget (the "
        "front sizes each worker's limit from the calls it finishes, 8 at least).",
    )
    reload_interval_s: float = Field(
        0.0, ge=0, description="Scan models_dir for new versions this often; 0 disables polling."
    )
    pinned_versions: dict[str, str] = Field(
        default_factory=dict,
        description="Model -> version that answers requests naming none where no experiment "
        'names a champion (JSON: {"fraud-demo": "3"}); unset models serve their highest.',
    )
    reload_drain_s: float = Field(
        5.0, ge=0, description="Time the replaced version gets to finish its queue."
    )
    engine_timeout_ms: float = Field(
        1000.0,
        ge=0,
        description="An engine call slower than this takes the engine out of service; 0 = off.",
    )
    experiments_file: Path | None = Field(
        None, description="JSON champion/challenger config; re-read when it changes."
    )
    shadow_log_prefix: str = Field(
        "shadow-logs", description="Folder or s3:// URI under which experiment logs are written."
    )
    shadow_max_queued_jobs: int = Field(1024, ge=1, description="Shadow jobs queued before drops.")
    shadow_flush_interval_s: float = Field(
        0.2,
        gt=0,
        description="Buffered experiment records reach the open log file at least this often "
        "(what a kill -9 can lose).",
    )
    shadow_max_file_bytes: int = Field(
        128 * 2**20,
        gt=0,
        description="An experiment log file is closed and published at this size.",
    )
    shadow_max_file_age_s: float = Field(
        300.0,
        gt=0,
        description="An experiment log file is closed and published at this age: the delay "
        "before a report sees a record.",
    )
    shadow_min_sampled_share: float = Field(
        1 / 64,
        gt=0,
        le=1,
        description="Least share of entities the shadow worker samples down to while it is "
        "behind or the machine has no CPU to spare for it; 1 = never sample (copies beyond "
        "shadow_max_queued_jobs are dropped and counted instead).",
    )
    shadow_pass_interval_s: float = Field(
        0.1, ge=0, description="The shadow worker scores what has arrived at most this often."
    )
    shadow_cpus: str = Field(
        "",
        description="CPUs the shadow worker may use, as a Linux CPU list ('2-3,6'); give it "
        "cores the server does not use. Empty: the server's own.",
    )
    trace_slow_ms: float | None = Field(
        None, gt=0, description="Traces at least this slow are always kept (default: budget / 2)."
    )
    trace_sample_ratio: float = Field(
        0.01, ge=0, le=1, description="Share of the other traces kept."
    )
    trace_export_all: bool = Field(
        False, description="Export every span (the Collector does tail sampling)."
    )
    trace_file: Path | None = Field(
        Path("traces.jsonl"),
        description="JSON-lines file of kept traces when OTEL_TRACES_EXPORTER is unset, relative "
        "to the working directory; none: no file.",
    )
    trace_file_max_bytes: int = Field(
        16 * 1024 * 1024, ge=1, description="The trace file is rotated when it reaches this size."
    )
    trace_file_backup_count: int = Field(
        3,
        ge=1,
        description="Rotated trace files kept (traces.jsonl.1, ...); older ones are deleted.",
    )
    tracing: bool = Field(True, description="Trace RPCs and batches (tail-sampled export).")
    metrics_host: str = Field("127.0.0.1", description="Address the Prometheus endpoint binds.")
    metrics_port: int | None = Field(
        9464, ge=0, le=65535, description="Prometheus /metrics port; none disables."
    )
    stats_interval_s: float = Field(
        0.0, ge=0, description="Log live p50/p99 per stage this often; 0 disables."
    )
    explain_when: Literal["always", "adverse"] = Field(
        "adverse",
        description="When requests asking for reasons get them, unless they say: always, or "
        "only for REVIEW and DECLINE decisions.",
    )
    warmup_iterations: int = Field(
        3, ge=0, description="Timed runs per batch size at start, seeding the latency model."
    )

    @model_validator(mode="after")
    def _secure_binding(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        if self.tls_cert_file is None and not self.allow_insecure and not _is_loopback(self.host):
            raise ValueError(
                f"refusing plaintext gRPC on non-loopback host {self.host!r}: set "
                "RISKSERVE_TLS_CERT_FILE and RISKSERVE_TLS_KEY_FILE, "
                "or RISKSERVE_ALLOW_INSECURE=true"
            )
        return self

    @field_validator("shadow_cpus", mode="before")
    @classmethod
    def _cpu_list(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # `shadow_cpus = 3` in a TOML or JSON file
        if isinstance(value, str):
            parse_cpu_list(value)  # its ValueError names the bad part; pydantic, the field
            return value.strip()
        return value

    @field_validator("pinned_versions", mode="before")
    @classmethod
    def _version_numbers(cls, value: object) -> object:
        if isinstance(value, dict):  # `fraud-demo = 3` in a TOML or JSON file names version "3"
            return {
                k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v
                for k, v in value.items()
            }
        return value

    @field_validator("processes", mode="before")
    @classmethod
    def _processes_auto(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return len(os.sched_getaffinity(0)) or 1
        return value

    @model_validator(mode="after")
    def _durations_within_a_week(self) -> Settings:
        """A duration past a week is a mistake (a unit confused), and past what the clocks,
        waits and HAProxy's timers take it fails where it is used (OverflowError)."""
        for name, scale in _DURATION_SCALES.items():
            value = getattr(self, name)
            if value is not None and value / scale > _LONGEST_DURATION_S:
                raise ValueError(f"{name}: {value:g} is more than a week")
        return self

    @model_validator(mode="after")
    def _fixed_port_for_processes(self) -> Settings:
        if self.processes > 1 and self.port == 0:
            raise ValueError("processes > 1 share one port: set a fixed port, not 0")
        if self.front is not None and self.port == 0:
            raise ValueError("the front binds a fixed port: set one, not 0")
        if self.front is not None and self.auth_client_names:
            raise ValueError(
                "auth_client_names needs the server to see the client certificate, which the "
                "front terminates: unset it, or set front to none"
            )
        return self

    @property
    def front_metrics_port_resolved(self) -> int | None:
        """Where the front's metrics are served: the setting, else after the processes'."""
        if self.front_metrics_port is not None:
            return self.front_metrics_port or None
        if not self.metrics_port:  # none, or 0 (a free port each)
            return None
        return self.metrics_port + self.processes

    @property
    def trace_slow_threshold_ms(self) -> float:
        """Traces at least this slow are kept: `trace_slow_ms`, else half the budget."""
        return self.budget_ms / 2 if self.trace_slow_ms is None else self.trace_slow_ms

    @property
    def budget_s(self) -> float:
        return self.budget_ms / 1000.0

    @property
    def shadow_cpu_set(self) -> frozenset[int]:
        return parse_cpu_list(self.shadow_cpus)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        config_file = _ConfigFileSource(settings_cls, os.environ.get(_CONFIG_FILE_VAR))
        return (init_settings, env_settings, config_file)


# sched_setaffinity's CPU numbers are bounded by the kernel's CPU mask (CONFIG_NR_CPUS).
_MAX_CPU = 8191


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU numbers from a Linux CPU list such as ``"2-3,6"`` (the format of taskset -c and
    cpuset.cpus); an empty string is the empty set. Raises ValueError naming the bad part."""
    if not text.strip():
        return frozenset()
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        low, dash, high = part.partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU number or a range like 2-3") from None
        if not 0 <= first <= last <= _MAX_CPU:
            raise ValueError(f"{part!r} is not an ascending range of CPUs 0 to {_MAX_CPU}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


# Every duration setting, by its unit's share of a second (the name's suffix says the unit).
_DURATION_SCALES = {
    name: {"_s": 1, "_ms": 1e3, "_us": 1e6}[suffix]
    for name in Settings.model_fields
    for suffix in ("_us", "_ms", "_s")
    if name.endswith(suffix)
}
_LONGEST_DURATION_S = 7 * 24 * 3600


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True  # (an empty host is every interface, to gRPC and HAProxy alike)
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
