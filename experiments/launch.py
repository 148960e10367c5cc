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

SIGINT (Ctrl-C) and SIGTERM to the launcher are passed on to every process, which all stop at
the same step boundary after a checkpoint (:mod:`experiments.interrupt`); process 0 prints the
launcher's command to resume with, and the launcher waits for them all and exits with 128 plus
the signal's number. The processes run in a process group of their own, so that a Ctrl-C in a
terminal reaches them once, through the launcher. A process still running
``_INTERRUPT_GRACE_SECONDS`` after the signal, or when a second signal comes, is killed.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

from experiments import provenance

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Number of local processes.",
                                      lower_bound=1)
_MODULE = flags.DEFINE_string("module", "experiments.run",
                              "Module each process runs (experiments.run or experiments.sweep).")
# After one process fails, the others get SIGTERM, then SIGKILL this much later.
_TERMINATE_GRACE_SECONDS = 10
# After a signal to the launcher, the processes' time to reach a step boundary and checkpoint.
_INTERRUPT_GRACE_SECONDS = 60


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
  (0 when all succeed, otherwise the first failure's, ``128 + signal`` for a signal, also for a
  signal to the launcher, which it passes on to them)."""
  address = f"127.0.0.1:{free_port()}"
  processes = []
  for i in range(num_processes):
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(num_processes),
               JAX_PROCESS_ID=str(i), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               **{provenance.COMMAND_ENV: provenance.command()})
    processes.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env,
                                      process_group=0))
  status, kill_at = 0, None
  running = list(processes)
  received = []

  def pass_on(signum, frame):
    del frame
    nonlocal kill_at
    if received:  # a second signal: stop them at once
      kill_at = time.monotonic()
      return
    received.append(signum)
    print(f"experiments.launch: received {signal.Signals(signum).name}; passed on to the "
          f"{len(running)} running processes, waiting for them to stop (again to kill them)",
          file=sys.stderr, flush=True)
    for p in running:
      p.send_signal(signum)
    kill_at = time.monotonic() + _INTERRUPT_GRACE_SECONDS

  previous = ({s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
              if threading.current_thread() is threading.main_thread() else {})
  try:
    while running:
      for p in list(running):
        code = p.poll()
        if code is None:
          continue
        running.remove(p)
        if code and not status and not received:
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
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return 128 + received[0] if received else status


def main(argv):
  # Else every process would print Python's "No module named ..." and the launcher its status.
  try:
    found = importlib.util.find_spec(_MODULE.value) is not None
  except ModuleNotFoundError:  # its package does not exist
    found = False
  if not found:
    sys.exit(f"experiments.launch: --module={_MODULE.value!r} names no module; allowed: "
             "experiments.run, experiments.sweep")
  sys.exit(launch(argv[1:], _NUM_PROCESSES.value, _MODULE.value))


if __name__ == "__main__":
  app.run(main)
