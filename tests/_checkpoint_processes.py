"""Run by tests/test_checkpoint_multiprocess.py under `python -m eqxpar.launch --nproc 2 --devices-per-proc 4`.

Every process of the 2 x 4 job:

1. restores the checkpoint `SAVED_BY_ONE/` (written by the test's single process with 8
   devices) onto two layouts whose meshes span both processes, and checks each restored
   array against the state it rebuilds from the seed; process 0 writes the gathered values
   (`restored_<layout>.npz`) for the test to compare with the state it saved;
2. saves another state, split across both processes, as `SAVED_BY_TWO/` for the test to
   restore in one process.

`make_state` is also imported by the test, so both sides build the same state.

Usage: python tests/_checkpoint_processes.py DIR
"""

import json
import sys

import numpy as np
from jax.sharding import PartitionSpec as P

SAVED_BY_ONE, SAVED_BY_TWO = "saved_by_1x8", "saved_by_2x4"
STEP = 3
# Layouts over 8 devices: (mesh sizes, spec of each array of the state). With 2 processes
# of 4 devices, "data" (the first axis) of data=2,model=4 crosses the processes, and
# model=8 splits every split array across both processes.
LAYOUTS = {
    "data2_model4": (
        {"data": 2, "model": 4},
        {"w": P("data", "model"), "b": P("model"), "h": P(), "count": P(), "key": P()},
    ),
    "model8": ({"model": 8}, {"w": P(None, "model"), "b": P("model"), "h": P("model"), "count": P(), "key": P()}),
}


def make_state(seed: int, mesh, specs):
    """A state with float32, bfloat16, int32 and typed-key leaves, placed by eqxpar.shard."""
    import jax
    import ml_dtypes

    import eqxpar

    rng = np.random.default_rng(seed)
    host = {
        "w": rng.standard_normal((16, 24), np.float32),
        "b": rng.standard_normal(16, np.float32),
        "h": rng.standard_normal(8, np.float32).astype(ml_dtypes.bfloat16),
        "count": np.int32(seed * 7),
    }
    placed = eqxpar.shard(host, mesh, {k: v for k, v in specs.items() if k != "key"})
    # A typed PRNG key: placed through its key data (every process holds the same key).
    key_data = eqxpar.shard(np.asarray(jax.random.key_data(jax.random.key(seed))), mesh, specs["key"])
    return {**placed, "key": jax.random.wrap_key_data(key_data)}


def host_values(state):
    """Every leaf of `state` as one whole NumPy array (typed keys as key data)."""
    import jax

    import eqxpar

    raw = {k: jax.random.key_data(v) if k == "key" else v for k, v in state.items()}
    return eqxpar.gather(raw)


def main(directory: str) -> None:
    import eqxpar.distributed

    info = eqxpar.distributed.initialize(timeout_s=60)

    import jax

    import eqxpar
    from eqxpar.checkpoint import Checkpointer

    report = {}
    for name, (sizes, specs) in LAYOUTS.items():
        mesh = eqxpar.make_mesh(**sizes)
        like = make_state(100, mesh, specs)
        with Checkpointer(f"{directory}/{SAVED_BY_ONE}") as ckpt:
            restored = ckpt.restore(like)
        values, expected = host_values(restored.state), host_values(make_state(1, mesh, specs))
        report[name] = {
            "step": restored.step,
            "data_state": restored.data_state,
            "equal": {k: values[k].tobytes() == expected[k].tobytes() for k in values},
            "spans_processes": all(not x.is_fully_addressable for x in jax.tree.leaves(restored.state)),
            "shardings_as_like": [x.sharding for x in jax.tree.leaves(restored.state)]
            == [x.sharding for x in jax.tree.leaves(like)],
            "key_dtype": str(restored.state["key"].dtype),
        }
        if jax.process_index() == 0:
            # Raw bytes (NumPy has no bfloat16 of its own): compared byte for byte by the test.
            np.savez(
                f"{directory}/restored_{name}.npz",
                **{k: np.asarray(v).reshape(-1).view(np.uint8) for k, v in values.items()},
            )

    sizes, specs = LAYOUTS["model8"]
    saved = make_state(2, eqxpar.make_mesh(**sizes), specs)
    with Checkpointer(f"{directory}/{SAVED_BY_TWO}") as ckpt:
        ckpt.maybe_save(STEP, saved, data_state={"index": 128})
    with open(f"{directory}/rank{jax.process_index()}.json", "w") as f:
        json.dump(report, f, indent=1)
    print("done", info, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
