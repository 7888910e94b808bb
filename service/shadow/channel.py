"""The messages between the server and its shadow worker process, and their framing.

Each message is a tuple, pickled and sent as one frame (a 4-byte little-endian length, then
the payload) over a private socket pair; both ends are this package, so pickle is safe here.
Arrays travel as raw bytes with dtype and shape: pickling numpy arrays themselves costs about
ten times more per job.

Server to worker::

    ("config", log_prefix, replica_id, flush_interval_s, pass_interval_s, log_rolling)  first
    ("version", model, version, model_dir)                  before the first job that needs it
    ("roll",)                                               publish the open log files now
    ("job", model, experiment, versions, champion_version, mode,
     request_ids, entity_ids, champion_scores, arrays, explain_top_k, explain_when)

Worker to server::

    ("done", {model: jobs completed}, {model: jobs failed}, decision_flips,
     ns its scoring thread ran, ns it waited to run)              since the last one
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import numpy as np

from service.shadow.job import ShadowJob

__all__ = ["FrameDecoder", "decode_job", "encode_job", "frame"]

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 256 * 1024 * 1024

Message = tuple[Any, ...]


def frame(message: Message) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def _array(array: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    return array.dtype.str, array.shape, array.tobytes()


def encode_job(job: ShadowJob) -> bytes:
    arrays = tuple((name, *_array(np.asarray(a))) for name, a in job.inputs.items())
    return frame(
        (
            "job",
            job.model,
            job.experiment,
            job.versions,
            job.champion_version,
            job.mode,
            job.request_ids,
            job.entity_ids,
            _array(np.asarray(job.champion_scores)),
            arrays,
            job.explain_top_k,
            job.explain_when,
        )
    )


def _restore(dtype: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


def decode_job(message: Message) -> ShadowJob:
    (_, model, experiment, versions, champion, mode, request_ids, entity_ids, scores, arrays,
     top_k, when) = message  # fmt: skip
    return ShadowJob(
        model=model,
        experiment=experiment,
        versions=versions,
        request_ids=request_ids,
        entity_ids=entity_ids,
        inputs={name: _restore(dtype, shape, data) for name, dtype, shape, data in arrays},
        champion_scores=_restore(*scores),
        champion_version=champion,
        mode=mode,
        explain_top_k=top_k,
        explain_when=when,
    )


class FrameDecoder:
    """Turns a byte stream back into messages, whatever the chunks it arrives in."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def messages(self, limit: int | None = None) -> list[Message]:
        """Complete messages buffered so far, at most `limit`; the rest stay for later."""
        out: list[Message] = []
        buffer = self._buffer
        while (limit is None or len(out) < limit) and len(buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"shadow frame of {size} bytes: the stream is corrupt")
            end = _HEADER.size + size
            if len(buffer) < end:
                break
            out.append(pickle.loads(buffer[_HEADER.size : end]))
            del buffer[:end]
        return out
