"""Language modelling on the Python standard library's own source: a real corpus every machine has.

No data set can be downloaded on the machines this project runs on, but one large real corpus
ships with every Python: its standard library (``sysconfig.get_paths()["stdlib"]``, about 12 MB
of ``.py`` files outside the test folders on Python 3.11). It is read at run time, never copied
into the repository.

* Corpus (``config.data.corpus``): ``stdlib`` (the default: the standard library, or the folder
  ``config.data_dir`` when set) or ``pypi``, the source of a pinned list of packages from PyPI,
  extracted on first use from the archives in the cache folder ``config.data_dir``
  (:mod:`experiments.data.pypi_corpus`); both are read, split and tokenized alike, as follows.
* Files: every ``*.py`` under the folder (``config.data_dir`` when set), except those in folders
  named ``test``, ``tests`` or ``idle_test`` and in ``site-packages`` and ``__pycache__``; read
  as UTF-8 (undecodable bytes replaced). Each must be a regular file: a FIFO, which would block
  the run, is refused.
* Split by file: a file is held out for validation when the first 8 bytes of the sha256 of its
  path relative to the folder (``/``-separated), as a fraction of 2^64, fall below
  ``config.data.eval_fraction``; the same files on every machine and Python version that has
  them, whatever the order of the directory listing.
* Tokenizer: a byte-level BPE (GPT-2's, the ``tokenizers`` package) of ``config.data.vocab_size``
  tokens, ``<|endoftext|>`` among them, trained on the training files once and shared by every
  process and run through ``config.data.cache_dir`` (:mod:`experiments.data.tokenizer`); the
  token ids of each split are cached beside it, with a checksum (a damaged file is encoded
  again).
* Rows: each split's files, in path order, each followed by ``<|endoftext|>``, are one token
  stream cut into windows of ``seq_len + 1`` tokens that overlap by one (the model reads the first
  ``seq_len`` and predicts each next one: task ``causal_lm``). Evaluation uses
  ``config.data.eval_sequences`` windows spread evenly over the validation stream (0: all).
* Metric: validation loss in nats per token, and in bits per byte of source text
  (``test_bits_per_byte``: the summed loss over ln 2, divided by the UTF-8 bytes the scored tokens
  stand for), which does not depend on the tokenizer.
* Provenance: the Python version and a sha256 of the corpus (every file's path and content),
  computed here when the corpus is read, are recorded in ``results.json`` with the tokenizer's
  hash. A config may pin each (``config.data.python_version``, which ``configs/lm_stdlib.py``
  sets, ``config.data.corpus_sha256``, ``config.data.tokenizer_sha256``; '' accepts whatever is
  found): a corpus or a cached tokenizer with another hash is refused.
"""

import dataclasses
import functools
import hashlib
import io
import math
import os
import pathlib
import platform
import sysconfig

from absl import logging
import numpy as np
from tokenizers import ByteLevelBPETokenizer

from experiments.data import pipeline
from experiments.data import pypi_corpus
from experiments.data import tokenizer as tokenizer_lib

END_OF_TEXT = "<|endoftext|>"
# config.data.corpus: this Python's standard library, or the pinned packages of .pypi_corpus.
CORPORA = ("stdlib", "pypi")
EXCLUDED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
# 256 byte tokens and the end-of-text token come first; merges make the rest.
MIN_VOCAB_SIZE = 257 + 1


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The standard library's source files.

  Attributes:
    root: the folder read.
    paths: the files' paths relative to ``root``, ``/``-separated, sorted.
    texts: their contents, in the same order.
    sha256: hash of every path and content (what ``config.data.corpus_sha256`` pins).
    python_version: the Python version of this process (``platform.python_version()``).
  """
  root: str
  paths: tuple[str, ...]
  texts: tuple[str, ...]
  sha256: str
  python_version: str

  @property
  def num_bytes(self) -> int:
    return sum(len(t.encode("utf-8")) for t in self.texts)

  def split(self, eval_fraction: float) -> tuple[list[str], list[str]]:
    """``(train texts, validation texts)``, by the hash of each file's path."""
    train, held_out = [], []
    for path, text in zip(self.paths, self.texts):
      (held_out if is_validation(path, eval_fraction) else train).append(text)
    return train, held_out


