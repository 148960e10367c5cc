"""LAMB and LARS against optax and against the papers' update rules written in numpy (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from compressors.parallel import fsdp
import optimizers
from optimizers import exclusions

STEPS = 10


def make_params(seed: int = 0) -> dict:
  """A kernel of norm ~4, a small 3-D kernel (norm ~0.25), a bias and an all-zero kernel."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(jnp.float32, {
      "dense": {"kernel": rng.normal(size=(5, 3)), "bias": 0.1 * rng.normal(size=3)},
      "conv": {"kernel": 0.05 * rng.normal(size=(2, 3, 4))},
      "zero": {"kernel": np.zeros((3, 2))},
  })


def make_gradients(params: dict, steps: int, seed: int = 1) -> list[dict]:
  """Fixed gradients (independent of the trajectory, so numpy can replay them in float64)."""
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda p: jnp.float32(rng.normal(size=p.shape)), params)
          for _ in range(steps)]


def run(tx: optax.GradientTransformation, params: dict, gradients: list[dict]) -> list[dict]:
  """Applies ``tx`` to the given gradients; returns the parameters after every step."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  trajectory = []
  for grads in gradients:
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    trajectory.append(params)
  return trajectory


def run_with_param_dependent_gradients(tx, params, steps: int) -> list[dict]:
  """Like :func:`run`, with gradients ``0.5 * params + noise`` so the trajectory feeds back."""
  noise = make_gradients(params, steps)
  state = tx.init(params)
  update = jax.jit(tx.update)
  trajectory = []
  for step_noise in noise:
    grads = jax.tree.map(lambda p, n: 0.5 * p + n, params, step_noise)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    trajectory.append(params)
  return trajectory


def max_abs_difference(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def leaf_names(tree) -> list[str]:
  return ["/".join(exclusions.path_names(path))
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# ----------------------------------------------------------------------------- optax equality

LAMB_SETTINGS = [
    dict(learning_rate=1e-2, weight_decay=0.0),
    dict(learning_rate=3e-2, b1=0.8, b2=0.99, eps=1e-5, weight_decay=0.01),
    dict(learning_rate=optax.linear_schedule(0.0, 5e-2, 4), weight_decay=0.1),
]

LARS_SETTINGS = [
    dict(learning_rate=0.5, weight_decay=0.0),
    dict(learning_rate=1.0, weight_decay=1e-3, trust_coefficient=0.01, eps=1e-6, momentum=0.8),
    dict(learning_rate=optax.cosine_decay_schedule(2.0, 10), weight_decay=5e-4, nesterov=True),
    dict(learning_rate=0.3, weight_decay=1e-2, momentum=0.0),
]


@pytest.mark.parametrize("settings", LAMB_SETTINGS)
def test_lamb_equals_optax_without_exclusions(settings):
  params = make_params()
  ours = run_with_param_dependent_gradients(
      optimizers.lamb(**settings, exclude=None), params, STEPS)
  theirs = run_with_param_dependent_gradients(optax.lamb(**settings), params, STEPS)
  assert max(max_abs_difference(a, b) for a, b in zip(ours, theirs)) <= 1e-7
  assert max_abs_difference(ours[-1], params) > 1e-3  # the optimizer did move the parameters


@pytest.mark.parametrize("settings", LARS_SETTINGS)
def test_lars_optax_denominator_equals_optax(settings):
  params = make_params()
  ours = run_with_param_dependent_gradients(
      optimizers.lars(**settings, denominator="optax", exclude=None), params, STEPS)
  theirs = run_with_param_dependent_gradients(optax.lars(**settings), params, STEPS)
  assert max(max_abs_difference(a, b) for a, b in zip(ours, theirs)) <= 1e-7
  assert max_abs_difference(ours[-1], params) > 1e-4


# ------------------------------------------------------------------ paper formulas (numpy f64)

def learning_rate_at(learning_rate, step: int) -> float:
  return float(learning_rate(step)) if callable(learning_rate) else learning_rate


def lamb_reference(params, gradients, *, learning_rate, b1=0.9, b2=0.999, eps=1e-6,
                   weight_decay=0.01, bias_correction=True, trust_clip=None, excluded=()):
  """You et al. 2020, Algorithm 2, leaf by leaf in float64; returns the parameters per step."""
  names = leaf_names(params)
  x = [np.asarray(p, np.float64) for p in jax.tree.leaves(params)]
  m = [np.zeros_like(p) for p in x]
  v = [np.zeros_like(p) for p in x]
  trajectory = []
  for t, grads in enumerate(gradients, start=1):
    lr = learning_rate_at(learning_rate, t - 1)
    for i, g in enumerate(jax.tree.leaves(grads)):
      g = np.asarray(g, np.float64)
      m[i] = b1 * m[i] + (1 - b1) * g
      v[i] = b2 * v[i] + (1 - b2) * g * g
      m_hat, v_hat = (m[i] / (1 - b1**t), v[i] / (1 - b2**t)) if bias_correction else (m[i], v[i])
      r = m_hat / (np.sqrt(v_hat) + eps)
      if names[i] in excluded:
        step = r
      else:
        u = r + weight_decay * x[i]
        x_norm, u_norm = np.linalg.norm(x[i]), np.linalg.norm(u)
        phi = x_norm if trust_clip is None else min(max(x_norm, trust_clip[0]), trust_clip[1])
        ratio = phi / u_norm if x_norm > 0 and u_norm > 0 else 1.0
        step = ratio * u
      x[i] = x[i] - lr * step
    trajectory.append(list(x))
  return trajectory


def lars_reference(params, gradients, *, learning_rate, momentum=0.9, weight_decay=1e-4,
                   trust_coefficient=0.001, eps=0.0, nesterov=False, excluded=()):
  """You, Gitman & Ginsburg 2017 / MLPerf ``LARSOptimizer`` in float64, leaf by leaf."""
  names = leaf_names(params)
  w = [np.asarray(p, np.float64) for p in jax.tree.leaves(params)]
  velocity = [np.zeros_like(p) for p in w]
  trajectory = []
  for t, grads in enumerate(gradients):
    lr = learning_rate_at(learning_rate, t)
    for i, g in enumerate(jax.tree.leaves(grads)):
      g = np.asarray(g, np.float64)
      if names[i] in excluded:
        direction = g
      else:
        w_norm, g_norm = np.linalg.norm(w[i]), np.linalg.norm(g)
        local_lr = (trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
                    if w_norm > 0 and g_norm > 0 else 1.0)
        direction = local_lr * (g + weight_decay * w[i])
      velocity[i] = momentum * velocity[i] + lr * direction
      w[i] = w[i] - (momentum * velocity[i] + lr * direction if nesterov else velocity[i])
    trajectory.append(list(w))
  return trajectory


def assert_matches_reference(trajectory, reference, params):
  """Compares displacements from the start (what the optimizer did), in relative terms."""
  start = [np.asarray(p, np.float64) for p in jax.tree.leaves(params)]
  for ours, theirs in zip(trajectory, reference):
    for p0, a, b in zip(start, jax.tree.leaves(ours), theirs):
      np.testing.assert_allclose(np.asarray(a, np.float64) - p0, b - p0, rtol=2e-4, atol=1e-7)


DEFAULT_EXCLUDED = ("dense/bias",)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("trust_clip", [None, (0.5, 2.0)])
def test_lamb_matches_algorithm_2(bias_correction, trust_clip):
  params = make_params()
  gradients = make_gradients(params, 3)
  settings = dict(learning_rate=0.05, weight_decay=0.01, bias_correction=bias_correction,
                  trust_clip=trust_clip)
  if trust_clip is not None:  # both bounds bind: phi changes the dense and the conv kernel
    norms = dict(zip(leaf_names(params), map(float, map(jnp.linalg.norm, jax.tree.leaves(params)))))
    assert norms["dense/kernel"] > trust_clip[1] and norms["conv/kernel"] < trust_clip[0]
  trajectory = run(optimizers.lamb(**settings), params, gradients)
  reference = lamb_reference(params, gradients, **settings, excluded=DEFAULT_EXCLUDED)
  assert_matches_reference(trajectory, reference, params)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-2])
def test_lars_matches_paper(nesterov, eps):
  params = make_params()
  gradients = make_gradients(params, 3)
  settings = dict(learning_rate=optax.linear_schedule(1.0, 0.5, 3), momentum=0.9,
                  weight_decay=0.05, trust_coefficient=0.01, eps=eps, nesterov=nesterov)
  trajectory = run(optimizers.lars(**settings), params, gradients)
  reference = lars_reference(params, gradients, **settings, excluded=DEFAULT_EXCLUDED)
  assert_matches_reference(trajectory, reference, params)


def test_lars_denominators_differ():
  params = make_params()
  gradients = make_gradients(params, 1)
  settings = dict(learning_rate=1.0, weight_decay=0.1)
  paper = run(optimizers.lars(**settings, denominator="paper"), params, gradients)[0]
  optax_form = run(optimizers.lars(**settings, denominator="optax"), params, gradients)[0]
  step_paper = paper["dense"]["kernel"] - params["dense"]["kernel"]
  step_optax = optax_form["dense"]["kernel"] - params["dense"]["kernel"]
  # ||g|| + wd ||w|| > ||g + wd w|| unless g and w are parallel: the paper's step is shorter.
  assert float(jnp.linalg.norm(step_paper)) < 0.99 * float(jnp.linalg.norm(step_optax))
  # Both leave the excluded bias alone: the same plain SGD step there.
  np.testing.assert_array_equal(paper["dense"]["bias"], optax_form["dense"]["bias"])


def test_zero_norm_leaf_gets_ratio_one():
  params = make_params()
  gradients = make_gradients(params, 1)
  new = run(optimizers.lars(learning_rate=0.1, trust_coefficient=0.001), params, gradients)[0]
  np.testing.assert_allclose(new["zero"]["kernel"], -0.1 * gradients[0]["zero"]["kernel"],
                             rtol=1e-6)


# ---------------------------------------------------------------------------------- exclusions

def first_step(tx, params):
  """The first update ``tx`` makes, and the gradients it was given."""
  grads = make_gradients(params, 1)[0]
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  return updates, grads


def test_bias_gets_neither_decay_nor_trust_ratio_by_default():
  params = make_params()
  lr = 0.05
  step, grads = first_step(optimizers.lars(lr, weight_decay=0.5), params)
  np.testing.assert_allclose(step["dense"]["bias"], -lr * grads["dense"]["bias"], rtol=1e-6)
  step, grads = first_step(optimizers.lamb(lr, weight_decay=0.5), params)
  # Bias-corrected Adam's first step is g / (|g| + eps); rtol 2e-5 because float32's
  # 1 - 0.999 is 1.3e-5 off.
  g = grads["dense"]["bias"]
  np.testing.assert_allclose(step["dense"]["bias"], -lr * g / (jnp.abs(g) + 1e-6), rtol=2e-5)
  # ...while without exclusions the bias is decayed and trust-scaled.
  step_all, _ = first_step(optimizers.lamb(lr, weight_decay=0.5, exclude=None), params)
  assert max_abs_difference(step_all["dense"]["bias"], step["dense"]["bias"]) > 1e-3


def conv_kernel_only(path, leaf):
  del leaf
  return path == ("conv", "kernel")


@pytest.mark.parametrize("exclude", [
    conv_kernel_only,
    {"dense": {"kernel": False, "bias": False}, "conv": {"kernel": True}, "zero": False},
], ids=["predicate", "mask_pytree"])
@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_custom_exclusions(exclude, optimizer):
  params = make_params()
  lr = 0.05
  if optimizer == "lars":
    tx = optimizers.lars(lr, weight_decay=0.5, exclude=exclude)
    plain = lambda g: -lr * g
  else:
    tx = optimizers.lamb(lr, weight_decay=0.5, exclude=exclude)
    plain = lambda g: -lr * g / (jnp.abs(g) + 1e-6)
  step, grads = first_step(tx, params)
  np.testing.assert_allclose(step["conv"]["kernel"], plain(grads["conv"]["kernel"]), rtol=2e-5)
  # The bias is no longer excluded: it is decayed and trust-scaled, unlike a plain step.
  assert max_abs_difference(step["dense"]["bias"], plain(grads["dense"]["bias"])) > 1e-4


@pytest.mark.parametrize("path, shape, excluded", [
    (("params", "Dense_0", "bias"), (8,), True),
    (("params", "Dense_0", "kernel"), (4, 8), False),
    (("params", "LayerNorm_0", "scale"), (8,), True),
    (("params", "BatchNorm_1", "weird_matrix"), (2, 8), True),
    (("encoder", "layer_norm", "w"), (2, 8), True),
    (("resnet", "batch_normalization", "w"), (2, 8), True),
    (("attention", "out", "bias"), (4, 8), True),
    (("conv", "Conv_0", "kernel"), (3, 3, 4, 8), False),
    (("embed", "embedding"), (100, 8), False),
])
def test_default_exclude_rule(path, shape, excluded):
  assert optimizers.default_exclude(path, jnp.zeros(shape)) is excluded


def test_exclude_none_and_false_switch_exclusions_off():
  params = make_params()
  step_none, _ = first_step(optimizers.lars(0.05, weight_decay=0.5, exclude=None), params)
  step_false, _ = first_step(optimizers.lars(0.05, weight_decay=0.5, exclude=False), params)
  step_default, _ = first_step(optimizers.lars(0.05, weight_decay=0.5), params)
  assert max_abs_difference(step_none, step_false) == 0.0
  assert max_abs_difference(step_none["dense"]["bias"], step_default["dense"]["bias"]) > 1e-4


def test_mask_with_non_boolean_leaf_is_rejected():
  with pytest.raises(TypeError, match=r"exclude: the mask entry at dense/bias is 1"):
    optimizers.lars(0.1, exclude={"dense": {"kernel": False, "bias": 1}, "conv": False,
                                  "zero": False})


# ----------------------------------------------------------------------------------- on shards

SHARDS = 4
# What a compressor may leave in the padding (a sign compressor sends a sign for zeros too),
# and a method's update may land on the parameters': unequal, so that the norms' errors do not
# cancel in a ratio of two.
PARAM_GARBAGE, GRADIENT_GARBAGE = 7.0, 20.0


def make_shardable_params(seed: int = 0) -> dict:
  """Leaves that 4 shards lay out every way (:mod:`compressors.parallel.fsdp`): split along a
  dimension (the dense kernel's first, the conv kernel's last), or flattened and zero-padded:
  the bias (3 -> 4), a 3 x 5 kernel (15 -> 16: a matrix whose shards are vectors) and an
  all-zero kernel (6 -> 8, its norm 0 on every shard)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(jnp.float32, {
      "dense": {"kernel": rng.normal(size=(8, 3)), "bias": 0.1 * rng.normal(size=3)},
      "conv": {"kernel": 0.05 * rng.normal(size=(2, 3, 4))},
      "odd": {"kernel": rng.normal(size=(3, 5))},
      "zero": {"kernel": np.zeros((3, 2))},
  })


