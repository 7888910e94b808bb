# syntax=docker/dockerfile:1
#
# riskserve images. Two final targets:
#
#   docker build -t riskserve:gpu .                  # default: NVIDIA's TensorRT container
#   docker build -t riskserve:cpu --target cpu .     # python slim, ONNX Runtime on CPU
#
# The GPU image takes TensorRT (libraries and Python bindings) and CUDA from NVIDIA's
# container; the `gpu` extra adds onnxruntime-gpu and cuda-python on top. Pick a TRT_TAG whose
# CUDA major matches onnxruntime-gpu's (CUDA 13 for the 1.31 wheels) and whose Python is the
# container's own. Run it with `--gpus all` (or the NVIDIA device plugin in Kubernetes).

ARG TRT_IMAGE=nvcr.io/nvidia/tensorrt
ARG TRT_TAG=26.08-py3
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- CPU build
FROM ${PYTHON_IMAGE} AS cpu-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/riskserve/venv
COPY . .
RUN /opt/riskserve/venv/bin/pip install --no-cache-dir ".[cpu]" \
    && mkdir -p /opt/riskserve/models \
    && if [ -d models ]; then cp -r models/. /opt/riskserve/models/; fi

# ---------------------------------------------------------------- GPU build
FROM ${TRT_IMAGE}:${TRT_TAG} AS gpu-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# --system-site-packages: the container's TensorRT bindings satisfy the `tensorrt` requirement,
# so pip keeps them instead of fetching the registry's placeholder package. --without-pip and
# the container's own pip (`--python`): Ubuntu's python may lack ensurepip.
RUN python3 -m venv --without-pip --system-site-packages /opt/riskserve/venv \
    && /opt/riskserve/venv/bin/python -c "import tensorrt; print('TensorRT', tensorrt.__version__)"
COPY . .
RUN python3 -m pip --python /opt/riskserve/venv/bin/python install --no-cache-dir ".[gpu]" \
    && mkdir -p /opt/riskserve/models \
    && if [ -d models ]; then cp -r models/. /opt/riskserve/models/; fi

# ---------------------------------------------------------------- CPU runtime
FROM ${PYTHON_IMAGE} AS cpu
LABEL org.opencontainers.image.title="riskserve (CPU)" \
      org.opencontainers.image.description="Risk scoring over gRPC, ONNX Runtime on CPU"
# HAProxy, the distribution's package, is the front: it turns away calls beyond capacity before
# a Python worker pays for them and balances calls over the workers (RISKSERVE_FRONT). The
# distribution's current package, not a pinned version: its security updates come with rebuilds.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 riskserve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin riskserve \
    && install -d -o 10001 -g 10001 /opt/riskserve/data
COPY --from=cpu-build /opt/riskserve/venv /opt/riskserve/venv
COPY --from=cpu-build --chown=10001:10001 /opt/riskserve/models /opt/riskserve/models
# Plaintext on all interfaces so the container is reachable; the server refuses this unless
# RISKSERVE_ALLOW_INSECURE is set. In production terminate TLS in the front (the RISKSERVE_TLS_*
# files) or a mesh sidecar, and drop RISKSERVE_ALLOW_INSECURE. The front runs
# RISKSERVE_PROCESSES workers behind it: set that to the cores the container is given.
ENV PATH=/opt/riskserve/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RISKSERVE_HOST=0.0.0.0 \
    RISKSERVE_FRONT=haproxy \
    RISKSERVE_ALLOW_INSECURE=true \
    RISKSERVE_PORT=50051 \
    RISKSERVE_METRICS_HOST=0.0.0.0 \
    RISKSERVE_METRICS_PORT=9464 \
    RISKSERVE_MODELS_DIR=/opt/riskserve/models
# The service user's files with relative defaults (the local trace file, shadow logs) go here.
WORKDIR /opt/riskserve/data
USER 10001:10001
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c = grpc.insecure_channel('127.0.0.1:' + os.environ.get('RISKSERVE_PORT', '50051')); r = g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=2); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["riskserve", "serve"]

# ---------------------------------------------------------------- GPU runtime (default)
FROM ${TRT_IMAGE}:${TRT_TAG} AS gpu
LABEL org.opencontainers.image.title="riskserve (GPU)" \
      org.opencontainers.image.description="Risk scoring over gRPC, TensorRT with ONNX Runtime fallback"
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 riskserve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin riskserve \
    && install -d -o 10001 -g 10001 /opt/riskserve/data
COPY --from=gpu-build /opt/riskserve/venv /opt/riskserve/venv
# Writable by the service user: TensorRT plans for this GPU are built into the model folder.
COPY --from=gpu-build --chown=10001:10001 /opt/riskserve/models /opt/riskserve/models
# Plaintext on all interfaces, as in the CPU image: TLS is expected in production.
ENV PATH=/opt/riskserve/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RISKSERVE_HOST=0.0.0.0 \
    RISKSERVE_FRONT=haproxy \
    RISKSERVE_ALLOW_INSECURE=true \
    RISKSERVE_PORT=50051 \
    RISKSERVE_METRICS_HOST=0.0.0.0 \
    RISKSERVE_METRICS_PORT=9464 \
    RISKSERVE_MODELS_DIR=/opt/riskserve/models
# The service user's files with relative defaults (the local trace file, shadow logs) go here.
WORKDIR /opt/riskserve/data
USER 10001:10001
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c = grpc.insecure_channel('127.0.0.1:' + os.environ.get('RISKSERVE_PORT', '50051')); r = g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=2); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["riskserve", "serve"]
