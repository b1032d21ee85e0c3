"""The offline default model, for real: the paper's Table 5 pattern on a small slice of the data.
E4M3 stays close to the bf16 baseline; int8 with per-tensor static activations is clearly worse."""

import json

import pytest


@pytest.mark.model
def test_default_model_e4m3_close_to_bf16_int8_worse(ptq_cli, tmp_path):
    out = tmp_path / "smollm2"
    code, _, stderr = ptq_cli(
        "compare",
        "--seq-len",
        "256",
        "--max-windows",
        "8",
        "--calib-samples",
        "8",
        "--out",
        out,
        "--quiet",
    )
    assert code == 0, stderr
    results = json.loads((out / "results.json").read_text())
    e4m3, int8 = results["variants"]
    assert results["model"]["caveats"] and "GGUF" in results["model"]["caveats"][0]
    assert "dequantized from a 4-bit GGUF" in (out / "report.md").read_text()
    assert results["baseline"]["perplexity"] < 200  # a working language model on Shakespeare
    assert abs(e4m3["ppl_delta_pct"]) < 5
    assert (
        int8["ppl_delta_pct"] > 2 * abs(e4m3["ppl_delta_pct"]) and int8["kl_div"] > e4m3["kl_div"]
    )


@pytest.mark.model
def test_inspect_reads_a_gguf_without_converting_it(ptq_cli, tmp_path, monkeypatch):
    """`ptq inspect FILE.gguf` builds the model from the config in the file's metadata: nothing is converted (a 70B
    GGUF would need its float32 model, 280 GB, in memory), and it shows what inspecting the converted model shows."""
    from ptq.models.loading import converted_gguf_dir, default_gguf_path

    recipes = ["--recipe", "fp8-e4m3,fp8-block,int8", "--json"]
    converted, _ = converted_gguf_dir(
        default_gguf_path()
    )  # in the run's cache (converted once for every test)
    code, out, err = ptq_cli("inspect", converted, *recipes)
    assert code == 0, err
    from_folder = json.loads(out)
    monkeypatch.setenv("PTQ_CACHE", str(tmp_path / "new-cache"))
    code, out, err = ptq_cli("inspect", default_gguf_path(), *recipes)
    assert code == 0, err
    from_gguf = json.loads(out)
    assert not (tmp_path / "new-cache").exists()  # not converted
    assert from_gguf.pop("model")["source"].endswith("(GGUF)") and from_folder.pop("model")
    assert from_gguf == from_folder and from_gguf["linear_layers"] == 211
