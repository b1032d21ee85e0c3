"""ptq search on tiny random models: the files it writes, the recipe it writes, the budget logic,
units that never split what the engine fuses."""

from __future__ import annotations

import json

import families
import pytest
import yaml

from ptq.commands.search import FILES
from ptq.models.matmuls import linearize
from ptq.quantization import engines
from ptq.quantization.plan import resolve_plan
from ptq.quantization.recipes import load_recipe
from ptq.reporting.search import search_markdown
from ptq.search.search import closest, units_of

SMALL = {
    "calib_data": None,  # filled with the text file
    "calib_samples": 4,
    "seq_len": 32,
    "max_windows": 8,
    "quiet": True,
}


def _search(ptq_run, model, text, out, **flags):
    given = SMALL | {"calib_data": text, "eval_data": text, "out": out, "force": True} | flags
    return ptq_run("search", model, **given)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-moe")
    families.build("qwen3_moe").save_pretrained(path)
    families.make_tokenizer().save_pretrained(path)
    return path


def test_search_writes_a_recipe_that_compare_and_inspect_accept(
    ptq_run, tiny_model, text_file, tmp_path
):
    out = tmp_path / "search"
    code, _, err = _search(ptq_run, tiny_model, text_file, out, max_kl="0.000012")
    assert code in (0, 1), err
    assert {p.name for p in out.iterdir()} == {
        "searched.yaml",
        "search.json",
        "search.md",
        "search.png",
    }
    record = json.loads((out / "search.json").read_text())
    assert record["budget"]["metric"] == "kl" and record["method"]
    assert record["windows"]["search"] + record["windows"]["held_out"] == 8
    assert {b["name"] for b in record["baselines"]} >= {"recipe:fp8-e4m3", "amax:budget"}
    assert (record["closest"] is None) == record["verdict"]["meets"]
    assert "## Verdict" in (out / "search.md").read_text()
    # the recipe keeps exactly the chosen units' layers in bf16, and nothing else beyond lm_head
    recipe = load_recipe(str(out / "searched.yaml"))
    kept = {m for u in record["units"] if u["name"] in record["chosen"] for m in u["members"]}
    code, stdout, err = ptq_run("inspect", tiny_model, recipe=str(out / "searched.yaml"), json=True)
    assert code == 0, err
    plan = resolve_plan(
        linearize(__import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model)),
        recipe,
        "vllm",
    )
    assert set(plan.left_out) == kept | {"lm_head"}
    code, _, err = ptq_run(
        "compare",
        tiny_model,
        recipes=str(out / "searched.yaml"),
        out=tmp_path / "compare",
        no_plots=True,
    )
    assert code == 0, err


def test_budget_zero_keeps_everything_and_huge_keeps_nothing(
    ptq_run, tiny_model, text_file, tmp_path
):
    code, _, err = _search(ptq_run, tiny_model, text_file, tmp_path / "zero", max_kl="0")
    assert code == 0, err  # every unit kept: the baseline itself, KL exactly 0
    record = json.loads((tmp_path / "zero" / "search.json").read_text())
    assert len(record["chosen"]) == len(record["units"]) and record["verdict"]["meets"]
    assert record["fraction_quantized"] == 0
    code, _, err = _search(
        ptq_run, tiny_model, text_file, tmp_path / "huge", max_ppl_increase="1000%"
    )
    assert code == 0, err
    record = json.loads((tmp_path / "huge" / "search.json").read_text())
    assert record["chosen"] == [] and record["verdict"]["meets"]
    assert record["budget"]["metric"] == "ppl"


