#!/usr/bin/env bash
# Creates the peer servers' virtual environments under bench/.peers/ (git-ignored):
#   triton-venv    nvidia-pytriton (bundles tritonserver 2.51 + Python backend), onnxruntime, numpy
#   mlserver-venv  mlserver 1.7.1 (uvloop<0.22), onnxruntime, numpy
#   perf-venv      tritonclient[grpc] 2.51.0, whose wheel carries the perf_analyzer binary
#   perf-libs/     libb64.so.0d and libcudart.so.12 linked from the pytriton wheel's libs
# Idempotent: an environment that already imports its packages is left alone.
# Override the interpreter with PYTHON=/path/to/python3.11.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
peers_dir="$repo_root/bench/.peers"
python_bin="${PYTHON:-python3.11}"
mkdir -p "$peers_dir"

say() { printf '[setup] %s\n' "$*"; }

# make_venv NAME CHECK_IMPORT PACKAGES...
make_venv() {
  local name="$1" check="$2"
  shift 2
  local venv="$peers_dir/$name"
  if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    say "$name: present ($venv), packages import; nothing to do"
    return
  fi
  if [[ ! -x "$venv/bin/python" ]]; then
    say "$name: creating with $("$python_bin" --version 2>&1)"
    "$python_bin" -m venv "$venv"
  fi
  say "$name: installing $*"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "$@"
  "$venv/bin/python" -c "$check"
  say "$name: ready"
}

make_venv triton-venv "import pytriton, onnxruntime, numpy" \
  "nvidia-pytriton==0.7.0" onnxruntime numpy
make_venv mlserver-venv "import mlserver, onnxruntime, numpy, uvloop" \
  "mlserver==1.7.1" "uvloop<0.22" onnxruntime numpy
make_venv perf-venv "import tritonclient.grpc" "tritonclient[grpc]==2.51.0"

# perf_analyzer needs libb64.so.0d and libcudart.so.12; the pytriton wheel bundles both
# under hashed names in nvidia_pytriton.libs.
site_packages="$("$peers_dir/triton-venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
wheel_libs="$site_packages/nvidia_pytriton.libs"
libs_dir="$peers_dir/perf-libs"
mkdir -p "$libs_dir"
link_lib() {
  local plain="$1" pattern="$2" found
  found="$(find "$wheel_libs" -maxdepth 1 -name "$pattern" | sort | head -n 1)"
  if [[ -z "$found" ]]; then
    say "ERROR: no $pattern in $wheel_libs" >&2
    exit 1
  fi
  ln -sfn "$found" "$libs_dir/$plain"
  say "perf-libs: $plain -> $(basename "$found")"
}
link_lib libb64.so.0d 'libb64*.so*'
link_lib libcudart.so.12 'libcudart*.so*'

perf_bin="$peers_dir/perf-venv/bin/perf_analyzer"
if [[ ! -x "$perf_bin" ]]; then
  say "ERROR: $perf_bin missing after installing tritonclient" >&2
  exit 1
fi
if LD_LIBRARY_PATH="$libs_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$perf_bin" --version >/dev/null 2>&1 \
  || LD_LIBRARY_PATH="$libs_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$perf_bin" --help >/dev/null 2>&1; then
  say "perf_analyzer: runs ($perf_bin)"
else
  say "WARNING: perf_analyzer did not start; check 'ldd $perf_bin' with LD_LIBRARY_PATH=$libs_dir" >&2
fi
say "done: peers in $peers_dir"
