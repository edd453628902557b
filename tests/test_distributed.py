"""eqxpar.distributed.initialize and recipes/multihost.py, single- and multi-process.

The multi-process checks start real processes on 127.0.0.1 (no mocks): the multihost recipe
as 2 processes x 4 CPU devices must reach the same final loss as one process with 8 devices
and as one device, and wrong settings must end in a clear error instead of a hang.
"""

import json
import logging
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from _launch import run_job
from _recipes import run_recipe

import eqxpar.distributed as distributed
from eqxpar.launch import free_port
from eqxpar.testing import F32_ATOL, F32_RTOL, assert_trees_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER_VARS = (
    distributed.ENV_COORDINATOR_ADDRESS,
    distributed.ENV_NUM_PROCESSES,
    distributed.ENV_PROCESS_ID,
    distributed.ENV_DEVICES_PER_PROCESS,
)
SLURM = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*LAUNCHER_VARS, *SLURM, "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_single_process_run_is_a_no_op(clean_env):
    info = distributed.initialize(cpu_devices=8)  # the 8 devices the test session already has
    assert (info.process_id, info.num_processes) == (0, 1)
    assert (info.local_device_count, info.device_count) == (8, 8)
    assert info.is_main and info.coordinator_address is None and info.source == "single process"
    assert str(info) == "process 0 of 1: 8 local / 8 global cpu devices (single process)"
    # A SLURM job with one task is a single process too.
    for name, value in {**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}.items():
        clean_env.setenv(name, value)
    assert distributed.initialize().num_processes == 1


def test_a_too_late_device_count_is_refused(clean_env):
    with pytest.raises(ValueError, match="came too late"):
        distributed.initialize(cpu_devices=4)


LAUNCHED = {
    distributed.ENV_COORDINATOR_ADDRESS: "127.0.0.1:1234",
    distributed.ENV_NUM_PROCESSES: "2",
    distributed.ENV_PROCESS_ID: "1",
}