def stored_with_garbage(layout: fsdp.ParamLayout, tree: dict, garbage: float) -> dict:
  """``tree`` as the shards store it, with ``garbage`` in every padded entry."""
  def one(leaf, x):
    stored = leaf.to_stored(x)
    return stored if leaf.dim is not None else stored.at[x.size:].set(garbage)
  return jax.tree.map(one, layout.leaves, tree, is_leaf=lambda x: isinstance(x, fsdp.LeafLayout))


def run_on_shards(tx: optax.GradientTransformation, params: dict, gradients: list[dict],
                  zero_padding: bool = True) -> list[dict]:
  """:func:`run` with every leaf split over a 4-device axis ``"fsdp"`` inside ``shard_map``,
  garbage in the padding of the parameters and of every gradient; the parameters after every
  step, natural."""
  layout = fsdp.ParamLayout.of(params, "fsdp", SHARDS)
  tx = layout.padding_zeroed(tx) if zero_padding else tx
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:SHARDS]), ("fsdp",))
  specs = [layout.shard_specs] * len(gradients)

  def steps(params, gradients):
    state, trajectory = tx.init(params), []
    for grads in gradients:
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      trajectory.append(params)
    return trajectory

  program = jax.jit(jax.shard_map(steps, mesh=mesh, in_specs=(layout.shard_specs, specs),
                                  out_specs=specs))
  trajectory = program(stored_with_garbage(layout, params, PARAM_GARBAGE),
                       [stored_with_garbage(layout, g, GRADIENT_GARBAGE) for g in gradients])
  return [layout.to_natural(p) for p in trajectory]


