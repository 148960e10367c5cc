"""DLRM (Naumov et al. 2019): a recommendation model of dense features and embedding bags.

A bottom MLP maps the 13 dense features to a vector of the embedding width; each categorical
feature looks up the rows of its IDs in its own table and sums them (a pooled, multi-hot
embedding bag); an interaction combines the bottom MLP's vector and the pooled embeddings; a top
MLP ends in one logit (the click's). Two interactions:

* ``dot`` (DLRM's): the pairwise dot products of the ``1 + tables`` vectors (each pair once, no
  diagonal), beside the bottom MLP's vector;
* ``dcn`` (DCN-v2, Wang et al. 2021, as MLPerf's DLRM-DCNv2 uses it): the concatenated vectors
  ``x0`` pass ``cross_layers`` layers ``x <- x0 * (U (V x) + b) + x`` (``V`` of rank
  ``cross_rank``; 0: a full matrix).

The model is two modules, so that the tables may live elsewhere (sharded across devices,
:mod:`compressors.parallel.embeddings`): :class:`DLRMTower` is everything but the tables and
takes the pooled embeddings ``[batch, tables, width]``; :class:`DLRM` holds the tables
(``embedding_0`` ... as ``[rows, width]`` parameters) and the tower (``tower``).

Inputs: ``dense [batch, 13]`` (float) and ``sparse``, one ``[batch, hotness]`` int array per table
(the hotness may differ from table to table; an ID is a row of its table), or, as the click-log
datasets give them, one ``[batch, sum of hotness]`` array of every table's IDs in turn, split by
the field ``hotness``.

Shapes of real workloads, as data (:data:`CRITEO_KAGGLE_ROWS`, :data:`MLPERF_DCNV2_ROWS`,
:data:`MLPERF_DCNV2_HOTNESS`, :data:`MLPERF_DCNV2_ARCH`), and :func:`capped`, the CPU tier's rows.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from experiments.models import fields

# Rows per categorical feature of Criteo's Kaggle Display Advertising Challenge (train.txt), as
# the DLRM reference (facebookresearch/dlrm, its Kaggle preprocessing) counts the distinct values;
# the same list is in real-zhangzhe/wukong, exp/train_wukong_on_criteo_kaggle_dataset.py.
CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)

# MLPerf Training's DLRM-DCNv2 on Criteo 1TB (mlcommons/training,
# recommendation_v2/torchrec_dlrm: --num_embeddings_per_feature, the tables capped at 40M rows,
# and --multi_hot_sizes of the synthetic multi-hot dataset; the same flags in mlcommons/ck,
# script get-preprocessed-dataset-criteo/preprocess_multihot.sh).
MLPERF_DCNV2_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
MLPERF_DCNV2_HOTNESS = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
# Its architecture (the reference's flags): width 128, bottom 512-256-128, top 1024-1024-512-256-1,
# three DCN-v2 layers of rank 512.
MLPERF_DCNV2_ARCH = dict(embedding_dim=128, bottom=(512, 256), top=(1024, 1024, 512, 256),
                         interaction="dcn", cross_layers=3, cross_rank=512)

NUM_DENSE = 13  # Criteo's integer features
INTERACTIONS = ("dot", "dcn")


def capped(rows: Sequence[int], cap: int) -> tuple[int, ...]:
  """The CPU tier's tables: each of ``rows`` capped at ``cap`` rows (small tables stay as they
  are, as hashing a large feature into ``cap`` buckets would make them)."""
  if cap < 1:
    raise ValueError(f"cap={cap} is not allowed; allowed: an int >= 1")
  return tuple(min(int(r), cap) for r in rows)


def _mlp(x, widths, name):
  for i, width in enumerate(widths):
    x = nn.relu(nn.Dense(width, name=f"{name}_{i}")(x))
  return x


class DLRMTower(nn.Module):
  """DLRM without its tables: ``(dense [batch, 13], pooled [batch, tables, width]) -> logits
  [batch]``.

  Attributes:
    embedding_dim: the tables' width (the bottom MLP's last layer has it).
    bottom: the bottom MLP's hidden widths (a last layer of ``embedding_dim`` follows).
    top: the top MLP's hidden widths (a last layer of one logit follows).
    interaction: ``dot`` or ``dcn``.
    cross_layers: DCN-v2 layers (``dcn`` only).
    cross_rank: rank of each DCN-v2 layer's matrix (0: full).
  """
  embedding_dim: int = fields.integer(16)
  bottom: Sequence[int] = fields.integers((64,))
  top: Sequence[int] = fields.integers((64, 32))
  interaction: str = fields.choice("dot", INTERACTIONS)
  cross_layers: int = fields.integer(2)
  cross_rank: int = fields.integer(0, minimum=0)

  @nn.compact
  def __call__(self, dense, pooled):
    bottom = _mlp(dense.astype(jnp.float32), self.bottom, "bottom")
    bottom = nn.relu(nn.Dense(self.embedding_dim, name=f"bottom_{len(self.bottom)}")(bottom))
    vectors = jnp.concatenate([bottom[:, None], pooled], axis=1)  # [batch, 1 + tables, width]
    if self.interaction == "dot":
      products = jnp.einsum("bid,bjd->bij", vectors, vectors)
      upper_i, upper_j = jnp.triu_indices(vectors.shape[1], k=1)
      x = jnp.concatenate([bottom, products[:, upper_i, upper_j]], axis=1)
    else:
      x0 = x = vectors.reshape(vectors.shape[0], -1)
      for i in range(self.cross_layers):
        if self.cross_rank:
          low = nn.Dense(self.cross_rank, use_bias=False, name=f"cross_{i}_v")(x)
          mixed = nn.Dense(x0.shape[1], name=f"cross_{i}_u")(low)
        else:
          mixed = nn.Dense(x0.shape[1], name=f"cross_{i}")(x)
        x = x0 * mixed + x
    x = _mlp(x, self.top, "top")
    return nn.Dense(1, name=f"top_{len(self.top)}")(x)[:, 0]


def pooled_lookup(tables: Sequence[jnp.ndarray], sparse: Sequence[jnp.ndarray]) -> jnp.ndarray:
  """Every table's bags summed, on one device: ``[batch, tables, width]``."""
  return jnp.stack([jnp.take(table, ids, axis=0).sum(axis=1)
                    for table, ids in zip(tables, sparse)], axis=1)