def default_root() -> str:
  """This Python's standard-library folder."""
  return sysconfig.get_paths()["stdlib"]


@functools.cache
def read_corpus(root: str | None = None) -> Corpus:
  """The ``.py`` files under ``root`` (default :func:`default_root`) outside test folders.

  Raises:
    FileNotFoundError: the folder is missing, or holds no ``.py`` file.
    ValueError: a ``.py`` file is not a regular file (a FIFO would block the run).
  """
  root = root or default_root()
  where = ("config.data_dir" if root != default_root()
           else 'sysconfig.get_paths()["stdlib"], this Python\'s standard library')
  if not os.path.isdir(root):
    raise FileNotFoundError(
        f"stdlib_lm: the standard-library folder {root!r} ({where}) does not exist. This dataset "
        "reads the Python standard library's .py source; run it with a Python whose standard "
        "library is installed as source, or point config.data_dir at such a folder")
  paths = []
  for folder, subfolders, names in os.walk(root):
    subfolders[:] = sorted(s for s in subfolders if s not in EXCLUDED_FOLDERS)
    relative = pathlib.PurePath(os.path.relpath(folder, root))
    paths += [(relative / n).as_posix().removeprefix("./") for n in names if n.endswith(".py")]
  paths.sort()
  if not paths:
    raise FileNotFoundError(f"stdlib_lm: no .py file outside test folders under {root!r} "
                            f"({where}); it must hold the standard library's source")
  texts, digest = [], hashlib.sha256()
  for path in paths:
    pipeline.check_regular_file("stdlib_lm", os.path.join(root, path))
    data = pathlib.Path(root, path).read_bytes()
    texts.append(data.decode("utf-8", "replace"))
    digest.update(f"{path}\0{len(data)}\0".encode())
    digest.update(data)
  return Corpus(root, tuple(paths), tuple(texts), digest.hexdigest(), platform.python_version())


def is_validation(path: str, eval_fraction: float) -> bool:
  """Whether the file at ``path`` (relative, ``/``-separated) is held out for validation."""
  value = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") / 2.0**64
  return value < eval_fraction


