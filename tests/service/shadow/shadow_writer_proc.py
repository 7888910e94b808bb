"""A replica that logs one record every few ms and prints each accepted id (run as a script),
with the count of records its log had written to the open file by then.

Usage: python shadow_writer_proc.py PREFIX FLUSH_INTERVAL_S
On SIGTERM it stops accepting, closes the log (the final flush) and prints "closed".
"""

from __future__ import annotations

import signal
import sys
import time

from service.shadow import ExperimentLog, ExperimentRecord


def main() -> None:
    prefix, interval_s = sys.argv[1], float(sys.argv[2])
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    log = ExperimentLog(prefix, replica_id="writer", flush_interval_s=interval_s).start()
    i = 0
    while not stopping:
        accepted = log.log(
            ExperimentRecord(
                request_id=str(i), entity_id=f"e{i}", experiment="exp", model="m",
                arm="champion", version="1", score=0.1, decision="APPROVE",
                engine="fake", latency_ms=1.0, mode="shadow", served=True,
            )
        )  # fmt: skip
        if accepted:
            print(f"{i} {log.written}", flush=True)
        i += 1
        time.sleep(0.002)  # a steady trickle, so that a kill finds records not yet flushed
    log.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
