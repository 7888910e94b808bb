"""riskserve traffic mix for locust.

    locust -f loadtest/locustfile.py --headless -u 20 -r 20 --run-time 60s \
        --host 127.0.0.1:50051 --rps-per-user 10

Each user paces itself to --rps-per-user task runs a second, so a run offers a fixed rate
(users x rps-per-user) whatever the latency. Per 100 task runs, about:

    60  Score with 4..64 history rows                 -> "Score"
    15  ScoreBatch of 2..8 requests                   -> "ScoreBatch"
     8  Score with 65..200 rows (the fallback path)   -> "Score (long history)"
    15  OIP ModelInfer of one row                     -> "ModelInfer"
     2  invalid Score (unknown feature or NaN)        -> "Score (invalid)", INVALID_ARGUMENT
                                                         is the expected, successful answer

With --streaming the three Score tasks go on one ScoreStream per locust process, shared by its
users (each message answered with its own status); ScoreBatch and ModelInfer stay unary.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import numpy as np
from grpc_user import GrpcUser, ModelSchema, OipInput, served_by
from locust import task
from traffic import TrafficSource

from inference import grpc_service_pb2
from riskscoring.v1 import risk_scoring_pb2

SHORT_HISTORY_ROWS = (4, 64)
LONG_HISTORY_ROWS = (65, 200)
BATCH_SIZES = (2, 8)
UNKNOWN_FEATURE = "not_a_feature_of_this_model"

_OIP_DTYPES = {
    "FP32": np.float32,
    "FP16": np.float16,
    "FP64": np.float64,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
}
_sources: dict[str, TrafficSource] = {}


def _check_score(response: risk_scoring_pb2.ScoreResponse) -> str | None:
    if not 0.0 <= response.score <= 1.0:
        return "score outside [0, 1]"
    if response.decision == risk_scoring_pb2.DECISION_UNSPECIFIED:
        return "decision unspecified"
    reason = f" ({response.fallback_reason})" if response.fallback_reason else ""
    served_by[response.engine + reason] += 1
    return None


def _check_batch(want: int) -> Any:
    def check(response: risk_scoring_pb2.ScoreBatchResponse) -> str | None:
        if len(response.responses) != want:
            return "response count differs from request count"
        for item in response.responses:
            problem = _check_score(item)
            if problem:
                return problem
        return None

    return check


def _check_infer(response: grpc_service_pb2.ModelInferResponse) -> str | None:
    return None if response.outputs else "no outputs"


class RiskScoringUser(GrpcUser):
    """A decision system calling riskserve: mostly single scores, some batches, some OIP."""

    def on_start(self) -> None:
        super().on_start()
        self.model_schema: ModelSchema = self.schema()
        schema = self.model_schema
        key = f"{schema.model}/{schema.model_version}"
        if key not in _sources:
            _sources[key] = TrafficSource.for_schema(schema.feature_names, schema.history_fields)
        self.source = _sources[key]
        limit = schema.max_history_length or LONG_HISTORY_ROWS[1]
        self.short_rows = (min(SHORT_HISTORY_ROWS[0], limit), min(SHORT_HISTORY_ROWS[1], limit))
        self.long_rows = (min(LONG_HISTORY_ROWS[0], limit), min(LONG_HISTORY_ROWS[1], limit))
        most = schema.max_score_batch_requests or BATCH_SIZES[1]
        self.batch_sizes = (min(BATCH_SIZES[0], most), min(BATCH_SIZES[1], most))
        self.score_call = self.score_method()
        # The first task is due at a random point of the first interval, as every later one
        # is paced: users that waited here together for the schema would otherwise all send
        # their first call at once.
        self.wait()

    def _request(self, n_rows: int) -> risk_scoring_pb2.ScoreRequest:
        request = risk_scoring_pb2.ScoreRequest(
            request_id=uuid.uuid4().hex,
            entity_id=self.source.entity_id(),
            model=self.model_name,
            features=self.source.features(),
        )
        if self.model_schema.history_fields:
            for row in self.source.history(n_rows):
                request.history.add(values=row.tolist())
        return request

    @task(60)
    def score(self) -> None:
        request = self._request(self.source.integers(*self.short_rows))
        self.client.call(self.score_call, request, name="Score", check=_check_score)

    @task(15)
    def score_batch(self) -> None:
        size = self.source.integers(*self.batch_sizes)
        batch = risk_scoring_pb2.ScoreBatchRequest(model=self.model_name)
        for _ in range(size):
            batch.requests.append(self._request(self.source.integers(*self.short_rows)))
        self.client.call(
            self.client.scoring.ScoreBatch, batch, name="ScoreBatch", check=_check_batch(size)
        )

    @task(8)
    def score_long_history(self) -> None:
        request = self._request(self.source.integers(*self.long_rows))
        self.client.call(self.score_call, request, name="Score (long history)", check=_check_score)

    @task(15)
    def model_infer(self) -> None:
        request = _infer_request(
            self.model_schema, self.source, self.source.integers(*self.short_rows)
        )
        self.client.call(
            self.client.inference.ModelInfer, request, name="ModelInfer", check=_check_infer
        )

    @task(2)
    def score_invalid(self) -> None:
        request = self._request(self.source.integers(*self.short_rows))
        nan_rejected = self.model_schema.nan_policy in ("", "reject")
        if nan_rejected and self.source.random() < 0.5:
            name = self.model_schema.feature_names[0]
            request.features[name] = float("nan")
        else:
            request.features[UNKNOWN_FEATURE] = 1.0
        self.client.call(
            self.score_call,
            request,
            name="Score (invalid)",
            expect=grpc.StatusCode.INVALID_ARGUMENT,
        )


def _infer_request(
    schema: ModelSchema, source: TrafficSource, n_rows: int
) -> grpc_service_pb2.ModelInferRequest:
    """One row in the model's own tensor layout, as raw little-endian bytes per input."""
    request = grpc_service_pb2.ModelInferRequest(model_name=schema.model, id=uuid.uuid4().hex)
    for spec in schema.oip_inputs:
        array = _tensor_for(spec, schema, source, n_rows)
        tensor = request.inputs.add(name=spec.name, datatype=spec.datatype)
        tensor.shape.extend(array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


def _tensor_for(
    spec: OipInput, schema: ModelSchema, source: TrafficSource, n_rows: int
) -> np.ndarray:
    dtype = np.dtype(_OIP_DTYPES.get(spec.datatype, np.float32)).newbyteorder("<")
    rank = len(spec.shape)
    width = spec.shape[-1] if spec.shape else 0
    if rank == 2 and width in (len(schema.feature_names), -1) and "mask" not in spec.name:
        array: np.ndarray = source.feature_vector()[None, :]
    elif rank == 3:
        array = source.history(n_rows)[None, :, :]
    elif rank == 2:
        array = np.ones((1, n_rows))  # a validity mask over the history rows
    else:
        array = np.zeros([1 if d < 0 else d for d in spec.shape])
    return np.ascontiguousarray(array, dtype=dtype)
