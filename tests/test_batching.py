"""--batch-size auto, its back-off on CUDA out-of-memory, and GPU memory faults as one line (exit 2). CUDA's
out-of-memory is injected: a model whose forward raises torch.cuda.OutOfMemoryError above N windows."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ptq.calibration.calibrate import load_calibration
from ptq.errors import PtqError
from ptq.evaluation.evaluate import evaluate
from ptq.execution import batching

FAST = ["--seq-len", "32", "--max-windows", "6", "--calib-samples", "4", "--quiet"]


def oom_above(monkeypatch, limit: int, calls: list | None = None):
    """Every LlamaForCausalLM forward of more than `limit` rows raises CUDA's out-of-memory error."""
    from transformers import LlamaForCausalLM

    forward = LlamaForCausalLM.forward

    def limited(self, input_ids=None, **kwargs):
        if calls is not None:
            calls.append(len(input_ids))
        if len(input_ids) > limit:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total "
                f"capacity of 139.8 GiB of which 1.2 GiB is free. ({len(input_ids)} rows)"
            )
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", limited)


def test_batch_size_is_a_positive_integer_or_auto():
    assert batching.parse_batch_size("auto") is None and batching.parse_batch_size(None) is None
    assert batching.parse_batch_size("8") == 8 and batching.parse_batch_size(3) == 3
    for bad in ("0", "-2", "many", "2.5"):
        with pytest.raises(PtqError, match="--batch-size must be a positive integer or 'auto'"):
            batching.parse_batch_size(bad)


