from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArtifactState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARTIFACT_STATE_UNSPECIFIED: _ClassVar[ArtifactState]
    ARTIFACT_STATE_READY: _ClassVar[ArtifactState]
    ARTIFACT_STATE_DENIED: _ClassVar[ArtifactState]
    ARTIFACT_STATE_PUBLISHING: _ClassVar[ArtifactState]

class TensorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_KIND_UNSPECIFIED: _ClassVar[TensorKind]
    TENSOR_KIND_PARAMETER: _ClassVar[TensorKind]
    TENSOR_KIND_BUFFER: _ClassVar[TensorKind]

class BeginOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BEGIN_OUTCOME_UNSPECIFIED: _ClassVar[BeginOutcome]
    BEGIN_OUTCOME_STAGED: _ClassVar[BeginOutcome]
    BEGIN_OUTCOME_ALREADY_PRESENT: _ClassVar[BeginOutcome]
    BEGIN_OUTCOME_JOINED: _ClassVar[BeginOutcome]

class PrewarmOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREWARM_OUTCOME_UNSPECIFIED: _ClassVar[PrewarmOutcome]
    PREWARM_OUTCOME_BUILT: _ClassVar[PrewarmOutcome]
    PREWARM_OUTCOME_ALREADY_PRESENT: _ClassVar[PrewarmOutcome]
    PREWARM_OUTCOME_JOINED: _ClassVar[PrewarmOutcome]
