"""Checkpointing a whole training state with orbax, and restoring it onto any layout.

A training run keeps one [`eqxpar.checkpoint.Checkpointer`][] for its checkpoint folder:

```python
ckpt = eqxpar.checkpoint.Checkpointer("runs/gpt", keep=3, save_every=100)
state, start, data_state = ckpt.restore(init_state)  # fresh start: (init_state, 0, None)
for step in range(start, steps):
    state = train_step(state, batch(step))
    ckpt.maybe_save(step + 1, state, data_state={"epoch": ..., "index": ...})
ckpt.close()
```

On SIGTERM (a scheduler's preemption notice) a `Checkpointer` made with
`save_on_preemption=True` saves the step that `maybe_save` is called with, at the same step
in every process, and raises [`eqxpar.checkpoint.Preempted`][] (exit status 143); a run
restarted with `resume` continues bit for bit.

A recipe creates it from its flags first thing, so that a wrong folder is refused before
anything is built: `Checkpointer.from_config(cfg, shape_fields=("dim", "layers"))`.

What is saved for a `state` PyTree (a tuple of model, optimizer state, PRNG key, ...), one
folder `<step>/` per checkpoint:

- `state/`: every array leaf (`jax.Array`, NumPy array), dtype kept, through orbax's
  sharded array format: each process writes the shards its devices hold, each shard once;
  typed PRNG keys (`jax.random.key`) as their raw key data, wrapped back on restore;
- `meta/eqxpar.json`: a JSON description of the tree (every leaf's path, and each array's
  shape and dtype), used to check a restore target before any array is read; it is also
  the marker that tells eqxpar's checkpoints from anything else in the folder;
- `config/eqxpar.json`: the run's config, if one was given;
- `data/`: the `data_state` (any JSON value, e.g. a data iterator's position), one file per
  process.

Everything else in the tree (activation functions, Python numbers such as a dropout rate
or an `inference` flag) is configuration, not data: it is not saved and comes back from
the `like` tree given to restore. The formats are orbax's (tensorstore/OCDBT for arrays)
and JSON; nothing is pickled.
"""

from ._checkpointer import Checkpointer
from ._config import RECIPE_FREE_FIELDS
from ._preemption import EXIT_PREEMPTED, Preempted, preempted, watch_preemption
from ._restore import Restored

__all__ = [
    "Checkpointer",
    "Restored",
    "RECIPE_FREE_FIELDS",
    "Preempted",
    "EXIT_PREEMPTED",
    "preempted",
    "watch_preemption",
]
