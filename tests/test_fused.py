"""TASC's one-pass CPU kernel (``a = g + e`` and block energies) against a float64 reference."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tasc import _fused as fused
from tests import harness


def _reference(g: np.ndarray, e: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
  """``a`` in float32 (one rounding, as the step makes it) and its block energies in float64."""
  a = g + e
  padded = np.zeros(-(-a.size // block_size) * block_size)
  padded[:a.size] = a
  return a, (padded.reshape(-1, block_size) ** 2).sum(axis=1)


def _buffers(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  g = (rng.normal(size=size) * rng.uniform(0.1, 10, size=size)).astype(np.float32)
  return g, rng.normal(size=size).astype(np.float32)


def _compiled(fn, *args, **jit_kwargs) -> str:
  return jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()


@pytest.mark.parametrize("size,block_size", [
    (1, 256),  # one block, shorter than a block
    (255, 256),
    (256 * 5, 256),
    (256 * 5 + 7, 256),  # a tail block of 7
    (1000, 100),  # blocks that the 16 lanes do not divide
    (70_001, 3),  # blocks shorter than the lanes, a tail of 2
    (300_000, 256),  # several chunks of work, shared with the thread pool
])
def test_kernel_matches_the_reference(size, block_size):
  assert fused.kernel_available()
  g, e = _buffers(size, seed=size)
  fn = functools.partial(fused.residual_and_energies, block_size=block_size)
  assert fused._TARGET in _compiled(fn, g, e)
  a, energies = jax.jit(fn)(g, e)
  want_a, want_energies = _reference(g, e, block_size)
  np.testing.assert_array_equal(np.asarray(a), want_a)
  assert energies.dtype == jnp.float32
  # float32 sums of at most 16 + 16 terms each: a few ulps.
  np.testing.assert_allclose(np.asarray(energies), want_energies, rtol=4e-6)


def test_kernel_agrees_with_the_two_pass_version():
  g, e = _buffers(50_000)
  one = jax.jit(functools.partial(fused.residual_and_energies, block_size=64))(g, e)
  two = jax.jit(functools.partial(fused._two_passes, block_size=64))(g, e)
  np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(two[0]))
  np.testing.assert_allclose(np.asarray(one[1]), np.asarray(two[1]), rtol=4e-6)


def test_kernel_writes_over_the_donated_residual():
  """In place: the sum lands in the residual's buffer and no full-size copy is made."""
  size = 100_000
  g, e = (jnp.asarray(x) for x in _buffers(size))
  fn = functools.partial(fused.residual_and_energies, block_size=256)
  hlo = _compiled(fn, g, e, donate_argnums=1)
  assert not re.search(rf"f32\[{size}\]\S* copy\(", hlo)
  where = e.unsafe_buffer_pointer()
  a, _ = jax.jit(fn, donate_argnums=1)(g, e)
  assert a.unsafe_buffer_pointer() == where


def test_kernel_runs_per_worker_under_shard_map():
  workers, size, block_size = 8, 4_000, 128
  g, e = _buffers(workers * size)
  mesh = harness.mesh(workers)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  def per_worker(g, e):
    return fused.residual_and_energies(g, e, block_size)

  sharding = jax.sharding.NamedSharding(mesh, P("data"))
  a, energies = per_worker(jax.device_put(g, sharding), jax.device_put(e, sharding))
  for w in range(workers):
    rows = slice(w * size, (w + 1) * size)
    want_a, want_energies = _reference(g[rows], e[rows], block_size)
    np.testing.assert_array_equal(np.asarray(a)[rows], want_a)
    blocks = -(-size // block_size)
    np.testing.assert_allclose(np.asarray(energies)[w * blocks:(w + 1) * blocks], want_energies,
                               rtol=4e-6)


def test_kernel_under_vmap():
  g, e = _buffers(3 * 1000)
  a, energies = jax.vmap(functools.partial(fused.residual_and_energies, block_size=100))(
      g.reshape(3, 1000), e.reshape(3, 1000))
  for row in range(3):
    want_a, want_energies = _reference(g.reshape(3, -1)[row], e.reshape(3, -1)[row], 100)
    np.testing.assert_array_equal(np.asarray(a[row]), want_a)
    np.testing.assert_allclose(np.asarray(energies[row]), want_energies, rtol=4e-6)


def test_other_dtypes_take_two_passes():
  g, e = (jnp.asarray(x, jnp.bfloat16) for x in _buffers(1000))
  fn = functools.partial(fused.residual_and_energies, block_size=100)
  assert fused._TARGET not in _compiled(fn, g, e)
  a, energies = jax.jit(fn)(g, e)
  assert a.dtype == energies.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(a), np.asarray(g + e))


def test_mismatched_buffers_are_refused():
  with pytest.raises(ValueError, match=r"g float32\[10\] and e float32\[11\] must be flat buffers"):
    fused.residual_and_energies(jnp.zeros(10), jnp.zeros(11), 4)


def test_kernel_is_built_once_into_the_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  library = fused._build()
  assert library.parent == tmp_path / "tasc-jax" and library.suffix == ".so"
  built = library.stat().st_mtime_ns
  assert fused._build() == library and library.stat().st_mtime_ns == built
  assert [p.name for p in library.parent.iterdir()] == [library.name]  # no partial file left


