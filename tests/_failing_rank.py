"""A 2-process JAX job in which one rank fails mid-run; run by tests/test_failures.py.

Usage: python tests/_failing_rank.py MODE FAILING_RANK

Every rank joins the job (settings from eqxpar.launch's or SLURM's environment variables),
runs one cross-process collective and prints `ready`. Then, by MODE:

- `raise`: the failing rank raises `RuntimeError("rank N ran out of data")` in the main
  thread, while every other rank enters the next collective, one that can never complete;
- `thread`: the same exception, raised in a background thread of the failing rank, whose
  main thread goes on into the collective with the others;
- `loop`: nobody fails here; every rank runs collectives in a loop until the test kills one;
- `exit`: the failing rank leaves early with `sys.exit(0)`, a *normal* exit; the others
  enter the collective. Only the finish timeout (`shutdown_timeout_s`, 10 s here) can tell;
- `exit3`: the failing rank leaves with `sys.exit(3)` while the others enter the collective:
  a failing exit status, which ends the job at once with that status;
- `hang`: every rank loops over steps (one collective each) under eqxpar's progress
  watchdog (`eqxpar.distributed.Watchdog(10)`); after step 3 the failing rank sleeps for
  ever instead of joining the next collective, without failing: only the watchdog can tell;
- `late`: every other rank reaches the end of the script; the failing rank raises 2 s later;
- `stall`: the "failing" rank sleeps instead of joining the next collective, so the others
  block in it (for the Ctrl-C test).

Without eqxpar's fail-fast handling the job never ends: the failed rank waits at JAX's
shutdown barrier for the others, which wait in the collective for it.
"""

import faulthandler
import signal
import sys
import threading
import time

import eqxpar.distributed

# Every thread's Python stack on SIGUSR1, from the C signal handler (the tests' diagnostics).
faulthandler.register(signal.SIGUSR1, all_threads=True)
info = eqxpar.distributed.initialize(cpu_devices=2, timeout_s=60, shutdown_timeout_s=10)

from jax.experimental import multihost_utils  # noqa: E402

mode, failing = sys.argv[1], int(sys.argv[2])
multihost_utils.sync_global_devices("start")  # a collective every rank completes
print(f"ready: {info}", flush=True)


def out_of_data():
    raise RuntimeError(f"rank {failing} ran out of data")


if info.process_id == failing and mode == "raise":
    out_of_data()
if info.process_id == failing and mode == "thread":
    threading.Thread(target=out_of_data, name="data-loader").start()
if info.process_id == failing and mode == "exit":
    print("leaving early", flush=True)
    sys.exit(0)
if info.process_id == failing and mode == "exit3":
    print("leaving with status 3", flush=True)
    sys.exit(3)
if info.process_id == failing and mode == "stall":
    time.sleep(600)
if mode == "late":
    if info.process_id == failing:
        time.sleep(2)
        out_of_data()
    print("finished", flush=True)
    sys.exit(0)
if mode == "hang":
    watchdog = eqxpar.distributed.Watchdog(10)
    for step in range(10**9):
        if info.process_id == failing and step == 3:
            print("stalling", flush=True)
            time.sleep(3600)
        multihost_utils.sync_global_devices(f"step {step}")
        watchdog.step_finished(step)
step = 0
while True:  # every other rank: collectives the failed rank never joins
    multihost_utils.sync_global_devices(f"step {step}")
    step += 1
    if mode != "loop":
        time.sleep(0.01)
