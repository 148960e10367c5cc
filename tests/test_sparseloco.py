"""SparseLoCo as published (Sarfi et al. 2025, arXiv 2508.15706): ``method="sparseloco"`` with its
default exchange ``chunk_topk`` (``compressors/_chunked_topk.py``) against a numpy float64
reference of the paper's algorithm; its error-feedback bookkeeping; its bytes against top-k's at
equal density, read from the compiled HLO; its refusals of bad settings; and its equal-bytes
tiers. The shared checks (tests/method_checks.py) run ``chunk_topk`` and ``sparseloco`` too."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import compressors
from compressors import equal_bytes
from compressors import registry
from compressors import _chunked_topk as chunked
from configs.paper import lm
from experiments import methods
from experiments import validation
from tests import harness
from tests import test_equal_bytes

pytestmark = pytest.mark.usefixtures("fast_compiles")

# A two-leaf model of 1,250 entries: chunks of 256 cut it into five, the last padded (226 real).
PARAMS = {"b": jnp.zeros((50,)), "w": jnp.zeros((30, 40))}
SIZE = 1250
CHUNK, DENSITY = 256, 1 / 16  # k = 16 a chunk
BETA = 0.95


# ------------------------------------------------------------------------- the numpy reference

def reference_compress(e: np.ndarray, chunk: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  """The paper's ``Q2(chunked-top-k(e))`` in float64, as its port (templar) computes it: per
  chunk (the last padded, padding never chosen before a real entry) the ``k`` largest
  magnitudes; their values centred on their mean, scaled by ``6 std / 4`` (``std`` with
  ``k - 1``; 1 when 0), rounded (ties to even) to codes ``0..3`` with offset 2; each code
  decoded to the mean of the values it stands for. Returns the dense decoded buffer and the
  mask of the entries chosen."""
  n = -(-e.size // chunk)
  padded = np.zeros(n * chunk)
  padded[:e.size] = e
  magnitude = np.where(np.arange(n * chunk) < e.size, np.abs(padded), -1).reshape(n, chunk)
  sent = np.zeros(n * chunk)
  chosen = np.zeros(n * chunk, bool)
  for c in range(n):
    idx = np.argsort(-magnitude[c], kind="stable")[:k] + c * chunk
    v = padded[idx]
    shift = v.mean()
    centred = v - shift
    std = np.linalg.norm(centred) / math.sqrt(k - 1) if k > 1 else math.nan
    scale = 6 * std / 4
    scale = 1.0 if scale == 0 or not math.isfinite(scale) else scale
    codes = np.clip(np.round(centred / scale + 2), 0, 3).astype(int)
    lookup = np.array([centred[codes == b].mean() if (codes == b).any() else 0.0
                       for b in range(4)])
    sent[idx] = lookup[codes] + shift
    chosen[idx] = True
  return sent[:e.size], chosen[:e.size]


def reference_sparseloco(theta: np.ndarray, deltas: list[np.ndarray], chunk: int, k: int,
                         beta: float, alpha: float,
                         average: str = "senders") -> tuple[np.ndarray, np.ndarray]:
  """SparseLoCo's synchronisations in float64: per worker ``e <- beta e + Delta``,
  ``s = Q2(chunked-top-k(e))``, ``e <- e - s``; then ``theta <- theta - alpha mean(s)``, each
  entry's mean over the workers that sent it (the authors' ``scatter_reduce_(reduce="mean",
  include_self=False)``: 0 where none did), or with ``average="workers"`` over all of them.

  Args:
    theta: the synchronised parameters before the first synchronisation, ``[D]``.
    deltas: each synchronisation's pseudo-gradients, ``[workers, D]``.

  Returns:
    ``(theta, e)`` after the last synchronisation (``e``: ``[workers, D]``).
  """
  theta = theta.astype(np.float64)
  e = np.zeros(deltas[0].shape)
  for delta in deltas:
    e = beta * e + delta
    sent, chosen = (np.stack(a) for a in zip(*[reference_compress(row, chunk, k) for row in e]))
    e = e - sent
    if average == "senders":
      theta = theta - alpha * sent.sum(0) / np.maximum(chosen.sum(0), 1)
    else:
      theta = theta - alpha * sent.mean(0)
  return theta, e


# --------------------------------------------------------------- sparseloco under shard_map

def _synchronising_steps(tx, mesh):
  """``(init, sync)`` of a local-update transformation under shard_map, every step a
  synchronisation: ``sync(state, grads)`` runs one inner step from the synchronised
  parameters (every worker holds them) and the synchronisation, and returns the new state."""
  specs = compressors.state_specs(tx, PARAMS, mesh, "data", per_worker_params=True,
                                  options={"synchronise": True})
  init = jax.jit(jax.shard_map(lambda p: compressors.add_device_axis(tx.init(p), specs),
                               mesh=mesh, in_specs=P(), out_specs=specs))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs)
  def sync(state, grads):
    state = compressors.drop_device_axis(state, specs)
    grads = jax.tree.map(lambda g: g[0], grads)
    _, state = tx.update(grads, state, state.anchor, synchronise=True)
    return compressors.add_device_axis(state, specs)

  return init, sync


def _residual(state, workers: int) -> np.ndarray:
  """The exchange's error buffers, ``[workers, D]`` in the fused layout."""
  return harness.fused(state.exchange.residual, workers)


