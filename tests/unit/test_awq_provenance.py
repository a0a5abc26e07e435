"""Provenance at load: weights that already come from an AWQ or GPTQ release are named as such
(GGUF general.* metadata, an HF folder's quantization_config), and `quantize` warns about them."""
import json

import gguf
import numpy as np
import pytest

from mixserve.quant.awq import AWQConfig
from mixserve.quant.checkpoint import quantize
from mixserve.quant.provenance import folder_release, quantized_release, release_warning

HIDDEN, INTER, VOCAB = 64, 128, 96


def write_float_gguf(path, name):
    """A one-block float32 llama GGUF whose general.name is `name`."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(1)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_context_length(128)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    r = lambda *s: (0.05 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", r(VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for kind, shape in {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
                        "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
                        "ffn_down": (HIDDEN, INTER)}.items():
        w.add_tensor(f"blk.0.{kind}.weight", r(*shape))
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name, expect", [("Tiny Coder 1B Instruct AWQ", True), ("tiny-1b-gptq-int4", True),
                                          ("Tiny Coder 1B Instruct GGUF", False), ("Hawqins 1B", False)])
def test_gguf_name_says_whether_weights_come_from_an_awq_release(tmp_path, name, expect):
    path = write_float_gguf(tmp_path / "m.gguf", name)
    found = quantized_release(str(path))
    assert (found is not None) == expect
    if expect:
        assert name in found and "general.name" in found
        assert "redoes work already done" in release_warning(str(path), "quantize")
        assert "already a rounded model" in release_warning(str(path), "eval-ppl")
    else:
        assert release_warning(str(path), "quantize") is None


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
