"""`python fake_server.py MODELS_DIR BASE_S`: a riskserve process whose engines are FakeEngines.

For tests that need the server off the test process's GIL (load, overload); settings come from
RISKSERVE_* variables as for `riskserve serve`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fakes import fake_factory

from service.config import Settings
from service.server import build_server


async def main(models_dir: Path, base_s: float) -> None:
    factory, _ = fake_factory(base_s=base_s)
    settings = Settings(models_dir=models_dir)
    running = await build_server(settings, factory)
    print(f"riskserve listening on 127.0.0.1:{running.port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await running.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(Path(sys.argv[1]), float(sys.argv[2])))
