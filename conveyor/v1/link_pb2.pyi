from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LinkRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkResponse(_message.Message):
    __slots__ = ("port", "local_name")
    PORT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_NAME_FIELD_NUMBER: _ClassVar[int]
    port: int
    local_name: str
    def __init__(self, port: _Optional[int] = ..., local_name: _Optional[str] = ...) -> None: ...
