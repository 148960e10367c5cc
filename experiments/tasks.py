"""Losses and metrics per task: what the model is fed and how its logits are scored.

``classification``: softmax cross-entropy on ``label``, accuracy of the arg-max.
``masked_lm``: cross-entropy of the original tokens at the masked positions, weighted by
``masked_weights`` (0 for padding predictions), and the masked-token accuracy (Devlin et al. 2019).
``causal_lm``: a row of ``tokens`` holds ``length + 1`` tokens; the model reads the first
``length`` and is scored, at every position, on the token that follows (cross-entropy in nats per
token, and next-token accuracy).

Both return per-example (per-prediction) ``loss``, ``correct`` and ``weight`` arrays of one shape,
so that a batch's loss is ``sum(loss * weight) / sum(weight)`` and evaluation can sum them over
devices exactly.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

Batch = dict[str, jax.Array]


class Outcomes(NamedTuple):
  loss: jax.Array
  correct: jax.Array
  weight: jax.Array


class Task(NamedTuple):
  """Attributes:
    inputs: batch -> the model's positional inputs.
    outcomes: (logits, batch) -> :class:`Outcomes`.
  """
  inputs: Callable[[Batch], tuple[Any, ...]]
  outcomes: Callable[[jax.Array, Batch], Outcomes]


def _classification_outcomes(logits, batch):
  labels = batch["label"]
  return Outcomes(
      loss=optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels),
      correct=(jnp.argmax(logits, -1) == labels).astype(jnp.float32),
      weight=jnp.ones(labels.shape, jnp.float32))


def _masked_lm_outcomes(logits, batch):
  targets = batch["masked_ids"]
  return Outcomes(
      loss=optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets),
      correct=(jnp.argmax(logits, -1) == targets).astype(jnp.float32),
      weight=batch["masked_weights"].astype(jnp.float32))


def _causal_lm_outcomes(logits, batch):
  targets = batch["tokens"][:, 1:]
  return Outcomes(
      loss=optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets),
      correct=(jnp.argmax(logits, -1) == targets).astype(jnp.float32),
      weight=jnp.ones(targets.shape, jnp.float32))


TASKS = {
    "classification": Task(inputs=lambda b: (b["input"],), outcomes=_classification_outcomes),
    "masked_lm": Task(
        inputs=lambda b: (b["input_ids"], b["attention_mask"], b["masked_positions"]),
        outcomes=_masked_lm_outcomes),
    "causal_lm": Task(inputs=lambda b: (b["tokens"][:, :-1],), outcomes=_causal_lm_outcomes),
}


def mean_loss(outcomes: Outcomes) -> tuple[jax.Array, jax.Array]:
  """Weighted mean loss and accuracy of one batch."""
  total = jnp.maximum(outcomes.weight.sum(), 1.0)
  return ((outcomes.loss * outcomes.weight).sum() / total,
          (outcomes.correct * outcomes.weight).sum() / total)
