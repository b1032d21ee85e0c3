"""Calibration: run text through the model and record the amax (max |x|) of every tensor that a
recipe quantizes: each targeted Linear's weight and its input, attention's batched-matmul inputs
("<attention layer>.query|key|value|probs") and residual-add inputs ("<block>.residual.<tensor>").
Observers stream (a running max, a fixed-bin histogram of |x| for the percentile/MSE/entropy
observers and the diagnostics, per-channel maxima for SmoothQuant; ptq/calibration/observers.py),
they never keep activations. The result is saved as safetensors (the amax tensors) plus JSON
metadata.

Faults, each with one documented rule (docs/reliability.md):
- NaN/inf in a weight, or in any other parameter (a norm, an embedding, a bias, a router:
  ptq.models.damage): always an error naming the layer or parameter and the element, before any
  forward pass (the checkpoint is broken); --on-nonfinite skip does not apply to them.
- NaN/inf in a layer's input: `on_nonfinite="fail"` (default) stops at the first such batch, naming
  the layer and the batch; "skip" leaves that batch out of that layer's amax and counts it.
- A layer no calibration batch reached (an MoE expert no token was routed to):
  `on_unseen="fallback"` (default) gives it the largest input amax of its siblings (see
  fallback_amax), listed in the metadata; "fail" stops.
- amax 0 (an all-zero tensor) or so small that its scale is not a normal float32: a warning (the
  scale is finite and the tensor is zero to the format's precision); an amax whose largest quantized
  value would overflow float32: an error (see range_findings).

Long runs save the observers to a checkpoint every `checkpoint_every` seconds (atomically); a
resumed run skips the batches already seen and, since a running max does not depend on how the
batches are split between runs (nor do histogram counts), ends with exactly the same statistics. A
checkpoint records its batch size (an automatic one resumes with it) and is refused for other
settings (run_fingerprint).

Batch size: explicit, or automatic (`--batch-size auto`: ptq.execution.batching); a CUDA
out-of-memory with an automatic size starts the calibration over on half the batch size (see
calibrate for why).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import re
import reprlib
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from ptq.calibration.observers import NUM_BINS, TensorObserver
from ptq.errors import PtqError, os_reason
from ptq.execution import batching
from ptq.execution.executors import WholeModels
from ptq.files import check_writable, save_safetensors
from ptq.models.damage import check_parameter
from ptq.models.matmuls import LinearExperts, quantizable
from ptq.numerics.formats import NumberFormat, amax, compute_scale, fake_quantize
from ptq.progress import progress
from ptq.runtime import distributed
from ptq.runtime.devices import WAYS_OUT, input_device

# /2: histogram bins read off the float32 bit pattern (ptq/calibration/observers.py); /3: up to
# 2^32, not 2^16
FILE_KIND = "ptq-calibration/3"
CHECKPOINT_KIND = "ptq-calibration-checkpoint/2"
NONFINITE_POLICIES = ("fail", "skip")
UNSEEN_POLICIES = ("fallback", "fail")
# The fields reports read from a calibration file's metadata, and their types.
REQUIRED_METADATA = {"data": str, "data_sha256": str, "windows": int, "seq_len": int, "tokens": int}


@dataclass
class Calibration:
    input_amax: dict[str, torch.Tensor]  # layer name -> scalar float32
    weight_amax: dict[str, torch.Tensor]  # layer name -> scalar float32; also identifies the model
    metadata: dict = field(default_factory=dict)
    # name -> int64 [NUM_BINS] counts of |x|
    input_hist: dict[str, torch.Tensor] = field(default_factory=dict)
    # name -> float32 [in_features]
    input_channel_amax: dict[str, torch.Tensor] = field(default_factory=dict)
    # every other parameter (norms, embeddings, biases, routers, ...) -> scalar float32 amax: a
    # model whose Linear weights are another's, with other norms (a fine-tune that kept them), is
    # another model
    tensor_amax: dict[str, torch.Tensor] = field(default_factory=dict)

    def check_model(self, model: nn.Module, layers: list[str]) -> None:
        """Refuse a calibration made for another model: same layers, same weights (by their amax).
        An attention matmul input or a residual-add input has no weight of its own: the weights of
        the matmuls of its attention layer or block (recorded by calibrate) identify the model."""
        modules = dict(model.named_modules())
        checked = set()
        for name in layers:
            if name not in self.input_amax:
                raise PtqError(
                    f"calibration file has no amax for layer '{name}' (made for model "
                    f"'{self.metadata.get('model', '?')}'; recalibrate for this model and recipe)"
                )
            module = modules.get(name)
            channels = self.input_channel_amax.get(name)
            if (
                channels is not None
                and quantizable(module)
                and channels.shape != module.weight.shape[1:]
            ):
                raise PtqError(
                    f"calibration file has {channels.numel()} per-channel input amax for layer "
                    f"'{name}', which has {module.weight.shape[1]} input channels: the file is "
                    "damaged; recalibrate"
                )
            owner = weightless_owner(name)
            if module is None and name not in self.weight_amax and owner in modules:
                checked |= {n for n in self.weight_amax if n.startswith(owner + ".")}
                continue
            checked.add(name)
        for name in sorted(checked):
            module = modules.get(name)
            if not quantizable(module) or name not in self.weight_amax:
                raise self.another_model(f"the weights of layer '{name}' differ")
            self.check_weight(name, module.weight)
        # those in memory: a part of the model, layer by layer
        for (
            name,
            p,
        ) in model.named_parameters():
            if p.device.type != "meta":
                self.check_tensor(name, p)
        # K/V or residual amax alone would be taken from any model with the same names
        if layers and not checked:
            raise PtqError(
                f"calibration file (made for model '{self.metadata.get('model', '?')}') has no "
                "weight amax to check it against this model: recalibrate with this version of ptq"
            )

    def check_weight(self, layer: str, weight: torch.Tensor) -> None:
        """Refuse `weight` (in memory or read from disk) when the file recorded another amax for
        `layer`."""
        recorded = self.weight_amax.get(layer)
        if recorded is not None and not torch.equal(
            amax(weight).cpu(), _as_weight(recorded, weight)
        ):
            raise self.another_model(f"the weights of layer '{layer}' differ")

    def check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse a tensor that is not quantized (a norm, an embedding: tensor_amax) when the file
        recorded another amax for it."""
        recorded = self.tensor_amax.get(name)
        if (
            recorded is not None
            and tensor.is_floating_point()
            and not torch.equal(amax(tensor).cpu(), _as_weight(recorded, tensor))
        ):
            raise self.another_model(f"its tensor '{name}' differs")

    def another_model(self, what: str) -> PtqError:
        return PtqError(
            f"calibration file was made for another model ('{self.metadata.get('model', '?')}'): "
            f"{what}"
        )


