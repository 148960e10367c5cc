"""A decoder-only (GPT-style) Transformer language model: pre-LN, GELU, tied embeddings, causal.

The GPT-2 layout (Radford et al. 2019): token and learned position embeddings, ``num_layers``
blocks ``x + attention(LN(x))`` then ``x + MLP(LN(x))`` (layer norm *before* each sublayer,
Xiong et al. 2020, which trains without the learning-rate warm-up that post-LN needs), a final
layer norm, and logits from the token embedding matrix itself (tied input and output embeddings,
Press & Wolf 2017). Attention is causal: position ``t`` attends to positions ``<= t`` only, so the
logits at ``t`` predict token ``t + 1`` from what precedes it. The output projections of both
sublayers are initialised with standard deviation ``0.02 / sqrt(2 num_layers)``, GPT-2's scaling
for the residual stream that every block adds to. The GELU is
:func:`experiments.models.layers.gelu`; layer norm needs no statistics across devices.
"""

import math

import flax.linen as nn
import jax.numpy as jnp

from experiments.models import fields
from experiments.models import layers

_init = nn.initializers.normal(0.02)


class DecoderLM(nn.Module):
  """Causal Transformer language model; returns next-token logits at every position.

  Attributes:
    vocab_size: tokens of the vocabulary (set by the dataset).
    hidden: width of the residual stream (``d_model``).
    num_layers: Transformer blocks.
    num_heads: attention heads; must divide ``hidden``.
    mlp_ratio: the MLP's width over ``hidden`` (4 in GPT-2).
    max_length: positions with an embedding (the longest sequence the model takes).
    dropout: dropout rate on embeddings, attention probabilities and block outputs (0: none).
    compute_dtype: ``"float32"`` or ``"bfloat16"``, the dtype of the matrix products (mixed
      precision: :mod:`experiments.models.layers`).
  """
  vocab_size: int
  hidden: int = fields.integer(128)
  num_layers: int = fields.integer(4)
  num_heads: int = fields.integer(4, divides="hidden")
  mlp_ratio: int = fields.integer(4)
  max_length: int = fields.integer(256)
  dropout: float = fields.rate(0.0)
  compute_dtype: str = fields.choice("float32", layers.COMPUTE_DTYPES)

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    """Next-token logits.

    Args:
      tokens: ``int32[batch, length]`` token ids, ``length <= max_length``.
      train: enables dropout (needs a ``"dropout"`` PRNG stream when ``dropout > 0``).

    Returns:
      ``float32[batch, length, vocab_size]``: at position ``t``, the logits of token ``t + 1``.
    """
    length = tokens.shape[1]
    if length > self.max_length:
      raise ValueError(f"decoder_lm: sequence length {length} exceeds "
                       f"max_length={self.max_length}")
    embed = nn.Embed(self.vocab_size, self.hidden, embedding_init=_init, name="token_embeddings")
    x = embed(tokens) + nn.Embed(self.max_length, self.hidden, embedding_init=_init,
                                 name="position_embeddings")(jnp.arange(length)[None])
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    mask = nn.make_causal_mask(tokens)
    residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * self.num_layers))
    dtype = jnp.dtype(self.compute_dtype)
    for i in range(self.num_layers):
      y = nn.LayerNorm(name=f"layer_{i}_attention_norm")(x)
      y = nn.MultiHeadDotProductAttention(
          num_heads=self.num_heads, kernel_init=_init, out_kernel_init=residual_init,
          dropout_rate=self.dropout, deterministic=not train, dtype=dtype,
          force_fp32_for_softmax=True, name=f"layer_{i}_attention")(y, y, mask=mask)
      # The residual stream stays float32: a bfloat16 sublayer output is widened as it is added.
      x = x + nn.Dropout(self.dropout, deterministic=not train)(y)
      y = nn.LayerNorm(name=f"layer_{i}_mlp_norm")(x)
      y = layers.gelu(nn.Dense(self.mlp_ratio * self.hidden, kernel_init=_init, dtype=dtype,
                               name=f"layer_{i}_mlp_in")(y))
      y = nn.Dense(self.hidden, kernel_init=residual_init, dtype=dtype,
                   name=f"layer_{i}_mlp_out")(y)
      x = x + nn.Dropout(self.dropout, deterministic=not train)(y)
    x = nn.LayerNorm(name="final_norm")(x)
    # Logits in the products' dtype, widened after: their gradient then enters the products in
    # that dtype too (a float32 cotangent would widen the backward products).
    return jnp.dot(x.astype(dtype), embed.embedding.astype(dtype).T).astype(jnp.float32)
