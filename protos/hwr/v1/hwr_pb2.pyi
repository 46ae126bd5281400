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
    __slots__ = ("identity_json", "key")
    IDENTITY_JSON_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    identity_json: bytes
    key: str
    def __init__(self, identity_json: _Optional[bytes] = ..., key: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("identity_json", "tensors", "wait_timeout_ms")
    IDENTITY_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    identity_json: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    wait_timeout_ms: int
    def __init__(self, identity_json: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., wait_timeout_ms: _Optional[int] = ...) -> None: ...

class BeginPublicationResponse(_message.Message):
    __slots__ = ("outcome", "key", "publication_id", "publication_token", "files", "placements")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    outcome: BeginOutcome
    key: str
    publication_id: str
    publication_token: str
    files: _containers.RepeatedCompositeFieldContainer[PayloadFile]
    placements: _containers.RepeatedCompositeFieldContainer[TensorPlacement]
    def __init__(self, outcome: _Optional[_Union[BeginOutcome, str]] = ..., key: _Optional[str] = ..., publication_id: _Optional[str] = ..., publication_token: _Optional[str] = ..., files: _Optional[_Iterable[_Union[PayloadFile, _Mapping]]] = ..., placements: _Optional[_Iterable[_Union[TensorPlacement, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ()
    def __init__(self) -> None: ...

class ListArtifactsResponse(_message.Message):
    __slots__ = ("artifacts",)
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactInfo]
    def __init__(self, artifacts: _Optional[_Iterable[_Union[ArtifactInfo, _Mapping]]] = ...) -> None: ...

class InspectArtifactRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class InspectArtifactResponse(_message.Message):
    __slots__ = ("artifact", "identity_json", "manifest_json")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_JSON_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactInfo
    identity_json: bytes
    manifest_json: bytes
    def __init__(self, artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., identity_json: _Optional[bytes] = ..., manifest_json: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("version", "root", "socket", "artifacts", "leases", "sessions", "publications", "store_bytes", "uptime_s", "pid")
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
    def __init__(self, version: _Optional[str] = ..., root: _Optional[str] = ..., socket: _Optional[str] = ..., artifacts: _Optional[int] = ..., leases: _Optional[int] = ..., sessions: _Optional[int] = ..., publications: _Optional[int] = ..., store_bytes: _Optional[int] = ..., uptime_s: _Optional[float] = ..., pid: _Optional[int] = ...) -> None: ...
