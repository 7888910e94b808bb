"""MLServer 1.7.1 serving the ONNX model through the custom runtime in this folder.

Renders ``settings.json`` and ``model-settings.json`` from this folder into a work directory
with the ports and batching knobs given, copies the runtime and the ONNX file beside them, and
runs ``mlserver start`` from the MLServer virtual environment on 127.0.0.1.

    .venv/bin/python -m bench.peers.mlserver.launch --grpc-port 8081 --max-batch-time-s 0.0005
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.model_io import REPO_ROOT, resolve_model_path
from bench.servers import ServerSpec, add_standalone_arguments, free_port, serve_alone

__all__ = ["MLServerConfig", "mlserver_spec"]

HERE = Path(__file__).resolve().parent
MLSERVER_VENV = REPO_ROOT / "bench" / ".peers" / "mlserver-venv"


@dataclass(frozen=True)
class MLServerConfig:
    """MLServer's adaptive batching knobs and the runtime's thread count."""

    model_name: str = "fraud-demo"
    max_batch_size: int = 64
    max_batch_time_s: float = 0.0005
    intra_op_num_threads: int = 1


def mlserver_spec(
    onnx_path: Path,
    work_dir: Path,
    config: MLServerConfig,
    grpc_port: int,
    http_port: int | None = None,
    metrics_port: int | None = None,
) -> ServerSpec:
    """Writes the server and model folders under `work_dir`; returns how to launch MLServer."""
    executable = MLSERVER_VENV / "bin" / "mlserver"
    if not executable.exists():
        raise FileNotFoundError(f"no {executable}; run bench/peers/setup.sh first")
    if work_dir.exists():
        shutil.rmtree(work_dir)
    model_dir = work_dir / config.model_name
    model_dir.mkdir(parents=True)

    settings = json.loads((HERE / "settings.json").read_text())
    settings.update(
        grpc_port=grpc_port,
        http_port=http_port or free_port(),
        metrics_port=metrics_port or free_port(),
    )
    (work_dir / "settings.json").write_text(json.dumps(settings, indent=2))

    model_settings = json.loads((HERE / "model-settings.json").read_text())
    model_settings.update(
        name=config.model_name,
        max_batch_size=config.max_batch_size,
        max_batch_time=config.max_batch_time_s,
    )
    model_settings["parameters"]["extra"]["intra_op_num_threads"] = config.intra_op_num_threads
    (model_dir / "model-settings.json").write_text(json.dumps(model_settings, indent=2))
    shutil.copyfile(HERE / "onnx_runtime.py", model_dir / "onnx_runtime.py")
    shutil.copyfile(onnx_path, model_dir / "model.onnx")

    return ServerSpec(
        name="mlserver",
        argv=(str(executable), "start", str(work_dir)),
        grpc_port=grpc_port,
        model_name=config.model_name,
        env={"PATH": f"{MLSERVER_VENV / 'bin'}:" + os.environ.get("PATH", "")},
        cwd=work_dir,
        supports_model_config=False,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_standalone_arguments(parser, grpc_port=8081, http_port=8080, metrics_port=8082)
    parser.add_argument("--max-batch-time-s", type=float, default=0.0005)
    args = parser.parse_args(argv)
    work_dir = REPO_ROOT / "bench" / ".peers" / "work" / "mlserver"
    config = MLServerConfig(
        max_batch_size=args.max_batch_size,
        max_batch_time_s=args.max_batch_time_s,
        intra_op_num_threads=args.intra_op_threads,
    )
    spec = mlserver_spec(
        resolve_model_path(args.model),
        work_dir,
        config,
        args.grpc_port,
        args.http_port,
        args.metrics_port,
    )
    return serve_alone(spec, work_dir.parent / "mlserver.log", args.serve_s)


if __name__ == "__main__":
    sys.exit(main())