def test_shardable_params_cover_every_layout_and_the_padded_matrix_is_a_vector_on_a_shard():
  params = make_shardable_params()
  layout = fsdp.ParamLayout.of(params, "fsdp", SHARDS)
  dims = jax.tree.map(lambda l: l.dim, layout.leaves,
                      is_leaf=lambda x: isinstance(x, fsdp.LeafLayout))
  assert dims == {"dense": {"kernel": 0, "bias": None}, "conv": {"kernel": 2},
                  "odd": {"kernel": None}, "zero": {"kernel": None}}
  # The default rule on a shard would exclude the 3 x 5 kernel; decided on the whole leaves
  # (what an optimizer on shards takes) only the bias is.
  assert optimizers.default_exclude(("odd", "kernel"), jnp.zeros((4,)))
  assert exclusions.excluded(optimizers.default_exclude, params) == {
      "dense": {"kernel": False, "bias": True}, "conv": {"kernel": False},
      "odd": {"kernel": False}, "zero": {"kernel": False}}


SHARDED_SETTINGS = [
    (optimizers.lamb, dict(learning_rate=0.05, weight_decay=0.1)),
    (optimizers.lamb, dict(learning_rate=0.05, weight_decay=0.1, trust_clip=(0.5, 2.0),
                           bias_correction=False)),
    (optimizers.lars, dict(learning_rate=0.5, weight_decay=0.01, trust_coefficient=0.01)),
    (optimizers.lars, dict(learning_rate=0.5, weight_decay=0.01, trust_coefficient=0.01,
                           eps=1e-3, denominator="optax", nesterov=True)),
]


