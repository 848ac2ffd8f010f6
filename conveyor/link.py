"""Links: the one stream a service receives every engine step (the worker's steps, the detokenizer's token
batches, the frontend's deltas), as protobuf messages after their length on one TCP connection. The format
and why not gRPC: ``protos/conveyor/v1/link.proto``. A message costs one ``send`` and one wake of the thread
(or event loop) that reads it (``bench/grpc_hop.py`` measures both). What the streams need from gRPC is kept:
mutual TLS with the internal certificates (``CONVEYOR_INTERNAL_TLS_DIR``), a size limit, an error that ends
the link with a status name and the sequence at fault, timeouts, and a broken connection seen at once.
Everything else (health, reflection, the ``Link`` call that names the port) stays on the service's gRPC port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from conveyor.grpc_util import INTERNAL_TLS_NAME, MAX_MESSAGE_BYTES, internal_tls_folder
from conveyor.v1 import link_pb2

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IB")
MESSAGE, ERROR = 0, 1


def frame(message, kind: int = MESSAGE) -> bytes:
    """A message (or, with ERROR, the bytes of an error) as it goes on the wire."""
    data = message if kind == ERROR else message.SerializeToString()
    return HEADER.pack(len(data), kind) + data


def error_frame(code: str, details: str, culprit: str | None = None) -> bytes:
    return frame(json.dumps({"code": code, "details": details, "culprit": culprit}).encode(), ERROR)


def host_of(address: str) -> str:
    """The host of a ``host:port`` address (``[::1]:50053``: ``::1``)."""
    return address.rsplit(":", 1)[0].strip("[]")


class LinkError(Exception):
    """The peer ended the link with an error: ``code`` (a gRPC status name, e.g. INVALID_ARGUMENT), ``details``,
    and ``culprit`` (the sequence at fault, when the peer could tell)."""

    def __init__(self, code: str, details: str, culprit: str | None = None):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
        self.culprit = culprit


def keep_alive(sock: socket.socket) -> None:
    """No delay for small messages, and TCP keepalive probes: a thread blocked reading a link whose peer's host
    vanished (no reset ever comes) learns it within ~35 s instead of TCP's hours."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


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
        keep_alive(sock)
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

    @classmethod
    def dial(cls, ask: Callable, address: str, timeout: float = 5.0) -> Link:
        """A link to the service whose gRPC server is at ``address``: ``ask`` is its stub's ``Link`` method,
        which names the port (on the same host)."""
        port = ask(link_pb2.LinkRequest(), timeout=timeout).port
        if not port:
            raise ConnectionError(f"the service at {address} names no link port")
        return cls.connect(host_of(address), port, timeout)

    def send(self, message) -> None:
        """Send a protobuf message (raises ``OSError`` when the connection is gone)."""
        self.sock.sendall(frame(message))

    def fail(self, code: str, details: str, culprit: str | None = None) -> None:
        """End the link with an error the peer's ``receive`` raises as ``LinkError``."""
        try:
            self.sock.sendall(error_frame(code, details, culprit))
        except OSError:
            pass  # the peer is gone: nobody to tell
        self.close()

    def receive(self, parse: Callable[[bytes], object], timeout: float | None = None):
        """The next message, parsed with ``parse`` (a message class's ``FromString``). Raises ``LinkError``
        when the peer ended the link with an error, ``ConnectionError`` when it closed or broke,
        ``TimeoutError`` after ``timeout`` seconds without a whole message (the link is then unusable), and
        whatever ``parse`` raises for bytes that are not a message (the caller's to answer)."""
        self.sock.settimeout(timeout)
        try:
            self._read_into(self._header)
            size, kind = HEADER.unpack(self._header)
            if size > MAX_MESSAGE_BYTES or kind not in (MESSAGE, ERROR):
                raise ConnectionError(f"{self.peer} sent a {size}-byte frame of kind {kind} (frames are messages or "
                                      f"errors of at most {MAX_MESSAGE_BYTES} bytes)")
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

    def answer_each(self, what: str, parse: Callable[[bytes], object], answer: Callable[[object], object],
                    refuse: Callable[[Exception], tuple[str, str, str | None]]) -> None:
        """Answer the peer's messages in order, on this thread, until it goes away or one fails; then close the link.
        A message that does not parse ends the link with INVALID_ARGUMENT ("malformed ``what``"); one that
        ``answer`` raises for, with ``refuse(exc)``: (code, details, culprit). Nothing after it is read."""
        try:
            while True:
                try:
                    message = self.receive(parse)
                except (ConnectionError, OSError, LinkError):
                    return  # the peer went away or reconnected
                except Exception as exc:  # noqa: BLE001 - bytes that are not a message: the peer's error
                    self.fail("INVALID_ARGUMENT", f"malformed {what}: {exc}")
                    return
                try:
                    reply = answer(message)
                except Exception as exc:  # noqa: BLE001 - this message failed: the link ends, the service goes on
                    self.fail(*refuse(exc))
                    return
                self.send(reply)
        except OSError:
            pass  # the answer could not go: the peer went away
        finally:
            self.close()

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