def stdlib_lm(config, shards: pipeline.ShardSpec) -> pipeline.ShardedDataset:
  """Causal-LM data from the standard library's source (see the module docstring)."""
  options = config.data
  seq_len = options.get("seq_len", 128)
  vocab_size = options.get("vocab_size", 4096)
  eval_fraction = options.get("eval_fraction", 0.05)
  eval_sequences = options.get("eval_sequences", 0)
  for name, value in (("seq_len", seq_len), ("vocab_size", vocab_size)):
    pipeline.check_positive(f"config.data.{name}", value)
  if vocab_size < MIN_VOCAB_SIZE:
    raise ValueError(f"config.data.vocab_size={vocab_size} is too small; allowed: >= "
                     f"{MIN_VOCAB_SIZE} (256 byte tokens, {END_OF_TEXT}, one merge)")
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"config.data.eval_fraction={eval_fraction!r} must be in (0, 1)")
  if isinstance(eval_sequences, bool) or not isinstance(eval_sequences, int) or eval_sequences < 0:
    raise ValueError(f"config.data.eval_sequences={eval_sequences!r} must be an int >= 0 "
                     "(0: every validation window)")
  corpus = read_corpus(corpus_root(config))
  check_pinned(corpus, options)
  train_texts, eval_texts = corpus.split(eval_fraction)
  if not train_texts or not eval_texts:
    raise ValueError(f"config.data.eval_fraction={eval_fraction} leaves {len(train_texts)} "
                     f"training and {len(eval_texts)} validation files of {len(corpus.paths)}; "
                     "both need at least one")
  shared = build_tokenizer(train_texts, vocab_size, options.get("cache_dir"),
                           options.get("tokenizer_sha256", ""))
  folder = pathlib.Path(shared.path).parent
  train_stream = token_stream(shared, train_texts, folder)
  eval_stream = token_stream(shared, eval_texts, folder)
  train_rows = windows(train_stream, seq_len)
  eval_rows = windows(eval_stream, seq_len)
  if eval_sequences and eval_sequences < len(eval_rows):
    eval_rows = eval_rows[np.unique(np.linspace(0, len(eval_rows) - 1, eval_sequences).round()
                                    .astype(np.int64))]
  if len(eval_rows) < shards.num_shards:
    raise ValueError(f"stdlib_lm: the validation files give {len(eval_rows)} windows of "
                     f"seq_len={seq_len}, fewer than the {shards.num_shards} devices; raise "
                     "config.data.eval_fraction or lower seq_len")
  sizes = token_byte_sizes(shared.tokenizer)
  eval_tokens = eval_rows[:, 1:].size
  eval_bytes = int(sizes[eval_rows[:, 1:]].sum())
  nats_to_bits_per_byte = eval_tokens / (math.log(2) * eval_bytes)
  info = {"python_version": corpus.python_version, "corpus_sha256": corpus.sha256,
          "corpus_files": len(corpus.paths), "corpus_bytes": corpus.num_bytes,
          "tokenizer_sha256": shared.sha256, "train_tokens": int(train_stream.size),
          "eval_tokens": eval_tokens, "eval_bytes": eval_bytes}
  return pipeline.ShardedDataset(
      task="causal_lm", model_fields={"vocab_size": shared.tokenizer.get_vocab_size()},
      train=pipeline.split_rows({"tokens": train_rows}, shards),
      evaluation=pipeline.split_rows({"tokens": eval_rows}, shards),
      num_train=len(train_rows), num_eval=len(eval_rows), shards=shards,
      batch_per_device=config.batch_size // shards.num_shards,
      eval_batch_per_device=config.eval_batch_size // shards.num_shards, seed=config.seed,
      info=info,
      derived_metrics=lambda m: {"test_bits_per_byte": m["test_loss"] * nats_to_bits_per_byte})


def corpus_root(config) -> str | None:
  """The folder to read: with ``config.data.corpus='stdlib'`` (the default) ``config.data_dir``,
  or this Python's standard library when that is ''; with ``'pypi'`` the pinned packages' source,
  extracted on first use from the archives in the cache folder ``config.data_dir`` ('': its
  default) by :func:`.pypi_corpus.extract`, without the network."""
  name = config.data.get("corpus", "stdlib")
  if name not in CORPORA:
    raise ValueError(f"config.data.corpus={name!r}; allowed: {', '.join(CORPORA)}")
  if name == "pypi":
    return pypi_corpus.extract(config.data_dir or pypi_corpus.default_cache_dir())
  return config.data_dir or None


def check_pinned(corpus: Corpus, options) -> None:
  """Raises if the config pins another Python version or corpus than the one found."""
  if options.get("corpus", "stdlib") == "pypi":
    remedy = ("the pinned packages' source was changed after it was extracted, or the pinned list "
              f"is another one. Delete {corpus.root} to extract it again from the archives")
  else:
    remedy = ("another Python's standard library gives another corpus. Run with the Python the "
              "config was made with")
  for field, found in (("python_version", corpus.python_version),
                       ("corpus_sha256", corpus.sha256)):
    pinned = options.get(field, "")
    if pinned and pinned != found:
      raise ValueError(
          f"config.data.{field}={pinned!r}, but the corpus read from {corpus.root!r} (Python "
          f"{corpus.python_version}) has {field} {found!r}, and runs on different corpora are "
          f"not comparable: {remedy}, or set --config.data.{field}='' to accept this one")


