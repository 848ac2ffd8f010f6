from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "logprobs", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    seed: int
    logprobs: int
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Structured(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf", "whitespace_pattern")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    GBNF_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    lark: str
    gbnf: str
    whitespace_pattern: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., lark: _Optional[str] = ..., gbnf: _Optional[str] = ..., whitespace_pattern: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "chat", "prompt_ids", "sampling", "stop", "request_id", "priority", "cache_salt", "structured", "speculative")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: Chat
    prompt_ids: TokenIds
    sampling: SamplingOptions
    stop: StopConditions
    request_id: str
    priority: int
    cache_salt: str
    structured: Structured
    speculative: bool
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., stop: _Optional[_Union[StopConditions, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., structured: _Optional[_Union[Structured, _Mapping]] = ..., speculative: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenAlternative]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenAlternative, _Mapping]]] = ...) -> None: ...

class TokenAlternative(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "first_token_index", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_index: int
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_token_index: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "token_index", "text_offset")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_index: int
    text_offset: int
    def __init__(self, request_id: _Optional[str] = ..., token_index: _Optional[int] = ..., text_offset: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "chat")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: Chat
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "eos_token_ids", "max_stop_strings", "max_waiting_requests", "has_chat_template", "worker")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_stop_strings: int
    max_waiting_requests: int
    has_chat_template: bool
    worker: str
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_stop_strings: _Optional[int] = ..., max_waiting_requests: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., worker: _Optional[str] = ...) -> None: ...
