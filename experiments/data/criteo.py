"""Click logs for recommendation models: Criteo's TSV format, streamed, and a synthetic generator.

Both give rows of ``dense`` (``float32[13]``, the integer features transformed as the DLRM
reference does: negatives clipped to 0, then ``log(1 + x)``), ``sparse`` (``int32[sum of
hotness]``: each table's IDs, one table after the other) and ``label`` (``float32``, 0 or 1).

**Criteo's TSV** (the Kaggle Display Advertising Challenge's ``train.txt``, and each day of the
1TB click logs): per line, tab-separated, the label, 13 integer features and 26 categorical
features, each a 32-bit hexadecimal hash; an empty field is 0. A category becomes an ID by its
value modulo its table's rows (the reference's ``max_ind_range``). :func:`read_tsv` streams a
file in batches, never holding it whole; a line with another count of columns, a category that is
not hexadecimal or an integer that is not an integer is refused in one line naming the file and
the line number.

**Synthetic click logs** (:func:`synthetic`), deterministic by seed:

* tables: the real per-feature rows capped (:func:`experiments.models.dlrm.capped`), hotness as
  given (MLPerf DLRM-DCNv2's multi-hot sizes, capped);
* skew: a table's IDs follow a power law (Zipf, ``P(rank k) ~ k^-s``) whose exponent is
  calibrated per table (:func:`calibrated_exponent`) so that its top 1% of rows takes
  :data:`TOP_SHARE` (90%) of its lookups, as BagPipe measured on Criteo; a table of fewer than 100
  rows has no top 1% and draws uniformly. The ranks are shuffled into IDs per table, so hot rows
  are spread over the ID space. Measured on the smoke tier's 8,192 rows (26 tables capped at
  20,000 rows, 214 lookups a row, tests/test_criteo.py): the top 1% of all rows takes 92.6%
  of the lookups (the small tables' rows are among the hottest);
* labels: Bernoulli draws of a hidden *teacher* model's click probability, a function of the
  dense features and of every looked-up row (a random per-row bias and a random per-row vector
  interacting with the dense features), so that a model must learn the rows' embeddings to rank
  clicks: AUC and log-loss mean something. About a quarter of the labels are clicks (Criteo's
  share).

The generated rows are cached in ``config.data.cache_dir`` (default
``$XDG_CACHE_HOME/tasc-jax/ctr``) as an ``.npz`` followed by the sha256 of its bytes; a cached
file that fails its checksum is named, deleted and generated again.
"""

from collections.abc import Iterator, Sequence
import hashlib
import io
import math
import os
import pathlib

from absl import logging
import numpy as np

from experiments.data import pipeline
from experiments.data import tokenizer as tokenizer_lib
from experiments.models import dlrm

NUM_INTEGER, NUM_CATEGORICAL = 13, 26
COLUMNS = 1 + NUM_INTEGER + NUM_CATEGORICAL
TOP_SHARE = 0.9  # of a table's lookups taken by its top 1% of rows
TEACHER_WIDTH = 4
CLICK_RATE = 0.25


def transform_integers(values: np.ndarray) -> np.ndarray:
  """The DLRM reference's dense transform: negatives clipped to 0, then ``log(1 + x)``."""
  return np.log1p(np.maximum(np.asarray(values, np.float64), 0)).astype(np.float32)


def _parse_line(line: str, number: int, path: str, rows: Sequence[int]):
  fields = line.rstrip("\n").split("\t")
  if len(fields) != COLUMNS:
    raise ValueError(f"criteo_tsv {path} line {number}: {len(fields)} columns; allowed: "
                     f"{COLUMNS} (label, {NUM_INTEGER} integers, {NUM_CATEGORICAL} hexadecimal "
                     "categories, tab-separated)")
  label = fields[0]
  if label not in ("0", "1"):
    raise ValueError(f"criteo_tsv {path} line {number}: label {label!r}; allowed: 0 or 1")
  integers = []
  for i, value in enumerate(fields[1:1 + NUM_INTEGER]):
    try:
      integers.append(int(value) if value else 0)
    except ValueError:
      raise ValueError(f"criteo_tsv {path} line {number}: integer feature {i} {value!r} is not "
                       "an integer; allowed: an integer or empty") from None
  ids = []
  for t, value in enumerate(fields[1 + NUM_INTEGER:]):
    try:
      category = int(value, 16) if value else 0
    except ValueError:
      category = -1
    if category < 0 or value.startswith(("0x", "0X", "+", "-")) or "_" in value:
      raise ValueError(f"criteo_tsv {path} line {number}: category {t} {value!r} is not "
                       "hexadecimal; allowed: hexadecimal digits or empty")
    ids.append(category % rows[t])
  return int(label), integers, ids


