"""Click logs (experiments/data/criteo.py) and their metrics (experiments/ctr_metrics.py)."""

import itertools
import math

import ml_collections
import numpy as np
import pytest

from experiments import ctr_metrics
from experiments.data import criteo
from experiments.data import pipeline
from experiments.models import dlrm

ROWS = (1000,) * 24 + (7, 3)


def _line(label="1", integers=None, categories=None):
  integers = integers if integers is not None else [str(i) for i in range(13)]
  categories = categories if categories is not None else [f"{i:08x}" for i in range(26)]
  return "\t".join([label, *integers, *categories]) + "\n"


def test_the_tsv_reader_transforms_hashes_and_streams(tmp_path):
  integers = ["5", "", "-3"] + ["0"] * 10
  categories = ["68fd1e64", "", "FFFFFFFF"] + ["0"] * 23
  path = tmp_path / "day.tsv"
  path.write_text(_line("0", integers, categories) + _line() * 4)
  batches = list(criteo.read_tsv(str(path), ROWS, batch_size=2))
  assert [len(b["label"]) for b in batches] == [2, 2, 1]
  first = batches[0]
  assert first["label"].tolist() == [0.0, 1.0]
  # log(1 + x), an empty field 0, a negative clipped to 0 (the DLRM reference's transform).
  np.testing.assert_allclose(first["dense"][0, :3], [math.log(6.0), 0.0, 0.0], rtol=1e-6)
  np.testing.assert_allclose(first["dense"][1, 12], math.log(13.0), rtol=1e-6)
  assert first["sparse"][0, :3].tolist() == [0x68fd1e64 % 1000, 0, 0xFFFFFFFF % 1000]
  assert first["sparse"][1, 24:].tolist() == [24 % 7, 25 % 3]
  assert first["sparse"].dtype == np.int32 and first["dense"].dtype == np.float32
  resumed = next(criteo.read_tsv(str(path), ROWS, batch_size=2, start_line=3))
  np.testing.assert_array_equal(resumed["sparse"], batches[1]["sparse"][1:].repeat(2, 0))


@pytest.mark.parametrize("bad,message", [
    (_line()[:-1] + "\textra\n", r"line 3: 41 columns; allowed: 40 \(label, 13 integers, 26"),
    (_line(categories=["12zz"] + ["0"] * 25), r"line 3: category 0 '12zz' is not hexadecimal"),
    (_line(categories=["0x12"] + ["0"] * 25), r"line 3: category 0 '0x12' is not hexadecimal"),
    (_line(integers=["1.5"] + ["0"] * 12), r"line 3: integer feature 0 '1.5' is not an integer"),
    (_line(label="2"), r"line 3: label '2'; allowed: 0 or 1"),
])
def test_a_bad_line_is_refused_in_one_line_naming_its_number_after_the_rows_before_it(
    tmp_path, bad, message):
  path = tmp_path / "day.tsv"
  path.write_text(_line() * 2 + bad + _line())
  batches = criteo.read_tsv(str(path), ROWS, batch_size=2)
  assert len(next(batches)["label"]) == 2  # streamed: the rows before it were read
  with pytest.raises(ValueError, match=rf"^criteo_tsv {path} {message}") as e:
    next(batches)
  assert "\n" not in str(e.value)


def test_each_tables_top_percent_takes_ninety_percent_of_its_lookups():
  for rows in (100, 155, 2209, 20000):
    assert criteo.top_share(criteo.calibrated_exponent(rows), rows) == pytest.approx(0.9, abs=1e-6)
  assert criteo.calibrated_exponent(63) == 0.0  # no top 1% of 63 rows: uniform


def test_the_synthetic_logs_top_percent_of_rows_takes_about_ninety_percent_of_lookups():
  rows = dlrm.capped(dlrm.MLPERF_DCNV2_ROWS, 20000)
  generator = criteo.Generator(rows, dlrm.MLPERF_DCNV2_HOTNESS, seed=0)
  sample = generator.sample(8192, seed=0)
  counts, start = [], 0
  for t, h in enumerate(dlrm.MLPERF_DCNV2_HOTNESS):
    counts.append(np.bincount(sample["sparse"][:, start:start + h].ravel(), minlength=rows[t]))
    start += h
  counts = np.sort(np.concatenate(counts))[::-1]
  top = counts[:math.ceil(counts.size / 100)].sum() / counts.sum()
  assert top == pytest.approx(0.926, abs=0.01)  # the module docstring's 92.6%
  assert sample["sparse"].shape == (8192, 214)
  assert np.all(sample["sparse"] >= 0)
  assert sample["label"].mean() == pytest.approx(criteo.CLICK_RATE, abs=0.02)
  # The teacher's own logits rank the clicks well; the dense features alone do not.
  assert ctr_metrics.auc(sample["label"], generator.logits(sample["dense"], sample["sparse"])) > 0.8
  assert ctr_metrics.auc(sample["label"], sample["dense"] @ generator._dense_weights) < 0.65


