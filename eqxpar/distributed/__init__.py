"""Multi-process start-up: one call that joins JAX's distributed runtime, or does nothing.

Every process of a multi-host (multi-process) job runs the same script; each calls
[`eqxpar.distributed.initialize`][] once, before anything else touches JAX. After it returns,
`jax.devices()` lists the devices of *all* processes, `jax.process_index()` says which
process this is, and a `jax.jit`/`shard_map` computation over a mesh of those devices runs as
one SPMD program whose collectives (`psum`, `pmean`, ...) cross process boundaries.

Where the settings come from, first match wins:

1. the arguments `coordinator_address`, `num_processes`, `process_id`;
2. the environment variables set by `python -m eqxpar.launch` (or by any launcher you write):
   `EQXPAR_COORDINATOR_ADDRESS`, `EQXPAR_NUM_PROCESSES`, `EQXPAR_PROCESS_ID`, and
   `EQXPAR_DEVICES_PER_PROCESS` (simulated CPU devices per process);
3. a cluster environment JAX recognises: SLURM (`srun`) and Open MPI (`mpirun`) are detected
   from their environment variables; other clusters (`"mpi4py"`, `"gketpu"`, `"gcetpu"`, ...)
   by passing `cluster_detection_method`. JAX then works out the coordinator itself.

With none of these, the run is a plain single process and `initialize` only sets the CPU
device count: recipes can call it unconditionally.

A multi-process run also *fails fast*: an uncaught exception in any process prints its
traceback tagged with the process, records the failure in JAX's coordination service and
hard-exits, skipping JAX's shutdown barrier (where a failed process would otherwise wait for
ever for peers that wait for it in a collective); a watchdog thread in every other process
sees the record and ends that process too, naming the failed one. See `_failfast.py`
and the troubleshooting page ("Hangs: how eqxpar prevents them").

The package is eqxpar's multi-process runtime; its public names are re-exported here, and
the launcher's from `eqxpar.launch`. Its modules, bottom to top:

- `_runtime.py`: the coordinator's address, the port checks, and joining JAX's runtime with
  timeouts that raise instead of aborting the process;
- `_calls.py`, `_interrupt.py`, `_finish.py`, `_stacks.py`: fail-fast's bounded calls, its
  Ctrl-C watch, its watched finish, and the stacks a stalled job prints;
- `_failfast.py`: one failing process ends the job (`install_fail_fast`, `end_job`);
- `_watchdog.py`: the progress watchdog, which ends a stalled job through `end_job`;
- `_startup.py`: `initialize`, `ProcessInfo`, `print_main`, `MainProcessFilter`;
- `_output.py`, `_procs.py`, `_launch.py`: `python -m eqxpar.launch` (the ranks' output, the
  ranks as processes, the launcher).
"""

from ._failfast import EXIT_PEER_FAILED
from ._startup import (
    ENV_COORDINATOR_ADDRESS,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    MainProcessFilter,
    ProcessInfo,
    initialize,
    print_main,
)
from ._watchdog import Watchdog

__all__ = [
    "initialize",
    "ProcessInfo",
    "print_main",
    "MainProcessFilter",
    "ENV_COORDINATOR_ADDRESS",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_DEVICES_PER_PROCESS",
    "EXIT_PEER_FAILED",
    "Watchdog",
]
