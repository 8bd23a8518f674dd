from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "embedding", "kind", "alias_of")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ALIAS_OF_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    embedding: bool
    kind: str
    alias_of: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., embedding: _Optional[bool] = ..., kind: _Optional[str] = ..., alias_of: _Optional[str] = ...) -> None: ...

class Blob(_message.Message):
    __slots__ = ("fragment", "version", "codec", "numel", "total_bytes", "checksum", "offset", "data", "full", "result_checksum", "refused", "seq", "compression", "held")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    RESULT_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    codec: str
    numel: int
    total_bytes: int
    checksum: int
    offset: int
    data: bytes
    full: bool
    result_checksum: int
    refused: str
    seq: int
    compression: str
    held: bool
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., codec: _Optional[str] = ..., numel: _Optional[int] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., full: _Optional[bool] = ..., result_checksum: _Optional[int] = ..., refused: _Optional[str] = ..., seq: _Optional[int] = ..., compression: _Optional[str] = ..., held: _Optional[bool] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner_id", "specs", "token", "session", "held")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    token: str
    session: str
    held: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, learner_id: _Optional[str] = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., token: _Optional[str] = ..., session: _Optional[str] = ..., held: _Optional[_Iterable[bytes]] = ...) -> None: ...

class JoinHeader(_message.Message):
    __slots__ = ("session", "config_json", "fragments", "data_position", "need_init", "total_bytes", "init_wait", "init_owner", "start_position")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEED_INIT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    INIT_WAIT_FIELD_NUMBER: _ClassVar[int]
    INIT_OWNER_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    session: str
    config_json: str
    fragments: int
    data_position: int
    need_init: bool
    total_bytes: int
    init_wait: bool
    init_owner: str
    start_position: int
    def __init__(self, session: _Optional[str] = ..., config_json: _Optional[str] = ..., fragments: _Optional[int] = ..., data_position: _Optional[int] = ..., need_init: _Optional[bool] = ..., total_bytes: _Optional[int] = ..., init_wait: _Optional[bool] = ..., init_owner: _Optional[str] = ..., start_position: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("header", "blob")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    header: JoinHeader
    blob: Blob
    def __init__(self, header: _Optional[_Union[JoinHeader, _Mapping]] = ..., blob: _Optional[_Union[Blob, _Mapping]] = ...) -> None: ...

class InitChunk(_message.Message):
    __slots__ = ("request", "blob")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    request: JoinRequest
    blob: Blob
    def __init__(self, request: _Optional[_Union[JoinRequest, _Mapping]] = ..., blob: _Optional[_Union[Blob, _Mapping]] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("learner_id", "session", "seq", "fragment", "base_version", "steps", "tokens", "data_position", "codec", "numel", "total_bytes", "checksum", "compression", "final")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    seq: int
    fragment: int
    base_version: int
    steps: int
    tokens: int
    data_position: int
    codec: str
    numel: int
    total_bytes: int
    checksum: int
    compression: str
    final: bool
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ..., seq: _Optional[int] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., steps: _Optional[int] = ..., tokens: _Optional[int] = ..., data_position: _Optional[int] = ..., codec: _Optional[str] = ..., numel: _Optional[int] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., compression: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "reason", "duplicate", "resync", "stop")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    duplicate: bool
    resync: bool
    stop: bool
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., duplicate: _Optional[bool] = ..., resync: _Optional[bool] = ..., stop: _Optional[bool] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("learner_id", "session")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "session", "step", "tokens_trained", "loss", "data_position", "step_seconds", "pushes", "applied", "speed", "tokens_per_second", "received_bytes")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    step: int
    tokens_trained: int
    loss: float
    data_position: int
    step_seconds: float
    pushes: int
    applied: int
    speed: float
    tokens_per_second: float
    received_bytes: int
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ..., step: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., loss: _Optional[float] = ..., data_position: _Optional[int] = ..., step_seconds: _Optional[float] = ..., pushes: _Optional[int] = ..., applied: _Optional[int] = ..., speed: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("stop", "tokens_trained", "budget_progress", "phase_lead")
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PHASE_LEAD_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    tokens_trained: int
    budget_progress: float
    phase_lead: float
    def __init__(self, stop: _Optional[bool] = ..., tokens_trained: _Optional[int] = ..., budget_progress: _Optional[float] = ..., phase_lead: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner_id", "session")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