def read_tsv(path: str, rows: Sequence[int], batch_size: int,
             start_line: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """Batches of ``batch_size`` rows of a Criteo TSV file, streamed (the last one may be short).

  Args:
    path: the file (``config.data.criteo_tsv``).
    rows: the 26 tables' rows (a category's ID is its value modulo its table's rows).
    batch_size: rows per batch.
    start_line: lines to skip first (0-based), e.g. a shard's or a resumed run's position.

  Yields:
    ``{"dense": float32[b, 13], "sparse": int32[b, 26], "label": float32[b]}``.

  Raises:
    ValueError: a line that is not in the format, naming the file and its line number (1-based).
  """
  if len(rows) != NUM_CATEGORICAL:
    raise ValueError(f"criteo_tsv: {len(rows)} tables; allowed: {NUM_CATEGORICAL}, one per "
                     "categorical feature")
  labels, integers, ids = [], [], []
  with open(path, encoding="ascii", errors="replace") as f:
    for number, line in enumerate(f, start=1):
      if number <= start_line:
        continue
      label, dense, sparse = _parse_line(line, number, path, rows)
      labels.append(label)
      integers.append(dense)
      ids.append(sparse)
      if len(labels) == batch_size:
        yield _batch(labels, integers, ids)
        labels, integers, ids = [], [], []
  if labels:
    yield _batch(labels, integers, ids)


def _batch(labels, integers, ids):
  return {"dense": transform_integers(np.asarray(integers, np.int64)),
          "sparse": np.asarray(ids, np.int64).astype(np.int32),
          "label": np.asarray(labels, np.float32)}


def top_share(exponent: float, rows: int) -> float:
  """The share of a Zipf law's draws over ``rows`` ranks that its top 1% of ranks
  (``ceil(rows / 100)``) take, in float64."""
  weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
  return float(weights[:math.ceil(rows / 100)].sum() / weights.sum())


def calibrated_exponent(rows: int, share: float = TOP_SHARE) -> float:
  """The Zipf exponent whose top 1% of ``rows`` ranks takes ``share`` of the draws (bisection
  to 1e-9); 0 (uniform) for a table of fewer than 100 rows."""
  if rows < 100:
    return 0.0
  low, high = 0.0, 16.0
  while high - low > 1e-9:
    middle = (low + high) / 2
    low, high = (middle, high) if top_share(middle, rows) < share else (low, middle)
  return (low + high) / 2


def _zipf_cdf(rows: int, exponent: float) -> np.ndarray:
  weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
  cdf = np.cumsum(weights)
  return cdf / cdf[-1]


class Generator:
  """The synthetic click logs' law and teacher for ``rows`` and ``hotness``, drawn from
  ``seed``; :meth:`sample` draws rows from it (see the module docstring)."""

  def __init__(self, rows: Sequence[int], hotness: Sequence[int], seed: int):
    if len(rows) != len(hotness):
      raise ValueError(f"{len(rows)} tables but {len(hotness)} hotness values; allowed: one "
                       "each")
    self.rows, self.hotness = tuple(rows), tuple(hotness)
    rng = np.random.default_rng([seed, 0])
    self.exponents = [calibrated_exponent(r) for r in self.rows]
    self._cdfs = [_zipf_cdf(r, s) for r, s in zip(self.rows, self.exponents)]
    self.ranked_ids = [rng.permutation(r) for r in self.rows]  # rank -> ID
    self._row_bias = [rng.normal(0, 1.0, r) for r in self.rows]
    self._row_vector = [rng.normal(0, 1.0, (r, TEACHER_WIDTH)) for r in self.rows]
    self._dense_to_vector = rng.normal(0, 1 / math.sqrt(NUM_INTEGER), (NUM_INTEGER,
                                                                        TEACHER_WIDTH))
    self._dense_weights = rng.normal(0, 0.3 / math.sqrt(NUM_INTEGER), NUM_INTEGER)
    self._scale = 0.5 / math.sqrt(len(self.rows))

  def probabilities(self, t: int) -> np.ndarray:
    """Table ``t``'s probability of each ID."""
    by_rank = np.diff(self._cdfs[t], prepend=0.0)
    return by_rank[np.argsort(self.ranked_ids[t])]

  def logits(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """The teacher's click logits (before its offset) of rows ``dense``, ``sparse``."""
    bias, vector, start = 0.0, 0.0, 0
    for t, h in enumerate(self.hotness):
      ids = sparse[:, start:start + h]
      bias = bias + self._row_bias[t][ids].mean(axis=1)
      vector = vector + self._row_vector[t][ids].mean(axis=1)
      start += h
    interaction = np.sum(vector * (dense @ self._dense_to_vector + 1.0), axis=1)
    return self._scale * (bias + interaction) + dense @ self._dense_weights

  def sample(self, count: int, seed: int) -> dict[str, np.ndarray]:
    """``count`` rows drawn with ``seed`` (the teacher's offset set for a click rate of
    :data:`CLICK_RATE` over them)."""
    rng = np.random.default_rng([seed, 1])
    counts = rng.geometric(0.05, (count, NUM_INTEGER)) - 1
    dense = transform_integers(counts)
    sparse = np.concatenate([
        ranked[np.minimum(np.searchsorted(cdf, rng.random((count, h))), len(cdf) - 1)]
        for ranked, cdf, h in zip(self.ranked_ids, self._cdfs, self.hotness)], axis=1)
    logits = self.logits(dense, sparse)
    low, high = logits.min() - 40, logits.max() + 40  # the mean click probability falls
    for _ in range(60):
      offset = (low + high) / 2
      low, high = ((offset, high) if np.mean(_sigmoid(logits - offset)) > CLICK_RATE
                   else (low, offset))
    labels = rng.random(count) < _sigmoid(logits - offset)
    return {"dense": dense, "sparse": sparse.astype(np.int32),
            "label": labels.astype(np.float32)}


def _sigmoid(x):
  return 0.5 * (1 + np.tanh(0.5 * x))


def default_cache_dir() -> pathlib.Path:
  root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
  return root / "tasc-jax" / "ctr"


def synthetic(rows: Sequence[int], hotness: Sequence[int], count: int, seed: int,
              cache_dir: str | None = None) -> tuple[dict[str, np.ndarray], str]:
  """``count`` synthetic rows of seed ``seed`` and their sha256, cached (see the module
  docstring): ``(rows, sha256 of the cached bytes)``."""
  folder = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
  key = hashlib.sha256(repr((tuple(rows), tuple(hotness), count, seed, TOP_SHARE,
                             TEACHER_WIDTH, CLICK_RATE)).encode()).hexdigest()[:24]
  path = folder / f"synthetic-ctr-{key}.npz"
  if path.exists():
    data = path.read_bytes()
    payload, checksum = data[:-32], data[-32:]
    if hashlib.sha256(payload).digest() == checksum:
      with np.load(io.BytesIO(payload)) as cached:
        return {k: cached[k] for k in cached.files}, checksum.hex()
    logging.warning("synthetic click logs: the cached file %s does not match the sha256 at its "
                    "end (damaged or cut short); generating it again", path)
    path.unlink(missing_ok=True)
  generated = Generator(rows, hotness, seed).sample(count, seed)
  buffer = io.BytesIO()
  np.savez(buffer, **generated)
  payload = buffer.getvalue()
  folder.mkdir(parents=True, exist_ok=True)
  tokenizer_lib.publish_once(path, payload + hashlib.sha256(payload).digest())
  return generated, hashlib.sha256(payload).hexdigest()


_SHAPES = {"mlperf": (dlrm.MLPERF_DCNV2_ROWS, dlrm.MLPERF_DCNV2_HOTNESS),
           "kaggle": (dlrm.CRITEO_KAGGLE_ROWS, (1,) * NUM_CATEGORICAL)}


def table_shapes(options) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The tables' rows (capped at ``data.max_rows``) and hotness (capped at
  ``data.max_hotness``) of ``data.shapes``."""
  shapes = options.get("shapes", "mlperf")
  if shapes not in _SHAPES:
    raise ValueError(f"config.data.shapes={shapes!r} is not allowed; allowed: {sorted(_SHAPES)}")
  max_rows, max_hotness = options.get("max_rows", 20000), options.get("max_hotness", 1000)
  pipeline.check_positive("config.data.max_rows", max_rows)
  pipeline.check_positive("config.data.max_hotness", max_hotness)
  rows, hotness = _SHAPES[shapes]
  return dlrm.capped(rows, max_rows), tuple(min(h, max_hotness) for h in hotness)


def _dataset(config, shards, train, test, rows, hotness, info) -> pipeline.ShardedDataset:
  return pipeline.ShardedDataset(
      task="ctr", model_fields={"cardinalities": rows, "hotness": hotness},
      train=pipeline.split_rows(train, shards), evaluation=pipeline.split_rows(test, shards),
      num_train=len(train["label"]), num_eval=len(test["label"]), shards=shards,
      batch_per_device=config.batch_size // shards.num_shards,
      eval_batch_per_device=config.eval_batch_size // shards.num_shards, seed=config.seed,
      info=info)


def synthetic_ctr(config, shards: pipeline.ShardSpec) -> pipeline.ShardedDataset:
  """Synthetic click logs (:func:`synthetic`): ``config.data.shapes`` (``mlperf``: MLPerf
  DLRM-DCNv2's tables and hotness; ``kaggle``: Criteo Kaggle's, one ID each) capped at
  ``data.max_rows`` rows and ``data.max_hotness`` IDs, ``data.num_train`` and ``data.num_eval``
  rows drawn with ``data.seed`` (default 0), cached in ``data.cache_dir``."""
  options = config.data
  rows, hotness = table_shapes(options)
  num_train, num_eval = options.get("num_train", 65536), options.get("num_eval", 8192)
  pipeline.check_positive("config.data.num_train", num_train)
  pipeline.check_positive("config.data.num_eval", num_eval)
  logs, digest = synthetic(rows, hotness, num_train + num_eval, options.get("seed", 0),
                           options.get("cache_dir"))
  train = {k: v[:num_train] for k, v in logs.items()}
  test = {k: v[num_train:] for k, v in logs.items()}
  return _dataset(config, shards, train, test, rows, hotness, {"data_sha256": digest})


def criteo(config, shards: pipeline.ShardSpec) -> pipeline.ShardedDataset:
  """Criteo's TSV ``config.data.criteo_tsv`` (:func:`read_tsv`): its first ``data.num_train``
  lines train, the next ``data.num_eval`` evaluate (the file is streamed; the run holds those
  rows), with Criteo Kaggle's tables capped at ``data.max_rows`` rows. The file's path, size and
  modification time are hashed (``files_sha256``)."""
  options = config.data
  path = options.get("criteo_tsv", "")
  if not path:
    raise ValueError("config.dataset='criteo' needs config.data.criteo_tsv=PATH (a file in "
                     "Criteo's TSV format)")
  status = pipeline.check_regular_file("criteo", path)
  rows = dlrm.capped(dlrm.CRITEO_KAGGLE_ROWS, options.get("max_rows", 20000))
  num_train, num_eval = options.get("num_train", 65536), options.get("num_eval", 8192)
  # The first batch only: the lines after it are never read.
  logs = next(read_tsv(path, rows, batch_size=num_train + num_eval), {"label": ()})
  if len(logs["label"]) < num_train + num_eval:
    raise ValueError(f"config.data.criteo_tsv={path!r} has {len(logs['label'])} lines; "
                     "allowed: at least config.data.num_train + num_eval = "
                     f"{num_train + num_eval}")
  digest = hashlib.sha256(f"{path}:{status.st_size}:{status.st_mtime_ns}".encode()).hexdigest()
  return _dataset(config, shards, {k: v[:num_train] for k, v in logs.items()},
                  {k: v[num_train:] for k, v in logs.items()}, rows, (1,) * NUM_CATEGORICAL,
                  {"files_sha256": digest})
