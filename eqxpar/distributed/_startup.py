"""`initialize`: join JAX's distributed runtime (or do nothing for one process), and
print or log from process 0 only. The package's docstring (`eqxpar/distributed/__init__.py`)
says where the settings come from."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from typing import Any

import jax

from .._compat import backends_started, distributed_client
from .._mesh import simulate_cpu_devices
from ._failfast import install_fail_fast
from ._runtime import bind_address, check_port_free, connect, split_address, wait_for_coordinator

__all__ = [
    "initialize",
    "ProcessInfo",
    "print_main",
    "MainProcessFilter",
    "ENV_COORDINATOR_ADDRESS",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_DEVICES_PER_PROCESS",
]

# The launcher's interface: `eqxpar.launch` sets these for every process it starts.
ENV_COORDINATOR_ADDRESS = "EQXPAR_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "EQXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "EQXPAR_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "EQXPAR_DEVICES_PER_PROCESS"

# Cluster environments recognised from environment variables alone (no network queries), with
# the variables that give (process count, process id). JAX's own detection does the rest.
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI_VARS = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the job, as [`eqxpar.distributed.initialize`][] left it.

    `str(info)` is a one-line summary, e.g.
    `process 1 of 2: 4 local / 8 global cpu devices, coordinator 127.0.0.1:40211 (eqxpar.launch)`.
    """

    process_id: int
    num_processes: int
    local_device_count: int
    device_count: int
    platform: str
    coordinator_address: str | None
    source: str  # "single process", "arguments", "eqxpar.launch", "slurm", "ompi", or a JAX method

    @property
    def is_main(self) -> bool:
        """True in process 0, the one that prints and writes files."""
        return self.process_id == 0

    def __str__(self) -> str:
        where = f", coordinator {self.coordinator_address}" if self.coordinator_address else ""
        return (
            f"process {self.process_id} of {self.num_processes}: {self.local_device_count} local / "
            f"{self.device_count} global {self.platform} devices{where} ({self.source})"
        )


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer.") from None


def _pick(name: str, given: Any, env_name: str, env_value: Any):
    """The argument if given, else the environment's value; a conflict between them is an error."""
    if given is not None and env_value is not None and given != env_value:
        raise ValueError(
            f"initialize({name}={given!r}) does not match the environment, which says "
            f"{env_name}={env_value!r} (set by eqxpar.launch or your launcher). The process "
            f"count and ids must agree with how the processes were started: drop the argument "
            f"to use the launcher's value, or start the job with matching settings."
        )
    return given if given is not None else env_value


