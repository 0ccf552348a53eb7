"""A GGUF file's header read with every count and length checked against the file's size,
before a GGUF reader (``gguf``'s, through transformers) is given it.

A GGUF file is a header (metadata keys and values, then one entry per tensor: name, shape,
type, offset) and the tensors' data. A reader that trusts the header's numbers reads what a
crafted file tells it to: ``gguf``'s own (0.19) returns a string longer than the file cut
short and takes a misaligned offset or a tensor of 5 dimensions without a word, and fails on
other crafted headers with its own ``IndexError``, ``KeyError`` or numpy errors
(``docs/reliability.md``). ``read_header`` walks the header with each number bounded by the
bytes left in the file (and by limits far above any real model's), so a crafted or cut file
costs at most one pass over its header, and says what is wrong with it in a ``ModelError``:
which key or tensor, at which byte.

>>> # header = read_header(Path("model.gguf"))
>>> # header.metadata["tokenizer.chat_template"]  # scalars and strings; arrays by length
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ken.errors import ModelError

MAGIC = b"GGUF"
#: versions 2 and 3 share one layout (64-bit counts); version 1 (32-bit counts) is obsolete
VERSIONS = (2, 3)
#: the most dimensions a tensor has in ggml
MAX_DIMS = 4
#: arrays of arrays are allowed this deep (ggml's own readers allow none)
MAX_ARRAY_DEPTH = 2
DEFAULT_ALIGNMENT = 32
#: what a header may hold, far above any real model's (tens of keys, thousands of tensors, a
#: chat template of a few KB), so that a crafted header cannot make ken hold more memory than
#: a few times the limits: keys, tensors, and the longest string value kept
MAX_KEYS = 65_536
MAX_TENSORS = 1_000_000
MAX_STRING_BYTES = 16 * 2**20
#: a dimension is an int64 in ggml
MAX_DIM = 2**63 - 1

# the value types of GGUF metadata: struct format of the fixed-size ones
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
          12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the header: its shape as stored (fastest dimension first), ggml type,
    and the byte range of its data relative to the start of the data section."""
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What ``read_header`` found: the version, the metadata's scalar and string values by key
    (an array's value is its length, in ``array_lengths``), the tensors, and where their data
    starts."""
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[TensorEntry, ...]
    data_start: int
    alignment: int


class _Cursor:
    """Reads little-endian values from ``data``, refusing any read past its end."""

    def __init__(self, data: Any, where: str) -> None:
        self.data, self.pos, self.where = data, 0, where

    def left(self) -> int:
        return len(self.data) - self.pos

    def fail(self, what: str) -> ModelError:
        return ModelError(f"{self.where} is not a valid GGUF file: {what} (at byte {self.pos:,} "
                          f"of {len(self.data):,})")

    def take(self, fmt: str, what: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if size > self.left():
            raise self.fail(f"the file ends inside {what}")
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def skip(self, size: int, what: str) -> None:
        if size > self.left():
            raise self.fail(f"{what} runs {size:,} bytes, past the end of the file")
        self.pos += size

    def string(self, what: str, keep: bool = True) -> str | None:
        length = self.take("Q", f"the length of {what}")
        if length > self.left():
            raise self.fail(f"{what} claims {length:,} bytes, more than the {self.left():,} "
                            "left in the file")
        start = self.pos
        self.pos += length
        if not keep:
            return None
        if length > MAX_STRING_BYTES:
            raise self.fail(f"{what} is a string of {length:,} bytes, over ken's limit of "
                            f"{MAX_STRING_BYTES:,}")
        try:
            return bytes(self.data[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None


def _value(cur: _Cursor, kind: int, what: str, depth: int = 0, keep: bool = True) -> Any:
    """One metadata value of type ``kind``: scalars and strings returned (``keep``), an array
    walked element by element where its elements have a length of their own (strings,
    arrays) and skipped whole otherwise; its length returned."""
    if kind in _FIXED:
        value = cur.take(_FIXED[kind], what)
        return value if keep else None
    if kind == STRING:
        return cur.string(what, keep)
    if kind != ARRAY:
        raise cur.fail(f"{what} has an unknown value type {kind}")
    if depth >= MAX_ARRAY_DEPTH:
        raise cur.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    inner = cur.take("I", f"the element type of {what}")
    count = cur.take("Q", f"the length of {what}")
    if inner in _FIXED:
        cur.skip(count * struct.calcsize("<" + _FIXED[inner]), f"{what} ({count:,} elements)")
        return count
    if inner not in (STRING, ARRAY):
        raise cur.fail(f"{what} has elements of an unknown value type {inner}")
    smallest = 8 if inner == STRING else 12  # a length (and an element type)
    if count * smallest > cur.left():
        raise cur.fail(f"{what} claims {count:,} elements, more than the {cur.left():,} bytes "
                       "left in the file can hold")
    if inner == STRING:
        _skip_strings(cur, count, what)
    else:
        for i in range(count):
            _value(cur, inner, f"element {i} of {what}", depth + 1, keep=False)
    return count


_LENGTH = struct.Struct("<Q")


def _skip_strings(cur: _Cursor, count: int, what: str) -> None:
    """Past ``count`` strings (a vocabulary: 10^5 of them), each length checked."""
    data, pos, end = cur.data, cur.pos, len(cur.data)
    for i in range(count):
        if pos + 8 > end:
            cur.pos = pos
            raise cur.fail(f"the file ends inside the length of element {i} of {what}")
        length = _LENGTH.unpack_from(data, pos)[0]
        if length > end - pos - 8:
            cur.pos = pos + 8
            raise cur.fail(f"element {i} of {what} claims {length:,} bytes, more than the "
                           f"{end - pos - 8:,} left in the file")
        pos += 8 + length
    cur.pos = pos


def _tensor_bytes(ggml_type: int, shape: tuple[int, ...], cur: _Cursor, name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name!r} has an unknown ggml type {ggml_type}") from None
    first = shape[0] if shape else 1  # a 0-d tensor holds one element
    if first % block:
        raise cur.fail(f"tensor {name!r}'s first dimension {first:,} is not a multiple of "
                       f"its type's block of {block}")
    elements = 1
    for d in shape:
        elements *= d
    return elements // block * size


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at ``path``, every count, length, shape and offset checked
    against the file's size (the data is not read). ModelError names the file and what is
    wrong."""
    path = Path(path)
    where = str(path)
    try:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ModelError(f"{where} is not a valid GGUF file: it is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _walk(_Cursor(data, where))
    except OSError as exc:
        raise ModelError(f"{where} cannot be read ({exc.strerror or exc})") from None


def _walk(cur: _Cursor) -> GGUFHeader:
    if cur.left() < 4 or bytes(cur.data[:4]) != MAGIC:
        raise cur.fail("it does not start with the GGUF magic number")
    cur.pos = 4
    version = cur.take("I", "the version")
    if version not in VERSIONS:
        raise cur.fail(f"version {version} (ken reads GGUF versions "
                       f"{' and '.join(map(str, VERSIONS))}, little-endian)")
    n_tensors = cur.take("Q", "the tensor count")
    n_keys = cur.take("Q", "the metadata count")
    if n_keys > MAX_KEYS or n_tensors > MAX_TENSORS:
        raise cur.fail(f"it claims {n_keys:,} metadata keys and {n_tensors:,} tensors, over "
                       f"ken's limits of {MAX_KEYS:,} and {MAX_TENSORS:,}")
    # the smallest key: a length, a type and a one-byte value; the smallest tensor entry: a
    # name's length, the dimension count, the type and the offset
    if n_keys * 13 + n_tensors * 24 > cur.left():
        raise cur.fail(f"it claims {n_keys:,} metadata keys and {n_tensors:,} tensors, more "
                       f"than the {cur.left():,} bytes left can hold")
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for i in range(n_keys):
        key = cur.string(f"the name of metadata key {i}")
        assert key is not None
        if key in metadata or key in lengths:
            raise cur.fail(f"metadata key {key!r} appears twice")
        kind = cur.take("I", f"the value type of {key!r}")
        value = _value(cur, kind, f"metadata {key!r}")
        if kind == ARRAY:
            lengths[key] = value
        else:
            metadata[key] = value
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment!r}, not a power of two")
    tensors, names = [], set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        assert name is not None
        if name in names:
            raise cur.fail(f"tensor {name!r} appears twice")
        names.add(name)
        dims = cur.take("I", f"the dimension count of tensor {name!r}")
        if dims > MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {dims} dimensions (at most {MAX_DIMS})")
        shape = tuple(cur.take("Q", f"the shape of tensor {name!r}") for _ in range(dims))
        if any(d > MAX_DIM for d in shape):
            raise cur.fail(f"tensor {name!r} has a dimension over 2^63 - 1, shape {shape}")
        ggml_type = cur.take("I", f"the type of tensor {name!r}")
        offset = cur.take("Q", f"the offset of tensor {name!r}")
        if offset % alignment:
            raise cur.fail(f"tensor {name!r}'s data offset {offset:,} is not a multiple of the "
                           f"alignment {alignment}")
        tensors.append(TensorEntry(name, shape, ggml_type, offset,
                                   _tensor_bytes(ggml_type, shape, cur, name)))
    data_start = -(-cur.pos // alignment) * alignment
    room = len(cur.data) - data_start
    for t in tensors:
        if t.offset + t.nbytes > room:
            raise cur.fail(f"tensor {t.name!r}'s data ({t.nbytes:,} bytes at offset "
                           f"{t.offset:,} of the data section) runs past the end of the file, "
                           f"whose data section holds {max(room, 0):,} bytes")
    return GGUFHeader(version, metadata, lengths, tuple(tensors), data_start, alignment)
