"""Losses and metrics per task: what the model is fed and how its logits are scored.

``classification``: softmax cross-entropy on ``label``, accuracy of the arg-max.
``masked_lm``: cross-entropy of the original tokens at the masked positions, weighted by
``masked_weights`` (0 for padding predictions), and the masked-token accuracy (Devlin et al. 2019).
``ctr`` (click-through rate): one logit per row, the binary cross-entropy of ``label`` (0 or 1)
and the accuracy of its sign; the evaluation also ranks the logits (AUC and log-loss over the
whole evaluation set: :attr:`Task.scores`).
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
import numpy as np
import optax

from experiments import ctr_metrics

Batch = dict[str, jax.Array]


class Outcomes(NamedTuple):
  loss: jax.Array
  correct: jax.Array
  weight: jax.Array


class Task(NamedTuple):
  """Attributes:
    inputs: batch -> the model's positional inputs.
    outcomes: (logits, batch) -> :class:`Outcomes`.
    scores: metrics of the whole evaluation set's ``(labels, logits)`` (numpy) that do not sum
      over batches (AUC), or None.
  """
  inputs: Callable[[Batch], tuple[Any, ...]]
  outcomes: Callable[[jax.Array, Batch], Outcomes]
  scores: Callable[[np.ndarray, np.ndarray], dict[str, float]] | None = None


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


def _ctr_outcomes(logits, batch):
  labels = batch["label"].astype(jnp.float32)
  return Outcomes(loss=optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), labels),
                  correct=((logits > 0) == (labels > 0.5)).astype(jnp.float32),
                  weight=jnp.ones(labels.shape, jnp.float32))


def _ctr_scores(labels, logits):
  return {"auc": ctr_metrics.auc(labels, logits), "log_loss": ctr_metrics.log_loss(labels, logits)}


TASKS = {
    "classification": Task(inputs=lambda b: (b["input"],), outcomes=_classification_outcomes),
    "masked_lm": Task(
        inputs=lambda b: (b["input_ids"], b["attention_mask"], b["masked_positions"]),
        outcomes=_masked_lm_outcomes),
    "causal_lm": Task(inputs=lambda b: (b["tokens"][:, :-1],), outcomes=_causal_lm_outcomes),
    "ctr": Task(inputs=lambda b: (b["dense"], b["sparse"]), outcomes=_ctr_outcomes,
                scores=_ctr_scores),
}


def mean_loss(outcomes: Outcomes) -> tuple[jax.Array, jax.Array]:
  """Weighted mean loss and accuracy of one batch."""
  total = jnp.maximum(outcomes.weight.sum(), 1.0)
  return ((outcomes.loss * outcomes.weight).sum() / total,
          (outcomes.correct * outcomes.weight).sum() / total)
