"""Layer-by-layer calibration, compare and export from disk (ptq/execution/streaming.py, `--low-memory`) against the
in-memory paths, on tiny Llama, Gemma 3, GPT-2, Mixtral, Qwen3-MoE and DeepSeek-V3: the same amax, bit for bit, the same
perplexity, KL and per-window values, and the same checkpoint files, byte for byte.

Why exactly equal, not within a tolerance: both run the same float32 ops on the same batches in the same order
(the layer-by-layer executor only changes *when* each decoder layer's weights are in memory, and runs the
model's own forward for everything outside its decoder layers), and a running max does not depend on anything
else. The weights are the same bf16 values widened to float32, laid out as in memory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import families
import pytest
import safetensors.torch
import torch
from conftest import TEXT, make_tokenizer
from test_loading import save_fp8_checkpoint

from ptq.calibration.calibrate import calibrate, load_calibration
from ptq.calibration.clips import quantize_variants
from ptq.errors import PtqError
from ptq.evaluation.evaluate import evaluate
from ptq.execution import streaming
from ptq.models.loading import linear_layers, load_model, load_structure
from ptq.models.matmuls import kind
from ptq.quantization.plan import calibration_targets, resolve_plans
from ptq.quantization.recipes import load_recipe
from ptq.runtime import resources

ALL_LINEAR = "name: e4m3-all\nweights: {format: e4m3}\ninputs: {format: e4m3}\nignore: []\n"  # lm_head included
STREAMED = [
    "llama",
    "gemma3",
    "gpt2",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
]  # dense, GPT-2 (Conv1D), MoE (fused experts; MLA)


# OPT-350m's shape: word embeddings narrower than the decoder, so that project_in and project_out, Linear layers
# outside the decoder layers, run before the first one and after the last one
OPT_PROJ = dict(word_embed_proj_dim=32, do_layer_norm_before=False)


def save_family(path: Path, family: str, **overrides) -> Path:
    """A tiny random model of `family` stored in bf16 in several shards, with its own (untied) lm_head."""
    model = families.build(family, seed=3, **overrides)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    make_tokenizer().save_pretrained(path)
    assert len(list(path.glob("model-*.safetensors"))) > 2
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {family: save_family(tmp_path_factory.mktemp(family), family) for family in STREAMED} | {
        "opt-proj": save_family(tmp_path_factory.mktemp("opt-proj"), "opt", **OPT_PROJ)
    }


@pytest.fixture(scope="module")
def sharded_model(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture
def all_linear(tmp_path) -> Path:
    path = tmp_path / "e4m3-all.yaml"
    path.write_text(ALL_LINEAR)
    return path


def windows(n: int = 7, seq_len: int = 24) -> torch.Tensor:
    return torch.randint(0, 300, (n, seq_len), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", [*STREAMED, "tied-llama", "opt-proj"])
@pytest.mark.parametrize("recipe", ["fp8-e4m3", "all-linear"])
def test_layer_by_layer_amax_equal_in_memory_calibration(
    family, recipe, checkpoints, tiny_model, all_linear
):
    directory = tiny_model if family == "tied-llama" else checkpoints[family]
    r = load_recipe(str(all_linear) if recipe == "all-linear" else recipe)
    whole = load_model(str(directory))
    layers, channels = calibration_targets(resolve_plans(whole.model, [r]).values())
    expected = calibrate(whole.model, windows(), layers, batch_size=3)  # the last batch is shorter

    streamed = streaming.load_streamed(str(directory))
    assert all(p.is_meta for p in streamed.model.parameters())  # no weight is in memory up front
    assert calibration_targets(resolve_plans(streamed.model, [r]).values()) == (layers, channels)
    got = calibrate(
        streamed.model,
        windows(),
        layers,
        batch_size=3,
        layer_by_layer=streaming.LayerByLayer(streamed.model),
    )
    assert list(got.input_amax) == list(expected.input_amax) == layers
    assert list(got.weight_amax) == list(expected.weight_amax)
    assert ("lm_head" in layers) == (recipe == "all-linear")
    assert any(".experts." in name for name in layers) == (
        family in ("mixtral", "qwen3_moe", "deepseek_v3")
    )
    assert ({"model.decoder.project_in", "model.decoder.project_out"} <= set(layers)) == (
        family == "opt-proj"
    )
    for name in layers:
        assert torch.equal(got.input_amax[name], expected.input_amax[name]), name
        assert torch.equal(got.weight_amax[name], expected.weight_amax[name]), name
        assert torch.equal(got.input_hist[name], expected.input_hist[name]), name
    # every other parameter's amax, which tells a model with other norms apart: those read, as in memory
    decoder = {
        n for n in expected.tensor_amax if re.search(r"\.(layers|h)\.\d+\.", n)
    }  # GPT-2's are h.N
    assert decoder and decoder <= got.tensor_amax.keys() <= expected.tensor_amax.keys()
    for name, value in got.tensor_amax.items():
        assert torch.equal(value, expected.tensor_amax[name]), name
    assert "layer by layer" in got.metadata["low_memory"]
    assert all(p.is_meta for p in streamed.model.parameters())  # the skeleton was never filled


@pytest.mark.parametrize("fault", ["embedding", "final-norm"])
def test_layer_by_layer_names_a_fault_outside_the_decoder_layers_as_in_memory(
    fault, tmp_path, all_linear
):
    """Layer by layer, an inf in a parameter of what runs before the first decoder layer (OPT's
    embeddings into project_in) or after the last (a final norm before the lm_head) stops as in
    memory, with the same message: the damaged parameter, named before any forward pass (not the
    input of the layer it feeds)."""
    ids = windows()
    model = families.build(
        "opt" if fault == "embedding" else "llama",
        seed=3,
        **(OPT_PROJ if fault == "embedding" else {}),
    )
    if fault == "embedding":
        model.get_input_embeddings().weight[int(ids[4, 5])] = float(
            "inf"
        )  # batch 1 of batches of 3
    else:
        model.model.norm.weight[0] = float("inf")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "m", max_shard_size="60KB")
    make_tokenizer().save_pretrained(tmp_path / "m")
    whole = load_model(str(tmp_path / "m"))
    layers, _ = calibration_targets(
        resolve_plans(whole.model, [load_recipe(str(all_linear))]).values()
    )
    with pytest.raises(PtqError) as expected:
        calibrate(whole.model, ids, layers, batch_size=3)
    streamed = streaming.load_streamed(str(tmp_path / "m"))
    with pytest.raises(PtqError) as got:
        calibrate(
            streamed.model,
            ids,
            layers,
            batch_size=3,
            layer_by_layer=streaming.LayerByLayer(streamed.model),
        )
    assert str(got.value) == str(expected.value)
    name = "model.decoder.embed_tokens.weight" if fault == "embedding" else "model.norm.weight"
    assert str(got.value).startswith(f"parameter '{name}' contains inf (first at index [")


def test_a_hidden_state_written_in_place_is_measured_again(checkpoints, tmp_path):
    """Layer by layer, each layer's output is copied into its input's buffer: the same tensor, new values. A layer
    that reads it directly (OPT with its norms after: q/k/v) must not be given the statistics the observers measured
    on it at the previous layer (they share one measurement per tensor: its version tells the values apart)."""
    recipe = tmp_path / "q.yaml"
    recipe.write_text(
        "name: q-only\nweights: {format: e4m3}\ninputs: {format: e4m3}\ninclude: ['*.q_proj']\n"
    )
    directory = checkpoints["opt-proj"]
    whole = load_model(str(directory))
    layers, _ = calibration_targets(resolve_plans(whole.model, [load_recipe(str(recipe))]).values())
    assert layers == [f"model.decoder.layers.{i}.self_attn.q_proj" for i in range(2)]
    expected = calibrate(
        whole.model, windows(3), layers, batch_size=3
    )  # one batch: one buffer, written per layer
    streamed = streaming.load_streamed(str(directory))
    got = calibrate(
        streamed.model,
        windows(3),
        layers,
        batch_size=3,
        layer_by_layer=streaming.LayerByLayer(streamed.model),
    )
    assert expected.input_amax[layers[0]] != expected.input_amax[layers[1]]
    for name in layers:
        assert torch.equal(got.input_amax[name], expected.input_amax[name]), name
        assert torch.equal(got.input_hist[name], expected.input_hist[name]), name


@pytest.mark.parametrize("family", STREAMED)
def test_layer_by_layer_logits_are_the_models_own(family, checkpoints):
    """Scores of the model itself, layer by layer, against the model in memory: every window's NLL equal."""
    whole = load_model(str(checkpoints[family]))
    streamed = streaming.load_streamed(str(checkpoints[family]))
    expected = evaluate({"m": whole.model}, windows(5), batch_size=2)["m"]
    got = evaluate(streaming.LayerByLayer(streamed.model), windows(5), batch_size=2)["model"]
    assert got.window_nll == expected.window_nll and got.tokens == expected.tokens == 5 * 23
    assert got.correct == expected.correct


