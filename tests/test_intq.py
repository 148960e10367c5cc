"""int8 / int4 transport (compressors/_intq.py) against numpy references, and its bytes.

Quantisation is replayed in float32 numpy exactly as the module writes it (bucket scales, codes,
decoded values: bit for bit); the two-phase exchange is replayed exactly in float32 (the
protocol's order of sums) and, as arithmetic, in float64; the bytes are read from the compiled
update on the shared 40,200-entry model (tests/method_checks.py) and stated exactly.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compressors
from compressors import _intq as intq
from compressors import _packing as packing
from compressors import registry
from tests import harness
from tests import method_checks
from tests.test_quantized import encode_decode

N = 8
# Fused: 4,237 entries, so each of the 8 chunks has 530 (the last padded by 3): four full
# buckets of 128 and one of 18.
PARAMS = {"w": jnp.zeros((60, 70)), "b": jnp.zeros((37,))}


def quantize_reference(x, bits, bucket, uniforms=None, dtype=np.float32):
  """``(codes [d], decoded [d], scales)`` of one buffer, in numpy, as the module docstring writes
  them: ``scale = max |v|`` per bucket, ``code = clip(round(v * (L / scale)), -L, L)`` (ties to
  even; ``floor(r + u)`` given ``uniforms``, shaped like the padded buckets), decoded as
  ``code * (scale * (1 / L))``."""
  x = np.asarray(x, dtype)
  top = 2 ** (bits - 1) - 1
  d = x.size
  length = min(bucket, d)
  count = -(-d // length)
  v = np.pad(x, (0, count * length - d)).reshape(count, length)
  scales = np.abs(v).max(axis=1)
  ratio = v * (dtype(top) / np.where(scales > 0, scales, dtype(1)))[:, None]
  rounded = np.round(ratio) if uniforms is None else np.floor(ratio + uniforms)
  codes = np.clip(rounded, -top, top)
  decoded = codes * (scales * dtype(1 / top))[:, None]
  return codes.reshape(-1)[:d].astype(np.int64), decoded.reshape(-1)[:d], scales


def pack_nibbles_reference(codes):
  """Codes in ``[-7, 7]`` offset by 7, two to a byte, the first in the low nibble."""
  offset = np.pad(np.asarray(codes) + 7, (0, len(codes) % 2)).astype(np.uint8)
  return offset[0::2] | (offset[1::2] << 4)


def _gaussian_with_outliers(key, d):
  """Normal entries, a few 50x outliers, and one bucket of zeros: every branch of the coder."""
  x = np.array(jax.random.normal(key, (d,)), np.float32)
  x[::97] *= 50
  x[128:256] = 0
  return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("d,bucket", [(1000, 128), (1000, 100), (50, 128), (999, 1)])
def test_codes_scales_and_decoded_values_match_numpy_exactly(bits, d, bucket):
  x = _gaussian_with_outliers(jax.random.PRNGKey(d + bucket), d)
  payload, decoded = encode_decode(compressors.quantize(bits, bucket=bucket), jnp.asarray(x),
                                   jax.random.PRNGKey(0))
  codes, expected, scales = quantize_reference(x, bits, bucket)
  np.testing.assert_array_equal(np.asarray(payload.scales), scales)
  assert np.abs(codes).max() == 2 ** (bits - 1) - 1  # the largest magnitude uses the top code
  if bits == 8:
    assert payload.codes.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(payload.codes, np.int64), codes)
  else:
    assert payload.codes.dtype == jnp.uint8 and payload.codes.shape == (-(-d // 2),)
    np.testing.assert_array_equal(np.asarray(payload.codes), pack_nibbles_reference(codes))
  np.testing.assert_array_equal(np.asarray(decoded), expected)
  assert not np.isnan(np.asarray(decoded)).any()
  # Rounding to nearest: each entry within half a step of its bucket's scale / L.
  step = np.repeat(scales / (2 ** (bits - 1) - 1), min(bucket, d))[:d]
  assert np.all(np.abs(np.asarray(decoded) - x) <= step / 2 + 1e-6 * np.abs(x))


def test_int4_codes_pack_two_a_byte_and_round_trip():
  """Every code from -7 to 7 in both nibbles, and an odd count (the last byte half empty)."""
  codes = np.array([c for c in range(-7, 8) for _ in range(2)] + list(range(-7, 8)))
  x = codes.astype(np.float32) / 7  # scale 1: the codes are x * 7 exactly
  payload, decoded = encode_decode(compressors.quantize(4, bucket=len(x)), jnp.asarray(x),
                                   jax.random.PRNGKey(0))
  assert payload.codes.shape == (math.ceil(len(codes) / 2),)
  np.testing.assert_array_equal(np.asarray(payload.codes), pack_nibbles_reference(codes))
  unpacked = packing.unpack(payload.codes, 4, len(codes))
  np.testing.assert_array_equal(np.asarray(unpacked, np.int64) - 7, codes)
  np.testing.assert_array_equal(np.asarray(decoded), codes.astype(np.float32) * np.float32(1 / 7))


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_matches_numpy_given_the_uniforms_and_is_unbiased(bits):
  d, bucket, key = 1000, 128, jax.random.PRNGKey(3)
  x = _gaussian_with_outliers(jax.random.PRNGKey(1), d)
  compressor = compressors.quantize(bits, bucket=bucket, rounding="stochastic")
  _, decoded = encode_decode(compressor, jnp.asarray(x), key)
  count = -(-d // bucket)
  uniforms = np.asarray(jax.random.uniform(key, (count, bucket), jnp.float32))
  np.testing.assert_array_equal(np.asarray(decoded),
                                quantize_reference(x, bits, bucket, uniforms)[1])
  # Unbiased: the mean of 400 draws is within 5 standard errors of x (a draw's error is at most
  # one step, so its standard deviation is at most half a step).
  draws = jax.vmap(lambda k: encode_decode(compressor, jnp.asarray(x), k)[1])(
      jax.random.split(jax.random.PRNGKey(4), 400))
  scales = quantize_reference(x, bits, bucket)[2]
  step = np.repeat(scales / (2 ** (bits - 1) - 1), bucket)[:d]
  assert np.all(np.abs(np.asarray(draws).mean(0) - x) <= 5 * step / 2 / np.sqrt(400) + 1e-7)


def test_a_non_finite_entry_poisons_its_bucket_only():
  x = np.linspace(-1, 1, 256, dtype=np.float32)
  x[3] = np.nan
  _, decoded = encode_decode(compressors.quantize(8), jnp.asarray(x), jax.random.PRNGKey(0))
  decoded = np.asarray(decoded)
  assert np.isnan(decoded[:128]).all() and np.isfinite(decoded[128:]).all()


def _run_steps(compressor, steps, params=PARAMS):
  """``[(inputs [n, d], mean [d], residual [n, d], owner memory before, after)]`` of ``steps``
  exchanges with error feedback under shard_map (owners' memories ``[n, chunk]``, None in the
  all-gather exchange), every replica's mean checked bit-identical."""
  tx = compressors.compress(compressor, axis_name="data")
  state, update = harness.shard_map_update(tx, harness.mesh(), params)
  owner = lambda: (np.asarray(state.buffers.owner_residual, np.float64)
                   if compressor.exchange == "two_phase" else None)
  out = []
  for t in range(steps):
    grads = harness.per_worker_grads(jax.random.PRNGKey(10 + t), N, params)
    inputs, before = harness.fused(grads, N) + harness.fused(state.residual, N), owner()
    mean, state = update(params, state, grads)
    harness.assert_replicas_identical(mean)
    out.append((inputs, harness.fused(mean, 1)[0], harness.fused(state.residual, N), before,
                owner()))
  return out


