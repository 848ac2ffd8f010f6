from conveyor.v1 import conveyor_pb2 as _conveyor_pb2
from conveyor.v1 import link_pb2 as _link_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "eos_token_ids", "max_model_len", "num_blocks", "block_size", "dtype", "device", "block_bytes", "bos_token_id", "verify_cost")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    block_bytes: int
    bos_token_id: int
    verify_cost: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_bytes: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., verify_cost: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceChunk(_message.Message):
    __slots__ = ("seq_id", "token_ids", "start_pos", "new_block_ids", "sample", "sampling", "num_prompt_tokens", "decode_last", "cached_token_ids", "stop", "structured", "max_drafts")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAST_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_pos: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    sampling: _conveyor_pb2.SamplingOptions
    num_prompt_tokens: int
    decode_last: bool
    cached_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _conveyor_pb2.StopConditions
    structured: _conveyor_pb2.Structured
    max_drafts: int
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_pos: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., sampling: _Optional[_Union[_conveyor_pb2.SamplingOptions, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., decode_last: _Optional[bool] = ..., cached_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Union[_conveyor_pb2.StopConditions, _Mapping]] = ..., structured: _Optional[_Union[_conveyor_pb2.Structured, _Mapping]] = ..., max_drafts: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "chunks", "free_seq_ids", "free_all")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FREE_ALL_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    chunks: _containers.RepeatedCompositeFieldContainer[SequenceChunk]
    free_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    free_all: bool
    def __init__(self, step_id: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[SequenceChunk, _Mapping]]] = ..., free_seq_ids: _Optional[_Iterable[str]] = ..., free_all: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_logprobs", "error", "accepted", "drafted")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    error: str
    accepted: _containers.RepeatedCompositeFieldContainer[SampledToken]
    drafted: int
    def __init__(self, seq_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., error: _Optional[str] = ..., accepted: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., drafted: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "tokens", "compute_seconds", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    compute_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "tokens", "ranks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    first_position: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., first_position: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...
