"""Bad sizes and misuse give a ValueError that names the layer, the size and the axis, before
anything compiles."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.models import GPT

KEY = jax.random.key(0)


@pytest.mark.parametrize(
    "layer, message",
    [
        (nn.ColumnParallelLinear(4, 6, key=KEY), r"ColumnParallelLinear.*out_features=6.*size 4.*'model'"),
        (nn.RowParallelLinear(10, 4, key=KEY), r"RowParallelLinear.*in_features=10.*size 4.*'model'"),
        (nn.ParallelMLP(4, 4, 6, key=KEY), r"ParallelMLP.*width_size=6.*size 4.*'model'"),
        # 6 heads of 4 channels: 24 rows divide by 4, but the heads do not.
        (nn.ParallelMultiheadAttention(6, 24, key=KEY), r"ParallelMultiheadAttention.*num_heads=6.*size 4.*'model'"),
        (nn.VocabParallelEmbedding(10, 3, key=KEY), r"VocabParallelEmbedding.*num_embeddings=10.*size 4.*'model'"),
    ],
)
def test_sizes_that_do_not_split_are_named(layer, message):
    with pytest.raises(ValueError, match=message):
        nn.partition_specs(layer, eqxpar.make_mesh(model=4))


def test_head_count_is_checked_while_tracing_too():
    """Without the mesh check the layer raises the same error while tracing, before any
    compile, though its weights (24 rows) would split over 4 devices without complaint."""
    mesh = eqxpar.make_mesh(model=4)
    attention = nn.ParallelMultiheadAttention(6, 24, key=KEY)
    f = eqxpar.filter_shard_map(
        lambda layer, x: jax.vmap(layer)(x), mesh=mesh, in_specs=(nn.partition_specs(attention), P()), out_specs=P()
    )
    with pytest.raises(ValueError, match=r"num_heads=6.*size 4.*'model'"):
        eqx.filter_jit(f).lower(attention, jnp.zeros((2, 3, 24)))


def test_errors_name_the_path_inside_a_model():
    # An abstract model (shapes only, nothing allocated) is enough to check the sizes.
    model = eqx.filter_eval_shape(GPT, 16, 8, dim=8, num_heads=2, num_layers=2, key=KEY)
    with pytest.raises(ValueError, match=r"ParallelMultiheadAttention at .blocks\[0\].attention: num_heads=2"):
        nn.partition_specs(model, eqxpar.make_mesh(model=4))


def test_a_model_axis_missing_from_the_mesh():
    layer = nn.ColumnParallelLinear(4, 8, axis_name="tensor", key=KEY)
    with pytest.raises(ValueError, match=r"axis 'tensor'.*mesh does not have"):
        nn.partition_specs(layer, eqxpar.make_mesh(model=2))


def test_outside_shard_map():
    layer = nn.ColumnParallelLinear(4, 8, key=KEY)
    with pytest.raises(ValueError, match=r"inside shard_map.*'model'"):
        layer(jnp.zeros(4))
    with pytest.raises(ValueError, match="inside shard_map"):
        nn.vocab_parallel_cross_entropy(jnp.zeros((2, 8)), jnp.zeros(2, jnp.int32))


def test_replicated_weights_are_not_mistaken_for_blocks():
    """Passing P() for a split layer would silently compute N times too much; it is refused."""
    mesh = eqxpar.make_mesh(model=4)
    layer = nn.RowParallelLinear(8, 3, input_is_split=False, key=KEY)
    f = eqxpar.filter_shard_map(lambda l, x: jax.vmap(l)(x), mesh=mesh, in_specs=(P(), P()), out_specs=P())
    with pytest.raises(ValueError, match=r"this device's block \(3, 2\).*partition_specs"):
        f(layer, jnp.zeros((2, 8)))


def test_wrong_input_shapes():
    mesh = eqxpar.make_mesh(model=2)
    row = nn.RowParallelLinear(8, 3, key=KEY)  # expects its block: 4 features
    f = eqxpar.filter_shard_map(lambda l, x: jax.vmap(l)(x), mesh=mesh, in_specs=(row.specs(), P()), out_specs=P())
    with pytest.raises(
        ValueError, match=r"this device's block of the input, shape \(4,\), got \(8,\).*input_is_split=False"
    ):
        f(row, jnp.zeros((2, 8)))
    with pytest.raises(ValueError, match="labels have shape"):
        nn.vocab_parallel_cross_entropy(jnp.zeros((2, 8)), jnp.zeros(3, jnp.int32))


def test_conversion_errors():
    linear = eqx.nn.Linear(4, 8, key=KEY)
    with pytest.raises(ValueError, match="linear='column'"):
        nn.from_dense(linear)
    with pytest.raises(ValueError, match="depth=2"):
        nn.from_dense(eqx.nn.MLP(4, 4, 8, 2, key=KEY))
    with pytest.raises(ValueError, match="no tensor-parallel form for Conv1d"):
        nn.from_dense(eqx.nn.Conv1d(2, 2, 3, key=KEY))
    with pytest.raises(ValueError, match="scalar"):
        nn.from_dense(eqx.nn.Linear("scalar", 8, key=KEY), linear="column")
    with pytest.raises(ValueError, match="parameters"):
        nn.from_dense(eqx.nn.MLP(4, 4, 8, 1, activation=eqx.nn.PReLU(), key=KEY))
    block = eqx.tree_at(lambda l: l.weight, nn.from_dense(linear, linear="row"), jnp.zeros((8, 2)))
    with pytest.raises(ValueError, match="global form"):
        nn.to_dense(block)
