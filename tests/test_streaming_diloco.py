"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): ``method="streaming_diloco"``
against a numpy float64 reference of the algorithm (fragments synchronised staggered, the outer
result landing ``tau`` steps late and mixed by ``alpha``); replicas bit-identical on a landed
fragment with ``alpha = 0``; the step kinds; each step's bytes read from its compiled program
(no step moves more than a fragment); its refusals of bad settings; its equal-bytes pricing; the
runner training it and resuming between synchronisations bit for bit. The shared checks
(tests/method_checks.py) run it too (``tests/test_methods_common.py -k streaming``)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compressors
from compressors import equal_bytes
from compressors import registry
from experiments import train
from tests import harness
from tests.test_local_updates import assert_resumes_bit_for_bit

pytestmark = pytest.mark.usefixtures("fast_compiles")

DIM, ROWS = 5, 6  # features, rows of a batch per worker
INNER_LR, OUTER_LR, OUTER_MOMENTUM = 0.05, 0.7, 0.9


def _params(layers: int, seed: int = 1, dim: int = DIM) -> dict:
  """``layers`` weight matrices and biases (``2 layers`` leaves: ``b0, b1, ..., w0, w1, ...``
  in leaf order), small random values."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 2 * layers)
  return {**{f"w{k}": 0.1 * jax.random.normal(keys[k], (dim, dim)) for k in range(layers)},
          **{f"b{k}": 0.1 * jax.random.normal(keys[layers + k], (dim,))
             for k in range(layers)}}


def _features(x, k):
  """Layer ``k``'s input: ``sin((k + 1) x)`` (each layer its own gradient)."""
  return jnp.sin((k + 1) * x) if isinstance(x, jax.Array) else np.sin((k + 1) * x)


def _loss(params, batch):
  """One worker's mean squared error of ``sum_k sin((k + 1) x) @ w_k + b_k``."""
  x, y = batch
  layers = len(params) // 2
  prediction = sum(_features(x, k) @ params[f"w{k}"] + params[f"b{k}"] for k in range(layers))
  return jnp.mean((prediction - y) ** 2)


def _numpy_grads(params, x, y):
  layers = len(params) // 2
  residual = sum(_features(x, k) @ params[f"w{k}"] + params[f"b{k}"] for k in range(layers)) - y
  scale = 2 / residual.size
  return {**{f"w{k}": scale * _features(x, k).T @ residual for k in range(layers)},
          **{f"b{k}": scale * residual.sum(0) for k in range(layers)}}


def _batch(workers: int, seed: int = 0, dim: int = DIM):
  """Each worker's own rows (different gradients on every worker)."""
  key_x, key_w = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(key_x, (workers * ROWS, dim))
  return x, x @ jax.random.normal(key_w, (dim, dim)) + 0.5


def _streaming(params, workers, *, every, fragments, overlap, alpha, carrier="dense",
               inner=None, dim=DIM, land_at_turn=False):
  settings = registry.default_settings(
      "streaming_diloco", every=every, fragments=fragments, overlap=overlap, alpha=alpha,
      carrier=carrier, outer_learning_rate=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
      land_at_turn=land_at_turn)
  tx = registry.training("streaming_diloco", settings, optimizer=inner or optax.sgd(INNER_LR),
                         learning_rate=INNER_LR, axis_name="data")
  return compressors.data_parallel(
      _loss, tx, harness.mesh(workers), params, _batch(workers, dim=dim), axis_name="data",
      kinds=registry.step_kinds("streaming_diloco", settings), per_worker_params=True)


def _fragment_rows(params, fragments) -> list[dict]:
  """Per fragment, leaf name (sorted keys: ``jax.tree.leaves`` order) -> ``bool[rows]``: the rows
  of the leaf in the fragment (:func:`compressors.fragment_layout`)."""
  names = sorted(params)
  layout = compressors.fragment_layout([params[k].shape for k in names], fragments)
  out = []
  for pieces in layout:
    rows = {k: np.zeros(params[k].shape[0], bool) for k in names}
    for piece in pieces:
      rows[names[piece.leaf]][piece.start:piece.stop] = True
    out.append(rows)
  return out