class Peer:
    """The link to one service, dialled through its ``Link`` call (``ask``, at ``address``) on first use and
    again after ``drop``."""

    def __init__(self, ask: Callable, address: str, timeout: float = 5.0):
        self.ask, self.address, self.timeout = ask, address, timeout
        self.link: Link | None = None

    def open(self) -> Link:
        if self.link is None:
            self.link = Link.dial(self.ask, self.address, self.timeout)
        return self.link

    def drop(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def call(self, message, parse: Callable[[bytes], object], timeout: float | None):
        """Send ``message`` and wait for its answer; on any failure the link is dropped (the next call dials
        anew) and the error raised."""
        try:
            link = self.open()
            link.send(message)
            return link.receive(parse, timeout)
        except BaseException:
            self.drop()
            raise


class LinkServer:
    """Accepts links on ``host:port`` (0: a free port, in ``port``) and hands each, connected and through its
    TLS handshake (on a thread of its own, so a slow one holds up no other), to ``on_link``."""

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


class LinkService:
    """What a service's gRPC servicer inherits to name its link's port (the ``Link`` call of link.proto)."""

    link_port = 0  # set once the link listens

    def Link(self, request, context):
        return link_pb2.LinkResponse(port=self.link_port)


async def serve_on_loop(host: str, port: int, parse: Callable[[bytes], object], answer: Callable[[object], object],
                        name: str) -> asyncio.Server:
    """Links served on the running event loop (the frontend's): each message parsed with ``parse`` and answered,
    in order, with ``answer(message)`` (a plain function that must not block the loop). A message that does not
    parse ends its link with INVALID_ARGUMENT. The server's port: ``server.sockets[0].getsockname()[1]``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep_alive(writer.get_extra_info("socket"))
        try:
            while True:
                size, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
                if size > MAX_MESSAGE_BYTES or kind != MESSAGE:
                    writer.write(error_frame("INVALID_ARGUMENT", f"a {size}-byte frame of kind {kind}: only messages "
                                             f"(kind {MESSAGE}) of at most {MAX_MESSAGE_BYTES} bytes are taken"))
                    break
                data = await reader.readexactly(size)
                try:
                    message = parse(data)
                except Exception as exc:  # noqa: BLE001 - bytes that are not a message: the peer's error
                    writer.write(error_frame("INVALID_ARGUMENT", f"malformed message: {exc}"))
                    break
                writer.write(frame(answer(message)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass  # the peer went away
        except asyncio.CancelledError:
            pass  # the loop is shutting down: this task is the link's whole life, nothing above it waits
        except Exception:  # noqa: BLE001 - a bug in answer: this link ends, the others go on
            log.exception("%s link failed", name)
        finally:
            writer.close()

    tls = _tls_context(server=True)
    return await asyncio.start_server(serve, host, port, ssl=tls,
                                      ssl_handshake_timeout=LinkServer.HANDSHAKE_SECONDS if tls else None)