def build_tokenizer(texts, vocab_size: int, cache_dir: str | None,
                    expected_sha256: str = "") -> tokenizer_lib.Shared:
  """The byte-level BPE of ``texts``, trained once and shared (:mod:`.tokenizer`); refused when
  ``expected_sha256`` is set and the cached one differs."""
  def train():
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                                special_tokens=[END_OF_TEXT], show_progress=False)
    return trained
  return tokenizer_lib.shared("bytelevel_bpe", {"vocab_size": vocab_size, "min_frequency": 2,
                                                "special_tokens": [END_OF_TEXT]},
                              tokenizer_lib.text_sha256(texts), train, cache_dir, expected_sha256)


def token_stream(shared: tokenizer_lib.Shared, texts, folder: pathlib.Path) -> np.ndarray:
  """``texts`` encoded, each followed by ``<|endoftext|>``, as one ``int32`` stream; cached in
  ``folder`` under the tokenizer's and the texts' hashes (encoding 12 MB takes seconds), with
  its checksum (:func:`_read_tokens`). A cached file that cannot be read or fails its checksum
  (cut short, damaged in place) is derived data: it is named, deleted and encoded again."""
  key = hashlib.sha256(f"{shared.sha256}:{tokenizer_lib.text_sha256(texts)}".encode())
  path = folder / f"tokens-{key.hexdigest()[:24]}.npy"
  if path.exists():
    try:
      return _read_tokens(path)
    except (ValueError, OSError, EOFError) as e:  # numpy's errors for a file cut short
      logging.warning("stdlib_lm: the cached token stream %s cannot be read (%s: %s); encoding "
                      "the texts again", path, type(e).__name__, e)
      path.unlink(missing_ok=True)  # another process may have deleted it first
  end = shared.tokenizer.token_to_id(END_OF_TEXT)
  stream = np.asarray([i for encoding in shared.tokenizer.encode_batch(list(texts))
                       for i in (*encoding.ids, end)], np.int32)
  encoded = io.BytesIO()
  np.save(encoded, stream)
  array = encoded.getvalue()
  # Runs started together (``--jobs``) encode the same stream; one file is kept, whole.
  tokenizer_lib.publish_once(path, array + hashlib.sha256(array).digest())
  return stream


def _read_tokens(path: pathlib.Path) -> np.ndarray:
  """A cached token stream: an ``.npy`` array followed by the 32-byte sha256 of the array's
  bytes (numpy's readers stop at the array's end, so ``np.load`` reads the file as it is).

  Raises:
    ValueError: the bytes are not those the checksum describes (damaged in place, cut short,
      or written before token streams carried a checksum), or not an ``.npy`` array.
  """
  data = path.read_bytes()
  array, checksum = data[:-32], data[-32:]
  if hashlib.sha256(array).digest() != checksum:
    raise ValueError("its bytes do not match the sha256 recorded at its end (damaged, cut "
                     "short, or cached before token streams carried one)")
  return np.load(io.BytesIO(array))


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
  """``int32[count, seq_len + 1]``: windows of ``stream`` starting every ``seq_len`` tokens."""
  count = (stream.size - 1) // seq_len
  if count < 1:
    raise ValueError(f"stdlib_lm: a split has {stream.size} tokens, too few for one window of "
                     f"seq_len={seq_len}")
  return np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len][:count].copy()


def token_byte_sizes(tokenizer) -> np.ndarray:
  """``int64[vocab]``: the UTF-8 bytes each token stands for (0 for the special token). A
  byte-level BPE token is spelled in printable symbols that each stand for one byte (GPT-2's
  ``bytes_to_unicode``, Radford et al. 2019), so its length is its size in bytes."""
  sizes = np.zeros(tokenizer.get_vocab_size(), np.int64)
  for token, index in tokenizer.get_vocab().items():
    sizes[index] = 0 if token == END_OF_TEXT else len(token)
  return sizes
