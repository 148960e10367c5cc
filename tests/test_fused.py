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


@pytest.mark.parametrize("size,block_size", [
    (100, 256),  # shorter than a tile: XLA's two passes
    (4096 * 3, 256),  # whole tiles only
    (4096 * 3 + 700, 256),  # a tail of 700: two whole blocks and one of 188, summed by XLA
    (4096 + 5, 64),
    (8192 * 2 + 3, 8192),  # one block per tile
])
def test_gpu_kernel_matches_the_reference_in_pallas_interpreter(size, block_size):
  """The Pallas kernel's program, run by Pallas's interpreter (on a GPU it is compiled by
  Triton: tests marked gpu)."""
  g, e = _buffers(size, seed=size)
  a, energies = jax.jit(functools.partial(fused.pallas_one_pass, block_size=block_size,
                                          interpret=True))(g, e)
  want_a, want_energies = _reference(g, e, block_size)
  np.testing.assert_array_equal(np.asarray(a), want_a)
  np.testing.assert_allclose(np.asarray(energies), want_energies, rtol=4e-6)


def test_gpu_kernel_runs_per_simulated_worker():
  """Under vmap (simulated workers) each worker's buffer is its own."""
  g, e = (x.reshape(4, -1) for x in _buffers(4 * (4096 + 9)))
  a, energies = jax.jit(jax.vmap(functools.partial(fused.pallas_one_pass, block_size=128,
                                                   interpret=True)))(g, e)
  for i in range(4):
    want_a, want_energies = _reference(g[i], e[i], 128)
    np.testing.assert_array_equal(np.asarray(a[i]), want_a)
    np.testing.assert_allclose(np.asarray(energies[i]), want_energies, rtol=4e-6)


def test_gpu_kernel_needs_a_power_of_two_block():
  g, e = _buffers(5000)
  with pytest.raises(ValueError, match="block_size=100 must be a power of two"):
    fused.pallas_one_pass(g, e, block_size=100, interpret=True)
  assert not fused.gpu_kernel_available(100)


