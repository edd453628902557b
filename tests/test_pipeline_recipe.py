"""recipes/pipeline_gpt.py as a user runs it: every schedule gives one device's final loss
on stage=4,data=2, prints the bubble of the formula and moves the theory's ppermute bytes
(every tick of the schedule's loops counted); 1F1B's compiled step needs at
most half of GPipe's temporary memory at M = 4P."""

import numpy as np
import pytest
from _budget import THOROUGH, case
from _recipes import run_recipe

SMALL = ("--steps", "2", "--batch-size", "32", "--microbatches", "16", "--context", "16", "--dim", "32")


# Circular under thorough (make test time): tests/test_pipeline.py's pin runs it by default.
SCHEDULES = ("gpipe", "circular", "1f1b") if THOROUGH else ("gpipe", "1f1b")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    runs = {
        (schedule, "stage=4,data=2"): run_recipe(
            "pipeline_gpt", tmp, "--schedule", schedule, "--mesh", "stage=4,data=2", *SMALL
        )
        for schedule in SCHEDULES
    }
    # One device is the reference for every schedule: one run (with one stage there is no
    # schedule to speak of; make test time).
    runs["one device"] = run_recipe("pipeline_gpt", tmp, "--mesh", "stage=1,data=1", *SMALL)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [case(s, default=s != "circular") for s in ("gpipe", "circular", "1f1b")])
def test_every_schedule_gives_one_devices_final_loss(runs, schedule):
    one, pipelined = runs["one device"], runs[(schedule, "stage=4,data=2")]
    np.testing.assert_allclose(pipelined["final_loss"], one["final_loss"], rtol=1e-4)
    assert pipelined["bubble_fraction"] == pytest.approx(pipelined["bubble_theory"], abs=1e-12)
    assert one["bubble_fraction"] == 0.0
    # Every tick's ppermute, counted through the schedule's loops, is the theory's.
    assert pipelined["ppermute_bytes_measured"] == pipelined["ppermute_bytes_theory"] > 0
    assert one["ppermute_bytes_measured"] == one["ppermute_bytes_theory"] == 0


@pytest.mark.slow
def test_1f1b_needs_at_most_half_of_gpipes_temp_memory(runs):
    gpipe, one_f_one_b = runs[("gpipe", "stage=4,data=2")], runs[("1f1b", "stage=4,data=2")]
    assert 2 * one_f_one_b["temp_bytes_per_device"] <= gpipe["temp_bytes_per_device"]
    assert one_f_one_b["max_in_flight"] == 7 and gpipe["max_in_flight"] == 16
