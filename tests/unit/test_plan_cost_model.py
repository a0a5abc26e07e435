"""The cost model's arithmetic against values worked out by hand for Qwen2.5-0.5B and 1.5B."""
import pytest

from mixserve.models.config import ModelConfig
from mixserve.plan import cost_model as cm


def qwen(hidden, layers, heads, kv_heads, head_dim, inter):
    return ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                       tie_word_embeddings=True, attention_bias=True)


Q05 = qwen(896, 24, 14, 2, 64, 4864)
Q15 = qwen(1536, 28, 12, 2, 128, 8960)


def test_params_qwen05():
    # embed 151936 * 896 = 136,134,656 (tied: the LM head is the same matrix)
    # per layer: q 896*896 = 802,816; k, v 896*128 = 114,688 each; o 802,816 -> 1,835,008
    #            gate, up, down 3 * 896 * 4864 = 13,074,432; biases 896 + 128 + 128 = 1,152;
    #            norms 2 * 896 = 1,792 -> 14,912,384; * 24 = 357,897,216
    # final norm 896 -> total 136,134,656 + 357,897,216 + 896 = 494,032,768 (published: 0.49B)
    p = cm.param_count(Q05)
    assert p["embed"] == 136_134_656
    assert p["per_layer"] == 14_912_384
    assert p["lm_head"] == 0
    assert p["total"] == 494_032_768
    assert round(p["total"] / 1e9, 2) == 0.49


def test_params_qwen15():
    # embed 151936 * 1536 = 233,373,696
    # per layer: q 1536^2 = 2,359,296; k, v 1536*256 = 393,216 each; o 2,359,296 -> 5,505,024
    #            MLP 3 * 1536 * 8960 = 41,287,680; biases 1536 + 256 + 256 = 2,048; norms 3,072
    #            -> 46,797,824; * 28 = 1,310,339,072
    # total 233,373,696 + 1,310,339,072 + 1,536 = 1,543,714,304 (published: 1.54B)
    p = cm.param_count(Q15)
    assert p["per_layer"] == 46_797_824
    assert p["total"] == 1_543_714_304
    assert round(p["total"] / 1e9, 2) == 1.54


def test_untied_head_counts_twice():
    p = cm.param_count(ModelConfig(**{**Q05.as_dict(), "tie_word_embeddings": False}))
    assert p["total"] == 494_032_768 + 136_134_656


def test_flops_qwen05():
    # matmul weights per layer 1,835,008 + 13,074,432 = 14,909,440; * 24 = 357,826,560
    # 2 FLOPs a weight: 715,653,120; LM head 2 * 136,134,656 = 272,269,312 -> 987,922,432
    assert cm.linear_flops_per_token(Q05, with_lm_head=False) == 715_653_120
    assert cm.linear_flops_per_token(Q05) == 987_922_432
    # attention: 4 * 14 heads * 64 * 24 layers = 86,016 FLOPs per context token
    assert cm.attention_flops(Q05, 1) == 86_016
    # decode at context 1024: 987,922,432 + 86,016 * 1024 = 1,076,002,816
    assert cm.decode_flops_per_token(Q05, 1024) == 1_076_002_816
    # prefill of 4 tokens: 4 * 715,653,120 = 2,862,612,480; + LM head once 272,269,312 =
    # 3,134,881,792; + attention over 1 + 2 + 3 + 4 = 10 keys, 860,160 -> 3,135,741,952
    assert cm.prefill_flops(Q05, 4) == 3_135_741_952


def test_flops_qwen15():
    # matmul weights per layer 5,505,024 + 41,287,680 = 46,792,704; * 28 = 1,310,195,712
    # * 2 = 2,620,391,424; LM head 2 * 233,373,696 = 466,747,392 -> 3,087,138,816
    assert cm.linear_flops_per_token(Q15) == 3_087_138_816
    # attention: 4 * 12 * 128 * 28 = 172,032 per context token
    assert cm.attention_flops(Q15, 1) == 172_032


def test_kv_bytes():
    # 2 (K and V) * 24 layers * 2 kv heads * 64 * 2 bytes = 12,288 bytes/token
    assert cm.kv_bytes_per_token(Q05) == 12_288 == Q05.kv_bytes_per_token(2)
    # 2 * 28 * 2 * 128 * 2 = 28,672 bytes/token
    assert cm.kv_bytes_per_token(Q15) == 28_672


def test_weight_bytes_qwen05():
    # bf16 decode read: matmuls 357,826,560 * 2 = 715,653,120; biases + norms (1,152 + 1,792) * 24
    # * 2 = 141,312; final norm 1,792; LM head 272,269,312 -> 988,065,536
    bf = cm.weight_bytes(Q05, cm.BF16)
    assert bf["decode_read"] == 988_065_536
    assert bf["total"] == 2 * 494_032_768
    # int4, group 128: 357,826,560 / 2 = 178,913,280 bytes of nibbles; 357,826,560 / 128 =
    # 2,795,520 groups * (2 scale + 0.5 zero) = 6,988,800 -> 185,902,080; + 141,312 + 1,792
    # + bf16 LM head 272,269,312 -> 458,314,496
    q = cm.weight_bytes(Q05, cm.INT4)
    assert q["decode_read"] == 458_314_496
    assert q["total"] == 272_269_312 + 185_902_080 + 141_312 + 1_792


def test_bad_format():
    with pytest.raises(ValueError, match="format"):
        cm.WeightFormat("int3")
