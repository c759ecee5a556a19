"""modelfile.read_gguf_header, the header-only GGUF reader behind start-up, `clawd models` and
doctor, against the gguf package's full reader (an independent implementation) on tiny models,
a file with every value type in both byte orders, damaged files, and the embedded model."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from clawd.modelfile import GGUFArray, gguf_architecture, read_gguf_header, why_untrainable
from tests.tiny_models import build_tiny_gguf, build_tiny_lora


def reference(path: Path) -> dict:
    """The same key/values as the gguf package reads them, arrays reduced to (type, length)."""
    out = {}
    for name, field in gguf.GGUFReader(str(path)).fields.items():
        if name.startswith("GGUF."):  # the reader's own entries for the fixed header
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            nested = field.types[1] == gguf.GGUFValueType.ARRAY  # the package flattens these: no outer count
            out[name] = GGUFArray(int(field.types[1]), None if nested else len(field.data))
        else:
            out[name] = field.contents()
    return out


def assert_same(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)  # same keys, in file order
    for key, want in theirs.items():
        got = ours[key]
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        elif isinstance(want, GGUFArray) and want.count is None:
            assert isinstance(got, GGUFArray) and got.elem_type == want.elem_type, key
        else:
            assert got == want, key


def test_tiny_models_read_like_the_gguf_package(tmp_path):
    model = build_tiny_gguf(tmp_path / "tiny.gguf", chat_template="{{ messages }}")
    for path in (model, build_tiny_gguf(tmp_path / "f16.gguf", f16=True), build_tiny_lora(tmp_path / "a.gguf", model)):
        ours = read_gguf_header(path)
        assert_same(ours, reference(path))
    header = read_gguf_header(model)
    assert header["general.architecture"] == "llama" and header["tokenizer.chat_template"] == "{{ messages }}"
    tokens = header["tokenizer.ggml.tokens"]
    assert isinstance(tokens, GGUFArray) and tokens.count > 200  # skipped by length, not read
    assert gguf_architecture(model) == "llama" and why_untrainable(model) is None
    early = read_gguf_header(model, want={"general.architecture"})  # stops there: the vocabulary is not walked
    assert early["general.architecture"] == "llama" and "tokenizer.ggml.tokens" not in early
    assert read_gguf_header(model, want={"no.such.key"}) == header  # an absent key: the whole header


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_in_both_byte_orders(tmp_path, endian):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3", endianess=endian)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo <start_of_turn>")
    w.add_string("t.empty", "")
    w.add_array("t.strs", ["a", "", "ccc" * 100])
    w.add_array("t.ints", [1, 2, 3, 4])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("w", np.ones((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_gguf_header(path)
    assert ours["t.f32"] == pytest.approx(0.1, rel=1e-7) and ours["t.u64"] == 2**63 + 5
    assert ours["t.strs"] == GGUFArray(8, 3) and ours["t.nested"] == GGUFArray(9, 2)
    assert gguf_architecture(path) == "qwen3"
    if endian == gguf.GGUFEndian.LITTLE:  # the package reads big-endian files only on a big-endian host
        assert_same(ours, reference(path))


def test_damaged_files_are_value_errors(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    header_end = 24 + 2000  # somewhere inside the key/values
    cases = {
        "empty": b"",
        "magic only": b"GGUF",
        "not gguf": b"PK\x03\x04" + data[4:],
        "truncated": data[:header_end],
        "bad version": data[:4] + (99).to_bytes(4, "little") + data[8:],
        "huge kv count": data[:16] + (2**40).to_bytes(8, "little") + data[24:],
    }
    for name, blob in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(blob)
        with pytest.raises(ValueError):
            read_gguf_header(path)
        if name != "truncated":  # cut after general.architecture: that one key still reads
            assert "cannot read" in why_untrainable(path), name
    with pytest.raises(OSError):
        read_gguf_header(tmp_path / "missing.gguf")


@pytest.mark.slow
def test_the_embedded_model_reads_like_the_gguf_package_and_fast(tmp_path):
    from clawd.models import ensure_embedded_model
    from clawd.paths import resolve_paths

    path = ensure_embedded_model(resolve_paths({"CLAWD_HOME": str(tmp_path)}))
    t0 = time.perf_counter()
    ours = read_gguf_header(path)
    took = time.perf_counter() - t0
    assert_same(ours, reference(path))
    assert ours["general.architecture"] == "gemma3" and ours["tokenizer.ggml.tokens"].count == 262144
    assert took < 1.0, f"the header read took {took:.2f} s"  # ~0.1 s; the full reader takes seconds
