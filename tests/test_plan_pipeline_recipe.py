"""`recipes/pipeline_gpt.py --layout auto`: the planner chooses the pipeline (mesh,
schedule, micro-batches, virtual stages, remat) for the 8 simulated devices, prints its
table, and the run trains to the losses of a plain one-device Equinox + optax loop (no
pipeline, no planner); its predicted collective bytes equal the compiled step's exactly.
With the memory per device it is given here only the recomputing plans fit, and 1F1B is
the fastest of them: its compiled program (which drops one gradient send on 2 stages) is
checked here."""

import jax
import pytest
from _recipes import load_recipe, run_recipe
from _reference import assert_reference_losses, recipe_text, text_reference_losses

from eqxpar.models import GPT

STEPS, BATCH, CONTEXT, DIM, HEADS, LAYERS, SEED, LR = 2, 16, 16, 32, 4, 4, 0, 3e-3
FLAGS = (
    # Plain token rows: with document masks each micro-batch's segment ids also travel
    # between the stages (the recipe's own theory counts them, tests/test_pipeline_recipe.py),
    # which the planner's collective theory does not price yet (64 bytes a forward tick here).
    "--no-document-mask",
    *("--steps", str(STEPS), "--batch-size", str(BATCH), "--context", str(CONTEXT)),
    *("--dim", str(DIM), "--heads", str(HEADS), "--layers", str(LAYERS)),  # last: a test below replaces it
)
MEMORY = "0.0006"  # GB: the plans that keep every tick's activations do not fit; the chosen one compiles to 0.000552


def reference_losses() -> dict[str, float]:
    """The recipe's run written out plainly on one device: its weights (the seed's key), its
    batches of packed rows, AdamW, the held-out metrics (`text_reference_losses`)."""
    vocab = recipe_text(CONTEXT).vocab_size
    model = GPT(vocab, CONTEXT, DIM, HEADS, LAYERS, scan_layers=True, key=jax.random.key(SEED))
    return text_reference_losses(model, seq=CONTEXT, batch=BATCH, steps=STEPS, seed=SEED, lr=LR, document_mask=False)


def test_layout_auto_picks_a_pipeline_prints_the_plans_and_equals_one_device(tmp_path, capsys):
    metrics = run_recipe("pipeline_gpt", tmp_path, "--layout", "auto", "--memory-per-device", MEMORY, *FLAGS)
    out = capsys.readouterr().out
    assert "--layout auto: 5 fastest of the stage x data x model layouts on 8 simulated CPU devices" in out
    start = out.index("\nlayout ")
    table = out[start : out.index("\n\n", start + 1)]
    peak = f"peak per device predicted {metrics['predicted_peak_bytes']:,} bytes"
    peak += f", compiled {metrics['compiled_peak_bytes']:,}"
    assert f"\nlayout {metrics['layout']}: {peak}" in out  # printed after the compile, before training
    rows = table.strip().splitlines()[2:]
    assert len(rows) == 5 and all("bubble" in row and row.startswith("stage=") for row in rows)
    assert rows[0].startswith(metrics["layout"] + " ")  # the first plan is the one that ran
    assert " 1f1b M=" in metrics["layout"] and metrics["schedule"] == "1f1b"
    assert f"M={metrics['microbatches']}" in metrics["layout"]
    assert metrics["mesh"].startswith(metrics["layout"].split()[0].split(",")[0])
    # Exact: the compiled step moves what the plan predicted, every collective counted.
    assert metrics["predicted_comm_bytes"] == metrics["compiled_comm_bytes"] > 0
    assert metrics["predicted_peak_bytes"] <= float(MEMORY) * 1e9
    assert 0.5 < metrics["compiled_peak_bytes"] / metrics["predicted_peak_bytes"] < 3
    assert_reference_losses(metrics, reference_losses())


def test_layout_auto_takes_no_mesh_and_names_the_memory_that_would(capsys):
    recipe = load_recipe("pipeline_gpt")
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--layout", "auto", "--mesh", "stage=4,data=2", *FLAGS])
    assert stop.value.code == 2
    assert "--layout auto chooses the mesh itself: drop --mesh stage=4,data=2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--layout", "auto", "--memory-per-device", "0.00001", *FLAGS])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "no stage x data x model layout" in err and "Give --memory-per-device" in err
    # 3 blocks split over no stage count: no pipeline at all, said before anything compiles.
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--layout", "auto", *FLAGS[:-1], "3"])
    assert stop.value.code == 2
    assert "layers over stage" in capsys.readouterr().err
