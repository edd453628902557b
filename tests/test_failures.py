"""A failing rank ends the whole multi-process job, non-zero, within 60 s: never a hang.

Real processes (2 ranks, gloo on 127.0.0.1, no mocks) run tests/_failing_rank.py: after a
collective every rank completes, one rank fails while the other enters a collective that can
never complete. Without eqxpar's fail-fast handling (eqxpar/distributed/_failfast.py) the failed rank
waits at JAX's shutdown barrier and the other in the collective, for ever. Each start has a
hard subprocess timeout, so a regression fails the test instead of hanging it.

The failure cases: an exception in the main thread, one in a background thread, and a rank
killed with SIGKILL; the job started by `python -m eqxpar.launch`, and by hand as two
subprocesses with the launcher's variables or SLURM's (as `srun` would start them).
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from _launch import launch_command

from eqxpar.distributed import EXIT_PEER_FAILED
from eqxpar.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_failing_rank.py")
LIMIT_S = 60  # the promise: a failed job is over within a minute
pytestmark = pytest.mark.slow


class Job:
    """Processes started together; their output (stdout + stderr) gathered line by line."""

    def __init__(self, commands_and_envs):
        self.start = time.monotonic()
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[tuple[float, int, str]] = []  # (time since start, process, line)
        self.procs = []
        for index, (command, env) in enumerate(commands_and_envs):
            p = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            self.procs.append(p)
            threading.Thread(target=self._read, args=(index, p), daemon=True).start()

    def _read(self, index, p):
        for line in p.stdout:
            self.lines.put((time.monotonic() - self.start, index, line.rstrip("\n")))

    def _drain(self, timeout):
        try:
            self.seen.append(self.lines.get(timeout=timeout))
        except queue.Empty:
            pass

    def wait_for(self, text, count=1, timeout=LIMIT_S, diagnose=None):
        """Wait until `count` lines containing `text` were printed; the time of the last one.

        On a timeout, `diagnose` (a process index) first has that process's threads described
        (`describe`) into the error, before the job is killed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t, _, line in self.seen if text in line]
            if len(hits) >= count:
                return hits[count - 1]
            self._drain(0.1)
        where = "" if diagnose is None else self.describe(diagnose)
        self.kill()
        raise AssertionError(f"no {text!r} within {timeout} s:\n{self.output()}{where}")

    def describe(self, process):
        """Each thread's kernel state and wait channel, then its Python stack: the script
        registers `faulthandler` on SIGUSR1, which dumps every thread's stack from the C
        signal handler, so it answers even with the main thread blocked holding the GIL."""
        pid = self.procs[process].pid
        lines = [f"\n--- process {process} (pid {pid}) threads: state, CPU ticks, wait channel"]
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    wchan = f.read().strip()
            except OSError:
                continue  # the thread ended while we read
            lines.append(f"{tid} {name}: {fields[0]} {int(fields[11]) + int(fields[12])} {wchan}")
        before = len(self.seen)
        self.procs[process].send_signal(signal.SIGUSR1)
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            self._drain(0.1)
        lines.append(f"--- its Python stacks (SIGUSR1): {len(self.seen) - before} lines above, after the rest")
        return "\n".join(lines)

    def wait(self, timeout=LIMIT_S):
        """Wait for every process to exit (kill them all after `timeout`); exit codes, time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            self._drain(0.05)
        hung = any(p.poll() is None for p in self.procs)
        ended = time.monotonic() - self.start
        self.kill()
        time.sleep(0.2)
        while not self.lines.empty():
            self._drain(0)
        assert not hung, f"the job still runs after {timeout} s: a hang\n{self.output()}"
        return [p.returncode for p in self.procs], ended

    def wait_until_blocked(self, process, quiet_s=3.0, timeout=LIMIT_S):
        """Wait until `process`'s main thread has slept, using no CPU, for `quiet_s` seconds
        (3 s: under a load of ten on two cores, 1.5 s was not enough to tell, and the hint
        after the first SIGINT never came; a longer quiet spell is the likelier explanation's fix).

        Read from /proc/PID/task/PID/stat: the state letter (field 3) and the thread's user and
        system CPU ticks (fields 14 and 15). A thread that compiles, dispatches or waits for a
        moment on the GIL either runs or changes its ticks within a few samples; one blocked
        in a collective that can never complete does neither."""
        pid = self.procs[process].pid
        deadline = time.monotonic() + timeout
        quiet_since, last_ticks = None, None
        while time.monotonic() < deadline:
            with open(f"/proc/{pid}/task/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the "(command)" field
            state, ticks = fields[0], int(fields[11]) + int(fields[12])
            now = time.monotonic()
            if state in "SD" and ticks == last_ticks:
                quiet_since = quiet_since or now
                if now - quiet_since >= quiet_s:
                    return
            else:
                quiet_since = None
            last_ticks = ticks
            self._drain(0.1)
        self.kill()
        raise AssertionError(f"process {process}'s main thread never blocked within {timeout} s:\n{self.output()}")

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    def output(self, process=None):
        return "\n".join(line for _, i, line in self.seen if process is None or i == process)


def launcher_job(mode, failing):
    return Job([(launch_command(2, 2, SCRIPT, mode, str(failing)), dict(os.environ))])


def by_hand_job(mode, failing, kind):
    """Two processes started directly, as a cluster scheduler would, with no eqxpar launcher."""
    port = free_port()
    runs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EQXPAR_", "SLURM_"))}
        env["JAX_PLATFORMS"] = "cpu"
        if kind == "slurm":  # what srun sets; JAX finds the coordinator from the node list
            env.update(
                SLURM_JOB_ID="4242",
                SLURM_STEP_NODELIST="localhost",
                SLURM_NTASKS="2",
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank),
                JAX_COORDINATOR_PORT=str(port),
            )
        else:
            env.update(
                EQXPAR_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", EQXPAR_NUM_PROCESSES="2", EQXPAR_PROCESS_ID=str(rank)
            )
        runs.append(([sys.executable, SCRIPT, mode, str(failing)], env))
    return Job(runs)


def last_lines(text, n):
    return "\n".join(text.strip().splitlines()[-n:])


def last_eqxpar_line(text):
    """The last line a process printed through eqxpar, from its `eqxpar:` on. JAX's C++
    logging, from other threads, may follow it in any number of lines (seen once: four
    lines of the coordination service agent's 'Polled an error' after the failing rank's
    own last line) and may even precede it on the same line (Gloo's unterminated
    '[Gloo] Rank 1 is connected to 1 peer ranks. ' was seen in front of it)."""
    lines = [line[line.index("eqxpar:") :] for line in text.splitlines() if "eqxpar:" in line]
    return lines[-1] if lines else ""


def stopped_for(line, process, failure):
    """Whether `line`, a process's last eqxpar line, says it stopped because of `failure`
    elsewhere, with the peer-failed status. Either of two ways, both at once: it learned of
    the failure from the coordination service first ("stops because ..."), or the collective
    it was blocked in failed first, when the failed process's sockets closed, and its own
    error handling then found the earlier failure ("probably a consequence of ..."; a
    fresh-clone make test under load took this path, 2026-11-26)."""
    return line in (
        f"eqxpar: process {process} of 2 stops because {failure}. Exiting with status {EXIT_PEER_FAILED}.",
        (
            f"eqxpar: process {process} of 2: this is probably a consequence of an earlier failure: {failure}. "
            f"Exit status {EXIT_PEER_FAILED}."
        ),
    )


def test_a_raising_rank_ends_a_launched_job():
    job = launcher_job("raise", failing=1)
    failed_at = job.wait_for("[rank 1] eqxpar: process 1 of 2 has an uncaught exception")
    (code,), ended = job.wait()
    out = job.output()
    assert code == 1, out
    # The end of the output names the failed rank and its error, after anything the stopped
    # rank printed.
    tail = last_lines(out, 6)
    assert "RuntimeError: rank 1 ran out of data" in tail, tail
    assert tail.endswith("eqxpar.launch: the job failed: rank 1 exited with status 1."), tail
    rank0 = last_eqxpar_line("\n".join(line for line in out.splitlines() if line.startswith("[rank 0]")))
    assert stopped_for(rank0, 0, "process 1 failed: RuntimeError: rank 1 ran out of data"), out
    assert ended - failed_at < LIMIT_S
    print(f"launcher, rank 1 raises: job over {ended - failed_at:.1f} s after the failure ({ended:.1f} s in all)")


@pytest.mark.parametrize(
    "kind, mode, failing",
    [
        ("plain", "raise", 1),  # the brief's case: rank 1 runs out of data
        ("slurm", "raise", 0),  # process 0 hosts the coordination service: it fails last
        ("plain", "thread", 1),  # a background thread's exception is a failure too
    ],
)
def test_a_failing_rank_ends_a_job_started_by_hand(kind, mode, failing):
    job = by_hand_job(mode, failing, kind)
    failed_at = job.wait_for(f"eqxpar: process {failing} of 2 has an uncaught exception")
    codes, ended = job.wait()
    other = 1 - failing
    out = job.output()
    assert codes[failing] == 1 and codes[other] == EXIT_PEER_FAILED, (codes, out)
    error = f"RuntimeError: rank {failing} ran out of data"
    # Each process's last own line names the failed process and its error (JAX's C++ log
    # lines, from other threads, may still follow it).
    assert f"eqxpar: process {failing} of 2 failed: {error}." in last_eqxpar_line(job.output(failing)), out
    assert stopped_for(last_eqxpar_line(job.output(other)), other, f"process {failing} failed: {error}"), out
    if mode == "thread":
        assert "has an uncaught exception in thread 'data-loader'" in out
    if kind == "slurm":
        assert "ready: process 0 of 2: 2 local / 4 global cpu devices (slurm)" in out
    assert ended - failed_at < LIMIT_S
    print(f"by hand ({kind}), rank {failing} {mode}: over {ended - failed_at:.1f} s after the failure")


def test_a_late_failure_reaches_a_rank_that_already_finished():
    """Rank 0 reached the end of its script; rank 1 raises 2 s later.

    Rank 0 waits for the others with the watchdog still running (not at JAX's shutdown
    barrier, where only the 30 s heartbeat would notice), so it ends at once, naming rank 1.
    """
    job = by_hand_job("late", failing=1, kind="plain")
    failed_at = job.wait_for("eqxpar: process 1 of 2 has an uncaught exception")
    codes, ended = job.wait()
    out = job.output()
    assert codes == [EXIT_PEER_FAILED, 1], (codes, out)
    assert "finished" in job.output(0)
    assert (
        "eqxpar: process 0 of 2 stops because process 1 failed: RuntimeError: rank 1 ran out of data."
        in last_eqxpar_line(job.output(0))
    ), out
    assert ended - failed_at < LIMIT_S
    print(f"by hand, rank 1 raises after rank 0 finished: over {ended - failed_at:.1f} s after the failure")


def test_a_rank_that_leaves_early_with_sys_exit_0_ends_the_job():
    """`sys.exit(0)` mid-job is a successful exit that no exception hook sees; rank 0 waits in
    a collective. (A failing status, `sys.exit(3)`, ends the job at once: test_exit_status.py.)

    Rank 1 waits for rank 0 to finish too; after `shutdown_timeout_s` (10 s in the script) it
    declares the job failed, which also ends rank 0.
    """
    job = launcher_job("exit", failing=1)
    left_at = job.wait_for("[rank 1] leaving early")
    (code,), ended = job.wait()
    out = job.output()
    assert code == 1, out
    assert "[rank 1] eqxpar: process 1 finished its script 10 s ago but process(es) 0 did not" in out
    assert "[rank 0] eqxpar: process 0 of 2 stops because process 1 finished its script" in out
    assert last_lines(out, 1) == "eqxpar.launch: the job failed: rank 1 exited with status 1.", out
    assert ended - left_at < LIMIT_S
    print(f"launcher, rank 1 leaves early with sys.exit(0): over {ended - left_at:.1f} s after it left")


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_ends_a_job_started_by_hand(killed):
    """SIGKILL runs no Python: the survivor learns of it from its collective, which fails."""
    job = by_hand_job("loop", failing=-1, kind="plain")
    job.wait_for("ready: process", count=2)
    # Any moment after `ready` will do: the survivor's next collective fails either way.
    job.procs[killed].send_signal(signal.SIGKILL)
    killed_at = time.monotonic() - job.start
    codes, ended = job.wait()
    survivor = 1 - killed
    out = job.output()
    assert codes[killed] == -signal.SIGKILL and codes[survivor] != 0, (codes, out)
    # The survivor's collective fails and its exception hook ends it. When the killed rank
    # hosted the coordination service, JAX may abort the survivor first ("another task died").
    assert f"eqxpar: process {survivor} of 2 failed: " in job.output(
        survivor
    ) or "JAX distributed service detected fatal errors" in job.output(survivor), out
    assert ended - killed_at < LIMIT_S
    print(f"by hand, rank {killed} SIGKILLed: over {ended - killed_at:.1f} s after the kill")


# Flaky in the full suite on 2 cores (passes alone in 8 s; two fresh-clone runs of make test
# on 2026-11-26 saw the first SIGINT's hint never come): a heavy variant until explained (issue 22).
@pytest.mark.thorough
def test_ctrl_c_twice_ends_a_job_blocked_in_a_collective():
    """Rank 0 is blocked in a collective (rank 1 stalls), where SIGINT cannot reach Python.

    The first SIGINT changes nothing but a hint; the second ends rank 0 (status 130), and
    the watchdog then ends rank 1.
    """
    job = by_hand_job("stall", failing=1, kind="plain")
    job.wait_for("ready: process", count=2)
    # A SIGINT that lands while rank 0 still runs Python (compiling or dispatching the next
    # collective) is an ordinary KeyboardInterrupt, not this test's case: wait until its main
    # thread sleeps in the collective, read from the kernel, not assumed after a fixed sleep.
    job.wait_until_blocked(0)
    job.procs[0].send_signal(signal.SIGINT)
    job.wait_for("eqxpar: process 0 of 2 received SIGINT but its main thread has not stopped", timeout=30, diagnose=0)
    job.procs[0].send_signal(signal.SIGINT)
    interrupted_at = time.monotonic() - job.start
    codes, ended = job.wait()
    out = job.output()
    assert codes == [130, EXIT_PEER_FAILED], (codes, out)
    assert "eqxpar: process 1 of 2 stops because process 0 was interrupted (SIGINT twice)" in last_eqxpar_line(
        job.output(1)
    ), out
    assert ended - interrupted_at < LIMIT_S
    print(f"by hand, Ctrl-C twice on rank 0 blocked in a collective: over {ended - interrupted_at:.1f} s after")
