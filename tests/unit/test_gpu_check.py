"""benchmarks/gpu_check.py's Python entry on the CPU with a tiny model (issue 20): every section
runs and records its results, so the script a lent GPU runs once is not dead code."""
import json

from tests.scripts import load_script

gpu_check = load_script("gpu_check")


def test_gpu_check_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    rc = gpu_check.main(["--tiny", "--device", "cpu", "--out", str(out), "--work", str(tmp_path / "models")])
    summary = json.loads((out / "summary.json").read_text())
    status = {k: (v["status"], v.get("why")) for k, v in summary["sections"].items()}
    assert rc == 0 and set(status) == set(gpu_check.SECTIONS), status
    assert set(out.iterdir()) <= {out / "summary.json", out / "probe.json"}  # few files: a lent machine caps them
    tg = summary["targets"]
    assert tg["greedy float32 equal to the CPU run (tie rule)"] and tg["speculation gives plain decoding's tokens"]
    assert tg["ShareGPT-shaped run completed"]
    eq = summary["sections"]["equality"]
    assert eq["float32"]["diverged"] == 0 and eq["float32"]["equal"] + eq["float32"]["near_tie"] == eq["prompts"]
    dec = summary["sections"]["decode"]
    for name in ("bf16 + graphs", "bf16 eager", "int4 (RTN g128) + graphs"):
        assert dec[name]["tokens_per_s"] > 0 and dec[name]["bytes_per_token"] > 0, dec
    # int4 reads about a quarter of bf16's weight bytes (plus scales)
    assert dec["int4 (RTN g128) + graphs"]["weight_bytes"] < 0.5 * dec["bf16 + graphs"]["weight_bytes"]
    share = summary["sections"]["sharegpt"]
    assert share["requests"] == 12 and share["report"]["output_tokens_per_s"] > 0
    plan = summary["sections"]["plan"]
    assert plan["probe"]["predicted_output_tokens_per_s"] > 0 and plan["probe"]["error"] is not None
    assert (out / "probe.json").exists()
    spec = summary["sections"]["spec"]
    for name in ("draft = copy of the target, k 4", "n-gram, k 4"):
        assert spec[name]["same_tokens_as_plain"], name  # greedy speculation changes no token
    assert spec["draft = copy of the target, k 4"]["acceptance_rate"] == 1.0  # the draft is the target


def test_cuda_without_a_gpu_is_an_error_in_the_results(tmp_path):
    import torch

    if torch.cuda.is_available():
        return
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in json.loads((tmp_path / "summary.json").read_text())["error"]


def test_an_unknown_section_is_refused(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--sections", "env,warp"])
    assert "unknown sections" in capsys.readouterr().err
