"""`--config-file run.toml`: every recipe's flags from a TOML file (keys: the config's field
names), the command line overriding it; a wrong key or value is one line and exit status 2."""

import dataclasses
import typing

import pytest
from _recipes import RECIPES, load_recipe

import eqxpar.recipe

NAMES = sorted(p.stem for p in RECIPES.glob("*.py"))


def other_values(config_cls) -> dict:
    """A value other than the default for every field (no checks run: any value of the type)."""
    hints = typing.get_type_hints(config_cls)
    values = {}
    for field in dataclasses.fields(config_cls):
        default, hint = field.default, hints[field.name]
        if typing.get_origin(hint) is typing.Literal:
            values[field.name] = [c for c in typing.get_args(hint) if c != default][-1]
        elif isinstance(default, bool):
            values[field.name] = not default
        elif isinstance(default, int):
            values[field.name] = default + 3
        elif isinstance(default, float):
            values[field.name] = default * 2 + 0.25
        elif default is None and float in typing.get_args(hint):  # float | None
            values[field.name] = 0.75
        elif default is None and int in typing.get_args(hint):  # int | None
            values[field.name] = 3
        else:  # str, or str | None
            values[field.name] = f"{default or 'some'}_x"
    return values


def as_toml(values: dict) -> str:
    def text(value):
        return (
            str(value).lower()
            if isinstance(value, bool)
            else repr(value)
            if isinstance(value, float)
            else (f'"{value}"' if isinstance(value, str) else str(value))
        )

    return "".join(f"{name} = {text(value)}\n" for name, value in values.items())


def as_flags(values: dict) -> list[str]:
    flags = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, str(value)]
    return flags


@pytest.mark.parametrize("name", NAMES)
def test_a_config_file_gives_the_config_its_flags_give(name, tmp_path):
    config_cls = load_recipe(name).Config
    values = other_values(config_cls)
    path = tmp_path / "run.toml"
    path.write_text(as_toml(values))
    from_file = eqxpar.recipe.parse_flags(config_cls, ["--config-file", str(path)])
    from_flags = eqxpar.recipe.parse_flags(config_cls, as_flags(values))
    assert from_file == from_flags
    assert from_file != config_cls()  # every field changed
    assert eqxpar.recipe.parse_flags(config_cls, [f"--config-file={path}"]) == from_file


def test_flags_override_the_file_and_dashes_work_as_keys(tmp_path):
    config_cls = load_recipe("hybrid_gpt").Config
    path = tmp_path / "run.toml"
    path.write_text('steps = 3\nbatch-size = 4\nlearning_rate = 1\nmesh = "data=2,model=1"\n')
    cfg = eqxpar.recipe.parse_flags(config_cls, ["--steps", "7", "--config-file", str(path)])
    assert (cfg.steps, cfg.batch_size, cfg.learning_rate, cfg.mesh) == (7, 4, 1.0, "data=2,model=1")
    assert isinstance(cfg.learning_rate, float)


@pytest.mark.parametrize(
    "text, message",
    [
        ("batch_sise = 3\n", "unknown key 'batch_sise' (did you mean 'batch_size'?)"),
        ('steps = "3"\n', "steps = '3': must be of type int"),
        ("resume = 1\n", "resume = 1: must be of type bool"),
        ("steps = [\n", "is not valid TOML"),
    ],
)
def test_a_bad_config_file_is_one_line_and_exit_2(text, message, tmp_path, capsys):
    recipe = load_recipe("data_parallel")
    path = tmp_path / "run.toml"
    path.write_text(text)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--config-file", str(path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"data_parallel.py: error: --config-file {path}") and message in err, err


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        load_recipe("three_ways").main(["--config-file", str(tmp_path / "none.toml")])
    assert stop.value.code == 2
    assert "No such file or directory" in capsys.readouterr().err