SHARDED_EXCLUSIONS = {
    "default": optimizers.default_exclude, "predicate": conv_kernel_only,
    "mask_pytree": {"dense": {"kernel": False, "bias": False}, "conv": {"kernel": True},
                    "odd": True, "zero": False},
    "none": None,
}


@pytest.mark.usefixtures("fast_compiles")
@pytest.mark.parametrize("factory, settings, exclusion", [
    (*SHARDED_SETTINGS[0], "default"), (*SHARDED_SETTINGS[0], "predicate"),
    (*SHARDED_SETTINGS[0], "mask_pytree"), (*SHARDED_SETTINGS[1], "default"),
    (*SHARDED_SETTINGS[2], "default"), (*SHARDED_SETTINGS[2], "none"),
    (*SHARDED_SETTINGS[3], "mask_pytree"),
], ids=["lamb-default", "lamb-predicate", "lamb-mask", "lamb_clipped-default", "lars-default",
        "lars-none", "lars_optax_nesterov-mask"])
def test_on_shards_lamb_and_lars_take_the_whole_leaves_step(factory, settings, exclusion):
  """Each device's shard of the step the unsharded optimizer takes, to float32 rounding: the
  norms summed over the axis, the padding's garbage left out, the exclusions decided on the
  whole leaves."""
  exclude = SHARDED_EXCLUSIONS[exclusion]
  params = make_shardable_params()
  gradients = make_gradients(params, 4)
  whole = run(factory(**settings, exclude=exclude), params, gradients)
  sharded = run_on_shards(factory(**settings, shard_axis="fsdp",
                                  exclude=exclusions.excluded(exclude, params)),
                          params, gradients)
  for a, b in zip(whole, sharded):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6), a, b)
  assert max_abs_difference(whole[-1], params) > 1e-2  # the optimizer did move the parameters