def test_only_one_layer_is_in_memory_at_a_time(sharded_model, monkeypatch):
    """Each read from disk is one part's tensors (the trunk, then one decoder layer at a time), and the layer built
    from the previous read is already freed when the next one is built."""
    import weakref

    streamed = streaming.load_streamed(str(sharded_model))
    layers, _ = calibration_targets(
        resolve_plans(streamed.model, [load_recipe("fp8-e4m3")]).values()
    )
    built, alive_before, reads = [], [], []
    materialise, each = streaming._materialise, streaming.SafetensorsCheckpoint.each

    def tracked(module, source, device, path="", **kwargs):
        alive_before.append([p for p, ref in built if ref() is not None and p])
        part = materialise(module, source, device, path, **kwargs)
        built.append((path, weakref.ref(part)))
        return part

    def reading(self, names):
        reads.append(names)
        return each(self, names)

    monkeypatch.setattr(streaming, "_materialise", tracked)
    monkeypatch.setattr(streaming.SafetensorsCheckpoint, "each", reading)
    calibrate(
        streamed.model,
        windows(2, 16),
        layers,
        layer_by_layer=streaming.LayerByLayer(streamed.model),
    )
    assert [p for p, _ in built] == [
        "",
        "model.layers.0",
        "model.layers.1",
    ]  # the trunk, then each layer
    assert alive_before == [[], [], []]
    assert all(ref() is None for _, ref in built)
    assert not any(
        n.startswith("model.layers.") or n == "lm_head.weight" for n in reads[0]
    )  # the trunk (no logits needed)
    assert all(
        n.startswith(f"model.layers.{i}.") for i, names in enumerate(reads[1:]) for n in names
    )


