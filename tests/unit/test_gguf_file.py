"""models/gguf_file.open_gguf: the `gguf` package's reader over a plain ndarray gives the same
fields and tensors as `gguf.GGUFReader` (issue 32: a 10 s read of the 0.5B's metadata)."""
import gguf
import numpy as np
import pytest

from mixserve.models.gguf_file import open_gguf
from tests.tiny_gguf import write_float_gguf
from tests.unit.test_gguf_native import write_tiny_gguf


def _same(a, b):
    assert list(a.fields) == list(b.fields)
    for key in a.fields:
        fa, fb = a.fields[key], b.fields[key]
        assert (fa.offset, fa.types, fa.data) == (fb.offset, fb.types, fb.data), key
        assert len(fa.parts) == len(fb.parts), key
        for pa, pb in zip(fa.parts, fb.parts):
            assert pa.dtype == pb.dtype and np.array_equal(pa, pb), key
        assert fa.contents() == fb.contents(), key
    assert len(a.tensors) == len(b.tensors) > 0
    for ta, tb in zip(a.tensors, b.tensors):
        assert (ta.name, ta.tensor_type, ta.n_elements, ta.n_bytes, ta.data_offset) == \
               (tb.name, tb.tensor_type, tb.n_elements, tb.n_bytes, tb.data_offset)
        assert np.array_equal(ta.shape, tb.shape)
        assert ta.data.dtype == tb.data.dtype and np.array_equal(ta.data, tb.data)


def test_fields_and_tensors_equal_the_packages_reader(tmp_path):
    with_tokenizer = write_float_gguf(tmp_path / "float.gguf", name="tiny", tokenizer=True)
    for path in (with_tokenizer, write_tiny_gguf(tmp_path / "quantized.gguf")):
        fast = open_gguf(path)
        _same(fast, gguf.GGUFReader(str(path)))
        assert type(fast.tensors[0].data) is np.ndarray  # no memmap subclass left
    assert open_gguf(with_tokenizer).fields["tokenizer.ggml.tokens"].contents()[-2:] == ["ab", "<|end|>"]


def test_not_a_gguf_is_refused_as_the_package_refuses_it(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="GGUF magic invalid"):
        open_gguf(bad)
    with pytest.raises(ValueError, match="GGUF magic invalid"):
        gguf.GGUFReader(str(bad))


def test_package_reader_is_fast_only_inside_and_restored_after_overlaps(tmp_path):
    import threading

    from mixserve.models.gguf_file import package_reader_is_fast

    path = write_float_gguf(tmp_path / "float.gguf", tokenizer=True)
    original = gguf.GGUFReader
    entered, leave = threading.Event(), threading.Event()

    def other():
        with package_reader_is_fast():
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with package_reader_is_fast():
        t.start()
        assert entered.wait(10)
        assert gguf.GGUFReader is not original and issubclass(gguf.GGUFReader, original)
        _same(gguf.GGUFReader(str(path)), original(str(path)))
    assert gguf.GGUFReader is not original  # the other thread's block is still open
    leave.set()
    t.join()
    assert gguf.GGUFReader is original


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_torch_dequantization_equals_the_packages_bit_for_bit(qtype):
    import torch

    from mixserve.layers.gguf_blocks import dequantize
    from mixserve.layers.gguf_linear import random_blocks

    for n, k in ([(37, 256 * 3), (8, 512)] if qtype.endswith("_K") else [(37, 32 * 20), (5, 512), (3, 32)]):
        blocks = random_blocks(qtype, n, k)
        ref = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]), np.float32).reshape(n, k)
        out = dequantize(qtype, blocks, k)
        assert out.dtype == torch.float32 and out.shape == (n, k)
        assert np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32)), qtype  # the same bits
    with pytest.raises(ValueError, match="do not hold"):
        dequantize(qtype, random_blocks(qtype, 2, k)[:, 1:], k)


def test_converted_tensors_equal_the_packages_dequantization(tmp_path):
    """dequantize_gguf (torch for the block types it parses) against gguf.quants for every tensor of
    a quantized llama file, the Q/K rows unpermuted as before."""
    from mixserve.models import weights

    path = write_tiny_gguf(tmp_path / "quantized.gguf")
    cfg, _, tensors = weights.dequantize_gguf(path, progress=False)
    reader = gguf.GGUFReader(str(path))
    assert len(tensors) == len(reader.tensors)
    for t in reader.tensors:
        name = weights._hf_name(t.name)
        ref = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        ref = ref.reshape(tuple(int(d) for d in reversed(t.shape)))
        heads = weights._heads_to_unpermute(cfg, name)
        if heads:
            ref = weights._unpermute(ref, heads)
        got = tensors[name].numpy()
        assert got.flags.c_contiguous and np.array_equal(got.view(np.uint32), ref.view(np.uint32)), name


@pytest.mark.parametrize("qtype,scale_at", [("Q4_0", 0), ("Q4_1", 0), ("Q5_0", 0), ("Q8_0", 0), ("Q4_K", 0),
                                            ("Q6_K", 208)])
def test_torch_dequantization_keeps_nan_signs_and_payloads_and_takes_no_rows(qtype, scale_at):
    """A NaN, inf or subnormal float16 scale gives gguf's bits (PyTorch's own float16 cast makes every
    NaN 0x7fffffff: found by a break-it helper); zero rows give an empty [0, k]."""
    from mixserve.layers.gguf_blocks import dequantize
    from mixserve.layers.gguf_linear import random_blocks

    k = 256
    blocks = random_blocks(qtype, 6, k, seed=3)
    for row, bits in enumerate((0x7E00, 0xFE00, 0x7C01, 0x7C00, 0x0001, 0x8000)):
        blocks[row, scale_at:scale_at + 2] = np.array([bits], np.uint16).view(np.uint8)
    with np.errstate(invalid="ignore"):
        ref = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]), np.float32).reshape(6, k)
    assert np.isnan(ref[0]).any()
    assert np.array_equal(dequantize(qtype, blocks, k).numpy().view(np.uint32), ref.view(np.uint32))
    assert dequantize(qtype, blocks[:0], k).shape == (0, k)
