"""No silent hang: a thread that ends the process when what it watches does not complete in time.

A training step blocked in a collective (a device or a process that never arrives), or a process
waiting for the others of its job to join, waits inside XLA or JAX's C++ code, where no Python
code of the waiting thread runs again and no exception can reach it. :class:`Watchdog` watches
from a thread of its own: when something watched has not completed within its time, it flushes
the logs, prints one line on stderr naming what was waited for, the setting that bounds it and
what to do, and ends the process with :data:`EXIT_STATUS` (``os._exit``: the waiting thread
cannot be unwound). Nothing is lost that a kill would not lose: checkpoints are written
atomically, and a restart resumes from the last one.

The runner watches each training step and the reading of its batch
(:func:`experiments.train.train`, bounded by ``config.stall_timeout_seconds``; the first step of
each kind is compiled before its clock starts, and evaluations and checkpoints are not watched)
and the join of a multi-process job (:func:`experiments.distributed.initialize`, bounded by
``config.distributed.join_timeout_seconds``).
"""

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from absl import logging

EXIT_STATUS = 1


class Watchdog:
  """Ends the process when a :meth:`watching` block runs past its time.

  One thread, started by the first block, serves every block of the watchdog; blocks run one
  after the other (a new block replaces the one watched).
  """

  def __init__(self):
    self._changed = threading.Condition()
    self._watched: tuple[Callable[[], str], float, str, str] | None = None
    self._deadline = 0.0
    self._thread: threading.Thread | None = None

  @contextlib.contextmanager
  def watching(self, what: str | Callable[[], str], seconds: float, setting: str,
               hint: str) -> Iterator[None]:
    """Watches the body: if it has not completed within ``seconds`` (0: never watched), prints
    ``stalled: <what> has not completed within <setting>=<seconds> s; <hint>`` and ends the
    process.

    Args:
      what: what the body waits for, or a function saying it (called only when it is late, so
        it may look around, e.g. at which processes answer).
      seconds: the body's time.
      setting: the config field that sets ``seconds``, for the message.
      hint: why it may wait forever and what to do.
    """
    if not seconds:
      yield
      return
    describe = what if callable(what) else lambda: what
    with self._changed:
      self._watched = (describe, seconds, setting, hint)
      self._deadline = time.monotonic() + seconds
      if self._thread is None:
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()
      self._changed.notify()
    try:
      yield
    finally:
      with self._changed:
        self._watched = None
        self._changed.notify()

  def _watch(self) -> None:
    with self._changed:
      while True:
        if self._watched is None:
          self._changed.wait()
          continue
        left = self._deadline - time.monotonic()
        if left > 0:
          self._changed.wait(left)
          continue
        describe, seconds, setting, hint = self._watched
        self._watched = None  # a block is stopped once (a test's stop_process returns)
        stop_process(f"stalled: {describe()} has not completed within {setting}={seconds:g} s; "
                     f"{hint}", EXIT_STATUS)


def stop_process(line: str | None, status: int) -> None:
  """Flushes the logs, prints ``line`` (if any) on stderr and ends the process with ``status``
  at once, from any thread (the main thread may be blocked where nothing can unwind it)."""
  logging.flush()
  sys.stdout.flush()
  if line is not None:
    print(line, file=sys.stderr, flush=True)
  sys.stderr.flush()
  os._exit(status)  # pylint: disable=protected-access
