"""Provenance at load: weights that already come from an AWQ or GPTQ release are named as such
(GGUF general.* metadata, an HF folder's quantization_config), and `quantize` warns about them."""
import json

import gguf
import numpy as np
import pytest

from mixserve.quant.awq import AWQConfig
from mixserve.quant.checkpoint import quantize
from mixserve.quant.provenance import folder_release, quantized_release, release_warning
from tests.tiny_gguf import HIDDEN, INTER, VOCAB, write_float_gguf  # noqa: F401


@pytest.mark.parametrize("name, expect", [("Tiny Coder 1B Instruct AWQ", True), ("tiny-1b-gptq-int4", True),
                                          ("Tiny Coder 1B Instruct GGUF", False), ("Hawqins 1B", False)])
def test_gguf_name_says_whether_weights_come_from_an_awq_release(tmp_path, name, expect):
    path = write_float_gguf(tmp_path / "m.gguf", name)
    found = quantized_release(str(path))
    assert (found is not None) == expect
    if expect:
        assert name in found and "general.name" in found
        assert "redoes work already done" in release_warning(str(path), found, "quantize")
        assert "already a rounded model" in release_warning(str(path), found, "eval-ppl")
    else:
        assert release_warning(str(path), found, "quantize") is None


def test_quantize_warns_and_the_checkpoint_remembers_the_release(tmp_path):
    path = write_float_gguf(tmp_path / "m.gguf", "Tiny Coder 1B Instruct AWQ")
    lines = []
    out = quantize(str(path), AWQConfig(method="rtn", group_size=32), out=tmp_path / "q", progress=False,
                   log=lines.append)
    warned = [x for x in lines if x.startswith("warning:")]
    assert len(warned) == 1 and "Tiny Coder 1B Instruct AWQ" in warned[0]
    meta = json.loads((out / "mixserve_quant.json").read_text())
    assert "Instruct AWQ" in meta["source_release"]
    # eval-ppl on the checkpoint finds the release through it, and through the dequantized copy
    assert "made from" in folder_release(out) and "Instruct AWQ" in folder_release(out)
    assert "Instruct AWQ" in folder_release(meta["source"])


def test_quantize_of_an_ordinary_model_says_nothing(tmp_path):
    path = write_float_gguf(tmp_path / "m.gguf", "Tiny Coder 1B Instruct")
    lines = []
    out = quantize(str(path), AWQConfig(method="rtn", group_size=32), out=tmp_path / "q", progress=False,
                   log=lines.append)
    assert not [x for x in lines if x.startswith("warning:")]
    assert json.loads((out / "mixserve_quant.json").read_text())["source_release"] is None
    assert folder_release(out) is None


def test_hf_folder_quantization_config(tmp_path):
    for method, expect in (("awq", True), ("gptq", True), ("bitsandbytes", False)):
        d = tmp_path / method
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": method, "bits": 4}}))
        assert (folder_release(d) is not None) == expect, method
    d = tmp_path / "dense"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert folder_release(d) is None
    (d / "config.json").write_text("not json")
    assert folder_release(d) is None


def test_unreadable_provenance_is_unknown_not_an_error(tmp_path):
    # a checkpoint's metadata that is JSON but not an object, and a dequantized copy beside a truncated GGUF
    for text in ("[]", "null", '"x"', "{bad"):
        d = tmp_path / f"ck{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "mixserve_quant.json").write_text(text)
        assert folder_release(d) is None and quantized_release(str(d)) is None
    good = write_float_gguf(tmp_path / "t.gguf", "Tiny AWQ")
    copy = tmp_path / "t.gguf.mixserve"
    copy.mkdir()
    assert "Tiny AWQ" in folder_release(copy)
    good.write_bytes(good.read_bytes()[:300])
    assert folder_release(copy) is None


def test_a_copy_in_the_cache_names_its_source(tmp_path):
    # copies under the cache are named <file>-<size>.mixserve: the source file says where they came from
    from mixserve.models.weights import convert_gguf

    src = write_float_gguf(tmp_path / "m.gguf", "Tiny Coder 1B Instruct AWQ")
    folder = convert_gguf(src, progress=False)
    moved = tmp_path / "cache" / "m.gguf-12345.mixserve"
    moved.parent.mkdir()
    folder.rename(moved)
    assert "Instruct AWQ" in folder_release(moved)


@pytest.mark.parametrize("key, value, expect", [
    ("general.source.repo_url", "https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ", True),
    ("general.tags", ["awq", "4-bit"], True), ("general.name", "Llama-3-8B-AWQ4bit", True),
    ("general.name", "Mistral-7B-Int4-GPTQ", True), ("general.name", "AutoAWQ-free model", False)])
def test_release_names_in_other_keys(tmp_path, key, value, expect):
    path = write_float_gguf(tmp_path / "m.gguf", "plain")
    # rewrite with the extra key: GGUFWriter takes it before the tensors
    w = gguf.GGUFReader(str(path))
    assert w.fields["general.name"].contents() == "plain"
    out = tmp_path / "k.gguf"
    wr = gguf.GGUFWriter(str(out), "llama")
    if isinstance(value, list):
        wr.add_array(key, value)
    else:
        wr.add_string(key, value)
    wr.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    from mixserve.quant.provenance import gguf_release

    assert (gguf_release(out) is not None) == expect
