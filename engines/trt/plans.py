"""Where TensorRT plans live and how a plan is matched to the model, TensorRT and GPU.

Plans sit in ``models/<name>/<version>/engines/``. A plan's key is the GPU's compute capability,
the TensorRT version, the precision and the sha256 of the ONNX file it was built from; its file
name carries the key and a JSON build record beside it repeats it with the plan's own hash. At
load time a plan whose record does not match the current key exactly is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from engines.base import EngineUnavailable

__all__ = ["BuildRecord", "PlanKey", "PlanRefused", "PlanStore", "sha256_file"]


class PlanRefused(EngineUnavailable):
    """No plan matches the current key: missing, stale, foreign, or damaged."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class PlanKey:
    precision: str
    compute_capability: str
    tensorrt_version: str
    onnx_sha256: str

    @property
    def stem(self) -> str:
        sm = self.compute_capability.replace(".", "")
        return f"{self.precision}.sm{sm}.trt{self.tensorrt_version}.{self.onnx_sha256[:16]}"

    def mismatch(self, other: PlanKey) -> tuple[str, str] | None:
        """(reason, message) for the first difference from `other`, None if equal."""
        checks = (
            ("precision", "precision", self.precision, other.precision),
            ("stale_onnx", "ONNX sha256", self.onnx_sha256, other.onnx_sha256),
            ("tensorrt_version", "TensorRT version", self.tensorrt_version, other.tensorrt_version),
            ("gpu", "GPU compute capability", self.compute_capability, other.compute_capability),
        )
        for reason, what, mine, theirs in checks:
            if mine != theirs:
                return reason, f"{what} {theirs} where {mine} is needed"
        return None


@dataclass(frozen=True, slots=True)
class BuildRecord:
    key: PlanKey
    onnx_file: str
    plan_sha256: str
    profiles: tuple[dict[str, list[int] | None], ...]
    workspace_bytes: int
    build_seconds: float
    flags: tuple[str, ...]
    built_at: str = ""

    def to_json(self) -> str:
        data = asdict(self)
        data["built_at"] = self.built_at or datetime.now(UTC).isoformat(timespec="seconds")
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> BuildRecord:
        data = json.loads(text)
        return cls(
            key=PlanKey(**data["key"]),
            onnx_file=data["onnx_file"],
            plan_sha256=data["plan_sha256"],
            profiles=tuple(data["profiles"]),
            workspace_bytes=int(data["workspace_bytes"]),
            build_seconds=float(data["build_seconds"]),
            flags=tuple(data["flags"]),
            built_at=data.get("built_at", ""),
        )


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class PlanStore:
    """The ``engines/`` folder of one model version."""

    def __init__(self, model_dir: Path) -> None:
        self.folder = Path(model_dir) / "engines"

    def plan_path(self, key: PlanKey) -> Path:
        return self.folder / f"{key.stem}.plan"

    def record_path(self, key: PlanKey) -> Path:
        return self.folder / f"{key.stem}.json"

    def inspector_path(self, key: PlanKey) -> Path:
        return self.folder / f"{key.stem}.layers.json"

    def save(self, record: BuildRecord, plan: bytes, inspector_json: str | None) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        key = record.key
        _atomic_write(self.plan_path(key), plan)
        if inspector_json is not None:
            _atomic_write(self.inspector_path(key), inspector_json.encode())
        # The record goes last: a plan without its record is never loaded.
        _atomic_write(self.record_path(key), record.to_json().encode())
        return self.plan_path(key)

    def records(self, precision: str | None = None) -> list[BuildRecord]:
        if not self.folder.is_dir():
            return []
        found = []
        for path in sorted(self.folder.glob("*.json")):
            if path.name.endswith(".layers.json"):
                continue
            try:
                record = BuildRecord.from_json(path.read_text())
            except (ValueError, KeyError, TypeError):
                continue
            if precision is None or record.key.precision == precision:
                found.append(record)
        return found

    def load(self, key: PlanKey) -> bytes:
        """The plan bytes for exactly `key`, else `PlanRefused` saying what does not match."""
        record_path = self.record_path(key)
        if not record_path.exists():
            others = self.records(key.precision)
            if not others:
                raise PlanRefused(
                    f"no {key.precision} TensorRT plan in {self.folder}; run build-engines",
                    "missing",
                )
            reason, message = key.mismatch(others[-1].key) or ("missing", "no exact match")
            raise PlanRefused(
                f"refusing the {key.precision} plan {others[-1].key.stem}: it was built for "
                f"{message}; rebuild it with build-engines",
                reason,
            )
        record = BuildRecord.from_json(record_path.read_text())
        diff = key.mismatch(record.key)
        if diff is not None:
            raise PlanRefused(f"refusing {record_path.name}: built for {diff[1]}", diff[0])
        plan_path = self.plan_path(key)
        if not plan_path.exists():
            raise PlanRefused(f"{plan_path.name} is missing beside its record", "missing")
        plan = plan_path.read_bytes()
        if hashlib.sha256(plan).hexdigest() != record.plan_sha256:
            raise PlanRefused(f"{plan_path.name} does not match its record's sha256", "corrupt")
        return plan
