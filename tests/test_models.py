"""Models: parameter counts against the published architectures, and errors.

Every model also trains end to end in tests/test_runner.py (the configs' smoke variants).
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import lm_stdlib
from experiments import models
from experiments import tasks
from experiments.models import fields as fields_lib
from experiments.models import layers


def _param_count(model, *inputs):
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *inputs))
  return sum(x.size for x in jax.tree.leaves(variables["params"]))


CIFAR = jnp.zeros((2, 32, 32, 3))


@pytest.mark.parametrize("fields, expected", [
    # He et al. 2016 (option-A shortcuts): ResNet-20 0.27M, ResNet-56 0.85M (exact counts as in
    # the reference PyTorch re-implementations).
    (dict(name="cifar_resnet", depth=20), 269_722),
    (dict(name="cifar_resnet", depth=56), 853_018),
    # Zagoruyko & Komodakis 2016, Table 1: WRN-28-10 36.5M, WRN-16-8 11.0M.
    (dict(name="wide_resnet", depth=28, widen_factor=10), 36_479_194),
    (dict(name="wide_resnet", depth=16, widen_factor=8), 10_961_370),
    # VGG with batch norm and one linear classifier (the common CIFAR variant).
    (dict(name="vgg", depth=16), 14_728_266),
    (dict(name="vgg", depth=19), 20_040_522),
])
def test_cifar_models_match_published_parameter_counts(fields, expected):
  assert _param_count(models.build_model(fields, num_classes=10), CIFAR) == expected


def test_resnet50_matches_torchvision_parameter_count():
  model = models.build_model(dict(name="imagenet_resnet", depth=50), num_classes=1000)
  assert _param_count(model, jnp.zeros((1, 224, 224, 3))) == 25_557_032


def test_bert_base_encoder_matches_the_released_model():
  model = models.build_model(dict(name="bert"), vocab_size=30522)
  ids = jnp.zeros((1, 128), jnp.int32)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids, ids, ids[:, :20]))
  encoder = sum(x.size for x in jax.tree.leaves(variables["params"]["encoder"]))
  # BERT-base's 109,482,240 parameters include the 768 x 768 + 768 pooler, unused by MLM.
  assert encoder == 109_482_240 - (768 * 768 + 768)


# V h token and L h position embeddings, per layer 12 h^2 + 13 h (attention 4 h^2 + 4 h, MLP
# 8 h^2 + 5 h, two layer norms 4 h), and the final layer norm's 2 h.
@pytest.mark.parametrize("tier, expected", [
    ("tiny", 2048 * 128 + 128 * 128 + 4 * (12 * 128**2 + 13 * 128) + 2 * 128),  # 1,071,872
    ("base", 8192 * 512 + 256 * 512 + 8 * (12 * 512**2 + 13 * 512) + 2 * 512)])  # 29,545,472
def test_decoder_lm_tiers_have_about_1m_and_over_25m_parameters(tier, expected):
  settings = lm_stdlib.MODEL_SIZES[tier]
  model = models.build_model(dict(name="decoder_lm", **settings["model"]),
                             vocab_size=settings["vocab_size"])
  assert _param_count(model, jnp.zeros((1, settings["seq_len"]), jnp.int32)) == expected


def _decoder(vocab=50, **fields):
  model = models.build_model(dict(name="decoder_lm", hidden=32, num_layers=2, num_heads=4,
                                  max_length=16, **fields), vocab_size=vocab)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, vocab)
  return model, model.init(jax.random.PRNGKey(0), tokens), tokens


def test_decoder_lm_gives_next_token_logits_at_every_position_and_ties_its_embeddings():
  model, variables, tokens = _decoder()
  logits = model.apply(variables, tokens)
  assert logits.shape == (3, 12, 50) and logits.dtype == jnp.float32
  # Tied: the only [vocab, hidden] matrix is the token embedding (the parameter count of the
  # tiers above has no output projection either).
  shapes = [x.shape for x in jax.tree.leaves(variables["params"])]
  assert shapes.count((50, 32)) == 1 and not any(s[-1:] == (50,) for s in shapes)
  with pytest.raises(ValueError, match="sequence length 17 exceeds max_length=16"):
    model.apply(variables, jnp.zeros((1, 17), jnp.int32))


def test_decoder_lm_is_causal_no_position_sees_a_later_token():
  model, variables, tokens = _decoder()
  logits = model.apply(variables, tokens)
  for t in range(tokens.shape[1]):
    changed = tokens.at[:, t].set((tokens[:, t] + 7) % 50)
    other = model.apply(variables, changed)
    np.testing.assert_array_equal(other[:, :t], logits[:, :t])  # before t: bit for bit
    assert np.abs(other[:, t:] - logits[:, t:]).max(axis=-1).min() > 0  # from t on: every one


def test_the_loss_of_a_uniform_model_is_log_vocab():
  model, variables, tokens = _decoder(vocab=97)
  zero = jax.tree.map(jnp.zeros_like, variables)  # zero embeddings and norms: uniform logits
  batch = {"tokens": jnp.concatenate([tokens, tokens[:, :1]], axis=1)}
  task = tasks.TASKS["causal_lm"]
  outcomes = task.outcomes(model.apply(zero, *task.inputs(batch)), batch)
  loss, _ = tasks.mean_loss(outcomes)
  np.testing.assert_allclose(loss, np.log(97), rtol=1e-6)
  assert outcomes.loss.shape == (3, 12)  # one prediction per input position


@pytest.mark.parametrize("fields, data_fields, message", [
    (dict(name="resnet9000"), dict(num_classes=10), "not a known model"),
    (dict(name="cifar_resnet", depth=21), dict(num_classes=10), "6n \\+ 2"),
    (dict(name="wide_resnet", depth=27), dict(num_classes=10), "6n \\+ 4"),
    (dict(name="vgg", depth=17), dict(num_classes=10), "allowed: one of \\(11, 13, 16, 19\\)"),
    (dict(name="imagenet_resnet", depth=51), dict(num_classes=10), "allowed"),
    (dict(name="cifar_resnet", widht=4), dict(num_classes=10), "widht.*not a field"),
    (dict(name="cifar_resnet", num_classes=3), dict(num_classes=10), "set by the dataset"),
    (dict(name="bert", hidden=10, num_heads=3), dict(vocab_size=10),
     r"config.model.num_heads=3 is not allowed for model 'bert'; allowed: an int >= 1 that "
     r"divides hidden \(hidden=10\)"),
    (dict(name="bert"), dict(num_classes=10), "cannot take"),
    (dict(name="decoder_lm", hidden=10, num_heads=3), dict(vocab_size=10), "that divides hidden"),
    (dict(name="decoder_lm", dropout=1.0), dict(vocab_size=10),
     r"config.model.dropout=1.0 is not allowed for model 'decoder_lm'; allowed: a number in "
     r"\[0, 1\)"),
    (dict(name="decoder_lm", num_layers=0), dict(vocab_size=10),
     r"config.model.num_layers=0 is not allowed .*; allowed: an int >= 1"),
    # Values that break shape inference, where JAX's own error names no field.
    (dict(name="cnn1d", kernel_size=0), dict(num_classes=10),
     r"^config.model.kernel_size=0 is not allowed for model 'cnn1d'; allowed: an int >= 1$"),
    (dict(name="cnn1d", stride=0), dict(num_classes=10), r"config.model.stride=0 is not allowed"),
    (dict(name="cnn1d", channels="many"), dict(num_classes=10),
     r"config.model.channels='many' is not allowed .*; allowed: a tuple of values each an int >= 1"),
    (dict(name="cnn1d", hidden=-1), dict(num_classes=10), r"allowed: an int >= 0"),
    (dict(name="cnn1d", pool="avg"), dict(num_classes=10),
     r"allowed: one of \('flatten', 'mean', 'max'\)"),
    (dict(name="mlp", hidden=(64, 0)), dict(num_classes=10), r"config.model.hidden=\(64, 0\)"),
    (dict(name="cnn2d", hidden=0), dict(num_classes=10), r"config.model.hidden=0 is not allowed"),
    (dict(name="cifar_resnet", width=0), dict(num_classes=10), r"config.model.width=0"),
    (dict(name="wide_resnet", widen_factor=True), dict(num_classes=10),
     r"config.model.widen_factor=True is not allowed"),
    (dict(name="vgg", width_divisor=128), dict(num_classes=10), r"allowed: an int in \[1, 64\]"),
    (dict(name="bert", type_vocab_size=0), dict(vocab_size=10), r"config.model.type_vocab_size=0"),
    (dict(name="decoder_lm", max_length=2.5), dict(vocab_size=10), r"config.model.max_length=2.5"),
])
def test_bad_model_settings_raise_clear_errors(fields, data_fields, message):
  with pytest.raises(ValueError, match=message):
    models.build_model(fields, **data_fields)


def test_every_model_setting_declares_what_it_allows():
  """So that build_model refuses any bad value before anything traces; only the fields the
  dataset sets are declared without a rule."""
  for name, module in models.MODELS.items():
    settings = {f.name for f in dataclasses.fields(module)} - {"parent", "name"}
    undeclared = settings - set(fields_lib.rules(module)) - {"num_classes", "vocab_size",
                                                             "cardinalities", "hotness"}
    assert not undeclared, f"{name}: {sorted(undeclared)} declare no rule"


def test_a_cnn2d_that_pools_the_image_away_is_refused_naming_the_field():
  model = models.build_model(dict(name="cnn2d", channels=(4, 4, 4, 4)), num_classes=10)
  with pytest.raises(ValueError, match=r"^config.model.channels=\(4, 4, 4, 4\) is not allowed "
                                       r"for model 'cnn2d' on 8x8 images; allowed: at most 3 "):
    _param_count(model, jnp.zeros((2, 8, 8)))


def test_exact_gelu_and_its_derivative_match_float64():
  x = np.linspace(-8, 8, 2001)
  erf = np.vectorize(math.erf)
  expected = 0.5 * x * (1 + erf(x / math.sqrt(2)))
  slope = 0.5 * (1 + erf(x / math.sqrt(2))) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
  x32 = jnp.asarray(x, jnp.float32)
  np.testing.assert_array_equal(layers.gelu(x32), jax.nn.gelu(x32, approximate=False))
  np.testing.assert_allclose(layers.gelu(x32), expected, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jax.vmap(jax.grad(layers.gelu))(x32), slope, rtol=1e-6, atol=1e-7)


def test_gelu_differentiates_a_per_worker_copy_under_shard_map():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

  def per_worker(w, x):
    loss = lambda w: jnp.sum(layers.gelu(x[0] * w))
    return jax.grad(loss)(jax.lax.pcast(w, "data", to="varying"))[None]

  grads = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=(P(), P("data")),
                                out_specs=P("data")))(jnp.ones(4), jnp.ones((8, 4)))
  slope_at_one = 0.5 * (1 + math.erf(1 / math.sqrt(2))) + math.exp(-0.5) / math.sqrt(2 * math.pi)
  np.testing.assert_allclose(grads, np.full((8, 4), slope_at_one), rtol=1e-6)


@pytest.mark.parametrize("name,fields,inputs", [
    ("decoder_lm", dict(vocab_size=300, hidden=32, num_layers=2, num_heads=4, max_length=16),
     lambda: (jnp.arange(64).reshape(4, 16) % 300,)),
    # The same attention blocks as the decoder's, with BERT's heads: the slow suite's.
    pytest.param("bert", dict(vocab_size=300, hidden=32, num_layers=2, num_heads=4,
                              intermediate=64, max_length=16, dropout=0.0),
                 lambda: (jnp.arange(64).reshape(4, 16) % 300, jnp.ones((4, 16), jnp.int32),
                          jnp.array([[1, 3]] * 4)), marks=pytest.mark.slow),
])
@pytest.mark.slow  # compiles a decoder in two precisions
def test_mixed_precision_runs_the_matmuls_in_bfloat16_and_keeps_float32_state(name, fields,
                                                                             inputs):
  """``compute_dtype="bfloat16"``: every matrix product with a parameter (projections, MLP,
  logits) takes bfloat16 operands in both passes, and so do the attention's own products but
  those of the backward pass through its float32 softmax (flax's ``force_fp32_for_softmax``:
  products of two ``[batch, heads, ...]`` activations, no parameter); parameters, gradients (what
  the exchange sees) and logits are float32, and the loss is float32's to bfloat16's precision."""
  full = models.build_model(dict(name=name, **fields))
  mixed = models.build_model(dict(name=name, compute_dtype="bfloat16", **fields))
  params = full.init(jax.random.PRNGKey(0), *inputs())["params"]

  def loss(model, p):
    return jnp.mean(jax.nn.logsumexp(model.apply({"params": p}, *inputs()), axis=-1))

  hlo = jax.jit(jax.grad(lambda p: loss(mixed, p))).lower(params).as_text()
  operands = re.findall(r"stablehlo\.dot_general .*: \((.*)\) ->", hlo)
  wide = [o for o in operands if "f32" in o]
  assert operands and all("bf16" in o for o in operands if o not in wide), name
  assert all(re.fullmatch(r"tensor<(\d+x){4}f32>, tensor<(\d+x){4}f32>", o) for o in wide), wide
  assert len(wide) <= 3 * fields["num_layers"] < len(operands) - len(wide)
  grads = jax.grad(lambda p: loss(mixed, p))(params)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  assert mixed.apply({"params": params}, *inputs()).dtype == jnp.float32
  np.testing.assert_allclose(loss(mixed, params), loss(full, params), rtol=2e-2)


def test_mixed_precision_is_checked_and_the_gpu_tier_uses_it():
  with pytest.raises(ValueError, match=r"config.model.compute_dtype='float16' is not allowed for "
                                       r"model 'decoder_lm'; allowed: one of \('float32', 'bfloat16'\)"):
    models.build_model(dict(name="decoder_lm", vocab_size=10, compute_dtype="float16"))
  assert lm_stdlib.MODEL_SIZES["base"]["model"]["compute_dtype"] == "bfloat16"
  assert "compute_dtype" not in lm_stdlib.MODEL_SIZES["tiny"]["model"]
