"""Ordinary inputs that used to crash, and bad inputs that used to end in a raw JAX error
(issue 27): each now runs, or gets a ValueError naming the problem and the fix, raised
before anything compiles."""

import jax
from _recipes import run_recipe as _run_recipe

import eqxpar.recipe


def run_recipe(*args):
    """A recipe runs with JAX's default promotion rules, as a user runs it (the suite's
    conftest makes implicit promotion raise, for the library's own code)."""
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        return _run_recipe(*args)


# A small GPT: one layer, 16 characters of context, 8 sequences per step.
GPT_FLAGS = ("--layers", "1", "--dim", "32", "--context", "16", "--batch-size", "8")


# -- 1. recipes: any --steps >= 1, and --resume of a finished run -------------------------


def test_speed_metrics_of_a_run_that_timed_no_step_are_null():
    speed = eqxpar.recipe.speed_metrics(float("nan"), 1000.0, 8, "float32")
    assert speed == {"tokens_per_second": None, "flops_per_token": 1000.0, "flops_per_second": None, "mfu": None}
    assert "2 or more steps" in eqxpar.recipe.speed_text(speed)
    timed = eqxpar.recipe.speed_metrics(2000.0, 1000.0, 8, "float32")
    assert eqxpar.recipe.speed_text(timed) == "2,000 tokens/s, 0.0 GFLOP/s"  # CPU: no MFU


def test_steps_to_run_says_when_a_resumed_run_has_nothing_left(capsys):
    assert eqxpar.recipe.steps_to_run(0, 3) == range(3)
    assert capsys.readouterr().out == ""
    assert eqxpar.recipe.steps_to_run(3, 3) == range(3, 3)
    out = capsys.readouterr().out
    assert "nothing left to do" in out and "step 3" in out and "--steps 3" in out


def test_fsdp_recipe_runs_one_step_and_resumes_a_finished_run(tmp_path, capsys):
    """`--steps 1` and `--resume` of a finished run both used to exit with `mfu:
    tokens_per_second must be a non-negative number, got nan` (no step was timed)."""
    flags = (*GPT_FLAGS, "--mesh", "fsdp=8", "--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    one = run_recipe("fsdp", tmp_path, *flags)
    assert one["steps"] == 1 and one["tokens_per_second"] is None and one["mfu"] is None
    assert "speed not measured" in capsys.readouterr().out
    again = run_recipe("fsdp", tmp_path, *flags, "--resume")
    assert "nothing left to do" in capsys.readouterr().out
    assert again["resumed_from_step"] == 1 and again["tokens_per_second"] is None
    for name in ("first_loss", "final_loss", "param_digest"):
        assert again[name] == one[name], name


def test_data_parallel_recipe_resumes_a_finished_run(tmp_path, capsys):
    flags = ("--steps", "2", "--batch-size", "32", "--width", "16", "--checkpoint-dir", str(tmp_path / "ckpt"))
    done = run_recipe("data_parallel", tmp_path, *flags)
    capsys.readouterr()
    again = run_recipe("data_parallel", tmp_path, *flags, "--resume")
    assert "nothing left to do" in capsys.readouterr().out
    assert again["resumed_from_step"] == 2 and again["final_loss"] is None  # null: no step run here
    assert again["param_digest"] == done["param_digest"]


def test_hybrid_gpt_recipe_runs_one_step(tmp_path, capsys):
    flags = (*GPT_FLAGS, "--mesh", "data=2,model=4", "--steps", "1", "--sample-chars", "0")
    one = run_recipe("hybrid_gpt", tmp_path, *flags)
    assert one["steps"] == 1 and one["first_loss"] == one["final_loss"] and one["flops_per_second"] is None
    assert "speed not measured" in capsys.readouterr().out
