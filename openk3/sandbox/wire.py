"""The message framing between the backend, the zygote and each supervisor, over Unix stream sockets: a 4-byte length,
a JSON header, then the raw byte blobs the header lists (file contents, stdout/stderr: no base64), with file
descriptors riding along on the first byte where a message carries them. Stdlib only and no sibling imports: the
zygote loads this file as a top-level module.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct

_LEN = struct.Struct(">I")
MAX_FDS = 4


class Eof(ConnectionError):
    """The peer closed the socket (the process on the other side is gone)."""


def send(sock: socket.socket, header: dict, blobs: tuple[bytes, ...] | list[bytes] = (), fds: list[int] = ()) -> None:
    header = dict(header, blobs=[len(b) for b in blobs]) if blobs else header
    head = json.dumps(header, separators=(",", ":")).encode()
    first = _LEN.pack(len(head)) + head
    if fds:
        socket.send_fds(sock, [first], list(fds))
    else:
        sock.sendall(first)
    for blob in blobs:
        sock.sendall(blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise Eof("peer closed the connection")
        got += k
    return bytes(buf)


def recv(sock: socket.socket, want_fds: bool = False) -> tuple[dict, list[bytes], list[int]]:
    """One message: (header, blobs, fds). Raises Eof if the peer is gone, socket.timeout past the socket's timeout."""
    fds: list[int] = []
    if want_fds:
        # The descriptors arrive with the first bytes of the message: read the length prefix with recvmsg.
        size = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        data, ancdata, _flags, _addr = sock.recvmsg(_LEN.size, size)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        for fd in fds:
            os.set_inheritable(fd, False)
        if not data:
            raise Eof("peer closed the connection")
        data += _recv_exact(sock, _LEN.size - len(data))
    else:
        data = _recv_exact(sock, _LEN.size)
    header = json.loads(_recv_exact(sock, _LEN.unpack(data)[0]))
    blobs = [_recv_exact(sock, n) for n in header.pop("blobs", ())]
    return header, blobs, fds
