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
"""

import os
import re

import jax

from configs import common

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
# any benchmark or reproduction asks for is 256.
MAX_CPU_DEVICES = 4096


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
  """``config.distributed.heartbeat_timeout_seconds`` (a default where the config lacks it)."""
  timeout = config.distributed.get("heartbeat_timeout_seconds",
                                   common.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS)
  if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
    raise ValueError(f"config.distributed.heartbeat_timeout_seconds={timeout!r} must be an int "
                     ">= 1 (seconds without a heartbeat before a process counts as dead)")
  return timeout


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
    ValueError: ``num_devices`` is not divisible by the number of processes, or asks each
      process for more than :data:`MAX_CPU_DEVICES` devices.
  """
  if config.num_devices is None:
    return
  _, num_processes, _ = process_settings(config)
  if config.num_devices < 1 or config.num_devices % num_processes:
    raise ValueError(f"config.num_devices={config.num_devices} must be a positive multiple of the "
                     f"{num_processes} processes")
  local_devices = config.num_devices // num_processes
  exposed = local_devices * max(1, config.get("workers_per_device", 1))
  if exposed > MAX_CPU_DEVICES:
    raise ValueError(
        f"config.num_devices={config.num_devices} with workers_per_device="
        f"{config.get('workers_per_device', 1)} over {num_processes} process(es) asks each "
        f"process for {exposed} devices; allowed: at most {MAX_CPU_DEVICES} per process")
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
  Must run before any JAX computation."""
  address, num_processes, process_id = process_settings(config)
  if num_processes == 1 or jax.distributed.is_initialized():
    return
  timeout = heartbeat_timeout(config)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                             process_id=process_id, heartbeat_timeout_seconds=timeout)