@pytest.mark.usefixtures("fast_compiles")
@pytest.mark.parametrize("settings", LAMB_SETTINGS)
def test_lamb_on_shards_equals_optax_without_exclusions(settings):
  params = make_shardable_params()
  gradients = make_gradients(params, 4)
  ours = run_on_shards(optimizers.lamb(**settings, exclude=None, shard_axis="fsdp"), params,
                       gradients)
  theirs = run(optax.lamb(**settings), params, gradients)
  assert max(max_abs_difference(a, b) for a, b in zip(ours, theirs)) <= 1e-6


@pytest.mark.usefixtures("fast_compiles")
@pytest.mark.parametrize("settings", LARS_SETTINGS)
def test_lars_on_shards_optax_denominator_equals_optax(settings):
  params = make_shardable_params()
  gradients = make_gradients(params, 4)
  ours = run_on_shards(optimizers.lars(**settings, denominator="optax", exclude=None,
                                       shard_axis="fsdp"), params, gradients)
  theirs = run(optax.lars(**settings), params, gradients)
  assert max(max_abs_difference(a, b) for a, b in zip(ours, theirs)) <= 1e-6


@pytest.mark.usefixtures("fast_compiles")
@pytest.mark.parametrize("factory, settings", SHARDED_SETTINGS[::2], ids=["lamb", "lars"])
def test_garbage_in_the_padding_would_reach_the_norms_unless_zeroed(factory, settings):
  """Why ``padding_zeroed`` wraps the optimizer: without it the padded leaves' norms count the
  garbage and their steps go wrong (the leaves split along a dimension have no padding)."""
  params = make_shardable_params()
  gradients = make_gradients(params, 2)
  tx = factory(**settings, shard_axis="fsdp",
               exclude=exclusions.excluded(optimizers.default_exclude, params))
  zeroed, raw = (run_on_shards(tx, params, gradients, zero_padding=z)[-1] for z in (True, False))
  moved = max_abs_difference(zeroed["odd"], params["odd"])
  assert max_abs_difference(zeroed["odd"], raw["odd"]) > 0.3 * moved
  np.testing.assert_array_equal(zeroed["conv"]["kernel"], raw["conv"]["kernel"])


