"""The coordinator's port: a taken one is a clear error, and a one-machine job listens on loopback.

Real processes (gloo on 127.0.0.1, no mocks). JAX's coordination service crashes process 0
with SIGSEGV on a port that something already listens on; `eqxpar.launch --port` and
`eqxpar.distributed.initialize` refuse it first, naming the port and how to pick another.
"""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_failing_rank.py")
pytestmark = pytest.mark.slow


@pytest.fixture
def taken_port():
    """A port something listens on (on every interface, as another job's coordinator would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def check_refusal(run, port, who):
    err = run.stderr
    assert run.returncode not in (0, -11, 139), (run.returncode, err)  # no SIGSEGV
    line = [ln for ln in err.splitlines() if "already in use" in ln]
    assert len(line) == 1, err
    assert f"{who}: the coordinator port {port} is already in use on this machine" in line[0], err
    assert "--port" in line[0] and "leave --port out" in line[0], err
    assert "Segmentation fault" not in err and "SIGSEGV" not in err, err


def test_a_taken_port_through_the_launcher_is_refused_before_anything_starts(taken_port):
    start = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eqxpar.launch",
            "--nproc",
            "2",
            "--devices-per-proc",
            "1",
            "--port",
            str(taken_port),
            SCRIPT,
            "loop",
            "-1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    check_refusal(run, taken_port, "eqxpar.launch")
    assert run.returncode == 2, run.stderr
    assert "started as pid" not in run.stderr  # no rank was started
    print(f"launcher --port {taken_port} (taken): refused in {time.monotonic() - start:.1f} s")


def test_a_taken_port_through_initialize_is_a_value_error(taken_port):
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EQXPAR_", "SLURM_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        EQXPAR_COORDINATOR_ADDRESS=f"127.0.0.1:{taken_port}",
        EQXPAR_NUM_PROCESSES="2",
        EQXPAR_PROCESS_ID="0",
    )
    run = subprocess.run(
        [sys.executable, SCRIPT, "loop", "-1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    check_refusal(run, taken_port, "eqxpar.distributed.initialize")
    assert run.returncode == 1, run.stderr
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith(f"ValueError: eqxpar.distributed.initialize: the coordinator port {taken_port}")
    ), run.stderr
    print(f"initialize on taken port {taken_port}: ValueError in {time.monotonic() - start:.1f} s")


def listeners(port):
    """The local addresses of the TCP sockets listening on `port` (from /proc/net/tcp{,6})."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        with open(name) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                address, state = fields[1], fields[3]
                host, port_hex = address.split(":")
                if state == "0A" and int(port_hex, 16) == port:
                    found.append(host)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_a_one_machine_launch_listens_on_loopback_only(tmp_path):
    go = tmp_path / "go"
    script = tmp_path / "listen.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, time
        import eqxpar.distributed
        info = eqxpar.distributed.initialize(timeout_s=60)
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("start")
        print("ready", info.coordinator_address, flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
        multihost_utils.sync_global_devices("end")
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "eqxpar.launch", "--nproc", "2", "--devices-per-proc", "1", str(script)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = None
        for line in proc.stdout:  # blocks until the ranks are up (a signal, not a sleep)
            if line.startswith("[rank 0] ready "):
                port = int(line.split()[-1].rsplit(":", 1)[1])
                break
        assert port is not None, "rank 0 never got ready"
        hosts = listeners(port)
        go.write_text("")
        assert hosts, f"nothing listens on the coordinator port {port}"
        # 0100007F is 127.0.0.1 in /proc's byte order; the IPv4-mapped form in tcp6 too.
        loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
        assert set(hosts) <= loopback, f"the coordinator listens on {hosts}, not only on loopback"
        rest, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_where_the_coordinator_listens(monkeypatch):
    from eqxpar.distributed._runtime import bind_address

    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert bind_address("127.0.0.1:1234") == "127.0.0.1:1234"  # eqxpar.launch: loopback only
    assert bind_address("localhost:1234") == "127.0.0.1:1234"
    assert bind_address("10.0.0.5:1234") == "10.0.0.5:1234"  # an IP: that address only
    assert bind_address("[::1]:1234") == "[::1]:1234"
    assert bind_address("node001:1234") == "[::]:1234"  # a name: JAX's every interface
    assert bind_address("node001:1234", "10.0.0.5:1234") == "10.0.0.5:1234"  # given wins
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "0.0.0.0:1234")
    assert bind_address("127.0.0.1:1234") == "0.0.0.0:1234"
    with pytest.raises(ValueError, match="not of the form host:port"):
        bind_address("127.0.0.1:1234", "nonsense")