def test_out_of_memory_backs_off_layer_by_layer(sharded_model, monkeypatch):
    """An automatic batch size is halved when a decoder layer runs out of GPU memory: evaluation runs the windows
    not yet scored again, calibration starts over; the results are those of the model in memory."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    whole = load_model(str(sharded_model))
    layers, _ = calibration_targets(resolve_plans(whole.model, [load_recipe("fp8-e4m3")]).values())
    expected = evaluate({"m": whole.model}, windows(), batch_size=2)["m"]
    expected_amax = calibrate(whole.model, windows(), layers, batch_size=2).input_amax
    forward, sizes = LlamaDecoderLayer.forward, []

    def limited(self, hidden_states, *args, **kwargs):
        sizes.append(len(hidden_states))
        if len(hidden_states) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB.")
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", limited)
    streamed = streaming.load_streamed(str(sharded_model))
    got = evaluate(streaming.LayerByLayer(streamed.model), windows(), batch_size=None)["model"]
    assert sizes[0] == 4 and set(sizes[1:]) <= {2, 1}
    assert got.window_nll == expected.window_nll and got.kl_sum == expected.kl_sum
    calibration = calibrate(
        streamed.model,
        windows(),
        layers,
        batch_size=None,
        layer_by_layer=streaming.LayerByLayer(streamed.model),
    )
    assert calibration.metadata["batch_size"] == 2
    assert all(torch.equal(calibration.input_amax[n], expected_amax[n]) for n in layers)


def test_layer_by_layer_keeps_the_hidden_states_in_host_memory_when_the_gpu_cannot_hold_them(
    sharded_model, monkeypatch
):
    """Every window's hidden states wait between decoder layers, whatever the batch size: on a GPU they could not
    fit (a 405B model's 512 calibration windows: 64 GiB), each out-of-memory back-off read the whole checkpoint again
    to fail at batch size 1, and the error advised --low-memory, in use. They wait in host memory when they would
    take more than HIDDEN_ON_GPU_FRACTION of the free GPU memory; a layer-by-layer out-of-memory names other ways
    out. Without a GPU here, the choice is checked on its own, and the scores with the states copied batch by batch
    are the model's in memory."""
    streamed = streaming.load_streamed(str(sharded_model))
    run = streaming.LayerByLayer(streamed.model)
    states = torch.zeros(2, 24, 64)  # one batch of 2 windows: 12 KiB in float32
    assert run._hidden_store(states, 2, 8) == run.device  # on the CPU: where they always were
    run.device = torch.device("cuda")
    free = 4 * 8 * 24 * 64 * 4  # 4 x what 8 windows take
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    assert run._hidden_store(states, 2, 8) == torch.device("cuda")  # a quarter of the free memory
    assert run._hidden_store(states, 2, 9) == torch.device("cpu")  # more
    assert run.with_parts(streaming._as_is, ["a", "b"])._hidden_store(states, 2, 8) == torch.device(
        "cpu"
    )

    whole = load_model(str(sharded_model))
    expected = evaluate({"m": whole.model}, windows(), batch_size=2)["m"]
    copies = []
    original = torch.Tensor.to

    def to(
        self, *args, **kwargs
    ):  # hidden states copied to and from a store that is not the compute device
        copies.append(kwargs.get("copy", False))
        return original(self, *args, **kwargs)

    run = streaming.LayerByLayer(streamed.model)
    monkeypatch.setattr(run, "_hidden_store", lambda hidden, batch, windows: torch.device("cpu"))
    monkeypatch.setattr(torch.Tensor, "to", to)
    got = evaluate(run, windows(), batch_size=2)["model"]
    monkeypatch.undo()
    assert got.window_nll == expected.window_nll and got.kl_sum == expected.kl_sum
    assert (
        copies.count(True) == 4
    )  # each of the 4 batches' captured states copied once into its buffer

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def no_memory(self, hidden_states, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB.")

    monkeypatch.setattr(LlamaDecoderLayer, "forward", no_memory)
    with pytest.raises(
        PtqError, match="use a smaller --batch-size or fewer recipes per run$"
    ) as error:
        evaluate(streaming.LayerByLayer(streamed.model), windows(), batch_size=None)
    assert "--low-memory" not in str(error.value)


def test_layer_by_layer_variants_equal_in_memory_variants(checkpoints):
    """compare's executor on its own: each recipe's variant scored layer by layer equals the variant of the whole
    model (quantize_variants), KL against the baseline included."""
    recipes = [load_recipe("bf16"), load_recipe("fp8-e4m3"), load_recipe("int8")]
    whole = load_model(str(checkpoints["mixtral"]))
    layers, _ = calibration_targets(resolve_plans(whole.model, recipes).values())
    calibration = calibrate(whole.model, windows(), layers, batch_size=3)
    expected = evaluate(
        quantize_variants(whole.model, recipes, calibration), windows(5), batch_size=2
    )

    streamed = streaming.load_streamed(str(checkpoints["mixtral"]))

    import contextlib

    @contextlib.contextmanager
    def variants(part):
        yield quantize_variants(part, recipes, calibration)

    got = evaluate(
        streaming.LayerByLayer(streamed.model, variants, [r.name for r in recipes]),
        windows(5),
        batch_size=2,
    )
    for r in recipes:
        assert got[r.name].window_nll == expected[r.name].window_nll, r.name
        assert got[r.name].window_kl == expected[r.name].window_kl, r.name
    assert got["int8"].kl_sum > 0


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    names = [
        p.name
        for p in directory.iterdir()
        if p.suffix in (".safetensors", ".json") and p.name != "ptq-export.json"
    ]
    return {name: (directory / name).read_bytes() for name in sorted(names)}


@pytest.mark.parametrize(
    "family,recipe",
    [
        ("llama", "fp8-e4m3"),
        ("llama", "int8"),
        ("gemma3", "fp8-e4m3"),
        ("gpt2", "fp8-e4m3"),
        ("mixtral", "fp8-e4m3"),
        ("qwen3_moe", "fp8-e4m3"),
        ("deepseek_v3", "fp8-e4m3"),
    ],
)
def test_layer_by_layer_quantize_writes_the_same_checkpoint(
    family, recipe, checkpoints, tmp_path, ptq_cli, ptq_run
):
    """`ptq quantize --low-memory` (calibrating in the run) and with a --calib file from `ptq calibrate --low-memory`
    write the same bytes (codes, scales, untouched tensors, index, config) as the in-memory `ptq quantize`."""
    model = checkpoints[family]
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    common = ["--recipe", recipe, "--seq-len", "32", "--shard-size", "0.05", "-q"]
    code, _, err = ptq_cli(
        "quantize",
        model,
        "--data",
        text,
        "--samples",
        "5",
        *common,
        "--in-memory",
        "--no-verify",
        "-o",
        tmp_path / "whole",
    )
    assert code == 0, err
    code, out, err = ptq_cli(
        "quantize",
        model,
        "--data",
        text,
        "--samples",
        "5",
        *common,
        "--low-memory",
        "-o",
        tmp_path / "streamed",
    )
    assert code == 0, err
    assert "not verified (exported layer by layer with `--low-memory`" in " ".join(out.split())
    code, _, err = ptq_run(
        "calibrate",
        model,
        data=text,
        samples=5,
        recipe=recipe,
        low_memory=True,
        o=tmp_path / "c.safetensors",
    )
    assert code == 0, err
    code, _, err = ptq_cli(
        "quantize",
        model,
        "--calib",
        tmp_path / "c.safetensors",
        *common,
        "--low-memory",
        "-o",
        tmp_path / "from-calib",
    )
    assert code == 0, err

    whole = checkpoint_files(tmp_path / "whole")
    assert len([n for n in whole if n.startswith("model-")]) > 1
    assert checkpoint_files(tmp_path / "streamed") == whole
    assert checkpoint_files(tmp_path / "from-calib") == whole
    tensors = {}
    for f in sorted((tmp_path / "streamed").glob("model-*.safetensors")):
        tensors |= safetensors.torch.load_file(str(f))
    codes = torch.float8_e4m3fn if recipe == "fp8-e4m3" else torch.int8
    quantized = [name for name, t in tensors.items() if t.dtype == codes]
    assert quantized and all(
        f"{name.removesuffix('.weight')}.input_scale" in tensors for name in quantized
    )
    if family in ("mixtral", "qwen3_moe", "deepseek_v3"):
        assert any(
            ".experts.3." in name for name in quantized
        )  # per-expert 2-D weights, under the checkpoint's names
    info = json.loads((tmp_path / "streamed" / "ptq-export.json").read_text())
    assert (
        info["low_memory"] is True
        and info["verification"] is None
        and "--low-memory" in info["verification_skipped"]
    )
    assert "--low-memory" in (tmp_path / "streamed" / "README.md").read_text()


def test_a_recipe_without_calibration_whose_weight_scales_vllm_shares_streams_the_same_checkpoint(
    sharded_model, text_file, tmp_path, ptq_cli
):
    """Per-tensor FP8 weights with dynamic per-token inputs need no calibration, yet under --target vllm q/k/v and
    gate/up share one weight scale, the largest amax of the group: layer by layer those amaxes are read from the
    files (there is no calibration to take them from; this used to be an AttributeError traceback)."""
    recipe = tmp_path / "tensor-dynamic.yaml"
    recipe.write_text(
        "name: tensor-dynamic\nweights: {format: e4m3}\ninputs: {format: e4m3, dynamic: true}\n"
    )
    common = [
        "--recipe",
        recipe,
        "--data",
        text_file,
        "--seq-len",
        "32",
        "--shard-size",
        "0.05",
        "-q",
    ]
    code, _, err = ptq_cli(
        "quantize", sharded_model, *common, "--in-memory", "--no-verify", "-o", tmp_path / "whole"
    )
    assert code == 0, err
    code, _, err = ptq_cli(
        "quantize", sharded_model, *common, "--low-memory", "-o", tmp_path / "streamed"
    )
    assert code == 0, err
    assert checkpoint_files(tmp_path / "streamed") == checkpoint_files(tmp_path / "whole")
    tensors = {}
    for f in (tmp_path / "whole").glob("model-*.safetensors"):
        tensors |= safetensors.torch.load_file(str(f))
    scales = {
        n: t
        for n, t in tensors.items()
        if n.endswith((".q_proj.weight_scale", ".k_proj.weight_scale"))
    }
    assert scales and len({float(t) for t in scales.values()}) < len(
        scales
    )  # q and k share their layer's scale


def test_a_moe_config_asking_for_router_logits_runs_layer_by_layer(tmp_path):
    """`output_router_logits: true` in a MoE checkpoint's config (kept from its training) makes the model's forward
    gather every layer's router logits for an auxiliary loss, which the trunk of a layer-by-layer run does not have
    (an IndexError traceback before): the same scores as the model in memory, which computes that loss and drops it."""
    path = save_family(tmp_path / "mixtral", "mixtral", output_router_logits=True)
    whole = load_model(str(path))
    assert whole.model.config.output_router_logits
    streamed = streaming.load_streamed(str(path))
    expected = evaluate({"m": whole.model}, windows(4), batch_size=2)["m"]
    got = evaluate(streaming.LayerByLayer(streamed.model), windows(4), batch_size=2)["model"]
    assert got.window_nll == expected.window_nll and got.correct == expected.correct


def test_calibrate_cli_low_memory_file_matches_in_memory(
    sharded_model, text_file, tmp_path, ptq_cli
):
    args = ["--data", text_file, "--samples", "4", "--seq-len", "32", "-q"]
    assert (
        ptq_cli("calibrate", sharded_model, *args, "--in-memory", "-o", tmp_path / "a.st")[0] == 0
    )
    assert (
        ptq_cli("calibrate", sharded_model, *args, "--low-memory", "-o", tmp_path / "b.st")[0] == 0
    )
    a, b = load_calibration(tmp_path / "a.st"), load_calibration(tmp_path / "b.st")
    assert a.input_amax.keys() == b.input_amax.keys() and len(a.input_amax) == 14
    assert all(
        torch.equal(a.input_amax[k], b.input_amax[k])
        and torch.equal(a.weight_amax[k], b.weight_amax[k])
        for k in a.input_amax
    )
    assert "layer by layer" in b.metadata["low_memory"] and "low_memory" not in a.metadata
    assert {k: v for k, v in a.metadata.items() if k != "created"} == {
        k: v for k, v in b.metadata.items() if k not in ("created", "low_memory")
    }


@pytest.mark.parametrize("family", [*STREAMED, "tied-llama", "opt-proj"])
def test_layer_by_layer_compare_gives_the_in_memory_results(
    family, checkpoints, tiny_model, text_file, tmp_path, ptq_cli
):
    """compare --low-memory: every variant's metrics, per-window values and per-layer SNR equal the in-memory
    compare's exactly (same float32 ops, same batches, same order), lm_head in E4M3 and dynamic inputs included."""
    directory = tiny_model if family == "tied-llama" else checkpoints[family]
    recipes = "fp8-e4m3,int8,fp8-e4m3-dynamic" + (
        "" if family == "tied-llama" else f",{tmp_path / 'e4m3-all.yaml'}"
    )
    (tmp_path / "e4m3-all.yaml").write_text(ALL_LINEAR)
    common = [
        "--recipes",
        recipes,
        "--calib-data",
        text_file,
        "--eval-data",
        text_file,
        "--calib-samples",
        "5",
        "--seq-len",
        "24",
        "--max-windows",
        "7",
        "--batch-size",
        "3",
        "--no-plots",
        "-q",
    ]
    results = {}
    for mode in ("--in-memory", "--low-memory"):
        code, _, err = ptq_cli("compare", directory, *common, mode, "--out", tmp_path / mode)
        assert code == 0, err
        results[mode] = json.loads((tmp_path / mode / "results.json").read_text())
    whole, streamed = results["--in-memory"], results["--low-memory"]
    assert not whole["compute"]["low_memory"] and streamed["compute"]["low_memory"]
    assert "layer by layer" in streamed["device"]
    for key in ("perplexity", "accuracy", "window_nll"):
        assert streamed["baseline"][key] == whole["baseline"][key], key
    assert len(whole["variants"]) == len(recipes.split(","))
    for a, b in zip(whole["variants"], streamed["variants"]):
        for key in ("perplexity", "accuracy", "kl_div", "top1_agreement", "window_nll", "snr_db"):
            assert b[key] == a[key], (a["name"], key)
    if family != "tied-llama":  # the lm_head's input in E4M3 is measured
        assert whole["variants"][3]["snr_db"]["inputs"]["lm_head"] is not None
    if (
        family == "opt-proj"
    ):  # the Linear layers before the first decoder layer and after the last one
        assert all(
            whole["variants"][0]["snr_db"]["inputs"][f"model.decoder.project_{x}"]
            for x in ("in", "out")
        )
    assert streamed["calibration"]["layers"] == whole["calibration"]["layers"]


def test_layer_by_layer_compare_refuses_what_needs_the_whole_model(
    sharded_model, text_file, tmp_path, ptq_cli
):
    common = [
        "--eval-data",
        text_file,
        "--calib-data",
        text_file,
        "--seq-len",
        "16",
        "--max-windows",
        "2",
        "--low-memory",
        "-q",
    ]
    for extra, message in (
        (["--recipes", "paper-e4m3"], "compares Linear-layer recipes only"),
        (
            ["--recipes", "fp8-e4m3+kv"],
            "recipe 'fp8-e4m3+kv' quantizes the KV cache: --low-memory compares",
        ),
        (["--tasks", "cloze"], "--tasks needs the whole model in memory"),
        (["--dtype", "bfloat16"], "--low-memory computes in float32"),
    ):
        code, _, err = ptq_cli("compare", sharded_model, *common, *extra, "--out", tmp_path / "x")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x" / "results.json").exists()


@pytest.mark.parametrize("stored", ["bf16", "fp8"])
def test_streams_automatically_when_the_model_does_not_fit(
    stored, checkpoints, tmp_path, ptq_run, monkeypatch
):
    model = checkpoints["qwen3_moe"]  # any architecture; an FP8 checkpoint too, read dequantized
    if stored == "fp8":
        model = save_fp8_checkpoint(model, tmp_path / "fp8", block=16, shards=2)
    params = resources.checkpoint_parameters(model)
    monkeypatch.setattr(
        resources, "available_memory", lambda device: params * 4 - 1
    )  # float32 weights do not fit
    code, _, err = ptq_run(
        "calibrate", model, quiet=None, samples=2, seq_len=16, o=tmp_path / "c.st"
    )
    assert code == 0, err
    assert (
        "does not fit in memory in float32: working layer by layer from disk (--low-memory)"
        in " ".join(err.split())
    )
    assert "layer by layer" in load_calibration(tmp_path / "c.st").metadata["low_memory"]
    # --in-memory keeps the old behaviour: refuse with the estimate
    code, _, err = ptq_run(
        "calibrate", model, quiet=None, samples=2, seq_len=16, in_memory=True, o=tmp_path / "d.st"
    )
    assert code == 2 and "needs at least" in err and not (tmp_path / "d.st").exists()


def test_compare_goes_layer_by_layer_when_its_variants_do_not_fit(
    sharded_model, text_file, tmp_path, ptq_cli, monkeypatch
):
    params = resources.checkpoint_parameters(sharded_model)
    # One float32 copy fits, the original and three models' weight codes (1 + 3 x 0.5 copies) do not.
    monkeypatch.setattr(resources, "available_memory", lambda device: params * 4 * 2)
    common = [
        "--eval-data",
        text_file,
        "--calib-data",
        text_file,
        "--calib-samples",
        "2",
        "--seq-len",
        "16",
        "--max-windows",
        "2",
        "--no-plots",
    ]
    code, _, err = ptq_cli("compare", sharded_model, *common, "--out", tmp_path / "a")
    assert code == 0, err
    assert (
        "and 3 variants of it do not fit in memory: comparing layer by layer from disk (--low-memory)"
        in " ".join(err.split())
    )
    assert (
        json.loads((tmp_path / "a" / "results.json").read_text())["compute"]["low_memory"] is True
    )
    code, _, err = ptq_cli(
        "compare", sharded_model, *common, "--in-memory", "--out", tmp_path / "b"
    )
    assert code == 2 and "needs at least" in err and not (tmp_path / "b").exists()


def test_low_memory_refusals_are_one_line(
    sharded_model, other_tiny_model, text_file, tmp_path, ptq_cli
):
    gpt_oss = tmp_path / "gpt-oss"  # its experts are stored fused (3-D) on disk
    families.build("gpt_oss").save_pretrained(gpt_oss)
    make_tokenizer().save_pretrained(gpt_oss)
    calib = ["--data", text_file, "--samples", "2", "--seq-len", "16", "-q"]
    cases = [
        (("calibrate", gpt_oss, *calib, "--low-memory", "-o", tmp_path / "g.st"), "cannot read"),
        (
            ("calibrate", "some-org/some-model", *calib, "--low-memory", "-o", tmp_path / "h.st"),
            "not in the local Hugging Face cache",
        ),
        (
            (
                "calibrate",
                sharded_model,
                *calib,
                "--low-memory",
                "--resume",
                "-o",
                tmp_path / "r.st",
            ),
            "--resume is not available",
        ),
        (
            (
                "calibrate",
                sharded_model,
                *calib,
                "--recipe",
                "paper-e4m3",
                "--low-memory",
                "-o",
                tmp_path / "a.st",
            ),
            "observes Linear inputs only",
        ),
    ]
    for args, message in cases:
        code, _, err = ptq_cli(*args)
        assert (
            code == 2 and len(err.strip().splitlines()) == 1 and message in " ".join(err.split())
        ), err
    # A calibration of another model is refused before anything is written.
    assert ptq_cli("calibrate", other_tiny_model, *calib, "-o", tmp_path / "other.st")[0] == 0
    code, _, err = ptq_cli(
        "quantize",
        sharded_model,
        "--calib",
        tmp_path / "other.st",
        "--low-memory",
        "-q",
        "-o",
        tmp_path / "out",
    )
    assert code == 2 and "calibration file" in err and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))


