"""Run one script as N cooperating JAX processes on this machine: `python -m eqxpar.launch`.

```
python -m eqxpar.launch --nproc 2 --devices-per-proc 4 recipes/multihost.py --steps 100
```

starts `recipes/multihost.py --steps 100` twice, as processes 0 and 1 of one JAX job, each
with 4 simulated CPU devices (8 global devices). The processes find each other through a
coordinator on 127.0.0.1 (loopback only) at a free port, or at `--port`, which must be free;
[`eqxpar.distributed.initialize`][] in the script
reads the settings from the environment variables the launcher sets:

| variable | value |
|---|---|
| `EQXPAR_COORDINATOR_ADDRESS` | `127.0.0.1:PORT` |
| `EQXPAR_NUM_PROCESSES` | `--nproc` |
| `EQXPAR_PROCESS_ID` | `0 .. nproc-1` |
| `EQXPAR_DEVICES_PER_PROCESS` | `--devices-per-proc` |

Every line a process prints comes out prefixed with `[rank i]`. If any process exits with a
non-zero status or is killed, the launcher stops the others (SIGTERM, then SIGKILL after a
grace period), says which rank failed, repeats that rank's last lines at the very end of the
output, and exits non-zero: a failed job never hangs. A rank that exits with
`eqxpar.distributed.EXIT_PEER_FAILED` (75) only stopped because *another* rank failed (see
[`eqxpar.distributed.initialize`][]'s `fail_fast`), so the launcher names the rank that
failed with any other status as the cause.

This is the local stand-in for a cluster launcher: on a real cluster, start the same script
with `srun` (SLURM) or `mpirun`, which [`eqxpar.distributed.initialize`][] also recognises.
"""

from __future__ import annotations

import sys

from .distributed._launch import free_port, launch, main

__all__ = ["launch", "main", "free_port"]

if __name__ == "__main__":
    sys.exit(main())
