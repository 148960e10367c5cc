"""Processes and devices: ``jax.distributed`` set-up and the simulated CPU device count.

The host platform's device count is a JAX setting read when JAX initialises its backends, on the
first computation: :func:`expose_cpu_devices` sets it after ``import jax`` and before that.

Multi-process runs are configured by ``config.distributed`` or, where a field is None, by the
environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (what
``experiments.launch`` sets). With neither, a run is a single process. CPU collectives between
processes use gloo.

A process that dies leaves the others blocked in a collective: gloo does not notice. The
coordination service (hosted by process 0) does: a process that has sent no heartbeat for
``config.distributed.heartbeat_timeout_seconds`` is declared dead, and every other process is
then terminated by JAX with "Terminating process because the JAX distributed service detected
fatal errors ... another task died" (exit status 134), within that timeout. If process 0 dies,
the service dies with it and the others stop as soon as they lose their connection to it; no
timeout is waited for (``tests/test_failures.py`` kills a process and checks that the others
stop).

SIGTERM goes to JAX's preemption service in a multi-process run: the runner stops every process
at the same step boundary, after a checkpoint (:mod:`experiments.interrupt`).

Joining: every process says at once that it waits for the others at the coordinator's address,
and one that is not joined by all of them within ``config.distributed.join_timeout_seconds``
says which are missing where it can tell and exits with status 1 (:func:`initialize`), before
JAX's own deadline would end it with a C++ "fatal errors ... DEADLINE_EXCEEDED" dump that names
no process.
"""

import contextlib
import importlib.metadata
import importlib.util
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator

import jax

from configs import common
from experiments import watchdog

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Simulated CPU devices run on one thread pool of as many threads as devices. Runs of 8 devices
# on 2 busy cores occasionally hung in a collective that 6 or 7 of the 8 devices had reached. Since
# each device runs its matrix products on its own thread (no work fanned out over the shared pool)
# and the trainer keeps one program in flight at a time, no run has hung.
_SHARED_POOL_FLAGS = {"--xla_cpu_multi_thread_eigen": "false"}
# On a loaded machine a device may wait long for a core; XLA's CPU collectives abort after 40 s
# without all participants.
_TIMEOUT_FLAGS = {"--xla_cpu_collective_call_terminate_timeout_seconds": "3600"}
# Simulated CPU devices per process. Each is a thread with its own buffers: 10,000 took 34 s to
# fail at the first check, 100,000 grew memory by 60 MB/s for minutes without a word; the most
# any benchmark or reproduction asks for is 256. Below this, memory bounds them: exposing 4,096
# took 0.1 MiB each (637 MB against 334 MB for 1,024), and each device is allowed 40 times that,
# for the programs compiled for it (:func:`max_cpu_devices`).
MAX_CPU_DEVICES = 4096
_MEMORY_PER_CPU_DEVICE = 4 << 20
# Simulated CPU devices per process that run a program with a collective. XLA's CPU runtime runs
# each device's part of a collective on a thread of a pool of min(max(cores, devices), 256)
# threads, and a participant holds its thread until all have arrived: with more than 256
# devices the rest never get a thread, and the first all-reduce waits forever (measured on 2
# cores, 24 GiB: a quickstart smoke run of 256 devices trains in 8 s with 0.5 MB per device more
# than at 64; one of 257 waits with 256 of them arrived). The cores never lower the bound: the
# pool has a thread per device up to 256 however few the cores, and 256 devices on 2 cores take
# turns. Memory bounds them through the devices exposed (above).
MAX_RUNNING_CPU_DEVICES = 256
# JAX's deadline for the join comes this much after ours, so that ours speaks first.
_JOIN_DEADLINE_MARGIN_SECONDS = 30


