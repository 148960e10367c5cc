"""One run per workdir: ``<workdir>/run.lock``, held while a run trains.

Two runs on one workdir would write the same checkpoints and logs and prune each other's
checkpoints (a second run crashed inside orbax on a checkpoint the first had just deleted). A run
therefore holds an exclusive ``flock`` on ``run.lock`` from its start to its exit, and writes its
pid, host and command into it so that a second run can say who holds the workdir. The operating
system drops the ``flock`` of a process that dies however it dies (``kill -9`` included), so a
lock left by a dead run never blocks: the next run takes it over and says whose it was. The file
stays when the run ends, emptied (an empty file is a free lock): deleting it would let a run that
opened it just before lock a file no one else sees.

The lock is judged by the ``flock`` alone: the pid in the file only names the holder in messages.
Judging by whether that pid is alive blocked every resume once the dead run's pid belonged to an
unrelated process; the price is that on a filesystem whose ``flock`` locks nothing (some network
filesystems) two runs on one workdir are not kept apart.

Nothing here imports JAX: in a multi-process run only process 0 takes the lock, and the runner
tells the other processes whether it could (:func:`experiments.train.train`).
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket
from collections.abc import Iterator

from absl import logging

from experiments import provenance

LOCK_FILE = "run.lock"


class WorkdirInUse(RuntimeError):
  """Another run holds the workdir's lock."""


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
  """Holds ``workdir``'s lock for the body (creating ``workdir`` if need be).

  Raises:
    WorkdirInUse: a live process holds its ``flock`` (the message names the run the file names,
      and how to find and stop the process that holds it).
  """
  path = os.path.join(workdir, LOCK_FILE)
  os.makedirs(workdir, exist_ok=True)
  with open(path, "a+", encoding="utf-8") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise WorkdirInUse(_in_use(workdir, _holder(f))) from None
    previous = _holder(f)
    if previous:
      logging.warning("%s: taking over the lock of a run that ended without releasing it (%s)",
                      workdir, _describe(previous))
    _write(f, {"pid": os.getpid(), "host": socket.gethostname(),
               "since": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": provenance.command()})
    try:
      yield
    finally:
      _write(f, None)
      fcntl.flock(f, fcntl.LOCK_UN)


def _holder(f) -> dict | None:
  """The holder the lock file names (None when empty; a file cut short names no one)."""
  f.seek(0)
  try:
    return json.loads(f.read() or "null")
  except ValueError:
    return {"pid": None, "host": "?", "command": "(unreadable lock file)"}


def _write(f, holder: dict | None) -> None:
  f.seek(0)
  f.truncate()
  if holder is not None:
    f.write(json.dumps(holder))
  f.flush()


def _describe(holder: dict | None) -> str:
  if not holder:
    return "a run that did not say who it is"
  command = " ".join(str(holder.get("command")).split())  # on one line, as the error is
  return (f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}: "
          f"{command}")


def _in_use(workdir: str, holder: dict | None) -> str:
  path = os.path.join(workdir, LOCK_FILE)
  # A live process holds the flock (a run, or a process it started that kept the file open):
  # deleting the file would free the workdir for a second run while the first still writes it.
  return (f"workdir={workdir!r} is in use by another run ({_describe(holder)}); one run per "
          f"workdir: wait for it to end, stop it, or use another --workdir. Its lock {path} "
          f"frees itself when the process that holds it ends (`fuser -v {path}` names that "
          "process); do not delete the file while it runs")
