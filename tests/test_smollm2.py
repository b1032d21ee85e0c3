"""The offline default model, for real: the paper's Table 5 pattern on a small slice of the data.
E4M3 stays close to the bf16 baseline; int8 with per-tensor static activations is clearly worse."""

import json

import pytest


@pytest.mark.model
def test_default_model_e4m3_close_to_bf16_int8_worse(ptq_cli, tmp_path):
    out = tmp_path / "smollm2"
    code, _, stderr = ptq_cli(
        "compare", "--seq-len", "256", "--max-windows", "8", "--calib-samples", "8", "--out", out, "--quiet"
    )
    assert code == 0, stderr
    results = json.loads((out / "results.json").read_text())
    e4m3, int8 = results["variants"]
    assert results["model"]["caveats"] and "GGUF" in results["model"]["caveats"][0]
    assert "dequantized from a 4-bit GGUF" in (out / "report.md").read_text()
    assert results["baseline"]["perplexity"] < 200  # a working language model on Shakespeare
    assert abs(e4m3["ppl_delta_pct"]) < 5
    assert int8["ppl_delta_pct"] > 2 * abs(e4m3["ppl_delta_pct"]) and int8["kl_div"] > e4m3["kl_div"]