def test_moe_search_keeps_experts_whole(ptq_run, moe_model, text_file, tmp_path):
    out = tmp_path / "moe"
    code, _, err = _search(ptq_run, moe_model, text_file, out, max_kl="0")
    assert code == 0, err
    record = json.loads((out / "search.json").read_text())
    experts = [u for u in record["units"] if u["name"].endswith(".experts")]
    assert experts and all(len(u["members"]) > 3 for u in experts)
    assert set(record["chosen"]) == {u["name"] for u in record["units"]}
    text = (out / "searched.yaml").read_text()
    assert yaml.safe_load(text)["name"] == "fp8-e4m3-searched"


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_units_never_split_a_fused_group(family):
    model = linearize(families.build(family))
    plan = resolve_plan(model, load_recipe("fp8-e4m3"), "vllm")
    units = units_of(model, plan)
    owner = {m: u.name for u in units for m in u.members}
    assert sorted(owner) == sorted(plan.quantized)  # every quantized matmul in exactly one unit
    for group in engines.fused_groups(model):
        assert len({owner[n] for n in group}) == 1, group
    for group in engines.expert_input_groups(model):
        assert len({owner[n] for n in group if n in owner}) == 1, group
    # under transformers each matmul is its own unit
    plan = resolve_plan(model, load_recipe("fp8-e4m3"), "transformers")
    assert all(len(u.members) == 1 for u in units_of(model, plan))


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"max_kl": "0.01", "recipes": "fp8-e4m3,fp8-e4m3"}, "names a recipe twice"),
        ({"max_kl": "0.01", "recipes": "fp8-e4m3,int8-smoothquant"}, "searched alone"),
        ({}, "give one budget"),
        ({"max_kl": "0.01", "max_ppl_increase": "1%"}, "give one budget"),
        ({"max_kl": "0.01", "low_memory": True, "dtype": "bfloat16"}, "computes in float32"),
        ({"max_kl": "0.01", "device_map": "auto"}, "--device-map does not apply"),
        ({"max_kl": "0.01", "device_map": "auto", "low_memory": True}, "use --low-memory"),
        ({"max_kl": "0.01", "recipes": "fp8-e4m3+kv"}, "does not search these"),
    ],
)
def test_refused_in_one_line(ptq_run, tiny_model, text_file, tmp_path, flags, message):
    code, _, err = _search(ptq_run, tiny_model, text_file, tmp_path / "x", **flags)
    assert code == 2 and message in err, err
    assert not (tmp_path / "x").exists()


def test_existing_out_refused_without_force(ptq_run, tiny_model, text_file, tmp_path):
    (tmp_path / "x").mkdir()
    code, _, err = _search(ptq_run, tiny_model, text_file, tmp_path / "x", max_kl="1", force=False)
    assert code == 2 and "already exists" in err


def test_search_never_writes_over_or_into_what_it_reads(ptq_run, tiny_model, text_file, tmp_path):
    """The one output rule (ptq.files.check_outputs) holds for search too: not into the model's
    folder, not over its text, and an existing folder only with --force; refused before any
    work, nothing written."""
    before = sorted(p.name for p in tiny_model.iterdir())
    for out in (tiny_model / "search", text_file):
        code, _, err = _search(ptq_run, tiny_model, text_file, out, max_kl="0.01")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tiny_model.iterdir()) == before and text_file.is_file()
    (tmp_path / "taken").mkdir()
    code, _, err = _search(
        ptq_run, tiny_model, text_file, tmp_path / "taken", max_kl="0.01", force=None
    )
    assert code == 2 and "--force" in err, err


