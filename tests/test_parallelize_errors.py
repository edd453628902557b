"""parallelize: bad plans are ValueErrors naming the path, raised before anything compiles;
the automatic plan, the Plan table and mapping, and to_dense of a whole model."""

import functools
import logging
import re

import equinox as eqx
import jax
import pytest
import test_parallelize as tp
from hypothesis import given
from hypothesis import strategies as st

import eqxpar
import eqxpar.nn


@functools.cache
def plain_model():
    return tp.PlainLM(vocab=16, dim=8, heads=4, width=16, layers=2, bias=False, key=jax.random.key(0))


def plan_error(plan, **kwargs):
    with pytest.raises(ValueError) as error:
        eqxpar.nn.parallelize(plain_model(), plan, **kwargs)
    return str(error.value)


@pytest.mark.parametrize(
    "plan, kwargs, path, message",
    [
        ({"blocks[0].mlpp": "mlp"}, {}, "blocks[0].mlpp", "Did you mean 'blocks[0].mlp'"),
        ({"head": "sideways"}, {}, "head", "the styles are"),
        ({"blocks[0].norm": "mlp"}, {}, "blocks[0].norm", "takes an eqx.nn.MLP"),
        ({lambda m: m.embedding: "column"}, {}, "embedding", "takes an eqx.nn.Linear"),
        ({"blocks[*].mlp": "attention"}, {}, "blocks[0].mlp", "takes an eqx.nn.MultiheadAttention"),
        ({"blocks[1]": "mlp"}, {}, "blocks[1]", "Name the layers themselves, e.g. 'blocks[1].mlp'"),
        # A row layer whose input nobody split: it would need a collective the plan lacks.
        ({"head": "row"}, {}, "head", "'row' at head expects its input already split"),
        ({"blocks[0].mlp.layers[1]": "row"}, {}, "blocks[0].mlp.layers[1]", "before it comes blocks[0].mlp.layers[0]"),
        # A column layer whose split output would reach a layer that wants it whole.
        ({"blocks[0].mlp.layers[0]": "column"}, {}, "blocks[0].mlp.layers[1]", "that would need an all-gather"),
        ({"blocks[0].mlp": "mlp", "blocks[0].mlp.layers[0]": "column"}, {}, "blocks[0].mlp", "overlap"),
        # A Linear inside a MultiheadAttention split on its own: MHA's reshape into heads
        # would cut across devices' slices and train silently wrong (issue 20: loss 3.5e-3 off).
        (
            {"blocks[1].attention.value_proj": "column", "blocks[1].attention.output_proj": "row"},
            {},
            "blocks[1].attention.value_proj",
            "plan {'blocks[1].attention': 'attention'}",
        ),
        ({lambda m: m.blocks[0].mlp.activation: "replicate"}, {}, "", "not a layer"),
        ({lambda m: m.nothing: "mlp"}, {}, "", "failed on the model"),
        ("everything", {}, "", "plan must be None"),
        # Sizes the model axis does not divide, with the mesh given: here, not at compile.
        (None, {"mesh": "model=8"}, "blocks[0].attention", "num_heads=4 is not divisible by the size 8"),
        (
            {"blocks[*].mlp.layers[0]": "column", "blocks[*].mlp.layers[1]": "row"},
            {"mesh": "model=3", "axis_name": "model"},
            "blocks[0].mlp.layers[0]",
            "out_features=16",
        ),
        (None, {"mesh": "data=8"}, "", "has no axis 'model'"),
    ],
)
def test_bad_plans_are_value_errors_naming_the_path(plan, kwargs, path, message, caplog):
    if "mesh" in kwargs:
        kwargs = {**kwargs, "mesh": eqxpar.make_mesh(**eqxpar.parse_mesh(kwargs["mesh"]))}
    plain_model()  # built (and its initialisation compiled) before the check
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        text = plan_error(plan, **kwargs)
    assert message in text, text
    assert path in text, text
    assert text.startswith("parallelize: ")
    assert not [r for r in caplog.records if r.getMessage().startswith("Compiling")]


def test_partition_specs_names_the_path_when_no_mesh_was_given():
    parallel = eqxpar.nn.parallelize(plain_model())  # no mesh: nothing checked yet
    with pytest.raises(ValueError, match=re.escape("blocks[0].attention") + ".*num_heads=4"):
        eqxpar.nn.partition_specs(parallel, eqxpar.make_mesh(data=1, model=8))