def _rewrite(directory: Path, edit) -> None:
    """Each safetensors file of `directory` rewritten as `edit` changes its {name: tensor} (in place)."""
    for f in sorted(directory.glob("*.safetensors")):
        tensors = safetensors.torch.load_file(str(f))
        edit(tensors)
        safetensors.torch.save_file(tensors, str(f), metadata={"format": "pt"})


def test_a_tied_config_with_its_own_lm_head_is_untied_as_transformers_does(
    tmp_path, text_file, ptq_cli
):
    """A config that ties the lm_head to the embeddings while the checkpoint stores a different lm_head.weight:
    transformers keeps them apart; layer by layer too, the lm_head is read, and exported, from its own tensor."""
    model = save_family(tmp_path / "m", "llama")  # its own lm_head
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    whole = load_model(str(model))
    assert whole.model.lm_head.weight is not whole.model.model.embed_tokens.weight
    streamed = streaming.load_streamed(str(model))
    assert streamed.model.ptq_streamed.disk["lm_head.weight"] == "lm_head.weight"
    expected = evaluate({"m": whole.model}, windows(3), batch_size=2)["m"]
    got = evaluate(streaming.LayerByLayer(streamed.model), windows(3), batch_size=2)["model"]
    assert got.window_nll == expected.window_nll
    common = [
        "--recipe",
        "fp8-e4m3",
        "--data",
        text_file,
        "--samples",
        "3",
        "--seq-len",
        "16",
        "-q",
    ]
    assert (
        ptq_cli("quantize", model, *common, "--in-memory", "--no-verify", "-o", tmp_path / "a")[0]
        == 0
    )
    assert ptq_cli("quantize", model, *common, "--low-memory", "-o", tmp_path / "b")[0] == 0
    assert checkpoint_files(tmp_path / "b") == checkpoint_files(tmp_path / "a")
    # A checkpoint storing the same values under both names is tied, as transformers ties it
    embeddings = streaming.SafetensorsCheckpoint(model).read_one("model.embed_tokens.weight")
    _rewrite(
        model, lambda t: t.update({"lm_head.weight": embeddings}) if "lm_head.weight" in t else None
    )
    tied = streaming.load_streamed(str(model)).model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_a_tensor_of_another_shape_is_refused_before_anything_runs(
    checkpoints, tmp_path, text_file, ptq_cli
):
    """copy_ would broadcast a norm weight stored as [1] over the whole layer: every tensor's shape is checked
    against the model's when it is loaded (Conv1D's weight, [in, out] on disk, included)."""
    import shutil

    llama = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], llama)
    name = "model.layers.1.post_attention_layernorm.weight"
    _rewrite(
        llama,
        lambda t: t.update({name: torch.ones(1, dtype=torch.bfloat16)}) if name in t else None,
    )
    calib = ["--data", text_file, "--samples", "2", "--seq-len", "16", "-q", "--low-memory"]
    code, _, err = ptq_cli("calibrate", llama, *calib, "-o", tmp_path / "c.st")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"tensor '{name}'" in err and "shape [1]" in err and "[64]" in err
    assert not (tmp_path / "c.st").exists()

    gpt2 = tmp_path / "gpt2"
    shutil.copytree(checkpoints["gpt2"], gpt2)
    name = (
        "transformer.h.0.mlp.c_fc.weight"  # [64, 256] on disk: stored as a Linear's [256, 64] here
    )
    _rewrite(gpt2, lambda t: t.update({name: t[name].t().contiguous()}) if name in t else None)
    with pytest.raises(
        streaming.PtqError, match=rf"'{name}' .* shape \[256, 64\], but .* has \[64, 256\]"
    ):
        streaming.load_streamed(str(gpt2))
    streaming.load_streamed(str(checkpoints["gpt2"]))  # as saved: loads