@pytest.mark.parametrize(
    "env, kwargs, message",
    [
        (
            {},
            {"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 2},
            "process_id 2 is out of range for 2 process",
        ),
        (
            LAUNCHED,
            {"num_processes": 3},
            r"initialize\(num_processes=3\) does not match the environment, which says EQXPAR_NUM_PROCESSES=2",
        ),
        ({}, {"num_processes": 2, "process_id": 0}, "also needs coordinator_address"),
        ({}, {"num_processes": 2}, "also needs coordinator_address and process_id"),
        ({}, {"coordinator_address": "localhost", "num_processes": 2, "process_id": 0}, "not of the form host:port"),
        (
            {},
            {"coordinator_address": "localhost:99999", "num_processes": 2, "process_id": 0},
            "port must be an integer",
        ),
        ({}, {"num_processes": 0}, "num_processes must be at least 1"),
        ({}, {"timeout_s": 0}, "timeout_s must be positive"),
        ({}, {"heartbeat_timeout_s": 0}, "heartbeat_timeout_s must be positive"),
        ({}, {"shutdown_timeout_s": -1.0}, "shutdown_timeout_s must be positive"),
        ({}, {"process_id": "0"}, "process_id must be an int"),
        ({distributed.ENV_NUM_PROCESSES: "two"}, {}, "EQXPAR_NUM_PROCESSES='two' is not an integer"),
        (LAUNCHED, {"cluster_detection_method": "slurm"}, "use one or the other"),
        # Valid settings, but this test session's JAX backend is already running.
        (LAUNCHED, {}, "before JAX starts a backend"),
        ({**SLURM, "SLURM_NTASKS": "2"}, {}, "before JAX starts a backend"),  # SLURM detected
    ],
)
def test_bad_settings_are_clear_errors(clean_env, env, kwargs, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        distributed.initialize(**kwargs)
    assert not jax.distributed.is_initialized()


def test_only_process_0_prints_and_logs(capsys):
    distributed.print_main("hello from", "process 0")
    assert capsys.readouterr().out == "hello from process 0\n"
    process_filter = distributed.MainProcessFilter()
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "message", None, None)
    assert process_filter.filter(record) and record.process_index == 0


@pytest.mark.slow
def test_a_process_count_that_contradicts_the_launcher_fails_every_rank(tmp_path):
    script = tmp_path / "three.py"
    script.write_text("import eqxpar.distributed\neqxpar.distributed.initialize(num_processes=3)\n")
    run = run_job(2, 2, str(script), timeout_s=90, check=False)
    assert run.returncode == 1
    assert "initialize(num_processes=3) does not match the environment, which says EQXPAR_NUM_PROCESSES=2" in run.stdout
    assert "exited with status 1" in run.stderr


ATTEMPT = """
import os, sys, time
import eqxpar.distributed
start = time.monotonic()
try:
    eqxpar.distributed.initialize(timeout_s=float(sys.argv[1]))
except TimeoutError as e:
    print(f"TimeoutError after {time.monotonic() - start:.1f} s: {e}", flush=True)
    os._exit(3)  # skip JAX's slow shutdown of the half-started runtime
print("connected", flush=True)
"""


@pytest.mark.slow
def test_wrong_start_ups_end_in_clear_errors():
    """Real processes started wrongly: no hang, and an error that says what to check.

    - process 0 of 2 started without process 1: the process count does not match the
      processes actually started;
    - process 1 of 2 whose coordinator (process 0) never starts;
    - two processes with different device counts.
    """
    runs = {}
    for rank in (0, 1):
        env = dict(os.environ)
        env.update(
            {
                distributed.ENV_COORDINATOR_ADDRESS: f"127.0.0.1:{free_port()}",
                distributed.ENV_NUM_PROCESSES: "2",
                distributed.ENV_PROCESS_ID: str(rank),
                distributed.ENV_DEVICES_PER_PROCESS: "1",
            }
        )
        runs[rank] = subprocess.Popen(
            [sys.executable, "-c", ATTEMPT, "3"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    # And a complete pair of processes, but with different device counts.
    address = f"127.0.0.1:{free_port()}"
    for rank in (0, 1):
        env = dict(os.environ)
        env.update(
            {
                distributed.ENV_COORDINATOR_ADDRESS: address,
                distributed.ENV_NUM_PROCESSES: "2",
                distributed.ENV_PROCESS_ID: str(rank),
                distributed.ENV_DEVICES_PER_PROCESS: str(rank + 1),
            }
        )
        runs[f"uneven{rank}"] = subprocess.Popen(
            [sys.executable, "-c", ATTEMPT, "30"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    out = {rank: p.communicate(timeout=60)[0] for rank, p in runs.items()}
    for rank in ("uneven0", "uneven1"):
        assert runs[rank].returncode != 0, out[rank]
        assert "different device counts (process 0: 1, process 1: 2)" in out[rank]
    assert runs[0].returncode == 3, out[0]
    assert "process 0 waited 3 s for all 2 processes to connect" in out[0]
    assert "num_processes must equal the number of processes actually started" in out[0]
    assert runs[1].returncode == 3, out[1]
    assert "process 1 could not reach the coordinator at 127.0.0.1:" in out[1]
    assert "within 3 s" in out[1]


# --- The multihost recipe: 2 processes x 4 devices = 1 process x 8 devices = 1 device --------

# Learning rate 0.2: the loss moves visibly in 8 steps (2.303 -> 2.227), so a process that
# loaded the wrong rows shows (with both processes loading rows 0..31 it ends at 2.204).
FLAGS = ("--steps", "8", "--batch-size", "64", "--learning-rate", "0.2")


@pytest.mark.slow
def test_multihost_recipe_matches_one_process_and_one_device(tmp_path):
    metrics_path = tmp_path / "two_processes.json"
    start = time.monotonic()
    run = run_job(2, 4, "recipes/multihost.py", *FLAGS, "--metrics-out", str(metrics_path))
    seconds = time.monotonic() - start
    two = json.loads(metrics_path.read_text())
    assert (two["processes"], two["devices"]) == (2, 8)
    # Each process loaded its own half of every global batch, and only process 0 printed
    # the summary.
    assert "[rank 0] process 0 loads rows 0..31 of every global batch of 64" in run.stdout
    assert "[rank 1] process 1 loads rows 32..63 of every global batch of 64" in run.stdout
    assert "[rank 0] multihost: 2 process(es) x 4 devices" in run.stdout
    assert "[rank 1] multihost:" not in run.stdout

    print(f"two processes: {seconds:.1f} s")
    eight = run_recipe("multihost", tmp_path, *FLAGS, "--mesh", "data=8")
    one = run_recipe("multihost", tmp_path, *FLAGS, "--mesh", "data=1")
    assert (eight["processes"], eight["devices"], one["devices"]) == (1, 8, 1)
    # The same data, model and updates; only the order of the float32 sums differs.
    for other in (eight, one):
        assert_trees_close(
            np.array([two["final_loss"], two["test_accuracy"]]),
            np.array([other["final_loss"], other["test_accuracy"]]),
            rtol=F32_RTOL,
            atol=F32_ATOL,
            what="2 processes vs one process",
        )
    print(f"final losses {two['final_loss']}, {eight['final_loss']}, {one['final_loss']}")