def reference_streaming_diloco(params, x, y, steps, *, every, fragments, overlap, alpha):
  """The algorithm in float64 (see compressors/_streaming.py): each worker's inner SGD; the rows
  of :func:`compressors.fragment_layout`'s fragments; fragment ``p`` synchronised at the steps
  ``t`` with ``(t + 1 - p H // F) % H == 0``, after the step's inner update: the mean
  pseudo-gradient, an outer Nesterov step of the fragment's anchor; ``tau`` steps later (after
  that step's inner update) each worker's fragment becomes ``alpha w + (1 - alpha) anchor``.
  Returns ``(each worker's parameters, the anchor)``."""
  rows = _fragment_rows(params, fragments)
  anchor = {k: np.asarray(v, np.float64) for k, v in params.items()}
  velocity = {k: np.zeros_like(v) for k, v in anchor.items()}
  workers = [dict(anchor) for _ in range(len(x))]
  lands = {}  # step -> the fragments landing then
  for t in range(steps):
    for i, w in enumerate(workers):
      g = _numpy_grads(w, x[i], y[i])
      workers[i] = {k: w[k] - INNER_LR * g[k] for k in w}
    for p in range(fragments):
      if (t + 1 - p * every // fragments) % every == 0:
        for k, on in rows[p].items():
          delta = np.mean([anchor[k][on] - w[k][on] for w in workers], axis=0)
          velocity[k][on] = OUTER_MOMENTUM * velocity[k][on] + delta
          anchor[k] = anchor[k].copy()
          anchor[k][on] = anchor[k][on] - OUTER_LR * (delta + OUTER_MOMENTUM * velocity[k][on])
        lands.setdefault(t + overlap, []).append(p)
    for p in lands.pop(t, []):
      land_fragment(workers, anchor, rows[p], alpha)
  return workers, anchor


def land_fragment(workers, anchor, fragment_rows, alpha) -> None:
  """The reference's late landing of a fragment (its rows ``fragment_rows``, a leaf -> rows):
  each worker's rows become ``alpha w + (1 - alpha) anchor``, in place."""
  for w in workers:
    for k, on in fragment_rows.items():
      w[k] = w[k].copy()
      w[k][on] = alpha * w[k][on] + (1 - alpha) * anchor[k][on]


CASES = [  # (layers, workers, every, fragments, overlap, alpha)
    (1, 2, 4, 2, 0, 0.0),
    (2, 4, 4, 4, 1, 0.5),
    (2, 3, 6, 3, 2, 0.5),
    (2, 4, 5, 2, 1, 0.0),
]


@pytest.mark.parametrize("layers, workers, every, fragments, overlap, alpha", CASES)
def test_streaming_diloco_matches_a_float64_reference_of_the_algorithm(
    layers, workers, every, fragments, overlap, alpha):
  """About 3 rounds (``3 H + 1`` steps) on 2 to 4 workers with different gradients: every
  worker's parameters and the anchor, to float32's rounding."""
  params = _params(layers)
  steps = 3 * every + 1
  dp = _streaming(params, workers, every=every, fragments=fragments, overlap=overlap,
                  alpha=alpha)
  got, state = dp.worker_params(params), dp.init(params)
  for t in range(steps):
    got, state, _ = dp.step(got, state, _batch(workers), kind=dp.kind_at(t))
  x, y = (np.asarray(a, np.float64).reshape(workers, ROWS, -1) for a in _batch(workers))
  expected, anchor = reference_streaming_diloco(params, x, y, steps, every=every,
                                                fragments=fragments, overlap=overlap,
                                                alpha=alpha)
  for k in params:
    rows = np.asarray(got[k])
    for i in range(workers):
      np.testing.assert_allclose(rows[i], expected[i][k], rtol=2e-5, atol=2e-6,
                                 err_msg=f"worker {i}, {k}")
    np.testing.assert_allclose(compressors.synchronised_params(state)[k], anchor[k], rtol=2e-5,
                               atol=2e-6, err_msg=f"anchor, {k}")
  # The workers differ (their own gradients) and none of the steps synchronised them all.
  assert not bool(dp.replicas_agree(got))
  assert not any(dp.synchronises(k) for k in dp.kinds)


def reference_torchft(params, x, y, steps, *, every, fragments, overlap, alpha):
  """torchft's Streaming DiLoCo (pytorch/torchft, ``torchft/local_sgd.py``: ``DiLoCo`` with
  ``fragment_sync_delay=tau``, ``fragment_update_alpha=alpha``) transcribed in float64, every
  commit succeeding. After each step's inner update (its ``_step_post_hook``) the local step
  counts up to ``S = H / F``; at ``S - tau`` the current fragment (turns so far ``% F``) takes
  its pseudo-gradient ``original - local`` and starts its all-reduce (``prepare_sync``); at
  ``S`` (``perform_sync``) the outer optimizer (torch's SGD with Nesterov momentum) steps the
  fragment's ``original`` from itself by the mean, and the worker's fragment becomes
  ``lerp(original, local, alpha)``; the count restarts. torchft's fragment ``i`` is the one
  numbered ``(i + 1) % F`` here (compressors/_streaming.py: numbered one turn apart).
  Returns ``(each worker's parameters, the synchronised parameters)``."""
  assert every % fragments == 0 and overlap < every // fragments  # torchft's own conditions
  ours = _fragment_rows(params, fragments)
  rows = [ours[(i + 1) % fragments] for i in range(fragments)]
  original = {k: np.asarray(v, np.float64) for k, v in params.items()}
  momentum_buffer = {k: np.zeros_like(v) for k, v in original.items()}
  workers = [dict(original) for _ in range(len(x))]
  per_fragment_steps, local_step, turns, in_flight = every // fragments, 0, 0, None
  for _ in range(steps):
    for i, w in enumerate(workers):
      g = _numpy_grads(w, x[i], y[i])
      workers[i] = {k: w[k] - INNER_LR * g[k] for k in w}
    local_step += 1
    fragment = rows[turns % fragments]
    if local_step == per_fragment_steps - overlap:  # prepare_sync
      in_flight = {k: np.mean([original[k][on] - w[k][on] for w in workers], axis=0)
                   for k, on in fragment.items()}
    if local_step == per_fragment_steps:  # perform_sync
      for k, on in fragment.items():
        grad = in_flight[k]
        momentum_buffer[k][on] = OUTER_MOMENTUM * momentum_buffer[k][on] + grad
        original[k] = original[k].copy()
        original[k][on] -= OUTER_LR * (grad + OUTER_MOMENTUM * momentum_buffer[k][on])
        for w in workers:
          w[k] = w[k].copy()
          w[k][on] = original[k][on] + alpha * (w[k][on] - original[k][on])  # torch's lerp_
      local_step, turns, in_flight = 0, turns + 1, None
  return workers, original


@pytest.mark.parametrize("layers, workers, every, fragments, overlap, alpha", [
    (2, 2, 4, 2, 1, 0.5),
    (2, 4, 6, 3, 1, 0.0),
    (1, 3, 6, 2, 2, 0.5),
])
def test_land_at_turn_matches_a_float64_transcription_of_torchfts_schedule(
    layers, workers, every, fragments, overlap, alpha):
  """``land_at_turn=True`` against :func:`reference_torchft` over three rounds on 2 to 4
  workers with different gradients: every worker's parameters and the synchronised ones (no
  fragment in flight at the end), to float32's rounding. The default schedule, a landing
  ``tau`` steps later, differs from it (and is what :func:`reference_streaming_diloco`
  checks)."""
  params = _params(layers)
  steps = 3 * every
  dp = _streaming(params, workers, every=every, fragments=fragments, overlap=overlap,
                  alpha=alpha, land_at_turn=True)
  got, state = dp.worker_params(params), dp.init(params)
  for t in range(steps):
    got, state, _ = dp.step(got, state, _batch(workers), kind=dp.kind_at(t))
  x, y = (np.asarray(a, np.float64).reshape(workers, ROWS, -1) for a in _batch(workers))
  expected, original = reference_torchft(params, x, y, steps, every=every,
                                         fragments=fragments, overlap=overlap, alpha=alpha)
  for k in params:
    rows = np.asarray(got[k])
    for i in range(workers):
      np.testing.assert_allclose(rows[i], expected[i][k], rtol=2e-5, atol=2e-6,
                                 err_msg=f"worker {i}, {k}")
    np.testing.assert_allclose(compressors.synchronised_params(state)[k], original[k],
                               rtol=2e-5, atol=2e-6, err_msg=f"synchronised, {k}")
  default, _ = reference_streaming_diloco(params, x, y, steps, every=every, fragments=fragments,
                                          overlap=overlap, alpha=alpha)
  assert not np.allclose(default[0]["w0"], expected[0]["w0"], rtol=1e-3), "the two coincide"


def test_land_at_turn_sends_tau_steps_before_the_turn_and_lands_at_it_for_the_same_bytes():
  """H = 8, 2 fragments, tau = 1: the turns of fragment 0 at steps 7, 15 and of fragment 1 at
  3, 11 (as by default); each sent a step before. A fragment whose turn comes within tau steps
  of the start sends first a round later. The cost model's bytes are the default's."""
  at = lambda kinds, t: max((k for k in kinds if k.runs_at(t)), key=lambda k: k.every).name
  kinds = compressors.streaming_kinds(8, 2, 1, land_at_turn=True)
  assert [at(kinds, t) for t in range(16)] == [
      "local", "local", "sync1", "apply1", "local", "local", "sync0", "apply0",
      "local", "local", "sync1", "apply1", "local", "local", "sync0", "apply0"]
  # Fragment 1's first turn is step 0: it sends first at step 3 and lands first at step 4.
  kinds = compressors.streaming_kinds(4, 4, 1, land_at_turn=True)
  assert [at(kinds, t) for t in range(6)] == ["sync2", "sync3+apply2", "sync0+apply3",
                                              "sync1+apply0", "sync2+apply1", "sync3+apply2"]
  assert compressors.streaming_kinds(4, 2, 0, land_at_turn=True) == (
      compressors.streaming_kinds(4, 2, 0))
  shapes = [(64, 32), (32,)]
  assert equal_bytes.method_bytes(
      "streaming_diloco", shapes, 8,
      registry.default_settings("streaming_diloco", land_at_turn=True)) == (
          equal_bytes.method_bytes("streaming_diloco", shapes, 8,
                                   registry.default_settings("streaming_diloco")))


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_landed_fragment_is_bit_identical_on_every_worker_with_alpha_0(overlap):
  """With ``alpha = 0`` each worker's fragment lands on the anchor bit for bit (as DiLoCo's
  whole model does), at its synchronisation (``tau = 0``) or ``tau`` steps later; the other
  fragments stay each worker's own."""
  params, workers, every, fragments = _params(2), 4, 4, 4
  dp = _streaming(params, workers, every=every, fragments=fragments, overlap=overlap, alpha=0.0)
  got, state = dp.worker_params(params), dp.init(params)
  rows = _fragment_rows(params, fragments)  # the weights are cut: rows of a leaf part ways
  assert all(not on.all() and on.any() for on in (rows[0]["w0"], rows[2]["w0"]))
  landed_any = set()
  for t in range(3 * every):
    kind = dp.kind_at(t)
    got, state, _ = dp.step(got, state, _batch(workers), kind=kind)
    options = dp.kinds[kind].update_kwargs()
    landed = options.get("apply")
    anchor = compressors.synchronised_params(state)
    for k in params:
      each = np.asarray(got[k])
      on = rows[landed][k] if landed is not None else np.zeros(len(each[0]), bool)
      if on.any():
        assert all(w[on].tobytes() == np.asarray(anchor[k])[on].tobytes() for w in each), (t, k)
        landed_any.add(landed)
      if (~on).any():  # the first step moves every worker its own way
        assert not all(w[~on].tobytes() == each[0][~on].tobytes() for w in each), (t, k)
  assert landed_any == set(range(fragments))


def test_the_step_kinds_stagger_the_fragments_and_land_them_late():
  """H = 8, 2 fragments, tau = 1: fragment 0 at steps 7, 15, ... (as DiLoCo), fragment 1 at
  3, 11, ...; each lands a step later (fragment 0's first landing at 8, not at 0)."""
  kinds = compressors.streaming_kinds(8, 2, 1)
  dp_kinds = {k.name: k for k in kinds}
  at = lambda t: max((k for k in kinds if k.runs_at(t)), key=lambda k: k.every).name
  assert [at(t) for t in range(17)] == [
      "local", "local", "local", "sync1", "apply1", "local", "local", "sync0",
      "apply0", "local", "local", "sync1", "apply1", "local", "local", "sync0", "apply0"]
  assert dp_kinds["sync0"].update_kwargs() == {"sync": 0}
  assert dp_kinds["apply1"].update_kwargs() == {"apply": 1}
  # A landing on another fragment's synchronisation: one program for both, after the
  # synchronisation ran alone until the landing's first.
  kinds = compressors.streaming_kinds(4, 4, 1)
  at = lambda t: max((k for k in kinds if k.runs_at(t)), key=lambda k: k.every).name
  assert [at(t) for t in range(9)] == ["sync1", "sync2+apply1", "sync3+apply2", "sync0+apply3",
                                       "sync1+apply0", "sync2+apply1", "sync3+apply2",
                                       "sync0+apply3", "sync1+apply0"]
  # tau = 0: the synchronisation lands at once (DiLoCo on the fragment); H = 1: every step.
  assert [(k.name, k.phase, k.update_kwargs()) for k in compressors.streaming_kinds(4, 2, 0)] == [
      ("local", 0, {}), ("sync1", 1, {"sync": 1, "apply": 1}),
      ("sync0", 3, {"sync": 0, "apply": 0})]
  assert [k.name for k in compressors.streaming_kinds(1, 1, 0)] == ["sync0"]


def test_tasc_exchanges_each_fragment_with_its_curvature_cut_to_the_fragment():
  """TASC as the carrier: each synchronisation makes the curvature (of the whole model, on each
  worker) and the exchange takes the fragment's part of it; the two fragments (of equal size)
  move equal bytes, local steps none, and training moves the loss down."""
  import tasc  # pylint: disable=import-outside-toplevel,unused-import  # registers "tasc"
  settings = registry.default_settings("streaming_diloco", every=4, fragments=2, carrier="tasc")
  tasc_settings = registry.default_settings("tasc", hessian_every=4, block_size=16,
                                            density=0.25, num_probes=1)
  kinds = registry.step_kinds("streaming_diloco", settings, exchange_settings=tasc_settings)
  assert [(k.name, k.inputs is not None) for k in kinds] == [
      ("local", False), ("apply0", False), ("sync1", True), ("apply1", False), ("sync0", True)]
  tx = registry.training("streaming_diloco", settings, optimizer=optax.adam(0.01),
                         learning_rate=0.01, axis_name="data", exchange_settings=tasc_settings)
  params, workers, dim = _params(2, dim=16), 4, 16
  dp = compressors.data_parallel(_loss, tx, harness.mesh(workers), params,
                                 _batch(workers, dim=dim), kinds=kinds, per_worker_params=True)
  got, state = dp.worker_params(params), dp.init(params)
  losses = []
  for t in range(9):
    got, state, metrics = dp.step(got, state, _batch(workers, dim=dim), kind=dp.kind_at(t))
    losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  sent = {k: _wire(dp, params, workers, k, dim) for k in ("sync0", "sync1", "local")}
  assert sent["local"] == 0 and sent["sync0"] == sent["sync1"] > 0


def _wire(dp, params, workers, kind, dim):
  state = jax.eval_shape(dp.init, params)
  return dp.wire_bytes(dp.worker_params(params), state, _batch(workers, dim=dim),
                       kind=kind).total - dp.nonfinite_flag_bytes()


@pytest.mark.parametrize("exchange", [
    "dense",
    # topk and the narrower fixed-bytes exchanges: variants, in the slow suite.
    *(pytest.param(e, marks=pytest.mark.slow) for e in ("topk", "bf16", "int8", "int4"))])
def test_no_step_moves_more_than_a_third_of_dilocos_synchronisation(exchange):
  """4 fragments of equal size (layer ``p``'s weights and bias in fragment ``p``, as
  ``test_the_fragments_are_of_about_equal_size_and_strided_over_the_depth`` checks): each kind's
  bytes, read from its compiled program, are at most 0.3x DiLoCo's whole synchronisation (a
  quarter, up to rounding), local steps move nothing, and a round moves what DiLoCo's
  synchronisation does."""
  params, workers, every, dim = _params(4, dim=64), 8, 8, 64
  dp = _streaming(params, workers, every=every, fragments=4, overlap=1, alpha=0.5,
                  carrier=exchange, dim=dim)
  diloco_settings = registry.default_settings("diloco", every=every, carrier=exchange)
  diloco = compressors.data_parallel(
      _loss, registry.training("diloco", diloco_settings, optimizer=optax.sgd(INNER_LR),
                               learning_rate=INNER_LR, axis_name="data"),
      harness.mesh(workers), params, _batch(workers, dim=dim),
      kinds=registry.step_kinds("diloco", diloco_settings), per_worker_params=True)
  whole = _wire(diloco, params, workers, "sync", dim)
  by_kind = {k: _wire(dp, params, workers, k, dim) for k in dp.kinds}
  print(f"{exchange}: DiLoCo's synchronisation {whole:,.0f} bytes; by kind {by_kind}")
  assert by_kind.pop("local") == 0
  assert whole > 0 and max(by_kind.values()) <= 0.3 * whole, (by_kind, whole)
  for k, sent in by_kind.items():
    if k.startswith("sync"):
      assert sent == pytest.approx(whole / 4, rel=0.05), (k, sent, whole)
    else:
      assert sent == 0, k  # a late landing moves nothing: the anchor is every worker's
  counts = dp.kind_counts(2 * every, 3 * every)
  assert sum(n * by_kind.get(k, 0) for k, n in counts.items()) == pytest.approx(whole, rel=0.05)


def test_equal_bytes_prices_a_round_as_dilocos_synchronisation():
  """Each fragment sends once every H steps: the bytes per step are DiLoCo's at the same H, and
  a tier met through H keeps H >= fragments (one it cannot meet so is said to be out of
  reach)."""
  shapes = [(256, 256), (256,), (256, 256), (256,)]
  for exchange in ("dense", "int8"):
    streaming = registry.default_settings("streaming_diloco", every=50, carrier=exchange)
    diloco = registry.default_settings("diloco", every=50, carrier=exchange)
    assert equal_bytes.method_bytes("streaming_diloco", shapes, 8, streaming) == (
        equal_bytes.method_bytes("diloco", shapes, 8, diloco))
  solved = equal_bytes.solve("streaming_diloco", shapes, 8, "100x")
  assert solved.feasible and solved.settings.every == 100
  assert solved.settings == registry.default_settings("streaming_diloco", every=100)
  low = equal_bytes.solve("streaming_diloco", shapes, 8, 2.0)
  assert not low.feasible and "every=2" in low.note and "every >= fragments" in low.note


@pytest.mark.parametrize("fields, error, message", [
    (dict(fragments=0), ValueError, r"streaming diloco: fragments=0 is below 1; it must be an "
                                    r"int >= 1"),
    (dict(fragments=2.0), TypeError, r"streaming diloco: fragments must be an int >= 1, got 2.0"),
    (dict(overlap=-1), ValueError, r"streaming diloco: overlap=-1 is below 0"),
    (dict(alpha=1.5), ValueError, r"streaming diloco: alpha=1.5 is outside \[0, 1\]"),
    (dict(every=3, fragments=4), ValueError, r"every=3 with fragments=4; allowed: every >= "
                                             r"fragments"),
    (dict(every=4, fragments=2, overlap=4), ValueError, r"overlap=4 with every=4; allowed: 0 <= "
                                                        r"overlap < every"),
    (dict(land_at_turn="yes"), TypeError, r"streaming diloco: land_at_turn must be True or "
                                          r"False, got 'yes'"),
])
def test_bad_settings_are_refused_naming_the_field_the_value_and_what_is_allowed(
    fields, error, message):
  with pytest.raises(error, match=message):
    registry.default_settings("streaming_diloco", **fields)


def test_the_fragments_are_of_about_equal_size_and_strided_over_the_depth():
  """Every entry in one fragment; equal layers dealt round robin; a leaf larger than a share cut
  along its first axis, so that on the CPU tier's language model (its embedding alone is over
  half of it: 4 fragments of whole leaves would put 0.56 or more of it in one) no fragment of 4
  holds more than 0.3 of the entries."""
  from configs.paper import lm  # pylint: disable=import-outside-toplevel
  from experiments import methods  # pylint: disable=import-outside-toplevel
  layers = [(64, 64), (64,)] * 4
  layout = compressors.fragment_layout(layers, 4)
  assert layout == tuple((compressors.FragmentPiece(2 * p, 0, 64),
                          compressors.FragmentPiece(2 * p + 1, 0, 64)) for p in range(4))
  shapes = methods.parameter_shapes(lm.get_config("method=dense,tier=cpu"))
  sizes = [int(np.prod(s)) for s in shapes]
  assert max(sizes) > 0.5 * sum(sizes)
  layout = compressors.fragment_layout(shapes, 4)
  covered = [np.zeros(s[:1] or (1,), int) for s in shapes]
  for pieces in layout:
    assert list(pieces) == sorted(pieces)
    for piece in pieces:
      covered[piece.leaf][piece.start:piece.stop] += 1
  assert all((c == 1).all() for c in covered)
  held = [sum(sizes[x.leaf] // max(1, (shapes[x.leaf] or (1,))[0]) * (x.stop - x.start)
              for x in pieces) for pieces in layout]
  assert sum(held) == sum(sizes) and max(held) <= 0.3 * sum(sizes), held
  assert compressors.fragment_layout([(1, 9), ()], 3)[2] == ()  # too few pieces for 3


def test_a_model_too_small_for_its_fragments_and_traced_options_are_refused():
  tx = compressors.streaming_local_updates(
      optax.sgd(0.1), compressors.compress(compressors.dense(), axis_name=None), fragments=3)
  with pytest.raises(ValueError, match=r"fragments=3 but the parameters' 2 leaves \(10 entries\) "
                                       r"cut into 2 pieces; allowed: fragments <= the pieces"):
    tx.init({"w": jnp.zeros((1, 9)), "b": jnp.zeros(())})
  params = _params(2)
  with pytest.raises(TypeError, match=r"sync=.* must be None or a Python int in \[0, 2\]"):
    jax.jit(lambda p: tx.update(p, tx.init(p), p, sync=jnp.int32(0)))(params)
  with pytest.raises(TypeError, match=r"apply=3 must be None or a Python int in \[0, 2\]"):
    tx.update(params, tx.init(params), params, apply=3)
  with pytest.raises(ValueError, match="alpha=-0.1"):
    compressors.streaming_local_updates(optax.sgd(0.1), optax.identity(), alpha=-0.1)


def test_a_runs_bad_settings_are_refused_before_it_starts():
  from configs import quickstart  # pylint: disable=import-outside-toplevel
  from experiments import validation  # pylint: disable=import-outside-toplevel
  config = quickstart.get_config("smoke")
  config.update_from_flattened_dict({"method": "streaming_diloco",
                                     "compression.streaming_diloco.every": 2})
  with pytest.raises(ValueError, match="every=2 with fragments=4"):
    validation.check_config(config, 8)


def _quickstart(**fields):
  from configs import quickstart  # pylint: disable=import-outside-toplevel
  config = quickstart.get_config("smoke")
  config.update_from_flattened_dict({"method": "streaming_diloco", "num_steps": 6,
                                     "compression.streaming_diloco.every": 4,
                                     "compression.streaming_diloco.fragments": 2, **fields})
  return config


@pytest.mark.slow  # a variant: tests/test_local_updates.py resumes a local-update run mid-round
def test_the_runner_trains_it_and_resumes_between_synchronisations_bit_for_bit(tmp_path):
  """The quickstart's smoke model, 6 steps, H = 4 over 2 fragments, tau = 1: fragment 1
  synchronises at 1 and lands at 2, fragment 0 at 3 and 4; the run is charged each kind's own
  bytes; a restart from the checkpoint after step 5 (the workers' own parameters) ends bit for
  bit as the uninterrupted run."""
  finished = str(tmp_path / "finished")
  results = train.train_and_evaluate(_quickstart(), finished)
  assert np.isfinite(results["test_loss"]) and not results["diverged"]
  ran = results["bytes_by_kind"]
  assert set(ran) == {"local", "sync1", "apply1", "sync0", "apply0"}
  assert ran["local"] == ran["apply0"] == ran["apply1"] == 0 and ran["sync0"] > 0
  assert results["wire_bytes"] == pytest.approx((ran["sync0"] + 2 * ran["sync1"]) / 6,
                                               rel=0.01)  # sync1 at steps 1 and 5
  assert_resumes_bit_for_bit(_quickstart, finished, str(tmp_path / "resumed"), 5, 6, results)


def _flip_worker_rows(state, worker: int):
  """``state`` with one bit flipped in worker ``worker``'s copy of every parameter leaf's first
  entry (each fragment holds some leaf's first row, so every fragment drifts)."""
  from tests import test_failures  # pylint: disable=import-outside-toplevel
  flip = test_failures._flip_one_bit  # pylint: disable=protected-access
  return state._replace(params=jax.tree.map(lambda x: flip(x, worker), state.params))


def _flip_worker_anchor(state, worker: int):
  """``state`` with one bit flipped in worker ``worker``'s copy of the synchronised parameters
  (every leaf's first entry)."""
  from tests import test_failures  # pylint: disable=import-outside-toplevel
  flip = test_failures._flip_one_bit  # pylint: disable=protected-access
  is_streaming = lambda x: isinstance(x, compressors.StreamingState)
  flipped = lambda s: s._replace(anchor=jax.tree.map(lambda x: flip(x, worker), s.anchor))
  return state._replace(opt_state=jax.tree.map(
      lambda s: flipped(s) if is_streaming(s) else s, state.opt_state, is_leaf=is_streaming))


def test_the_runners_replica_check_finds_a_landed_fragment_that_drifted(tmp_path, monkeypatch):
  """With ``alpha = 0`` a landed fragment must be bit-identical on every worker: the runner
  checks each fragment after it lands (the other fragments differ between workers by design).
  A bit flipped on worker 5 in every leaf at fragment 1's landing (step 2) stops the run there,
  naming fragment 1's leaves alone."""
  from tests import test_failures  # pylint: disable=import-outside-toplevel
  after = lambda state: _flip_worker_rows(state, 5) if int(state.step) == 3 else state
  test_failures._wrap_train_steps(monkeypatch, after)  # pylint: disable=protected-access
  config = _quickstart(**{"compression.streaming_diloco.alpha": 0.0, "check_replicas_every": 1})
  with pytest.raises(train.ReplicaDriftError,
                     match=r"replica drift detected at step 3: .* on devices \['5 row 0'\]"
                     ) as found:
    train.train_and_evaluate(config, str(tmp_path / "drift"))
  # Fragment 0 (the first conv's kernel among its pieces) had not landed: not compared.
  assert "['Conv_0']['kernel']" not in str(found.value)


@pytest.mark.slow
def test_with_mixed_landings_the_replica_check_compares_the_synchronised_parameters(
    tmp_path, monkeypatch):
  """With ``alpha = 0.5`` a landing mixes in each worker's own fragment, so the workers'
  parameters differ after it by design; what must agree is every worker's copy of the
  synchronised parameters, which the check compares after each landing: one bit flipped in
  worker 5's copy stops the run at the next landing (fragment 1's, step 2)."""
  from tests import test_failures  # pylint: disable=import-outside-toplevel
  after = lambda state: _flip_worker_anchor(state, 5) if int(state.step) == 2 else state
  test_failures._wrap_train_steps(monkeypatch, after)  # pylint: disable=protected-access
  config = _quickstart(**{"check_replicas_every": 1})
  assert config.compression.streaming_diloco.alpha == 0.5
  with pytest.raises(train.ReplicaDriftError,
                     match=r"replica drift detected at step 3: .* on devices \['5 row 0'\]"):
    train.train_and_evaluate(config, str(tmp_path / "drift"))
