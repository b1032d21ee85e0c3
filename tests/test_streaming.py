"""Block-by-block calibration and export from disk (ptq/execution/streaming.py, `--low-memory`) against the in-memory
paths they replace: the same amax, bit for bit, and the same checkpoint files, byte for byte.

Why exactly equal, not within a tolerance: both run the same float32 ops on the same batches in the same order
(the block-by-block pass only changes *when* each decoder block's weights are in memory, not what it computes),
and a running max does not depend on anything else. The weights are the same bf16 values widened to float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import TEXT, make_tokenizer

from ptq.calibration.calibrate import calibrate, load_calibration
from ptq.execution import resources, streaming
from ptq.models.loading import load_model
from ptq.quantization.plan import calibrated_layers
from ptq.quantization.recipes import load_recipe

ALL_LINEAR = "name: e4m3-all\nweights: {format: e4m3}\ninputs: {format: e4m3}\nignore: []\n"  # lm_head included


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory) -> Path:
    """A tiny 3-block Llama stored in bf16 in six shards, with its own (untied) lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("sharded-llama")
    tokenizer = make_tokenizer()
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    tokenizer.save_pretrained(path)
    assert len(list(path.glob("model-*.safetensors"))) > 3
    return path


@pytest.fixture
def all_linear(tmp_path) -> Path:
    path = tmp_path / "e4m3-all.yaml"
    path.write_text(ALL_LINEAR)
    return path


@pytest.mark.parametrize("model_fixture", ["sharded_model", "tiny_model"])
@pytest.mark.parametrize("recipe", ["fp8-e4m3", "all-linear"])
def test_block_by_block_amax_equal_in_memory_calibration(model_fixture, recipe, request, all_linear):
    directory = request.getfixturevalue(model_fixture)
    r = load_recipe(str(all_linear) if recipe == "all-linear" else recipe)
    whole = load_model(str(directory))
    layers = calibrated_layers(whole.model, r)
    input_ids = torch.randint(0, len(whole.tokenizer), (7, 24), generator=torch.Generator().manual_seed(0))
    expected = calibrate(whole.model, input_ids, layers, batch_size=3)  # the last batch is shorter

    streamed = streaming.load_streamed(str(directory))
    assert all(p.is_meta for p in streamed.model.parameters())  # no weight is in memory up front
    assert calibrated_layers(streamed.model, r) == layers
    got = streaming.calibrate_blocks(streamed.model, input_ids, layers, batch_size=3)
    assert list(got.input_amax) == list(expected.input_amax) == layers
    assert ("lm_head" in layers) == (recipe == "all-linear")
    for name in layers:
        assert torch.equal(got.input_amax[name], expected.input_amax[name]), name
        assert torch.equal(got.weight_amax[name], expected.weight_amax[name]), name
    assert all(p.is_meta for p in streamed.model.parameters())  # the skeleton was never filled


def test_only_one_block_is_in_memory_at_a_time(sharded_model, monkeypatch):
    """Each read from disk is one module's tensors (the embeddings, then one block at a time), and the module
    built from the previous read is already freed when the next one is built."""
    import weakref

    streamed = streaming.load_streamed(str(sharded_model))
    layers = calibrated_layers(streamed.model, load_recipe("fp8-e4m3"))
    built, alive_before = [], []
    materialise = streaming._materialise

    def tracked(skeleton, prefix, checkpoint, device):
        alive_before.append([p for p, ref in built if ref() is not None])
        module = materialise(skeleton, prefix, checkpoint, device)
        built.append((prefix, weakref.ref(module)))
        return module

    monkeypatch.setattr(streaming, "_materialise", tracked)
    streaming.calibrate_blocks(streamed.model, torch.randint(0, 200, (2, 16)), layers)
    assert [p for p, _ in built] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"]
    assert alive_before == [[], [], [], []]
    assert all(ref() is None for _, ref in built)


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    names = [p.name for p in directory.iterdir() if p.suffix in (".safetensors", ".json") and p.name != "ptq-export.json"]
    return {name: (directory / name).read_bytes() for name in sorted(names)}