def test_a_checkpoint_without_the_base_model_prefix_streams(tmp_path):
    """openai-community/gpt2's checkpoint names its tensors `wte.weight`, not `transformer.wte.weight` (the base
    model's checkpoint): transformers loads it, and so does --low-memory, with the same results."""
    model = families.build("gpt2", seed=3)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    directory = tmp_path / "gpt2"
    model.to(torch.bfloat16).save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    _rewrite(
        directory, lambda t: t.update({k.removeprefix("transformer."): t.pop(k) for k in list(t)})
    )
    with safetensors.safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert "wte.weight" in f.keys() and not any(k.startswith("transformer.") for k in f.keys())
    whole = load_model(str(directory))
    streamed = streaming.load_streamed(str(directory))
    expected = evaluate({"m": whole.model}, windows(3), batch_size=2)["m"]
    got = evaluate(streaming.LayerByLayer(streamed.model), windows(3), batch_size=2)["model"]
    assert got.window_nll == expected.window_nll


def test_the_memory_estimate_counts_the_files_the_index_names(sharded_model, tmp_path):
    """Mistral's repositories ship the sharded weights (named in model.safetensors.index.json) and the same weights
    again as consolidated.safetensors: only what the index names loads, and is counted."""
    import shutil

    directory = tmp_path / "m"
    shutil.copytree(sharded_model, directory)
    params = resources.checkpoint_parameters(sharded_model)
    assert params == sum(p.numel() for p in load_model(str(sharded_model)).model.parameters())
    tensors = {}
    for f in sorted(directory.glob("model-*.safetensors")):
        tensors |= safetensors.torch.load_file(str(f))
    safetensors.torch.save_file(tensors, str(directory / "consolidated.safetensors"))
    assert resources.checkpoint_parameters(directory) == params