def test_auto_is_the_old_default_on_the_cpu_and_follows_free_memory_on_cuda(
    tiny_model, monkeypatch
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert batching.auto_batch_size(model, 32, windows=40) == batching.CPU_BATCH_SIZE
    assert batching.auto_batch_size(model, 32, windows=3) == 3
    # The logits dominate: vocab x seq_len x (compute dtype + float32), plus the baseline's float32 probabilities
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336)
    one = batching.window_bytes(config, 2048, torch.bfloat16, models=1)
    assert one == 2048 * 128256 * 2 + 2048 * (8 * 4096 + 3 * 14336) * 2
    assert batching.window_bytes(config, 2048, torch.bfloat16, models=3) == one + 2048 * 128256 * 4
    # On CUDA, the free memory decides (mem_get_info stubbed: this machine may have no GPU)
    param = torch.nn.Parameter(torch.empty(0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * one, 200 * one))

    class OnCuda(torch.nn.Module):
        def parameters(self, recurse=True):
            yield type("P", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16})()

    fake = OnCuda()
    fake.config = config
    assert batching.auto_batch_size(fake, 2048, windows=1000) == min(
        batching.MAX_AUTO_BATCH_SIZE, int(100 * 0.7)
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (one // 2, 200 * one))
    assert (
        batching.auto_batch_size(fake, 2048, windows=1000) == 1
    )  # even when one window does not seem to fit
    del param


def test_an_automatic_batch_size_halves_on_out_of_memory_with_the_same_scores(
    tiny_model, monkeypatch
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    other = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.nn.init.normal_(other.model.layers[0].mlp.down_proj.weight, std=0.05)
    ids = torch.randint(
        0, model.config.vocab_size, (7, 24), generator=torch.Generator().manual_seed(0)
    )
    want = evaluate({"a": model, "b": other}, ids, batch_size=1)
    calls = []
    oom_above(monkeypatch, 1, calls)
    got = evaluate(
        {"a": model, "b": other}, ids, batch_size=None
    )  # auto: 4 on the CPU, then 2, then 1
    assert calls[:3] == [4, 2, 1] and max(calls[3:]) == 1
    for name in ("a", "b"):
        assert (
            got[name] == want[name]
        )  # every sum and per-window list: a failed batch left nothing behind
    assert got["b"].kl_div > 0


def test_an_explicit_batch_size_that_does_not_fit_is_one_line(tiny_model, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.randint(
        0, model.config.vocab_size, (6, 24), generator=torch.Generator().manual_seed(0)
    )
    oom_above(monkeypatch, 1)
    with pytest.raises(PtqError) as e:
        evaluate({"a": model}, ids, batch_size=2)
    message = str(e.value)
    assert (
        "\n" not in message
        and "out of GPU memory evaluating 1 model(s) on 2 window(s) of 24 tokens" in message
    )
    assert (
        "estimated" in message
        and "Tried to allocate 3.91 GiB" in message
        and "--batch-size" in message
    )
    assert "--low-memory" in message and "fewer recipes" in message


def test_compare_with_an_automatic_batch_size_survives_out_of_memory(
    ptq_run, tiny_model, tmp_path, monkeypatch
):
    runs = {}
    for name, limit in (("plain", 100), ("oom", 1)):
        with monkeypatch.context() as m:
            oom_above(m, limit)
            code, _, stderr = ptq_run("compare", tiny_model, out=tmp_path / name, max_windows=6)
        assert code == 0, stderr
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    for key in ("perplexity", "accuracy", "window_nll"):
        assert runs["oom"]["baseline"][key] == runs["plain"]["baseline"][key]
    for a, b in zip(runs["oom"]["variants"], runs["plain"]["variants"]):
        assert (a["perplexity"], a["kl_div"], a["top1_agreement"]) == (
            b["perplexity"],
            b["kl_div"],
            b["top1_agreement"],
        )


def test_compare_with_an_explicit_batch_size_that_does_not_fit_is_one_line_exit_2(
    ptq_run, tiny_model, tmp_path, monkeypatch
):
    oom_above(monkeypatch, 1)
    out = tmp_path / "x"
    code, _, stderr = ptq_run("compare", tiny_model, out=out, batch_size=2, max_windows=6)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert (
        "out of GPU memory evaluating 3 model(s) on 2 window(s)" in stderr
        and "--batch-size" in stderr
    )
    assert not out.exists()


@pytest.mark.parametrize("value", ["0", "lots"])
def test_a_bad_batch_size_is_one_line_exit_2(ptq_run, tiny_model, tmp_path, value):
    code, _, stderr = ptq_run(
        "compare", tiny_model, calib_data=None, out=tmp_path / "x", batch_size=value, max_windows=6
    )
    assert code == 2 and "--batch-size must be a positive integer or 'auto'" in stderr
    assert len(stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_out_of_memory_while_loading_is_one_line_naming_the_model(
    ptq_cli, tiny_model, text_file, tmp_path, monkeypatch
):
    import ptq.commands.common

    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 28.00 GiB. GPU 0 has 1.0 GiB free."
        )

    monkeypatch.setattr(ptq.commands.common, "load_model", no_room)
    for command in (
        ["compare", "--out", tmp_path / "c"],
        ["eval", "--tasks", "", "--out", tmp_path / "e"],
        ["calibrate", "-o", tmp_path / "c.safetensors", "--data", text_file],
    ):
        extra = (
            ["--eval-data", text_file, "--seq-len", "32", "--max-windows", "4"]
            if command[0] != "calibrate"
            else []
        )
        code, _, stderr = ptq_cli(command[0], tiny_model, *command[1:], *extra, "--quiet")
        assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert (
            f"out of GPU memory loading model '{tiny_model}'" in stderr
            and "Tried to allocate 28.00 GiB" in stderr
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]  # no output, no checkpoint


def test_out_of_memory_while_exporting_leaves_nothing(ptq_run, tiny_model, tmp_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    import ptq.export.reading

    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    monkeypatch.setattr(ptq.export.reading, "reload", no_room)
    out = tmp_path / "exported"
    code, _, stderr = ptq_run("quantize", tiny_model, recipe="fp8-e4m3", o=out)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "out of GPU memory exporting and verifying the checkpoint" in stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def test_an_out_of_memory_no_step_names_is_still_one_line(
    ptq_cli, tiny_model, text_file, tmp_path, monkeypatch
):
    import ptq.commands.common

    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.00 GiB.")

    monkeypatch.setattr(ptq.commands.common, "make_windows", no_room)
    code, _, stderr = ptq_cli(
        "compare", tiny_model, "--eval-data", text_file, "--out", tmp_path / "x", *FAST
    )
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert (
        "out of GPU memory (CUDA out of memory. Tried to allocate 5.00 GiB)" in stderr
        and "--low-memory" in stderr
    )


# Calibration: --batch-size for `ptq calibrate` and the calibration inside compare / eval / quantize --------------


def oom_in_mlp_above(monkeypatch, limit: int, calls: list | None = None):
    """Every LlamaMLP forward of more than `limit` rows raises CUDA's out-of-memory error: half-way through the
    model, after the observers of the first block's attention have counted the batch."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    forward = LlamaMLP.forward

    def limited(self, x):
        if calls is not None:
            calls.append(len(x))
        if len(x) > limit:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.50 GiB. ({len(x)} rows)"
            )
        return forward(self, x)

    monkeypatch.setattr(LlamaMLP, "forward", limited)


def test_calibration_estimate_has_no_metrics_and_logits_only_when_computed():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336)
    block = 2048 * (8 * 4096 + 3 * 14336) * 2
    observer = (
        2048 * 14336 * 16
    )  # float32 copy, int32 bits, int64 bin index of the MLP's intermediate input
    assert (
        batching.window_bytes(config, 2048, torch.bfloat16, calibrating=True, logits=False)
        == block + observer
    )
    assert (
        batching.window_bytes(config, 2048, torch.bfloat16, calibrating=True, logits=True)
        == block + observer + 2048 * 128256 * 2
    )  # the lm_head calibrated: logits in bf16, no float32 copy
    assert (
        batching.window_bytes(config, 2048, torch.bfloat16) == 2048 * 128256 * 2 + block
    )  # evaluation unchanged


def _calibration_setup(tiny_model):
    from ptq.quantization.plan import calibrated_layers
    from ptq.quantization.recipes import load_recipe

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.randint(
        0, model.config.vocab_size, (7, 24), generator=torch.Generator().manual_seed(0)
    )
    return model, ids, calibrated_layers(model, load_recipe("fp8-e4m3"))


def test_calibration_with_an_automatic_batch_size_restarts_on_out_of_memory(
    tiny_model, monkeypatch
):
    from ptq.calibration.calibrate import TensorObserver, calibrate

    model, ids, layers = _calibration_setup(tiny_model)
    want = calibrate(model, ids, layers, batch_size=2)
    observed, calls = [], []
    forward = TensorObserver.__call__

    def counting(self, module, args):
        observed.append(len(args[0]))
        forward(self, module, args)

    monkeypatch.setattr(TensorObserver, "__call__", counting)
    oom_in_mlp_above(monkeypatch, 2, calls)
    got = calibrate(
        model, ids, layers, batch_size=None
    )  # auto: 4 on the CPU, then 2 from the first batch again
    assert calls[0] == 4 and set(calls[1:]) == {2, 1}
    assert (
        4 in observed
    )  # the failed batch of 4 was counted by the first block's attention observers ...
    assert got.metadata["batch_size"] == 2 == want.metadata["batch_size"]
    assert (
        got.input_amax.keys() == want.input_amax.keys()
        and got.input_hist.keys() == want.input_hist.keys()
    )
    for name in (
        want.input_amax
    ):  # ... and yet nothing of it is left: amax and histograms as on batches of 2
        assert torch.equal(got.input_amax[name], want.input_amax[name]), name
        assert torch.equal(got.input_hist[name], want.input_hist[name]), name
    assert sum(int(h.sum()) for h in got.input_hist.values()) > 0


def test_calibration_with_an_explicit_batch_size_that_does_not_fit_is_one_line(
    tiny_model, monkeypatch
):
    from ptq.calibration.calibrate import calibrate

    model, ids, layers = _calibration_setup(tiny_model)
    oom_in_mlp_above(monkeypatch, 1)
    with pytest.raises(PtqError) as e:
        calibrate(model, ids, layers, batch_size=2)
    message = str(e.value)
    assert (
        "\n" not in message
        and "out of GPU memory calibrating on batches of 2 window(s) of 24 tokens" in message
    )
    assert (
        "estimated" in message
        and "Tried to allocate 2.50 GiB" in message
        and "--batch-size" in message
    )
    with pytest.raises(PtqError, match="out of GPU memory calibrating on batches of 1 window"):
        oom_in_mlp_above(monkeypatch, 0)
        calibrate(
            model, ids, layers, batch_size=None
        )  # automatic, down to one window that does not fit either


CALIBRATE = ["--samples", "6", "--seq-len", "16", "--quiet"]


def test_calibrate_command_batch_size(ptq_cli, tiny_model, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")

    def calibrate(out, *extra):
        return ptq_cli("calibrate", tiny_model, "--data", text_file, "-o", out, *CALIBRATE, *extra)

    code, _, stderr = calibrate(tmp_path / "two.st", "--batch-size", "2")
    assert code == 0, stderr
    assert load_calibration(tmp_path / "two.st").metadata["batch_size"] == 2
    code, _, stderr = calibrate(tmp_path / "cpu.st")  # auto on the CPU: 4, the old fixed size
    assert code == 0, stderr
    assert load_calibration(tmp_path / "cpu.st").metadata["batch_size"] == batching.CPU_BATCH_SIZE
    with monkeypatch.context() as m:
        oom_in_mlp_above(m, 2)
        code, _, stderr = calibrate(
            tmp_path / "auto.st"
        )  # auto: 4 runs out of memory, restarts on 2
        assert code == 0, stderr
        assert (tmp_path / "auto.st").read_bytes() == (
            tmp_path / "two.st"
        ).read_bytes()  # the same file, byte for byte
        code, _, stderr = calibrate(tmp_path / "three.st", "--batch-size", "3")
        assert code == 2 and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, (
            stderr
        )
        assert "out of GPU memory calibrating on batches of 3 window(s) of 16 tokens" in stderr
        assert (
            not (tmp_path / "three.st").exists() and not (tmp_path / "three.st.checkpoint").exists()
        )
    code, _, stderr = calibrate(tmp_path / "bad.st", "--batch-size", "0")
    assert code == 2 and "--batch-size must be a positive integer or 'auto'" in stderr


def test_compare_and_quantize_calibrate_on_their_batch_size(ptq_run, tiny_model, tmp_path):
    code, _, stderr = ptq_run(
        "compare", tiny_model, out=tmp_path / "c", batch_size=3, max_windows=6
    )
    assert code == 0, stderr
    assert (
        json.loads((tmp_path / "c" / "results.json").read_text())["calibration"]["batch_size"] == 3
    )
    pytest.importorskip("compressed_tensors")
    code, _, stderr = ptq_run(
        "quantize", tiny_model, batch_size=1, no_verify=True, o=tmp_path / "q"
    )
    assert code == 0, stderr
    assert (
        json.loads((tmp_path / "q" / "ptq-export.json").read_text())["calibration"]["batch_size"]
        == 1
    )


def test_the_estimate_reads_a_multimodal_models_text_config(monkeypatch):
    """Gemma 3 4B and up (Gemma3ForConditionalGeneration, what AutoModelForCausalLM loads), Mistral 3, Llama 4 keep
    vocab_size and hidden_size in config.text_config: read off the top-level config, the estimate was 1 byte a
    window and `auto` took MAX_AUTO_BATCH_SIZE windows whatever the free memory."""
    from transformers import Gemma3Config

    config = (
        Gemma3Config()
    )  # google/gemma-3-4b-it's text shape: 262,208-token vocabulary, 2560 wide
    text = config.get_text_config()
    assert batching.window_bytes(config, 2048, torch.bfloat16, models=3) == batching.window_bytes(
        text, 2048, torch.bfloat16, models=3
    )
    assert (
        batching.window_bytes(config, 2048, torch.bfloat16, calibrating=True)
        > 2048 * text.vocab_size * 2
    )

    class OnCuda(torch.nn.Module):
        def parameters(self, recurse=True):
            yield type("P", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16})()

    fake = OnCuda()
    fake.config = config
    one = batching.window_bytes(text, 2048, torch.bfloat16, models=3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * one, 20 * one))
    assert (
        batching.auto_batch_size(fake, 2048, windows=1000, models=3) == 7
    )  # 70% of 10 windows, not 64


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_whole_models_build_no_kv_cache(family):
    """Scoring and calibrating run each forward once over whole windows: a KV cache (transformers builds one unless
    told not to: config.use_cache) would hold every layer's keys and values for the batch until its logits are
    scored, on top of what `auto` estimates (Llama 2 7B: 1 GiB a window of 2048 tokens, eight times its logits)."""
    import families
    from transformers.cache_utils import Cache

    from ptq.calibration.calibrate import calibrate
    from ptq.models.loading import linear_layers
    from ptq.models.matmuls import linearize

    model = linearize(families.build(family))  # as loaded: GPT-2's Conv1D as Linear
    ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    expected = [model(input_ids=ids[i : i + 2]).logits for i in (0, 2)]  # with its cache, as before
    outputs = []
    hooks = [
        m.register_forward_hook(lambda m, a, out: outputs.append(out))
        for m in (model, model.base_model)
    ]
    scores = evaluate({"m": model}, ids, batch_size=2)["m"]
    linear = next(n for n in linear_layers(model) if "lm_head" not in n)
    calibrate(model, ids, [linear], batch_size=2)
    for h in hooks:
        h.remove()
    assert outputs and not [k for out in outputs for k, v in out.items() if isinstance(v, Cache)]
    nll = [
        torch.nn.functional.cross_entropy(lg[w, :-1], ids[i + w, 1:]).item()
        for i, lg in zip((0, 2), expected)
        for w in range(len(lg))
    ]
    assert scores.window_nll == pytest.approx(nll, rel=1e-5)  # the same numbers


def test_the_estimate_counts_the_scores_eager_attention_materializes():
    """Gemma 2 and gpt-oss run eager attention by default (ptq's attention quantization too): each layer's scores,
    heads x seq_len^2 a window, are in memory in the compute dtype and as their float32 softmax. gpt-oss-20b at 2048
    tokens: 64 heads x 2048^2 x 4 bytes = 1 GiB a window for the softmax alone, left out of an estimate of 2.4 GiB."""
    from transformers import GptOssConfig

    config = GptOssConfig()  # gpt-oss-20b's shape: 64 heads, 201,088-token vocabulary
    sdpa = batching.window_bytes(config, 2048, torch.bfloat16, models=2)
    config._attn_implementation = "eager"
    softmax = config.num_attention_heads * 2048 * 2048 * 4
    assert batching.window_bytes(config, 2048, torch.bfloat16, models=2) >= sdpa + softmax
    for calibrating in (True, False):
        config._attn_implementation = "sdpa"
        fused = batching.window_bytes(config, 2048, torch.bfloat16, calibrating=calibrating)
        config._attn_implementation = (
            "ptq"  # ptq.quantization.attention: eager, with its quantizers
        )
        assert (
            batching.window_bytes(config, 2048, torch.bfloat16, calibrating=calibrating)
            >= fused + softmax
        )


def test_auto_takes_the_smallest_batch_over_the_models_a_variant_with_eager_attention_included(
    tiny_model, monkeypatch
):
    """A variant that quantizes attention runs ptq's eager attention (heads x seq_len^2 scores a window) where the
    baseline runs SDPA: the batch size was estimated from the baseline alone. Both the evaluation and lm-eval's
    batches now take the smallest estimate over the models."""
    from transformers import LlamaConfig

    from ptq.evaluation.evaluate import evaluate

    def on_cuda(attention: str) -> torch.nn.Module:
        class OnCuda(torch.nn.Module):
            def parameters(self, recurse=True):
                yield type("P", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16})()

        fake = OnCuda()
        fake.config = LlamaConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32
        )
        fake.config._attn_implementation = attention
        return fake

    baseline, variant = on_cuda("sdpa"), on_cuda("ptq")
    sdpa = batching.window_bytes(baseline.config, 4096, torch.bfloat16, models=2)
    eager = batching.window_bytes(variant.config, 4096, torch.bfloat16, models=2)
    assert eager == sdpa + 32 * 4096 * 4096 * (
        2 * 2 + 4
    )  # by hand: the scores, their float32 softmax, the cast
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * eager, 40 * eager))
    alone = batching.auto_batch_size(baseline, 4096, windows=1000, models=2)
    both = batching.auto_batch_size([baseline, variant], 4096, windows=1000, models=2)
    assert both == int(20 * eager * batching.GPU_MEMORY_FRACTION // eager) == 14 and alone > both
    # the evaluation hands every model it runs to the estimate
    given = []
    monkeypatch.setattr(
        batching, "auto_batch_size", lambda model, *a, **k: given.append(model) or 2
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    evaluate({"a": model, "b": model}, torch.randint(0, 100, (2, 8)), batch_size=None)
    assert given == [[model, model]]
