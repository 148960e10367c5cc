"""BERT encoder with a masked-language-model head (Devlin et al. 2019).

Post-layer-norm Transformer encoder exactly as in the reference implementation: word, position and
token-type embeddings, ``num_layers`` blocks of self-attention and a GELU feed-forward layer, each
followed by dropout, a residual connection and layer norm; the MLM head (dense, GELU, layer norm,
decoder tied to the word embeddings plus a bias) scores only the masked positions, as the reference
does with ``max_predictions_per_seq``. BERT-base (12 layers, 768 hidden, 12 heads, 3072
intermediate, vocabulary 30,522, 512 positions) has 108,891,648 encoder parameters
(109,482,240 with the pooler, which masked-LM pre-training does not use and is left out).
Layer norm needs no cross-device statistics. The GELU is :func:`experiments.models.layers.gelu`.
"""

import flax.linen as nn
import jax.numpy as jnp

from experiments.models import fields
from experiments.models import layers

_init = nn.initializers.truncated_normal(0.02)


class BertEncoder(nn.Module):
  """Embeddings and Transformer blocks; returns hidden states ``[batch, length, hidden]``."""
  vocab_size: int
  hidden: int
  num_layers: int
  num_heads: int
  intermediate: int
  max_length: int
  type_vocab_size: int
  dropout: float
  dtype: jnp.dtype = jnp.float32  # of the matrix products

  @nn.compact
  def __call__(self, input_ids, attention_mask, train: bool):
    length = input_ids.shape[1]
    word = nn.Embed(self.vocab_size, self.hidden, embedding_init=_init, name="word_embeddings")
    x = word(input_ids)
    x += nn.Embed(self.max_length, self.hidden, embedding_init=_init,
                  name="position_embeddings")(jnp.arange(length)[None])
    x += nn.Embed(self.type_vocab_size, self.hidden, embedding_init=_init,
                  name="token_type_embeddings")(jnp.zeros_like(input_ids))
    x = nn.LayerNorm(epsilon=1e-12, name="embeddings_norm")(x)
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    mask = nn.make_attention_mask(attention_mask, attention_mask)
    for i in range(self.num_layers):
      y = nn.MultiHeadDotProductAttention(
          num_heads=self.num_heads, kernel_init=_init, dropout_rate=self.dropout,
          deterministic=not train, dtype=self.dtype, force_fp32_for_softmax=True,
          name=f"layer_{i}_attention")(x, x, mask=mask)
      y = nn.Dropout(self.dropout, deterministic=not train)(y)
      x = nn.LayerNorm(epsilon=1e-12, name=f"layer_{i}_attention_norm")(x + y)
      y = layers.gelu(nn.Dense(self.intermediate, kernel_init=_init, dtype=self.dtype,
                               name=f"layer_{i}_intermediate")(x))
      y = nn.Dense(self.hidden, kernel_init=_init, dtype=self.dtype, name=f"layer_{i}_output")(y)
      y = nn.Dropout(self.dropout, deterministic=not train)(y)
      x = nn.LayerNorm(epsilon=1e-12, name=f"layer_{i}_output_norm")(x + y)
    return x, word


class BertMLM(nn.Module):
  """BERT with the masked-LM head; returns logits at ``masked_positions``.

  Attributes:
    vocab_size: size of the WordPiece vocabulary (30,522 for the released BERT).
    hidden: hidden size (768 base, 128 tiny).
    num_layers: Transformer blocks (12 base, 2 tiny).
    num_heads: attention heads (12 base, 2 tiny); must divide ``hidden``.
    intermediate: feed-forward width (3072 base, 512 tiny).
    max_length: number of position embeddings (512).
    type_vocab_size: number of token types (2).
    dropout: dropout rate on embeddings, attention probabilities and block outputs (0.1).
    compute_dtype: ``"float32"`` or ``"bfloat16"``, the dtype of the matrix products (mixed
      precision: :mod:`experiments.models.layers`).
  """
  vocab_size: int
  hidden: int = fields.integer(768)
  num_layers: int = fields.integer(12)
  num_heads: int = fields.integer(12, divides="hidden")
  intermediate: int = fields.integer(3072)
  max_length: int = fields.integer(512)
  type_vocab_size: int = fields.integer(2)
  dropout: float = fields.rate(0.1)
  compute_dtype: str = fields.choice("float32", layers.COMPUTE_DTYPES)

  @nn.compact
  def __call__(self, input_ids, attention_mask, masked_positions, train: bool = False):
    """Scores the vocabulary at the masked positions.

    Args:
      input_ids: ``int32[batch, length]`` token ids (masked tokens already replaced).
      attention_mask: ``[batch, length]``, 1 for real tokens and 0 for padding.
      masked_positions: ``int32[batch, predictions]`` positions to score.
      train: enables dropout (needs a ``"dropout"`` PRNG stream).

    Returns:
      ``float32[batch, predictions, vocab_size]`` logits.
    """
    if input_ids.shape[1] > self.max_length:
      raise ValueError(f"bert: sequence length {input_ids.shape[1]} exceeds "
                       f"max_length={self.max_length}")
    dtype = jnp.dtype(self.compute_dtype)
    x, word = BertEncoder(self.vocab_size, self.hidden, self.num_layers, self.num_heads,
                          self.intermediate, self.max_length, self.type_vocab_size, self.dropout,
                          dtype, name="encoder")(input_ids, attention_mask, train)
    x = jnp.take_along_axis(x, masked_positions[..., None], axis=1)
    x = layers.gelu(nn.Dense(self.hidden, kernel_init=_init, dtype=dtype,
                             name="mlm_transform")(x))
    x = nn.LayerNorm(epsilon=1e-12, name="mlm_norm")(x)
    bias = self.param("mlm_bias", nn.initializers.zeros, (self.vocab_size,))
    # Logits in the products' dtype, widened after (see the decoder).
    return jnp.dot(x.astype(dtype), word.embedding.astype(dtype).T).astype(jnp.float32) + bias
