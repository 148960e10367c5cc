"""metrics.jsonl survives a kill mid-write."""

import json
import os

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
