"""search.md, searched.yaml and the curve's plot, from the record `ptq search` writes as
search.json (a plain dict: ptq.commands.search builds it)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import yaml


def _num(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}g}"


def _measure(record: dict, v: dict) -> str:
    unit = " nats" if record["budget"]["metric"] == "kl" else "%"
    lo, hi = v["ci"]
    return f"{_num(v['value'])}{unit} [{_num(lo)}, {_num(hi)}]"


def verdict_word(v: dict) -> str:
    """A held-out verdict in words: it meets the budget only where the interval's upper bound does;
    without an interval (too few held-out windows) it is not verified, and says so."""
    if v["meets"]:
        return "meets"
    return "misses" if v["miss"] is not None else "is not verified against"


def _sensitivity(u: dict) -> str:
    """A unit's sensitivity in words: its KL quantized alone by each recipe."""
    kl = ", ".join(f"{_num(v)} under {name}" for name, v in u["sensitivity"].items())
    return f"KL {kl} when quantized alone"


def finer_words(record: dict) -> str:
    """ ", N at RECIPE" for the units at each finer recipe ("" for none)."""
    counts = Counter(record["finer"].values())
    return "".join(f", {n} at {name}" for name, n in counts.items())


def searched_yaml(record: dict, sources: list[dict], schemes: list[str]) -> str:
    """The recipe the search chose: the YAML (`sources`, one per recipe) of the cheapest recipe a
    unit takes (record["base"]) with the units kept in 16-bit added to its ignore list and an
    override per finer recipe (`schemes`: how each recipe is named there), one comment per unit
    giving its sensitivity."""
    units = {u["name"]: u for u in record["units"]}
    first = record["recipes"].index(record["base"])
    source = sources[first]
    data = {k: v for k, v in source.items() if k not in ("ignore", "overrides")}
    data["name"] = f"{source['name']}-searched"
    data["description"] = (
        f"{source.get('description', source['name'])}; {len(record['chosen'])} unit(s) kept in "
        f"16-bit{finer_words(record)} by ptq search ({record['budget']['flag']} "
        f"{record['budget']['given']})"
    )
    head = (
        f"# ptq search: {record['model']}, recipes {', '.join(record['recipes'])}, budget "
        f"{record['budget']['flag']} {record['budget']['given']}\n"
        f"# held-out verdict: {verdict_word(record['verdict'])} the budget "
        f"({_measure(record, record['verdict'])}, 95% interval)\n"
    )
    lines = [head + yaml.safe_dump(data, sort_keys=False, width=1000).rstrip("\n"), "ignore:"]
    lines += [f"  - {json.dumps(p)}" for p in source.get("ignore", ["lm_head"])]
    for name in record["chosen"]:
        u = units[name]
        for p in u["patterns"]:
            lines.append(
                f"  - {json.dumps(p)}  # kept in 16-bit: {_sensitivity(u)}, {u['params']:,} weights"
            )
    if not source.get("ignore", ["lm_head"]) and not record["chosen"]:
        lines[-1] = "ignore: []"
    finer = [
        (recipe, scheme, [n for n, r in record["finer"].items() if r == recipe])
        for recipe, scheme in zip(record["recipes"][first + 1 :], schemes[first + 1 :])
    ]
    if any(names for *_, names in finer):
        lines.append("overrides:")
    for recipe, scheme, names in finer:
        if not names:
            continue
        lines += [f"  - scheme: {json.dumps(scheme)}", "    match:"]
        for name in names:
            u = units[name]
            lines += [
                f"      - {json.dumps(p)}  # {recipe}: {_sensitivity(u)}" for p in u["patterns"]
            ]
    return "\n".join(lines) + "\n"


def closest_line(record: dict) -> str | None:
    """Which configuration evaluated on the held-out windows came closest to the budget, when the
    searched one misses it (None when it meets it)."""
    c = record.get("closest")
    if c is None:
        return None
    if c["name"] is None:
        return "No configuration could be verified: too few held-out windows for an interval."
    if c["only"]:
        return (
            "Closest configuration: the searched one, the only configuration verified on the "
            "held-out windows."
        )
    unit = " nats" if record["budget"]["metric"] == "kl" else "%"
    how = "meets the budget" if c["meets"] else f"misses it by {_num(c['miss'])}{unit}"
    return (
        f"Closest configuration on the held-out windows ({c['verified']} verified): "
        f"**{c['name']}**, {c['count']} unit(s) in 16-bit, {_measure(record, c)}; it {how}."
    )


def _closest(record: dict) -> list[str]:
    line = closest_line(record)
    return [] if line is None else ["", line]


def amax_line(record: dict) -> str | None:
    """What the units ranked by input amax need to meet the budget on the search windows, against
    what the search needs (None when there was no amax to rank by)."""
    curve = record.get("amax_curve")
    if not curve:
        return None
    at = min((p for p in curve if p["meets"]), key=lambda p: p["steps"])
    return (
        f"Ranked by input amax instead, the budget is met on the search windows with {at['kept']} "
        f"unit(s) kept in 16-bit: {100 * at['fraction_quantized']:.1f}% of the matmul weights "
        f"quantized, against {100 * record['fraction_quantized']:.1f}% for the search."
    )


