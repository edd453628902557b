"""Regenerate the HLO fixtures: `python tests/hlo_fixtures/capture.py` (8 simulated CPU devices).

Each fixture keeps the collective lines of one real compiled program (`compiled.as_text()`)
under a header naming the JAX version and the mesh. The programs are plain `jax.jit` with
`NamedSharding`s (XLA's partitioner chooses the collectives and prints the replica groups
in its iota form `[2,4]<=[8]` or its mesh form `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`),
plus one `shard_map` program (explicit lists `{{0,1,2,3},{4,5,6,7}}`).
"""

import pathlib

import eqxpar

eqxpar.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = pathlib.Path(__file__).parent
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def save(name: str, mesh: str, fn, *args) -> None:
    text = jax.jit(fn).lower(*args).compile().as_text()
    lines = [line.strip() for line in text.splitlines() if any(f" {k}(" in line for k in KINDS)]
    header = (
        f"# jax {jax.__version__}, {jax.devices()[0].platform}; mesh {mesh}; compiled.as_text(), collectives only\n"
    )
    (HERE / f"{name}.hlo").write_text(header + "\n".join(lines) + "\n")


def auto_mesh(devices, names):
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def data_model():
    mesh = auto_mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

    def f(x, w):
        with jax.named_scope("matmul"):
            y = x @ w  # partial sums over model: all-reduce over model
        with jax.named_scope("scatter"):
            ys = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("data", "model")))
        with jax.named_scope("gather"):  # all-gathers over model and data
            g = jax.lax.with_sharding_constraint(ys * 2, NamedSharding(mesh, P()))
        with jax.named_scope("total"):
            t = jnp.sum(x, axis=0)  # all-reduce over data
        return ys, g, t

    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("model", None)))
    save("jit_data2_model4", "data=2,model=4", f, x, w)


def three_axes():
    mesh = auto_mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "b", "c"))

    def g(x):
        with jax.named_scope("outer"):
            with jax.named_scope("inner"):
                r = jnp.sum(x, axis=0)  # all-reduce over (a, c), then all-gather over b
        return jax.lax.with_sharding_constraint(r, NamedSharding(mesh, P()))

    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(("a", "c"), "b")))
    save("jit_a2_b2_c2", "a=2,b=2,c=2", g, x)


def permuted():
    devices = np.array(jax.devices())[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4)
    mesh = auto_mesh(devices, ("data", "model"))
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("data", "model")))
    # all-reduce over data, then all-gather over model
    save(
        "jit_permuted_data2_model4",
        "data=2,model=4 over devices 0,2,4,6,1,3,5,7",
        lambda x: jax.lax.with_sharding_constraint(jnp.sum(x, 0), NamedSharding(mesh, P())),
        x,
    )


def shard_map_lists():
    mesh = eqxpar.make_mesh(data=2, model=4)

    def local(x):
        reduced = jax.lax.psum(x, "model")
        gathered = jax.lax.all_gather(x, "data", tiled=True)
        scattered = jax.lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True)
        return (reduced.sum() + gathered.sum() + scattered.sum())[None]

    f = eqxpar.filter_shard_map(local, mesh=mesh, in_specs=(P(("data", "model")),), out_specs=P(("data", "model")))
    save("shard_map_data2_model4", "data=2,model=4", f, jnp.ones((64, 3)))


if __name__ == "__main__":
    data_model()
    three_axes()
    permuted()
    shard_map_lists()
