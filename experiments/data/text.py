"""Raw text for masked-language-model pre-training (BERT, Devlin et al. 2019).

Corpus: every ``*.txt`` file under ``config.data_dir`` (sorted, recursively), or, for the
``pydoc_text`` dataset, the English help texts CPython ships in ``pydoc_data/topics.py``. Lines are
lower-cased and tokenized with a WordPiece tokenizer (``tokenizers``), either loaded from
``config.data.vocab_file`` (one token per line, as released with BERT) or trained on the corpus
with ``config.data.vocab_size`` entries, once, and shared by every process through
``config.data.cache_dir`` (:mod:`experiments.data.tokenizer`: the trainer is not deterministic).
The token stream is cut into sequences
``[CLS] tokens [SEP]`` of ``config.data.seq_len``; the last ``config.data.eval_fraction`` of them
are held out for evaluation. The corpus's and the tokenizer's sha256 identify the data
(``results.json``, checkpoints). A ``.txt`` file that is not a regular file (a FIFO) is refused.

Masking is dynamic (a fresh draw per step, as in RoBERTa): 15% of the non-special tokens of every
sequence, at most ``config.data.max_predictions``, are chosen; each is replaced by ``[MASK]`` with
probability 0.8, by a random token with probability 0.1 and left unchanged otherwise, and the
model predicts the original token there.
"""

import hashlib
import os
from pydoc_data import topics

import numpy as np
from tokenizers import BertWordPieceTokenizer

from experiments.data import pipeline
from experiments.data import tokenizer as tokenizer_lib

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_LAYOUT = "config.data_dir must be a .txt file or a folder holding .txt files (raw UTF-8 text)"


def text(config, shards: pipeline.ShardSpec) -> pipeline.ShardedDataset:
  """Masked-LM data from the ``*.txt`` files under ``config.data_dir``."""
  return _masked_lm(config, shards, _read_text_files(config.data_dir))


def pydoc_text(config, shards: pipeline.ShardSpec) -> pipeline.ShardedDataset:
  """Masked-LM data from CPython's bundled ``pydoc_data.topics`` (about 0.5 MB of English)."""
  return _masked_lm(config, shards, [topics.topics[k] for k in sorted(topics.topics)])


def _read_text_files(data_dir):
  if not data_dir or not os.path.exists(data_dir):
    raise FileNotFoundError(f"text: config.data_dir={data_dir!r} does not exist; {_LAYOUT}")
  if os.path.isfile(data_dir):
    files = [data_dir]
  else:
    files = sorted(os.path.join(root, f) for root, _, names in os.walk(data_dir)
                   for f in names if f.endswith(".txt"))
  if not files:
    raise FileNotFoundError(f"text: no .txt files under config.data_dir={data_dir!r}; {_LAYOUT}")
  documents = []
  for path in files:
    pipeline.check_regular_file("text", path)
    try:
      with open(path, encoding="utf-8") as f:
        documents.append(f.read())
    except UnicodeDecodeError as e:
      raise ValueError(f"text: {path} is not UTF-8 text ({e}); {_LAYOUT}") from None
  return documents


def build_tokenizer(documents, vocab_file=None, vocab_size=30522, cache_dir=None,
                    expected_sha256="") -> tokenizer_lib.Shared:
  """A lower-casing BERT WordPiece tokenizer, loaded from ``vocab_file`` or trained on
  ``documents`` once and shared by every process through ``cache_dir``, with the sha256
  ``expected_sha256`` if one is given (:func:`experiments.data.tokenizer.shared`)."""
  if vocab_file:
    if not os.path.isfile(vocab_file):
      raise FileNotFoundError(f"text: config.data.vocab_file={vocab_file!r} does not exist")
    tokenizer = BertWordPieceTokenizer(vocab_file, lowercase=True)
    data = tokenizer.to_str().encode("utf-8")
    shared = tokenizer_lib.Shared(tokenizer, hashlib.sha256(data).hexdigest(), vocab_file)
  else:
    def train():
      trained = BertWordPieceTokenizer(lowercase=True)
      trained.train_from_iterator(documents, vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False)
      return trained
    shared = tokenizer_lib.shared(
        "wordpiece", {"vocab_size": vocab_size, "min_frequency": 2, "lowercase": True,
                      "special_tokens": SPECIAL_TOKENS},
        tokenizer_lib.text_sha256(documents), train, cache_dir, expected_sha256)
  missing = [t for t in SPECIAL_TOKENS if shared.tokenizer.token_to_id(t) is None]
  if missing:
    raise ValueError(f"text: the vocabulary lacks the special tokens {missing}")
  return shared


