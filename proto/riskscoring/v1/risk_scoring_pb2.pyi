from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExplainWhen(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPLAIN_WHEN_UNSPECIFIED: _ClassVar[ExplainWhen]
    EXPLAIN_ALWAYS: _ClassVar[ExplainWhen]
    EXPLAIN_ADVERSE: _ClassVar[ExplainWhen]

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    APPROVE: _ClassVar[Decision]
    REVIEW: _ClassVar[Decision]
    DECLINE: _ClassVar[Decision]
EXPLAIN_WHEN_UNSPECIFIED: ExplainWhen
EXPLAIN_ALWAYS: ExplainWhen
EXPLAIN_ADVERSE: ExplainWhen
DECISION_UNSPECIFIED: Decision
APPROVE: Decision
REVIEW: Decision
DECLINE: Decision

class HistoryRow(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "entity_id", "model", "model_version", "features", "history", "timeout_us", "explain_top_k", "explain_when")
    class FeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_TOP_K_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_WHEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    entity_id: str
    model: str
    model_version: str
    features: _containers.ScalarMap[str, float]
    history: _containers.RepeatedCompositeFieldContainer[HistoryRow]
    timeout_us: int
    explain_top_k: int
    explain_when: ExplainWhen
    def __init__(self, request_id: _Optional[str] = ..., entity_id: _Optional[str] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., features: _Optional[_Mapping[str, float]] = ..., history: _Optional[_Iterable[_Union[HistoryRow, _Mapping]]] = ..., timeout_us: _Optional[int] = ..., explain_top_k: _Optional[int] = ..., explain_when: _Optional[_Union[ExplainWhen, str]] = ...) -> None: ...

class Reason(_message.Message):
    __slots__ = ("code", "text", "features", "contribution")
    CODE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    code: str
    text: str
    features: _containers.RepeatedScalarFieldContainer[str]
    contribution: float
    def __init__(self, code: _Optional[str] = ..., text: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., contribution: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("total_us", "queue_us", "engine_us", "batch_size")
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    ENGINE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    total_us: int
    queue_us: int
    engine_us: int
    batch_size: int
    def __init__(self, total_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., engine_us: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "score", "decision", "model", "model_version", "engine", "fallback_reason", "timings", "degraded", "status", "reasons")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    score: float
    decision: Decision
    model: str
    model_version: str
    engine: str
    fallback_reason: str
    timings: Timings
    degraded: bool
    status: Status
    reasons: _containers.RepeatedCompositeFieldContainer[Reason]
    def __init__(self, request_id: _Optional[str] = ..., score: _Optional[float] = ..., decision: _Optional[_Union[Decision, str]] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., engine: _Optional[str] = ..., fallback_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., degraded: _Optional[bool] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., reasons: _Optional[_Iterable[_Union[Reason, _Mapping]]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("model", "model_version", "requests")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: str
    requests: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ("model", "model_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: str
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class Thresholds(_message.Message):
    __slots__ = ("review", "decline")
    REVIEW_FIELD_NUMBER: _ClassVar[int]
    DECLINE_FIELD_NUMBER: _ClassVar[int]
    review: float
    decline: float
    def __init__(self, review: _Optional[float] = ..., decline: _Optional[float] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("name", "kind", "precision", "max_batch_size", "max_history_length", "healthy")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    precision: str
    max_batch_size: int
    max_history_length: int
    healthy: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., precision: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., max_history_length: _Optional[int] = ..., healthy: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "model_version", "versions", "feature_names", "history_fields", "max_history_length", "max_batch_size", "nan_policy", "thresholds", "engines", "description", "max_score_batch_requests")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_NAMES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELDS_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAN_POLICY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_BATCH_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: str
    versions: _containers.RepeatedScalarFieldContainer[str]
    feature_names: _containers.RepeatedScalarFieldContainer[str]
    history_fields: _containers.RepeatedScalarFieldContainer[str]
    max_history_length: int
    max_batch_size: int
    nan_policy: str
    thresholds: Thresholds
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    description: str
    max_score_batch_requests: int
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[str] = ..., versions: _Optional[_Iterable[str]] = ..., feature_names: _Optional[_Iterable[str]] = ..., history_fields: _Optional[_Iterable[str]] = ..., max_history_length: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., nan_policy: _Optional[str] = ..., thresholds: _Optional[_Union[Thresholds, _Mapping]] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., description: _Optional[str] = ..., max_score_batch_requests: _Optional[int] = ...) -> None: ...
