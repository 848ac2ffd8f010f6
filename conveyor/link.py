"""Links: the one stream a service receives every engine step (the worker's steps, the detokenizer's token
batches, the frontend's deltas), as protobuf messages after their length on one connection. The format
and why not gRPC: ``protos/conveyor/v1/link.proto``. A message costs one ``send`` and one wake of the thread
(or event loop) that reads it (``bench/grpc_hop.py`` measures both). What the streams need from gRPC is kept:
mutual TLS with the internal certificates (``CONVEYOR_INTERNAL_TLS_DIR``), a size limit, an error that ends
the link with a status name and the sequence at fault, timeouts, and a broken connection seen at once.
Everything else (health, reflection, the ``Link`` call that names the port) stays on the service's gRPC port.

A service listens twice: on its TCP port, and (on Linux) on an abstract Unix socket of a random name. A caller
in the same network namespace (the same host under ``conveyor up``, the same pod) connects to the socket and
skips TLS: the kernel tells each end the other's user (``SO_PEERCRED``), a peer that is not this process's user
is refused, and the caller first sends the socket's key, which only the ``Link`` call's answer holds (under
internal TLS only holders of the certificates can make that call), so the socket admits whom TCP would. TLS
over the loopback cost more CPU than anything else on a link (Python's ``ssl`` a message each way, asyncio's
pure-Python TLS on the frontend's event loop): at one stream the pipeline spent about twice the CPU a token with
it (``bench/pipeline_ceiling.py``). A caller elsewhere finds no such socket and takes TCP, with TLS when the
certificates are set.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from conveyor.grpc_util import INTERNAL_TLS_NAME, MAX_MESSAGE_BYTES, internal_tls_folder
from conveyor.v1 import link_pb2

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IB")
MESSAGE, ERROR = 0, 1
LOCAL = sys.platform == "linux"  # abstract Unix sockets are Linux's
PEER_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED's struct ucred: pid, uid, gid
KEY_BYTES = 16  # the local socket's key, which a caller sends first


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
    vanished (no reset ever comes) learns it within ~35 s instead of TCP's hours. Nothing on a Unix socket (its
    peer is on this host: the kernel closes its end when it dies)."""
    if sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class LocalSocket:
    """A listening abstract Unix socket of a new random ``name`` and its ``key`` (None, "" and b"" off Linux, or
    where a sandbox forbids it: the service then takes links over TCP alone). A caller must run as this process's
    user and send the key first: the name shows in /proc/net/unix, the key only in the answer to the ``Link`` call,
    which under internal TLS only a holder of the certificates can make, so the socket admits whom TCP would."""

    def __init__(self):
        self.listener: socket.socket | None = None
        self.name, self.key = "", b""
        if not LOCAL:
            return
        name = f"conveyor-link-{secrets.token_hex(16)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + name)
            listener.listen()
        except OSError as exc:
            listener.close()
            log.warning("no local link socket (%s); links go over TCP", exc)
            return
        self.listener, self.name, self.key = listener, name, secrets.token_bytes(KEY_BYTES)

    def admits(self, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


def fill(sock: socket.socket, buffer: bytearray, peer: str) -> None:
    """Read exactly ``len(buffer)`` bytes into it; ``ConnectionError`` when the peer closes first."""
    view = memoryview(buffer)
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError(f"{peer} closed the link")
        view = view[got:]


def same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of a Unix socket runs as this one's user (root's peers: root)."""
    _pid, uid, _gid = PEER_CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              PEER_CREDENTIALS.size))
    return uid == os.geteuid()


def connect_local(name: str, key: bytes, timeout: float) -> socket.socket | None:
    """A connection to the abstract Unix socket ``name``, its ``key`` sent, or None where it cannot be reached
    (another network namespace: another host or container) or it is held by another user (two containers of one
    pod may run as two users: the service would refuse this process there too), so the caller takes TCP."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
        if not same_user(sock):
            sock.close()
            return None
        sock.sendall(key)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


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
        self._poll: select.poll | None = None  # ``ready``'s

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 5.0, local_name: str = "", local_key: bytes = b"") -> Link:
        """A link to the abstract Unix socket ``local_name`` (sending its ``local_key``) where it can be reached,
        else to ``host:port`` (over mutual TLS when the internal certificates are set)."""
        if local_name and LOCAL:
            sock = connect_local(local_name, local_key, timeout)
            if sock is not None:
                return cls(sock, f"{host}:{port} (local)")
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
        where = ask(link_pb2.LinkRequest(), timeout=timeout)
        if not where.port:
            raise ConnectionError(f"the service at {address} names no link port")
        return cls.connect(host_of(address), where.port, timeout, where.local_name, where.local_key)

    def send(self, message) -> None:
        """Send a protobuf message. A peer that has closed the link is seen by the next ``receive``, which first
        reads what the peer sent before it closed (an error frame: its ``LinkError``, culprit included), as over
        TCP, where a send into a connection its peer closed succeeds and only the reply tells; a Unix socket
        refuses the send at once. Raises ``OSError`` for any other failure."""
        try:
            self.sock.sendall(frame(message))
        except (BrokenPipeError, ConnectionResetError):
            pass  # every message is answered, so its receive raises what went wrong

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

    def ready(self) -> bool:
        """Whether ``receive`` would find something at once (a message, an error, or the peer gone) instead of
        waiting: bytes in the socket, or decrypted ones TLS holds back."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.sock, select.POLLIN)
        return bool(self._poll.poll(0))

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
        fill(self.sock, buffer, self.peer)

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
    """Accepts links on ``host:port`` (0: a free port, in ``port``) and on an abstract Unix socket (``local``), and
    hands each, connected and through its TLS handshake or its user and key checked (on a thread of its own, so a
    slow one holds up no other), to ``on_link``."""

    HANDSHAKE_SECONDS = 10.0  # a peer that connects and says nothing does not hold the next one up longer

    def __init__(self, host: str, port: int, on_link: Callable[[Link], None], name: str):
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self.local = LocalSocket()
        self.on_link = on_link
        self.name = name
        self.context = _tls_context(server=True)
        threading.Thread(target=self._accept, args=(self.listener,), name=f"{name}-accept", daemon=True).start()
        if self.local.listener is not None:
            threading.Thread(target=self._accept, args=(self.local.listener,), name=f"{name}-accept-local",
                             daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, address = listener.accept()
            except OSError:
                return  # closed
            if sock.family == socket.AF_UNIX:
                threading.Thread(target=self._admit_local, args=(sock,), name=f"{self.name}-handshake",
                                 daemon=True).start()
                continue
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

    def _admit_local(self, sock: socket.socket) -> None:
        try:
            ours = same_user(sock)
            if ours:
                sock.settimeout(self.HANDSHAKE_SECONDS)
                key = bytearray(KEY_BYTES)
                fill(sock, key, f"local {self.local.name}")
                ours = self.local.admits(bytes(key))
                sock.settimeout(None)
        except OSError:  # ConnectionError and timeouts too
            ours = False
        if not ours:
            log.warning("%s link: refused a local peer (another user, or without the key)", self.name)
            sock.close()
            return
        self.on_link(Link(sock, f"local {self.local.name}"))

    def close(self) -> None:
        self.listener.close()
        self.local.close()


class LinkService:
    """What a service's gRPC servicer inherits to name its link's port and local socket (the ``Link`` call of
    link.proto)."""

    link_server: LinkServer | LoopLinks | None = None  # set once the link listens (``listening``)

    def listening(self, links: LinkServer | LoopLinks) -> None:
        """Name ``links``' port and local socket (and its key) from now on."""
        self.link_server = links

    @property
    def link_port(self) -> int:
        return self.link_server.port if self.link_server is not None else 0

    def Link(self, request, context):
        if self.link_server is None:
            return link_pb2.LinkResponse()  # no port yet: the caller is told so
        local = self.link_server.local
        return link_pb2.LinkResponse(port=self.link_server.port, local_name=local.name, local_key=local.key)