def test_streams_automatically_when_the_host_cannot_load_it_for_the_gpu(sharded_model, monkeypatch):
    """On a GPU that holds the model, loading it whole still reads its float32 weights into host memory first: a host
    with less memory than that streams it (one layer at a time, memory-mapped) instead of loading it."""
    params = resources.checkpoint_parameters(sharded_model)
    free = {"cuda": params * 4 * 100, "cpu": params * 4 - 1}
    monkeypatch.setattr(resources, "available_memory", lambda device: free[device.type])
    monkeypatch.setattr(streaming, "default_device", lambda: torch.device("cuda"))
    assert streaming.too_big(str(sharded_model))
    free["cpu"] = params * 4 * 2
    assert not streaming.too_big(str(sharded_model))
    free["cuda"] = params * 4 - 1
    assert streaming.too_big(str(sharded_model))


def assert_read_as_loaded(directory: Path) -> int:
    """Layer by layer, every tensor is read as the in-memory load holds it (transformers' loader dequantizing the
    checkpoint), bit for bit; returns how many were stored as codes. And `ptq inspect`'s model, built from the config
    alone, has the loaded model's matmuls (a quantized checkpoint's too: plain Linear layers, as dequantized)."""
    loaded = load_model(str(directory)).model
    whole = loaded.state_dict()
    built = load_structure(str(directory)).model
    shapes = [
        {n: (kind(m), tuple(m.weight.shape)) for n, m in linear_layers(model).items()}
        for model in (built, loaded)
    ]
    assert shapes[0] == shapes[1] and len(shapes[0]) > 0
    streamed = streaming.load_streamed(str(directory)).model.ptq_streamed
    for name, stored in streamed.disk.items():
        value = streamed.checkpoint.read_one(stored).float()
        assert whole[name].dtype == torch.float32 and torch.equal(value, whole[name]), name
    return sum(
        streamed.checkpoint.dtype[s] in ("F8_E4M3", "I8", "U8") for s in streamed.disk.values()
    )