def _as_weight(recorded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A weight amax recorded in float32 (ptq calibrate reads float32) as it is for the weight in
    its compute dtype: rounding is monotonic, so the amax of a float32 checkpoint's weights rounded
    to bfloat16 is its amax rounded."""
    return recorded.to(weight.dtype).float() if weight.dtype != recorded.dtype else recorded


def weightless_owner(name: str) -> str:
    """The attention layer of an attention matmul input or KV-cache tensor ("<layer>.key"), the
    decoder block of a residual-add input ("<block>.residual.mid"): the module whose matmuls'
    weights identify the model for it."""
    return name.split(".residual.")[0] if ".residual." in name else name.rpartition(".")[0]


def checkpoint_path(output: Path) -> Path:
    """Where `ptq calibrate -o OUTPUT` keeps its checkpoint: OUTPUT.checkpoint (a different kind of
    file, which load_calibration refuses, so it can never be mistaken for a finished
    calibration)."""
    return Path(output).with_name(Path(output).name + ".checkpoint")


def calibrate(
    model: nn.Module,
    input_ids: torch.Tensor,
    layers: list[str],
    batch_size: int | None = 4,
    on_nonfinite: str = "fail",
    on_unseen: str = "fallback",
    checkpoint: Path | None = None,
    checkpoint_every: float = 60.0,
    resume: bool = False,
    channels: list[str] = (),
    all_experts: bool = True,
    weights_of: nn.Module | None = None,
    layer_by_layer=None,
) -> Calibration:
    """Record input and weight amax of the named Linear layers (and attention matmul / residual-add
    inputs) over the calibration windows, with histograms of every input, and per-channel input amax
    of the Linear layers in `channels`. With `all_experts`, every token also runs through every
    expert of a mixture-of-experts layer (observed, the output unchanged), so that no expert is left
    without a scale.

    batch_size: windows per forward pass; None for automatic (ptq.execution.batching.auto_batch_size
    with calibration's per-window estimate: on CUDA from the free memory, CPU_BATCH_SIZE on the
    CPU). Resuming with None takes the batch size the checkpoint was made with. The size used is
    `metadata["batch_size"]`.

    CUDA out of memory: with an explicit batch size, the one-line error naming the batch size
    (ptq.execution.batching). With an automatic one, the batch size is halved
    (ptq.execution.batching.back_off) and the calibration RESTARTS FROM THE FIRST BATCH with new
    observers, any checkpoint's statistics included: a batch that ran out of memory half-way has
    already been counted by the observers of the layers it went through (their running max,
    histogram counts, per-channel max and batch counts), and undoing that exactly is not possible,
    so every statistic is dropped. The result is then exactly that of a run on the smaller batch
    size from the start (tests/test_batching.py). The batches already done are computed again; an
    out of memory happens on the first batch in practice (every batch but the last has the same
    shape).

    With `checkpoint`, the observers are saved there (atomically) at most every `checkpoint_every`
    seconds; `resume=True` continues from it. The caller deletes the checkpoint once the result is
    saved. `weights_of`: the model the weight amax are read from, when `model` is a copy placed over
    the devices (ptq.execution.placement) whose offloaded weights are not in memory.
    `layer_by_layer`: the executor that runs `model` one decoder layer at a time from disk
    (ptq.execution.streaming.LayerByLayer); the observers are hooked on each layer as it is read.
    Linear inputs only, without checkpoints.
    """
    if on_nonfinite not in NONFINITE_POLICIES or on_unseen not in UNSEEN_POLICIES:
        raise PtqError(f"unknown policy: on_nonfinite={on_nonfinite!r}, on_unseen={on_unseen!r}")
    auto = batch_size is None
    runner = _runner(model, layers)
    if auto:
        size = (checkpoint_batch_size(checkpoint) if resume else None) or batching.auto_batch_size(
            model, input_ids.shape[1], len(input_ids), calibrating=True, logits=runner is model
        )
    else:
        size = batch_size
    # Under torchrun each process runs its share of the batches and the observers are merged: one
    # batch size for all (an automatic one follows each GPU's free memory), so that every batch is
    # one of the one-process run's
    split = distributed.joined() and layer_by_layer is None and checkpoint is None
    if split:
        size = min(distributed.gather(size))
    restarted = None
    while True:
        error = failure = None
        batches = range(-(-len(input_ids) // size))
        mine = distributed.share(len(batches)) if split else batches
        try:
            observers, weight_amax, tensor_amax = _calibrate_batches(
                model,
                input_ids[mine.start * size : mine.stop * size],
                layers,
                size,
                on_nonfinite,
                checkpoint,
                checkpoint_every,
                resume,
                channels,
                all_experts,
                restarted,
                weights_of,
                layer_by_layer,
                first_batch=mine.start,
            )
        except torch.cuda.OutOfMemoryError as e:
            error = str(e)  # not the exception: its frames hold the batch's tensors
        except PtqError as e:
            if not split:
                raise
            failure = str(e)
        # what one process met (a NaN in its share, out of memory) stops or backs off every process
        if split:
            outcomes = distributed.gather((failure, error))
            failure = next((f for f, _ in outcomes if f), None)
            if failure is not None:
                raise PtqError(failure)
            error = next((e for _, e in outcomes if e), None)
            if error is None:
                observers = merge_shares(
                    distributed.gather({n: o.cpu() for n, o in observers.items()})
                )
        if error is None:
            calibration = finish(observers, layers, weight_amax, on_nonfinite, on_unseen)
            calibration.tensor_amax = tensor_amax
            calibration.metadata["batch_size"] = size
            if layer_by_layer is not None:
                calibration.metadata["low_memory"] = f"calibrated {layer_by_layer.description}"
            return calibration
        param = next(model.parameters())
        estimate = size * batching.window_bytes(
            model.config, input_ids.shape[1], param.dtype, calibrating=True, logits=runner is model
        )
        restarted = size
        size = batching.back_off(
            size,
            auto,
            f"calibrating on batches of {size} window(s) of {input_ids.shape[1]} tokens",
            error,
            estimate,
            layer_by_layer.ways_out if layer_by_layer is not None else WAYS_OUT,
        )
        resume = False  # the checkpoint's statistics go too: a new run on the smaller batch size


def _observe_heads(observer: TensorObserver, x: torch.Tensor) -> torch.Tensor:
    """K or V observed with the head dimension last: the same amax and histogram, and per-head
    maxima as its per-channel amax (KV-cache scales per head)."""
    observer.observe(x.transpose(1, -1))
    return x


def _calibrate_batches(
    model: nn.Module,
    input_ids: torch.Tensor,
    layers: list[str],
    batch_size: int,
    on_nonfinite: str,
    checkpoint: Path | None,
    checkpoint_every: float,
    resume: bool,
    channels: list[str],
    all_experts: bool,
    restarted: int | None = None,
    weights_of: nn.Module | None = None,
    layer_by_layer=None,
    first_batch: int = 0,
) -> tuple[dict[str, TensorObserver], dict[str, torch.Tensor]]:
    """One calibration run on batches of `batch_size` windows, with new observers (see calibrate):
    the observers and the weights' amax. restarted: the batch size that ran out of memory before
    this run, for the progress bar. first_batch: the number of the first batch among all processes'
    (torchrun), for the messages."""
    from ptq.quantization import attention, residual

    modules = dict(model.named_modules())
    linears = [name for name in layers if quantizable(modules.get(name))]
    observers = {name: TensorObserver(channels=name in set(channels)) for name in layers}
    weight_amax: dict[str, torch.Tensor] = {}
    tensor_amax: dict[str, torch.Tensor] = {}  # every other parameter's (Calibration.tensor_amax)
    # attention layers and blocks whose inputs are calibrated: their matmuls' weight amax identify
    # the model (Calibration.check_model), calibrated or not
    owners = tuple(weightless_owner(name) + "." for name in layers if name not in linears)

    @contextlib.contextmanager
    def observed(part: nn.Module):
        """The observers hooked on the calibrated Linear layers of `part` (the whole model, or the
        part of it that is in memory, its modules under their names in the model), their weights'
        amax recorded."""
        here = dict(part.named_modules())
        weights = dict(weights_of.named_modules()) if weights_of is not None else here
        hooks = []
        for name in linears:
            if name in here:
                weight_amax[name] = check_weight(name, weights[name].weight)
                hooks.append(here[name].register_forward_pre_hook(observers[name]))
        for name, m in here.items():
            if owners and name not in weight_amax and name.startswith(owners) and quantizable(m):
                weight_amax[name] = check_weight(name, weights[name].weight)
        recorded = {f"{name}.weight" for name in weight_amax}
        # a part's are named as in the model
        for name, p in (weights_of or part).named_parameters():
            if (
                p.device.type != "meta"
                and p.is_floating_point()
                and p.numel()
                and name not in recorded
            ):
                value = amax(p.detach()).cpu()
                if not torch.isfinite(value):  # named as itself, never as the next layer's input
                    check_parameter(name, p)
                tensor_amax[name] = value
        experts = [m for m in part.modules() if isinstance(m, LinearExperts)]
        for m in experts:
            m.all_experts = all_experts
        try:
            yield {"original": part}
        finally:
            for m in experts:
                m.all_experts = False
            for h in hooks:
                h.remove()

    attention_layers, residual_blocks = {}, {}
    for name in layers:
        if name not in linears:
            layer, _, tensor = name.rpartition(".")
            # "<block>.residual.<tensor>": ptq/quantization/residual.py
            if layer.endswith(".residual"):
                residual_blocks.setdefault(layer.removesuffix(".residual"), {})[tensor] = observers[
                    name
                ].observe
            # [batch, kv heads, tokens, dim]: heads last, so "channels" are heads
            elif tensor in (
                "key",
                "value",
            ):
                attention_layers.setdefault(layer, {})[tensor] = partial(
                    _observe_heads, observers[name]
                )
            else:
                attention_layers.setdefault(layer, {})[tensor] = observers[name].observe
    logits = _runner(model, layers) is model  # the lm_head is observed: the logits are computed
    batches = input_ids.split(batch_size)
    start = 0
    with contextlib.ExitStack() as stack:
        if layer_by_layer is not None:
            beyond = [name for name in layers if name not in linears]
            if beyond:
                raise PtqError(
                    "calibrating layer by layer (--low-memory) observes Linear inputs only; "
                    f"'{beyond[0]}' (attention or residual coverage) needs the model in memory"
                )
            run = layer_by_layer.with_parts(observed, ["original"])
            # layer by layer, no batch is done before the last layer: nothing to resume from
            checkpoint = None
        else:
            stack.enter_context(observed(model))
            # the model's digest reads every weight: only where a checkpoint is written (ptq
            # calibrate)
            digest = (
                model_digest(weights_of if weights_of is not None else model)
                if checkpoint is not None
                else b""
            )
            fingerprint = run_fingerprint(
                input_ids, layers, batch_size, on_nonfinite, weight_amax, channels, all_experts,
                digest,
            )  # fmt: skip
            if resume:
                start = load_checkpoint(
                    checkpoint,
                    observers,
                    fingerprint,
                    len(batches),
                    input_device(model),
                    batch_size,
                )
            previous = model.config._attn_implementation
            attention.install(
                model,
                {k: attention.AttentionQuant(v) for k, v in attention_layers.items()},
                observe=True,
            )
            stack.callback(attention.uninstall, model, previous)
            for hook in residual.install(model, residual_blocks):
                stack.callback(hook.remove)
            run = WholeModels({"original": _runner(model, layers)}, input_device(model))
        # release the last activations it holds
        stack.callback(setattr, TensorObserver, "shared", ())
        saved_at = time.monotonic()
        description = (
            f"calibrating again on batches of {batch_size} (out of GPU memory on {restarted})"
            if restarted
            else "calibrating"
        )
        done = sum(len(b) for b in batches[:start])
        check = (
            (lambda i: _fail_on_nonfinite(observers, first_batch + start + i, batch_size))
            if on_nonfinite == "fail"
            else None
        )
        with (
            # not inference_mode: its tensors have no version, which the observers' shared
            # statistics need
            torch.no_grad(),
            progress(description, run.steps(len(input_ids), logits), input_ids.shape[1]) as advance,
        ):
            advance(done)
            for i, (_, outputs) in enumerate(
                run.forward(
                    input_ids[done:], batch_size, logits=logits, after_batch=check, advance=advance
                ),
                start,
            ):
                for _ in outputs:
                    pass  # the observers have seen the batch; the logits are not needed
                if (
                    checkpoint is not None
                    and i + 1 < len(batches)
                    and time.monotonic() - saved_at >= checkpoint_every
                ):
                    save_checkpoint(
                        checkpoint, observers, fingerprint, i + 1, len(batches), batch_size
                    )
                    saved_at = time.monotonic()
    # the calibrated layers in their order (as read, layer by layer, they come part by part), then
    # the others
    return observers, {name: weight_amax[name] for name in linears} | weight_amax, tensor_amax


def merge_shares(shares: list[dict[str, TensorObserver]]) -> dict[str, TensorObserver]:
    """The observers of every process's share of the batches (torchrun), in rank order, merged:
    those of one process that saw every batch (TensorObserver.merge; the histogram's bins are fixed,
    so the sum is exact)."""
    merged = shares[0]
    for other in shares[1:]:
        for name, observer in merged.items():
            observer.merge(other[name])
    return merged


def finish(
    observers: dict[str, TensorObserver],
    layers: list[str],
    weight_amax: dict[str, torch.Tensor],
    on_nonfinite: str,
    on_unseen: str,
) -> Calibration:
    """The Calibration from the observers once every batch has run: unseen layers get their fallback
    amax (or stop the run), skipped non-finite batches are counted in the metadata."""
    input_amax, unseen, skipped = {}, [], {}
    for name, obs in observers.items():
        if int(obs.nonfinite):
            skipped[name] = int(obs.nonfinite)
        if obs.finite_batches() == 0:
            unseen.append(name)
        else:
            input_amax[name] = obs.amax.float().cpu()
    # an executor checks each batch as it goes; none may pass unchecked
    if skipped and on_nonfinite == "fail":
        name = next(iter(skipped))
        raise PtqError(
            f"input of layer '{name}' contains NaN or inf in {skipped[name]} calibration "
            "batch(es); use --on-nonfinite skip to leave such batches out of that layer's amax"
        )
    if len(unseen) == len(layers):
        raise PtqError(
            "no calibration batch reached any calibrated layer with finite values: nothing to "
            "calibrate from"
        )
    metadata: dict = {"on_nonfinite": on_nonfinite, "on_unseen": on_unseen}
    if skipped:
        metadata["nonfinite_batches"] = skipped
    hists = {
        name: obs.hist
        for name, obs in observers.items()
        if obs.finite_batches() and obs.hist is not None
    }
    # per-channel maxima of the batches kept (a layer whose every batch was non-finite has zeros:
    # none)
    channel_amax = {
        name: obs.channel_amax.cpu()
        for name, obs in observers.items()
        if obs.channels and obs.channel_amax is not None and obs.finite_batches()
    }
    if unseen:
        if on_unseen == "fail":
            raise PtqError(
                f"{len(unseen)} layer(s) received no calibration data, e.g. '{unseen[0]}' (an MoE "
                "expert no token was routed to?): calibrate on more text, or use --on-unseen "
                "fallback"
            )
        metadata["unseen_layers"] = []
        unseen_set = set(unseen)
        # no fallback is another's source
        calibrated = {n: v for n, v in input_amax.items() if n not in unseen_set}
        for name in unseen:
            source, rule = _fallback_source(name, calibrated)
            value = input_amax[name] = input_amax[source].clone()
            # the observers other than max read a histogram: that of the layer the amax comes from
            if source in hists:
                # its own tensor: safetensors saves no shared memory
                hists[name] = hists[source].clone()
            # SmoothQuant's per-channel maxima, likewise, where the layer's own shape is known to be
            # the source's
            shape = getattr(observers[name].channel_amax, "shape", None)
            if source in channel_amax and shape == channel_amax[source].shape:
                channel_amax[name] = channel_amax[source].clone()
            metadata["unseen_layers"].append(
                {"layer": name, "input_amax": float(value), "rule": rule}
            )
    input_amax = {name: input_amax[name] for name in layers}
    return Calibration(
        input_amax,
        weight_amax,
        metadata,
        input_hist=hists,
        input_channel_amax=channel_amax,
    )


def _runner(model: nn.Module, layers: list[str]) -> nn.Module:
    """Layers outside the base model (lm_head) are not quantized by default: skip computing them."""
    base = getattr(model, "base_model", model)
    if base is model:
        return model
    base_names = {
        f"{model.base_model_prefix}.{n}" if n else model.base_model_prefix
        for n, _ in base.named_modules()
    }
    return base if set(layers) <= base_names else model


def check_weight(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight's amax; NaN/inf is always an error, naming the first bad element."""
    value = amax(weight.detach())
    if not torch.isfinite(value):
        bad = (~torch.isfinite(weight.detach())).nonzero()[0].tolist()
        what = "NaN" if torch.isnan(weight.detach()).any() else "inf"
        raise PtqError(
            f"weight of layer '{name}' contains {what} (first at index {bad}): the model's weights "
            "are damaged; --on-nonfinite skip applies to activations only"
        )
    return value.cpu()


def _fail_on_nonfinite(observers: dict[str, TensorObserver], batch: int, batch_size: int) -> None:
    # One device sync per batch and device, only in "fail" mode. An observer not called yet (an MoE
    # expert no token reached; layer by layer, every later layer's) holds an int: no tensor made and
    # copied to the GPU for it per check
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for o in observers.values():
        if torch.is_tensor(o.nonfinite):
            by_device.setdefault(o.nonfinite.device, []).append(o.nonfinite)
    if any(not torch.is_tensor(o.nonfinite) and o.nonfinite for o in observers.values()) or any(
        bool(torch.stack(counts).any()) for counts in by_device.values()
    ):
        name, obs = min(
            ((n, o) for n, o in observers.items() if int(o.nonfinite)), key=lambda no: no[1].step
        )
        what = "NaN" if torch.isnan(obs.last) else "inf"
        raise PtqError(
            f"input of layer '{name}' contains {what} in calibration batch {batch} (windows "
            f"{batch * batch_size}-{batch * batch_size + batch_size - 1}); use --on-nonfinite skip "
            "to leave such batches out of that layer's amax"
        )


def fallback_amax(name: str, seen: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
    """Input amax for a layer no batch reached: the largest among its closest relatives, in order
    (1) same name but for the last number (the other experts of the same block:
        experts.*.down_proj),
    (2) same name but for every number (that projection in every block), (3) every calibrated layer.
    The largest, because a too-large scale costs precision while a too-small one clips."""
    source, rule = _fallback_source(name, seen)
    return seen[source].clone(), rule


def _fallback_source(name: str, seen: dict[str, torch.Tensor]) -> tuple[str, str]:
    """The calibrated layer whose input amax fallback_amax gives `name`, and the rule that chose
    it."""
    parts = name.split(".")
    numbers = [i for i, p in enumerate(parts) if p.isdigit()]
    wildcards = [{numbers[-1]}, set(numbers)] if numbers else []
    for wild in wildcards:
        pattern = ".".join("*" if i in wild else p for i, p in enumerate(parts))
        regex = re.compile(
            r"\.".join(r"\d+" if i in wild else re.escape(p) for i, p in enumerate(parts))
        )
        relatives = [n for n in seen if regex.fullmatch(n)]
        if relatives:
            source = max(relatives, key=lambda n: float(seen[n]))
            return (
                source,
                f"max input amax of {len(relatives)} calibrated layer(s) matching {pattern}",
            )
    return max(
        seen, key=lambda n: float(seen[n])
    ), f"max input amax of all {len(seen)} calibrated layers"


def range_findings(checks: list[tuple[str, str, torch.Tensor, NumberFormat]]) -> list[str]:
    """Apply the range rule to (layer, tensor, amax, format) tuples; return the warnings, raise for
    errors.

    With a per-tensor scale (amax / format max) every finite amax maps onto the format, so the only
    failures are at float32's own edges: an amax whose scale is not a normal float32 (below format
    max * 2^-126, about 5e-36 for E4M3) quantizes coarsely but the tensor is then zero for any
    practical purpose (warning, like an all-zero tensor, whose scale is 1); an amax so close to
    float32's max that the largest quantized value, format max * scale, rounds to inf is an error.
    """
    warnings = []
    for layer, tensor, value, fmt in checks:
        if not fmt.scaled:
            continue
        top = fake_quantize(value.reshape(1), compute_scale(value, fmt), fmt)
        if not bool(torch.isfinite(top).all()):
            raise PtqError(
                f"{tensor} amax {float(value):.4g} of layer '{layer}' is beyond {fmt.name}'s reach "
                "in float32: its largest quantized value overflows to inf"
            )
        if float(value) == 0:
            warnings.append(f"{tensor} of layer '{layer}' is all zeros (amax 0): scale 1 is used")
        elif float(value) < fmt.max * 2.0**-126:
            warnings.append(
                f"{tensor} amax {float(value):.3g} of layer '{layer}' is below "
                f"{fmt.max * 2.0**-126:.3g}: its {fmt.name} scale is not a normal float32, so it "
                "quantizes coarsely (the tensor is nearly zero)"
            )
    return list(dict.fromkeys(warnings))


def run_fingerprint(
    input_ids: torch.Tensor,
    layers: list[str],
    batch_size: int,
    on_nonfinite: str,
    weight_amax: dict[str, torch.Tensor],
    channels: list[str] = (),
    all_experts: bool = True,
    model: bytes = b"",
) -> str:
    """What a checkpoint must match to be resumed: the same windows, layers, batches, policy,
    weights, and whether every expert saw every token (`all_experts`: the statistics of the two
    settings differ); `model`: the model's model_digest."""
    h = hashlib.sha256(model)
    h.update(
        json.dumps(
            [
                list(input_ids.shape),
                layers,
                batch_size,
                on_nonfinite,
                sorted(channels),
                bool(all_experts),
            ]
        ).encode()
    )
    h.update(input_ids.cpu().contiguous().numpy().tobytes())
    h.update(
        torch.stack([weight_amax[n] for n in layers if n in weight_amax] or [torch.zeros(())])
        .numpy()
        .tobytes()
    )
    return h.hexdigest()


def model_digest(model: nn.Module) -> bytes:
    """The model a calibration runs, for a resumed run to match: its config (less the fields that
    name a copy: its path, dtype, transformers' version) and every parameter and buffer by name,
    shape, dtype and two float64 moments (sum and 2-norm: one pass each, on the tensor's own device;
    tensors offloaded to the meta device by name alone). The calibrated layers' weight amax alone
    let a fine-tune of the norms, or another rope_theta, resume this run."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        fields = {
            k: v
            for k, v in config.to_dict().items()
            if not k.startswith("_") and k not in ("dtype", "transformers_version")
        }
        h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    moments = []
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        h.update(f"{name} {tuple(t.shape)} {t.dtype}\n".encode())
        if t.device.type != "meta" and t.numel():
            t = (
                t.detach()
                if t.dtype in (torch.float32, torch.bfloat16, torch.float16)
                else t.detach().double()
            )
            moments.append(
                torch.stack(
                    [t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64)]
                ).cpu()
            )
    if moments:
        h.update(torch.stack(moments).numpy().tobytes())
    return h.digest()


def save_checkpoint(
    path: Path,
    observers: dict[str, TensorObserver],
    fingerprint: str,
    done: int,
    total: int,
    batch_size: int,
) -> None:
    tensors = {}
    for name, obs in observers.items():
        if obs.amax is not None:
            tensors[f"amax/{name}"] = obs.amax.float().cpu().contiguous()
        if obs.hist is not None:
            tensors[f"hist/{name}"] = obs.hist.cpu().contiguous()
        if obs.channel_amax is not None:
            tensors[f"channel_amax/{name}"] = obs.channel_amax.float().cpu().contiguous()
        tensors[f"counts/{name}"] = torch.tensor([obs.calls, int(obs.nonfinite)], dtype=torch.int64)
    header = {
        "kind": CHECKPOINT_KIND,
        "fingerprint": fingerprint,
        "batches_done": str(done),
        "batches": str(total),
        "batch_size": str(batch_size),
    }
    save_safetensors(tensors, path, header)


def checkpoint_batch_size(path: Path | None) -> int | None:
    """The batch size a checkpoint was made with (what `--batch-size auto` resumes with), or None
    when there is no readable one (load_checkpoint then says what is wrong)."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            size = int((f.metadata() or {}).get("batch_size", ""))
    except Exception:
        return None
    return size if size > 0 else None


def load_checkpoint(
    path: Path | None,
    observers: dict[str, TensorObserver],
    fingerprint: str,
    total: int,
    device: torch.device | str = "cpu",
    batch_size: int | None = None,
) -> int:
    """Restore the observers from `path`; return the number of batches it covers. batch_size: this
    run's, to name a mismatch (the fingerprint covers it as well)."""
    if path is None or not Path(path).is_file():
        raise PtqError(
            f"no checkpoint to resume from ({path} does not exist); run without --resume"
        )
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        done = int(header.get("batches_done", ""))
    except Exception:
        raise PtqError(
            f"{path} is not a readable calibration checkpoint; delete it or use --force to start "
            "over"
        ) from None
    made_on = header.get("batch_size")
    if (
        header.get("kind") == CHECKPOINT_KIND
        and batch_size is not None
        and made_on not in (None, str(batch_size))
    ):
        raise PtqError(
            f"{path} was made on batches of {made_on} windows, not {batch_size}: resume with "
            f"--batch-size {made_on} (or auto), or use --force to start over"
        )
    if (
        header.get("kind") != CHECKPOINT_KIND
        or header.get("batches") != str(total)
        or not 0 < done < total
    ):
        raise PtqError(
            f"{path} is not a checkpoint of this calibration (kind or batch count differ); use "
            "--force to start over"
        )
    if header.get("fingerprint") != fingerprint:
        raise PtqError(
            f"{path} was made by a different run (model, data, layers, --samples, --seq-len, "
            "--batch-size, --on-nonfinite or --calibrate-all-experts/--routed-experts-only "
            "differ); rerun with the same options, or use --force to start over"
        )
    for name, obs in observers.items():
        counts = tensors.get(f"counts/{name}")
        if counts is None or counts.shape != (2,):
            raise PtqError(
                f"{path} is damaged (no counts for layer '{name}'); use --force to start over"
            )
        obs.calls, obs.nonfinite = int(counts[0]), int(counts[1])
        if f"amax/{name}" in tensors:
            obs.amax = tensors[f"amax/{name}"].to(device)
        if obs.hist is not None and f"hist/{name}" in tensors:
            obs.hist = tensors[f"hist/{name}"].clone()
        if f"channel_amax/{name}" in tensors:
            obs.channel_amax = tensors[f"channel_amax/{name}"].to(device)
    return done


def save_calibration(calibration: Calibration, path: Path, force: bool = False) -> None:
    check_writable(path, force)
    tensors = {f"input_amax/{k}": v.contiguous() for k, v in calibration.input_amax.items()}
    tensors |= {f"weight_amax/{k}": v.contiguous() for k, v in calibration.weight_amax.items()}
    tensors |= {f"tensor_amax/{k}": v.contiguous() for k, v in calibration.tensor_amax.items()}
    tensors |= {f"input_hist/{k}": v.contiguous() for k, v in calibration.input_hist.items()}
    tensors |= {
        f"input_channel_amax/{k}": v.float().contiguous()
        for k, v in calibration.input_channel_amax.items()
    }
    header = {"kind": FILE_KIND, "metadata": json.dumps(calibration.metadata, sort_keys=True)}
    save_safetensors(tensors, path, header)


def load_calibration(path: Path) -> Calibration:
    path = Path(path)
    if path.is_dir():
        raise PtqError(
            f"calibration file {path} is a folder: give the .safetensors file that `ptq calibrate` "
            "wrote"
        )
    if not path.is_file():
        raise PtqError(f"calibration file {path} does not exist")
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        if os_reason(path, e):  # the file is there (checked above), but may not be read
            raise PtqError(
                f"cannot read the calibration file {path}: {os_reason(path, e)}"
            ) from None
        raise PtqError(
            f"{path} is not a readable calibration file: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    kind = header.get("kind")
    if (
        isinstance(kind, str)
        and kind.startswith(FILE_KIND.split("/")[0] + "/")
        and kind != FILE_KIND
    ):
        raise PtqError(
            f"{path} was written by another version of ptq (kind {reprlib.repr(kind)}; this "
            f"version reads {FILE_KIND!r}, whose histograms are binned differently): calibrate "
            "again"
        )
    if kind != FILE_KIND:
        raise PtqError(
            f"{path} is not a ptq calibration file (kind {reprlib.repr(kind)}, expected "
            f"{FILE_KIND!r})"
        )
    try:
        metadata = json.loads(header.get("metadata", "{}"))
    except (json.JSONDecodeError, RecursionError):
        raise PtqError(f"{path}: calibration metadata is not valid JSON") from None
    check_metadata(metadata, path)
    calibration = Calibration({}, {}, metadata)
    for key, tensor in tensors.items():
        kind, _, name = key.partition("/")
        if kind in ("input_hist", "input_channel_amax") and name:
            _load_statistics(calibration, path, key, tensor)
            continue
        target = {
            "input_amax": calibration.input_amax,
            "weight_amax": calibration.weight_amax,
            "tensor_amax": calibration.tensor_amax,
        }.get(kind)
        if (
            target is None
            or not name
            or tensor.dtype != torch.float32
            or tensor.numel() != 1
            or not torch.isfinite(tensor).all()
            or tensor.item() < 0
        ):
            raise PtqError(
                f"{path}: invalid entry {reprlib.repr(key)} (expected input_amax/LAYER, "
                "weight_amax/LAYER or tensor_amax/TENSOR: a finite, non-negative float32 scalar)"
            )
        target[name] = tensor.reshape(())
    if not calibration.input_amax:
        raise PtqError(f"{path}: the calibration file has no amax entries")
    if not set(calibration.input_hist) | set(calibration.input_channel_amax) <= set(
        calibration.input_amax
    ):
        raise PtqError(f"{path}: histograms or per-channel amax name tensors without an input amax")
    return calibration


def _load_statistics(calibration: Calibration, path: Path, key: str, tensor: torch.Tensor) -> None:
    """Histograms (int64 counts, NUM_BINS) and per-channel amax (finite, non-negative float32
    vectors)."""
    kind, _, name = key.partition("/")
    if kind == "input_hist":
        if tensor.dtype != torch.int64 or tensor.shape != (NUM_BINS,) or bool((tensor < 0).any()):
            raise PtqError(
                f"{path}: invalid entry {reprlib.repr(key)} (expected {NUM_BINS} non-negative "
                "int64 counts)"
            )
        calibration.input_hist[name] = tensor
    else:
        if (
            tensor.dtype != torch.float32
            or tensor.dim() != 1
            or not torch.isfinite(tensor).all()
            or bool((tensor < 0).any())
        ):
            raise PtqError(
                f"{path}: invalid entry {reprlib.repr(key)} (expected a finite, non-negative "
                "float32 vector)"
            )
        calibration.input_channel_amax[name] = tensor


def check_metadata(metadata: object, path: Path) -> None:
    """The metadata is read into reports: it must be a JSON object with the fields they use, well
    typed."""
    if not isinstance(metadata, dict):
        raise PtqError(
            f"{path}: calibration metadata must be a JSON object, not {type(metadata).__name__}"
        )
    for key, kind in REQUIRED_METADATA.items():
        value = metadata.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            raise PtqError(
                f"{path}: calibration metadata field '{key}' must be a "
                f"{'non-negative integer' if kind is int else 'string'}, not {reprlib.repr(value)}"
            )
    unseen = metadata.get("unseen_layers", [])
    if not isinstance(unseen, list) or not all(
        isinstance(u, dict) and isinstance(u.get("layer"), str) and isinstance(u.get("rule"), str)
        for u in unseen
    ):
        raise PtqError(f"{path}: calibration metadata field 'unseen_layers' is malformed")
    warnings, skipped = metadata.get("warnings", []), metadata.get("nonfinite_batches", {})
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        raise PtqError(f"{path}: calibration metadata field 'warnings' must be a list of strings")
    if not isinstance(skipped, dict) or not all(isinstance(v, int) for v in skipped.values()):
        raise PtqError(
            f"{path}: calibration metadata field 'nonfinite_batches' must map layers to counts"
        )


def summary_rows(calibration: Calibration, top: int = 10) -> dict:
    """The tensors with the largest input amax, and the spread across layers, for reports."""
    # Linear layers only (they have weights); attention matmul inputs are in the per-tensor
    # diagnostics.
    items = sorted(
        ((k, float(v)) for k, v in calibration.input_amax.items() if k in calibration.weight_amax),
        key=lambda kv: -kv[1],
    )
    values = [v for _, v in items] or [0.0]
    weights = calibration.weight_amax
    return {
        "layers": len(items),
        "input_amax_min": min(values),
        # the mean of the middle two (torch's median: the lower)
        "input_amax_median": statistics.median(values),
        "input_amax_max": max(values),
        "largest": [
            {"layer": k, "input_amax": v, "weight_amax": float(weights[k])} for k, v in items[:top]
        ],
    }
