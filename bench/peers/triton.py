"""Triton Inference Server (the nvidia-pytriton wheel's tritonserver) serving the ONNX model.

Writes a model repository whose ``config.pbtxt`` sets ``max_batch_size``, dynamic batching with
a configurable ``max_queue_delay_microseconds`` and a CPU instance group, and whose Python
backend ``model.py`` runs ONNX Runtime on each whole batch. Starts ``tritonserver`` on
127.0.0.1 with the library and PATH fixes that the wheel needs outside PyTriton.

    .venv/bin/python -m bench.peers.triton --grpc-port 8001 --max-queue-delay-us 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.model_io import REPO_ROOT, ModelIO, read_model_io, resolve_model_path
from bench.servers import ServerSpec, add_standalone_arguments, free_port, serve_alone

__all__ = ["TritonConfig", "triton_spec", "write_model_repository"]

PEERS_DIR = REPO_ROOT / "bench" / ".peers"
TRITON_VENV = PEERS_DIR / "triton-venv"
MODEL_FILE = Path(__file__).with_name("triton_model.py")


@dataclass(frozen=True)
class TritonConfig:
    """The knobs of the Triton model configuration that the benchmark varies."""

    model_name: str = "fraud-demo"
    max_batch_size: int = 64
    max_queue_delay_microseconds: int = 200
    instance_count: int = 1
    intra_op_num_threads: int = 1


def _config_pbtxt(config: TritonConfig, io: ModelIO) -> str:
    return f"""name: "{config.model_name}"
backend: "python"
max_batch_size: {config.max_batch_size}
input [
  {{ name: "{io.features_input}" data_type: TYPE_FP32 dims: [ {io.n_features} ] }},
  {{ name: "{io.history_input}" data_type: TYPE_FP32 dims: [ -1, {io.n_history_fields} ] }},
  {{ name: "{io.mask_input}" data_type: TYPE_FP32 dims: [ -1 ] }}
]
output [
  {{ name: "{io.output}" data_type: TYPE_FP32 dims: [ 1 ] }}
]
dynamic_batching {{
  max_queue_delay_microseconds: {config.max_queue_delay_microseconds}
}}
instance_group [ {{ count: {config.instance_count} kind: KIND_CPU }} ]
parameters {{
  key: "intra_op_num_threads"
  value: {{ string_value: "{config.intra_op_num_threads}" }}
}}
"""


def write_model_repository(root: Path, onnx_path: Path, config: TritonConfig) -> Path:
    """Writes ``root/<model>/config.pbtxt`` and ``root/<model>/1/{model.py,model.onnx}``."""
    model_dir = root / config.model_name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(_config_pbtxt(config, read_model_io(onnx_path)))
    shutil.copyfile(MODEL_FILE, version_dir / "model.py")
    shutil.copyfile(onnx_path, version_dir / "model.onnx")
    return root


def _wheel_paths() -> tuple[Path, Path, Path]:
    """(site-packages, tritonserver dist folder, bundled libs folder) of the Triton venv."""
    matches = sorted(TRITON_VENV.glob("lib/python3.*/site-packages"))
    if not matches or not (matches[0] / "pytriton" / "tritonserver").is_dir():
        raise FileNotFoundError(f"no pytriton in {TRITON_VENV}; run bench/peers/setup.sh first")
    site = matches[0]
    return site, site / "pytriton" / "tritonserver", site / "nvidia_pytriton.libs"


def _backend_directory(work_dir: Path, dist: Path, python_version: str) -> Path:
    """A backends folder holding the wheel's Python backend plus the stub for our Python."""
    backends = work_dir / "backends"
    python_backend = backends / "python"
    python_backend.mkdir(parents=True, exist_ok=True)
    stub = dist / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    files = [item for item in (dist / "backends" / "python").iterdir() if item.is_file()]
    for source, name in [*((f, f.name) for f in files), (stub, stub.name)]:
        # Copy then rename: a file still executing from an earlier run cannot be overwritten.
        staged = python_backend / f".{name}.new"
        shutil.copy2(source, staged)
        os.replace(staged, python_backend / name)
    return backends


def _venv_python_version_and_libdir() -> tuple[str, str]:
    import subprocess

    out = subprocess.run(
        [
            str(TRITON_VENV / "bin" / "python"),
            "-c",
            "import sys, sysconfig; "
            "print(f'{sys.version_info[0]}.{sys.version_info[1]}'); "
            "print(sysconfig.get_config_var('LIBDIR'))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return out[0], out[1]


def triton_spec(
    onnx_path: Path,
    work_dir: Path,
    config: TritonConfig,
    grpc_port: int,
    http_port: int | None = None,
    metrics_port: int | None = None,
) -> ServerSpec:
    """Prepares the repository and backend folder; returns how to launch tritonserver."""
    _, dist, libs = _wheel_paths()
    version, libdir = _venv_python_version_and_libdir()
    repo = write_model_repository(work_dir / "model_repository", onnx_path, config)
    backends = _backend_directory(work_dir, dist, version)
    http_port = http_port or free_port()
    metrics_port = metrics_port or free_port()
    # The stub must load the venv's own libpython (LIBDIR), and finds packages via PATH.
    ld_path = ":".join(p for p in (str(libs), libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    env = {
        "LD_LIBRARY_PATH": ld_path,
        "PATH": f"{TRITON_VENV / 'bin'}:{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(TRITON_VENV),
    }
    argv = (
        str(dist / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        f"--cache-directory={dist / 'caches'}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics_port}",
        "--log-verbose=0",
        "--exit-timeout-secs=5",
    )
    return ServerSpec(
        name="triton",
        argv=argv,
        grpc_port=grpc_port,
        model_name=config.model_name,
        env=env,
        cwd=work_dir,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_standalone_arguments(parser, grpc_port=8001, http_port=8000, metrics_port=8002)
    parser.add_argument("--max-queue-delay-us", type=int, default=200)
    parser.add_argument("--instances", type=int, default=1)
    args = parser.parse_args(argv)
    work_dir = PEERS_DIR / "work" / "triton"
    config = TritonConfig(
        max_batch_size=args.max_batch_size,
        max_queue_delay_microseconds=args.max_queue_delay_us,
        instance_count=args.instances,
        intra_op_num_threads=args.intra_op_threads,
    )
    spec = triton_spec(
        resolve_model_path(args.model),
        work_dir,
        config,
        args.grpc_port,
        args.http_port,
        args.metrics_port,
    )
    return serve_alone(spec, work_dir / "tritonserver.log", args.serve_s)


if __name__ == "__main__":
    sys.exit(main())