def _sent_reference(inputs, residual, bits):
  """``(decoded [n, n, chunk], scales [n, n, buckets])``: what each worker sent of each chunk,
  by the float32 reference, checked against the worker's residual ``x - sent`` to an ulp of
  ``x`` (XLA may fuse the subtraction with the decoding product into one rounding, an FMA)."""
  n, d = inputs.shape
  chunk = -(-d // n)
  chunks = np.pad(inputs, ((0, 0), (0, n * chunk - d))).reshape(n, n, chunk)
  coded = [[quantize_reference(c, bits, intq.DEFAULT_BUCKET) for c in row] for row in chunks]
  decoded = np.array([[decoded for _, decoded, _ in row] for row in coded], np.float64)
  np.testing.assert_allclose(residual, inputs - decoded.reshape(n, -1)[:, :d], rtol=0,
                             atol=np.finfo(np.float32).eps * np.abs(inputs).max())
  return decoded, np.array([[scales for _, _, scales in row] for row in coded])


def _assert_equal_but_rare_flips(actual, expected, step, what):
  """``actual`` is ``expected`` to float32's rounding, except that an entry whose ratio lies
  within float32's rounding of a half-integer may round the other way: one step, rarely."""
  error = np.abs(actual - expected)
  assert np.all(error <= step * (1 + 1e-3)), f"{what}: off by more than one step"
  flips = error > 1e-3 * step
  assert flips.mean() < 1e-3, f"{what}: {flips.sum()} of {flips.size} entries differ"


@pytest.mark.parametrize("bits", [8, 4])
def test_two_phase_matches_the_protocol_replayed_in_float64(bits):
  """Three steps with worker and owner error feedback, each replayed in float64 from the
  implementation's state: the owner of chunk j decodes chunk j of every worker, takes their mean,
  adds its memory, re-quantizes (its memory keeps what that loses) and every worker gets the
  result. The mean is also within the two roundings' bound of the exact mean of the inputs."""
  top = 2 ** (bits - 1) - 1
  for inputs, mean, residual, owner, new_owner in _run_steps(compressors.quantize(bits), 3):
    n, d = inputs.shape
    sent, worker_scales = _sent_reference(inputs, residual, bits)
    owner_input = sent.mean(axis=0) + owner
    shared = [quantize_reference(c, bits, intq.DEFAULT_BUCKET, dtype=np.float64)
              for c in owner_input]
    expected = np.stack([decoded for _, decoded, _ in shared])
    step = np.stack([np.repeat(scales / top, intq.DEFAULT_BUCKET)[:owner.shape[1]]
                     for _, _, scales in shared])
    _assert_equal_but_rare_flips(mean, expected.reshape(-1)[:d], step.reshape(-1)[:d], "mean")
    _assert_equal_but_rare_flips(new_owner, owner_input - expected, step, "owner memory")
    worker_step = np.repeat(worker_scales.mean(axis=0) / top, intq.DEFAULT_BUCKET, axis=1)
    bound = (worker_step[:, :owner.shape[1]] + step) / 2 + np.abs(owner)
    assert np.all(np.abs(mean - inputs.mean(axis=0)) <= bound.reshape(-1)[:d]
                  + 1e-6 * np.abs(inputs).max())


@pytest.mark.parametrize("bits", [8, 4])
def test_all_gather_mean_is_the_mean_of_what_the_workers_sent(bits):
  compressor = compressors.quantize(bits, exchange="all_gather")
  for inputs, mean, residual, _, _ in _run_steps(compressor, 2):
    sent = np.stack([quantize_reference(x, bits, intq.DEFAULT_BUCKET)[1] for x in inputs])
    np.testing.assert_allclose(residual, inputs - sent, rtol=0,
                               atol=np.finfo(np.float32).eps * np.abs(inputs).max())
    # A sum of N terms rounds N - 1 times.
    np.testing.assert_allclose(mean, sent.astype(np.float64).mean(axis=0), rtol=0,
                               atol=N * np.finfo(np.float32).eps * np.abs(sent).max())


# Bytes one device sends per step on the shared model (200 x 200 + 200 = 40,200 entries, 8
# workers): the two-phase chunk is ceil(40,200 / 8) = 5,025 entries in ceil(5,025 / 128) = 40
# buckets (39 of 128, one of 33), and each phase sends 7 of the 8 chunks:
#   int8: 2 * 7 * (5,025 + 4 * 40) = 72,590;  int4: 2 * 7 * (2,513 + 4 * 40) = 37,422;
#   f32 dense all-reduce (and f32 chunks two-phase): 2 * 7/8 * 4 * 40,200 = 281,400.
EXPECTED_BYTES = {"int8": 72_590, "int4": 37_422, "dense": 281_400}


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_bytes_are_a_quarter_and_an_eighth_of_float32_plus_the_scales(name):
  bits = int(name[3:])
  sent = {m: harness.update_bytes(method_checks.transformation(m), method_checks.PARAMS,
                                  harness.mesh()).total for m in (name, "dense")}
  assert sent == {m: EXPECTED_BYTES[m] for m in (name, "dense")}
  chunk = -(-40_200 // N)
  assert sent[name] == 2 * (N - 1) * (math.ceil(chunk * bits / 8) + 4 * math.ceil(chunk / 128))
  # The codes are bits/32 of float32's bytes (int4's odd chunk adds half a byte); the rest is
  # the 40 float32 scales of each chunk.
  codes = sent["dense"] * bits / 32 + (2 * (N - 1) / 2 if bits == 4 else 0)
  assert sent[name] == codes + 2 * (N - 1) * 4 * 40


def test_all_gather_bytes_match_the_cost_model():
  """(n - 1) whole payloads: 7 * (40,200 + 4 * 315) = 290,220 bytes for int8."""
  settings = intq.QuantizeSettings(exchange="all_gather")
  sent = harness.update_bytes(method_checks.transformation("int8", settings),
                              method_checks.PARAMS, harness.mesh()).total
  topology = compressors.Topology.flat(N, compressors.Link(alpha=1e-6, bandwidth=1e9))
  modelled = registry.cost("int8", [(200, 200), (200,)], topology, settings).bytes_sent
  assert sent == modelled == 7 * (40_200 + 4 * 315)


@pytest.mark.parametrize("make,error,match", [
    (lambda: compressors.quantize(16), ValueError,
     r"quantize: bits=16 is unknown; allowed: \(8, 4\)"),
    (lambda: compressors.quantize(8, bucket=0), ValueError,
     r"quantize: bucket=0 is below 1; it must be an int >= 1"),
    (lambda: compressors.quantize(4, bucket=2.5), TypeError,
     r"quantize: bucket must be an int >= 1, got 2.5"),
    (lambda: compressors.quantize(8, rounding="up"), ValueError,
     r"quantize: rounding='up' is unknown; allowed: \('nearest', 'stochastic'\)"),
    (lambda: compressors.quantize(8, exchange="psum"), ValueError,
     r"quantize: exchange='psum'; allowed: None \(two-phase\), 'two_phase', 'all_gather'"),
    (lambda: intq.QuantizeSettings(bucket=-1), ValueError,
     r"QuantizeSettings: bucket=-1 is below 1"),
    (lambda: registry.default_settings("int4", rounding="floor"), ValueError,
     r"QuantizeSettings: rounding='floor' is unknown"),
    (lambda: registry.default_settings("int8", exchange="ring"), ValueError,
     r"QuantizeSettings: exchange='ring'; allowed"),
])
def test_bad_settings_are_refused_with_clear_messages(make, error, match):
  with pytest.raises(error, match=match):
    make()
