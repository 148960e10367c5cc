"""metrics.jsonl survives a kill mid-write; unreadable images are named in the error."""

import json
import os

import pytest

from experiments import logs
from experiments.data import imagenet


def test_a_partial_last_line_is_ignored_and_resume_rewrites_atomically(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n" +
                  json.dumps({"step": 2, "loss": 0.5}) + "\n" + '{"step": 3, "lo')
  assert [r["step"] for r in logs.read_metrics(str(tmp_path))] == [1, 2]
  writer = logs.MetricsWriter(str(tmp_path), active=True, resume_step=1)
  writer.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
  assert not os.path.exists(str(path) + ".tmp")


def test_a_truncated_jpeg_is_named_in_the_error(tmp_path):
  bad = tmp_path / "n01440764_1.JPEG"
  bad.write_bytes(b"\xff\xd8\xff\xe0 truncated")
  with pytest.raises(ValueError, match=r"cannot decode image '.*n01440764_1\.JPEG'.*readable JPEG"):
    imagenet._open(str(bad))  # pylint: disable=protected-access
