"""fidelity.packs.gguf_file.GGUFFile against gguf-py's GGUFReader (the reference): every field's types and contents,
every tensor's type, shape, sizes, offset and data view, on SmolLM2's real GGUF and on random files of every value
type, both byte orders; malformed files are refused with a message naming what is wrong."""
import numpy as np
import pytest

import gguf
from fidelity.packs.gguf_file import GGUFFile


def assert_same_as_gguf_py(path):
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, f in ref_fields.items():
        assert ours.fields[key].types == f.types, key
        got, want = ours.fields[key].contents(), f.contents()
        assert type(got) is type(want) and got == want, key
        if isinstance(want, list) and want:
            assert [type(v) for v in got] == [type(v) for v in want], key
    assert ours.alignment == ref.alignment and ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (
            a.tensor_type == b.tensor_type
            and a.shape.tolist() == b.shape.tolist()
            and a.shape.dtype == b.shape.dtype.newbyteorder("=")
        )
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name


@pytest.mark.slow
def test_smollm2_gguf_reads_as_gguf_py_reads_it(smollm2_gguf):
    assert_same_as_gguf_py(smollm2_gguf)


def random_gguf(path, rng, endian=gguf.GGUFEndian.LITTLE, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment:
        w.add_custom_alignment(alignment)
    words = ["".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, rng.integers(0, 12))) for _ in range(50)]
    w.add_string("t.string", words[0])
    w.add_bool("t.bool", bool(rng.integers(2)))
    w.add_uint8("t.u8", int(rng.integers(0, 2**8)))
    w.add_int8("t.i8", int(rng.integers(-2**7, 2**7)))
    w.add_uint16("t.u16", int(rng.integers(0, 2**16)))
    w.add_int16("t.i16", int(rng.integers(-2**15, 2**15)))
    w.add_uint32("t.u32", int(rng.integers(0, 2**32)))
    w.add_int32("t.i32", int(rng.integers(-2**31, 2**31)))
    w.add_uint64("t.u64", int(rng.integers(0, 2**63)) * 2 + 1)
    w.add_int64("t.i64", int(rng.integers(-2**63, 2**63)))
    w.add_float32("t.f32", float(rng.standard_normal()))
    w.add_float64("t.f64", float(rng.standard_normal()))
    w.add_array("t.strings", words)
    w.add_array("t.ints", [int(v) for v in rng.integers(-2**31, 2**31, 300)])
    w.add_array("t.floats", [float(v) for v in rng.standard_normal(77)])
    w.add_key_value("t.u8s", [int(v) for v in rng.integers(0, 256, 33)], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.UINT8)
    w.add_key_value("t.bools", [bool(v) for v in rng.integers(0, 2, 9)], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.BOOL)
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[int(v) for v in rng.integers(0, 9, 3)], [int(v) for v in rng.integers(0, 9, 3)]])
    for i, kind in enumerate(["F32", "F16", "Q8_0", "Q4_K", "Q6_K", "I32", "BF16"]):
        qtype = gguf.GGMLQuantizationType[kind]
        rows, cols = int(rng.integers(1, 5)), 256 * int(rng.integers(1, 3))
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        if kind == "I32":
            data = rng.integers(-2**31, 2**31, (rows, cols)).astype(np.int32)
        elif kind == "F16":
            data = x.astype(np.float16)
        elif kind == "F32":
            data = x
        elif kind in ("Q8_0", "BF16"):
            data = gguf.quants.quantize(x, qtype)
        else:  # gguf-py cannot quantize K-types: random blocks (the reader only hands bytes on)
            data = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape((rows, cols), qtype), dtype=np.uint8)
        w.add_tensor(f"blk.{i}.t{kind}", data, raw_dtype=qtype if kind not in ("F32", "F16", "I32") else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_random_files_read_as_gguf_py_reads_them(tmp_path, rng_seed, endian):
    rng = np.random.default_rng(rng_seed)
    path = random_gguf(tmp_path / "r.gguf", rng, endian, alignment=int(rng.choice([32, 64, 256])))
    assert_same_as_gguf_py(path)


def test_malformed_files_are_refused_with_what_is_wrong(tmp_path, rng_seed):
    path = random_gguf(tmp_path / "r.gguf", np.random.default_rng(rng_seed))
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(bad)
    bad.write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="version 7"):
        GGUFFile(bad)
    first_tensor = GGUFFile(path).data_offset
    bad.write_bytes(data[: first_tensor // 2])
    with pytest.raises(ValueError, match="ends inside its header|runs past the end"):
        GGUFFile(bad)