def mask_tokens(ids: np.ndarray, rng: np.random.Generator, *, max_predictions: int,
                vocab_size: int, special_ids: np.ndarray, mask_id: int, pad_id: int,
                mask_rate: float = 0.15) -> dict[str, np.ndarray]:
  """BERT's masking of ``ids`` (``int32[batch, length]``).

  Returns:
    ``input_ids`` (masked), ``attention_mask`` (1 where not padding), ``masked_positions``,
    ``masked_ids`` (the original tokens there) and ``masked_weights`` (1 for real predictions,
    0 for padding), the last three ``[batch, max_predictions]``.
  """
  batch, _ = ids.shape
  inputs = ids.copy()
  positions = np.zeros((batch, max_predictions), np.int32)
  targets = np.zeros((batch, max_predictions), np.int32)
  weights = np.zeros((batch, max_predictions), np.float32)
  for row in range(batch):
    candidates = np.flatnonzero(~np.isin(ids[row], special_ids))
    count = min(max_predictions, max(1, int(round(len(candidates) * mask_rate))),
                len(candidates))
    chosen = np.sort(rng.choice(candidates, size=count, replace=False))
    draw = rng.random(count)
    replaced = np.where(draw < 0.8, mask_id,
                        np.where(draw < 0.9, rng.integers(len(SPECIAL_TOKENS), vocab_size, count),
                                 ids[row, chosen]))
    inputs[row, chosen] = replaced
    positions[row, :count], targets[row, :count], weights[row, :count] = chosen, ids[row, chosen], 1
  return {"input_ids": inputs, "attention_mask": (ids != pad_id).astype(np.int32),
          "masked_positions": positions, "masked_ids": targets, "masked_weights": weights}


def _masked_lm(config, shards, documents):
  options = config.data
  seq_len = options.get("seq_len", 128)
  max_predictions = options.get("max_predictions", 20)
  vocab_size = options.get("vocab_size", 30522)
  eval_fraction = options.get("eval_fraction", 0.05)
  for name, value in (("seq_len", seq_len), ("max_predictions", max_predictions),
                      ("vocab_size", vocab_size)):
    pipeline.check_positive(f"config.data.{name}", value)
  if seq_len < 3:
    raise ValueError(f"config.data.seq_len={seq_len} must be at least 3 ([CLS] token [SEP])")
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"config.data.eval_fraction={eval_fraction!r} must be in (0, 1)")
  shared = build_tokenizer(documents, options.get("vocab_file"), vocab_size,
                          options.get("cache_dir"), options.get("tokenizer_sha256", ""))
  tokenizer = shared.tokenizer
  lines = [line for doc in documents for line in doc.splitlines() if line.strip()]
  stream = np.asarray([i for enc in tokenizer.encode_batch(lines, add_special_tokens=False)
                       for i in enc.ids], np.int32)
  body = seq_len - 2
  count = len(stream) // body
  cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
  sequences = np.concatenate([np.full((count, 1), cls_id, np.int32),
                              stream[:count * body].reshape(count, body),
                              np.full((count, 1), sep_id, np.int32)], axis=1)
  num_eval = max(shards.num_shards, int(round(count * eval_fraction)))
  if count - num_eval < 1:
    raise ValueError(f"text: the corpus gives {count} sequences of seq_len={seq_len}, too few to "
                     f"hold out {num_eval} for evaluation; add text or shorten seq_len")
  special = np.asarray([tokenizer.token_to_id(t) for t in SPECIAL_TOKENS], np.int32)
  masking = dict(max_predictions=max_predictions, vocab_size=tokenizer.get_vocab_size(),
                 special_ids=special, mask_id=tokenizer.token_to_id("[MASK]"),
                 pad_id=tokenizer.token_to_id("[PAD]"))
  transform = lambda rows, rng: mask_tokens(rows["ids"], rng, **masking)
  train, test = {"ids": sequences[:-num_eval]}, {"ids": sequences[-num_eval:]}
  return pipeline.ShardedDataset(
      task="masked_lm", model_fields={"vocab_size": tokenizer.get_vocab_size()},
      train=pipeline.split_rows(train, shards), evaluation=pipeline.split_rows(test, shards),
      num_train=count - num_eval, num_eval=num_eval, shards=shards,
      batch_per_device=config.batch_size // shards.num_shards,
      eval_batch_per_device=config.eval_batch_size // shards.num_shards, seed=config.seed,
      train_transform=transform, eval_transform=transform,
      info={"corpus_sha256": tokenizer_lib.text_sha256(documents),
            "tokenizer_sha256": shared.sha256})
