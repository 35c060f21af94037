"""GGUF headers without the weights: the one reader of a GGUF's key/value section.

meshdeploy only ever holds a model's header: the probe sends the first 64 KiB of an Ollama
blob (models: its architecture), the plan fetches a Hub model's header by HTTP Range or a
host's over SFTP (placement.tensors: tensor offsets and the model's shape). gguf's GGUFReader maps a
whole file and builds an object per vocabulary entry (about 15 s for gemma-3's 262k tokens), so
this reads the format itself, with gguf's own type tables, in well under a second, skipping
long arrays.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gguf import GGUFReader


def _gguf_constants():
    """gguf's own type tables (its constants.py, which imports only the standard library),
    loaded without the gguf package: the package's __init__ imports numpy and every reader and
    writer, a third of a second of each command's start on a small CPU, for tables alone.
    Under a name of its own: where the whole package is imported too (tests), its enums are
    another copy, IntEnums equal to these by value."""
    name = "meshdeploy.core._gguf_constants"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("gguf")  # finds the package, runs nothing of it
    spec = importlib.util.spec_from_file_location(
        name, Path(package.submodule_search_locations[0]) / "constants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_CONSTANTS = _gguf_constants()
GGML_QUANT_SIZES = _CONSTANTS.GGML_QUANT_SIZES
GGUF_MAGIC = _CONSTANTS.GGUF_MAGIC
MODEL_ARCH_NAMES = _CONSTANTS.MODEL_ARCH_NAMES
GGMLQuantizationType = _CONSTANTS.GGMLQuantizationType
GGUFValueType = _CONSTANTS.GGUFValueType

SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}

KNOWN_ARCHITECTURES = frozenset(MODEL_ARCH_NAMES.values())

MAX_ARRAY = 4096  # longer arrays (vocabularies, merges) are skipped, not decoded
SKIPPED = object()  # the value of a skipped array


class GgufHeaderError(ValueError):
    """The bytes are not a GGUF header meshdeploy can read."""


@dataclass
class Header:
    """What the GGUF header says: scalar/short-array fields and (name, offset, size) per tensor."""

    fields: dict
    tensors: list  # (name, absolute data offset, bytes)
    data_offset: int


def architecture(head: bytes) -> str | None:
    """`general.architecture`, or None when the prefix ends before that key."""
    if len(head) < 24 or struct.unpack_from("<I", head, 0)[0] != GGUF_MAGIC:
        raise GgufHeaderError("not a GGUF file")
    version = struct.unpack_from("<I", head, 4)[0]
    if version < 2:
        raise GgufHeaderError(f"GGUF version {version} is too old")
    n_kv = struct.unpack_from("<Q", head, 16)[0]
    try:
        for key, value, _ in key_values(head, 24, n_kv):
            if key == "general.architecture" and isinstance(value, str):
                return value
    except (struct.error, IndexError):
        return None
    return None


def parse_header(buf: bytes) -> Header | None:
    """The header in `buf`, or None when `buf` ends before the tensor infos do."""
    if len(buf) >= 4 and struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
        raise GgufHeaderError("not a GGUF file (bad magic)")
    fields: dict = {}
    infos = []
    try:
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise GgufHeaderError(f"GGUF version {version} is too old")
        pos = 24
        for key, value, pos in key_values(buf, pos, n_kv):
            if value is not SKIPPED:
                fields[key] = value
        for _ in range(n_tensors):
            name, pos = read_string(buf, pos)
            n_dims = struct.unpack_from("<I", buf, pos)[0]
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ggml_type, offset))
    except (struct.error, IndexError):
        return None
    except ValueError as exc:  # an unknown value or tensor type: not a GGUF this reads
        raise GgufHeaderError(f"unreadable GGUF header: {exc}") from None
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GgufHeaderError(f"invalid general.alignment {alignment!r}")
    data = pos + (-pos % alignment)
    tensors = []
    for name, dims, ggml_type, offset in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise GgufHeaderError(f"tensor {name}: unknown ggml type {ggml_type}") from None
        n = 1
        for dim in dims:
            n *= dim
        tensors.append((name, data + offset, n * type_size // block))
    return Header(fields, tensors, data)


def header_end(buf: bytes) -> int | None:
    """Offset where tensor data starts (aligned), or None when `buf` ends inside the header."""
    header = parse_header(buf)
    return None if header is None else header.data_offset


def from_reader(reader: GGUFReader) -> Header:
    """The same Header from gguf's own reader (tests compare the two)."""
    fields = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] == GGUFValueType.ARRAY and len(f.data) > MAX_ARRAY:
            continue
        fields[key] = f.contents()
    return Header(fields, [(t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors],
                  int(reader.data_offset))


# ---- the key/value section -----------------------------------------------------------------------

def key_values(buf: bytes, pos: int, count: int):
    """Yield (key, value, position after it) for `count` pairs from `pos`; the value of an
    array longer than MAX_ARRAY is SKIPPED. struct.error or IndexError: `buf` ends first."""
    for _ in range(count):
        key, pos = read_string(buf, pos)
        vtype = GGUFValueType(struct.unpack_from("<I", buf, pos)[0])
        value, pos = read_value(buf, pos + 4, vtype)
        yield key, value, pos


def read_string(buf: bytes, pos: int) -> tuple[str, int]:
    n = struct.unpack_from("<Q", buf, pos)[0]
    end = pos + 8 + n
    if end > len(buf):
        raise IndexError
    return buf[pos + 8:end].decode("utf-8", "replace"), end


def read_value(buf: bytes, pos: int, vtype: GGUFValueType):
    """(value, position after it) of one value of type `vtype` at `pos`."""
    if vtype == GGUFValueType.STRING:
        return read_string(buf, pos)
    if vtype == GGUFValueType.ARRAY:
        item = GGUFValueType(struct.unpack_from("<I", buf, pos)[0])
        count = struct.unpack_from("<Q", buf, pos + 4)[0]
        pos += 12
        if item in SCALAR_FORMATS:
            width = struct.calcsize(SCALAR_FORMATS[item])
            end = pos + count * width
            if end > len(buf):
                raise IndexError
            if count > MAX_ARRAY:
                return SKIPPED, end
            return list(struct.unpack_from(f"<{count}{SCALAR_FORMATS[item][1]}", buf, pos)), end
        if count > MAX_ARRAY and item == GGUFValueType.STRING:
            # A vocabulary: skipped by the strings' lengths alone, none of them decoded (a
            # 262k-token one took most of a 30-host plan, read once per model and attempt).
            unpack = struct.unpack_from
            for _ in range(count):
                pos += 8 + unpack("<Q", buf, pos)[0]
            if pos > len(buf):
                raise IndexError
            return SKIPPED, pos
        values = []
        for _ in range(count):
            v, pos = read_value(buf, pos, item)
            if count <= MAX_ARRAY:
                values.append(v)
        return (values if count <= MAX_ARRAY else SKIPPED), pos
    fmt = SCALAR_FORMATS[vtype]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
