from conveyor.v1 import conveyor_pb2 as _conveyor_pb2
from conveyor.v1 import link_pb2 as _link_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Delta(_message.Message):
    __slots__ = ("request_id", "text_offset", "text", "first_token_index", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text_offset: int
    text: str
    first_token_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _conveyor_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_conveyor_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., text_offset: _Optional[int] = ..., text: _Optional[str] = ..., first_token_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_conveyor_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_conveyor_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DeltaBatch(_message.Message):
    __slots__ = ("deltas",)
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[Delta]
    def __init__(self, deltas: _Optional[_Iterable[_Union[Delta, _Mapping]]] = ...) -> None: ...

class DeliverResponse(_message.Message):
    __slots__ = ("unknown_request_ids",)
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...
