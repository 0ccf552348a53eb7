"""A GGUF file's header checked against its size before a reader is given it
(``ken/models/gguf_file.py``, issue 38 item 2): a file written by the reference writer
(``gguf.GGUFWriter``) reads as the reference reader reads it; every cut of it, and every
crafted count, length, type, shape and offset, ends in a ModelError naming the file and what is
wrong, at once, and ``ken models add`` refuses such a file before converting anything."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

from ken.errors import ModelError
from ken.models import registry
from ken.models.gguf_file import DEFAULT_ALIGNMENT, read_header


def reference_file(path: Path) -> Path:
    """A small GGUF of every metadata kind, written by ``gguf``'s own writer."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("test.count", 7)
    w.add_float32("test.scale", 0.5)
    w.add_bool("test.flag", True)
    w.add_string("tokenizer.chat_template", "{{ messages[0]['content'] }}")
    w.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<s>"])
    w.add_array("test.ints", [1, 2, 3])
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("output.weight", np.ones((2, 5), dtype=np.float16))
    w.add_tensor("scale", np.array(1.5, dtype=np.float32))  # 0-d: one element, no dimension
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_reference_file_reads_as_the_reference_reader_reads_it(tmp_path: Path) -> None:
    import gguf

    path = reference_file(tmp_path / "ok.gguf")
    header = read_header(path)
    assert header.version == 3 and header.alignment == DEFAULT_ALIGNMENT
    assert header.metadata["test.count"] == 7 and header.metadata["test.flag"] is True
    assert header.metadata["test.scale"] == 0.5
    assert header.metadata["tokenizer.chat_template"] == "{{ messages[0]['content'] }}"
    assert header.metadata["general.architecture"] == "llama"
    assert header.array_lengths == {"tokenizer.ggml.tokens": 4, "test.ints": 3}
    reader = gguf.GGUFReader(path)
    assert header.data_start == reader.data_offset
    assert [(t.name, t.shape, t.ggml_type, t.nbytes) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.n_bytes))
        for t in reader.tensors]
    assert [header.data_start + t.offset for t in header.tensors] == [
        int(t.data_offset) for t in reader.tensors]


def test_every_cut_of_a_file_is_refused_with_a_model_error(tmp_path: Path) -> None:
    """Brute force over every length the file could be cut to: refused exactly when the cut
    removes header bytes or tensor data (padding after the last tensor is not needed)."""
    path = reference_file(tmp_path / "ok.gguf")
    whole = path.read_bytes()
    header = read_header(path)
    needed = header.data_start + max(t.offset + t.nbytes for t in header.tensors)
    cut = tmp_path / "cut.gguf"
    for size in range(len(whole)):
        cut.write_bytes(whole[:size])
        if size >= needed:
            read_header(cut)
            continue
        with pytest.raises(ModelError, match=rf"{re.escape(str(cut))} is not a valid GGUF file: "
                           ) as info:
            read_header(cut)
        assert "it is empty" in str(info.value) if size == 0 else "at byte" in str(info.value)


# --------------------------------------------------------------------------- crafted files

