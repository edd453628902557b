"""python -m eqxpar.launch: N real processes, rank-prefixed output, and no hang on failure."""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from eqxpar import launch
from eqxpar.distributed._output import is_gloo_chatter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def run_launcher(*args, timeout=90, env=None):
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "eqxpar.launch", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return run, time.monotonic() - start


def test_every_rank_runs_with_its_settings_and_prefixed_output(tmp_path):
    script = write(
        tmp_path,
        "show.py",
        """
        import os, sys
        env = {k: os.environ[k] for k in sorted(os.environ) if k.startswith("EQXPAR_") and k != "EQXPAR_CPU_DEVICES"}
        print("env", env)
        sys.stdout.write("progress 1\\rprogress 2\\n")  # a progress bar's redraw
        print("args", sys.argv[1:], file=sys.stderr)
    """,
    )
    run, _ = run_launcher("--nproc", "3", "--devices-per-proc", "2", script, "--steps", "5")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for rank in range(3):
        env = [line for line in lines if line.startswith(f"[rank {rank}] env ")]
        assert len(env) == 1, lines
        settings = eval(env[0].split(" env ", 1)[1])  # the dict the script printed
        assert settings["EQXPAR_PROCESS_ID"] == str(rank)
        assert settings["EQXPAR_NUM_PROCESSES"] == "3"
        assert settings["EQXPAR_DEVICES_PER_PROCESS"] == "2"
        assert settings["EQXPAR_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
        assert f"[rank {rank}] progress 1" in lines and f"[rank {rank}] progress 2" in lines
        assert f"[rank {rank}] args ['--steps', '5']" in lines
    addresses = {line.split("'EQXPAR_COORDINATOR_ADDRESS': ")[1].split(",")[0] for line in lines if " env " in line}
    assert len(addresses) == 1  # one coordinator for all ranks


def test_a_module_runs_with_its_own_flags(tmp_path):
    write(tmp_path, "my_train.py", "import os, sys\nprint(os.environ['EQXPAR_PROCESS_ID'], sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    # Everything after `-m MODULE` is the module's, even flags the launcher also has.
    run, _ = run_launcher("--nproc", "2", "-m", "my_train", "--nproc", "7", env=env)
    assert run.returncode == 0, run.stderr
    assert "[rank 0] 0 ['--nproc', '7']" in run.stdout and "[rank 1] 1 ['--nproc', '7']" in run.stdout


def test_a_failing_rank_stops_the_others_and_sets_the_status(tmp_path):
    script = write(
        tmp_path,
        "fail.py",
        """
        import os, sys, time
        if os.environ["EQXPAR_PROCESS_ID"] == "1":
            sys.exit(3)
        time.sleep(600)
        print("rank 0 finished")
    """,
    )
    run, seconds = run_launcher("--nproc", "2", "--grace-s", "2", script)
    assert run.returncode == 3
    assert "rank 1 (pid" in run.stderr and "exited with status 3" in run.stderr
    assert "stopping the other 1 running process(es)" in run.stderr
    assert "rank 0 finished" not in run.stdout
    assert seconds < 30  # instead of rank 0's 600 s


def test_a_rank_that_only_followed_a_failure_is_not_named_as_the_cause(tmp_path):
    """Status 75 (EXIT_PEER_FAILED) says "another rank failed": the launcher names that one.

    Rank 0 exits with 75 at once, as eqxpar's watchdog does when it reads a peer's failure;
    rank 1, the real failure, exits a moment later with status 3.
    """
    script = write(
        tmp_path,
        "follow.py",
        """
        import os, sys, time
        if os.environ["EQXPAR_PROCESS_ID"] == "0":
            print("stops because process 1 failed", flush=True)
            sys.exit(75)
        time.sleep(1.0)
        print("RuntimeError: the real failure", flush=True)
        sys.exit(3)
    """,
    )
    run, seconds = run_launcher("--nproc", "2", "--grace-s", "2", script)
    assert run.returncode == 3, run.stderr
    assert "rank 1 (pid" in run.stderr and "exited with status 3" in run.stderr
    last = run.stderr.strip().splitlines()
    assert last[-1] == "eqxpar.launch: the job failed: rank 1 exited with status 3.", run.stderr
    assert last[-2:-1] == ["    [rank 1] RuntimeError: the real failure"], run.stderr  # its last lines
    assert seconds < 30


def test_timeout_stops_the_job(tmp_path):
    script = write(tmp_path, "slow.py", "import time\ntime.sleep(600)\n")
    run, seconds = run_launcher("--nproc", "2", "--timeout-s", "1", "--grace-s", "1", script)
    assert run.returncode == 124
    assert "ran longer than 1 s" in run.stderr
    assert seconds < 30


@pytest.mark.slow
def test_a_killed_process_mid_run_ends_the_job_within_60_s(tmp_path):
    """Two JAX processes in a loop of cross-process collectives; rank 1 is SIGKILLed.

    Rank 0 is then blocked in a collective that can never finish: the launcher must notice
    the death, stop rank 0 and exit non-zero, naming rank 1.
    """
    script = write(
        tmp_path,
        "collectives.py",
        """
        import eqxpar.distributed
        info = eqxpar.distributed.initialize(timeout_s=60)
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("start")
        print("ready", info, flush=True)
        while True:
            multihost_utils.sync_global_devices("tick")
    """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "eqxpar.launch", "--nproc", "2", "--devices-per-proc", "2", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen, pid, ready = [], None, False
    # Starting two JAX processes takes seconds, minutes on a loaded machine; what the test
    # times is the launcher's reaction to the kill, below.
    deadline = time.monotonic() + 300
    try:
        while not (pid and ready):
            # A job that ends before it is ready (e.g. a rank failing to start) fails the
            # test now, with its output, instead of at the deadline.
            assert time.monotonic() < deadline, f"rank 1 not ready after 300 s:\n{''.join(seen)}"
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, f"the job ended before rank 1 was ready:\n{''.join(seen)}"
                continue
            seen.append(line)
            if line.startswith("eqxpar.launch: rank 1 started as pid "):
                pid = int(line.split()[-1])
            ready = ready or line.startswith("[rank 1] ready process 1 of 2")
        time.sleep(0.5)  # well inside the loop of collectives
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=60)
        seconds = time.monotonic() - killed
    finally:
        if proc.poll() is None:  # the test failed: let the launcher stop its ranks first
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get())
    output = "".join(seen)
    assert code != 0, output
    assert f"rank 1 (pid {pid}) was killed by SIGKILL" in output
    # The last line names the rank that died, after whatever rank 0 printed while stopping.
    assert output.strip().splitlines()[-1] == "eqxpar.launch: the job failed: rank 1 was killed by SIGKILL.", output
    assert seconds < 60
    print(f"launcher exited {seconds:.1f} s after the kill, status {code}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_a_killed_launcher(tmp_path):
    """A launcher killed by SIGKILL cannot stop its ranks itself; the kernel must (each rank
    is started with PR_SET_PDEATHSIG), or they would run on, unowned, forever."""
    script = write(
        tmp_path,
        "forever.py",
        """
        import time
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "eqxpar.launch", "--nproc", "2", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids, ready = [], 0
    try:
        for line in proc.stdout:
            if line.startswith("eqxpar.launch: rank ") and " started as pid " in line:
                pids.append(int(line.split()[-1]))
            ready += line.endswith("] ready\n")
            if len(pids) == 2 and ready == 2:
                break
        assert len(pids) == 2 and all(_alive(pid) for pid in pids), (pids, ready)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), f"ranks {pids} outlived their launcher"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_gloo_connection_chatter_is_recognised():
    assert is_gloo_chatter("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
    assert is_gloo_chatter(
        "[Gloo] Rank [Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"
    )
    assert not is_gloo_chatter("1")
    assert not is_gloo_chatter("step 3 loss 0.25")


def test_bad_launcher_arguments(tmp_path):
    with pytest.raises(ValueError, match="--nproc must be at least 1"):
        launch.launch([sys.executable, "-c", "pass"], nproc=0)
    with pytest.raises(ValueError, match="--devices-per-proc must be at least 1"):
        launch.launch([sys.executable, "-c", "pass"], nproc=1, devices_per_proc=0)
    with pytest.raises(SystemExit):
        launch.main(["--nproc", "2", str(tmp_path / "missing.py")])
    assert 0 < launch.free_port() < 65536
