"""What ptq quantizes: every matmul of a model whose weight multiplies activations, as an
`nn.Linear`.

Transformers builds those matmuls three ways, and `linearize(model)` turns each into Linear layers,
so that calibration, quantization, evaluation, per-layer statistics, inspect and export all deal
with one thing:
- `nn.Linear`: kept as it is (kind "Linear").
- GPT-2's `Conv1D` (weight stored [in, out], `addmm`): an nn.Linear whose weight is the transposed
  view of the same storage (kind "Conv1D"); same product, no copy.
- Fused experts (`@use_experts_implementation` modules holding 3-D parameters, `gate_up_proj`
  [E, 2I, H] and `down_proj` [E, H, I], or transposed, gate/up concatenated or interleaved, with or
  without biases): `LinearExperts`, one `{e}.gate_proj`, `{e}.up_proj`, `{e}.down_proj` Linear per
  expert (kind "Experts"), each a view into the 3-D parameters. Its forward computes what the fused
  module computes: routed tokens only, the family's own gating function; once every expert is
  quantized alike it runs as one grouped matmul per projection (`LinearExperts.forward`), not a
  Python loop over experts.

What cannot be made a Linear (a router kept as a bare weight, a convolution, an experts layout ptq
does not know) is listed by `coverage`, with the reason, so that reports never leave weights in
16-bit silently.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("Linear", "Conv1D", "Experts")  # what recipes target (Recipe.targets)
# an MoE router that is a Linear layer: left in the compute dtype, like routers of other kinds
ROUTER = "Router"
# Qwen2-MoE's gate of its shared expert (Linear H -> 1, sigmoid): a gating weight like the router's,
# which vLLM's qwen2_moe.py keeps a plain torch.nn.Linear (no quantized weight loads into it) and
# llm-compressor's Qwen-MoE examples leave out (`re:.*mlp.shared_expert_gate$`): left out with the
# routers, for its own reason
SHARED_EXPERT_GATE = "shared_expert_gate"
_SHARED_EXPERT_GATE_REASON = (
    "router (shared-expert gate, Linear): its gating stays in the compute dtype, as vLLM keeps it "
    "(a plain nn.Linear)"
)
# What a quantized matmul (ptq.quantization.quantize.QuantLinear) has that this module reads without
# importing it. QUANTIZED: a class attribute, True: a matmul already quantized (coverage skips it
# and its parts)
QUANTIZED = "quantized_matmul"
GROUPING = (
    "grouped_experts"  # (experts, layers) -> the grouped form of a LinearExperts' layers, or None
)


def kind(module: nn.Module) -> str:
    """The kind of matmul a Linear layer of a linearized model came from ("Linear", "Conv1D",
    "Experts", "Router")."""
    return getattr(module, "ptq_kind", "Linear")


def quantizable(module: nn.Module) -> bool:
    """A Linear layer that ptq quantizes when a recipe targets its kind: not a router (routing
    decisions are left alone; a router subclassing Linear may not even return a tensor)."""
    return isinstance(module, nn.Linear) and kind(module) in KINDS


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers without Conv1D: nothing to linearize
        return ()
    return Conv1D


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module (`@use_experts_implementation`) whose layout ptq knows."""
    return (
        hasattr(module, "is_transposed")
        and hasattr(module, "has_gate")
        and hasattr(module, "_apply_gate")
        and isinstance(getattr(module, "down_proj", None), nn.Parameter)
        and module.down_proj.dim() == 3
        and isinstance(
            getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None), nn.Parameter
        )
        and not getattr(module, "has_post_expert_norm", False)
        and getattr(module, "is_concatenated", True) in (True, False)
    )


def linear_view(weight: torch.Tensor, bias: torch.Tensor | None, kind_: str) -> nn.Linear:
    """An nn.Linear over `weight` ([out, in], a view: no copy) and `bias`."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    linear.ptq_kind = kind_
    return linear


class ExpertLinears(nn.Module):
    """One expert's matmuls: gate_proj (when the family gates), up_proj, down_proj."""

    def __init__(self, gate: nn.Linear | None, up: nn.Linear, down: nn.Linear):
        super().__init__()
        if gate is not None:
            self.gate_proj = gate
        self.up_proj, self.down_proj = up, down


