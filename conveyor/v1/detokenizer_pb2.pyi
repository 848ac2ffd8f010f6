from conveyor.v1 import conveyor_pb2 as _conveyor_pb2
from conveyor.v1 import frontend_pb2 as _frontend_pb2
from conveyor.v1 import link_pb2 as _link_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestTokens(_message.Message):
    __slots__ = ("request_id", "first_index", "token_ids", "finish_reason", "stopped_by_token", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOPPED_BY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _conveyor_pb2.FinishReason
    stopped_by_token: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_conveyor_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_conveyor_pb2.FinishReason, str]] = ..., stopped_by_token: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_conveyor_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("step", "requests")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestTokens]
    def __init__(self, step: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestTokens, _Mapping]]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("step", "retry")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    step: int
    retry: bool
    def __init__(self, step: _Optional[int] = ..., retry: _Optional[bool] = ...) -> None: ...

class ReplayRequest(_message.Message):
    __slots__ = ("request_id", "frontend")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    frontend: str
    def __init__(self, request_id: _Optional[str] = ..., frontend: _Optional[str] = ...) -> None: ...

class ReplayResponse(_message.Message):
    __slots__ = ("deltas",)
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[_frontend_pb2.Delta]
    def __init__(self, deltas: _Optional[_Iterable[_Union[_frontend_pb2.Delta, _Mapping]]] = ...) -> None: ...
