"""A model whose blocks are stacked with eqx.filter_vmap (a layer axis in front of every
array) and run with lax.scan: what many third-party Equinox models do (issue 20)."""

import equinox as eqx
import jax
import jax.numpy as jnp

LAYERS, DIM, WIDTH = 2, 8, 16


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(DIM, WIDTH, key=k1)
        self.down = eqx.nn.Linear(WIDTH, DIM, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class ScannedNet(eqx.Module):
    blocks: Block  # every array with a leading axis of LAYERS
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k1, LAYERS))
        self.head = eqx.nn.Linear(DIM, DIM, key=k2)

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, layer):
            return eqx.combine(layer, static)(h), None

        return self.head(jax.lax.scan(body, x, params)[0])


def loss_fn(model, batch, key=None):
    return jnp.mean(jnp.square(jax.vmap(model)(batch) - batch))