def _anchor(state, workers: int) -> np.ndarray:
  """The synchronised parameters, ``[D]`` (the same on every worker)."""
  rows = harness.fused(state.anchor, workers) if all(
      np.shape(a)[0] == workers and np.ndim(a) == np.ndim(p) + 1
      for a, p in zip(jax.tree.leaves(state.anchor), jax.tree.leaves(PARAMS))) else (
          harness.fused(state.anchor, 1))
  assert (rows == rows[0]).all()
  return rows[0]


@pytest.mark.parametrize("average", ["senders", "workers"])
def test_sparseloco_matches_a_float64_reference_of_the_paper_over_several_synchronisations(
    average):
  """4 workers, 4 synchronisations (inner SGD of rate 1 on given gradients, so that each
  pseudo-gradient is known): the synchronised parameters and every worker's error buffer match
  the reference to float32's rounding, with the authors' mean over senders (the default) and
  with the mean over all workers kept for comparison."""
  workers, syncs = 4, 4
  tx = registry.training(
      "sparseloco", registry.default_settings("sparseloco", every=1),
      optimizer=optax.sgd(1.0), learning_rate=1.0, axis_name="data",
      exchange_settings=registry.default_settings("chunk_topk", chunk=CHUNK, density=DENSITY,
                                                  average=average))
  init, sync = _synchronising_steps(tx, harness.mesh(workers))
  state = init(PARAMS)
  theta = _anchor(state, workers)
  deltas = []
  for t in range(syncs):
    grads = harness.per_worker_grads(jax.random.PRNGKey(10 + t), workers, PARAMS)
    # The pseudo-gradient the step forms, in float32: anchor - (anchor + (-g)).
    anchor = _anchor(state, workers)
    g = harness.fused(grads, workers)
    deltas.append((anchor - (anchor + -g)).astype(np.float64))
    state = sync(state, grads)
  want_theta, want_e = reference_sparseloco(theta, deltas, CHUNK, round(DENSITY * CHUNK), BETA,
                                            alpha=1.0, average=average)
  scale = np.abs(np.stack(deltas)).max()
  np.testing.assert_allclose(_anchor(state, workers), want_theta, rtol=0, atol=1e-5 * scale)
  np.testing.assert_allclose(_residual(state, workers), want_e, rtol=0, atol=1e-5 * scale)
  assert np.abs(want_e).max() > 0.1 * scale  # the buffers hold something to compare


def test_two_workers_sending_disjoint_entries_move_each_entry_by_its_senders_value():
  """The issue's check of the mean: worker 0's large entries fill the first half of every
  chunk, worker 1's the second half, and each keeps half a chunk, so their supports are
  disjoint. Each entry of the mean is then its sender's decoded value (the authors' mean over
  senders); the mean over all workers gives half of it."""
  chunk, workers = 16, 2
  params = {"w": jnp.zeros((4 * chunk,))}
  first = (jnp.arange(4 * chunk) % chunk) < chunk // 2
  ramp = 1.0 + jnp.arange(4 * chunk, dtype=jnp.float32) / 8
  grads = {"w": jnp.stack([jnp.where(first, ramp, 0.01), jnp.where(first, 0.01, -ramp)])}
  means = {}
  for average in ("senders", "workers"):
    tx = compressors.compress(compressors.chunk_topk(0.5, chunk=chunk, average=average),
                              axis_name="data")
    state, update = harness.shard_map_update(tx, harness.mesh(workers), params)
    means[average] = np.asarray(update(params, state, grads)[0]["w"])
  sent = {i: np.asarray(chunked.decode_buffer(
      chunked.encode_buffer(grads["w"][i], chunked.layout(4 * chunk, chunk, 0.5)), 4 * chunk,
      chunked.layout(4 * chunk, chunk, 0.5))) for i in range(workers)}
  owner = np.where(np.asarray(first), 0, 1)
  want = np.where(owner == 0, sent[0], sent[1])
  assert ((sent[0] != 0) != (sent[1] != 0)).all()  # disjoint, and every entry sent by one
  np.testing.assert_array_equal(means["senders"], want)
  np.testing.assert_allclose(means["workers"], want / 2, rtol=1e-7)


