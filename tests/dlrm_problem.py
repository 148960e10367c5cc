"""The small DLRM problem the embedding tests train: five tables whose row counts the 8 devices
do not divide, a tower, a batch and the tables' initial values (tests/test_embeddings.py,
tests/test_sharded_params.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from experiments.models import dlrm

DEVICES = 8
ROWS = (37, 5, 100, 11, 64)  # none divides by 8; table 1 has fewer rows than devices
HOTNESS = (3, 1, 2, 4, 1)
WIDTH = 6  # the column placement pads it to 8 columns
BATCH = 32
LEARNING_RATE = 0.5


def bce(logits, labels):
  return jnp.mean(jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits))))


def problem():
  """``(tower, batch, tower_params, tables)``, the same on every call."""
  rng = np.random.default_rng(0)
  tower = dlrm.DLRMTower(embedding_dim=WIDTH, bottom=(8,), top=(8,))
  batch = {"dense": rng.normal(size=(BATCH, dlrm.NUM_DENSE)).astype(np.float32),
           "sparse": [rng.integers(0, r, size=(BATCH, h)).astype(np.int32)
                      for r, h in zip(ROWS, HOTNESS)],
           "label": (rng.random(BATCH) < 0.5).astype(np.float32)}
  tower_params = tower.init(jax.random.PRNGKey(0), batch["dense"],
                            jnp.zeros((BATCH, len(ROWS), WIDTH)))["params"]
  tables = [rng.uniform(-0.3, 0.3, size=(r, WIDTH)).astype(np.float32) for r in ROWS]
  return tower, batch, tower_params, tables
