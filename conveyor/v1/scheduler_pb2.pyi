from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchedulerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "eos_token_ids", "vocab_size", "max_waiting", "device", "dtype")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    max_waiting: int
    device: str
    dtype: str
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., max_waiting: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("waiting", "refused")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    refused: _containers.RepeatedCompositeFieldContainer[SubmitRefusal]
    def __init__(self, waiting: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[SubmitRefusal, _Mapping]]] = ...) -> None: ...

class SubmitRefusal(_message.Message):
    __slots__ = ("request_id", "code", "details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: str
    details: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[str] = ..., details: _Optional[str] = ...) -> None: ...

class SchedulerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SchedulerAbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestState(_message.Message):
    __slots__ = ("request_id", "client_id", "owner", "status", "num_blocks", "num_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    client_id: str
    owner: str
    status: str
    num_blocks: int
    num_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., client_id: _Optional[str] = ..., owner: _Optional[str] = ..., status: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("steps", "running", "waiting", "num_blocks", "free_blocks", "preemptions", "aborts", "finished", "requests", "worker_up", "prefix_cache_queries", "prefix_cache_hits", "cached_blocks")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_UP_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    running: int
    waiting: int
    num_blocks: int
    free_blocks: int
    preemptions: int
    aborts: int
    finished: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestState]
    worker_up: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    cached_blocks: int
    def __init__(self, steps: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., preemptions: _Optional[int] = ..., aborts: _Optional[int] = ..., finished: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestState, _Mapping]]] = ..., worker_up: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., cached_blocks: _Optional[int] = ...) -> None: ...
