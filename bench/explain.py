"""What reason codes cost: Score latency and server CPU with and without explanations.

Configurations, each on a fresh `riskserve serve` of the demo model, in turn:

- ``plain``: unexplained Score requests at ``--rate``;
- ``explained``: every request asks for 3 reasons (EXPLAIN_ALWAYS) under the demo manifest's
  14 codes (13 feature groups and the history): a block of 15 rows per request;
- ``explained-33``: the same with one code per feature (31) plus the history: 33 rows a request;
- ``explained-33-repeated``: ``explained-33`` with the manifest's ``history.broadcast`` off, so
  every occlusion row carries its own copy of the history (as for a model that cannot broadcast);
- ``adverse``: every request asks for 3 reasons with EXPLAIN_ADVERSE (the server's default mode):
  the row is scored alone, and only REVIEW and DECLINE decisions send the 15-row block;
- ``mixed``: unexplained requests at ``--rate`` and, at the same time, explained ones (15 rows)
  at ``--mix-rate``;
- ``mixed-plain``: the control for ``mixed``: the same two streams, the second unexplained too,
  so the unexplained requests' p99 beside explained ones is compared with their p99 beside as
  many unexplained ones (the same load in requests, without the explanations);
- ``plain-w2``, ``mixed-w2`` and ``explained-33-w2``: the same with two engine workers
  (RISKSERVE_ENGINE_WORKERS=2), so a single row can run beside a block instead of behind it;
- ``mixed-thread`` and ``mixed-plain-thread``: ``mixed`` and its control with every batch run on
  an engine thread (RISKSERVE_ENGINE_INLINE_MAX_US=0) instead of short ones on the event loop;
  ``-thread-si500`` the same with a 500 µs thread switch interval
  (RISKSERVE_SWITCH_INTERVAL_US=500), and ``explained-33-thread-si500`` ``explained-33`` so.

Load: open-loop Poisson arrivals from one client process on the same machine, latency from each
request's scheduled send time (a client that falls behind shows as latency). Requests carry a
1 s gRPC deadline, so nothing is shed and the whole latency distribution is seen. Histories are
cut to ``--max-history`` rows. Server CPU is the server process group's user + system time during
the timed load, divided by the requests sent in it.

    .venv/bin/python -m bench.explain --rate 200 --mix-rate 100 --duration-s 10 --repeats 2

`--instructions N` instead counts, with valgrind's callgrind, the instructions one `riskserve
serve` process executes per request over N sequential requests of each kind (plain, explained
with the demo's codes, explained with one code per feature with and without the history
broadcast, adverse mode), ONNX Runtime FP32 serving them all: server work in a figure that other
load on the machine does not change.

    .venv/bin/python -m bench.explain --instructions 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from bench import callgrind
from bench.score_load import ScoreStream, open_loop, score_requests
from bench.servers import ServerProcess, ServerSpec, free_port
from riskscoring.v1 import risk_scoring_pb2 as pb

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "fraud-demo" / "1"
WARMUP_REQUESTS = 100
TOP_K = 3


@dataclass(frozen=True)
class Config:
    per_feature: bool  # one code per feature (33 rows) instead of the demo's codes (15 rows)
    plain: bool  # unexplained requests at --rate
    explained: str  # "", or the explained requests' mode (at --rate, or --mix-rate beside plain)
    env: tuple[tuple[str, str], ...] = ()
    extra_plain: bool = False  # a second unexplained stream at --mix-rate (mixed's control)
    broadcast: bool = True  # the demo manifest's history.broadcast; False: histories repeated

    @property
    def mixed(self) -> bool:
        return self.plain and (bool(self.explained) or self.extra_plain)


_THREAD = (("RISKSERVE_ENGINE_INLINE_MAX_US", "0"),)
_THREAD_SI = (*_THREAD, ("RISKSERVE_SWITCH_INTERVAL_US", "500"))
CONFIGS = {
    "plain": Config(per_feature=False, plain=True, explained=""),
    "explained": Config(per_feature=False, plain=False, explained="always"),
    "explained-33": Config(per_feature=True, plain=False, explained="always"),
    "explained-33-repeated": Config(True, False, "always", broadcast=False),
    "adverse": Config(per_feature=False, plain=False, explained="adverse"),
    "mixed": Config(per_feature=False, plain=True, explained="always"),
    "mixed-plain": Config(per_feature=False, plain=True, explained="", extra_plain=True),
    "plain-w2": Config(False, True, "", (("RISKSERVE_ENGINE_WORKERS", "2"),)),
    "mixed-w2": Config(False, True, "always", (("RISKSERVE_ENGINE_WORKERS", "2"),)),
    "explained-33-w2": Config(True, False, "always", (("RISKSERVE_ENGINE_WORKERS", "2"),)),
    "mixed-thread": Config(False, True, "always", _THREAD),
    "mixed-plain-thread": Config(False, True, "", _THREAD, extra_plain=True),
    "mixed-thread-si500": Config(False, True, "always", _THREAD_SI),
    "mixed-plain-thread-si500": Config(False, True, "", _THREAD_SI, extra_plain=True),
    "explained-33-thread-si500": Config(True, False, "always", _THREAD_SI),
}
WHEN = {"always": pb.EXPLAIN_ALWAYS, "adverse": pb.EXPLAIN_ADVERSE}


def _models(root: Path, per_feature: bool, broadcast: bool = True) -> Path:
    target = root / "fraud-demo" / "1"
    shutil.copytree(DEMO, target)
    path = target / "manifest.json"
    manifest = json.loads(path.read_text())
    if per_feature:
        features = manifest["explanations"]["features"]
        for i, name in enumerate(manifest["features"]):
            features[name] |= {"code": f"F{i:02d}", "text": name}
    manifest["history"]["broadcast"] = broadcast
    path.write_text(json.dumps(manifest))
    return root


def _payloads(n: int, max_history: int, explained: str) -> list[bytes]:
    return score_requests(n, max_history, "e", (TOP_K, WHEN[explained]) if explained else None)


def _spec(name: str, models_dir: Path, env: dict[str, str]) -> ServerSpec:
    """`riskserve serve` of the models under `models_dir` on a free port, no metrics or traces."""
    port = free_port()
    return ServerSpec(
        name=name,
        argv=(str(REPO / ".venv" / "bin" / "riskserve"), "serve", "--port", str(port)),
        grpc_port=port,
        model_name="fraud-demo",
        env={
            "RISKSERVE_MODELS_DIR": str(models_dir),
            "RISKSERVE_METRICS_PORT": "none",
            "RISKSERVE_TRACE_FILE": "none",
            **env,
        },
        cwd=REPO,
    )


def _run(name: str, args: argparse.Namespace, tmp: Path, payloads: dict[str, list[bytes]]):
    config = CONFIGS[name]
    root = _models(tmp / name, config.per_feature, config.broadcast)
    spec = _spec(name, root, dict(config.env))
    streams: dict[str, ScoreStream] = {}
    if config.plain:
        streams["plain"] = ScoreStream.poisson(payloads[""], args.rate, args.duration_s, 11)
    if config.explained:
        rate = args.mix_rate if config.plain else args.rate
        explained = payloads[config.explained]
        streams["explained"] = ScoreStream.poisson(explained, rate, args.duration_s, 12)
    if config.extra_plain:
        streams["extra"] = ScoreStream.poisson(payloads[""], args.mix_rate, args.duration_s, 12)
    log = REPO / "bench" / "results" / f"explain_{spec.grpc_port}.log"
    with ServerProcess(spec, log) as server:
        before: list[float] = []
        asyncio.run(
            open_loop(
                server.target,
                list(streams.values()),
                lambda: before.append(server.cpu_seconds()),
                warmup=WARMUP_REQUESTS,
                settle_s=0.5,
                timeout_s=1.0,
            )
        )
        cpu_s = server.cpu_seconds() - before[0]
    sent = sum(len(s.offsets) for s in streams.values())
    rows = []
    for kind, stream in streams.items():
        ms = stream.latencies_ms()
        p50, p99 = np.percentile(ms, [50, 99]) if ms.size else (float("nan"),) * 2
        rows.append(
            dict(
                config=name, kind=kind, sent=len(stream.offsets), ok=int(ms.size),
                errors=stream.errors, p50=float(p50), p99=float(p99),
                server_p99=float(np.percentile(stream.server_us, 99) / 1e3)
                if stream.server_us else float("nan"),
                batch_rows=float(np.mean(stream.batch_rows)) if stream.batch_rows else 0.0,
                with_reasons=float(np.mean(np.array(stream.reasons) > 0))
                if stream.reasons else 0.0,
                cpu_ms_per_request=cpu_s * 1e3 / sent,
            )
        )  # fmt: skip
    return rows


KINDS = {  # kind -> (model, explain mode)
    "plain": ("fraud-demo", ""),
    "explained": ("fraud-demo", "always"),
    "explained-33": ("fraud-demo-each", "always"),
    "explained-33-repeated": ("fraud-demo-repeated", "always"),
    "adverse": ("fraud-demo", "adverse"),
}


def _named(payload: bytes, model: str) -> bytes:
    request = pb.ScoreRequest.FromString(payload)
    request.model = model
    return request.SerializeToString()


def count_instructions(requests: int, max_history: int, tmp: Path) -> int:
    """Callgrind's instruction count per request of each kind, in one server process."""
    root = _models(tmp / "counted", per_feature=False)
    for name, broadcast in (("fraud-demo-each", True), ("fraud-demo-repeated", False)):
        folder = _models(tmp / name, per_feature=True, broadcast=broadcast) / "fraud-demo"
        manifest = json.loads((folder / "1" / "manifest.json").read_text())
        (folder / "1" / "manifest.json").write_text(json.dumps(manifest | {"name": name}))
        shutil.move(folder, root / name)
    spec = _spec(
        "riskserve-callgrind",
        root,
        {
            "RISKSERVE_BUDGET_MS": "60000",
            "RISKSERVE_WARMUP_ITERATIONS": "1",
            # One engine (ONNX Runtime FP32) for every kind: with variants on, each model picks
            # the engine it timed fastest at load, and under callgrind that choice is noise.
            "RISKSERVE_ONNX_VARIANTS": "false",
        },
    )
    out_file = REPO / "bench" / "results" / "callgrind" / f"explain-{spec.grpc_port}.out"
    spec = callgrind.under_callgrind(spec, out_file)
    totals: dict[str, int] = {}
    explained: dict[str, int] = {}
    log = REPO / "bench" / "results" / f"explain_callgrind_{spec.grpc_port}.log"
    with ServerProcess(spec, log) as server, grpc.insecure_channel(server.target) as channel:
        score = channel.unary_unary(
            "/riskscoring.v1.RiskScoring/Score", response_deserializer=pb.ScoreResponse.FromString
        )
        for kind, (model, mode) in KINDS.items():
            payloads = [_named(p, model) for p in _payloads(requests, max_history, mode)]
            for payload in payloads[:5]:  # the first calls of a kind warm its paths
                score(payload, timeout=120)
            callgrind.control(server.pid, "-i", "on")
            explained[kind] = sum(bool(score(p, timeout=120).reasons) for p in payloads)
            callgrind.control(server.pid, "-i", "off")
            callgrind.control(server.pid, "-d", kind)
            dumps = sorted(out_file.parent.glob(f"{out_file.name}.*"), key=os.path.getmtime)
            totals[kind] = callgrind.total(dumps[-1])
        server.stop(grace_s=callgrind.STOP_GRACE_S)
    print(f"\ncallgrind, one server process, {requests} sequential Score requests of each kind, "
          f"history <= {max_history} rows, ONNX Runtime FP32")  # fmt: skip
    print("| kind | with reasons | M instructions / request | against plain |")
    print("| --- | --- | --- | --- |")
    for kind, total in totals.items():
        ratio = total / totals["plain"]
        print(
            f"| {kind} | {explained[kind]} of {requests} | {total / requests / 1e6:.2f} "
            f"| {ratio:.2f}x |"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.explain", description=__doc__)
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s of the main stream")
    parser.add_argument("--mix-rate", type=float, default=100.0, help="explained req/s in mixed")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-history", type=int, default=32)
    parser.add_argument("--only", action="append", choices=sorted(CONFIGS))
    parser.add_argument("--instructions", type=int, metavar="N", help="count, N requests a kind")
    args = parser.parse_args(argv)
    if args.instructions:
        missing = callgrind.missing_tools()
        if missing:
            print(missing, file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            return count_instructions(args.instructions, args.max_history, Path(tmp))
    payloads = {e: _payloads(500, args.max_history, e) for e in ("", *WHEN)}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in args.only or CONFIGS:
                for row in _run(name, args, Path(tmp) / str(repeat), payloads):
                    runs.append({**row, "repeat": repeat + 1})
                    print(json.dumps(runs[-1]), flush=True)
    print(
        f"\nScore on fraud-demo, history <= {args.max_history} rows, {args.duration_s:g} s a run, "
        f"open loop; explained = {TOP_K} reasons, EXPLAIN_ALWAYS (adverse: EXPLAIN_ADVERSE); "
        f"mixed = plain at {args.rate:g} + explained at {args.mix_rate:g} req/s "
        f"(mixed-plain: + plain at {args.mix_rate:g}, kind 'extra')"
    )
    runs_column = args.repeats > 1
    print(
        "| configuration |" + (" run |" if runs_column else "") + " requests | req/s | errors "
        "| p50 ms | p99 ms | server p99 ms | rows / batch | server CPU ms / request |"
    )
    print("|---|" + ("---:|" if runs_column else "") + "---|" + "---:|" * 7)
    for r in runs:
        mixed = CONFIGS[r["config"]].mixed
        rate = args.mix_rate if mixed and r["kind"] in ("explained", "extra") else args.rate
        cpu = f"{r['cpu_ms_per_request']:.2f}" + (" (both)" if mixed else "")
        run = f" {r['repeat']} |" if runs_column else ""
        print(
            f"| {r['config']} |{run} {r['kind']} | {rate:g} | {sum(r['errors'].values())} "
            f"| {r['p50']:.2f} | {r['p99']:.2f} | {r['server_p99']:.2f} | {r['batch_rows']:.1f} "
            f"| {cpu} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