@pytest.mark.parametrize("recipe", ["fp8-e4m3", "int8"])
def test_block_by_block_quantize_writes_the_same_checkpoint(recipe, sharded_model, tmp_path, ptq_cli):
    """`ptq quantize --low-memory` (calibrating in the run) and with a --calib file from `ptq calibrate --low-memory`
    write the same bytes (codes, scales, untouched tensors, index, config) as the in-memory `ptq quantize`."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    common = ["--recipe", recipe, "--seq-len", "32", "--shard-size", "0.05", "-q"]
    code, _, err = ptq_cli("quantize", sharded_model, "--data", text, "--samples", "5", *common, "--in-memory",
                           "--no-verify", "-o", tmp_path / "whole")
    assert code == 0, err
    code, out, err = ptq_cli("quantize", sharded_model, "--data", text, "--samples", "5", *common, "--low-memory",
                             "-o", tmp_path / "streamed")
    assert code == 0, err
    assert "not verified (exported block by block with `--low-memory`" in " ".join(out.split())
    code, _, err = ptq_cli("calibrate", sharded_model, "--data", text, "--samples", "5", "--seq-len", "32", "--recipe",
                           recipe, "--low-memory", "-q", "-o", tmp_path / "c.safetensors")
    assert code == 0, err
    code, _, err = ptq_cli("quantize", sharded_model, "--calib", tmp_path / "c.safetensors", *common, "--low-memory",
                           "-o", tmp_path / "from-calib")
    assert code == 0, err

    whole = checkpoint_files(tmp_path / "whole")
    assert len([n for n in whole if n.startswith("model-")]) > 1
    assert checkpoint_files(tmp_path / "streamed") == whole
    assert checkpoint_files(tmp_path / "from-calib") == whole
    tensors = {}
    for f in sorted((tmp_path / "streamed").glob("model-*.safetensors")):
        tensors |= safetensors.torch.load_file(str(f))
    assert tensors["model.layers.2.mlp.down_proj.weight"].dtype == (torch.float8_e4m3fn if recipe == "fp8-e4m3" else torch.int8)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # untouched, in the source's dtype
    info = json.loads((tmp_path / "streamed" / "ptq-export.json").read_text())
    assert info["low_memory"] is True and info["verification"] is None and "--low-memory" in info["verification_skipped"]
    assert "--low-memory" in (tmp_path / "streamed" / "README.md").read_text()


def test_calibrate_cli_low_memory_file_matches_in_memory(sharded_model, text_file, tmp_path, ptq_cli):
    args = ["--data", text_file, "--samples", "4", "--seq-len", "32", "-q"]
    assert ptq_cli("calibrate", sharded_model, *args, "--in-memory", "-o", tmp_path / "a.st")[0] == 0
    assert ptq_cli("calibrate", sharded_model, *args, "--low-memory", "-o", tmp_path / "b.st")[0] == 0
    a, b = load_calibration(tmp_path / "a.st"), load_calibration(tmp_path / "b.st")
    assert a.input_amax.keys() == b.input_amax.keys() and len(a.input_amax) == 21
    assert all(torch.equal(a.input_amax[k], b.input_amax[k]) and torch.equal(a.weight_amax[k], b.weight_amax[k])
               for k in a.input_amax)
    assert "block by block" in b.metadata["low_memory"] and "low_memory" not in a.metadata
    assert {k: v for k, v in a.metadata.items() if k != "created"} == \
           {k: v for k, v in b.metadata.items() if k not in ("created", "low_memory")}


@pytest.mark.parametrize("model_fixture", ["sharded_model", "tiny_model"])
def test_block_by_block_compare_gives_the_in_memory_results(model_fixture, request, text_file, tmp_path, ptq_cli):
    """compare --low-memory: every variant's metrics, per-window values and per-layer SNR equal the in-memory
    compare's exactly (same float32 ops, same batches, same order), lm_head in E4M3 and dynamic inputs included."""
    directory = request.getfixturevalue(model_fixture)
    recipes = f"fp8-e4m3,int8,fp8-e4m3-dynamic,{tmp_path / 'e4m3-all.yaml'}"
    (tmp_path / "e4m3-all.yaml").write_text(ALL_LINEAR)
    common = ["--recipes", recipes, "--calib-data", text_file, "--eval-data", text_file, "--calib-samples", "5",
              "--seq-len", "24", "--max-windows", "7", "--batch-size", "3", "--no-plots", "-q"]
    results = {}
    for mode in ("--in-memory", "--low-memory"):
        code, _, err = ptq_cli("compare", directory, *common, mode, "--out", tmp_path / mode)
        assert code == 0, err
        results[mode] = json.loads((tmp_path / mode / "results.json").read_text())
    whole, streamed = results["--in-memory"], results["--low-memory"]
    assert not whole["compute"]["low_memory"] and streamed["compute"]["low_memory"]
    assert "block by block" in streamed["device"]
    for key in ("perplexity", "accuracy", "window_nll"):
        assert streamed["baseline"][key] == whole["baseline"][key], key
    assert len(whole["variants"]) == 4
    for a, b in zip(whole["variants"], streamed["variants"]):
        for key in ("perplexity", "accuracy", "kl_div", "top1_agreement", "window_nll", "snr_db"):
            assert b[key] == a[key], (a["name"], key)
    assert whole["variants"][3]["snr_db"]["inputs"]["lm_head"] is not None  # the lm_head's input in E4M3 is measured
    assert streamed["calibration"]["layers"] == whole["calibration"]["layers"]


