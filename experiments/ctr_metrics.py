"""Click-prediction metrics in numpy float64: the area under the ROC curve and the log-loss.

``auc`` is the Mann-Whitney statistic: the probability that a random positive scores above a
random negative, ties counting one half, computed from the ranks of the scores (ties given their
mean rank) in ``O(n log n)``. ``log_loss`` is the mean binary cross-entropy of the logits, in
nats, computed stably (``max(z, 0) - z y + log(1 + exp(-|z|))``).
"""

import numpy as np


def auc(labels, scores) -> float:
  """Area under the ROC curve of ``scores`` (any monotone score: logits or probabilities) for
  binary ``labels``.

  Raises:
    ValueError: labels other than 0 and 1, shapes that differ, or no positive or no negative.
  """
  labels, scores = _check(labels, scores)
  positives = int(labels.sum())
  negatives = labels.size - positives
  if not positives or not negatives:
    raise ValueError(f"auc: {positives} positive and {negatives} negative labels; allowed: at "
                     "least one of each")
  order = np.argsort(scores, kind="stable")
  ordered = scores[order]
  ranks = np.empty(scores.size, np.float64)
  # Tied scores share the mean of their ranks (1-based).
  starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
  ends = np.r_[starts[1:], ordered.size]
  ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
  return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2.0)
               / (positives * float(negatives)))


def log_loss(labels, logits) -> float:
  """Mean binary cross-entropy of ``logits`` for binary ``labels``, in nats."""
  labels, logits = _check(labels, logits)
  return float(np.mean(np.maximum(logits, 0) - logits * labels
                       + np.log1p(np.exp(-np.abs(logits)))))


def _check(labels, scores):
  labels = np.asarray(labels, np.float64).reshape(-1)
  scores = np.asarray(scores, np.float64).reshape(-1)
  if labels.shape != scores.shape:
    raise ValueError(f"{labels.size} labels for {scores.size} scores; allowed: one each")
  if not np.all((labels == 0) | (labels == 1)):
    raise ValueError("labels other than 0 and 1; allowed: binary labels")
  return labels, scores