def s(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def kv(key: str | bytes, kind: int, value: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + value


def tensor(name: str, shape: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    return (s(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
            + struct.pack("<IQ", ggml_type, offset))


def gguf_bytes(kvs: list[bytes], tensors: tuple[bytes, ...] | list[bytes] = (), version: int = 3,
               counts: tuple[int, int] | None = None, data: int = 64) -> bytes:
    n_tensors, n_kvs = counts or (len(tensors), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kvs) + b"".join(kvs) \
        + b"".join(tensors)
    return head + bytes(-len(head) % DEFAULT_ALIGNMENT) + bytes(data)


U32, STR, ARR = 4, 8, 9
ONE = kv("general.architecture", STR, s("llama"))
CRAFTED = {
    "version 1": (gguf_bytes([ONE], version=1), "version 1 \\(ken reads GGUF versions 2 and 3"),
    "2^62 keys": (gguf_bytes([ONE], counts=(0, 2**62)),
                  "claims 4,611,686,018,427,387,904 metadata keys"),
    "65,537 keys": (gguf_bytes([ONE] * 3, counts=(0, 65_537)),
                    "65,537 metadata keys and 0 tensors, over ken's limits of 65,536"),
    "a 16-MiB string": (gguf_bytes([kv("a", STR, s(bytes(16 * 2**20 + 1)))]),
                        "metadata 'a' is a string of 16,777,217 bytes, over ken's limit"),
    "a key longer than the file": (gguf_bytes([struct.pack("<Q", 2**40)]),
                                   "the name of metadata key 0 claims 1,099,511,627,776 bytes"),
    "a string longer than the file": (gguf_bytes([kv("a", STR, struct.pack("<Q", 2**63))]),
                                      "metadata 'a' claims 9,223,372,036,854,775,808 bytes"),
    "2^61 strings": (gguf_bytes([kv("t", ARR, struct.pack("<IQ", STR, 2**61))]),
                     "metadata 't' claims 2,305,843,009,213,693,952 elements"),
    "a token longer than the file": (
        gguf_bytes([kv("t", ARR, struct.pack("<IQ", STR, 2) + s("a") + struct.pack("<Q", 2**40))]),
        "element 1 of metadata 't' claims 1,099,511,627,776 bytes"),
    "2^61 integers": (gguf_bytes([kv("t", ARR, struct.pack("<IQ", U32, 2**61))]),
                      r"metadata 't' \(2,305,843,009,213,693,952 elements\) runs"),
    "arrays three deep": (gguf_bytes([kv("t", ARR, struct.pack("<IQ", ARR, 1)
                                         + struct.pack("<IQ", ARR, 1)
                                         + struct.pack("<IQ", U32, 1) + bytes(4))]),
                          "nests arrays more than 2 deep"),
    "a value type 13": (gguf_bytes([kv("a", 13, bytes(8))]), "unknown value type 13"),
    "an element type 99": (gguf_bytes([kv("a", ARR, struct.pack("<IQ", 99, 1))]),
                           "elements of an unknown value type 99"),
    "a key twice": (gguf_bytes([ONE, ONE]), "metadata key 'general.architecture' appears twice"),
    "a key not UTF-8": (gguf_bytes([kv(b"\xff\xfe", U32, bytes(4))]), "is not UTF-8 text"),
    "alignment 3": (gguf_bytes([kv("general.alignment", U32, struct.pack("<I", 3))]),
                    "general.alignment is 3, not a power of two"),
    "5 dimensions": (gguf_bytes([ONE], [tensor("w", (1, 1, 1, 1, 1))]),
                     "tensor 'w' has 5 dimensions"),
    "a dimension of 2^63": (gguf_bytes([ONE], [tensor("w", (4, 2**63))]),
                            "tensor 'w' has a dimension over 2\\^63 - 1"),
    "ggml type 999": (gguf_bytes([ONE], [tensor("w", (4,), ggml_type=999)]),
                      "unknown ggml type 999"),
    "a block cut": (gguf_bytes([ONE], [tensor("w", (33,), ggml_type=2)]),
                    "first dimension 33 is not a multiple of its type's block of 32"),
    "a misaligned offset": (gguf_bytes([ONE], [tensor("w", (4,), offset=4)]),
                            "data offset 4 is not a multiple of the alignment 32"),
    "a tensor twice": (gguf_bytes([ONE], [tensor("w", (4,)), tensor("w", (4,))]),
                       "tensor 'w' appears twice"),
    "data past the end": (gguf_bytes([ONE], [tensor("w", (17,))]),
                          r"tensor 'w''s data \(68 bytes at offset 0 of the data section\) runs "
                          "past the end of the file, whose data section holds 64 bytes"),
    "a shape of 2^248 elements": (gguf_bytes([ONE], [tensor("w", (2**62,) * 4)]),
                                  "runs past the end of the file"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_header_is_refused_saying_what_is_wrong(tmp_path: Path, case: str) -> None:
    data, reason = CRAFTED[case]
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelError, match=reason) as info:
        read_header(path)
    assert str(path) in str(info.value)


def test_a_crafted_file_is_refused_by_models_add_before_anything_is_converted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: object) -> None:
        raise AssertionError("the file reached the converter")

    monkeypatch.setattr(registry.convert, "write_gguf_folder", no_conversion)
    home = tmp_path / "home"
    for case in ("2^61 strings", "data past the end"):
        path = tmp_path / "crafted.gguf"
        path.write_bytes(CRAFTED[case][0])
        where = re.escape(str(path))
        with pytest.raises(ModelError, match=rf"cannot add {where} as 'x': {where} is not a "
                                             "valid GGUF file: "):
            registry.add("x", path, home=home)
    long = tmp_path / "long.gguf"  # a template over the limit: refused before converting
    long.write_bytes(gguf_bytes([ONE, kv("tokenizer.chat_template", STR,
                                         s("x" * (registry.MAX_TEMPLATE_CHARS + 1)))]))
    with pytest.raises(ModelError, match="chat template is 65,537 characters"):
        registry.add("x", long, home=home)
    assert not (home / "models" / "x").exists()