ARTIFACT_STATE_UNSPECIFIED: ArtifactState
ARTIFACT_STATE_READY: ArtifactState
ARTIFACT_STATE_DENIED: ArtifactState
ARTIFACT_STATE_PUBLISHING: ArtifactState
TENSOR_KIND_UNSPECIFIED: TensorKind
TENSOR_KIND_PARAMETER: TensorKind
TENSOR_KIND_BUFFER: TensorKind
BEGIN_OUTCOME_UNSPECIFIED: BeginOutcome
BEGIN_OUTCOME_STAGED: BeginOutcome
BEGIN_OUTCOME_ALREADY_PRESENT: BeginOutcome
BEGIN_OUTCOME_JOINED: BeginOutcome
PREWARM_OUTCOME_UNSPECIFIED: PrewarmOutcome
PREWARM_OUTCOME_BUILT: PrewarmOutcome
PREWARM_OUTCOME_ALREADY_PRESENT: PrewarmOutcome
PREWARM_OUTCOME_JOINED: PrewarmOutcome

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "client_version")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    client_version: str
    def __init__(self, client_name: _Optional[str] = ..., client_version: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "pid", "uid", "daemon_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pid: int
    uid: int
    daemon_version: str
    def __init__(self, session_id: _Optional[str] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ..., daemon_version: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("session_id", "lease_count", "publication_count")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_COUNT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_count: int
    publication_count: int
    def __init__(self, session_id: _Optional[str] = ..., lease_count: _Optional[int] = ..., publication_count: _Optional[int] = ...) -> None: ...

class ArtifactRef(_message.Message):
    __slots__ = ("identity_json", "key", "checkpoint", "channel")
    IDENTITY_JSON_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    identity_json: bytes
    key: str
    checkpoint: CheckpointRef
    channel: str
    def __init__(self, identity_json: _Optional[bytes] = ..., key: _Optional[str] = ..., checkpoint: _Optional[_Union[CheckpointRef, _Mapping]] = ..., channel: _Optional[str] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("artifact",)
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactRef
    def __init__(self, artifact: _Optional[_Union[ArtifactRef, _Mapping]] = ...) -> None: ...

class PayloadFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "lease_token", "key", "manifest_json", "files")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_token: str
    key: str
    manifest_json: bytes
    files: _containers.RepeatedCompositeFieldContainer[PayloadFile]
    def __init__(self, lease_id: _Optional[str] = ..., lease_token: _Optional[str] = ..., key: _Optional[str] = ..., manifest_json: _Optional[bytes] = ..., files: _Optional[_Iterable[_Union[PayloadFile, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "kind", "role")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    kind: TensorKind
    role: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., kind: _Optional[_Union[TensorKind, str]] = ..., role: _Optional[str] = ...) -> None: ...

class TensorPlacement(_message.Message):
    __slots__ = ("name", "file_index", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    file_index: int
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., file_index: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class BeginPublicationRequest(_message.Message):
    __slots__ = ("identity_json", "tensors", "wait_timeout_ms", "format_metadata_json", "channel", "non_durable", "overlap_hashing", "reuse_base", "reuse_tensors")
    IDENTITY_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    NON_DURABLE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_HASHING_FIELD_NUMBER: _ClassVar[int]
    REUSE_BASE_FIELD_NUMBER: _ClassVar[int]
    REUSE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    identity_json: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    wait_timeout_ms: int
    format_metadata_json: bytes
    channel: str
    non_durable: bool
    overlap_hashing: bool
    reuse_base: str
    reuse_tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, identity_json: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., wait_timeout_ms: _Optional[int] = ..., format_metadata_json: _Optional[bytes] = ..., channel: _Optional[str] = ..., non_durable: _Optional[bool] = ..., overlap_hashing: _Optional[bool] = ..., reuse_base: _Optional[str] = ..., reuse_tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class BeginPublicationResponse(_message.Message):
    __slots__ = ("outcome", "key", "publication_id", "publication_token", "files", "placements", "reused")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    outcome: BeginOutcome
    key: str
    publication_id: str
    publication_token: str
    files: _containers.RepeatedCompositeFieldContainer[PayloadFile]
    placements: _containers.RepeatedCompositeFieldContainer[TensorPlacement]
    reused: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outcome: _Optional[_Union[BeginOutcome, str]] = ..., key: _Optional[str] = ..., publication_id: _Optional[str] = ..., publication_token: _Optional[str] = ..., files: _Optional[_Iterable[_Union[PayloadFile, _Mapping]]] = ..., placements: _Optional[_Iterable[_Union[TensorPlacement, _Mapping]]] = ..., reused: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitPublicationRequest(_message.Message):
    __slots__ = ("publication_id", "expected_sha256")
    class ExpectedSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PUBLICATION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SHA256_FIELD_NUMBER: _ClassVar[int]
    publication_id: str
    expected_sha256: _containers.ScalarMap[str, str]
    def __init__(self, publication_id: _Optional[str] = ..., expected_sha256: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CommitPublicationResponse(_message.Message):
    __slots__ = ("key", "joined", "size_bytes", "content_sha256")
    KEY_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    key: str
    joined: bool
    size_bytes: int
    content_sha256: str
    def __init__(self, key: _Optional[str] = ..., joined: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., content_sha256: _Optional[str] = ...) -> None: ...

class AbortPublicationRequest(_message.Message):
    __slots__ = ("publication_id",)
    PUBLICATION_ID_FIELD_NUMBER: _ClassVar[int]
    publication_id: str
    def __init__(self, publication_id: _Optional[str] = ...) -> None: ...

class AbortPublicationResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class ArtifactInfo(_message.Message):
    __slots__ = ("key", "size_bytes", "state", "leases", "model_id", "component", "dtype", "tensor_count", "created_at", "content_sha256", "deny_reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    DENY_REASON_FIELD_NUMBER: _ClassVar[int]
    key: str
    size_bytes: int
    state: ArtifactState
    leases: int
    model_id: str
    component: str
    dtype: str
    tensor_count: int
    created_at: float
    content_sha256: str
    deny_reason: str
    def __init__(self, key: _Optional[str] = ..., size_bytes: _Optional[int] = ..., state: _Optional[_Union[ArtifactState, str]] = ..., leases: _Optional[int] = ..., model_id: _Optional[str] = ..., component: _Optional[str] = ..., dtype: _Optional[str] = ..., tensor_count: _Optional[int] = ..., created_at: _Optional[float] = ..., content_sha256: _Optional[str] = ..., deny_reason: _Optional[str] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ("include_denied",)
    INCLUDE_DENIED_FIELD_NUMBER: _ClassVar[int]
    include_denied: bool
    def __init__(self, include_denied: _Optional[bool] = ...) -> None: ...

class ListArtifactsResponse(_message.Message):
    __slots__ = ("artifacts",)
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactInfo]
    def __init__(self, artifacts: _Optional[_Iterable[_Union[ArtifactInfo, _Mapping]]] = ...) -> None: ...

class InspectArtifactRequest(_message.Message):
    __slots__ = ("key", "paged", "tensor_offset", "tensor_limit")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAGED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TENSOR_LIMIT_FIELD_NUMBER: _ClassVar[int]
    key: str
    paged: bool
    tensor_offset: int
    tensor_limit: int
    def __init__(self, key: _Optional[str] = ..., paged: _Optional[bool] = ..., tensor_offset: _Optional[int] = ..., tensor_limit: _Optional[int] = ...) -> None: ...

class InspectArtifactResponse(_message.Message):
    __slots__ = ("artifact", "identity_json", "manifest_json", "tensors_json", "tensor_count", "next_tensor_offset", "remote_state", "channels", "non_durable")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_JSON_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEXT_TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REMOTE_STATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NON_DURABLE_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactInfo
    identity_json: bytes
    manifest_json: bytes
    tensors_json: bytes
    tensor_count: int
    next_tensor_offset: int
    remote_state: str
    channels: _containers.RepeatedScalarFieldContainer[str]
    non_durable: bool
    def __init__(self, artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., identity_json: _Optional[bytes] = ..., manifest_json: _Optional[bytes] = ..., tensors_json: _Optional[bytes] = ..., tensor_count: _Optional[int] = ..., next_tensor_offset: _Optional[int] = ..., remote_state: _Optional[str] = ..., channels: _Optional[_Iterable[str]] = ..., non_durable: _Optional[bool] = ...) -> None: ...

class LeaseInfo(_message.Message):
    __slots__ = ("lease_id", "key", "session_id", "pid", "uid", "client_name", "acquired_at")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_AT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    key: str
    session_id: str
    pid: int
    uid: int
    client_name: str
    acquired_at: float
    def __init__(self, lease_id: _Optional[str] = ..., key: _Optional[str] = ..., session_id: _Optional[str] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ..., client_name: _Optional[str] = ..., acquired_at: _Optional[float] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("paged", "after", "limit")
    PAGED_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    paged: bool
    after: str
    limit: int
    def __init__(self, paged: _Optional[bool] = ..., after: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases", "next_after", "total")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    next_after: str
    total: int
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ..., next_after: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("version", "root", "socket", "artifacts", "leases", "sessions", "publications", "store_bytes", "uptime_s", "pid", "remote", "channels")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PUBLICATIONS_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    version: str
    root: str
    socket: str
    artifacts: int
    leases: int
    sessions: int
    publications: int
    store_bytes: int
    uptime_s: float
    pid: int
    remote: RemoteStatus
    channels: _containers.RepeatedCompositeFieldContainer[ChannelInfo]
    def __init__(self, version: _Optional[str] = ..., root: _Optional[str] = ..., socket: _Optional[str] = ..., artifacts: _Optional[int] = ..., leases: _Optional[int] = ..., sessions: _Optional[int] = ..., publications: _Optional[int] = ..., store_bytes: _Optional[int] = ..., uptime_s: _Optional[float] = ..., pid: _Optional[int] = ..., remote: _Optional[_Union[RemoteStatus, _Mapping]] = ..., channels: _Optional[_Iterable[_Union[ChannelInfo, _Mapping]]] = ...) -> None: ...

class CheckpointRef(_message.Message):
    __slots__ = ("checkpoint_id",)
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    def __init__(self, checkpoint_id: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("checkpoint_id", "path", "model_id", "revision", "file_count", "tensor_count", "size_bytes", "source_kind", "state", "leases", "registered_at")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FILE_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    path: str
    model_id: str
    revision: str
    file_count: int
    tensor_count: int
    size_bytes: int
    source_kind: str
    state: str
    leases: int
    registered_at: float
    def __init__(self, checkpoint_id: _Optional[str] = ..., path: _Optional[str] = ..., model_id: _Optional[str] = ..., revision: _Optional[str] = ..., file_count: _Optional[int] = ..., tensor_count: _Optional[int] = ..., size_bytes: _Optional[int] = ..., source_kind: _Optional[str] = ..., state: _Optional[str] = ..., leases: _Optional[int] = ..., registered_at: _Optional[float] = ...) -> None: ...

class AddCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class AddCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint", "added")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointInfo
    added: bool
    def __init__(self, checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., added: _Optional[bool] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class PrewarmRequest(_message.Message):
    __slots__ = ("checkpoint", "producer", "dtype", "keep_fp32", "tp_size", "tp_plan", "tp_ranks", "timeout_ms", "wait_timeout_ms", "producer_config")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FP32_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_PLAN_FIELD_NUMBER: _ClassVar[int]
    TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    producer: str
    dtype: str
    keep_fp32: _containers.RepeatedScalarFieldContainer[str]
    tp_size: int
    tp_plan: bytes
    tp_ranks: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    wait_timeout_ms: int
    producer_config: bytes
    def __init__(self, checkpoint: _Optional[str] = ..., producer: _Optional[str] = ..., dtype: _Optional[str] = ..., keep_fp32: _Optional[_Iterable[str]] = ..., tp_size: _Optional[int] = ..., tp_plan: _Optional[bytes] = ..., tp_ranks: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ..., wait_timeout_ms: _Optional[int] = ..., producer_config: _Optional[bytes] = ...) -> None: ...

class PrewarmProgress(_message.Message):
    __slots__ = ("tp_rank", "done_bytes", "total_bytes", "tensor")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    done_bytes: int
    total_bytes: int
    tensor: str
    def __init__(self, tp_rank: _Optional[int] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., tensor: _Optional[str] = ...) -> None: ...

class PrewarmArtifact(_message.Message):
    __slots__ = ("key", "tp_rank", "outcome", "size_bytes", "content_sha256", "producer_peak_rss_bytes", "build_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    tp_rank: int
    outcome: PrewarmOutcome
    size_bytes: int
    content_sha256: str
    producer_peak_rss_bytes: int
    build_seconds: float
    def __init__(self, key: _Optional[str] = ..., tp_rank: _Optional[int] = ..., outcome: _Optional[_Union[PrewarmOutcome, str]] = ..., size_bytes: _Optional[int] = ..., content_sha256: _Optional[str] = ..., producer_peak_rss_bytes: _Optional[int] = ..., build_seconds: _Optional[float] = ...) -> None: ...

class PrewarmResult(_message.Message):
    __slots__ = ("artifacts",)
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[PrewarmArtifact]
    def __init__(self, artifacts: _Optional[_Iterable[_Union[PrewarmArtifact, _Mapping]]] = ...) -> None: ...

class PrewarmResponse(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: PrewarmProgress
    result: PrewarmResult
    def __init__(self, progress: _Optional[_Union[PrewarmProgress, _Mapping]] = ..., result: _Optional[_Union[PrewarmResult, _Mapping]] = ...) -> None: ...

class VerifyArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class VerifyArtifactResponse(_message.Message):
    __slots__ = ("key", "done_bytes", "total_bytes", "finished", "ok", "error_code", "message", "quarantined", "affected_leases")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    AFFECTED_LEASES_FIELD_NUMBER: _ClassVar[int]
    key: str
    done_bytes: int
    total_bytes: int
    finished: bool
    ok: bool
    error_code: str
    message: str
    quarantined: bool
    affected_leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    def __init__(self, key: _Optional[str] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., finished: _Optional[bool] = ..., ok: _Optional[bool] = ..., error_code: _Optional[str] = ..., message: _Optional[str] = ..., quarantined: _Optional[bool] = ..., affected_leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ...) -> None: ...

class DenyArtifactRequest(_message.Message):
    __slots__ = ("key", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: str
    reason: str
    def __init__(self, key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DenyArtifactResponse(_message.Message):
    __slots__ = ("key", "affected_leases")
    KEY_FIELD_NUMBER: _ClassVar[int]
    AFFECTED_LEASES_FIELD_NUMBER: _ClassVar[int]
    key: str
    affected_leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    def __init__(self, key: _Optional[str] = ..., affected_leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ...) -> None: ...

class AllowArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class AllowArtifactResponse(_message.Message):
    __slots__ = ("key", "was_denied")
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAS_DENIED_FIELD_NUMBER: _ClassVar[int]
    key: str
    was_denied: bool
    def __init__(self, key: _Optional[str] = ..., was_denied: _Optional[bool] = ...) -> None: ...

class PinArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class PinArtifactResponse(_message.Message):
    __slots__ = ("key", "already_pinned", "size_bytes", "locked_bytes", "residency")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PINNED_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    key: str
    already_pinned: bool
    size_bytes: int
    locked_bytes: int
    residency: str
    def __init__(self, key: _Optional[str] = ..., already_pinned: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., locked_bytes: _Optional[int] = ..., residency: _Optional[str] = ...) -> None: ...

class UnpinArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class UnpinArtifactResponse(_message.Message):
    __slots__ = ("key", "was_pinned")
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAS_PINNED_FIELD_NUMBER: _ClassVar[int]
    key: str
    was_pinned: bool
    def __init__(self, key: _Optional[str] = ..., was_pinned: _Optional[bool] = ...) -> None: ...

class EvictArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class EvictArtifactResponse(_message.Message):
    __slots__ = ("key", "freed_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    freed_bytes: int
    def __init__(self, key: _Optional[str] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class CollectGarbageRequest(_message.Message):
    __slots__ = ("target_bytes",)
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    target_bytes: int
    def __init__(self, target_bytes: _Optional[int] = ...) -> None: ...

class SkippedArtifact(_message.Message):
    __slots__ = ("key", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: str
    reason: str
    def __init__(self, key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CollectGarbageResponse(_message.Message):
    __slots__ = ("evicted", "freed_bytes", "store_bytes", "target_bytes", "skipped", "staging_reclaimed")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    STAGING_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    evicted: _containers.RepeatedScalarFieldContainer[str]
    freed_bytes: int
    store_bytes: int
    target_bytes: int
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedArtifact]
    staging_reclaimed: int
    def __init__(self, evicted: _Optional[_Iterable[str]] = ..., freed_bytes: _Optional[int] = ..., store_bytes: _Optional[int] = ..., target_bytes: _Optional[int] = ..., skipped: _Optional[_Iterable[_Union[SkippedArtifact, _Mapping]]] = ..., staging_reclaimed: _Optional[int] = ...) -> None: ...

class ArtifactUsage(_message.Message):
    __slots__ = ("key", "size_bytes", "last_access", "pinned", "leases", "held_by_pids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_PIDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    size_bytes: int
    last_access: float
    pinned: bool
    leases: int
    held_by_pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[str] = ..., size_bytes: _Optional[int] = ..., last_access: _Optional[float] = ..., pinned: _Optional[bool] = ..., leases: _Optional[int] = ..., held_by_pids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStoreUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStoreUsageResponse(_message.Message):
    __slots__ = ("store_bytes", "reserved_bytes", "store_limit_bytes", "artifact_limit_bytes", "min_free_bytes", "free_bytes", "pinned_bytes", "locked_bytes", "evictions", "artifacts")
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIN_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    store_bytes: int
    reserved_bytes: int
    store_limit_bytes: int
    artifact_limit_bytes: int
    min_free_bytes: int
    free_bytes: int
    pinned_bytes: int
    locked_bytes: int
    evictions: int
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactUsage]
    def __init__(self, store_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., store_limit_bytes: _Optional[int] = ..., artifact_limit_bytes: _Optional[int] = ..., min_free_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., locked_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., artifacts: _Optional[_Iterable[_Union[ArtifactUsage, _Mapping]]] = ...) -> None: ...

class RemoteStatus(_message.Message):
    __slots__ = ("url", "reachable", "error", "push", "pending_pushes", "pulls_in_flight", "bytes_pulled", "bytes_pushed", "pulls", "error_code", "peers")
    URL_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUSHES_FIELD_NUMBER: _ClassVar[int]
    PULLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    url: str
    reachable: bool
    error: str
    push: bool
    pending_pushes: int
    pulls_in_flight: int
    bytes_pulled: int
    bytes_pushed: int
    pulls: _containers.RepeatedCompositeFieldContainer[RemotePull]
    error_code: str
    peers: PeerTierStatus
    def __init__(self, url: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., push: _Optional[bool] = ..., pending_pushes: _Optional[int] = ..., pulls_in_flight: _Optional[int] = ..., bytes_pulled: _Optional[int] = ..., bytes_pushed: _Optional[int] = ..., pulls: _Optional[_Iterable[_Union[RemotePull, _Mapping]]] = ..., error_code: _Optional[str] = ..., peers: _Optional[_Union[PeerTierStatus, _Mapping]] = ...) -> None: ...

class PeerTierStatus(_message.Message):
    __slots__ = ("node", "address", "serve", "fetch", "served_bytes", "serving_peers", "fetched_bytes", "fallback_bytes", "refused", "lying_peers", "failed_peers", "peer_pulls", "cap_bytes_per_s", "agent_rss_bytes", "pulls", "agent_restarts", "agent_pid", "staging_served_bytes", "partial_fetched_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVE_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVING_PEERS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LYING_PEERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_PEERS_FIELD_NUMBER: _ClassVar[int]
    PEER_PULLS_FIELD_NUMBER: _ClassVar[int]
    CAP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    AGENT_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    AGENT_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    AGENT_PID_FIELD_NUMBER: _ClassVar[int]
    STAGING_SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    serve: bool
    fetch: bool
    served_bytes: int
    serving_peers: _containers.RepeatedScalarFieldContainer[str]
    fetched_bytes: int
    fallback_bytes: int
    refused: int
    lying_peers: int
    failed_peers: int
    peer_pulls: int
    cap_bytes_per_s: int
    agent_rss_bytes: int
    pulls: _containers.RepeatedCompositeFieldContainer[PeerPull]
    agent_restarts: int
    agent_pid: int
    staging_served_bytes: int
    partial_fetched_bytes: int
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., serve: _Optional[bool] = ..., fetch: _Optional[bool] = ..., served_bytes: _Optional[int] = ..., serving_peers: _Optional[_Iterable[str]] = ..., fetched_bytes: _Optional[int] = ..., fallback_bytes: _Optional[int] = ..., refused: _Optional[int] = ..., lying_peers: _Optional[int] = ..., failed_peers: _Optional[int] = ..., peer_pulls: _Optional[int] = ..., cap_bytes_per_s: _Optional[int] = ..., agent_rss_bytes: _Optional[int] = ..., pulls: _Optional[_Iterable[_Union[PeerPull, _Mapping]]] = ..., agent_restarts: _Optional[int] = ..., agent_pid: _Optional[int] = ..., staging_served_bytes: _Optional[int] = ..., partial_fetched_bytes: _Optional[int] = ...) -> None: ...

class ListPeerHoldersRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class ListPeerHoldersResponse(_message.Message):
    __slots__ = ("holders", "node", "now")
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[PeerHolder]
    node: str
    now: float
    def __init__(self, holders: _Optional[_Iterable[_Union[PeerHolder, _Mapping]]] = ..., node: _Optional[str] = ..., now: _Optional[float] = ...) -> None: ...

class PeerHolder(_message.Message):
    __slots__ = ("key", "node", "address", "recorded_at", "expires_at", "live")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECORDED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    key: str
    node: str
    address: str
    recorded_at: float
    expires_at: float
    live: bool
    def __init__(self, key: _Optional[str] = ..., node: _Optional[str] = ..., address: _Optional[str] = ..., recorded_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., live: _Optional[bool] = ...) -> None: ...

class PeerPull(_message.Message):
    __slots__ = ("key", "peers", "done_bytes", "total_bytes", "started_at", "from_store_bytes", "verified_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FROM_STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    peers: _containers.RepeatedScalarFieldContainer[str]
    done_bytes: int
    total_bytes: int
    started_at: float
    from_store_bytes: int
    verified_bytes: int
    def __init__(self, key: _Optional[str] = ..., peers: _Optional[_Iterable[str]] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., started_at: _Optional[float] = ..., from_store_bytes: _Optional[int] = ..., verified_bytes: _Optional[int] = ...) -> None: ...

class RemotePull(_message.Message):
    __slots__ = ("key", "phase", "done_bytes", "total_bytes", "started_at", "waiters")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    key: str
    phase: str
    done_bytes: int
    total_bytes: int
    started_at: float
    waiters: _containers.RepeatedCompositeFieldContainer[PullWaiter]
    def __init__(self, key: _Optional[str] = ..., phase: _Optional[str] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., started_at: _Optional[float] = ..., waiters: _Optional[_Iterable[_Union[PullWaiter, _Mapping]]] = ...) -> None: ...

class PullWaiter(_message.Message):
    __slots__ = ("session_id", "pid", "uid", "client_name", "since")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pid: int
    uid: int
    client_name: str
    since: float
    def __init__(self, session_id: _Optional[str] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ..., client_name: _Optional[str] = ..., since: _Optional[float] = ...) -> None: ...

class RemoteArtifact(_message.Message):
    __slots__ = ("key", "size_bytes", "complete", "local")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    key: str
    size_bytes: int
    complete: bool
    local: bool
    def __init__(self, key: _Optional[str] = ..., size_bytes: _Optional[int] = ..., complete: _Optional[bool] = ..., local: _Optional[bool] = ...) -> None: ...

class ListRemoteRequest(_message.Message):
    __slots__ = ("paged", "after", "limit")
    PAGED_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    paged: bool
    after: str
    limit: int
    def __init__(self, paged: _Optional[bool] = ..., after: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListRemoteResponse(_message.Message):
    __slots__ = ("url", "artifacts", "next_after", "total")
    URL_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    url: str
    artifacts: _containers.RepeatedCompositeFieldContainer[RemoteArtifact]
    next_after: str
    total: int
    def __init__(self, url: _Optional[str] = ..., artifacts: _Optional[_Iterable[_Union[RemoteArtifact, _Mapping]]] = ..., next_after: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class PullArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class PullArtifactResponse(_message.Message):
    __slots__ = ("finished", "done_bytes", "total_bytes", "key", "outcome", "size_bytes")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    finished: bool
    done_bytes: int
    total_bytes: int
    key: str
    outcome: str
    size_bytes: int
    def __init__(self, finished: _Optional[bool] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., key: _Optional[str] = ..., outcome: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class PushArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class PushArtifactResponse(_message.Message):
    __slots__ = ("key", "outcome", "size_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    outcome: str
    size_bytes: int
    def __init__(self, key: _Optional[str] = ..., outcome: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class ChannelHistoryEntry(_message.Message):
    __slots__ = ("key", "generation", "set_at", "set_by", "durable", "uid")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SET_AT_FIELD_NUMBER: _ClassVar[int]
    SET_BY_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    key: str
    generation: int
    set_at: float
    set_by: str
    durable: bool
    uid: int
    def __init__(self, key: _Optional[str] = ..., generation: _Optional[int] = ..., set_at: _Optional[float] = ..., set_by: _Optional[str] = ..., durable: _Optional[bool] = ..., uid: _Optional[int] = ...) -> None: ...

class ChannelInfo(_message.Message):
    __slots__ = ("name", "key", "generation", "durable", "durable_key", "switches", "watchers", "created_at", "updated_at", "history", "owner_uid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_KEY_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    WATCHERS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    generation: int
    durable: bool
    durable_key: str
    switches: int
    watchers: int
    created_at: float
    updated_at: float
    history: _containers.RepeatedCompositeFieldContainer[ChannelHistoryEntry]
    owner_uid: int
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., generation: _Optional[int] = ..., durable: _Optional[bool] = ..., durable_key: _Optional[str] = ..., switches: _Optional[int] = ..., watchers: _Optional[int] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., history: _Optional[_Iterable[_Union[ChannelHistoryEntry, _Mapping]]] = ..., owner_uid: _Optional[int] = ...) -> None: ...

class SetChannelRequest(_message.Message):
    __slots__ = ("name", "key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class SetChannelResponse(_message.Message):
    __slots__ = ("channel", "changed")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    channel: ChannelInfo
    changed: bool
    def __init__(self, channel: _Optional[_Union[ChannelInfo, _Mapping]] = ..., changed: _Optional[bool] = ...) -> None: ...

class GetChannelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetChannelResponse(_message.Message):
    __slots__ = ("channel",)
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    channel: ChannelInfo
    def __init__(self, channel: _Optional[_Union[ChannelInfo, _Mapping]] = ...) -> None: ...

class ListChannelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListChannelsResponse(_message.Message):
    __slots__ = ("channels",)
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    channels: _containers.RepeatedCompositeFieldContainer[ChannelInfo]
    def __init__(self, channels: _Optional[_Iterable[_Union[ChannelInfo, _Mapping]]] = ...) -> None: ...

class DeleteChannelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteChannelResponse(_message.Message):
    __slots__ = ("channel",)
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    channel: ChannelInfo
    def __init__(self, channel: _Optional[_Union[ChannelInfo, _Mapping]] = ...) -> None: ...

class WatchChannelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class WatchChannelResponse(_message.Message):
    __slots__ = ("exists", "channel")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    channel: ChannelInfo
    def __init__(self, exists: _Optional[bool] = ..., channel: _Optional[_Union[ChannelInfo, _Mapping]] = ...) -> None: ...