def process_settings(config) -> tuple[str | None, int, int]:
  """``(coordinator_address, num_processes, process_id)`` from the config or the environment."""
  d = config.distributed
  address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num_processes = d.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "1"))
  process_id = d.process_id if d.process_id is not None else int(
      os.environ.get("JAX_PROCESS_ID", "0"))
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(f"config.distributed: num_processes={num_processes} and "
                     f"process_id={process_id} must satisfy 0 <= process_id < num_processes")
  if num_processes > 1 and not address:
    raise ValueError("config.distributed.coordinator_address (or JAX_COORDINATOR_ADDRESS) must be "
                     f"set for num_processes={num_processes}, e.g. 127.0.0.1:12345")
  return address, num_processes, process_id


def heartbeat_timeout(config) -> int:
  """``config.distributed.heartbeat_timeout_seconds``, checked (a default where the config
  lacks it)."""
  return _setting(config, "heartbeat_timeout_seconds", common.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS)


def join_timeout(config) -> int:
  """``config.distributed.join_timeout_seconds``, checked (a default where the config lacks
  it)."""
  return _setting(config, "join_timeout_seconds", common.DEFAULT_JOIN_TIMEOUT_SECONDS)


def _setting(config, field: str, default: int) -> int:
  """``config.distributed.<field>`` checked against its rule (``configs.common.RULES``); read
  before the config's other checks, as the processes join first."""
  name = f"distributed.{field}"
  return common.RULES[name].check(config.distributed.get(field, default), f"config.{name}")


def max_cpu_devices() -> int:
  """The most CPU devices a process may expose: :data:`MAX_CPU_DEVICES`, fewer where this
  machine's memory holds fewer."""
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return min(MAX_CPU_DEVICES, memory // _MEMORY_PER_CPU_DEVICE)


def check_running_cpu_devices(count: int, num_processes: int = 1) -> None:
  """Refuses ``count`` simulated CPU devices per process in a mesh that runs collectives where
  they would wait forever (:data:`MAX_RUNNING_CPU_DEVICES`).

  Raises:
    ValueError: more than :data:`MAX_RUNNING_CPU_DEVICES`, naming what to do instead.
  """
  if count <= MAX_RUNNING_CPU_DEVICES:
    return
  raise ValueError(
      f"config.num_devices={count * num_processes} over {num_processes} process(es) runs "
      f"{count} simulated CPU devices in each; allowed: at most {MAX_RUNNING_CPU_DEVICES} per "
      "process (XLA's CPU runtime gives a collective at most that many threads, so the first "
      "all-reduce of more would wait forever); simulate more workers with "
      "config.workers_per_device, or run more processes (experiments.launch)")


def _cpu_only() -> bool:
  """Whether JAX can only run on the CPU here, told without starting it: ``JAX_PLATFORMS``
  names the CPU alone, or no accelerator plugin (what JAX would load) is installed."""
  if jax.config.jax_platforms:
    return set(jax.config.jax_platforms.split(",")) == {"cpu"}
  return not (importlib.metadata.entry_points(group="jax_plugins")
              or importlib.util.find_spec("jax_plugins") or importlib.util.find_spec("libtpu"))


def expose_cpu_devices(config) -> None:
  """Makes the CPU platform expose ``config.num_devices x workers_per_device / num_processes``
  devices per process: the mesh's devices, and with simulated workers as many as their bytes
  are read from (the program of one worker per device is compiled for them, never run).

  Sets ``jax_num_cpu_devices``, with a generous collective timeout and, for several devices per
  process in the mesh, single-threaded Eigen per device (see the XLA flags above); harmless on
  accelerators, whose devices are real (the CPU's serve the bytes of simulated workers there
  too). JAX reads both when it initialises its backends, so this must run before the first JAX
  computation; where the backends already run (a test process that set its own count), it
  changes nothing, and the mesh checks that enough devices exist.

  Raises:
    ValueError: ``num_devices`` is not divisible by the number of processes, asks each process
      for more devices than :func:`max_cpu_devices`, or, where JAX can only run on the CPU, for
      more devices in the mesh than can run a collective (:func:`check_running_cpu_devices`).
  """
  if config.num_devices is None:
    return
  _, num_processes, _ = process_settings(config)
  if config.num_devices < 1 or config.num_devices % num_processes:
    raise ValueError(f"config.num_devices={config.num_devices} must be a positive multiple of the "
                     f"{num_processes} processes")
  local_devices = config.num_devices // num_processes
  exposed = local_devices * max(1, config.get("workers_per_device", 1))
  if exposed > max_cpu_devices():
    raise ValueError(
        f"config.num_devices={config.num_devices} with workers_per_device="
        f"{config.get('workers_per_device', 1)} over {num_processes} process(es) asks each "
        f"process for {exposed} devices; allowed: at most {max_cpu_devices()} per process")
  if _cpu_only():  # on an accelerator the mesh's devices are real, the CPU's compile only
    check_running_cpu_devices(local_devices, num_processes)
  try:
    jax.config.update("jax_num_cpu_devices", exposed)
  except RuntimeError:  # the backends already run: their device count stays
    return
  flags = re.sub(_DEVICE_COUNT_FLAG + r"=\S*", "", os.environ.get("XLA_FLAGS", ""))
  extra = {**_TIMEOUT_FLAGS, **(_SHARED_POOL_FLAGS if local_devices > 1 else {})}
  flags += "".join(f" {k}={v}" for k, v in extra.items() if k not in flags)
  os.environ["XLA_FLAGS"] = flags.strip()


def initialize(config) -> None:
  """Joins the multi-process job described by the config or the environment (no-op for one
  process, or when already joined), with the heartbeat timeout of :func:`heartbeat_timeout`.
  Must run before any JAX computation.

  Says on stderr, at once, that this process waits for the others at the coordinator's address;
  if they have not all joined within :func:`join_timeout`, says which are missing where this
  process can tell (the coordinator, process 0, when nothing answers at its address; else the
  processes other than this one and process 0) and exits with status 1
  (:mod:`experiments.watchdog`). A Ctrl-C while it waits ends the process at once.
  """
  address, num_processes, process_id = process_settings(config)
  if num_processes == 1 or jax.distributed.is_initialized():
    return
  timeout, waiting = heartbeat_timeout(config), join_timeout(config)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  print(f"process {process_id} of {num_processes}: waiting for the {num_processes} processes to "
        f"join at {address} (up to {waiting} s: config.distributed.join_timeout_seconds)",
        file=sys.stderr, flush=True)
  with watchdog.Watchdog().watching(
      lambda: _missing_processes(address, num_processes, process_id), waiting,
      "config.distributed.join_timeout_seconds",
      "start every process of the job, each with its own process id and the same coordinator "
      "address and process count (experiments.launch does), or raise the timeout"
  ), _sigint_ends_the_process():
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=timeout,
                               initialization_timeout=waiting + _JOIN_DEADLINE_MARGIN_SECONDS)


