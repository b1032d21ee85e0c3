"""search.md, searched.yaml and the curve's plot, from the record `ptq search` writes as
search.json (a plain dict: ptq.commands.search builds it)."""

from __future__ import annotations

import json
import math
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


def searched_yaml(record: dict, source: dict) -> str:
    """The chosen recipe (`source`: its YAML as a mapping) with the kept units added to its ignore
    list, one comment per unit giving its sensitivity."""
    sens = {u["name"]: u for u in record["units"]}
    data = {k: v for k, v in source.items() if k != "ignore"}
    data["name"] = f"{source['name']}-searched"
    data["description"] = (
        f"{source.get('description', source['name'])}; {len(record['chosen'])} unit(s) kept in "
        f"16-bit by ptq search ({record['budget']['flag']} {record['budget']['given']})"
    )
    head = (
        f"# ptq search: {record['model']}, recipe {source['name']}, budget "
        f"{record['budget']['flag']} {record['budget']['given']}\n"
        f"# held-out verdict: {verdict_word(record['verdict'])} the budget "
        f"({_measure(record, record['verdict'])}, 95% interval)\n"
    )
    lines = [head + yaml.safe_dump(data, sort_keys=False, width=1000).rstrip("\n"), "ignore:"]
    lines += [f"  - {json.dumps(p)}" for p in source.get("ignore", ["lm_head"])]
    for name in record["chosen"]:
        u = sens[name]
        for p in u["patterns"]:
            lines.append(
                f"  - {json.dumps(p)}  # kept in 16-bit: KL {_num(u['sensitivity'])} "
                f"nats when quantized alone, {u['params']:,} weights"
            )
    if not source.get("ignore", ["lm_head"]) and not record["chosen"]:
        lines[-1] = "ignore: []"
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


def search_markdown(record: dict) -> str:
    b, v, cost = record["budget"], record["verdict"], record["cost"]
    unit = " nats" if b["metric"] == "kl" else "%"
    out = [
        f"# ptq search: {record['model']}",
        "",
        f"Recipe **{record['recipe']}**, target {record['target']}, budget **{b['flag']} "
        f"{b['given']}** ({b['measure']}).",
        "",
        "## Verdict (held-out windows)",
        "",
        f"{len(record['chosen'])} of {len(record['units'])} unit(s) kept in 16-bit; "
        f"{100 * record['fraction_quantized']:.1f}% of the matmul weights quantized.",
        "",
        f"Held-out {b['measure']}: {_measure(record, v)} (95% paired bootstrap interval over "
        f"{v['n']} windows).",
        "",
        (
            f"**Meets the budget**: the interval's upper bound is within {b['given']}."
            if v["meets"]
            else (
                f"**Misses the budget** by {_num(v['miss'])}{unit} (the interval's upper bound "
                f"over {b['given']})."
                if v["miss"] is not None
                else "**Not verified**: too few held-out windows for an interval."
            )
        ),
        *_closest(record),
        "",
        "## Method",
        "",
        f"- Windows: {record['windows']['description']}",
        f"- Units: {record['units_description']}",
        f"- Sensitivity: {record['method']}",
        f"- Selection: {record['selection']}",
        f"- Cost: {cost['forwards']:,} window forward passes, {cost['evaluations']:.1f}x one "
        f"evaluation (the baseline and one variant on all {record['windows']['total']} windows); "
        f"{cost['seconds']:.1f} s, of which sensitivity {cost['sensitivity_seconds']:.1f} s.",
        "",
        "## Baselines (held-out windows, same number of 16-bit units)",
        "",
        f"| configuration | 16-bit units | {b['measure']} [95% interval] | meets |",
        "|---|---|---|---|",
        f"| searched | {len(record['chosen'])} | {_measure(record, v)} | "
        f"{'yes' if v['meets'] else 'no'} |",
    ]
    for x in record["baselines"]:
        out.append(
            f"| {x['name']} | {x['count']} | {_measure(record, x)} | "
            f"{'yes' if x['meets'] else 'no'} |"
        )
    out += [
        "",
        "## Curve (search windows)",
        "",
        "| 16-bit units | matmul weights quantized | KL (nats) | perplexity increase | meets |",
        "|---|---|---|---|---|",
    ]
    for p in record["curve"]:
        note = "" if p["evaluated"] else " (the baseline itself)"
        out.append(
            f"| {p['kept']}{note} | {100 * p['fraction_quantized']:.1f}% | {_num(p['kl'])} | "
            f"{_num(p['ppl_increase'])}% | {'yes' if p['meets'] else 'no'} |"
        )
    out += [
        "",
        "## Units kept in 16-bit",
        "",
        "| unit | weights | sensitivity (KL, alone) |",
        "|---|---|---|",
    ]
    sens = {u["name"]: u for u in record["units"]}
    for name in record["chosen"]:
        out.append(f"| {name} | {sens[name]['params']:,} | {_num(sens[name]['sensitivity'])} |")
    return "\n".join(out) + "\n"


def curve_writer(record: dict):
    """A writer of the curve's PNG (damage against the fraction of matmul weights quantized)."""

    def write(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        b = record["budget"]
        pts = record["curve"]
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        ax.plot([p["fraction_quantized"] for p in pts], [p["damage"] for p in pts], "o-")
        ax.axhline(b["value"], color="red", linestyle="--", label=f"budget {b['given']}")
        ax.set_xlabel("fraction of matmul weights quantized")
        ax.set_ylabel(b["measure"] + " (search windows)")
        ax.set_title(f"ptq search: {record['model']}, {record['recipe']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
        plt.close(fig)

    return write