class DLRM(nn.Module):
  """The tables (``embedding_<t>``, ``[rows, embedding_dim]``, initialised uniform in
  ``+-1/sqrt(rows)`` as the DLRM reference does) and :class:`DLRMTower` (``tower``).

  Attributes:
    cardinalities: rows per table (the dataset sets them).
    hotness: IDs per table of a row, to split one array of every table's IDs (the dataset sets
      them; empty: ``sparse`` comes as one array per table).
    embedding_dim, bottom, top, interaction, cross_layers, cross_rank: as :class:`DLRMTower`'s.
    frozen_embeddings: the tables keep their initial values (no gradient reaches them): the
      baseline that shows what learning the embeddings is worth.
  """
  cardinalities: Sequence[int]
  hotness: Sequence[int] = ()
  embedding_dim: int = fields.integer(16)
  bottom: Sequence[int] = fields.integers((64,))
  top: Sequence[int] = fields.integers((64, 32))
  interaction: str = fields.choice("dot", INTERACTIONS)
  cross_layers: int = fields.integer(2)
  cross_rank: int = fields.integer(0, minimum=0)
  frozen_embeddings: bool = fields.choice(False, (False, True))

  def tower(self, **where) -> DLRMTower:
    """The tower of this model's shape: ``name="tower"`` inside :meth:`__call__`;
    ``parent=None`` for a module of its own (placed tables apply it so)."""
    return DLRMTower(self.embedding_dim, tuple(self.bottom), tuple(self.top), self.interaction,
                     self.cross_layers, self.cross_rank, **where)

  @nn.compact
  def __call__(self, dense, sparse, train: bool = False):
    del train
    if self.hotness and not isinstance(sparse, (list, tuple)):
      splits = [sum(self.hotness[:t + 1]) for t in range(len(self.hotness) - 1)]
      sparse = jnp.split(sparse, splits, axis=1)
    if len(sparse) != len(self.cardinalities):
      raise ValueError(f"DLRM: {len(sparse)} sparse features for {len(self.cardinalities)} "
                       "tables (config.model.cardinalities); allowed: one per table")
    tables = [self.param(f"embedding_{t}", _uniform_init(rows), (rows, self.embedding_dim))
              for t, rows in enumerate(self.cardinalities)]
    if self.frozen_embeddings:
      tables = [jax.lax.stop_gradient(table) for table in tables]
    return self.tower(name="tower")(dense, pooled_lookup(tables, sparse))


def _uniform_init(rows: int):
  bound = 1.0 / float(rows) ** 0.5

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init
