"""Verifying a written checkpoint: ptq's simulation of what the loader computes, the tensors the
files must hold bit for bit, and the check itself (verify), which scores the reloaded checkpoint
against the simulation and returns a typed Verification.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ptq.calibration.calibrate import Calibration
from ptq.calibration.clips import input_clip, quantize_
from ptq.export.checkpoint import _input_scale, kv_cache_entries
from ptq.export.format import weight_scale_shape
from ptq.export.reading import _read_tensors
from ptq.export.record import ExportRecord, NoiseFloor, Tolerance, Verification
from ptq.models.matmuls import LinearExperts, quantizable
from ptq.models.names import checkpoint_names, saved_names
from ptq.numerics.granularity import (
    PerTensor,
    PerToken,
    e8m0_codes,
)
from ptq.quantization import engines
from ptq.quantization.plan import Plan
from ptq.quantization.plan import resolve_plan as plan_of
from ptq.quantization.quantize import QuantLinear
from ptq.quantization.recipes import Recipe

# What verification checks, and why these limits. The gate is what separates a wrong checkpoint from
# float-order noise on any model: (1) every quantized tensor in the files (codes, weight_scale,
# input_scale) is ptq's, bit for bit; (2) the reloaded model computes what ptq's simulation of the
# loader's arithmetic computes: the same codes, scales, input rounding and float32 ops in the same
# order, so the KL is 0 on SmolLM2 and the test models and summation-order differences would stay
# near 1e-10; input scales 3x off already give 1e-5 on a tiny random model. A tolerance from the
# float-order noise floor cannot be the gate: on SmolLM2 with int8, the same simulation with eager
# instead of sdpa attention moves perplexity by 1.1% (KL 0.28, same top-1 73%), while one layer's
# weight_scale x2 (model.layers.29.self_attn.o_proj) gives KL 0.20: inside that noise, yet caught by
# (1) and (2). The noise floor is measured in every verification (that attention swap, on the
# simulation) and reported next to the perplexity difference from ptq's own simulation (what `ptq
# compare` reports), which differs from the loader's by its int8 input range only.
VERIFY_MAX_KL = 1e-6  # mean KL(simulated || reloaded), nats per predicted token
VERIFY_MIN_TOP1 = 0.99  # share of positions where both predict the same next token
VERIFY_CRITERION = (
    "the files hold ptq's quantized tensors bit for bit, and the reloaded model reproduces ptq's "
    f"simulation of the loader's arithmetic (KL <= {VERIFY_MAX_KL:g} nats/token, same top-1 >= "
    f"{100 * VERIFY_MIN_TOP1:g}%); the perplexity difference from ptq's own simulation is reported "
    "next to the float-order noise floor (the simulation with another attention implementation), "
    "which can exceed a wrong scale's effect"
)


class VerificationFailed(Exception):
    """The reloaded checkpoint does not match the simulation; carries the export record with its
    verification, and (info) that record as ptq-export.json would hold it."""

    def __init__(self, record: ExportRecord):
        super().__init__("; ".join(record.verification.problems))
        self.record = record
        self.info = record.to_json()


def simulate_export(
    model: nn.Module,
    recipe: Recipe,
    calibration: Calibration,
    loader_inputs: bool = True,
    unrounded_inputs: list[str] = (),
    target: str = "transformers",
    token_rule_inputs: list[str] = (),
    kv_cache: bool = False,
) -> nn.Module:
    """ptq's simulation of the exported checkpoint, in place: quantize_ with the recipe and
    calibration, except that the layers the recipe leaves out keep their plain Linear (the
    checkpoint stores them unquantized and transformers runs them as is, where `ptq compare` rounds
    them to bf16 as in its 16-bit baseline), and, with loader_inputs, inputs round as the reload
    check's loader rounds them: int8 over the loaders' [-128, 127] range (ptq's own is [-127, 127]),
    static FP8 inputs divided by their scale as compressed-tensors does in transformers (vLLM
    multiplies by the reciprocal: engines rule 5). loader_inputs=False: as `ptq compare` simulates
    the target. The `unrounded_inputs` layers keep their quantized weights but take their inputs as
    they are (what the loader of the reload check computes for them: see unapplied_input_layers).
    `target`: whose scales the checkpoint holds (ptq.quantization.engines; vllm: the fused groups'
    shared scales). The `token_rule_inputs` layers take their dynamic input scales as
    compressed-tensors does in transformers (see token_rule_layers). kv_cache: whether the loader
    quantizes the KV cache (reload's kv_cache_quantized)"""
    # transformers (but 5.17) does not quantize the KV cache (vLLM does, from k_scale / v_scale):
    # simulated without it then; its scales are checked in the files either way (unapplied_scales)
    if not kv_cache:
        recipe = dataclasses.replace(recipe, kv_cache=None)
    plan = plan_of(model, recipe, target, **(engines.RELOAD_LOADER_INPUTS if loader_inputs else {}))
    kept = {name: model.get_submodule(name) for name in plan.left_out}
    quantize_(model, recipe, calibration, target=target, plan=plan)
    for name, m in kept.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, m)
    for name in unrounded_inputs:
        model.get_submodule(name).round_inputs = False
    for name in token_rule_inputs:
        model.get_submodule(name).__class__ = _TokenScalesOfTheLoader
    return model


# compressed-tensors' dynamic "token" strategy (compute_dynamic_scales_and_zp, 0.20) keeps
# dimensions 0 and 1 of the input and reduces the rest: per token for [batch, tokens, features], but
# ONE scale for a 2-D [tokens, features] input (torch reduces every dimension over an empty list),
# which some modules feed their Linear layers (Qwen2-MoE's shared expert: hidden_states.view(-1,
# H)), and one per window for DeepSeek-V3's kv_b_proj, fed [batch, 1, tokens, rank]. vLLM flattens
# every input to 2-D and scales each token (as ptq simulates), so this is the reload check's
# loader's arithmetic, not the served one: the check simulates it for those layers, and reports
# ptq's own next to it.


class _TokenScalesOfTheLoader(QuantLinear):
    """A QuantLinear with dynamic per-token inputs scaled as compressed-tensors scales them in
    transformers: one scale per index of the input's first two dimensions, over the others (per
    token for a 3-D input)."""

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 3 or not self.round_inputs:
            return super().quantize_input(x)
        if x.dim() == 2:
            return x, self.input_quantizer(
                x, dataclasses.replace(self.inputs, granularity=PerTensor()), None
            )[0]
        # a row per index of the first two dimensions: a scale each
        rows = x.reshape(x.shape[0] * x.shape[1], -1)
        return x, self.input_quantizer(rows, self.inputs, None)[0].reshape(x.shape)


def token_rule_layers(
    model: nn.Module, recipe: Recipe, layers: list[str], input_ids: torch.Tensor
) -> list[str]:
    """The `layers` (quantized, with their inputs rounded by the reload check's loader) whose
    dynamic per-token inputs reach them other than 3-D, where compressed-tensors' scales are not
    per token (_TokenScalesOfTheLoader): found by one forward of the unquantized `model` over the
    first window. None of them for other recipes (a recipe with overrides: `layers` are those of
    its dynamic per-token schemes)."""
    if (
        not any(
            s.inputs.dynamic and isinstance(s.inputs.granularity, PerToken) for s in recipe.schemes
        )
        or not layers
    ):
        return []
    seen: set[str] = set()
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: seen.add(name) if args[0].dim() != 3 else None
        )
        for name in layers
    ]
    try:
        with torch.inference_mode():
            model(input_ids=input_ids[:1].to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return [name for name in layers if name in seen]


def describe_token_rule(layers: list[str]) -> str | None:
    """ptq's rounding of the layers token_rule_layers found, in words for the report (None: there
    are none)."""
    if not layers:
        return None
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return (
        f"vLLM's per-token dynamic input scales in the {len(layers)} layer(s) fed inputs other "
        f"than 3-D ({shown}), where transformers' compressed-tensors takes one scale per index of "
        "their first two dimensions (one per 2-D input)"
    )


def unapplied_input_layers(
    model: nn.Module, quantized: list[str], conv1d: bool, dynamic: bool | set[str] = False
) -> list[str]:
    """The quantized layers whose input quantization the reload check's loader does not apply: the
    experts' (transformers has no place for their input scales and runs them weights-only; vLLM
    quantizes their inputs), or, for static inputs, every layer when ptq's own reader stands in
    (Conv1D models: it applies dynamic input quantization, not static scales). `dynamic`: whether
    the inputs are dynamic, or the layers whose inputs are (a recipe with overrides)."""
    if conv1d and not dynamic:
        return list(quantized)
    static = set() if dynamic is True or not conv1d else set(quantized) - set(dynamic)
    in_experts = static | {
        f"{path}.{name}"
        for path, e in model.named_modules()
        if isinstance(e, LinearExperts)
        for name, m in e.named_modules()
        if quantizable(m)
    }
    return [name for name in quantized if name in in_experts]


def unapplied_scales(
    model: nn.Module, layers: list[str], calibration: Calibration, plan: Plan
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> each scale the reload check's loader does not apply, which the checkpoint
    must hold for vLLM: the input scales of `layers` (unapplied_input_layers) and the KV cache's
    k_scale / v_scale, as the command's plan has them."""
    recipe, scales = plan.recipe, {}
    if recipe.kv_cache is not None:
        disk = checkpoint_names(model, saved_names(model))
        scales = {e.name: e.make() for e in kv_cache_entries(model, plan, calibration, disk)}
    layers = [name for name in layers if plan.matmuls[name].inputs.static]
    if not layers:
        return scales
    disk = checkpoint_names(model, [f"{name}.weight" for name in layers])
    return scales | {
        disk[f"{name}.weight"].removesuffix(".weight") + ".input_scale": _input_scale(
            input_clip(calibration, name, plan.matmuls[name].inputs),
            plan.matmuls[name].inputs.format,
        )
        for name in layers
    }


def simulated_tensors(
    simulated: nn.Module, disk: dict[str, str], conv1d: list[str]
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> what the files must hold for each quantized layer of the simulation, as
    the simulation holds it: the weight codes (Conv1D's [in, out]), the weight scale and the
    static input scale. `disk`: checkpoint_names of the layers' weights, taken before the model
    was quantized."""
    expected = {}
    for weight, on_disk in disk.items():
        m = simulated.get_submodule(weight.removesuffix(".weight"))
        layer = on_disk.removesuffix(".weight")
        codes = m.weight_codes.t() if weight.removesuffix(".weight") in conv1d else m.weight_codes
        expected[f"{layer}.weight"] = codes
        # the scale as the preset lays it out on disk: [1], [out, 1], [out, groups] (MX: E8M0
        # codes), [row, column blocks], of the weight [out, in] (Conv1D's too)
        scale = m.weight_scale.reshape(weight_scale_shape(tuple(m.weight_codes.shape), m.weights))
        expected[f"{layer}.weight_scale"] = (
            e8m0_codes(scale) if m.weights.scale_format == "e8m0" else scale
        )
        if m.inputs.static:
            expected[f"{layer}.input_scale"] = m.input_scale.reshape(1)
    return expected


def differing_tensors(expected: dict[str, torch.Tensor], directory: Path) -> list[str]:
    """The names of `expected` that the checkpoint's files lack or hold with another shape, dtype or
    bits."""
    written = _read_tensors(directory, list(expected))

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(
                a.detach().cpu().contiguous().flatten().view(torch.uint8),
                b.contiguous().flatten().view(torch.uint8),
            )
        )

    return [k for k, v in expected.items() if k not in written or not same(v, written[k])]


class OtherAttention(nn.Module):
    """A model run with another attention implementation (eager for sdpa, and the reverse), its
    weights shared: the same arithmetic in another float order, for the noise floor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config
        self.implementation = "sdpa" if model.config._attn_implementation == "eager" else "eager"

    def forward(self, **kwargs):
        previous = self.model.config._attn_implementation
        self.model.config._attn_implementation = self.implementation
        try:
            return self.model(**kwargs)
        finally:
            self.model.config._attn_implementation = previous

    def cannot_run(self, input_ids: torch.Tensor) -> str | None:
        """Why the other implementation cannot run this model (transformers refuses it: Gemma 2's
        soft-capped attention has no sdpa form), tried on a few tokens of the first window; None
        when it runs."""
        from ptq.models.loading import one_line

        device = self.model.get_input_embeddings().weight.device
        try:
            with torch.inference_mode():
                self(input_ids=input_ids[:1, :8].to(device))
        except (ValueError, NotImplementedError) as e:
            return f"{self.implementation} attention cannot run this model ({one_line(e, 160)})"
        return None


def verify(
    simulated: nn.Module,
    reloaded: nn.Module,
    load_info: dict,
    expected_layers: int,
    input_ids: torch.Tensor,
    batch_size: int = 4,
    ptq_own: tuple[str, nn.Module] | None = None,
    unapplied_input_scales: dict[str, torch.Tensor] | None = None,
    directory: Path | None = None,
    expected_tensors: dict[str, torch.Tensor] | None = None,
) -> Verification:
    """Score the reloaded checkpoint against the simulation that computes what the loader computes
    (the gate on logits: KL and top-1), check the files against `expected_tensors`
    (simulated_tensors) bit for bit, and report the measured noise floor (the simulation with
    another attention implementation), all on the same windows, through the one evaluation loop.
    ptq_own: (how the loader's input rounding differs from ptq's, ptq's own simulation), where
    they differ (int8 inputs over [-127, 127], vLLM's scaling of static FP8 inputs): the reloaded
    perplexity is also given against it. unapplied_input_scales: the scales the loader does not
    apply (unapplied_scales: fused experts' input scales in transformers, KV-cache scales),
    checked in the files only."""
    from ptq.evaluation.evaluate import evaluate

    noise = OtherAttention(simulated)
    no_noise_floor = noise.cannot_run(input_ids)
    models = (
        {"simulated": simulated, "reloaded": reloaded}
        | ({"ptq": ptq_own[1]} if ptq_own is not None else {})
        | ({"noise": noise} if no_noise_floor is None else {})
    )
    scores = evaluate(models, input_ids, batch_size)
    sim, rel, floor = scores["simulated"], scores["reloaded"], scores.get("noise")
    own = scores.get("ptq", sim)
    ppl_delta = rel.perplexity / own.perplexity - 1
    problems = []
    # transformers merges the per-expert weights and scales into its fused experts, but has no place
    # for their input scales (vLLM reads them): those keys are expected to be left over (the file
    # check covers them).
    expert_input_scales = unapplied_input_scales or {}
    # (transformers reports them under its own module names, e.g. Mixtral's block_sparse_moe as mlp)
    left = [
        k
        for k in load_info["unexpected_keys"]
        if not (k.endswith(".input_scale") and ".experts." in k)
        and not k.endswith((".k_scale", ".v_scale"))
    ]
    if len(load_info["unexpected_keys"]) - len(left) == len(expert_input_scales):
        load_info = load_info | {"unexpected_keys": left}
    for kind_ in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if load_info[kind_]:
            problems.append(
                f"{kind_.replace('_', ' ')} on reload: {', '.join(load_info[kind_][:3])}"
            )
    if expert_input_scales:
        written = _read_tensors(directory, list(expert_input_scales))
        wrong = [
            k
            for k, v in expert_input_scales.items()
            if k not in written or not torch.equal(written[k], v)
        ]
        if wrong:
            problems.append(
                "expert input or KV-cache scales in the checkpoint differ from ptq's: "
                f"{', '.join(wrong[:3])}"
            )
    expected_tensors = expected_tensors or {}
    differing = differing_tensors(expected_tensors, directory) if expected_tensors else []
    if differing:
        problems.append(
            f"{len(differing)} quantized tensor(s) in the checkpoint differ from ptq's: "
            f"{', '.join(differing[:3])}"
        )
    if load_info["input_quantized_layers"] != expected_layers:
        problems.append(
            f"the loader applies input quantization in {load_info['input_quantized_layers']} "
            f"of {expected_layers} quantized layers"
        )
    if not rel.kl_div <= VERIFY_MAX_KL:
        problems.append(
            f"KL(simulated || reloaded) {rel.kl_div:.3g} nats/token > {VERIFY_MAX_KL:g}"
        )
    if not rel.top1_agreement >= VERIFY_MIN_TOP1:
        problems.append(
            f"same top-1 token at {100 * rel.top1_agreement:.2f}% of positions (limit "
            f"{100 * VERIFY_MIN_TOP1:g}%)"
        )
    return Verification(
        passed=not problems,
        problems=problems,
        criterion=VERIFY_CRITERION,
        windows=len(input_ids),
        seq_len=int(input_ids.shape[1]),
        tokens=sim.tokens,
        simulated_perplexity=sim.perplexity,
        reloaded_perplexity=rel.perplexity,
        ptq_perplexity=own.perplexity,
        ppl_delta_pct=100 * ppl_delta,
        kl_div=rel.kl_div,
        top1_agreement=rel.top1_agreement,
        noise_floor=NoiseFloor(
            what=f"ptq's simulation with {noise.implementation} instead of "
            f"{simulated.config._attn_implementation} attention",
            ppl_delta_pct=100 * (floor.perplexity / sim.perplexity - 1),
            kl_div=floor.kl_div,
            top1_agreement=floor.top1_agreement,
        )
        if floor is not None
        else None,
        no_noise_floor=no_noise_floor,
        ptq_rounding=ptq_own[0] if ptq_own is not None else None,
        tensors_checked_in_file=len(expected_tensors),
        tensors_differing=differing,
        input_scales_checked_in_file=sum(
            1 for k in expert_input_scales if k.endswith(".input_scale")
        ),
        kv_scales_checked_in_file=sum(
            1 for k in expert_input_scales if k.endswith((".k_scale", ".v_scale"))
        ),
        tolerance=Tolerance(
            max_kl_div=VERIFY_MAX_KL, min_top1_agreement=VERIFY_MIN_TOP1, files="bit for bit"
        ),
        load=load_info,
    )
