import pytest
import torch
import yaml

from ptq.errors import PtqError
from ptq.numerics.formats import FORMATS
from ptq.numerics.granularity import PerChannel, PerTensor
from ptq.quantization.recipes import builtin_recipe_names, load_recipe, parse_recipe

VALID = {"name": "x", "weights": {"format": "e4m3"}, "inputs": {"format": "e4m3"}}


def test_builtin_recipes_load_with_the_documented_formats():
    assert set(builtin_recipe_names()) >= {"bf16", "fp8-e4m3", "fp8-e5m2", "int8"}
    bf16, e4m3, e5m2, int8 = (load_recipe(n) for n in ("bf16", "fp8-e4m3", "fp8-e5m2", "int8"))
    assert (
        bf16.weights.format is FORMATS["bf16"] and not bf16.needs_calibration and bf16.ignore == ()
    )
    assert (
        e4m3.inputs.format is FORMATS["e4m3"]
        and e4m3.needs_calibration
        and e4m3.ignore == ("lm_head",)
    )
    assert e5m2.weights.format is FORMATS["e5m2"]
    assert int8.weights.granularity == PerChannel() and int8.inputs.granularity == PerTensor()
    assert (
        bf16.weights.saturate is False and e4m3.weights.saturate is True
    )  # 16-bit overflows like an IEEE cast
    assert all(
        load_recipe(n).name == n for n in builtin_recipe_names()
    )  # every shipped recipe validates
    assert (
        load_recipe("int8-smoothquant").smoothquant
        == load_recipe("paper-int8-smoothquant").smoothquant
        == 0.85
    )