def _verdict(record: dict) -> list[str]:
    b, v = record["budget"], record["verdict"]
    unit = " nats" if b["metric"] == "kl" else "%"
    if v["meets"]:
        word = f"**Meets the budget**: the interval's upper bound is within {b['given']}."
    elif v["miss"] is not None:
        word = (
            f"**Misses the budget** by {_num(v['miss'])}{unit} (the interval's upper bound over "
            f"{b['given']})."
        )
    else:
        word = "**Not verified**: too few held-out windows for an interval."
    amax = amax_line(record)
    return [
        f"{len(record['chosen'])} of {len(record['units'])} unit(s) kept in 16-bit"
        f"{finer_words(record)}; {100 * record['fraction_quantized']:.1f}% of the matmul weights "
        "quantized.",
        "",
        f"Held-out {b['measure']}: {_measure(record, v)} (95% paired bootstrap interval over "
        f"{v['n']} windows).",
        "",
        word,
        *_closest(record),
        *([] if amax is None else ["", amax]),
    ]


def _baselines(record: dict) -> list[str]:
    v = record["verdict"]
    out = [
        "## Baselines (held-out windows)",
        "",
        "Each recipe whole; as many units at each level as the search chose, by largest input "
        "amax and at random; the amax ranking's own choice at the budget (`amax:budget`).",
        "",
        f"| configuration | 16-bit units | finer units | {record['budget']['measure']} "
        "[95% interval] | meets |",
        "|---|---|---|---|---|",
    ]
    for x in [{"name": "searched"} | v, *record["baselines"]]:
        if "skipped" in x:
            out.append(f"| {x['name']} | | | skipped: {x['skipped']} | |")
            continue
        finer = sum(1 for label in x["config"].values() if label != "16-bit")
        out.append(
            f"| {x['name']} | {x['count']} | {finer} | {_measure(record, x)} | "
            f"{'yes' if x['meets'] else 'no'} |"
        )
    return out


def _curve(record: dict) -> list[str]:
    out = [
        "## Curve (search windows)",
        "",
        f"| steps | 16-bit units | matmul weights quantized | {record['budget']['measure']} "
        "[95% interval] | KL (nats) | perplexity increase | meets |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in record["curve"]:
        note = "" if p["evaluated"] else " (the baseline itself)"
        out.append(
            f"| {p['steps']}{note} | {p['kept']} | {100 * p['fraction_quantized']:.1f}% | "
            f"{_measure(record, {'value': p['damage'], 'ci': p['ci']})} | {_num(p['kl'])} | "
            f"{_num(p['ppl_increase'])}% | {'yes' if p['meets'] else 'no'} |"
        )
    return out


def search_markdown(record: dict) -> str:
    b, cost = record["budget"], record["cost"]
    units = {u["name"]: u for u in record["units"]}
    out = [
        f"# ptq search: {record['model']}",
        "",
        f"Recipes **{', '.join(record['recipes'])}** (cheapest first, 16-bit last), target "
        f"{record['target']}, budget **{b['flag']} {b['given']}**, measured as {b['measure']}.",
        "",
        "## Verdict (held-out windows)",
        "",
        *_verdict(record),
        "",
        "## Method",
        "",
        f"- Windows: {record['windows']['description']}",
        f"- Units: {record['units_description']}",
        f"- Sensitivity: {record['method']}",
        f"- Selection: {record['selection']}",
        f"- Cost: {cost['forwards']:,} window forward passes, {cost['evaluations']:.1f}x one "
        f"evaluation (the baseline and one variant on all {record['windows']['total']} windows); "
        f"{cost['seconds']:.1f} s, of which sensitivity {cost['sensitivity_seconds']:.1f} s"
        + (
            f", layer by layer from disk (--low-memory: the checkpoint read {cost['chunks']} times)"
            if cost.get("low_memory")
            else ""
        )
        + (
            f"; {cost['reused']} configuration(s) scored earlier, reused."
            if cost.get("reused")
            else "."
        ),
        "",
        *_baselines(record),
        "",
        *_curve(record),
        "",
        "## Units not at " + record["recipes"][0],
        "",
        "| unit | weights | level | sensitivity (KL, quantized alone) |",
        "|---|---|---|---|",
    ]
    for name in [*record["chosen"], *record["finer"]]:
        u = units[name]
        kl = ", ".join(f"{_num(x)} ({r})" for r, x in u["sensitivity"].items())
        out.append(f"| {name} | {u['params']:,} | {u['level']} | {kl} |")
    return "\n".join(out) + "\n"


def curve_writer(record: dict):
    """A writer of the curve's PNG (damage against the fraction of matmul weights quantized, the
    search's and the amax ranking's)."""

    def write(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        b = record["budget"]
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for key, label in (("curve", "search"), ("amax_curve", "ranked by input amax")):
            pts = record.get(key) or []
            if pts:
                ax.plot(
                    [p["fraction_quantized"] for p in pts], [p["damage"] for p in pts], "o-",
                    label=label,
                )  # fmt: skip
        ax.axhline(b["value"], color="red", linestyle="--", label=f"budget {b['given']}")
        ax.set_xlabel("fraction of matmul weights quantized")
        ax.set_ylabel(b["measure"] + " (search windows)")
        ax.set_title(f"ptq search: {record['model']}, {', '.join(record['recipes'])}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
        plt.close(fig)

    return write