@pytest.mark.parametrize("family", ["llama", "mixtral", "deepseek_v3"])
def test_an_fp8_checkpoint_is_read_layer_by_layer_dequantized_as_in_memory(
    family, checkpoints, tmp_path, ptq_cli
):
    """An official FP8 checkpoint (DeepSeek-V3, Qwen3 FP8: too large for memory in float32 is what they are) is read
    with --low-memory, each weight its codes times its tile's scale as compressed-tensors' model-free converter
    computes it, equal to what transformers' loader makes of it in memory; `ptq quantize --low-memory` (calibrating
    layer by layer) then writes the bytes the in-memory quantize writes, and says the weights were dequantized."""
    fp8 = save_fp8_checkpoint(checkpoints[family], tmp_path / "fp8", block=16, shards=2)
    assert assert_read_as_loaded(fp8) > (8 if family == "llama" else 20)
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    common = [
        "--recipe",
        "fp8-e4m3",
        "--data",
        text,
        "--samples",
        "3",
        "--seq-len",
        "32",
        "-q",
    ]  # calibrated
    assert (
        ptq_cli("quantize", fp8, *common, "--in-memory", "--no-verify", "-o", tmp_path / "whole")[0]
        == 0
    )
    code, _, err = ptq_cli("quantize", fp8, *common, "--low-memory", "-o", tmp_path / "streamed")
    assert code == 0, err
    assert checkpoint_files(tmp_path / "streamed") == checkpoint_files(tmp_path / "whole")
    info = json.loads((tmp_path / "streamed" / "ptq-export.json").read_text())
    assert "fp8 checkpoint: its weights were dequantized" in info["model"]["caveats"][-1]
    assert "quantization_config" in json.loads(
        (tmp_path / "streamed" / "config.json").read_text()
    )  # ptq's own


@pytest.mark.parametrize("recipe", ["fp8-e4m3", "fp8-block", "mxfp8", "int8"])
def test_a_compressed_tensors_checkpoint_is_read_layer_by_layer_dequantized_as_in_memory(
    recipe, checkpoints, tmp_path, ptq_cli
):
    """ptq's own exports (and llm-compressor's: the same compressed-tensors formats) read with --low-memory: every
    weight equals what transformers' compressed-tensors loader dequantizes in memory (per tensor, per block, E8M0
    groups of 32, int8 codes)."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    out = tmp_path / recipe
    code, _, err = ptq_cli(
        "quantize", checkpoints["llama"], "--recipe", recipe, "--data", text, "--samples", "3", "--seq-len", "32",
        "--no-verify", "-q", "-o", out,
    )  # fmt: skip
    assert code == 0, err
    scales = [
        k
        for f in out.glob("*.safetensors")
        for k in safetensors.torch.load_file(str(f))
        if "weight_scale" in k
    ]
    assert assert_read_as_loaded(out) == len(scales) > 0


def test_low_memory_refuses_packed_and_damaged_quantized_checkpoints_in_one_line(
    checkpoints, tmp_path, ptq_cli
):
    """What the layer-by-layer reader cannot dequantize is named, not read as codes: packed int4 weights (load them
    in memory), an FP8 weight whose scale is missing."""
    packed = tmp_path / "packed"
    packed.mkdir()
    for f in checkpoints["llama"].iterdir():
        (packed / f.name).write_bytes(f.read_bytes())
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    (packed / "config.json").write_text(json.dumps(config))
    damaged = save_fp8_checkpoint(checkpoints["llama"], tmp_path / "damaged", block=16, shards=2)
    index = json.loads((damaged / "model.safetensors.index.json").read_text())
    scale = "model.layers.1.mlp.down_proj.weight_scale_inv"
    file = damaged / index["weight_map"].pop(scale)
    kept = {k: v for k, v in safetensors.torch.load_file(str(file)).items() if k != scale}
    safetensors.torch.save_file(kept, str(file), metadata={"format": "pt"})
    (damaged / "model.safetensors.index.json").write_text(json.dumps(index))
    cases = [
        (packed, "--low-memory reads 16/32-bit and 8-bit quantized checkpoints only"),
        (damaged, "tensor 'model.layers.1.mlp.down_proj.weight' in"),
    ]
    for model, message in cases:
        code, _, err = ptq_cli("calibrate", model, "--samples", "2", "--seq-len", "16", "--low-memory", "-q", "-o",
                               tmp_path / "c.st")  # fmt: skip
        assert (
            code == 2 and len(err.strip().splitlines()) == 1 and message in " ".join(err.split())
        ), err


def cache_as_hub(source: Path, cache: Path, repo: str, monkeypatch) -> None:
    """`source` as the Hugging Face cache holds a downloaded Hub model (models--org--name: refs/main naming a snapshot
    folder of its files), the cache pointed at `cache`, and no Hub to reach (HF_HUB_OFFLINE)."""
    import huggingface_hub.constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def hub_model(checkpoints, tmp_path, monkeypatch):
    cache_as_hub(checkpoints["llama"], tmp_path / "hub", "ptq-test/tiny-llama", monkeypatch)
    return "ptq-test/tiny-llama"


def test_a_hub_id_is_read_from_its_folder_in_the_cache_layer_by_layer_as_in_memory(
    hub_model, tmp_path, ptq_cli
):
    """A Hub id is a folder once its files are in the Hugging Face cache (hub_snapshot): --low-memory reads it (it
    used to be refused: "works on a local model directory"), with the numbers of the in-memory compare."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    common = ["--calib-data", text, "--calib-samples", "3", "--eval-data", text, "--seq-len", "32"]
    common += ["--max-windows", "3", "--recipes", "fp8-e4m3", "-q"]
    code, _, err = ptq_cli(
        "compare", hub_model, *common, "--in-memory", "--out", tmp_path / "whole"
    )
    assert code == 0, err
    code, _, err = ptq_cli(
        "compare", hub_model, *common, "--low-memory", "--out", tmp_path / "streamed"
    )
    assert code == 0, err
    whole, streamed = (
        json.loads((tmp_path / d / "results.json").read_text()) for d in ("whole", "streamed")
    )
    assert [v["perplexity"] for v in streamed["variants"]] == [
        v["perplexity"] for v in whole["variants"]
    ]
    assert streamed["model"][
        "name"
    ] == hub_model and "Hugging Face Hub: ptq-test/tiny-llama" in str(streamed["model"])


