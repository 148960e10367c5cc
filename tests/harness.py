"""Shared test plumbing: run a gradient transformation per worker under shard_map or pmap."""

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import compressors
from experiments import checkpoint
from experiments import train
from experiments.data import stdlib

# What a run with simulated workers reports, compared between a resumed and an uninterrupted run.
SIMULATED_FIGURES = ("test_loss", "modelled_seconds", "useful_throughput", "staleness",
                     "updates_dropped")


def regression_loss(params, batch):
  """One worker's mean squared error of the linear model ``x @ w + b`` on ``batch = (x, y)``."""
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def regression_batch(workers: int, dim: int, seed: int = 0):
  """``(x, y)`` for :func:`regression_loss`: 4 rows a worker, ``y`` a linear map of ``x`` plus
  0.5, the same for the same ``seed``."""
  key_x, key_w = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(key_x, (workers * 4, dim))
  return x, x @ jax.random.normal(key_w, (dim, dim)) + 0.5


def mesh(num_devices: int = 8, axis_name: str = "data") -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), (axis_name,))


def islands_mesh(islands: int = 2, fsdp: int = 4) -> jax.sharding.Mesh:
  """``islands x fsdp`` devices: the slow axis ``"islands"``, the fast axis ``"fsdp"``."""
  devices = np.array(jax.devices()[:islands * fsdp]).reshape(islands, fsdp)
  return jax.sharding.Mesh(devices, ("islands", "fsdp"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)


def h100_mesh(num_devices: int, axis_name: str = "data") -> jax.sharding.AbstractMesh:
  """A mesh of abstract H100s: a program traced on it and lowered for CUDA is what a GPU
  process would compile, checked on a machine without one."""
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  return jax.sharding.AbstractMesh((num_devices,), (axis_name,),
                                   axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=h100)


def shard_map_update(tx, mesh_, params, axis_name="data"):
  """(initial state, update) running ``tx`` per worker under shard_map.

  ``update(params, state, grads)`` takes ``grads`` leaves with a leading worker axis and returns
  the replicated mean (``P()``) and the new state (per-worker leaves with a leading device axis).
  """
  specs = compressors.state_specs(tx, params, mesh_, axis_name)
  state = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                mesh=mesh_,
                                in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh_, in_specs=(P(), specs, P(axis_name)),
                     out_specs=(P(), specs))
  def update(params, state, grads):
    state = compressors.drop_device_axis(state, specs)
    grads = jax.tree.map(lambda g: g[0], grads)
    mean, state = tx.update(grads, state, params)
    return mean, compressors.add_device_axis(state, specs)

  return state, update


def update_bytes(tx, params, mesh_, axis_name="data") -> compressors.WireBytes:
  """Bytes one device sends in one ``tx.update`` per worker under shard_map (compiled, not run);
  ``params`` may be ``ShapeDtypeStruct``s."""
  specs = compressors.state_specs(tx, params, mesh_, axis_name)
  state = jax.eval_shape(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                                       mesh=mesh_, in_specs=P(), out_specs=specs), params)

  @functools.partial(jax.shard_map, mesh=mesh_, in_specs=(P(), specs, P(axis_name)),
                     out_specs=(P(), specs))
  def update(params, state, grads):
    grads = jax.tree.map(lambda g: g[0], grads)
    mean, state = tx.update(grads, compressors.drop_device_axis(state, specs), params)
    return mean, compressors.add_device_axis(state, specs)

  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mesh_.size,) + x.shape, x.dtype), params)
  return compressors.wire_bytes(update, params, state, grads, mesh=mesh_)


def pmap_update(tx, axis_name="data"):
  """The same under pmap: params and grads carry a leading device axis."""
  init = jax.pmap(tx.init, axis_name=axis_name)
  update = jax.pmap(lambda p, s, g: tx.update(g, s, p), axis_name=axis_name)
  return init, update


def device_copies(x: jax.Array) -> list[np.ndarray]:
  """Every device's own copy of a (nominally replicated) array."""
  return [np.asarray(s.data) for s in x.addressable_shards]


def assert_replicas_identical(tree) -> None:
  for leaf in jax.tree.leaves(tree):
    copies = device_copies(leaf)
    for c in copies[1:]:
      np.testing.assert_array_equal(c, copies[0])
      assert c.tobytes() == copies[0].tobytes()


def per_worker_grads(key, num_workers: int, params) -> dict:
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten([jax.random.normal(k, (num_workers,) + jnp.shape(x))
                            for k, x in zip(keys, leaves)])


def fused(tree, leading: int) -> np.ndarray:
  """``[leading, D]``: each row's leaves concatenated in compress()'s fused layout (pytree
  order)."""
  return np.concatenate([np.asarray(x).reshape(leading, -1) for x in jax.tree.leaves(tree)],
                        axis=1)


def topk_reference(a: np.ndarray, k: int) -> np.ndarray:
  """Each row of ``a`` keeping only its ``k`` largest magnitudes (ties to the lower index)."""
  sent = np.zeros_like(a)
  for i, row in enumerate(a):
    idx = np.argsort(-np.abs(row), kind="stable")[:k]
    sent[i, idx] = row[idx]
  return sent


def cached_token_stream(folder):
  """``(texts, tokenizer, stream, cached file)``: a small corpus encoded once, its token stream
  cached in ``folder`` (for the tests that damage the cache)."""
  texts = ["def f(x):\n  return x + 1\n", "class A:\n  pass\n"] * 20
  shared = stdlib.build_tokenizer(texts, vocab_size=300, cache_dir=str(folder))
  stream = stdlib.token_stream(shared, texts, folder)
  [cached] = folder.glob("tokens-*.npy")
  return texts, shared, stream, cached


def assert_resumes_bit_for_bit(config, folder, last_step: int, lost_steps) -> dict:
  """Trains ``config()`` to the end in ``folder/finished``, then again from a copy whose
  checkpoints of ``lost_steps`` (and results) are gone, as a run killed before them: the
  resumed run's parameters at ``last_step`` and :data:`SIMULATED_FIGURES` equal the
  uninterrupted one's. Returns the uninterrupted run's results."""
  finished, resumed = os.path.join(folder, "finished"), os.path.join(folder, "resumed")
  results = train.train_and_evaluate(config(), finished)
  shutil.copytree(finished, resumed)
  for step in lost_steps:
    shutil.rmtree(os.path.join(resumed, "checkpoints", str(step)), ignore_errors=True)
  os.remove(os.path.join(resumed, train.RESULTS_FILE))
  again = train.train_and_evaluate(config(), resumed)
  jax.tree.map(np.testing.assert_array_equal, checkpoint.load_params(resumed, last_step),
               checkpoint.load_params(finished, last_step))
  for key in SIMULATED_FIGURES:
    assert again[key] == results[key], key
  return results
