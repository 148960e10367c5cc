"""The small DLRM problem the embedding tests train: five tables whose row counts the 8 devices
do not divide, a tower, a batch and the tables' initial values, and the trajectory of the tables
whole that every placement must give (tests/test_embeddings.py, tests/test_sharded_params.py,
tests/test_hot_rows.py, tests/test_embedding_codecs.py)."""

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
MIXED = ("row", "table", "column", "replicated", "table")  # one placement per table, each kind


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


def replicated_trajectory(steps: int):
  """One device, the whole batch, the tables whole: ``(losses, trained params)`` of ``steps``
  SGD steps from :func:`problem`'s parameters."""
  tower, batch, tower_params, tables = problem()

  def loss(params):
    pooled = dlrm.pooled_lookup(params["tables"], batch["sparse"])
    return bce(tower.apply({"params": params["tower"]}, batch["dense"], pooled), batch["label"])

  @jax.jit
  def step(params):
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), value
  params, losses = {"tower": tower_params, "tables": tables}, []
  for _ in range(steps):
    params, value = step(params)
    losses.append(float(value))
  return losses, params