class LoopLinks:
    """``serve_on_loop``'s listeners: the TCP one (``port``) and the abstract Unix one (``local``)."""

    def __init__(self, servers: list[asyncio.Server], local: LocalSocket):
        self.servers = servers
        self.port = servers[0].sockets[0].getsockname()[1]
        self.local = local

    def close(self) -> None:
        for server in self.servers:
            server.close()


async def serve_on_loop(host: str, port: int, parse: Callable[[bytes], object], answer: Callable[[object], object],
                        name: str) -> LoopLinks:
    """Links served on the running event loop (the frontend's), on ``host:port`` and an abstract Unix socket: each
    message parsed with ``parse`` and answered, in order, with ``answer(message)`` (a plain function that must not
    block the loop). A message that does not parse ends its link with INVALID_ARGUMENT."""

    local = LocalSocket()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            if sock.family == socket.AF_UNIX and not (
                    same_user(sock) and local.admits(await asyncio.wait_for(
                        reader.readexactly(KEY_BYTES), LinkServer.HANDSHAKE_SECONDS))):
                log.warning("%s link: refused a local peer (another user, or without the key)", name)
                return
            keep_alive(sock)
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
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, TimeoutError):
            pass  # the peer went away (or said nothing in time)
        except asyncio.CancelledError:
            pass  # the loop is shutting down: this task is the link's whole life, nothing above it waits
        except Exception:  # noqa: BLE001 - a bug in answer: this link ends, the others go on
            log.exception("%s link failed", name)
        finally:
            writer.close()

    tls = _tls_context(server=True)
    servers = [await asyncio.start_server(serve, host, port, ssl=tls,
                                          ssl_handshake_timeout=LinkServer.HANDSHAKE_SECONDS if tls else None)]
    if local.listener is not None:
        servers.append(await asyncio.start_unix_server(serve, sock=local.listener))
    return LoopLinks(servers, local)
