"""The architecture string of a GGUF from its first bytes.

gguf's GGUFReader maps a whole file; on a remote host only the header travels (the probe sends
the first 64 KiB), so this reads the key/value section itself, using gguf's own type table.
"""

from __future__ import annotations

import struct

from gguf.constants import GGUF_MAGIC, MODEL_ARCH_NAMES, GGUFValueType

SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}

KNOWN_ARCHITECTURES = frozenset(MODEL_ARCH_NAMES.values())


class HeaderError(ValueError):
    pass


def architecture(head: bytes) -> str | None:
    """`general.architecture`, or None when the prefix ends before that key."""
    if len(head) < 24 or struct.unpack_from("<I", head, 0)[0] != GGUF_MAGIC:
        raise HeaderError("not a GGUF file")
    version = struct.unpack_from("<I", head, 4)[0]
    if version < 2:
        raise HeaderError(f"GGUF version {version} is too old")
    n_kv = struct.unpack_from("<Q", head, 16)[0]
    pos = 24
    try:
        for _ in range(n_kv):
            key, pos = read_string(head, pos)
            vtype = GGUFValueType(struct.unpack_from("<I", head, pos)[0])
            pos += 4
            if key == "general.architecture" and vtype == GGUFValueType.STRING:
                return read_string(head, pos)[0]
            pos = _skip(head, pos, vtype)
    except (struct.error, IndexError):
        return None
    return None


def read_string(buf: bytes, pos: int) -> tuple[str, int]:
    n = struct.unpack_from("<Q", buf, pos)[0]
    end = pos + 8 + n
    if end > len(buf):
        raise IndexError
    return buf[pos + 8:end].decode("utf-8", "replace"), end


def _skip(buf: bytes, pos: int, vtype: GGUFValueType) -> int:
    if vtype == GGUFValueType.STRING:
        return read_string(buf, pos)[1]
    if vtype == GGUFValueType.ARRAY:
        item = GGUFValueType(struct.unpack_from("<I", buf, pos)[0])
        count = struct.unpack_from("<Q", buf, pos + 4)[0]
        pos += 12
        if item in SCALAR_FORMATS:
            return pos + count * struct.calcsize(SCALAR_FORMATS[item])
        for _ in range(count):
            pos = _skip(buf, pos, item)
        return pos
    return pos + struct.calcsize(SCALAR_FORMATS[vtype])
