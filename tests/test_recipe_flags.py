"""The recipes' command line (eqxpar.recipe.parse_flags, mesh_from_flag, eqxpar.fit_mesh).

- A bad flag ends the recipe with ONE line on stderr, `<recipe>.py: error: ...`, and exit
  status 2, before JAX compiles anything. As subprocesses (one case per recipe) with
  JAX_LOG_COMPILES=1, so any compile would print more lines to stderr; in-process (more
  cases) with `jax.log_compiles` and the log records captured.
- `--help` shows every field's description (the comment after the field in the source).
- Every recipe runs on one device (`--devices 1`). (`--mesh auto` on 8 devices and
  `eqxpar.fit_mesh`: tests/test_recipe_auto_mesh.py.)
"""

import dataclasses
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest
from _budget import THOROUGH, case
from _recipes import RECIPES, load_recipe

NAMES = sorted(p.stem for p in RECIPES.glob("*.py"))
ROOT = RECIPES.parent


def run_script(args, env=None, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---- Bad flags: one line, exit 2, nothing compiled -----------------------------------------

# One case per recipe as a real process: the exit status and the whole of stderr.
PROCESS_CASES = {
    "data_loading": (["--batch-size", "-4"], "--batch-size must be at least 1, got -4"),
    "data_parallel": (["--learning-rat", "0.1"], "did you mean --learning-rate?"),
    "fsdp": (["--mesh", "fsdp=8", "--batch-size", "12"], "fsdp=8 does not divide --batch-size 12"),
    "hybrid_gpt": (["--mesh", "data=2,model=8"], "needs 16 devices but there are 8"),
    "llama": (["--kv-heads", "3"], "--heads 8 is not a multiple of --kv-heads 3"),
    "long_context": (["--attention", "flash"], "invalid choice 'flash' for argument '--attention'"),
    "moe_gpt": (["--mesh", "data=2,expert=3"], "expert=3 does not divide --experts 8; choose expert from [1, 2, 4, 8]"),
    "multihost": (["--resume"], "--resume needs --checkpoint-dir"),
    "pipeline_gpt": (["--schedule", "zigzag"], "Expected one of ('gpipe', 'circular', '1f1b')"),
    "pmap_data_parallel": (["--mesh", "data=2,model=2"], "exactly one"),
    "sharding_basics": (["--mesh", "x=2"], "exactly two axes"),
    "tensor_parallel": (["--mesh", "model=3"], "model=3 does not divide --heads 8"),
    "three_ways": (["--mesh", "x=3"], "does not divide the 32 input features"),
    "your_model": (["--mesh", "data=2,model=3"], "model=3 does not divide --heads 4"),
}


def test_every_recipe_has_its_cases():
    for table in (PROCESS_CASES, ONE_DEVICE_FLAGS):
        assert set(NAMES) <= set(table), f"recipes without an entry: {sorted(set(NAMES) - set(table))}"


@pytest.fixture(scope="module")
def bad_flag_processes():
    """Every case's process, started together (most of each is Python and JAX starting)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
    started = {
        name: subprocess.Popen(
            [sys.executable, f"recipes/{name}.py", *flags],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, (flags, _) in PROCESS_CASES.items()
        if name in NAMES
    }
    return {name: (process, *process.communicate(timeout=600)) for name, process in started.items()}


@pytest.mark.parametrize("name", NAMES)
def test_bad_flag_is_one_line_and_exit_2_before_any_compile(bad_flag_processes, name):
    _, message = PROCESS_CASES[name]
    process, _, stderr = bad_flag_processes[name]
    lines = stderr.splitlines()
    assert process.returncode == 2, stderr
    # JAX_LOG_COMPILES=1 logs every compile to stderr: one line means nothing compiled.
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{name}.py: error: ") and message in lines[0], lines[0]


# More cases, in this process: the same parse_flags -> validate -> flag_error path.
INPROCESS_CASES = [
    ("three_ways", ["--mesh", "x=2,y=2"], "exactly one axis"),
    ("three_ways", ["--mesh", "nonsense"], "is not of the form name=size"),
    ("three_ways", ["--seed", "-1"], "--seed must be at least 0"),
    ("sharding_basics", ["--mesh", "x=3,y=2"], "does not split the 4x8 array evenly"),
    ("sharding_basics", ["--devices", "two"], "Error parsing --devices"),
    ("pmap_data_parallel", ["--mesh", "data=2,model=2"], "exactly one"),
    ("pmap_data_parallel", ["--per-device-batch", "1000"], "digits training set has"),
    ("pmap_data_parallel", ["--mesh", "data=16"], "needs 16 devices but there are 8"),
    ("data_loading", ["--batch-axis", "foo"], "'foo' is not in the mesh"),
    ("data_loading", ["--mesh", "data=8", "--batch-size", "12"], "cannot be split evenly"),
    ("data_parallel", ["--mesh", "data=8", "--batch-size", "100"], "data=8 does not divide --batch-size 100"),
    ("data_parallel", ["--mesh", "data=4", "--batch-size", "32", "--grad-accum", "16"], "data=4 does not divide"),
    ("data_parallel", ["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
    ("data_parallel", ["--batch-size", "64", "--grad-accum", "3"], "not divisible by --grad-accum 3"),
    ("data_parallel", ["--steps", "-1"], "--steps must be at least 1, got -1"),
    ("data_parallel", ["--mesh", "model=8"], "axes 'data'"),
    ("data_parallel", ["--resume"], "--resume needs --checkpoint-dir"),
    ("multihost", ["--mesh", "data=3"], "data=3 does not divide --batch-size 128"),
    ("multihost", ["--width", "0"], "--width must be at least 1"),
    ("tensor_parallel", ["--mesh", "data=8"], "axes 'model'"),
    ("tensor_parallel", ["--dim", "60"], "--dim 60 is not divisible by --heads 8"),
    ("tensor_parallel", ["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    # Choice flags are Literal types: tyro refuses other values, naming the choices.
    (
        "tensor_parallel",
        ["--dtype", "float16"],
        "invalid choice 'float16' for argument '--dtype'. Expected one of ('float32', 'bfloat16')",
    ),
    ("tensor_parallel", ["--attention", "flash"], "Expected one of ('dot_product', 'reference')"),
    ("tensor_parallel", ["--remat", "all"], "Expected one of ('none', 'block', 'save_matmuls', 'offload')"),
    (
        "long_context",
        ["--remat", "offload"],
        "invalid choice 'offload' for argument '--remat'. Expected one of ('none', 'block', 'save_matmuls')",
    ),
    ("tensor_parallel", ["--model-size", "7b"], "Expected one of ('custom', '10m', '124m', '1.3b')"),
    ("tensor_parallel", ["--model-size", "10m", "--mesh", "model=4"], "model=4 does not divide --heads 6"),
    ("fsdp", ["--dtype", "float16"], "Expected one of ('float32', 'bfloat16')"),
    ("tensor_parallel", ["--scan-layers", "yes"], "Unrecognized options: yes"),
    ("hybrid_gpt", ["--dtype", "fp8"], "invalid choice 'fp8' for argument '--dtype'"),
    ("hybrid_gpt", ["--mesh", "data=8"], "axes 'data' and 'model'"),
    ("hybrid_gpt", ["--mesh", "data=4,model=2", "--batch-size", "6"], "data=4 does not divide --batch-size 6"),
    ("hybrid_gpt", ["--mesh", "data=1,model=3"], "model=3 does not divide --heads 8"),
    ("hybrid_gpt", ["--resume"], "--resume needs --checkpoint-dir"),
    ("hybrid_gpt", ["--steps"], "Missing value for argument '--steps'"),
    (
        "long_context",
        ["--layout", "auto", "--mesh", "data=2,context=2,model=2"],
        "--layout auto chooses the mesh itself: drop --mesh data=2,context=2,model=2",
    ),
    ("fsdp", ["--mesh", "data=8"], "axes 'fsdp', optionally 'model'"),
    ("fsdp", ["--remat", "yes"], "Unrecognized options: yes"),
    ("fsdp", ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
]


def compile_messages(caplog):
    return [r.getMessage() for r in caplog.records if re.match(r"Compiling|Finished tracing", r.getMessage())]


@pytest.mark.parametrize("name, flags, message", INPROCESS_CASES)
def test_bad_flags_in_process(name, flags, message, capsys, caplog):
    recipe = load_recipe(name)
    capsys.readouterr()
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True), pytest.raises(SystemExit) as stop:
        recipe.main(flags)
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"{name}.py: error: ") and message in err, err
    assert compile_messages(caplog) == []


def test_the_compile_check_sees_compiles(caplog):
    """The in-process check above can fail: something that compiles is seen."""
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(5.0))
    assert compile_messages(caplog)


# ---- --help --------------------------------------------------------------------------------


def field_comments(config_cls) -> dict[str, str]:
    """Each field's comment in the source (`name: type = default  # comment`), base classes too."""
    comments = {}
    for cls in reversed(config_cls.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        for line in inspect.getsource(cls).splitlines():
            found = re.match(r"\s+(\w+): [^=]+= .*?  # (.+)$", line)
            if found:
                comments[found.group(1)] = found.group(2)
    return comments


@pytest.mark.parametrize("name", NAMES)
def test_help_describes_every_flag(name, capsys):
    recipe = load_recipe(name)
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--help"])
    assert stop.value.code in (0, None)
    shown = re.sub(r"[\s│╭╮╰╯─]", "", capsys.readouterr().out)  # unwrapped, box drawing gone
    comments = field_comments(recipe.Config)
    for field in dataclasses.fields(recipe.Config):
        assert field.name in comments, f"{name}: field {field.name} has no description"
        flag = "--" + field.name.replace("_", "-")
        assert flag in shown, f"{name}: {flag} missing from --help"
        assert re.sub(r"\s", "", comments[field.name]) in shown, f"{name}: {flag}'s description missing"


# ---- Every recipe on one device ------------------------------------------------------------

# Small settings: what is tested is that the default (auto) mesh fits one device.
ONE_DEVICE_FLAGS = {
    "data_loading": ["--steps", "1", "--batch-size", "8"],
    "data_parallel": ["--steps", "2", "--batch-size", "16", "--width", "16"],
    "fsdp": ["--steps", "2", "--batch-size", "2", "--context", "8", "--dim", "16", "--heads", "2", "--layers", "1"],
    "hybrid_gpt": [
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--context",
        "8",
        "--dim",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--sample-chars",
        "0",
    ],
    "llama": ["--steps", "2", "--batch-size", "2", "--context", "8", "--dim", "16", "--layers", "1"],
    "long_context": [
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--dim",
        "8",
        "--heads",
        "2",
        "--layers",
        "1",
    ],
    "moe_gpt": ["--steps", "1", "--batch-size", "2", "--context", "8", "--dim", "16", "--heads", "2", "--layers", "1"],
    "multihost": ["--steps", "2", "--batch-size", "16", "--width", "16"],
    "pipeline_gpt": [
        "--steps",
        "1",
        "--batch-size",
        "4",
        "--microbatches",
        "2",
        "--context",
        "8",
        "--dim",
        "16",
        "--heads",
        "2",
        "--layers",
        "2",
    ],
    "pmap_data_parallel": ["--per-device-batch", "4"],
    "sharding_basics": [],
    "tensor_parallel": [
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--context",
        "8",
        "--dim",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--sample-chars",
        "0",
    ],
    "three_ways": [],
    "your_model": [
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--context",
        "8",
        "--dim",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
    ],
}
ONE_DEVICE_MESH = {
    "data_loading": "data=1,model=1",
    "data_parallel": "data=1",
    "fsdp": "fsdp=1,model=1",
    "hybrid_gpt": "data=1,model=1",
    "llama": "data=1,model=1",
    "long_context": "data=1,context=1,model=1",
    "moe_gpt": "data=1,expert=1,model=1",
    "pipeline_gpt": "stage=1,data=1,model=1",
    "pmap_data_parallel": {"data": 1},
    "sharding_basics": {"x": 1, "y": 1},
    "tensor_parallel": "model=1",
    "three_ways": {"x": 1},
    "your_model": "data=1,model=1",
}

# All recipes in one process (one JAX start-up) on one simulated device.
ONE_DEVICE_SCRIPT = textwrap.dedent(
    """
    import json, sys, traceback
    sys.path.insert(0, "tests")
    import eqxpar
    eqxpar.simulate_cpu_devices(1)
    from _recipes import load_recipe
    runs, out = json.loads(sys.argv[1]), sys.argv[2]
    results = {}
    for name, flags in runs.items():
        try:
            metrics = load_recipe(name).main([*flags, "--devices", "1"])
            results[name] = {"ok": True, "mesh": metrics.get("mesh"), "devices": metrics.get("devices")}
        except BaseException as error:  # noqa: BLE001 - reported per recipe
            results[name] = {"ok": False, "error": "".join(traceback.format_exception(error))[-3000:]}
    json.dump(results, open(out, "w"))
    """
)


# your_model's one-device run (its two parts, the parity check and the dense comparison: 25
# of this fixture's 48 s on the CI machine's two cores) runs under HYPOTHESIS_PROFILE=thorough;
# tests/test_your_model_recipe.py runs that recipe by default, and every other recipe here
# shows that `--devices 1` reaches the recipes' shared mesh and flag code.
# llama: tests/test_llama_recipe.py runs it on one device by default.
ONE_DEVICE_DEFAULT = [name for name in NAMES if THOROUGH or name not in ("your_model", "llama")]


@pytest.fixture(scope="module")
def one_device_runs(tmp_path_factory):
    runs = {name: ONE_DEVICE_FLAGS[name] for name in ONE_DEVICE_DEFAULT}
    out = tmp_path_factory.mktemp("one_device") / "results.json"
    done = run_script(["-c", ONE_DEVICE_SCRIPT, json.dumps(runs), str(out)], env={"JAX_LOG_COMPILES": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    # The subprocess cases above rely on JAX_LOG_COMPILES=1 printing compiles to stderr.
    assert "Compiling" in done.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", [case(name, default=name in ONE_DEVICE_DEFAULT) for name in NAMES])
def test_every_recipe_runs_on_one_device(one_device_runs, name):
    result = one_device_runs[name]
    assert result["ok"], result["error"]
    if name == "multihost":
        assert result["devices"] == 1
    else:
        assert result["mesh"] == ONE_DEVICE_MESH[name]
