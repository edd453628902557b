"""Choice flags are `Literal` types (`--help` lists the choices, tyro refuses others in one
line), and `--model-size` (once `--config`, which still works with a warning) names a GPT size."""

import dataclasses
import re
import typing

import pytest
from _recipes import RECIPES, load_recipe

import eqxpar.recipe
from eqxpar.models import GPT_CONFIGS, REMAT_CHOICES
from eqxpar.train import SCHEDULES

NAMES = sorted(p.stem for p in RECIPES.glob("*.py"))


def choices(config_cls) -> dict[str, tuple]:
    hints = typing.get_type_hints(config_cls)
    return {
        f.name: typing.get_args(hints[f.name])
        for f in dataclasses.fields(config_cls)
        if typing.get_origin(hints[f.name]) is typing.Literal
    }


def test_the_choices_are_the_library_s():
    gpt = choices(eqxpar.recipe.GPTFlags)
    assert gpt["model_size"] == ("custom", *GPT_CONFIGS)
    assert gpt["remat"] == REMAT_CHOICES
    assert gpt["dtype"] == ("float32", "bfloat16")
    assert choices(load_recipe("pipeline_gpt").Config)["schedule"] == tuple(SCHEDULES)
    long_context = load_recipe("long_context")
    assert choices(long_context.Config)["attention"] == long_context.MODES
    assert choices(long_context.Config)["remat"] == REMAT_CHOICES[:3]  # no offload under context parallelism


def test_the_choice_flags():
    """Where the recipes have choices: every flag whose help text used to list them by hand."""
    found = {name: sorted(choices(load_recipe(name).Config)) for name in NAMES}
    gpt = ["attention", "dtype", "model_size", "remat"]
    assert found["tensor_parallel"] == gpt
    assert found["hybrid_gpt"] == sorted([*gpt, "layout"])  # --layout mesh|auto (the planner)
    assert choices(load_recipe("hybrid_gpt").Config)["layout"] == ("mesh", "auto")
    assert found["fsdp"] == ["attention", "dtype"]
    assert found["long_context"] == ["attention", "layout", "remat"]  # --layout mesh|auto (the planner)
    assert found["pipeline_gpt"] == ["layout", "schedule"]  # --layout mesh|auto (the planner)


@pytest.mark.parametrize("name", [n for n in NAMES if n in ("hybrid_gpt", "fsdp", "long_context", "pipeline_gpt")])
def test_help_lists_the_choices(name, capsys):
    recipe = load_recipe(name)
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--help"])
    assert stop.value.code in (0, None)
    shown = re.sub(r"[\s│╭╮╰╯─]", "", capsys.readouterr().out)
    for field, options in choices(recipe.Config).items():
        assert f"--{field.replace('_', '-')}{{{','.join(options)}}}" in shown, (field, shown[:2000])


def test_config_still_sets_the_model_size_with_a_warning(capsys):
    config_cls = load_recipe("tensor_parallel").Config
    capsys.readouterr()
    old = eqxpar.recipe.parse_flags(config_cls, ["--config", "10m"])
    err = capsys.readouterr().err
    assert old == eqxpar.recipe.parse_flags(config_cls, ["--model-size", "10m"]) and old.model_size == "10m"
    assert err == "tensor_parallel.py: warning: --config is now --model-size (a named model size); --config will go\n"
    assert eqxpar.recipe.parse_flags(config_cls, ["--config=124m"]).model_size == "124m"


def test_config_is_not_renamed_where_there_is_no_model_size(capsys):
    """Recipes without a model size: `--config` is an unknown flag, as before."""
    recipe = load_recipe("data_parallel")
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--config", "10m"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "warning" not in err, err