def test_block_by_block_compare_refuses_what_needs_the_whole_model(sharded_model, text_file, tmp_path, ptq_cli):
    common = ["--eval-data", text_file, "--calib-data", text_file, "--seq-len", "16", "--max-windows", "2",
              "--low-memory", "-q"]
    for extra, message in ((["--recipes", "paper-e4m3"], "compares Linear-layer recipes only"),
                           (["--tasks", "cloze"], "--tasks needs the whole model in memory"),
                           (["--dtype", "bfloat16"], "--low-memory computes in float32")):
        code, _, err = ptq_cli("compare", sharded_model, *common, *extra, "--out", tmp_path / "x")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x" / "results.json").exists()


def test_streams_automatically_when_the_model_does_not_fit(sharded_model, text_file, tmp_path, ptq_cli, monkeypatch):
    params = resources.checkpoint_parameters(sharded_model)
    monkeypatch.setattr(resources, "available_memory", lambda device: params * 4 - 1)  # float32 weights do not fit
    code, _, err = ptq_cli("calibrate", sharded_model, "--data", text_file, "--samples", "2", "--seq-len", "16",
                           "-o", tmp_path / "c.st")
    assert code == 0, err
    assert "does not fit in memory in float32: working block by block from disk (--low-memory)" in " ".join(err.split())
    assert "block by block" in load_calibration(tmp_path / "c.st").metadata["low_memory"]
    # --in-memory keeps the old behaviour: refuse with the estimate
    code, _, err = ptq_cli("calibrate", sharded_model, "--data", text_file, "--samples", "2", "--seq-len", "16",
                           "--in-memory", "-o", tmp_path / "d.st")
    assert code == 2 and "needs at least" in err and not (tmp_path / "d.st").exists()


def test_compare_goes_block_by_block_when_its_variants_do_not_fit(sharded_model, text_file, tmp_path, ptq_cli,
                                                                  monkeypatch):
    params = resources.checkpoint_parameters(sharded_model)
    # One float32 copy fits, the original and three models' weight codes (1 + 3 x 0.5 copies) do not.
    monkeypatch.setattr(resources, "available_memory", lambda device: params * 4 * 2)
    common = ["--eval-data", text_file, "--calib-data", text_file, "--calib-samples", "2", "--seq-len", "16",
              "--max-windows", "2", "--no-plots"]
    code, _, err = ptq_cli("compare", sharded_model, *common, "--out", tmp_path / "a")
    assert code == 0, err
    assert "and 3 variants of it do not fit in memory: comparing block by block from disk (--low-memory)" in " ".join(err.split())
    assert json.loads((tmp_path / "a" / "results.json").read_text())["compute"]["low_memory"] is True
    code, _, err = ptq_cli("compare", sharded_model, *common, "--in-memory", "--out", tmp_path / "b")
    assert code == 2 and "needs at least" in err and not (tmp_path / "b").exists()


def test_low_memory_refusals_are_one_line(sharded_model, other_tiny_model, text_file, tmp_path, ptq_cli):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300)).save_pretrained(gpt2)
    make_tokenizer().save_pretrained(gpt2)
    calib = ["--data", text_file, "--samples", "2", "--seq-len", "16", "-q"]
    cases = [
        (("calibrate", gpt2, *calib, "--low-memory", "-o", tmp_path / "g.st"), "supports the llama architecture, not 'gpt2'"),
        (("calibrate", "some-org/some-model", *calib, "--low-memory", "-o", tmp_path / "h.st"), "local model directory"),
        (("calibrate", sharded_model, *calib, "--low-memory", "--resume", "-o", tmp_path / "r.st"), "--resume is not available"),
    ]
    for args, message in cases:
        code, _, err = ptq_cli(*args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in " ".join(err.split()), err
    # A calibration of another model is refused before anything is written.
    assert ptq_cli("calibrate", other_tiny_model, *calib, "-o", tmp_path / "other.st")[0] == 0
    code, _, err = ptq_cli("quantize", sharded_model, "--calib", tmp_path / "other.st", "--low-memory", "-q",
                           "-o", tmp_path / "out")
    assert code == 2 and "calibration file" in err and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))
