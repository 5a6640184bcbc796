"""A point-to-point transport that damages one received bucket, for the weight-sync verification tests."""

from __future__ import annotations

from typing import Any

import torch


def corrupting_transport(group: Any, nth: int, byte: int | None = None) -> Any:
    """`megarl.hybrid.executor.P2PTransport` over `group` that flips one bit of the `nth` buffer this
    rank receives (0-based, in the order received), after the transfer and before it is unpacked:
    byte `byte` modulo the buffer's size, or its middle byte."""
    from megarl.hybrid.executor import P2PTransport

    class CorruptingTransport(P2PTransport):
        def __init__(self) -> None:
            super().__init__(group)
            self.received = 0
            self.posted: dict[int, list[torch.Tensor]] = {}

        def start(self, sends: dict, recvs: dict) -> Any:
            handle = super().start(sends, recvs)
            self.posted[id(handle)] = list(recvs.values())
            return handle

        def wait(self, handle: Any) -> None:
            super().wait(handle)
            for buf in self.posted.pop(id(handle), []):
                if self.received == nth:
                    raw = buf.view(torch.uint8)
                    raw[(raw.numel() // 2 if byte is None else byte) % raw.numel()] ^= 0x04
                self.received += 1

    return CorruptingTransport()
