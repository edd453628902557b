"""recipes/long_context.py: the same final_loss on one device, data=2,context=2,model=2
and context=8, with and without sequence parallelism; at context=8 a quarter of the
one-device temporaries or less; every collective's bytes, axis by axis, equal the theory."""

import pytest
from _recipes import load_recipe

FLAGS = ["--steps", "2", "--batch-size", "2", "--seq-len", "256", "--dim", "16", "--heads", "2", "--layers", "1"]


KINDS = {
    # The rows over `context` each attention mode adds to the step's collectives.
    "ring": {"collective-permute context"},
    "all_gather": {"all-gather context", "reduce-scatter context"},
}


@pytest.mark.parametrize("attention, sequence_parallel", [("ring", False), ("all_gather", True)])
def test_long_context_recipe_same_loss_less_memory(attention, sequence_parallel):
    recipe = load_recipe("long_context")
    sp = ["--sequence-parallel"] if sequence_parallel else []
    runs = {
        mesh: recipe.main([*FLAGS, *sp, "--attention", attention, "--mesh", mesh])
        for mesh in ("data=1,context=1,model=1", "data=2,context=2,model=2", "data=1,context=8,model=1")
    }
    one = runs["data=1,context=1,model=1"]
    assert one["comm_bytes_measured"] == {} and one["comm_ratio"] is None
    for mesh, metrics in runs.items():
        assert abs(metrics["final_loss"] - one["final_loss"]) <= 1e-4 * abs(one["final_loss"]), mesh
        assert metrics["comm_bytes_measured"] == metrics["comm_bytes_theory"], mesh
    hybrid = runs["data=2,context=2,model=2"]["comm_bytes_measured"]
    want = KINDS[attention] | {"all-reduce data/context", "all-reduce model"}
    if sequence_parallel:
        want |= {"all-gather model", "reduce-scatter model"}
    assert set(hybrid) == want and all(v > 0 for v in hybrid.values())
    assert set(runs["data=1,context=8,model=1"]["comm_bytes_measured"]) == KINDS[attention] | {"all-reduce context"}
    assert runs["data=1,context=8,model=1"]["temp_bytes_per_device"] * 4 <= one["temp_bytes_per_device"]


def test_sequence_parallelism_shrinks_the_temporaries():
    """The same model and mesh (model=8), with and without --sequence-parallel: the same
    losses, fewer temporaries with the positions split over the model axis."""
    recipe = load_recipe("long_context")
    flags = [*FLAGS[:-4], "--heads", "8", "--layers", "1", "--mesh", "data=1,context=1,model=8"]
    off = recipe.main(flags)
    on = recipe.main([*flags, "--sequence-parallel"])
    assert abs(on["final_loss"] - off["final_loss"]) <= 1e-5 * abs(off["final_loss"])
    assert on["temp_bytes_per_device"] < off["temp_bytes_per_device"]
