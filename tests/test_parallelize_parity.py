"""eqxpar.testing.check_parallel_parity: passes on a correct parallel model, and fails, with
the leaves named, when a collective is doubled or the models do not belong together."""

import functools

import equinox as eqx
import jax
import optax
import pytest
import test_parallelize as tp

import eqxpar
import eqxpar.nn
from eqxpar.testing import check_parallel_parity

MESH = dict(data=2, model=4)
OPTIMIZER = optax.sgd(0.1)


@functools.cache
def dense_model():
    return tp.PlainLM(vocab=16, dim=8, heads=4, width=16, layers=1, bias=True, key=jax.random.key(3))


def tokens():
    return jax.random.randint(jax.random.key(4), (4, 7), 0, 16)


def split_loss(model, tokens, key=None):
    logits = jax.vmap(model)(tokens[:, :-1])  # this device's block of the vocabulary
    return eqxpar.nn.vocab_parallel_cross_entropy(logits, tokens[:, 1:], axis_name="model").mean()


def test_parity_of_a_split_head_with_the_vocabulary_parallel_loss():
    mesh = eqxpar.make_mesh(**MESH)
    parallel = eqxpar.nn.parallelize(dense_model(), {**eqxpar.nn.auto_plan(dense_model()), "head": "column"}, mesh=mesh)
    report = check_parallel_parity(dense_model(), parallel, split_loss, OPTIMIZER, mesh, tokens(), steps=2)
    assert len(report.losses) == 2 and report.losses[1] < report.losses[0]
    assert set(report.worst) == {"loss", "gradients", "parameters"}
    assert all(used <= 1 for used, _ in report.worst.values())
    assert report.leaves == len(jax.tree.leaves(eqx.filter(dense_model(), eqx.is_inexact_array)))
    assert "parallel == dense over 2 step(s)" in str(report)
    # The inputs are copied, not consumed by the step's donation.
    assert not any(x.is_deleted() for x in jax.tree.leaves(eqx.filter(parallel, eqx.is_array)))


def test_a_doubled_collective_fails_with_every_leaf_named():
    mesh = eqxpar.make_mesh(**MESH)
    parallel = eqxpar.nn.parallelize(dense_model(), mesh=mesh)

    def doubled(model, tokens, key=None):  # an extra psum over the model axis: 4x the loss
        return jax.lax.psum(tp.loss_fn(model, tokens), "model")

    with pytest.raises(AssertionError) as error:
        check_parallel_parity(dense_model(), parallel, doubled, OPTIMIZER, mesh, tokens())
    text = str(error.value)
    assert "loss at step 0" in text and "grad norm" in text
    assert "gradients .blocks[0].attention.query_proj.weight" in text
    assert "parameters .head.weight" in text


def test_models_that_do_not_belong_together_are_refused():
    mesh = eqxpar.make_mesh(**MESH)
    other = tp.PlainLM(vocab=16, dim=8, heads=4, width=16, layers=1, bias=True, key=jax.random.key(5))
    with pytest.raises(ValueError, match="start from different parameters"):
        check_parallel_parity(dense_model(), eqxpar.nn.parallelize(other), tp.loss_fn, OPTIMIZER, mesh, tokens())
    with pytest.raises(ValueError, match="does not have dense_model's structure"):
        check_parallel_parity(
            dense_model(), eqxpar.nn.parallelize(dense_model().head), tp.loss_fn, OPTIMIZER, mesh, tokens()
        )
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        check_parallel_parity(dense_model(), dense_model(), tp.loss_fn, OPTIMIZER, mesh, tokens(), steps=0)


def test_the_concept_page_runs_as_written(capsys):
    """docs/concepts/your_model.md: its python blocks, in order, print the table it shows.
    (Blocks fenced as `py` are fragments of a user's own model, shown in full in
    tests/test_parallelize_llama_style.py and tests/test_parallelize_registry.py.)"""
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "concepts" / "your_model.md").read_text()
    namespace = {}
    for code in re.findall(r"```python\n(.*?)```", page, re.S):
        exec(compile(code, "docs/concepts/your_model.md", "exec"), namespace)
    shown = re.findall(r"```text\n(.*?)```", page, re.S)[0]
    printed = capsys.readouterr().out
    assert shown.strip() in printed, printed
    assert "parallel == dense over 1 step(s)" in printed
    assert isinstance(namespace["dense_again"].blocks[0].attention, eqx.nn.MultiheadAttention)
    assert isinstance(namespace["split_head"].head, eqxpar.nn.ColumnParallelLinear)
