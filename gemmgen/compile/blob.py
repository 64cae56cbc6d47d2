"""A cache entry as one immutable byte string: what the remote tier stores and ranks exchange.

Layout: a magic line, a 4-byte little-endian header length, a JSON header (format, key, each
file's name, size and SHA-256, the metadata), then the files' bytes in the header's order. The
header names its key, so a value stored under another key (or a truncated one) is refused by
`unpack` before the caller's own check (`validate.kernel_problem`) runs.
"""

from __future__ import annotations

import hashlib
import json
import struct

from .cache import Artifact
from .validate import digest_problem

MAGIC = b"gemmgen-artifact\n"
_FORMAT = 1
_LENGTH = struct.Struct("<I")


def pack(key: str, art: Artifact) -> bytes:
    names = sorted(art.files)
    header = {"format": _FORMAT, "key": key, "meta": art.meta,
              "files": [[n, len(art.files[n]), hashlib.sha256(art.files[n]).hexdigest()] for n in names]}
    head = json.dumps(header, sort_keys=True).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(head)), head, *(art.files[n] for n in names)])


def unpack(data: bytes, key: str) -> tuple[Artifact | None, str | None]:
    """(the artifact, None), or (None, what is wrong with `data` as the entry for `key`)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        return None, f"it is a {type(data).__name__}, not bytes"
    data = bytes(data)
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
        return None, "it is not a gemmgen artifact (no header)"
    start = len(MAGIC) + _LENGTH.size
    (size,) = _LENGTH.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start:start + size])
        files_spec = [(str(n), int(s), str(d)) for n, s, d in header["files"]]
        meta = header["meta"]
    except (ValueError, KeyError, TypeError) as e:
        return None, f"its header is unreadable ({e})"
    if header.get("format") != _FORMAT or not isinstance(meta, dict):
        return None, f"it is not a format-{_FORMAT} artifact"
    if header.get("key") != key:
        return None, f"it records key {str(header.get('key'))[:16]}..., not {key[:16]}..."
    files, offset = {}, start + size
    for name, length, _ in files_spec:
        files[name] = data[offset:offset + length]
        offset += length
    if offset != len(data):
        return None, f"it holds {len(data)} bytes, its header accounts for {offset} (truncated or padded)"
    problem = digest_problem({n: d for n, _, d in files_spec}, files)
    return (None, problem) if problem else (Artifact(files, meta), None)