def _detected_cluster() -> tuple[str, int, int] | None:
    """(name, process count, process id) of a cluster recognised from its environment variables."""
    if all(v in os.environ for v in _SLURM_VARS):
        return "slurm", int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_PROCID"])
    if all(v in os.environ for v in _OMPI_VARS):
        return "ompi", int(os.environ["OMPI_COMM_WORLD_SIZE"]), int(os.environ["OMPI_COMM_WORLD_RANK"])
    return None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices: int | None = None,
    timeout_s: float = 60.0,
    cluster_detection_method: str | None = None,
    heartbeat_timeout_s: float = 30.0,
    shutdown_timeout_s: float = 120.0,
    fail_fast: bool = True,
    coordinator_bind_address: str | None = None,
) -> ProcessInfo:
    """Join this process to a multi-process JAX job, or do nothing for a single process.

    Call it once, at the top of the script, before any JAX array exists. Settings come from
    the arguments, else from `eqxpar.launch`'s environment variables, else from a detected
    cluster (SLURM, Open MPI, or the `cluster_detection_method` you name); with none of them
    this is a single-process run and only the CPU device count is set.

    For a multi-process run it turns on CPU collectives (gloo) so that collectives between
    processes also work on CPU, starts JAX's distributed runtime (process 0 hosts the
    coordinator), checks that every process ended up with the same number of devices, and
    makes a failure of any process end the whole job instead of hanging it (`fail_fast`).

    **Arguments:**

    - `coordinator_address`: `host:port` of process 0's coordinator service.
    - `num_processes`: how many processes take part.
    - `process_id`: this process's index, `0 <= process_id < num_processes`.
    - `cpu_devices`: simulated CPU devices for this process (see
      [`eqxpar.simulate_cpu_devices`][]); `None` leaves JAX's default. Under
      `eqxpar.launch` its `--devices-per-proc` (the `EQXPAR_DEVICES_PER_PROCESS`
      variable) takes precedence, so a recipe's `--devices` flag is ignored there.
    - `timeout_s`: how long to wait for the coordinator and for all processes to connect.
    - `cluster_detection_method`: a JAX cluster name (`"slurm"`, `"ompi"`, `"mpi4py"`,
      `"gketpu"`, `"gcetpu"`) to force JAX's auto-detection; default: only
      SLURM and Open MPI are detected, from their environment variables.
    - `heartbeat_timeout_s`: JAX's coordination service declares a process dead after this
      long without a heartbeat and then terminates every other process (JAX's default is
      100 s; 30 s keeps the time to notice a silently lost host under a minute).
    - `shutdown_timeout_s`: how long a process that reached the end of its script waits for
      the others to get there too. A process still running after that is taken to be stuck
      in a collective that a finished process skipped: the job fails (status 1). JAX's own
      default is 300 s; give more if one process legitimately works alone (no collectives)
      for longer at the end of a run.
    - `fail_fast`: in a multi-process run, install the failure handling of
      `eqxpar/distributed/_failfast.py`: an uncaught exception (any thread) in any process
      prints its traceback tagged `eqxpar: process i of n`, records the failure in the
      coordination service and ends the process at once with `os._exit` (status 1); a
      watchdog thread in every other process then ends that process with status
      `eqxpar.distributed.EXIT_PEER_FAILED` (75), printing which process failed and why.
      The job ends in seconds instead of hanging. `False` keeps Python's and JAX's behaviour.
    - `coordinator_bind_address`: `host:port` where process 0's coordination service
      listens. Default: where `coordinator_address` points when that is an IP address
      (`127.0.0.1` for `eqxpar.launch`: loopback only), every interface (`[::]:PORT`, JAX's
      default) when it is a host name; `JAX_COORDINATOR_BIND_ADDRESS` also sets it. The
      service has no authentication: see "What the coordinator exposes" in the multi-host
      guide.

    **Returns:**

    A [`eqxpar.distributed.ProcessInfo`][] describing this process and the device counts.

    **Raises:**

    - `ValueError` before anything starts: a process id out of range, a process count below
      1, an argument that contradicts the launcher's environment (e.g. a process count that
      does not match), a malformed address, a multi-process run requested after JAX's
      backend has already started, processes that ended up with different device counts, or
      (process 0) a coordinator port that is already in use on this machine.
    - `TimeoutError` if the coordinator cannot be reached, or not every process connects,
      within `timeout_s`.
    """
    for name, value in (
        ("timeout_s", timeout_s),
        ("heartbeat_timeout_s", heartbeat_timeout_s),
        ("shutdown_timeout_s", shutdown_timeout_s),
    ):
        if not value > 0:
            raise ValueError(f"initialize: {name} must be positive, got {value}.")
    for name, value in (("num_processes", num_processes), ("process_id", process_id), ("cpu_devices", cpu_devices)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"initialize: {name} must be an int, got {value!r}.")

    env_count = _env_int(ENV_NUM_PROCESSES)
    env_id = _env_int(ENV_PROCESS_ID)
    env_address = os.environ.get(ENV_COORDINATOR_ADDRESS) or None
    env_devices = _env_int(ENV_DEVICES_PER_PROCESS)

    address = _pick("coordinator_address", coordinator_address, ENV_COORDINATOR_ADDRESS, env_address)
    count = _pick("num_processes", num_processes, ENV_NUM_PROCESSES, env_count)
    pid = _pick("process_id", process_id, ENV_PROCESS_ID, env_id)
    if coordinator_address is not None or num_processes is not None or process_id is not None:
        source = "arguments"
    elif env_count is not None or env_address is not None:
        source = "eqxpar.launch"
    else:
        source = "single process"

    method = cluster_detection_method
    if source == "single process":
        detected = _detected_cluster()
        if method is not None:
            source = method
        elif detected is not None and detected[1] > 1:
            method, count, pid = detected
            source = method
    if method is not None and source != method:
        raise ValueError(
            f"initialize: cluster_detection_method={method!r} was given together with explicit "
            f"settings from the {source}; use one or the other."
        )

    if count is not None and count < 1:
        raise ValueError(f"initialize: num_processes must be at least 1, got {count}.")
    if count is not None and pid is not None and not 0 <= pid < count:
        raise ValueError(
            f"initialize: process_id {pid} is out of range for {count} process(es); ids run "
            f"from 0 to {count - 1}. Give each process a different id in that range."
        )
    if method is None and count is not None and count > 1:
        missing = [n for n, v in (("coordinator_address", address), ("process_id", pid)) if v is None]
        if missing:
            raise ValueError(
                f"initialize: a run with {count} processes also needs {' and '.join(missing)} "
                f"(as arguments or via {ENV_COORDINATOR_ADDRESS} / {ENV_PROCESS_ID}). Start "
                f"the processes with `python -m eqxpar.launch`, or pass all three settings."
            )
    if address is not None:
        split_address(address)

    devices = env_devices if env_devices is not None else cpu_devices
    if devices is not None and devices < 1:
        raise ValueError(f"initialize: the CPU device count must be at least 1, got {devices}.")

    multi = method is not None or (count is not None and count > 1)
    if jax.distributed.is_initialized():
        info = _process_info(address, source)
        if count is not None and info.num_processes != count:
            raise ValueError(
                f"initialize: JAX's distributed runtime is already running with "
                f"{info.num_processes} processes, not {count}."
            )
        return info
    if multi and backends_started():
        raise ValueError(
            "initialize: a multi-process run must join the distributed runtime before JAX "
            "starts a backend, but a backend is already running (an array was created or "
            "devices were listed). Call eqxpar.distributed.initialize() first thing in the "
            "script."
        )

    if devices is not None:
        simulate_cpu_devices(devices)
    if not multi:
        return _process_info(None, source)

    # Collectives between processes on the CPU backend need a cross-process implementation;
    # accelerator backends bring their own (NCCL, ICI), so this only matters on CPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    bind = None
    if address is not None:
        bind = bind_address(address, coordinator_bind_address)
        if pid == 0:  # process 0 hosts the coordination service: JAX crashes on a taken port
            check_port_free(bind, launched=source == "eqxpar.launch")
    if address is not None and pid not in (None, 0):
        wait_for_coordinator(address, timeout_s, pid)
    connect(address, count, pid, method, timeout_s, heartbeat_timeout_s, shutdown_timeout_s, bind)
    if fail_fast:
        install_fail_fast(
            distributed_client(), jax.process_index(), jax.process_count(), address, finish_timeout_s=shutdown_timeout_s
        )

    info = _process_info(address, source)
    if count is not None and info.num_processes != count:
        raise ValueError(f"initialize: expected {count} processes but JAX reports {info.num_processes}.")
    per_process = Counter(d.process_index for d in jax.devices())
    if len(set(per_process.values())) > 1:
        listing = ", ".join(f"process {p}: {n}" for p, n in sorted(per_process.items()))
        raise ValueError(
            f"initialize: the processes have different device counts ({listing}). Start every "
            f"process with the same number of devices (eqxpar.launch --devices-per-proc N)."
        )
    if devices is not None and info.platform == "cpu" and info.local_device_count != devices:
        raise ValueError(
            f"initialize: asked for {devices} CPU devices per process but this process has "
            f"{info.local_device_count}. Was JAX configured elsewhere (XLA_FLAGS, "
            f"jax_num_cpu_devices)?"
        )
    return info


