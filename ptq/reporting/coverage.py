"""How a coverage reads (ptq.models.matmuls.coverage, as results.json holds it): the share of matmul
weight parameters quantized, and what is left out, grouped by reason."""

from __future__ import annotations

from ptq.reporting.results import fmt_against

NAMES_SHOWN = 3  # names per reason in describe_coverage's line; the report lists every one below it


def quantized_share(quantized_params: int, matmul_params: int) -> float:
    """The share (0 to 1) of the model's matmul weight parameters a recipe quantizes; 0 for a model
    without any."""
    return quantized_params / matmul_params if matmul_params else 0.0


def left_out_groups(cov: dict) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """A coverage's left-out matmul weights and attention inputs, each grouped by reason
    ({reason: [entries]})."""
    groups: dict[str, list[dict]] = {}
    for x in cov["left_out"]:
        groups.setdefault(x["reason"], []).append(x)
    attention: dict[str, list[dict]] = {}
    for x in cov.get("attention_left_out", []):
        attention.setdefault(x["reason"], []).append(x)
    return groups, attention


def describe_coverage(cov: dict) -> str:
    """One line: share of matmul weights quantized, and what is left out, grouped by reason (the
    first few names of each: NAMES_SHOWN). A share that is not all reads as less than 100%."""
    share = quantized_share(cov["quantized_weight_params"], cov["matmul_weight_params"])
    groups, attention = left_out_groups(cov)
    parts = [
        f"{_names(items)} ({sum(i['params'] for i in items):,} params): {reason}"
        for reason, items in groups.items()
    ]
    parts += [f"{_names(items)}: {reason}" for reason, items in attention.items()]
    return (
        f"{fmt_against(100 * share, None, '.2f', 0, 100)}% of matmul weight parameters quantized "
        f"({cov['quantized_weight_params']:,} of "
        f"{cov['matmul_weight_params']:,})"
        + (f"; left unquantized: {'; '.join(parts)}" if parts else "")
    )


def _names(items: list[dict], shown: int = NAMES_SHOWN) -> str:
    names = ", ".join(f"`{i['name']}`" for i in items[:shown])
    return names + (f" and {len(items) - shown} more" if len(items) > shown else "")