# ---------------------------------------------------------------------------------- schedules

@pytest.mark.parametrize("warmup, power", [(4, 1.0), (4, 2.0), (0, 2.0)])
def test_warmup_polynomial_decay(warmup, power):
  peak, end, total = 2.0, 0.1, 12
  schedule = optimizers.warmup_polynomial_decay(peak, warmup, total, end_value=end, power=power)
  for t in range(total + 3):
    if t < warmup:
      expected = peak * t / warmup
    else:
      decay_steps = total - warmup
      expected = end + (peak - end) * (1 - min(t - warmup, decay_steps) / decay_steps)**power
    assert float(schedule(t)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("batch_size, base_lr, warmup_epochs", [
    (256, 10.0, 5), (16383, 10.0, 5), (16384, 25.0, 5), (32767, 25.0, 5),
    (32768, 31.2, 25), (65536, 31.2, 25),
])
def test_mlperf_lars_preset(batch_size, base_lr, warmup_epochs):
  preset = optimizers.mlperf_lars_preset(batch_size)
  assert (preset.base_learning_rate, preset.warmup_epochs) == (base_lr, warmup_epochs)
  assert (preset.end_learning_rate, preset.power) == (1e-4, 2.0)


def test_mlperf_lars_schedule_matches_reference_formula():
  steps_per_epoch, train_steps, batch_size = 3, 40, 4096
  schedule = optimizers.mlperf_lars_schedule(batch_size, steps_per_epoch, train_steps)
  warmup_steps, decay_steps = 5 * steps_per_epoch, train_steps - 5 * steps_per_epoch + 1
  for step in range(train_steps + 1):  # PolynomialDecayWithWarmup._get_learning_rate
    if step <= warmup_steps:
      expected = 10.0 * step / warmup_steps
    else:
      expected = (10.0 - 1e-4) * (1 - min(step - warmup_steps, decay_steps) / decay_steps)**2 + 1e-4
    assert float(schedule(step)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("rule, expected", [("linear", 1.6), ("sqrt", 0.4)])
def test_scale_learning_rate(rule, expected):
  lr = optimizers.scale_learning_rate(0.1, 2048, base_batch_size=128, rule=rule)
  assert lr == pytest.approx(expected)


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("factory, kwargs, message", [
    (optimizers.lamb, dict(learning_rate=-1e-3), r"lamb: learning_rate=-0.001 .* >= 0"),
    (optimizers.lamb, dict(learning_rate=1e-3, b1=1.0), r"lamb: b1=1.0 .* in \[0, 1\)"),
    (optimizers.lamb, dict(learning_rate=1e-3, b1=-0.1), r"lamb: b1=-0.1 .* in \[0, 1\)"),
    (optimizers.lamb, dict(learning_rate=1e-3, b2=1.5), r"lamb: b2=1.5 .* in \[0, 1\)"),
    (optimizers.lamb, dict(learning_rate=1e-3, eps=0.0), r"lamb: eps=0.0 .* > 0"),
    (optimizers.lamb, dict(learning_rate=1e-3, weight_decay=-0.1),
     r"lamb: weight_decay=-0.1 .* >= 0"),
    (optimizers.lamb, dict(learning_rate=1e-3, trust_clip=(2.0, 1.0)),
     r"lamb: trust_clip=\(2.0, 1.0\) .* lower <= upper"),
    (optimizers.lamb, dict(learning_rate=1e-3, trust_clip=(-1.0, 1.0)),
     r"lamb: trust_clip\[0\] \(lower\)=-1.0 .* >= 0"),
    (optimizers.lamb, dict(learning_rate=1e-3, trust_clip=3.0), r"lamb: trust_clip=3.0 .* pair"),
    (optimizers.lars, dict(learning_rate=-0.1), r"lars: learning_rate=-0.1 .* >= 0"),
    (optimizers.lars, dict(learning_rate=0.1, momentum=1.0), r"lars: momentum=1.0 .* in \[0, 1\)"),
    (optimizers.lars, dict(learning_rate=0.1, momentum=-0.5),
     r"lars: momentum=-0.5 .* in \[0, 1\)"),
    (optimizers.lars, dict(learning_rate=0.1, weight_decay=-1e-4),
     r"lars: weight_decay=-0.0001 .* >= 0"),
    (optimizers.lars, dict(learning_rate=0.1, trust_coefficient=0.0),
     r"lars: trust_coefficient=0.0 .* > 0"),
    (optimizers.lars, dict(learning_rate=0.1, eps=-1.0), r"lars: eps=-1.0 .* >= 0"),
    (optimizers.lars, dict(learning_rate=0.1, denominator="mine"),
     r"lars: denominator='mine' .* one of 'paper', 'optax'"),
    (optimizers.scale_learning_rate, dict(base_learning_rate=0.1, batch_size=256,
                                          base_batch_size=128, rule="cubic"),
     r"scale_learning_rate: rule='cubic' .* one of 'linear', 'sqrt'"),
    (optimizers.scale_learning_rate, dict(base_learning_rate=0.1, batch_size=0,
                                          base_batch_size=128, rule="linear"),
     r"scale_learning_rate: batch_size=0 .* int >= 1"),
    (optimizers.warmup_polynomial_decay, dict(peak_value=1.0, warmup_steps=10, total_steps=10),
     r"warmup_polynomial_decay: total_steps=10 .* int >= 11"),
    (optimizers.mlperf_lars_preset, dict(batch_size=0), r"mlperf_lars_preset: batch_size=0"),
])
def test_bad_hyper_parameters_raise_value_error(factory, kwargs, message):
  with pytest.raises(ValueError, match=message):
    factory(**kwargs)


@pytest.mark.parametrize("factory, kwargs, message", [
    (optimizers.lamb, dict(learning_rate="0.1"), r"lamb: learning_rate='0.1' .* real number"),
    (optimizers.lamb, dict(learning_rate=0.1, bias_correction="yes"),
     r"lamb: bias_correction='yes' is not a bool"),
    (optimizers.lars, dict(learning_rate=0.1, nesterov=1), r"lars: nesterov=1 is not a bool"),
    (optimizers.lars, dict(learning_rate=0.1, momentum=None), r"lars: momentum=None .* real"),
    (optimizers.lamb, dict(learning_rate=0.1, shard_axis=3),
     r"lamb: shard_axis=3 is not a mesh axis's name; shard_axis must be None, a non-empty "),
    (optimizers.lars, dict(learning_rate=0.1, shard_axis=""), r"lars: shard_axis='' is not"),
])
def test_wrong_types_raise_type_error(factory, kwargs, message):
  with pytest.raises(TypeError, match=message):
    factory(**kwargs)


def test_update_without_params_is_rejected():
  tx = optimizers.scale_by_layerwise_trust_ratio(trust_clip=(0.0, 10.0))
  params = make_params()
  with pytest.raises(ValueError, match="scale_by_layerwise_trust_ratio: params is None"):
    tx.update(params, tx.init(params))