FAMILY_RUN = {"calib_samples": 2, "seq_len": 16, "max_windows": 4}


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_search_on_every_family(family, ptq_run, text_file, tmp_path):
    """Every supported family through `ptq search`, with a budget that forces a choice (a quarter
    of the whole recipe's KL, as a first search with no binding budget measured it on the same
    windows): exit 0 or 1 with the files written, the recipe loads, its plan keeps exactly the
    chosen units' layers in 16-bit, no unit splits a fused group."""
    import transformers

    model_dir = tmp_path / family
    families.build(family).save_pretrained(model_dir)
    families.make_tokenizer().save_pretrained(model_dir)
    free = tmp_path / "free"
    code, _, err = _search(
        ptq_run, model_dir, text_file, free, max_ppl_increase="1000%", **FAMILY_RUN
    )
    assert code in (0, 1), err
    whole = json.loads((free / "search.json").read_text())["curve"][0]
    assert whole["kept"] == 0 and whole["kl"] > 0
    out = tmp_path / "search"
    code, _, err = _search(
        ptq_run, model_dir, text_file, out, max_kl=f"{whole['kl'] / 4:.3g}", **FAMILY_RUN
    )
    assert code in (0, 1), err
    assert {p.name for p in out.iterdir()} == set(FILES)
    record = json.loads((out / "search.json").read_text())
    assert 0 < len(record["chosen"]) < len(record["units"])  # a choice, not an end of the curve
    recipe = load_recipe(str(out / "searched.yaml"))
    model = linearize(transformers.AutoModelForCausalLM.from_pretrained(model_dir))
    plan = resolve_plan(model, recipe, "vllm")
    full = resolve_plan(model, load_recipe("fp8-e4m3"), "vllm")
    kept = {m for u in record["units"] if u["name"] in record["chosen"] for m in u["members"]}
    assert set(plan.left_out) - set(full.left_out) == kept
    assert set(plan.quantized) == set(full.quantized) - kept
    owner = {m: u["name"] for u in record["units"] for m in u["members"]}
    assert sorted(owner) == sorted(full.quantized)
    for group in engines.fused_groups(model) + engines.expert_input_groups(model):
        assert len({owner.get(n) for n in group}) == 1, group


def _measured(name, kept, upper, budget=0.01):
    return {
        "name": name,
        "kept": kept,
        "config": dict.fromkeys(kept, "16-bit"),
        "count": len(kept),
        "value": upper / 2,
        "ci": [0.0, upper],
        "n": 4,
        "meets": upper <= budget,
        "miss": None if upper <= budget else upper - budget,
    }


def test_closest_configuration_when_the_held_out_check_misses():
    """A miss names the configuration evaluated on the held-out windows whose upper bound came
    nearest the budget (a baseline that keeps the searched units is the same configuration); a
    searched configuration alone says it was the only one verified; a meet names none."""
    searched = _measured("searched", ["a"], 0.03)
    baselines = [
        _measured("recipe", [], 0.05),
        _measured("amax", ["b"], 0.02),
        _measured("random:0", ["a"], 0.001),  # the searched configuration itself
        {"name": "skipped", "skipped": "no amax"},
    ]
    c = closest({k: v for k, v in searched.items() if k != "name"}, baselines)
    assert c["name"] == "amax" and c["count"] == 1 and not c["only"] and c["verified"] == 3
    assert c["miss"] == pytest.approx(0.01)
    c = closest(searched, [_measured("recipe", ["a"], 0.05)])
    assert c["name"] == "searched" and c["only"]
    assert closest(_measured("searched", ["a"], 0.001), baselines) is None
    record = {
        "model": "m",
        "recipe": "fp8-e4m3",
        "recipes": ["fp8-e4m3"],
        "target": "vllm",
        "budget": {
            "metric": "kl",
            "flag": "--max-kl",
            "given": "0.01",
            "value": 0.01,
            "measure": "mean KL (nats per token)",
        },
        "verdict": searched,
        "baselines": baselines[:2],
        "closest": closest(searched, baselines),
        "chosen": ["a"],
        "finer": {},
        "units": [
            {
                "name": "a",
                "params": 1,
                "sensitivity": {"fp8-e4m3": 0.1},
                "patterns": ["a"],
                "level": "16-bit",
            }
        ],
        "fraction_quantized": 0.5,
        "windows": {"description": "d", "total": 8},
        "units_description": "u",
        "method": "m",
        "selection": "s",
        "cost": {"forwards": 1, "evaluations": 1.0, "seconds": 1.0, "sensitivity_seconds": 0.5},
        "curve": [],
        "amax_curve": None,
    }
    md = search_markdown(record)
    assert "Closest configuration on the held-out windows (3 verified): **amax**, 1 unit(s)" in md
    assert "misses it by 0.01 nats" in md
    record["closest"] = closest(searched, [_measured("recipe", ["a"], 0.05)])
    assert "the only configuration verified" in search_markdown(record)