@contextlib.contextmanager
def _sigint_ends_the_process() -> Iterator[None]:
  """Inside the body, a Ctrl-C (SIGINT) ends the process at once, as a SIGTERM does: Python's
  handler, which raises KeyboardInterrupt, would run only once the body's wait in C++ returns.
  Outside the main thread (which alone receives signals) it changes nothing."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _missing_processes(address: str, num_processes: int, process_id: int) -> str:
  """What a process that has not joined its job waits for, as far as it can tell: process 0
  hosts the coordinator at ``address``, so whether anything answers there tells whether
  process 0 is missing."""
  others = [i for i in range(num_processes) if i not in (process_id, 0)]
  if process_id and not _answers(address):
    missing = "process 0, the coordinator: nothing answers at its address"
  elif not others:
    missing = ("none this process can name: process 0 answers at the address, so the processes "
               "may disagree on the address or the process count")
  elif len(others) == 1:
    missing = f"process {others[0]}"
  else:
    missing = f"one or more of processes {', '.join(map(str, others))}"
  return (f"process {process_id} of {num_processes}: the join of the job's {num_processes} "
          f"processes at {address} (missing: {missing})")


def _answers(address: str) -> bool:
  """Whether something accepts a connection at ``address`` (``host:port``) within 5 s."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
      return True
  except (OSError, ValueError):
    return False