def test_an_entry_nobody_sent_stays_zero_and_shared_entries_are_averaged():
  """Three workers, one chunk of 8 entries, 2 kept: entry 0 sent by all three, entry 1 by two,
  entry 2 by one, the rest by none. Each entry's mean is over its senders (the float64
  reference's), and 0 where nobody sent."""
  params = {"w": jnp.zeros((8,))}
  grads = {"w": jnp.array([[4.0, 3.0, 0, 0, 0, 0, 0, 0],
                           [8.0, 6.0, 0, 0, 0, 0, 0, 0],
                           [6.0, 0.0, 5.0, 0, 0, 0, 0, 0]])}
  tx = compressors.compress(compressors.chunk_topk(0.25, chunk=8), axis_name="data",
                            error_feedback=False)
  state, update = harness.shard_map_update(tx, harness.mesh(3), params)
  mean = np.asarray(update(params, state, grads)[0]["w"])
  sent, chosen = (np.stack(a) for a in zip(*[reference_compress(np.asarray(g, np.float64), 8, 2)
                                              for g in grads["w"]]))
  np.testing.assert_array_equal(chosen.sum(0), [3, 2, 1, 0, 0, 0, 0, 0])
  np.testing.assert_allclose(mean, sent.sum(0) / np.maximum(chosen.sum(0), 1), rtol=1e-6)
  assert mean[2] == sent[2, 2] != 0 and (mean[3:] == 0).all()


def _decayed_sum(e: np.ndarray, delta: np.ndarray, after: np.ndarray,
                 sent: np.ndarray) -> np.ndarray:
  """``beta e + Delta`` in float32 as the compiled step forms it: XLA's CPU backend contracts
  the multiply and the add into one fused multiply-add (one rounding: the exact product, a
  48-bit number, is exact in float64, so the float64 sum rounded to float32 is the FMA's but in
  a double-rounding tie, about one entry in 2**29); without contraction, two roundings. The one
  whose residual ``after`` is, bit for bit, ``x - sent``; the other, to fail with."""
  beta = np.float32(BETA)
  fused = (delta.astype(np.float64) + np.float64(beta) * e.astype(np.float64)).astype(np.float32)
  unfused = delta + beta * e
  return unfused if np.array_equal(after, unfused - sent) else fused


def test_error_feedback_keeps_exactly_what_was_not_sent():
  """Through sparseloco's own exchange (``registry.local_exchange``: ``chunk_topk`` with
  ``error_decay=0.95``), on one worker, whose returned mean is its decoded payload bit for bit:
  ``e_after == (beta e_before + Delta) - decoded`` in float32, bit for bit; entries not sent
  keep ``beta e_before + Delta`` exactly; and where an entry was sent, ``e_after + decoded``
  equals ``beta e_before + Delta`` to the one rounding of that float32 subtraction (exactly
  where it is exact: a 2-bit level is not the value it stands for, so the difference can need
  more bits than float32 has)."""
  tx = registry.local_exchange(
      registry.default_settings("sparseloco"),
      registry.default_settings("chunk_topk", chunk=CHUNK, density=DENSITY), axis_name="data",
      carrier="chunk_topk")
  state, update = harness.shard_map_update(tx, harness.mesh(1), PARAMS)
  exact = 0
  for t in range(4):
    grads = harness.per_worker_grads(jax.random.PRNGKey(t), 1, PARAMS)
    before = harness.fused(state.residual, 1)[0]
    mean, state = update(PARAMS, state, grads)
    after = harness.fused(state.residual, 1)[0]
    sent = harness.fused(mean, 1)[0]
    a = _decayed_sum(before, harness.fused(grads, 1)[0], after, sent)
    np.testing.assert_array_equal(after, a - sent)
    unsent = sent == 0
    assert unsent.sum() >= SIZE - 5 * 16  # at most k = 16 of each of the 5 chunks sent
    np.testing.assert_array_equal(after[unsent], a[unsent])
    wide = after.astype(np.float64) + sent.astype(np.float64) - a.astype(np.float64)
    assert (np.abs(wide) <= np.spacing(np.abs(after)) / 2).all()
    exact += int((wide == 0).sum())
  assert np.abs(before).max() > 0 and exact > 0.9 * 4 * SIZE


