"""TensorRT backend: plan building, plan storage and the `TensorRTEngine`.

Nothing here imports `tensorrt` or `cuda` at import time; each entry point does so when called
and raises `EngineUnavailable` where they are missing.
"""

from engines.trt.build import BuiltPlan, PlanBuildError, build_plan, precision_flags
from engines.trt.engine import TensorRTEngine
from engines.trt.loader import build_engines, current_key, load_engines
from engines.trt.logger import make_logger
from engines.trt.plans import BuildRecord, PlanKey, PlanRefused, PlanStore

__all__ = [
    "BuildRecord",
    "BuiltPlan",
    "PlanBuildError",
    "PlanKey",
    "PlanRefused",
    "PlanStore",
    "TensorRTEngine",
    "build_engines",
    "build_plan",
    "current_key",
    "load_engines",
    "make_logger",
    "precision_flags",
]