def test_units_that_would_split_a_served_group_are_refused(monkeypatch):
    """A group vLLM serves together that the units cannot hold whole is refused in one line, never
    searched mis-grouped."""
    from ptq.errors import PtqError

    model = linearize(families.build("llama"))
    plan = resolve_plan(model, load_recipe("fp8-e4m3"), "vllm")
    odd = ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    monkeypatch.setattr(engines, "expert_input_groups", lambda m: [odd])
    with pytest.raises(PtqError, match="cannot form search units") as e:
        units_of(model, plan)
    assert "\n" not in str(e.value)


def test_a_verdict_without_an_interval_is_not_verified_not_missed():
    """Too few held-out windows give no interval: the summary says the budget is not verified,
    never that it is missed (or met)."""
    from ptq.reporting.search import verdict_word

    assert verdict_word({"meets": True, "miss": None}) == "meets"
    assert verdict_word({"meets": False, "miss": 0.5}) == "misses"
    assert verdict_word({"meets": False, "miss": None}) == "is not verified against"


def _by_recipe(model, baseline, recipes, units, configs, calibration, target, ids):
    """The reference: each configuration's recipe (config_recipe) quantized by quantize_variants
    and evaluated with the baseline, CHUNK at a time, as the first version of the search did."""
    from ptq.calibration.clips import quantize_variants
    from ptq.evaluation.evaluate import evaluate
    from ptq.search.search import CHUNK, config_recipe

    out, names = {}, list(configs)
    for start in range(0, len(names), CHUNK):
        part = [config_recipe(recipes, units, configs[n], n) for n in names[start : start + CHUNK]]
        models = quantize_variants(model, [baseline, *part], calibration, "simulated", target)
        out |= evaluate(models, ids, None)
    return out


