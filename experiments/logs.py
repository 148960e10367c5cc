"""Run logs, written by process 0 only: ``metrics.jsonl``, TensorBoard events, ``config.json``.

``metrics.jsonl`` holds one JSON object per logged step (training metrics) or evaluation
(``test_*`` metrics), each with its ``step``. When a run resumes from a checkpoint, records after
the checkpoint's step (written before the interruption) are dropped, so the file describes one
uninterrupted run.
"""

import contextlib
import errno
import json
import math
import os
from collections.abc import Iterator
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of ``workdir/metrics.jsonl`` (empty if there is none).

  Raises:
    ValueError: a line other than the last is not a record (a JSON object with a ``step``),
      naming the file, the line's number and how to go on. Such a line is damage that no run
      writes, and the file is what reports are made of, so it is not skipped in silence.
  """
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  # Replaced, not refused, undecodable bytes: the line that holds them is then named below.
  with open(path, encoding="utf-8", errors="replace") as f:
    lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
  records = [_record(path, number, line) for number, line in lines[:-1]]
  try:
    records += [_record(path, number, line) for number, line in lines[-1:]]
  except ValueError:  # a run killed while appending leaves a partial last line
    pass
  return records


def _record(path: str, number: int, line: str) -> dict[str, Any]:
  """The record on line ``number`` of the metrics file ``path``."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    problem = f"is not JSON ({e})"
  else:
    if isinstance(record, dict) and isinstance(record.get("step"), int):
      return record
    problem = "is not a JSON object with an int step"
  raise ValueError(f"{path}, line {number} {problem}: {line.strip()[:80]!r}; each line is one "
                   f"record that the run wrote. Delete or repair that line (e.g. sed -i "
                   f"'{number}d' {path}) and run again: the checkpoints do not depend on it")


# The errors of a write that found no room: a full disk, or a full quota.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _naming_full_disk(path: str) -> Iterator[None]:
  """Re-raises a write's full-disk error naming ``path`` and what a rerun does: the bare
  ``[Errno 28] No space left on device`` names no file."""
  try:
    yield
  except OSError as e:
    if e.errno not in _NO_SPACE:
      raise
    raise OSError(e.errno, f"{path}: the disk is full ({os.strerror(e.errno)}); the log could "
                  "not be written. The checkpoints already written are kept: free space on that "
                  "disk and run again with the same --workdir to resume") from e


class MetricsWriter:
  """Appends metrics to ``metrics.jsonl`` and TensorBoard; a no-op on processes other than 0."""

  def __init__(self, workdir: str, *, active: bool, resume_step: int):
    """Args:
      workdir: the run's directory.
      active: whether this process writes (process 0).
      resume_step: the step the run starts from; later records are dropped.
    """
    self._active = active
    self._tb = None
    if not active:
      return
    os.makedirs(workdir, exist_ok=True)
    self._path = os.path.join(workdir, METRICS_FILE)
    kept = [r for r in read_metrics(workdir) if r["step"] <= resume_step]
    tmp = self._path + ".tmp"  # rewritten whole and renamed: a kill leaves the old or the new
    with _naming_full_disk(self._path), open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, self._path)
    # Here, not at the top: about a second to import, needed only by the process that writes,
    # and readers of metrics.jsonl (experiments.reproduce.report) import this module.
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self._tb_path = os.path.join(workdir, "tensorboard")
    with _naming_full_disk(self._tb_path):
      self._tb = SummaryWriter(self._tb_path, purge_step=resume_step + 1)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Records ``metrics`` at ``step``."""
    if not self._active:
      return
    with _naming_full_disk(self._path), open(self._path, "a") as f:
      f.write(json.dumps({"step": step, **metrics}) + "\n")
    for name, value in metrics.items():
      # TensorBoard gets finite numbers only (a diverged loss, or no ratio for one worker, stays
      # in metrics.jsonl).
      if isinstance(value, (int, float)) and math.isfinite(value):
        self._tb.add_scalar(name, value, step)
    with _naming_full_disk(self._tb_path):
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def summary(results: dict) -> str:
  """The final line printed by the runner: accuracy (and AUC where the task ranks), skipped
  steps and bytes per step against dense."""
  ranked = f"test AUC {results['auc']:.4f}, " if "auc" in results else ""
  accuracy = (f"{ranked}test accuracy {results['test_accuracy']:.4f} (test loss "
              f"{results['test_loss']:.4g}) after {results['step']} steps, "
              f"{results['skipped_steps']} skipped (non-finite gradient)")
  if not results["dense_bytes"]:
    return f"{accuracy}; one worker: no bytes travel"
  return (f"{accuracy}; bytes per worker per step {results['wire_bytes']:,.0f} vs dense "
          f"{results['dense_bytes']:,.0f} ({results['compression_ratio']:.1f}x fewer) over "
          f"{results['num_workers']} workers")


def write_json(path: str, payload: Any) -> None:
  """Writes ``payload`` as JSON atomically (a temporary file renamed into place)."""
  tmp = path + ".tmp"
  with _naming_full_disk(path), open(tmp, "w") as f:
    json.dump(payload, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