def test_gpu_kernel_lowers_to_triton_without_a_gpu():
  """Lowered for CUDA on an abstract H100 (no GPU needed): Pallas's Triton lowering accepts the
  kernel, and the program calls it (compiling it to PTX needs the GPU: tests marked gpu)."""
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=h100)
  buffer = jax.ShapeDtypeStruct((4096 * 3 + 5,), jnp.float32)
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(functools.partial(fused.pallas_one_pass, block_size=256)).trace(
        buffer, buffer).lower(lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text().lower()


@pytest.mark.gpu
@pytest.mark.parametrize("size", [25_557_032, 4096 * 7 + 13])
def test_gpu_kernel_compiles_for_the_gpu_and_matches_the_reference(size):
  assert fused.gpu_kernel_available(256)
  g, e = _buffers(size)
  fn = functools.partial(fused.residual_and_energies, block_size=256)
  hlo = _compiled(fn, g, e, donate_argnums=1)
  assert "triton" in hlo.lower(), "the Pallas kernel is not in the compiled program"
  assert not re.search(rf"f32\[{size}\]\S* copy\(", hlo), "a full-size copy of the residual"
  a, energies = jax.jit(fn)(g, e)
  want_a, want_energies = _reference(g, e, 256)
  np.testing.assert_array_equal(np.asarray(a), want_a)
  np.testing.assert_allclose(np.asarray(energies), want_energies, rtol=4e-6)


# --- The Pallas kernel in the contexts a training step calls it from. On a GPU it runs inside
# shard_map (check_vma on: one worker per device), under vmap inside shard_map (simulated
# workers) and in the runner's step; on CPU the same program runs in Pallas's interpreter.

def _sharded(x, mesh, spec):
  return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def _check_per_row(a, energies, g, e, block_size):
  for i in range(g.shape[0]):
    want_a, want_energies = _reference(g[i], e[i], block_size)
    np.testing.assert_array_equal(np.asarray(a[i]), want_a)
    np.testing.assert_allclose(np.asarray(energies[i]), want_energies, rtol=4e-6)


def test_gpu_kernel_in_the_interpreter_inside_shard_map():
  """Typed for shard_map's varying manual axes (check_vma on, the default): each device's
  outputs vary over the axis its inputs do."""
  mesh = harness.mesh(2)
  g, e = (x.reshape(2, -1) for x in _buffers(2 * (4096 * 3 + 700)))
  kernel = functools.partial(fused.pallas_one_pass, block_size=256, interpret=True)
  per_device = jax.shard_map(lambda g, e: jax.tree.map(lambda x: x[None], kernel(g[0], e[0])),
                             mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  a, energies = jax.jit(per_device)(_sharded(g, mesh, P("data")), _sharded(e, mesh, P("data")))
  _check_per_row(a, energies, g, e, 256)


def test_gpu_kernel_in_the_interpreter_under_vmap_inside_shard_map():
  """Simulated workers: a vmap over each device's workers, inside shard_map."""
  mesh = harness.mesh(2)
  g, e = (x.reshape(8, -1) for x in _buffers(8 * (4096 + 9)))
  kernel = jax.vmap(functools.partial(fused.pallas_one_pass, block_size=128, interpret=True),
                    axis_name="worker")
  per_device = jax.shard_map(kernel, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  a, energies = jax.jit(per_device)(_sharded(g, mesh, P("data")), _sharded(e, mesh, P("data")))
  _check_per_row(a, energies, g, e, 128)


def _h100_mesh(num_devices: int) -> jax.sharding.AbstractMesh:
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  return jax.sharding.AbstractMesh((num_devices,), ("data",),
                                   axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=h100)


def test_gpu_kernel_lowers_for_an_abstract_h100_inside_shard_map():
  mesh = _h100_mesh(8)
  buffer = jax.ShapeDtypeStruct((8 * (4096 * 3 + 5),), jnp.float32,
                                sharding=jax.sharding.NamedSharding(mesh, P("data")))
  kernel = functools.partial(fused.pallas_one_pass, block_size=256)
  per_device = jax.shard_map(kernel, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(per_device).trace(buffer, buffer).lower(lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text().lower()


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


@pytest.fixture
def fast_compiles():
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


def test_gpu_kernel_in_the_interpreter_inside_the_runners_training_step(monkeypatch, tmp_path,
                                                                         fast_compiles):
  """The quickstart's TASC step with the Pallas kernel (interpreted) in place of the CPU one:
  one worker per device (check_vma on) and simulated workers; it trains as XLA's passes do."""
  from experiments import train  # pylint: disable=import-outside-toplevel
  traced = []

  def interpreted(g, e, *, block_size):
    traced.append(jax.typeof(g).str_short())
    return fused.pallas_one_pass(g, e, block_size=block_size, interpret=True)

  results = {}
  for devices, per_device in ((8, 1), (2, 4)):
    for kernel in ("pallas", "xla"):
      config = _quickstart_smoke()
      config.num_devices, config.workers_per_device = devices, per_device
      config.compression.tasc.block_size = 128  # blocks of a Pallas tile: 32 per worker
      config.model.channels = (16, 16)
      with monkeypatch.context() as patch:
        patch.setattr(fused, "one_pass_kernels", lambda block_size, kernel=kernel: (
            {"cpu": functools.partial(interpreted, block_size=block_size)}
            if kernel == "pallas" else {}))
        results[devices, kernel] = train.train_and_evaluate(
            config, str(tmp_path / f"{devices}_{kernel}"))
    assert results[devices, "pallas"]["train_loss"] == pytest.approx(
        results[devices, "xla"]["train_loss"], rel=1e-5)
  assert traced, "the kernel was not in the step"


def test_quickstarts_training_step_traced_for_an_abstract_gpu_mesh(monkeypatch):
  """The README's quickstart step (TASC with its curvature refresh, LAMB) traced on a mesh of 8
  abstract H100s and lowered for CUDA, as the bytes of a GPU run are compiled: the Pallas kernel
  is in the program, typed for shard_map."""
  import compressors  # pylint: disable=import-outside-toplevel
  from experiments import data, methods, models, tasks, train  # pylint: disable=import-outside-toplevel
  config = _quickstart_smoke()
  config.model.channels = (64, 64)
  mesh = _h100_mesh(8)
  workers = compressors.Workers.on(mesh, "data")
  dataset = data.load(config, data.ShardSpec(8, tuple(range(8))))
  model = models.build_model(config.model, **dataset.model_fields)
  task = tasks.TASKS[dataset.task]
  learning_rate = methods.learning_rate_schedule(config, dataset.steps_per_epoch, 2)
  tx = methods.training_chain(config, learning_rate, workers.axis_name)
  first = dataset.train_batch(0)
  init_variables = train._variables_initializer(model, task, {k: v[0] for k, v in first.items()},
                                                workers.count)
  params, model_state = jax.eval_shape(init_variables, config.seed)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), first)
  example = (train.TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, model_state, ()),
             batch)
  monkeypatch.setattr(fused, "gpu_kernel_available", lambda block_size: True)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  program = train._build_program(model, task, tx, learning_rate, workers, config, example,
                                 methods.step_inputs(config))
  with jax.sharding.use_abstract_mesh(mesh):
    opt_state = jax.eval_shape(program.init_opt_state, params)
    state = train.TrainState(train._abstract(example[0].step, mesh, P()),
                             train._abstract(params, mesh, P()),
                             train._abstract(model_state, mesh, workers.spec),
                             train._abstract(opt_state, mesh, program.specs.opt_state))
    lowered = program.train_steps[True].trace(
        state, train._abstract(batch, mesh, workers.spec)).lower(lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text().lower()
