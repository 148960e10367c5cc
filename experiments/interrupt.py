"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM: at a step boundary, after a checkpoint.

While :func:`experiments.train.train` runs, a first SIGINT or SIGTERM only asks the run to stop:
at its next step boundary the runner checkpoints that step and raises :class:`Interrupted`, which
the command-line entry points (:mod:`experiments.cli`) turn into ``interrupted at step N; resume
with: <command>`` and the exit status a shell gives a process the signal killed (128 + its
number: 130 for SIGINT, 143 for SIGTERM). A second signal acts at once, as if no handler were
installed; a restart then resumes from the last checkpoint.

Before the run's first step has completed, a signal stops it at once instead, with the same
status: nothing since its last checkpoint would be lost, and the wait for the next boundary may
be long (compilation) or endless (a collective that never completes). Python runs a signal
handler only when the main thread is back in the interpreter, never while it waits inside XLA,
so a thread of its own, woken by Python's C-level handler through ``signal.set_wakeup_fd``,
prints ``interrupted by <signal> before the run's first step completed ...; resume with:
<command>`` and ends the process.

In a multi-process run every process must stop at the same step: the checkpoint is written by
all processes together, and a process that stopped alone would leave the others blocked in a
collective. JAX's preemption service, started by ``jax.distributed.initialize``, does exactly
that for SIGTERM, which its own handler receives: every process reports its step count and all
stop at the first boundary each can still reach
(``jax.experimental.multihost_utils.reached_preemption_sync_point``). A SIGINT is passed on to it
as a SIGTERM; before the first step completes, a SIGINT stops the process at once (a SIGTERM,
which JAX's own handler receives, is kept for the first boundary). With the service off
(``jax_enable_preemption_service``), signals keep their default effect.
"""

import itertools
import signal
import socket
import sys
import threading

import jax
from jax.experimental import multihost_utils

from experiments import provenance
from experiments import watchdog

# Step boundaries this process has reached, over all its runs (a sweep's too): every process of
# a job reaches the same boundaries in the same order, so their counts agree, as the preemption
# service needs.
_BOUNDARIES = itertools.count(1)


class Interrupted(BaseException):
  """A run stopped at a step boundary on a signal.

  A BaseException, as KeyboardInterrupt is: an ``except Exception`` of a caller (a sweep that
  records a failed run and goes on to the next) lets it through.

  Attributes:
    step: the step the run stopped at (its checkpoint's, unless the run stopped where it started).
    signum: the signal that stopped it.
    workdir: the run's directory.
  """

  def __init__(self, step: int, signum: int, workdir: str):
    super().__init__(f"{workdir}: interrupted by {signal.Signals(signum).name} at step {step}")
    self.step = step
    self.signum = signum
    self.workdir = workdir

  @property
  def exit_status(self) -> int:
    """128 + the signal's number, as a shell reports a process killed by it."""
    return 128 + self.signum


class StopRequest:
  """Asks, at every step boundary, whether a signal asked the run to stop.

  A context manager: inside it, a SIGINT or SIGTERM before :meth:`step_completed` was first
  called stops the process at once, and the first one after it is recorded instead of acting
  (see the module docstring); the previous handlers come back on leaving. Outside the main
  thread (which alone receives signals) it installs nothing and never asks to stop.
  """

  def __init__(self):
    self.signum: int | None = None
    self._previous = {}
    self._synced = False
    self._is_main = True
    self._stepped = False
    self._wakeup: tuple[socket.socket, socket.socket] | None = None  # (read end, write end)
    self._previous_wakeup_fd = -1

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is not threading.main_thread():
      return self
    multi_process = jax.process_count() > 1
    if multi_process and not jax.config.jax_enable_preemption_service:
      return self
    self._synced = multi_process
    self._is_main = jax.process_index() == 0
    # JAX's preemption service owns SIGTERM in a multi-process run.
    for signum in (signal.SIGINT,) if multi_process else (signal.SIGINT, signal.SIGTERM):
      self._previous[signum] = signal.signal(signum, self._handle)
    read, write = socket.socketpair()
    write.setblocking(False)  # Python's C-level handler must never wait on it
    self._wakeup = (read, write)
    self._previous_wakeup_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=self._stop_at_once, args=(read,), name="stop-at-once",
                     daemon=True).start()
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()
    if self._wakeup is not None:
      signal.set_wakeup_fd(self._previous_wakeup_fd)
      read, write = self._wakeup
      write.send(b"\0")  # no signal's number: tells the thread to end (it closes the read end)
      write.close()
      self._wakeup = None

  def step_completed(self) -> None:
    """Says that a training step has completed: from now on a first signal stops the run at
    the next step boundary, after a checkpoint, instead of at once."""
    self._stepped = True

  def _stop_at_once(self, read: socket.socket) -> None:
    """Reads the numbers of the signals received; ends the process on one of this request's
    before the first step has completed; returns when told to end."""
    with read:
      while (received := read.recv(1)) and received[0]:
        if self._stepped or received[0] not in self._previous:
          continue
        name = signal.Signals(received[0]).name
        watchdog.stop_process(
            f"interrupted by {name} before the run's first step completed: stopped at once, "
            f"nothing lost since its last checkpoint; resume with: {provenance.command()}"
            if self._is_main else None, 128 + received[0])

  def _handle(self, signum, frame) -> None:
    del frame
    if not self._stepped:  # _stop_at_once ends the process
      return
    if self.signum is None:
      self.signum = signum
    signal.signal(signum, signal.SIG_DFL)  # a second one acts at once
    if self._synced:
      signal.raise_signal(signal.SIGTERM)  # to JAX's preemption service, and every process
    if self._is_main:
      print(f"received {signal.Signals(signum).name}: stopping at the next step boundary, after "
            "a checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)

  def should_stop(self) -> bool:
    """Whether to stop at this step boundary; every process of a job gets the same answer.
    Call it at every boundary, in every process."""
    if self._synced:
      return multihost_utils.reached_preemption_sync_point(next(_BOUNDARIES))
    return self.signum is not None

  def stopping_signal(self) -> int:
    """The signal to report: this process's first, else SIGTERM (the preemption service's)."""
    return self.signum or signal.SIGTERM