def test_recipe_from_a_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(VALID | {"ignore": ["lm_head", "*.down_proj"]}))
    recipe = load_recipe(str(path))
    assert recipe.name == "x" and recipe.ignore == ("lm_head", "*.down_proj")
    assert recipe.targets_module("model.layers.0.mlp.up_proj", torch.nn.Linear(2, 2))
    assert not recipe.targets_module("model.layers.0.mlp.down_proj", torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"colour": "red"}, "unknown key 'colour'"),
        ({"weights": {"format": "e3m4"}}, "unknown number format 'e3m4'"),
        # said once where ("recipe x: 'weights': recipe x: 'weights'.format must be ...")
        (
            {"weights": {"format": ["e4m3"]}},
            r"^recipe <recipe>: 'weights'.format must be a non-empty string, not",
        ),
        ({"weights": {"format": "e4m3", "granularity": "row"}}, "unknown granularity 'row'"),
        (
            {"inputs": {"format": "e4m3", "granularity": "channel"}},
            "per-channel scales apply to weights only",
        ),
        ({"inputs": {"format": "e4m3", "saturate": "yes"}}, "saturate must be true or false"),
        ({"targets": ["Conv2d"]}, "unknown target type 'Conv2d'"),
        ({"ignore": "lm_head"}, "'ignore' must be a list of strings"),
        ({"weights": {"format": "e4m3", "scales": 2}}, "unknown key 'scales'"),
        ({"weights": {"format": "e4m3", "scale": 2}}, "unknown scale '2'"),
        ({"inputs": {"format": "e4m3", "observer": "minmax"}}, "unknown observer 'minmax'"),
        ({"weights": {"format": "e4m3", "observer": "mse"}}, "weights use max calibration"),
        (
            {"inputs": {"format": "e4m3", "observer": "percentile", "percentile": 101}},
            "percentile must be a number in",
        ),
        (
            {"inputs": {"format": "e4m3", "observer": "mse", "percentile": 99.9}},
            "'percentile' applies to observer",
        ),
        ({"inputs": {"format": "e4m3", "dynamic": "yes"}}, "dynamic must be true or false"),
        (
            {"weights": {"format": "e4m3", "dynamic": True}},
            "dynamic .per-token. scales apply to activations",
        ),
        (
            {"inputs": {"format": "e4m3", "dynamic": True, "scale": "unscaled"}},
            "neither 'dynamic' nor an observer",
        ),
        ({"inputs": {"format": "bf16", "scale": "pow2"}}, "bf16 is not scaled"),
        ({"inputs": {"format": "bf16", "dynamic": True}}, "bf16 is not scaled, so 'dynamic'"),
        ({"attention": {"format": "fp16", "dynamic": True}}, "fp16 is not scaled, so 'dynamic'"),
        ({"inputs": {"format": "int8", "saturate": False}}, "int8 always clamps to its range"),
        ({"weights": {"format": "int8", "saturate": True}}, "int8 always clamps to its range"),
        (
            {"attention": {"format": "e4m3", "tensors": ["query", "scores"]}},
            "unknown attention tensor 'scores'",
        ),
        (
            {"attention": {"format": "e4m3", "granularity": "channel"}},
            "per-channel scales apply to weights only",
        ),
        ({"kv_cache": {"format": "e4m3", "colour": 1}}, "unknown key 'colour'"),
        ({"smoothquant": {"alpha": 1.5}}, "alpha must be a number in"),
        # PyYAML reads 1e-3 (no decimal point) as a string: the message says how to write it
        (
            {"inputs": {"format": "e4m3", "observer": "percentile", "percentile": "9.999e1"}},
            r"not '9.999e1' \(YAML reads 9.999e1 as text: write it as 99.99\)$",
        ),
        (
            {"smoothquant": {"alpha": "5e-1"}},
            r"not '5e-1' \(YAML reads 5e-1 as text: write it as 0.5\)$",
        ),
        ({"smoothquant": {"beta": 0.5}}, "unknown key 'beta'"),
        (
            {"smoothquant": {"alpha": 0.5}, "inputs": {"format": "int8", "observer": "mse"}},
            "smoothquant needs static inputs",
        ),
        ({"include": "model.*"}, "'include' must be a list of strings"),
        (
            {"targets": []},
            "'targets' is empty: it would select nothing",
        ),  # used to give a variant that is the baseline
        ({"include": []}, "'include' is empty: it would select nothing"),
        ({"attention": {"format": "e4m3", "tensors": []}}, "'attention.tensors' is empty"),
        # numbers no tensor can meet: refused before any model is read (issue #45)
        (
            {"weights": {"format": "e4m3", "granularity": "block", "block_size": [10**9, 10**9]}},
            r"block_size \[1000000000, 1000000000\] is larger than any tensor's dimension",
        ),
        (
            {"weights": {"format": "e4m3", "granularity": "block", "block_size": [128, 2**40]}},
            "block_size .* is larger than any tensor's dimension",
        ),
        (
            {"weights": {"format": "e4m3", "granularity": "group", "group_size": 2**20 + 1}},
            "group_size 1048577 is larger than any tensor's dimension",
        ),
        (
            {"weights": {"format": "e4m3", "granularity": "group", "group_size": -8}},
            "needs 'group_size', a positive integer",
        ),
        (
            {"weights": {"format": "e4m3", "granularity": "block", "block_size": [0, 128]}},
            "needs 'block_size', two positive integers",
        ),
        (
            {"inputs": {"format": "e4m3", "observer": "percentile", "percentile": float("nan")}},
            "percentile must be a number in",
        ),
        (
            {"inputs": {"format": "e4m3", "observer": "percentile", "percentile": 0}},
            "percentile must be a number in",
        ),
        ({"smoothquant": {"alpha": -0.1}}, "alpha must be a number in"),
        ({"smoothquant": {"alpha": float("nan")}}, "alpha must be a number in"),
    ],
)
def test_invalid_recipes_name_the_problem(change, message):
    with pytest.raises(PtqError, match=message):
        parse_recipe(VALID | change)


def test_missing_key_and_non_mapping():
    with pytest.raises(PtqError, match="missing key 'inputs'"):
        parse_recipe({"name": "x", "weights": {"format": "e4m3"}})
    with pytest.raises(PtqError, match="must be a mapping"):
        parse_recipe(["name", "x"])