# ---------------------------------------------------------------------- bytes on the wire

def test_one_synchronisation_moves_at_most_0_4x_a_top_k_steps_bytes_at_equal_density():
  """200,000 entries, 8 workers, density 1/64: sparseloco's synchronisation (its exchange,
  ``chunk_topk`` with 4096-entry chunks) against float32 top-k's step, each read from its
  compiled program; each equals its cost-model entry."""
  params = {"w": jax.ShapeDtypeStruct((400, 500), jnp.float32)}
  mesh, n = harness.mesh(8), 200_000
  sync = registry.local_exchange(registry.default_settings("sparseloco"),
                                 registry.default_settings("chunk_topk", density=1 / 64),
                                 axis_name="data", carrier="chunk_topk")
  topk_settings = registry.default_settings("topk", density=1 / 64, selection="exact")
  topk = registry.transformation("topk", topk_settings, axis_name="data")
  ours, theirs = (harness.update_bytes(tx, params, mesh).total for tx in (sync, topk))
  # 49 chunks of 64 kept: 784 bytes of codes, 4,704 of 12-bit indices, 784 of levels; 7 copies.
  assert ours == 7 * (784 + 4704 + 784) == 43_904
  assert theirs == 7 * 3125 * 8 == 175_000
  assert ours / theirs <= 0.4
  topology = equal_bytes.topology(8)
  assert ours == registry.cost("sparseloco", [(n,)], topology).bytes_sent
  assert theirs == registry.cost("topk", [(n,)], topology, topk_settings).bytes_sent


@pytest.mark.parametrize("tier", ["30x", "100x"])
def test_equal_bytes_tiers_land_within_10_percent_in_the_compiled_hlo(tier):
  """As tests/test_equal_bytes.py checks the budgeted methods: on the CPU tier's parameters at 8
  workers, the density the solver picks sends within 10% of the tier in the compiled HLO, and
  within 2% of the cost model."""
  solution = equal_bytes.solve("chunk_topk", test_equal_bytes.cpu_shapes(), 8, tier)
  assert solution.feasible, solution.note
  test_equal_bytes.check([(solution, test_equal_bytes.hlo_bytes(solution, harness.mesh(8)))])


def test_tiers_below_the_levels_bytes_are_said_to_be_out_of_reach():
  """Four float32 levels a chunk (16 bytes of 4096 entries) and one kept entry a chunk bound the
  bytes from below: 300x and 1000x are out of reach at 8 workers, and the solver says so."""
  for tier in ("300x", "1000x"):
    solution = equal_bytes.solve("chunk_topk", test_equal_bytes.cpu_shapes(), 8, tier)
    assert not solution.feasible and "from the target" in solution.note


@pytest.mark.parametrize("ratio", [100, 1000])
def test_sparseloco_meets_a_tier_through_its_exchanges_density(ratio):
  """``method=sparseloco`` keeps H = 30 and sets ``chunk_topk``'s density to the tier over 30;
  its bytes per step, compiled, are on the tier."""
  settings, solution = methods.equal_bytes_settings(
      lm.get_config(f"method=sparseloco,ratio={ratio}"))
  assert solution.feasible, solution.note
  assert settings.carrier == "chunk_topk" and settings.every == 30
  params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in test_equal_bytes.cpu_shapes()]
  tx = registry.transformation("chunk_topk", solution.exchange_settings, axis_name="data")
  per_step = harness.update_bytes(tx, params, harness.mesh(8)).total / settings.every
  assert per_step == pytest.approx(solution.target_bytes, rel=0.1)
  assert per_step == pytest.approx(solution.bytes, rel=0.02)


# ---------------------------------------------------------------------------- bad settings

