"""A stand-in for cuTensorMapEncodeTiled that records its arguments (for tests and host-cost benchmarks)."""

from __future__ import annotations

from ..runtime.tma import EncodeArgs


class RecordingEncoder:
    """Returns a 128-byte map whose bytes name the call; `calls[i]` holds call i+1's arguments."""

    def __init__(self) -> None:
        self.calls: list[EncodeArgs] = []

    def __call__(self, args: EncodeArgs) -> bytes:
        self.calls.append(args)
        return bytes([len(self.calls) & 0xFF]) * 128

    def of(self, desc: bytes) -> EncodeArgs | None:
        return self.calls[desc[0] - 1] if desc[0] else None
