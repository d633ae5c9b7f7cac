"""Typed ZeroMQ sockets: each socket encodes structs with msgspec and decodes exactly its union."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq


@dataclass(frozen=True)
class PortArgs:
    """The IPC addresses of one server instance, all under its own temporary directory."""

    ipc_dir: str
    scheduler_input: str  # tokenizer manager -> scheduler
    detokenizer_input: str  # scheduler -> detokenizer
    tokenizer_input: str  # detokenizer and scheduler -> tokenizer manager

    @classmethod
    def create(cls) -> PortArgs:
        ipc_dir = tempfile.mkdtemp(prefix="berth-ipc-")
        return cls(
            ipc_dir=ipc_dir,
            scheduler_input=f"ipc://{os.path.join(ipc_dir, 'scheduler')}",
            detokenizer_input=f"ipc://{os.path.join(ipc_dir, 'detokenizer')}",
            tokenizer_input=f"ipc://{os.path.join(ipc_dir, 'tokenizer')}",
        )


class Receiver:
    """A bound PULL socket that decodes messages of one union type."""

    def __init__(self, ctx: zmq.Context, address: str, message_type: Any) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(address)
        self.decoder = msgspec.msgpack.Decoder(message_type)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """One message, or None if none arrived within `timeout_ms` (0 = do not wait)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self.decoder.decode(self.socket.recv(copy=False).buffer)

    def recv_all(self, timeout_ms: int = 0) -> list[Any]:
        """Everything already queued, waiting up to `timeout_ms` for the first message."""
        first = self.recv(timeout_ms)
        if first is None:
            return []
        msgs = [first]
        while (msg := self.recv(0)) is not None:
            msgs.append(msg)
        return msgs


class Sender:
    """A connected PUSH socket that encodes msgspec structs."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, msg: msgspec.Struct) -> None:
        self.socket.send(self.encoder.encode(msg), copy=False)