def test_auto_plan_table_and_mapping():
    model = plain_model()
    parallel, plan = eqxpar.nn.parallelize(model, mesh=eqxpar.make_mesh(data=2, model=4), return_plan=True)
    assert dict(plan) == {
        "embedding": "vocab",
        "blocks[0].norm": "replicate",
        "blocks[0].attention": "attention",
        "blocks[0].mlp": "mlp",
        "blocks[1].norm": "replicate",
        "blocks[1].attention": "attention",
        "blocks[1].mlp": "mlp",
        "head": "replicate",
    }
    assert dict(eqxpar.nn.auto_plan(model)) == dict(plan)
    table = str(plan)
    assert "split over model=4" in table
    assert re.search(
        r"blocks\[1\]\.attention\s+MultiheadAttention\(4 heads, 8->8\)\s+attention\s+"
        r"num_heads=4 -> 1 per device\s+all-reduce\s+all-reduce",
        table,
    )
    assert isinstance(parallel.blocks[1].mlp, eqxpar.nn.ParallelMLP)
    assert isinstance(parallel.head, eqx.nn.Linear)
    # The layers share the dense model's arrays, and to_dense gives the model back.
    assert parallel.blocks[0].attention.query_proj.weight is model.blocks[0].attention.query_proj.weight
    assert bool(eqx.tree_equal(eqxpar.nn.to_dense(parallel), model))
    # A plan is a mapping: edited and passed back, later entries winning.
    edited, edited_plan = eqxpar.nn.parallelize(model, {**plan, "head": "column"}, return_plan=True)
    assert isinstance(edited.head, eqxpar.nn.ColumnParallelLinear) and not edited.head.gather_output
    assert "vocab_parallel_cross_entropy" in str(edited_plan)  # the note on the split logits
    kept = eqxpar.nn.parallelize(model, {**plan, "blocks[1]": "replicate"})
    assert isinstance(kept.blocks[1].attention, eqx.nn.MultiheadAttention)
    assert isinstance(kept.blocks[0].attention, eqxpar.nn.ParallelMultiheadAttention)


def test_auto_plan_keeps_deeper_mlps_and_parallel_layers_whole():
    key = jax.random.key(1)
    model = (eqx.nn.MLP(4, 4, 8, depth=2, key=key), eqxpar.nn.ParallelMLP(4, 4, 8, key=key))
    parallel, plan = eqxpar.nn.parallelize(model, return_plan=True)
    assert parallel[0] is model[0] and parallel[1] is model[1]
    assert dict(plan) == {"[0]": "replicate"}
    assert "depth=2" in str(plan) and "already tensor-parallel" in str(plan)
    # An MLP of depth 2 split by hand: its first two Linears as a pair.
    parallel = eqxpar.nn.parallelize(model[0], {"layers[0]": "column", "layers[1]": "row"})
    assert isinstance(parallel.layers[1], eqxpar.nn.RowParallelLinear)
    with pytest.raises(ValueError, match=r"\[0\] \(MLP\(4->8->4, depth 2\)\) cannot be 'mlp'.*depth=2"):
        eqxpar.nn.parallelize(model, {"[0]": "mlp"})
    with pytest.raises(ValueError, match="already tensor-parallel"):
        eqxpar.nn.parallelize(model, {"[1]": "mlp"})
    # Explicit plans leave layers that are already tensor-parallel as they are.
    assert bool(
        eqx.tree_equal(eqxpar.nn.parallelize(model, {"[0].layers[0]": "column", "[0].layers[1]": "row"})[1], model[1])
    )
    assert bool(eqx.tree_equal(eqxpar.nn.parallelize(model, {"<root>": "replicate"}), model))


def test_a_single_layer_is_a_model_too():
    attention = eqx.nn.MultiheadAttention(2, 4, key=jax.random.key(0))
    parallel = eqxpar.nn.parallelize(attention)
    assert isinstance(parallel, eqxpar.nn.ParallelMultiheadAttention)
    assert bool(eqx.tree_equal(eqxpar.nn.to_dense(parallel), attention))


@given(
    model_size=st.sampled_from([2, 4, 8]),
    heads=st.sampled_from([2, 4, 8]),
    width=st.sampled_from([4, 8, 12, 16]),
    vocab=st.sampled_from([4, 8, 16]),
)
def test_sizes_are_checked_against_the_mesh_before_anything_compiles(model_size, heads, width, vocab):
    model = tp.PlainLM(vocab=vocab, dim=heads, heads=heads, width=width, layers=1, bias=False, key=jax.random.key(0))
    mesh = eqxpar.make_mesh(model=model_size)
    # The first layer (in field order) whose split size the axis does not divide.
    sizes = [
        ("embedding", "num_embeddings", vocab),
        ("blocks[0].attention", "num_heads", heads),
        ("blocks[0].mlp", "width_size", width),
    ]
    bad = [(path, what, n) for path, what, n in sizes if n % model_size]
    if bad:
        path, what, n = bad[0]
        with pytest.raises(
            ValueError, match=re.escape(f"at {path}: {what}={n} is not divisible by the size {model_size}")
        ):
            eqxpar.nn.parallelize(model, mesh=mesh)
        # Without the mesh, partition_specs raises the same error, naming the same path.
        with pytest.raises(ValueError, match=re.escape(path)):
            eqxpar.nn.partition_specs(eqxpar.nn.parallelize(model), mesh)
    else:
        parallel = eqxpar.nn.parallelize(model, mesh=mesh)
        specs = eqxpar.nn.partition_specs(parallel, mesh)
        assert specs.blocks[0].mlp.hidden.weight == jax.sharding.PartitionSpec("model", None)
