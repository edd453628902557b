"""Joining JAX's distributed runtime with timeouts that raise instead of hanging or aborting.

Used by [`eqxpar.distributed.initialize`][]: `split_address` checks a `host:port`,
`bind_address` chooses where process 0's coordinator listens, `check_port_free` refuses a
port already in use (JAX would crash with SIGSEGV on it), `wait_for_coordinator` waits for
process 0's coordinator to listen, and `connect` runs `jax.distributed.initialize` with
eqxpar's timeouts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time

import jax

__all__ = ["split_address", "bind_address", "check_port_free", "wait_for_coordinator", "connect"]


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of `host:port`; a clear ValueError for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(
            f"coordinator address {address!r} is not of the form host:port (e.g. '127.0.0.1:1234' or 'node001:1234')."
        )
    try:
        port_number = int(port)
    except ValueError:
        port_number = -1
    if not 0 < port_number < 65536:
        raise ValueError(f"coordinator address {address!r}: the port must be an integer in 1..65535.")
    return host.strip("[]"), port_number


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def bind_address(address: str, given: str | None = None) -> str:
    """`host:port` where process 0's coordination service listens, for the coordinator `address`.

    `given` (or JAX's `JAX_COORDINATOR_BIND_ADDRESS`) wins. Otherwise a loopback coordinator
    (`127.0.0.1`, `localhost`, `::1`: a one-machine job) listens on loopback only, and an IP
    address listens on that address only; a host name keeps JAX's default, every interface
    (`[::]:PORT`), since a name can resolve differently on the host itself (Debian maps its
    own name to 127.0.1.1) and the other hosts must reach it.
    """
    if given is None:
        given = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or None
    if given is not None:
        split_address(given)
        return given
    host, port = split_address(address)
    if host == "localhost":
        return f"127.0.0.1:{port}"
    if _is_ip(host):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"[::]:{port}"


def check_port_free(bind: str, launched: bool, who: str = "eqxpar.distributed.initialize") -> None:
    """Raise a ValueError naming the port when the coordinator cannot listen at `bind`.

    JAX's coordination service crashes the process (SIGSEGV) on a port already in use; this
    binds a socket there first (SO_REUSEADDR, as gRPC does: on Linux only a listening socket
    conflicts, not connections closing in TIME_WAIT) and closes it again.
    """
    host, port = split_address(bind)
    if host in ("::", ""):
        family, target = socket.AF_INET6, ("::", port)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        target = (host, port)
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this machine: check every IPv4 interface instead
        family, target = socket.AF_INET, ("0.0.0.0", port)
        s = socket.socket(family, socket.SOCK_STREAM)
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(target)
        except OSError as e:
            how = (
                "pass another one with `python -m eqxpar.launch --port N`, or leave --port out "
                "and the launcher picks a free one"
                if launched
                else "give coordinator_address another port (one nothing listens on)"
            )
            raise ValueError(
                f"{who}: the coordinator port {port} is already in use "
                f"on this machine ({bind}: {e.strerror or e}); another job or program listens "
                f"there. Choose another port: {how}."
            ) from None


def wait_for_coordinator(address: str, timeout_s: float, process_id: int) -> None:
    """Block until something listens at `address`; a clear TimeoutError if nothing does in time."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"eqxpar.distributed.initialize: process {process_id} could not reach the "
                    f"coordinator at {address} within {timeout_s:g} s ({e}). The coordinator is "
                    f"process 0: check that it was started, that it did not fail (see its "
                    f"output), that every process was given the same address, and that this "
                    f"host can reach that host and port (firewalls). Raise timeout_s if process "
                    f"0 starts late."
                ) from None
            time.sleep(0.2)


def connect(
    address: str | None,
    num_processes: int | None,
    process_id: int | None,
    method: str | None,
    timeout_s: float,
    heartbeat_timeout_s: float,
    shutdown_timeout_s: float,
    bind: str | None = None,
) -> None:
    """jax.distributed.initialize with a timeout that raises instead of aborting the process.

    JAX aborts the whole process (a fatal C++ log message) when not every process connects
    within its `initialization_timeout`. We give JAX a much longer timeout and wait for it
    on a helper thread, so that our own, shorter timeout ends in a Python exception that says
    what to check.
    """
    failure: list[BaseException] = []

    def run():
        try:
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=num_processes,
                process_id=process_id,
                cluster_detection_method=method,
                coordinator_bind_address=bind,
                initialization_timeout=int(timeout_s) + 3600,
                heartbeat_timeout_seconds=max(1, round(heartbeat_timeout_s)),
                shutdown_timeout_seconds=max(1, round(shutdown_timeout_s)),
            )
        except BaseException as e:  # handed to the calling thread below
            failure.append(e)

    thread = threading.Thread(target=run, name="eqxpar-distributed-initialize", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        count = "the expected number of" if num_processes is None else f"all {num_processes}"
        raise TimeoutError(
            f"eqxpar.distributed.initialize: process {process_id} waited {timeout_s:g} s for "
            f"{count} processes to connect to the coordinator at {address}, and they did not. "
            f"Usually the process count is wrong (num_processes must equal the number of "
            f"processes actually started, each with a different process_id), or a process "
            f"failed before connecting (see its output), or the processes were given different "
            f"coordinator addresses. This process cannot recover: exit and restart the job."
        )
    if failure:
        raise failure[0]
