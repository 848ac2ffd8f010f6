"""A link: protobuf messages, each after its length, over one TCP connection, for the stream that runs once per
engine step between two processes on the hot path (the scheduler's steps to its worker).

Why not gRPC there: a gRPC message in Python wakes three or four threads on its way (the request iterator's,
the channel's poller, the reader's, the caller's), about 0.5 ms of CPU a round trip when steps come every few
milliseconds, the same with ``grpc.aio`` (``bench/grpc_hop.py``: run it to see both). On a CPU that time comes
out of the model's cores. A link costs one ``send`` and one wake of the thread blocked reading it (~0.15 ms a
paced round trip). It keeps what the stream needs from gRPC: mutual TLS with the internal certificates
(``CONVEYOR_INTERNAL_TLS_DIR``), a size limit, an error that ends the stream with a status name and the
sequence at fault, timeouts, and a broken connection seen at once. Everything else (health, reflection,
``Info``) stays on the service's gRPC port, which advertises the link's.

Frames: a 5-byte header (little-endian u32 length, u8 kind) then the bytes: a message, or an error (JSON
``{"code", "details", "culprit"}``) after which the sender closes the link.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from conveyor.grpc_util import INTERNAL_TLS_NAME, MAX_MESSAGE_BYTES, internal_tls_folder

HEADER = struct.Struct("<IB")
MESSAGE, ERROR = 0, 1


class LinkError(Exception):
    """The peer ended the link with an error: ``code`` (a gRPC status name, e.g. INVALID_ARGUMENT), ``details``,
    and ``culprit`` (the sequence at fault, when the peer could tell)."""

    def __init__(self, code: str, details: str, culprit: str | None = None):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
        self.culprit = culprit


def _tls_context(server: bool) -> ssl.SSLContext | None:
    folder = internal_tls_folder()
    if folder is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.load_cert_chain(Path(folder, "cert.pem"), Path(folder, "key.pem"))
    context.load_verify_locations(Path(folder, "ca.pem"))
    context.verify_mode = ssl.CERT_REQUIRED  # both ways: only holders of a certificate from the CA get in
    return context


class Link:
    """One end of a connection. ``send`` may be called from one thread while another blocks in ``receive`` only
    on a plain connection; over TLS, keep both on one thread (OpenSSL's objects are not for concurrent use)."""

    def __init__(self, sock: socket.socket, peer: str):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self._header = bytearray(HEADER.size)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 5.0) -> Link:
        """A link to ``host:port`` (over mutual TLS when the internal certificates are set)."""
        sock = socket.create_connection((host, port), timeout=timeout)
        context = _tls_context(server=False)
        if context is not None:
            try:
                sock = context.wrap_socket(sock, server_hostname=INTERNAL_TLS_NAME)
            except BaseException:
                sock.close()
                raise
        sock.settimeout(None)
        return cls(sock, f"{host}:{port}")

    def send(self, message) -> None:
        """Send a protobuf message (raises ``OSError`` when the connection is gone)."""
        self._send(MESSAGE, message.SerializeToString())

    def fail(self, code: str, details: str, culprit: str | None = None) -> None:
        """End the link with an error the peer's ``receive`` raises as ``LinkError``."""
        try:
            self._send(ERROR, json.dumps({"code": code, "details": details, "culprit": culprit}).encode())
        except OSError:
            pass  # the peer is gone: nobody to tell
        self.close()

    def _send(self, kind: int, data: bytes) -> None:
        self.sock.sendall(HEADER.pack(len(data), kind) + data)

    def receive(self, parse: Callable[[bytes], object], timeout: float | None = None):
        """The next message, parsed with ``parse`` (a message class's ``FromString``). Raises ``LinkError``
        when the peer ended the link with an error, ``ConnectionError`` when it closed or broke,
        ``TimeoutError`` after ``timeout`` seconds without a whole message (the link is then unusable), and
        whatever ``parse`` raises for bytes that are not a message (the caller's to answer)."""
        self.sock.settimeout(timeout)
        try:
            self._read_into(self._header)
            size, kind = HEADER.unpack(self._header)
            if size > MAX_MESSAGE_BYTES:
                raise ConnectionError(f"{self.peer} sent a {size}-byte message (the limit is {MAX_MESSAGE_BYTES})")
            data = bytearray(size)
            self._read_into(data)
        except socket.timeout:
            raise TimeoutError(f"no message from {self.peer} within {timeout:g} s") from None
        except ssl.SSLError as exc:
            raise ConnectionError(f"the TLS link to {self.peer} broke: {exc}") from None
        if kind == ERROR:
            error = json.loads(data)
            raise LinkError(error["code"], error["details"], error.get("culprit"))
        return parse(bytes(data))

    def _read_into(self, buffer: bytearray) -> None:
        view = memoryview(buffer)
        while view:
            got = self.sock.recv_into(view)
            if not got:
                raise ConnectionError(f"{self.peer} closed the link")
            view = view[got:]

    def interrupt(self) -> None:
        """Wake a thread blocked in ``receive`` on this link (from another thread): it raises ``ConnectionError``."""
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the descriptor's, never the TLS layer's
        except OSError:
            pass

    def close(self) -> None:
        self.interrupt()
        self.sock.close()


class LinkServer:
    """Accepts links on ``host:port`` (0: a free port, in ``port``) and hands each, connected and through its
    TLS handshake, to ``on_link`` on the thread that accepted it (``on_link`` must not block)."""

    HANDSHAKE_SECONDS = 10.0  # a peer that connects and says nothing does not hold the next one up longer

    def __init__(self, host: str, port: int, on_link: Callable[[Link], None], name: str):
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self.on_link = on_link
        self.name = name
        self.context = _tls_context(server=True)
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._admit, args=(sock, f"{address[0]}:{address[1]}"),
                             name=f"{self.name}-handshake", daemon=True).start()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        try:
            if self.context is not None:
                sock.settimeout(self.HANDSHAKE_SECONDS)
                sock = self.context.wrap_socket(sock, server_side=True)
                sock.settimeout(None)
        except (OSError, ssl.SSLError):
            sock.close()  # not one of ours, or it went away: nothing was accepted
            return
        self.on_link(Link(sock, peer))

    def close(self) -> None:
        self.listener.close()
