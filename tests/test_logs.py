"""metrics.jsonl survives a kill mid-write, and a damaged line is named with its file."""

import errno
import json
import os
import re

import pytest

from experiments import logs


def test_a_partial_last_line_is_ignored_and_resume_rewrites_atomically(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n" +
                  json.dumps({"step": 2, "loss": 0.5}) + "\n" + '{"step": 3, "lo')
  assert [r["step"] for r in logs.read_metrics(str(tmp_path))] == [1, 2]
  writer = logs.MetricsWriter(str(tmp_path), active=True, resume_step=1)
  writer.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
  assert not os.path.exists(str(path) + ".tmp")


@pytest.mark.parametrize("damage, problem", [
    (b"garbage", r"is not JSON \(Expecting value: line 1 column 1 \(char 0\)\): 'garbage'"),
    (b"\xff\xfe\x00", r"is not JSON \(.*\): '.*'"),
    (b"[1, 2]", r"is not a JSON object with an int step: '\[1, 2\]'"),
])
def test_a_damaged_line_before_the_last_names_the_file_and_line(damage, problem, tmp_path):
  """Not only the JSON error, which names neither: the run's resume reads the file."""
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"step": 1, "loss": 1.0}\n' + damage + b'\n{"step": 2, "loss": 0.5}\n')
  with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line 2 {problem}; .*Delete or "
                                       rf"repair that line \(e.g. sed -i '2d' "):
    logs.MetricsWriter(str(tmp_path), active=True, resume_step=2)
  assert path.read_bytes().startswith(b'{"step": 1, "loss": 1.0}\n' + damage)  # left as it was



def test_tensorboard_gets_finite_scalars_only(tmp_path):
  """A diverged loss, or no ratio for one worker, stays in metrics.jsonl; TensorBoard warns on
  every NaN or Inf it receives, so it receives none."""
  writer = logs.MetricsWriter(str(tmp_path), active=True, resume_step=0)
  received = []
  writer._tb.add_scalar = lambda name, value, step: received.append(name)  # pylint: disable=protected-access
  writer.write(1, {"loss": float("nan"), "ratio": float("inf"), "none": None, "accuracy": 0.5,
                   "skipped_steps": 0})
  writer.close()
  assert received == ["accuracy", "skipped_steps"]
  assert logs.read_metrics(str(tmp_path))[0]["ratio"] == float("inf")


def test_a_full_disk_is_one_line_naming_the_log_and_what_is_kept(small_disk):
  """The bare ``[Errno 28] No space left on device`` names no file."""
  with open(small_disk / "filler", "wb", buffering=0) as f:  # fill the disk
    with pytest.raises(OSError):
      while True:
        f.write(b"\0" * 4096)
  path = str(small_disk / "results.json")
  with pytest.raises(OSError) as full:
    logs.write_json(path, {"loss": list(range(10_000))})
  assert full.value.errno == errno.ENOSPC
  assert str(full.value).startswith(f"[Errno {errno.ENOSPC}] {path}: the disk is full")
  assert "checkpoints already written are kept" in str(full.value)
