"""recipes/your_model.py as a user runs it: a plain Equinox model, parallelized by one call,
trains as the dense model does on one device, with the automatic plan and with a split head."""

import numpy as np
from _recipes import run_recipe

SMALL = ("--steps", "3", "--batch-size", "4", "--context", "8", "--dim", "16", "--heads", "4", "--layers", "1")


def test_your_model_recipe_matches_the_dense_model(tmp_path):
    metrics = run_recipe("your_model", tmp_path, "--mesh", "data=2,model=4", *SMALL)
    assert metrics["mesh"] == "data=2,model=4" and metrics["steps"] == 3
    # The automatic plan: attention, MLP and embedding split, the rest whole.
    assert metrics["plan"] == {
        "embedding": "vocab",
        "positions": "replicate",
        "blocks[0].norm1": "replicate",
        "blocks[0].attention": "attention",
        "blocks[0].norm2": "replicate",
        "blocks[0].mlp": "mlp",
        "norm": "replicate",
        "head": "replicate",
    }
    assert metrics["split_plan"] == {**metrics["plan"], "head": "column"}
    # Parity (check_parallel_parity raised nothing) and the training losses: the recipe
    # trains the dense model on one device on the same batches. Float sums in another order
    # (psums over 2 and 4 devices): a few ulps per step.
    np.testing.assert_allclose(metrics["parity_losses"], metrics["parity_dense_losses"], rtol=1e-5)
    assert metrics["max_relative_loss_gap"] < 1e-5
    assert metrics["split_head_max_relative_loss_gap"] < 1e-5
    np.testing.assert_allclose(metrics["final_loss"], metrics["dense_final_loss"], rtol=1e-5)
    # No "the loss fell" check: three steps on three batches of 4 x 8 tokens of a 512-token
    # vocabulary move it by noise (6.3231 -> 6.3254); the dense model trains to the same.
    # The packed rows of the recipes' pipeline, with document masks, and the BPE's vocabulary.
    assert metrics["document_mask"] is True and metrics["seq_len"] == 8 and metrics["vocab_size"] == 512
    # The split head holds a quarter of the head (and its gradient) per device.
    assert metrics["split_head_param_bytes_per_device"] < metrics["param_bytes_per_device"]