def test_the_synthetic_logs_are_deterministic_by_seed_and_cached_with_a_checksum(tmp_path, caplog):
  rows, hotness = (500, 30, 3), (2, 1, 3)
  first, digest = criteo.synthetic(rows, hotness, 256, seed=3, cache_dir=str(tmp_path))
  (cached,) = tmp_path.glob("synthetic-ctr-*.npz")
  again, again_digest = criteo.synthetic(rows, hotness, 256, seed=3, cache_dir=str(tmp_path))
  assert again_digest == digest
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])
  other, _ = criteo.synthetic(rows, hotness, 256, seed=4, cache_dir=str(tmp_path))
  assert not np.array_equal(other["sparse"], first["sparse"])
  data = bytearray(cached.read_bytes())
  data[100] ^= 0xFF
  cached.write_bytes(bytes(data))
  regenerated, regenerated_digest = criteo.synthetic(rows, hotness, 256, seed=3,
                                                     cache_dir=str(tmp_path))
  assert "does not match the sha256" in caplog.text
  assert regenerated_digest == digest
  np.testing.assert_array_equal(regenerated["sparse"], first["sparse"])


def _pairwise_auc(labels, scores):
  """Every positive-negative pair counted, ties one half, in float64."""
  positives = [s for s, y in zip(scores, labels) if y == 1]
  negatives = [s for s, y in zip(scores, labels) if y == 0]
  wins = sum(1.0 if p > n else 0.5 if p == n else 0.0
             for p, n in itertools.product(positives, negatives))
  return wins / (len(positives) * len(negatives))


def test_auc_matches_the_pairwise_count_with_ties():
  rng = np.random.default_rng(0)
  for _ in range(5):
    labels = (rng.random(300) < 0.3).astype(np.float32)
    scores = np.round(rng.normal(size=300) + labels, 1)  # rounded: many ties
    assert ctr_metrics.auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores),
                                                            rel=1e-12)
  assert ctr_metrics.auc([0, 1, 0, 1], [0.1, 0.9, 0.2, 0.8]) == 1.0
  assert ctr_metrics.auc([0, 1], [0.5, 0.5]) == 0.5
  with pytest.raises(ValueError, match="0 positive and 3 negative labels"):
    ctr_metrics.auc([0, 0, 0], [1, 2, 3])


def test_log_loss_matches_the_cross_entropy_of_the_probabilities():
  labels = np.array([1, 0, 1, 0], np.float64)
  logits = np.array([2.0, -1.0, -12.0, 9.0])
  probabilities = 1 / (1 + np.exp(-logits))
  expected = -np.mean(labels * np.log(probabilities) + (1 - labels) * np.log1p(-probabilities))
  assert ctr_metrics.log_loss(labels, logits) == pytest.approx(expected, rel=1e-9)
  with pytest.raises(ValueError, match="labels other than 0 and 1"):
    ctr_metrics.log_loss([0, 2], [0.0, 1.0])


def _data_config(**data):
  config = ml_collections.ConfigDict({"batch_size": 8, "eval_batch_size": 8, "seed": 0,
                                      "data": data})
  return config


def test_the_criteo_dataset_reads_only_the_lines_it_holds(tmp_path):
  path = tmp_path / "day.tsv"
  path.write_text(_line() * 24 + "a line no reader reaches\n")
  shards = pipeline.ShardSpec(2, (0, 1))
  dataset = criteo.criteo(_data_config(criteo_tsv=str(path), num_train=16, num_eval=8), shards)
  assert dataset.task == "ctr" and dataset.num_train == 16 and dataset.num_eval == 8
  assert dataset.model_fields["hotness"] == (1,) * 26
  assert dataset.train_batch(0)["sparse"].shape == (2, 4, 26)
  short = tmp_path / "short.tsv"
  short.write_text(_line() * 24)
  with pytest.raises(ValueError, match=r"has 24 lines; allowed: at least .* = 32"):
    criteo.criteo(_data_config(criteo_tsv=str(short), num_train=24, num_eval=8), shards)
  with pytest.raises(ValueError, match="needs config.data.criteo_tsv=PATH"):
    criteo.criteo(_data_config(), shards)