@pytest.mark.parametrize("fields, error, message", [
    (dict(chunk=1), ValueError, r"chunk_topk: chunk=1 is below 2; it must be an int in "
                                r"\[2, 16777216\]"),
    (dict(chunk=2**25), ValueError, r"chunk_topk: chunk=33554432 is above 16777216"),
    (dict(chunk=64.0), TypeError, r"chunk_topk: chunk must be an int in \[2, 16777216\], "
                                  r"got 64.0"),
    (dict(density=0.0), ValueError, r"chunk_topk: density=0.0 is outside \(0, 1\]"),
    (dict(density=1.5), ValueError, r"chunk_topk: density=1.5 is outside \(0, 1\]"),
    (dict(average="mean"), ValueError, r"chunk_topk: average='mean' is unknown; allowed: "
                                       r"\('workers', 'senders'\)"),
    (dict(density=1e-5), ValueError, r"chunk_topk: density=1e-05 keeps round\(1e-05 \* 4096\) = "
                                     r"0 of each chunk's 4096 entries; allowed: density in "
                                     r"\[0.000122, 1\] for chunk=4096"),
])
def test_bad_settings_are_refused_naming_the_field_the_value_and_what_is_allowed(
    fields, error, message):
  """Refused when the settings are made, before anything is traced: by the settings (a run's
  ``config.compression.chunk_topk``) and by the factory."""
  with pytest.raises(error, match=message):
    registry.default_settings("chunk_topk", **fields)
  with pytest.raises(error, match=message):
    compressors.chunk_topk(**fields)


@pytest.mark.parametrize("field, value, message", [
    ("chunk", 1, r"config.compression.chunk_topk.chunk=1 is below 2"),
    ("density", 1e-5, r"config.compression.chunk_topk: chunk_topk: density=1e-05 keeps "
                      r"round\(1e-05 \* 4096\) = 0"),
])
def test_a_runs_bad_exchange_settings_are_refused_before_it_starts(field, value, message):
  """A sparseloco run's ``config.compression.chunk_topk`` is checked with the config."""
  config = lm.get_config("method=sparseloco")
  config.compression.chunk_topk[field] = value
  with pytest.raises(ValueError, match=message):
    validation.check_config(config, 8)


def test_the_defaults_are_the_ports_and_sparseloco_takes_them():
  """Chunks of 4096 (64 x 64), 64 kept a chunk (density 1/64), 12-bit indices; sparseloco
  exchanges through them, and the float32 top-k exchange stays reachable."""
  settings = registry.default_settings("chunk_topk")
  assert (settings.chunk, settings.density) == (4096, 1 / 64)
  assert chunked.layout(10_000, settings.chunk, settings.density) == chunked.Layout(3, 4096, 64,
                                                                                  12)
  assert registry.default_settings("sparseloco").carrier == "chunk_topk"
  assert registry.get("chunk_topk").budget == "density"
  topk = registry.default_settings("sparseloco", carrier="topk")
  assert registry.cost("sparseloco", [(200_000,)], equal_bytes.topology(8), topk,
                       exchange_settings=registry.default_settings("topk", density=1 / 64)
                       ).bytes_sent == 175_000


def test_the_exchange_lowers_for_cuda_on_a_mesh_of_abstract_h100s(monkeypatch):
  """What a GPU process compiles (JAX's default backend a GPU, where top-k may take another
  path): the per-worker exchange traced under shard_map on 8 abstract H100s and lowered for
  CUDA, with the all-gather of packed bytes and no host callback."""
  mesh = harness.h100_mesh(8)
  tx = compressors.compress(compressors.chunk_topk(1 / 64), axis_name="data")
  params = {"w": jax.ShapeDtypeStruct((300, 70), jnp.float32)}
  specs = compressors.state_specs(tx, params, mesh, "data")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                     out_specs=(P(), specs))
  def update(params, state, grads):
    state = compressors.drop_device_axis(state, specs)
    mean, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
    return mean, compressors.add_device_axis(state, specs)

  def abstract(tree, spec):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, s)), tree,
        jax.tree.broadcast(spec, tree, is_leaf=lambda s: isinstance(s, P)),
        is_leaf=lambda s: isinstance(s, P))
  grads = {"w": jax.ShapeDtypeStruct((8, 300, 70), jnp.float32)}
  with jax.sharding.use_abstract_mesh(mesh):
    state = jax.eval_shape(jax.shard_map(
        lambda p: compressors.add_device_axis(tx.init(p), specs), mesh=mesh, in_specs=P(),
        out_specs=specs), params)
    lowered = jax.jit(update).trace(abstract(params, P()), abstract(state, specs),
                                    abstract(grads, P("data"))).lower(
                                        lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "all_gather" in text and "ui8" in text and "custom_call" not in text