@pytest.mark.parametrize(
    "family,target",
    [("llama", "transformers"), *((family, "vllm") for family in sorted(families.FAMILIES))],
)
def test_swapped_configurations_score_exactly_as_their_recipes(family, target, monkeypatch):
    """The search's configurations (layers swapped between one 16-bit and one quantized copy of the
    model, the decoder layers before the first quantized one given the baseline's outputs) score,
    bit for bit, as their recipes quantized from the model (config_recipe): the sensitivities, the
    selection's configurations and the held-out ones measure what searched.yaml gives compare."""
    import random

    import torch

    from ptq.calibration.calibrate import calibrate
    from ptq.quantization.plan import calibrated_layers
    from ptq.search import search
    from ptq.search.search import CHUNK, Scorer

    given = []  # the decoder layers whose baseline outputs were reused

    class Given(search._Given):
        def __init__(self, output):
            super().__init__(output)
            given.append(output)

    monkeypatch.setattr(search, "_Given", Given)
    model = linearize(families.build(family)).to(torch.bfloat16).eval()
    recipes = [load_recipe("fp8-e4m3"), load_recipe("fp8-dynamic")]
    baseline = load_recipe("bf16")
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 16))
    calibration = calibrate(model, ids, calibrated_layers(model, recipes[0]))
    units = units_of(model, resolve_plan(model, recipes[0], target), served=True)
    rng = random.Random(0)
    everything = dict.fromkeys((u.name for u in units), search.KEEP)
    configs = {f"only:{u.name}": everything | {u.name: 0} for u in units}
    configs |= {f"dynamic:{u.name}": everything | {u.name: 1} for u in units[:2]}
    for k in (0, 1, len(units) // 2, len(units)):  # k units at random levels, the rest at the first
        configs[f"mixed:{k}"] = {u.name: rng.choice([search.KEEP, 0, 1]) for u in units[:k]}
    assert len(configs) > CHUNK  # several chunks, each with its baseline
    scorer = Scorer(model, baseline, recipes, units, calibration, "simulated", target, None)
    scores, base = scorer.score(configs, ids, "test")
    expected = _by_recipe(model, baseline, recipes, units, configs, calibration, target, ids)
    assert base == expected[baseline.name]
    for name in configs:
        assert scores[name] == expected[name], name
    assert scores["only:" + units[0].name].kl_div > 0
    assert scores["dynamic:" + units[0].name] != scores["only:" + units[0].name]
    assert given  # the layers before a configuration's first quantized one were not run again


def test_the_ladder_takes_the_most_damage_avoided_per_byte_first():
    """Hand-computed: a step to a finer scheme of the same width adds no byte and comes first; a
    finer scheme that does no better is skipped; a unit's own steps keep their order; with one
    recipe the order is sensitivity per weight, most first."""
    from ptq.search.search import KEEP, Unit, configuration, ladder

    recipes = [load_recipe("fp8-e4m3"), load_recipe("fp8-dynamic")]
    units = [Unit("a", ("a",), 100, ("a",)), Unit("b", ("b",), 10, ("b",))]
    units.append(Unit("c", ("c",), 1000, ("c",)))
    sens = {"a": [0.4, 0.1], "b": [0.05, 0.06], "c": [0.2, 0.2]}
    # a -> fp8-dynamic avoids 0.3 for 0 bytes; b -> 16-bit 0.05 / 10 bytes; a -> 16-bit from
    # fp8-dynamic 0.1 / 100; c -> 16-bit 0.2 / 1000 (its fp8-dynamic does no better: skipped)
    steps = ladder(units, recipes, sens)
    assert steps == [("a", 1), ("b", KEEP), ("a", KEEP), ("c", KEEP)]
    assert configuration(steps, 3) == {"a": KEEP, "b": KEEP}
    one = {"a": [0.4], "b": [0.05], "c": [0.2]}  # per weight: 0.004, 0.005, 0.0002
    assert ladder(units, recipes[:1], one) == [("b", KEEP), ("a", KEEP), ("c", KEEP)]


def test_a_mixed_search_writes_a_recipe_that_quantize_exports_and_verifies(
    ptq_run, tiny_model, text_file, tmp_path
):
    """`--recipes fp8-e4m3,fp8-dynamic`: units take the finer recipe or 16-bit; searched.yaml
    gives each unit's layers the level the record names (the plan's scheme per matmul), and `ptq
    quantize` writes it as one checkpoint with a config group per scheme, reloaded by transformers
    and verified."""
    import transformers

    free = tmp_path / "free"
    code, _, err = _search(ptq_run, tiny_model, text_file, free, max_ppl_increase="1000%")
    assert code in (0, 1), err
    whole = json.loads((free / "search.json").read_text())["curve"][0]
    out = tmp_path / "mixed"
    code, _, err = _search(
        ptq_run, tiny_model, text_file, out, max_kl=f"{whole['kl'] / 4:.3g}",
        recipes="fp8-e4m3,fp8-dynamic",
    )  # fmt: skip
    assert code in (0, 1), err
    record = json.loads((out / "search.json").read_text())
    assert record["recipes"] == ["fp8-e4m3", "fp8-dynamic"]
    assert record["finer"] and set(record["finer"].values()) == {"fp8-dynamic"}
    assert all(set(u["sensitivity"]) == {"fp8-e4m3", "fp8-dynamic"} for u in record["units"])
    recipe = load_recipe(str(out / "searched.yaml"))
    model = linearize(transformers.AutoModelForCausalLM.from_pretrained(tiny_model))
    plan = resolve_plan(model, recipe, "vllm")
    for u in record["units"]:
        want = {"16-bit": "bf16", record["base"]: recipe.name}.get(u["level"], u["level"])
        assert {plan.scheme_name(plan.matmuls[m]) for m in u["members"]} == {want}, u["name"]
    checkpoint = tmp_path / "checkpoint"
    # the recipe is built on the cheapest recipe a unit takes: calibrated where that one is
    assert recipe.needs_calibration == (record["base"] == "fp8-e4m3")
    calibrated = {"samples": 2} if recipe.needs_calibration else {"data": None, "samples": None}
    code, stdout, err = ptq_run(
        "quantize", tiny_model, recipe=out / "searched.yaml", o=checkpoint, quiet=None, **calibrated
    )
    assert code == 0, err
    assert "verification passed" in stdout
    groups = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    schemes = {u["level"] for u in record["units"]} - {"16-bit"}
    assert len(groups["config_groups"]) == len(schemes)  # a config group per scheme used


def test_an_interrupted_search_resumes_to_the_same_result(
    ptq_run, tiny_model, text_file, tmp_path, monkeypatch
):
    """Ctrl-C in the middle: nothing written but the state beside OUT (the configurations scored
    so far); the same command refuses to run over it, --resume continues it without scoring those
    again, and the result is the uninterrupted search's, number for number."""
    from ptq.commands.search import state_path
    from ptq.search import search

    budget = {"max_kl": "0.00005"}
    code, _, err = _search(ptq_run, tiny_model, text_file, tmp_path / "whole", **budget)
    assert code in (0, 1), err
    calls, evaluate = [], search.evaluate

    def interrupted(run, *args, **kwargs):
        calls.append(len(run.swaps))  # the configurations of this chunk
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(run, *args, **kwargs)

    monkeypatch.setattr(search, "evaluate", interrupted)
    out = tmp_path / "search"
    code, _, err = _search(ptq_run, tiny_model, text_file, out, force=None, **budget)
    assert code == 130 and "--resume" in err, err
    assert not out.exists() and state_path(out).is_file()
    code, _, err = _search(ptq_run, tiny_model, text_file, out, force=None, **budget)
    assert code == 2 and "pass --resume to continue it" in err, err
    scored = sum(calls[:2])  # the chunks scored before the interruption
    calls.clear()
    code, _, err = _search(ptq_run, tiny_model, text_file, out, force=None, resume=True, **budget)
    assert code in (0, 1), err
    assert not state_path(out).exists()
    whole = json.loads((tmp_path / "whole" / "search.json").read_text())
    resumed = json.loads((out / "search.json").read_text())
    for key in ("units", "steps", "curve", "amax_curve", "chosen", "verdict", "baselines"):
        assert resumed[key] == whole[key], key
    assert resumed["cost"]["reused"] == whole["cost"]["reused"] + scored
    assert resumed["cost"]["forwards"] < whole["cost"]["forwards"]
    code, _, err = _search(ptq_run, tiny_model, text_file, tmp_path / "new", resume=True, **budget)
    assert code == 2 and "no search to resume" in err, err


def test_an_accuracy_budget_is_the_share_of_next_token_accuracy_kept():
    """--min-accuracy-recovery P% budgets next-token accuracy: held as the accuracy it may lose
    (100 - P, % of the baseline's); a configuration meets it where its interval's upper bound on
    that loss does (the recovery's lower bound at least P); a task's accuracy is refused."""
    from ptq.commands.search import parse_budget
    from ptq.errors import PtqError
    from ptq.evaluation.evaluate import Scores
    from ptq.search.search import damage, verdict

    for given in ("99%", "next-token=99%"):
        b = parse_budget(None, None, given)
        assert b["metric"] == "acc" and b["value"] == pytest.approx(1.0)
    with pytest.raises(PtqError, match="not the accuracy of a task"):
        parse_budget(None, None, "hellaswag=99%")
    with pytest.raises(PtqError, match="give one budget"):
        parse_budget("0.01", None, "99%")
    base = Scores(tokens=400, correct=200, window_correct=[0.5, 0.4, 0.6, 0.5])
    variant = Scores(tokens=400, correct=196, window_correct=[0.49, 0.39, 0.59, 0.49])
    assert damage("acc", variant, base) == pytest.approx(2.0)  # 196 of 200 kept: 2% lost
    v = verdict("acc", 2.5, variant, base)
    assert v["value"] == pytest.approx(2.0)  # means 0.495 / 0.5 (paired windows)
    lo, hi = v["ci"]
    assert lo <= 2.0 <= hi and v["meets"] == (hi <= 2.5)
    assert not verdict("acc", 1.0, variant, base)["meets"]  # every resample loses 1.6% or more
