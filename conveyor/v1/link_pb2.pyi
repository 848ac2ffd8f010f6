from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LinkRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkResponse(_message.Message):
    __slots__ = ("port", "local_name", "local_key")
    PORT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_NAME_FIELD_NUMBER: _ClassVar[int]
    LOCAL_KEY_FIELD_NUMBER: _ClassVar[int]
    port: int
    local_name: str
    local_key: bytes
    def __init__(self, port: _Optional[int] = ..., local_name: _Optional[str] = ..., local_key: _Optional[bytes] = ...) -> None: ...
