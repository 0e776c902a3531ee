"""The link between a forwarder and its slot's engine host: length-prefixed frames over a Unix socket.

Frame = magic ``SFEH`` | type u8 | body length u32 | body (little-endian, at most ``MAX_FRAME``).
A forwarder opens with ``F_HELLO`` (JSON: session id, settings digest, pid, seat); the host answers
``F_OK`` (JSON: shard and engine info) once its engine is ready, or ``F_ERR`` (text, or JSON with
``mismatch`` when the host serves another session). Then each ``F_TASK`` (the executor's identity as
JSON + the task payload) gets ``F_OK`` (the encoded result) or ``F_ERR`` (the error text).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from pathlib import Path
from typing import Optional

from sut.errors import EngineError

_FRAME = struct.Struct("<4sBI")
_FRAME_MAGIC = b"SFEH"
F_HELLO, F_TASK, F_OK, F_ERR = 1, 2, 3, 4
MAX_FRAME = 64 << 20


class HostMismatch(RuntimeError):
    """The slot's engine host belongs to another session or other settings."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("engine host closed the connection")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, ftype: int, body: bytes) -> None:
    sock.sendall(_FRAME.pack(_FRAME_MAGIC, ftype, len(body)) + body)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    magic, ftype, n = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if magic != _FRAME_MAGIC or n > MAX_FRAME:
        raise ConnectionError("bad frame from the engine host")
    return ftype, _recv_exact(sock, n)


async def arecv_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    magic, ftype, n = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    if magic != _FRAME_MAGIC or n > MAX_FRAME:
        raise ConnectionError("bad frame from a forwarder")
    return ftype, await reader.readexactly(n)


def asend_frame(writer: asyncio.StreamWriter, ftype: int, body: bytes) -> None:
    writer.write(_FRAME.pack(_FRAME_MAGIC, ftype, len(body)) + body)


def pack_task(ident: dict, data: bytes) -> bytes:
    ib = json.dumps(ident).encode()
    return struct.pack("<I", len(ib)) + ib + data


def unpack_task(body: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<I", body, 0)
    return json.loads(body[4:4 + n]), body[4 + n:]


class EngineClient:
    """Blocking connection from a forwarder to its engine host (one task at a time).

    The constructor connects, says hello and waits up to ``timeout`` s for the host's engine.
    Raises ``HostMismatch`` (another session's host), ``EngineError`` (the host failed), ``OSError``
    / ``ConnectionError`` (no host listening) or ``socket.timeout``.
    """

    def __init__(self, sock_path: Path, hello: dict, timeout: float):
        self.sock_path, self.hello = sock_path, hello
        self.broken: Optional[str] = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(5.0)
            self.sock.connect(str(sock_path))
            send_frame(self.sock, F_HELLO, json.dumps(hello).encode())
            self.sock.settimeout(timeout)  # the host answers once its engine is ready
            ftype, body = recv_frame(self.sock)
        except BaseException:
            self.sock.close()
            raise
        if ftype == F_ERR:
            self.sock.close()
            text = body.decode("utf-8", "replace")
            try:
                mismatch = bool(json.loads(text).get("mismatch"))
            except (json.JSONDecodeError, AttributeError):
                mismatch = False
            raise HostMismatch(text) if mismatch else EngineError(text)
        info = json.loads(body)
        self.shard, self.engine_info = info["shard"], info["engine"]
        self.sock.settimeout(None)

    def run(self, data: bytes, ident: dict) -> bytes:
        """Relay one task; the encoded result. ``EngineError`` once the host is gone, ``RuntimeError``
        with the host's text when the task failed there."""
        if self.broken:
            raise EngineError(self.broken)
        try:
            send_frame(self.sock, F_TASK, pack_task(ident, data))
            ftype, body = recv_frame(self.sock)
        except (OSError, ConnectionError) as e:
            self.broken = (f"engine host of shard {self.shard['key']} (pid {self.shard['host_pid']}) is gone: {e}; "
                           "this executor cannot serve tasks any more")
            raise EngineError(self.broken) from None
        if ftype == F_ERR:
            raise RuntimeError(body.decode("utf-8", "replace"))
        return body

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