def test_without_a_compiler_the_xla_version_runs_with_a_warning(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  fused.kernel_available.cache_clear()
  try:
    with pytest.warns(RuntimeWarning, match="could not be built.*second pass"):
      assert not fused.kernel_available()
    g, e = _buffers(1000)
    fn = functools.partial(fused.residual_and_energies, block_size=100)
    assert fused._TARGET not in _compiled(fn, g, e)
    a, energies = jax.jit(fn)(g, e)
  finally:
    fused.kernel_available.cache_clear()
  want_a, want_energies = _reference(g, e, 100)
  np.testing.assert_array_equal(np.asarray(a), want_a)
  np.testing.assert_allclose(np.asarray(energies), want_energies, rtol=4e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [25_557_032, 4096 * 7 + 13])
def test_on_a_gpu_xla_fuses_the_sum_and_the_energies_in_place(size):
  """On a GPU no kernel is used: XLA's passes, written over the donated residual (no full-size
  copy), against the float64 reference."""
  assert fused.one_pass_kernels(256) == {}
  g, e = _buffers(size)
  fn = functools.partial(fused.residual_and_energies, block_size=256)
  hlo = _compiled(fn, g, e, donate_argnums=1)
  assert "custom-call" not in hlo
  assert not re.search(rf"f32\[{size}\]\S* copy\(", hlo), "a full-size copy of the residual"
  a, energies = jax.jit(fn)(g, e)
  want_a, want_energies = _reference(g, e, 256)
  np.testing.assert_array_equal(np.asarray(a), want_a)
  np.testing.assert_allclose(np.asarray(energies), want_energies, rtol=4e-6)


# --- The step in the contexts a GPU run traces it in: the kernel is chosen where each call is
# traced, so a context it cannot be traced in gets XLA's passes, never a crash.
def test_a_kernel_that_cannot_be_traced_falls_back_with_one_warning(monkeypatch):
  """The choice is made where the call is traced: a kernel that fails there (as an untyped one
  did inside shard_map) leaves XLA's two passes in its place, with one warning for any number
  of traces, and the step runs."""
  def broken(g, e):
    raise ValueError("not typed for this context")

  monkeypatch.setattr(fused, "one_pass_kernels", lambda block_size: {"cpu": broken})
  fused._warn_untraceable.cache_clear()
  g, e = _buffers(5000)
  with pytest.warns(RuntimeWarning, match="cannot be traced here: ValueError") as caught:
    for size in (5000, 4000):  # two traces
      a, energies = jax.jit(functools.partial(fused.residual_and_energies, block_size=64))(
          g[:size], e[:size])
  assert len([w for w in caught if "cannot be traced" in str(w.message)]) == 1
  want_a, want_energies = _reference(g[:4000], e[:4000], 64)
  np.testing.assert_array_equal(np.asarray(a), want_a)
  np.testing.assert_allclose(np.asarray(energies), want_energies, rtol=4e-6)


def test_one_pass_can_be_switched_off(monkeypatch):
  monkeypatch.setenv("TASC_ONE_PASS", "0")
  assert fused.one_pass_kernels(256) == {} and not fused.one_pass_available(256)
  g, e = _buffers(5000)
  fn = functools.partial(fused.residual_and_energies, block_size=100)
  assert fused._TARGET not in _compiled(fn, g, e)


def _quickstart_smoke():
  from configs import quickstart  # pylint: disable=import-outside-toplevel
  return quickstart.get_config("smoke")


def test_quickstarts_training_step_traced_for_an_abstract_gpu_mesh(monkeypatch):
  """The README's quickstart step (TASC with its curvature refresh, LAMB) traced on a mesh of 8
  abstract H100s and lowered for CUDA as a process on a GPU traces it (JAX's default backend a
  GPU; a Pallas kernel untyped for shard_map failed here): XLA's passes, no kernel."""
  # pylint: disable=import-outside-toplevel
  import compressors
  from experiments import data, methods, models, tasks, train
  config = _quickstart_smoke()
  config.model.channels = (64, 64)
  mesh = harness.h100_mesh(8)
  workers = compressors.Workers.on(mesh, "data")
  dataset = data.load(config, data.ShardSpec(8, tuple(range(8))))
  model = models.build_model(config.model, **dataset.model_fields)
  task = tasks.TASKS[dataset.task]
  learning_rate = methods.learning_rate_schedule(config, dataset.steps_per_epoch, 2)
  tx = methods.make_chain(config, learning_rate, workers.axis_name)
  first = dataset.train_batch(0)
  init_variables = train._variables_initializer(model, task, {k: v[0] for k, v in first.items()},
                                                workers.count)
  params, model_state = jax.eval_shape(init_variables, config.seed)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8 * x.shape[1],) + x.shape[2:], x.dtype),
                       first)
  example = train.TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, model_state, ())
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  dp = train._data_parallel(config, model, task, tx, workers, example, batch)
  def abstract(tree, specs):
    specs = jax.tree.broadcast(specs, tree, is_leaf=lambda s: isinstance(s, P))
    return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec)), tree, specs,
        is_leaf=lambda s: isinstance(s, P))
  with jax.sharding.use_abstract_mesh(mesh):
    state = train.TrainState(abstract(example.step, P()), abstract(params, P()),
                             abstract(model_state, workers.spec),
                             abstract(jax.eval_shape(dp.init, params), dp.specs))
    lowered = dp.train_step.trace(state, abstract(batch, workers.spec), kind="with_inputs").lower(
        lowering_platforms=("cuda",))
  assert "custom_call" not in lowered.as_text()