class LinearExperts(nn.ModuleList):
    """A fused-experts module as one `ExpertLinears` per expert (`experts.{e}.gate_proj`, ... : the
    names per-expert checkpoints use), called like the fused module: (hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H].

    `all_experts` (calibration): every token also goes through every expert, so that each expert's
    layers see inputs (and get a scale) even when no token is routed to it; the output still uses
    routed tokens only."""

    def __init__(self, fused: nn.Module):
        experts = []
        gate_up = fused.gate_up_proj if fused.has_gate else fused.up_proj
        gate_up_bias = (
            getattr(fused, "gate_up_proj_bias" if fused.has_gate else "up_proj_bias", None)
            if fused.has_bias
            else None
        )
        down_bias = fused.down_proj_bias if fused.has_bias else None
        for e in range(gate_up.shape[0]):
            w = gate_up[e].t() if fused.is_transposed else gate_up[e]  # [2I or I, H]
            b = gate_up_bias[e] if gate_up_bias is not None else None
            gate = up = None
            if fused.has_gate:
                rows = _gate_rows(w.shape[0], fused.is_concatenated)
                gate = linear_view(w[rows[0]], b[rows[0]] if b is not None else None, "Experts")
                up = linear_view(w[rows[1]], b[rows[1]] if b is not None else None, "Experts")
            else:
                up = linear_view(w, b, "Experts")
            d = fused.down_proj[e].t() if fused.is_transposed else fused.down_proj[e]
            experts.append(
                ExpertLinears(
                    gate,
                    up,
                    linear_view(d, down_bias[e] if down_bias is not None else None, "Experts"),
                )
            )
        super().__init__(experts)
        self.has_gate, self.concatenated = fused.has_gate, fused.is_concatenated
        self.all_experts = False
        # The family's gating function (activation, clamps, interleaving) on the fused module,
        # without its weights.
        activation = copy.copy(fused)
        activation._parameters = {}
        object.__setattr__(self, "_activation", activation)  # not a submodule: it holds no tensor
        self.fused_type = type(fused).__name__
        self._grouped: tuple | None = None

    def gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The family's activation of the gate/up product (its `_apply_gate`), or `act_fn` without a
        gate."""
        return (
            self._activation._apply_gate(gate_up)
            if self.has_gate
            else self._activation.act_fn(gate_up)
        )

    def _gate_up(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate and up outputs [..., I] laid out as the fused module lays them out (concatenated or
        interleaved)."""
        if self.concatenated:
            return torch.cat([gate, up], dim=-1)
        return torch.stack([gate, up], dim=-1).flatten(-2)

    def expert_forward(self, e: int, x: torch.Tensor, modules: bool = True) -> torch.Tensor:
        """Expert e on rows x: through its modules (hooks and quantizers run), or with their weights
        only."""
        expert = self[e]
        run = (lambda m, t: m(t)) if modules else (lambda m, t: F.linear(t, m.weight, m.bias))
        if self.has_gate:
            h = self.gate(self._gate_up(run(expert.gate_proj, x), run(expert.up_proj, x)))
        else:
            h = self.gate(run(expert.up_proj, x))
        return run(expert.down_proj, h)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.all_experts:
            for e in range(len(self)):
                # observed by calibration's hooks; the output is not used
                self.expert_forward(e, hidden_states)
        grouped = self._grouped_weights()
        if grouped is not None:
            return grouped_forward(self, grouped, hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            y = self.expert_forward(e, hidden_states[token], modules=not self.all_experts)
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def regroup(self) -> None:
        """Forget the grouped form: it is stacked again on the next forward from the layers' current
        tensors (after their scales were changed in place, which the cache key of modules and device
        does not see)."""
        self._grouped = None

    def _grouped_weights(self):
        """When every expert matrix is a QuantLinear without SmoothQuant, and the experts of each
        projection share their formats: their codes stacked along a leading expert dimension, made
        once (the QuantLinears then keep views into them). None otherwise: the loop over experts
        (calibration, mixed recipes).

        The quantized layers say how they run grouped (their `grouped_experts`, GROUPING): finding
        matmuls does not depend on quantizing them."""
        grouped_experts = getattr(self[0].down_proj, GROUPING, None)
        if grouped_experts is None:  # not quantized: the loop over experts
            return None
        layers = {
            p: [getattr(expert, p) for expert in self]
            for p in ("gate_proj", "up_proj", "down_proj")
            if hasattr(self[0], p)
        }
        if getattr(getattr(self, "_hf_hook", None), "offload", False):
            # offloaded (ptq.execution.placement): its tensors are on the device for this call only
            return grouped_experts(self, layers)
        first = next(itertools.chain(self[0].down_proj.buffers(), self[0].down_proj.parameters()))
        key = (*(id(m) for group in layers.values() for m in group), first.device)
        # made again when the modules or their device change
        if self._grouped is None or self._grouped[0] != key:
            self._grouped = (key, grouped_experts(self, layers))
        return self._grouped[1]


def _gate_rows(rows: int, concatenated: bool) -> tuple[slice, slice]:
    half = rows // 2
    return (
        (slice(0, half), slice(half, rows))
        if concatenated
        else (slice(0, rows, 2), slice(1, rows, 2))
    )


def grouped_forward(
    experts: LinearExperts,
    grouped,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' grouped_mm experts forward over ptq's quantized operands: (token, slot) pairs
    sorted by expert, each projection's inputs rounded with their expert's scale (one kernel for all
    rows), one grouped matmul per projection over the dequantized stacked weights."""
    k = top_k_index.shape[-1]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // k]
    counts = torch.bincount(expert_ids, minlength=len(experts))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    h = experts.gate(grouped["gate_up"](x, expert_ids, offsets))
    y = grouped["down"](h, expert_ids, offsets) * top_k_weights.reshape(-1)[perm, None]
    out = torch.empty_like(y)
    out[perm] = y
    return out.view(-1, k, y.shape[-1]).sum(1).to(hidden_states.dtype)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [S, in] (rows sorted by expert) times weight[e].T ([E, out, in]) for each expert's rows,
    plus that expert's bias row ([S, out]): transformers' own grouped matmul (torch's grouped_mm
    where the device and dtype have it, a loop over experts elsewhere), so that unquantized operands
    give the fused module's exact output."""
    from transformers.integrations.moe import _grouped_linear

    return _grouped_linear(x, weight, offsets, bias=bias)


def linearize(model: nn.Module) -> nn.Module:
    """Replace, in place, every Conv1D and every fused-experts module ptq knows by Linear layers
    (views of the same weights). Idempotent; returns the model."""
    conv1d = _conv1d_type()
    for name, module in list(model.named_modules()):
        if not name:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if conv1d and isinstance(module, conv1d):
            setattr(parent, child, linear_view(module.weight.t(), module.bias, "Conv1D"))
        elif is_fused_experts(module):
            setattr(parent, child, LinearExperts(module))
            # the MoE block's router, where it is a Linear layer
            for (
                sibling,
                m,
            ) in parent.named_children():
                if sibling in ("gate", "router", SHARED_EXPERT_GATE) and isinstance(m, nn.Linear):
                    m.ptq_kind = ROUTER
        elif isinstance(module, nn.Linear) and "router" in type(module).__name__.lower():
            module.ptq_kind = ROUTER
    return model


@dataclass(frozen=True)
class LeftOut:
    name: str
    params: int
    reason: str


def unsupported(model: nn.Module) -> list[LeftOut]:
    """Weights that multiply activations but that ptq cannot quantize (after linearize): routers
    that keep a bare weight, fused experts of an unknown layout, convolutions. Embedding look-ups
    and norms are not matmuls."""

    def skip(module: nn.Module) -> bool:
        return isinstance(module, (nn.Linear, nn.Embedding, nn.EmbeddingBag)) or getattr(
            module, QUANTIZED, False
        )

    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and kind(module) == ROUTER:
            found.append(
                LeftOut(
                    f"{name}.weight",
                    module.weight.numel(),
                    _SHARED_EXPERT_GATE_REASON
                    if name.rsplit(".", 1)[-1] == SHARED_EXPERT_GATE
                    else f"router ({type(module).__name__}): routing stays in the compute dtype",
                )
            )
            continue
        if skip(module) or any(skip(p) for p in _parents(model, name)):
            continue
        # Conv1d/2d/3d and transposed: any kernel size
        conv = isinstance(module, nn.modules.conv._ConvNd)
        for pname, p in module.named_parameters(recurse=False):
            if not (conv and pname == "weight") and (
                not (p.dim() == 3 or (p.dim() == 2 and pname.endswith("weight")))
                or "embed" in pname
                or "norm" in type(module).__name__.lower()
            ):
                continue
            full = f"{name}.{pname}" if name else pname
            cls = type(module).__name__
            if conv:
                reason = f"not supported ({cls} is a convolution, which ptq does not quantize)"
            elif "router" in cls.lower() or "gate" in name.rsplit(".", 1)[-1]:
                reason = f"router ({cls}): routing stays in the compute dtype"
            elif p.dim() == 3:
                reason = f"fused experts of a layout ptq does not know ({cls})"
            else:
                reason = f"not supported ({cls} is not a Linear, Conv1D or fused-experts module)"
            found.append(LeftOut(full, p.numel(), reason))
    return found


def _parents(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".") if name else []
    return [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]


def natural_key(name: str) -> tuple:
    """Layer names in block order: model.layers.2 before model.layers.10 (each dotted part a number
    or a word)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


def unsupported_weights(cov: dict) -> list[dict]:
    """The left-out weights of a coverage that no recipe could quantize for lack of support (routers
    are left out by design and are not counted here)."""
    return [
        x
        for x in cov["left_out"]
        if x["reason"].startswith(("not supported", "fused experts of a layout"))
    ]