def _process_info(address: str | None, source: str) -> ProcessInfo:
    return ProcessInfo(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
        platform=jax.devices()[0].platform,
        coordinator_address=address if jax.process_count() > 1 else None,
        source=source,
    )


def print_main(*values: Any, **print_kwargs: Any) -> None:
    """`print`, but only in process 0, so a multi-process job prints each message once.

    **Arguments:**

    - `*values`, `**print_kwargs`: as for the built-in `print` (`flush=True` is the default).

    **Returns:**

    Nothing.
    """
    if jax.process_index() == 0:
        print_kwargs.setdefault("flush", True)
        print(*values, **print_kwargs)


class MainProcessFilter(logging.Filter):
    """A `logging` filter that lets process 0 log everything and the others only warnings and up.

    ```python
    handler = logging.StreamHandler()
    handler.addFilter(eqxpar.distributed.MainProcessFilter())
    logging.getLogger("my_training").addHandler(handler)
    ```

    **Arguments:**

    - `min_level_elsewhere`: the lowest level that processes other than 0 still emit
      (default `logging.WARNING`: their problems are never hidden).
    """

    def __init__(self, min_level_elsewhere: int = logging.WARNING):
        super().__init__()
        self.min_level_elsewhere = min_level_elsewhere

    def filter(self, record: logging.LogRecord) -> bool:
        index = jax.process_index()
        record.process_index = index
        return index == 0 or record.levelno >= self.min_level_elsewhere
