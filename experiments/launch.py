"""Starts N local processes of a run (or sweep) joined by ``jax.distributed``, for testing.

  python -m experiments.launch --num_processes=2 -- \
      --config=configs/quickstart.py --workdir=runs/mp

Every process runs ``python -m <module> <args after -->`` with ``JAX_COORDINATOR_ADDRESS``
(127.0.0.1 and a free port), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set; the runner joins
them with gloo collectives on CPU (:mod:`experiments.distributed`). Each process exposes
``config.num_devices / num_processes`` CPU devices, so the mesh has the same global size as a
1-process run. Only process 0 writes logs. If any process fails, the launcher says which and how,
stops the others and exits with that process's status (a process killed by a signal: 128 plus the
signal's number, as a shell reports it). Restarting with the same arguments resumes from the last
checkpoint.
"""

import os
import signal
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Number of local processes.",
                                      lower_bound=1)
_MODULE = flags.DEFINE_string("module", "experiments.run",
                              "Module each process runs (experiments.run or experiments.sweep).")
# After one process fails, the others get SIGTERM, then SIGKILL this much later.
_TERMINATE_GRACE_SECONDS = 10


def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _describe(code: int) -> str:
  if code < 0:
    return f"was killed by {signal.Signals(-code).name}"
  return f"exited with status {code}"


def launch(args: list[str], num_processes: int, module: str = "experiments.run") -> int:
  """Runs ``python -m module *args`` in ``num_processes`` local processes; returns the exit status
  (0 when all succeed, otherwise the first failure's, ``128 + signal`` for a signal)."""
  address = f"127.0.0.1:{free_port()}"
  processes = []
  for i in range(num_processes):
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(num_processes),
               JAX_PROCESS_ID=str(i), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    processes.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env))
  status, kill_at = 0, None
  running = list(processes)
  while running:
    for p in list(running):
      code = p.poll()
      if code is None:
        continue
      running.remove(p)
      if code and not status:
        status = 128 - code if code < 0 else code
        print(f"experiments.launch: process {processes.index(p)} of {num_processes} "
              f"{_describe(code)}; stopping the others", file=sys.stderr, flush=True)
        for other in running:
          other.terminate()
        kill_at = time.monotonic() + _TERMINATE_GRACE_SECONDS
    if kill_at is not None and time.monotonic() > kill_at:
      for other in running:  # JAX may treat SIGTERM as a preemption notice and go on
        other.kill()
    time.sleep(0.2)
  return status


def main(argv):
  sys.exit(launch(argv[1:], _NUM_PROCESSES.value, _MODULE.value))


if __name__ == "__main__":
  app.run(main)