def test_a_hub_id_too_big_for_memory_is_checked_before_loading_and_goes_layer_by_layer(
    hub_model, checkpoints, text_file, tmp_path, ptq_cli, monkeypatch
):
    """A Hub id's size is known from its files before it is loaded: one that does not fit goes layer by layer on its
    own, and --in-memory refuses it with the estimate (before, a Hub id had no memory check: from_pretrained ran out
    of memory)."""
    params = resources.checkpoint_parameters(checkpoints["llama"])
    monkeypatch.setattr(resources, "available_memory", lambda device: params * 4 - 1)
    calib = ["--data", text_file, "--samples", "2", "--seq-len", "16"]
    code, _, err = ptq_cli("calibrate", hub_model, *calib, "-o", tmp_path / "c.st")
    assert code == 0, err
    assert "working layer by layer from disk (--low-memory)" in " ".join(err.split())
    code, _, err = ptq_cli("calibrate", hub_model, *calib, "--in-memory", "-o", tmp_path / "d.st")
    assert code == 2 and "needs at least" in err and not (tmp_path / "d.st").exists()


@pytest.mark.parametrize("recipe", ["int8", "fp8-dynamic"])
def test_a_gpt2_checkpoint_ptq_wrote_is_read_dequantized_in_memory_and_layer_by_layer(
    recipe, checkpoints, tmp_path, ptq_cli
):
    """GPT-2 stores its Conv1D weights [in, out], their per-channel scales [out, 1]: transformers' compressed-tensors
    loader refused the checkpoint ptq quantize writes for it ("CONVERSION entries"), and --low-memory broadcast the
    scales along the wrong dimension (a traceback; a square c_proj silently wrong). Each Linear weight, in memory,
    equals the file's codes (decoded by numpy and ml_dtypes, not by torch) transposed times the row's scale, and
    `ptq eval` scores the same whole and layer by layer. quantize says its verification reloaded with ptq's reader."""
    import ml_dtypes
    import numpy as np

    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    out = tmp_path / recipe
    code, out_text, err = ptq_cli(
        "quantize", checkpoints["gpt2"], "--recipe", recipe, "--data", text, "--samples", "3", "--seq-len", "32",
        "--verify-windows", "2", "-q", "-o", out,
    )  # fmt: skip
    assert code == 0, err
    assert "verification passed (ptq reader reload vs ptq simulation" in out_text, (
        out_text
    )  # not transformers'
    stored = {
        k: v
        for f in out.glob("*.safetensors")
        for k, v in safetensors.torch.load_file(str(f)).items()
    }
    model = load_model(str(out), reader=streaming.whole_reader(str(out))).model
    layers = [k.removesuffix(".weight_scale") for k in stored if k.endswith(".weight_scale")]
    square = 0
    for name in layers:
        codes = stored[f"{name}.weight"]
        as_numpy = (
            codes.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
            if codes.dtype != torch.int8
            else codes.numpy()
        )
        scale = stored[f"{name}.weight_scale"].float().numpy()
        assert scale.shape == (codes.shape[1], 1)  # [out, 1]: codes are [in, out]
        expected = torch.from_numpy(as_numpy.astype(np.float32).T * scale)
        assert torch.equal(model.get_submodule(name).weight, expected), name
        square += codes.shape[0] == codes.shape[1]
    assert (
        len(layers) == 8 and square == 2
    )  # c_attn, attn.c_proj (square), c_fc, mlp.c_proj in each of 2 layers
    scores = []
    for how in ("--in-memory", "--low-memory"):
        code, _, err = ptq_cli(
            "eval", out, "--eval-data", text, "--seq-len", "32", "--out", tmp_path / how, "-q", how
        )
        assert code == 0, err
        scores.append(json.loads((tmp_path / how / "results.json").read_text()))
    assert scores[0]["config"]["perplexity"] == scores[1]["config"]["perplexity"] > 1


def test_an_mxfp8_moe_checkpoint_ptq_wrote_is_read_in_memory_where_transformers_fails(
    checkpoints, tmp_path, ptq_cli
):
    """transformers' loader fails on the merged experts of an MXFP8 Qwen3-MoE checkpoint ("CONVERSION entries" of a
    report it does not show): ptq reads it with its own reader, whole. Every weight equals its E4M3 codes (ml_dtypes)
    times 2^(e8m0 - 127) over its group of 32 inputs, computed here with numpy from the files."""
    import ml_dtypes
    import numpy as np

    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    out = tmp_path / "mx"
    code, _, err = ptq_cli(
        "quantize", checkpoints["qwen3_moe"], "--recipe", "mxfp8", "--data", text, "--seq-len", "32", "--no-verify",
        "-q", "-o", out,
    )  # fmt: skip
    assert code == 0, err
    stored = {
        k: v
        for f in out.glob("*.safetensors")
        for k, v in safetensors.torch.load_file(str(f)).items()
    }
    whole = load_model(str(out), reader=streaming.whole_reader(str(out))).model.state_dict()
    disk = streaming.load_streamed(str(out)).model.ptq_streamed.disk
    checked = 0
    for name, on_disk in disk.items():
        scale = stored.get(f"{on_disk}_scale")
        if scale is None:
            continue
        codes = (
            stored[on_disk]
            .view(torch.uint8)
            .numpy()
            .view(ml_dtypes.float8_e4m3fn)
            .astype(np.float32)
        )
        factor = np.exp2(scale.numpy().astype(np.float32) - 127).repeat(32, axis=1)[
            :, : codes.shape[1]
        ]
        assert torch.equal(whole[name], torch.from_numpy(codes * factor)), name
        checked += ".experts." in name
    assert checked >= 2 * 4 * 3  # 2 layers x 4 experts x gate, up, down
