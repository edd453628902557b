"""The launcher behind `python -m eqxpar.launch` (documented in `eqxpar/launch.py`, the
public entry module, which re-exports `launch`, `main` and `free_port` from here)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from ._failfast import EXIT_PEER_FAILED
from ._output import TAIL_LINES, Output, Tail, describe
from ._procs import die_with_launcher_preexec, stop
from ._runtime import check_port_free
from ._startup import ENV_COORDINATOR_ADDRESS, ENV_DEVICES_PER_PROCESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID

__all__ = ["launch", "main", "free_port"]

# After a rank exits with EXIT_PEER_FAILED, how long to wait for the rank that caused it. The
# cause may first wait up to 5 s for the others to read its failure (a stalled job: 5 s more
# for them to print their stacks), so 5 s here was seen to name a follower under load.
_CAUSE_WAIT_S = 15.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (the OS picks it).

    **Arguments:**

    - `host`: the address to bind to when asking.

    **Returns:**

    The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(
    command: Sequence[str],
    *,
    nproc: int,
    devices_per_proc: int | None = None,
    port: int | None = None,
    grace_s: float = 5.0,
    term_grace_s: float = 60.0,
    timeout_s: float | None = None,
    show_gloo: bool = False,
    out=None,
) -> int:
    """Run `command` as `nproc` processes of one JAX job on 127.0.0.1; return the exit status.

    **Arguments:**

    - `command`: the program and its arguments, e.g. `[sys.executable, "train.py", "--steps", "10"]`.
    - `nproc`: how many processes to start (ranks `0 .. nproc-1`).
    - `devices_per_proc`: simulated CPU devices per process (sets
      `EQXPAR_DEVICES_PER_PROCESS`, and `JAX_PLATFORMS=cpu` unless it is set already, so
      that on a machine with accelerators the processes do not all grab them); `None`
      leaves both to the script.
    - `port`: the coordinator's port; default: a free one. The coordinator listens on
      127.0.0.1 only (nothing outside this machine can reach it).
    - `grace_s`: after a failure, how long the other processes get to exit after SIGTERM
      before they are killed.
    - `term_grace_s`: when the launcher itself receives SIGTERM (a scheduler's preemption
      notice), it passes SIGTERM on and gives the ranks this long to save a checkpoint and
      exit (a recipe with `--checkpoint-dir` saves its current step, see
      `eqxpar.checkpoint.Preempted`) before killing them.
    - `timeout_s`: stop everything and return 124 if the job runs longer than this;
      default: no limit.
    - `show_gloo`: keep gloo's per-connection messages (hidden by default).
    - `out`: where the prefixed output goes (default `sys.stdout`).

    **Returns:**

    0 if every process exited with status 0. Otherwise the status of the process that failed
    first (128 + the signal number if it was killed), or 124 on timeout. A rank that exited
    with `EXIT_PEER_FAILED` (75) is only named when no other rank failed. The last lines on
    `sys.stderr` name the failed rank and repeat its last lines of output (its error).

    **Raises:**

    - `ValueError` before anything starts: bad counts, no command, or a `port` that is
      already in use on 127.0.0.1.
    """
    if nproc < 1:
        raise ValueError(f"eqxpar.launch: --nproc must be at least 1, got {nproc}.")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"eqxpar.launch: --devices-per-proc must be at least 1, got {devices_per_proc}.")
    if not command:
        raise ValueError("eqxpar.launch: give the script to run, e.g. recipes/multihost.py.")
    if port is not None:
        if not 0 < port < 65536:
            raise ValueError(f"eqxpar.launch: --port must be in 1..65535, got {port}.")
        # Process 0 would crash (SIGSEGV inside JAX) on a port that is taken: say so now.
        check_port_free(f"127.0.0.1:{port}", launched=True, who="eqxpar.launch")
    out = sys.stdout if out is None else out
    address = f"127.0.0.1:{port or free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    die_with_launcher = die_with_launcher_preexec()
    copies: list[Output] = []
    tails = [Tail(maxlen=TAIL_LINES) for _ in range(nproc)]

    def note(message: str) -> None:
        with lock:
            sys.stderr.write(f"eqxpar.launch: {message}\n")
            sys.stderr.flush()

    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            {
                ENV_COORDINATOR_ADDRESS: address,
                ENV_NUM_PROCESSES: str(nproc),
                ENV_PROCESS_ID: str(rank),
                "PYTHONUNBUFFERED": "1",  # lines reach us as they are printed
            }
        )
        if devices_per_proc is not None:
            env[ENV_DEVICES_PER_PROCESS] = str(devices_per_proc)
            # Simulated CPU devices are the point of this launcher; on a machine with
            # accelerators every process would otherwise grab all of them.
            env.setdefault("JAX_PLATFORMS", "cpu")
        p = subprocess.Popen(
            list(command),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group
            preexec_fn=die_with_launcher,  # and gone if the launcher is killed
        )
        procs.append(p)
        copies.append(Output(p.stdout, out, f"[rank {rank}] ", lock, show_gloo, tails[rank]))
        copies.append(Output(p.stderr, out, f"[rank {rank}] ", lock, show_gloo, tails[rank]))
        note(f"rank {rank} started as pid {p.pid}")

    interrupted: list[int] = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, on_signal)
    start = time.monotonic()
    status = 0
    cause: int | None = None
    cause_code = 0
    peer_failed_at = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            causes = [(r, c) for r, c in failed if c != EXIT_PEER_FAILED]
            if failed and not causes:
                # Only ranks that stopped because another one failed: give the one that failed
                # a moment to exit too, so that it is named as the cause.
                peer_failed_at = peer_failed_at or time.monotonic()
                if all(c is not None for c in codes) or time.monotonic() - peer_failed_at > _CAUSE_WAIT_S:
                    causes = failed
            if causes:
                rank, code = causes[0]
                cause, cause_code = rank, code
                others = sum(c is None for c in codes)
                note(
                    f"rank {rank} (pid {procs[rank].pid}) {describe(code)}; stopping the "
                    f"other {others} running process(es)."
                )
                status = code if code > 0 else 128 - code
                break
            if all(c == 0 for c in codes):
                break
            if interrupted:
                if interrupted[0] == signal.SIGTERM:
                    note(
                        f"received SIGTERM; passing it on: the ranks get {max(grace_s, term_grace_s):g} s "
                        f"to save a checkpoint and exit."
                    )
                else:
                    note(f"received {signal.Signals(interrupted[0]).name}; stopping all processes.")
                status = 128 + interrupted[0]
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                note(f"the job ran longer than {timeout_s:g} s; stopping all processes.")
                status = 124
                break
            time.sleep(0.05)
    finally:
        preempted = interrupted[:1] == [signal.SIGTERM] and cause is None
        stop(procs, max(grace_s, term_grace_s) if preempted else grace_s)
        # Every rank has exited: the copies end at their pipes' end, once they have written
        # all a rank printed last (under load that can take seconds). The deadline, one for
        # all copies, is for a rank's child process that still holds a pipe open.
        deadline = time.monotonic() + 15.0
        for c in copies:
            c.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
    if cause is not None:
        # Last in the output, after whatever the stopped ranks printed: who failed, and why.
        lines = list(tails[cause])
        if lines:
            note(f"the last lines of rank {cause}:\n" + "\n".join(f"    {line}" for line in lines))
        if tails[cause].failure:
            note(f"rank {cause}'s error: {tails[cause].failure}")
        note(f"the job failed: rank {cause} {describe(cause_code)}.")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: `python -m eqxpar.launch [options] SCRIPT [ARGS...]`.

    **Arguments:**

    - `argv`: the command line without the program name (default `sys.argv[1:]`).

    **Returns:**

    The exit status from [`eqxpar.launch.launch`][].
    """
    parser = argparse.ArgumentParser(
        prog="python -m eqxpar.launch",
        usage="python -m eqxpar.launch --nproc N [options] (SCRIPT | -m MODULE) [ARGS...]",
        description="Run a script as N processes of one JAX job on this machine.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        help="simulated CPU devices per process (overrides the script's --devices)",
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument(
        "--grace-s", type=float, default=5.0, help="after a failure, seconds between SIGTERM and SIGKILL for the others"
    )
    parser.add_argument(
        "--term-grace-s",
        type=float,
        default=60.0,
        help="on SIGTERM, seconds the ranks get to save a checkpoint and exit before SIGKILL",
    )
    parser.add_argument("--timeout-s", type=float, default=None, help="stop the job after this many seconds")
    parser.add_argument("--show-gloo", action="store_true", help="keep gloo's connection messages")
    argv = list(sys.argv[1:] if argv is None else argv)
    # The launcher's own options come first; everything from the script (or `-m MODULE`) on
    # belongs to the program being launched, flags included.
    takes_value = {"--nproc", "--devices-per-proc", "--port", "--grace-s", "--term-grace-s", "--timeout-s"}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        i += 2 if argv[i] in takes_value else 1
    args = parser.parse_args(argv[:i])
    rest = argv[i:]
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            parser.error("-m needs a module name, e.g. -m my_package.train")
        command = [sys.executable, *rest]
    else:
        if not rest:
            parser.error("give the script to run, e.g. recipes/multihost.py")
        if not os.path.exists(rest[0]):
            parser.error(f"script {rest[0]!r} does not exist")
        command = [sys.executable, *rest]
    try:
        return launch(
            command,
            nproc=args.nproc,
            devices_per_proc=args.devices_per_proc,
            port=args.port,
            grace_s=args.grace_s,
            term_grace_s=args.term_grace_s,
            timeout_s=args.timeout_s,
            show_gloo=args.show_gloo,
        )
    except ValueError as e:
        parser.error(str(e))