def test_unknown_name_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(PtqError, match="unknown recipe 'fp7'.*built-in: bf16"):
        load_recipe("fp7")
    with pytest.raises(
        PtqError,
        match=r"'fp8-e4m3,int8' names several recipes: this command takes one \(`ptq compare",
    ):
        load_recipe(
            "fp8-e4m3,int8"
        )  # eval's and quantize's --recipe: it was "unknown recipe 'fp8-e4m3,int8'"
    with pytest.raises(PtqError, match="does not exist"):
        load_recipe(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndescription: [unclosed\n")
    with pytest.raises(
        PtqError, match=r"bad.yaml, line 3, column 1: not valid YAML: expected ',' or ']'"
    ):
        load_recipe(str(bad))
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(
        PtqError, match="line 1, column 1: not valid YAML: could not determine a constructor"
    ):
        load_recipe(str(unsafe))  # safe loading refuses Python tags


@pytest.mark.parametrize("name", ["fp8|static", "fp8\nstatic"])
def test_a_recipe_name_that_cannot_name_a_table_row_is_refused(name):
    with pytest.raises(
        PtqError, match=r"recipe <recipe>: 'name' .* holds .*: a name is one line without '\|'"
    ):
        parse_recipe({"name": name, "weights": {"format": "e4m3"}, "inputs": {"format": "e4m3"}})


@pytest.mark.parametrize(
    "text, where",
    [
        (
            "name: x\nweights: {format: e4m3}\ninputs: {format: e4m3}\nweights: {format: int8}\n",
            "line 4, column 1",
        ),
        (
            "name: x\nweights: {format: e4m3, format: int8}\ninputs: {format: e4m3}\n",
            "line 2, column 25",
        ),
    ],
)
def test_a_key_given_twice_is_refused_where_yaml_would_keep_the_last(tmp_path, text, where):
    import yaml

    assert yaml.safe_load(text)["weights"] == {
        "format": "int8"
    }  # what PyYAML alone would quantize by
    # a key that overrides a merged one (`<<: *anchor`) is not given twice: YAML's merge is for that
    merged = tmp_path / "merged.yaml"
    merged.write_text(
        "name: x\nbase: &b {format: e4m3, granularity: tensor}\nweights:\n  <<: *b\n  granularity: channel\n"
        "inputs: {format: e4m3}\n"
    )
    with pytest.raises(
        PtqError, match="unknown key 'base'"
    ):  # read as YAML: the recipe check speaks, not the reader
        load_recipe(str(merged))
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    key = "weights" if where.startswith("line 4") else "format"
    with pytest.raises(
        PtqError, match=rf"twice.yaml, {where}: not valid YAML: '{key}' given twice \(first on line"
    ):
        load_recipe(str(path))


@pytest.mark.parametrize(
    "text, where",
    [
        (
            "name: x\nweights: {format: e4m3}\ninputs: {format: e4m3}\n[1, 2]: 3\n",
            "line 4, column 1",
        ),
        (
            "name: x\nweights: {format: e4m3, ? {a: 1} : 1}\ninputs: {format: e4m3}\n",
            "line 2, column 27",
        ),
    ],
)
def test_a_list_or_mapping_as_a_key_is_one_line_not_a_traceback(tmp_path, text, where):
    # the check for keys given twice looked each key up in a dict: "TypeError: unhashable type: 'list'"
    path = tmp_path / "key.yaml"
    path.write_text(text)
    with pytest.raises(
        PtqError, match=rf"key.yaml, {where}: not valid YAML: found unhashable key$"
    ):
        load_recipe(str(path))


def test_a_builtin_name_is_not_shadowed_by_a_file_or_folder_of_that_name(tmp_path, monkeypatch):
    # `ptq quantize smollm2 --recipe int8 -o int8` makes a folder `int8`: `--recipe int8` in that folder then read
    # the folder as a recipe file ("recipe file int8 does not exist"), and a stray file `fp8-e4m3` as YAML
    monkeypatch.chdir(tmp_path)
    (tmp_path / "int8").mkdir()
    (tmp_path / "fp8-e4m3").write_text("name: mine\n")
    assert load_recipe("int8").weights.format is FORMATS["int8"] and load_recipe(
        "int8"
    ).source.endswith("int8.yaml")
    assert (
        load_recipe("fp8-e4m3").name == "fp8-e4m3"
        and load_recipe("fp8-e4m3+kv").kv_cache is not None
    )
    with pytest.raises(PtqError, match="recipe fp8-e4m3: missing key"):  # a path, written as one
        load_recipe("./fp8-e4m3")
    (tmp_path / "mine").write_text(
        yaml.safe_dump(VALID)
    )  # a name that is no built-in: the file, as before
    assert load_recipe("mine").name == "x"
    with pytest.raises(PtqError, match="int8 is a folder, not a recipe file"):
        load_recipe("./int8")


def test_new_keys_parse_and_describe():
    recipe = parse_recipe(
        VALID
        | {
            "inputs": {"format": "e4m3", "observer": "best", "percentile": 99.9},
            "attention": {"format": "e4m3", "observer": "percentile", "tensors": ["query", "key"]},
            "kv_cache": {"format": "e4m3", "scale": "pow2"},
            "include": ["model.layers.*"],
            "ignore": ["model.layers.0.*"],
        }
    )
    assert (
        recipe.inputs.observer == "best"
        and recipe.inputs.percentile == 99.9
        and recipe.inputs.static
    )
    assert recipe.attention_tensors == ("query", "key") and recipe.kv_cache.scale == "pow2"
    assert recipe.inputs.describe() == "e4m3 per-tensor best"
    assert recipe.attention.describe() == "e4m3 per-tensor percentile 99.99"
    assert recipe.selects("model.layers.1.self_attn.query") and not recipe.selects(
        "model.layers.0.mlp.up_proj"
    )
    assert not recipe.selects("lm_head")
    dynamic = parse_recipe(VALID | {"inputs": {"format": "e4m3", "dynamic": True}})
    assert not dynamic.inputs.static and not dynamic.needs_calibration
    assert dynamic.inputs.describe() == "e4m3 per-token dynamic"
    unscaled = parse_recipe(VALID | {"inputs": {"format": "e4m3", "scale": "unscaled"}})
    assert not unscaled.inputs.static and unscaled.inputs.describe() == "e4m3 unscaled"
    assert parse_recipe(VALID | {"smoothquant": {"alpha": 0.5}}).smoothquant == 0.5


def test_sensitivity_examples_each_quantize_one_kind_of_tensor(tiny_model):
    """examples/sensitivity (docs/paper.md): each recipe puts exactly one kind of tensor in E4M3."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from ptq.quantization.plan import resolve_plan

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    expected = {
        "only-weights": ("weights", linears),
        "only-qkv-input": ("inputs", {"q_proj", "k_proj", "v_proj"}),
        "only-o-input": ("inputs", {"o_proj"}),
        "only-gate-up-input": ("inputs", {"gate_proj", "up_proj"}),
        "only-down-input": ("inputs", {"down_proj"}),
        **{f"only-{t}": ("inputs", {t}) for t in ("query", "key", "value", "probs")},
    }
    paths = sorted((Path(__file__).parent.parent / "examples" / "sensitivity").glob("*.yaml"))
    assert sorted(p.stem for p in paths) == sorted(expected)
    is_e4m3 = lambda text: "e4m3" in (text or "").lower()  # noqa: E731
    for path in paths:
        rows = resolve_plan(model, load_recipe(str(path))).rows()
        weights = {r["name"].rsplit(".", 1)[-1] for r in rows if is_e4m3(r["weights"])}
        inputs = {r["name"].rsplit(".", 1)[-1] for r in rows if is_e4m3(r["inputs"])}
        part, names = expected[path.stem]
        assert (weights, inputs) == ((names, set()) if part == "weights" else (set(), names)), (
            path.name
        )


def test_targets_default_to_every_matmul_kind_and_smoothquant_leaves_experts_out():
    base = {"name": "r", "weights": {"format": "int8"}, "inputs": {"format": "int8"}}
    assert parse_recipe(base).targets == ("Linear", "Conv1D", "Experts")
    smooth = base | {"smoothquant": {"alpha": 0.5}}
    assert parse_recipe(smooth).targets == ("Linear", "Conv1D")
    with pytest.raises(PtqError, match="smoothquant applies to Linear and Conv1D"):
        parse_recipe(smooth | {"targets": ["Linear", "Experts"]})
    with pytest.raises(PtqError, match="unknown target type 'Conv2D'"):
        parse_recipe(base | {"targets": ["Conv2D"]})


HUGE_BLOCK = (
    "name: huge\nweights: {format: e4m3, granularity: block, block_size: [%d, 64]}\n"
    "inputs: {format: e4m3, dynamic: true}\n"
)
# as vLLM serves blocks (fp8-block): square, with input groups of their size
HUGE_SQUARE = (
    "name: huge\nweights: {format: e4m3, granularity: block, block_size: [%d, %d]}\n"
    "inputs: {format: e4m3, granularity: group, group_size: %d, dynamic: true}\n"
)


@pytest.mark.parametrize("command", ["inspect", "calibrate", "quantize", "eval", "compare"])
def test_a_block_no_tensor_of_the_model_can_have_is_refused_by_every_command(
    tiny_model, tmp_path, ptq_run, command
):
    """A block (or group) larger than every dimension of the model's tensors passed the recipe
    check and inspect, then padded each weight to it: refused where the recipe meets the model
    (plan.check_granules), one line, exit 2, inspect too."""
    from test_faults import one_error_line

    recipe = tmp_path / "huge.yaml"
    text = HUGE_SQUARE % ((2**20,) * 3) if command == "quantize" else HUGE_BLOCK % 2**20
    # calibrate needs an input to calibrate
    recipe.write_text(text.replace(", dynamic: true", "") if command == "calibrate" else text)
    flags = {
        "inspect": {"recipe": recipe},
        "calibrate": {"recipe": recipe, "o": tmp_path / "c.st"},
        "quantize": {"recipe": recipe, "o": tmp_path / "q", "data": None, "samples": None},
        "eval": {"recipe": recipe, "out": tmp_path / "e"},
        "compare": {
            "recipes": recipe,
            "out": tmp_path / "r",
            "calib_data": None,
            "calib_samples": None,
        },
    }[command]
    code, _, err = ptq_run(command, tiny_model, **flags)
    assert code == 2 and one_error_line(err), err
    assert "recipe 'huge': weights per-block-1048576x" in err
    assert "is larger than every dimension of the model's tensors (the largest: " in err


def test_a_block_that_pads_a_weight_to_many_times_its_size_is_refused(tiny_model, monkeypatch):
    """Within the model's dimensions, a block can still pad a small weight to many times its size
    (a vocabulary-high block on a 2-head k_proj): refused, naming the layer, before allocating."""
    from ptq.models.loading import load_model
    from ptq.quantization import plan

    model = load_model(str(tiny_model)).model
    # the tiny model's weights are all small, and its largest dimension (the vocabulary) 300
    monkeypatch.setattr(plan, "PAD_FLOOR", 1024)
    monkeypatch.setattr(plan, "PAD_FACTOR", 4)
    recipe = parse_recipe(yaml.safe_load(HUGE_BLOCK % 256))
    with pytest.raises(
        PtqError, match=r"pads the weight of layer 'model.layers.0.self_attn.k_proj"
    ):
        plan.resolve_plan(model, recipe)
    # the usual 128 x 128 block pads the tiny model's weights a few times: fine
    plan.resolve_plan(model, load_recipe("fp8-block"))


MIXED = {
    "name": "mixed",
    "targets": ["Linear"],
    "weights": {"format": "e4m3", "granularity": "tensor"},
    "inputs": {"format": "e4m3", "granularity": "tensor"},
    "overrides": [
        {"match": ["model.layers.0.mlp.*"], "keep": "bf16"},
        {"match": ["model.layers.1.mlp.*"], "scheme": "fp8-dynamic"},
        {
            "match": ["model.layers.1.self_attn.o_proj"],
            "weights": {"format": "e4m3", "granularity": "channel"},
            "inputs": {"format": "e4m3", "granularity": "token", "dynamic": True},
        },
        {"match": ["model.layers.0.self_attn.o_proj"], "scheme": "fp8-block"},
    ],
}


def test_overrides_parse_into_schemes_and_bf16():
    r = parse_recipe(MIXED)
    assert [o.number for o in r.overrides] == [1, 2, 3, 4] and r.overrides[0].keep
    # the inline override is fp8-dynamic's scheme: one scheme, named after the recipe that gave it
    assert [s.name for s in r.schemes] == ["mixed", "fp8-dynamic", "fp8-block"]
    assert r.scheme_index(r.overrides[2]) == r.scheme_index(r.overrides[1]) == 1
    assert r.override_for("model.layers.1.mlp.up_proj").number == 2
    assert r.override_for("model.layers.1.self_attn.q_proj") is None
    assert r.needs_calibration  # the recipe's own static inputs
    dynamic = {
        **MIXED,
        "inputs": {"format": "e4m3", "dynamic": True},
        "overrides": MIXED["overrides"][:3],
    }
    assert not parse_recipe(dynamic).needs_calibration
    static = {**dynamic, "overrides": [{"match": ["*"], "scheme": "fp8-e4m3"}]}
    assert parse_recipe(static).needs_calibration  # the override's static inputs


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"match": ["*"]}, "overrides' must be a list"),
        ([{"keep": "bf16"}], "entry 1: missing key 'match'"),
        ([{"match": [], "keep": "bf16"}], "entry 1: 'match' is empty"),
        ([{"match": ["*"], "keep": "fp16"}], "'keep' must be bf16"),
        ([{"match": ["*"], "keep": "bf16", "scheme": "int8"}], "not scheme + keep"),
        ([{"match": ["*"], "weights": {"format": "e4m3"}}], "not weights"),
        ([{"match": ["*"]}], "not none of them"),
        ([{"match": ["*"], "scheme": "nope"}], "entry 1: 'scheme': unknown recipe 'nope'"),
        ([{"match": ["*"], "scheme": "bf16"}], "quantizes nothing: write 'keep: bf16'"),
        ([{"match": ["*"], "scheme": "fp8-e4m3+kv"}], "also sets kv_cache"),
        ([{"match": ["*"], "scheme": "int8-smoothquant"}], "also sets smoothquant"),
        (
            [
                {
                    "match": ["*"],
                    "weights": {"format": "e4m3"},
                    "inputs": {"format": "e4m3", "granularity": "channel"},
                }
            ],
            "entry 1: 'inputs': per-channel scales apply to weights only",
        ),
        ([{"match": ["*"], "keep": "bf16", "colour": 1}], "unknown key 'colour'"),
    ],
)
def test_overrides_are_validated_in_one_line(overrides, message):
    with pytest.raises(PtqError, match="recipe <recipe>") as e:
        parse_recipe({**VALID, "overrides": overrides})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_overrides_do_not_combine_with_smoothquant():
    data = {**VALID, "smoothquant": {"alpha": 0.5}, "overrides": [{"match": ["*"], "keep": "bf16"}]}
    with pytest.raises(PtqError, match="'overrides' and 'smoothquant' do not combine"):
        parse_recipe(data)


def test_an_override_scheme_may_be_a_recipe_file_next_to_the_recipe(tmp_path):
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({**VALID, "name": "mine"}))
    path = tmp_path / "mixed.yaml"
    path.write_text(
        yaml.safe_dump({**VALID, "overrides": [{"match": ["*"], "scheme": "mine.yaml"}]})
    )
    assert load_recipe(str(path)).overrides[0].scheme == "mine"


def test_the_plan_gives_each_matmul_its_overrides_scheme(tiny_model):
    from transformers import AutoModelForCausalLM

    from ptq.quantization.plan import resolve_plan

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    plan = resolve_plan(model, parse_recipe(MIXED), target="vllm")
    m = plan.matmuls
    assert not m["model.layers.0.mlp.up_proj"].quantized
    assert "kept in bf16 by the recipe's override 1 (match: model.layers.0.mlp.*)" == (
        m["model.layers.0.mlp.up_proj"].reason
    )
    assert m["model.layers.1.mlp.up_proj"].weights.granularity == PerChannel()
    assert (
        m["model.layers.1.mlp.up_proj"].inputs.dynamic
        and m["model.layers.1.mlp.up_proj"].scheme == 1
    )
    assert m["model.layers.0.self_attn.o_proj"].scheme == 2
    assert m["model.layers.0.self_attn.q_proj"].weights.granularity == PerTensor()
    # vLLM's shared q/k/v weight scale still holds for the recipe's own scheme
    assert len(m["model.layers.0.self_attn.q_proj"].weight_group) == 3
    # calibration observes the static inputs only
    assert "model.layers.1.mlp.up_proj" not in plan.calibrated
    assert "model.layers.0.self_attn.q_proj" in plan.calibrated
    rows = {r["name"]: r for r in plan.rows()}
    assert rows["model.layers.1.mlp.up_proj"]["scheme"] == "fp8-dynamic"
    assert rows["model.layers.0.mlp.up_proj"]["scheme"] == "bf16"
    assert "override 1" in plan.left_out_reasons()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [{"match": ["*.q_proj"], "scheme": "fp8-dynamic"}],
            "its overrides give 'model.layers.0.self_attn.q_proj' e4m3 per-channel weights",
        ),
        (
            [{"match": ["*.gate_proj"], "keep": "bf16"}],
            "vLLM serves gate_proj/up_proj as one layer",
        ),
        (
            [{"match": ["*.mlp.*", "*.nothing"], "keep": "bf16"}],
            "override 1 (match: *.mlp.*, *.nothing): '*.nothing' matches no layer",
        ),
        ([{"match": ["lm_head"], "scheme": "fp8-dynamic"}], "'lm_head' matches no layer"),
        (
            [
                {"match": ["*.mlp.*"], "keep": "bf16"},
                {"match": ["*.layers.0.mlp.*"], "keep": "bf16"},
            ],
            "override 2 (match: *.layers.0.mlp.*) takes no layer",
        ),
    ],
)
def test_overrides_the_model_cannot_take_are_refused_with_the_plan(tiny_model, overrides, message):
    from transformers import AutoModelForCausalLM

    from ptq.quantization.plan import resolve_plan

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    recipe = parse_recipe({**VALID, "overrides": overrides})
    with pytest.raises(PtqError, match="recipe 'x'") as e:
        resolve_plan(model, recipe, target="transformers")
    assert message in str(e.value) and "\n" not in str(e.value)
