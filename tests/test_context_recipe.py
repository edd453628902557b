"""recipes/long_context.py: the same final_loss on one device, data=2,context=2,model=2
and context=8, with and without sequence parallelism; at context=8 a quarter of the
one-device temporaries or less; every collective's bytes, axis by axis, equal the theory."""

import pytest
from _recipes import load_recipe

FLAGS = ["--steps", "2", "--batch-size", "2", "--seq-len", "256", "--dim", "16", "--heads", "2", "--layers", "1"]


KINDS = {
    # The rows over `context` each attention mode adds to the step's collectives (with the
    # packed documents' ids all-gathered once per step).
    "ring": {"collective-permute context", "all-gather context"},
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


def test_the_recipe_reports_activation_memory_against_theory():
    """--remat block --scan-layers: the step keeps each block's input only; the recipe's
    theory and autodiff's count agree on the blocks (a second depth gives the per-block
    difference), and the theory's total is the least the step keeps."""
    recipe = load_recipe("long_context")
    flags = [
        *FLAGS[:-2],
        "--remat",
        "block",
        "--scan-layers",
        "--sequence-parallel",
        "--mesh",
        "data=2,context=2,model=2",
    ]
    one, two = recipe.main([*flags, "--layers", "1"]), recipe.main([*flags, "--layers", "2"])
    # Per block: 1 example x 128 positions per context shard / 2 (SP) x dim 16, float32.
    assert two["activation_bytes_per_block_theory"] == 1 * 256 // 2 // 2 * 16 * 4
    assert two["activation_bytes_saved"] - one["activation_bytes_saved"] == two["activation_bytes_per_block_theory"]
    assert 0 < two["activation_bytes_theory"] <= two["activation_bytes_saved"]
    assert two["remat"] == "block" and two["scan_layers"] is True
    assert abs(
        two["final_loss"]
        - recipe.main([*FLAGS[:-2], "--layers", "2", "--mesh", "data=2,context=2,model=2"])["final_loss"]
    ) <= 1e-5 * abs(two["final_loss"])


@pytest.mark.parametrize("attention", ["ring", "all_gather"])
def test_remat_save_matmuls_communication_equals_the_theory(attention):
    """Under --remat save_matmuls the backward pass runs the model axis's all-reduces and
    attention's K/V traffic again; the theory the recipe builds counts them."""
    metrics = load_recipe("long_context").main([*FLAGS, "--remat", "save_matmuls", "--attention", attention])
    assert metrics["comm_bytes_measured"] == metrics["comm_bytes_theory"]
