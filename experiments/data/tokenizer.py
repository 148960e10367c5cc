"""One tokenizer for every process of a run: trained once, shared through a cache folder, checked.

The trainers of the ``tokenizers`` package are not deterministic: four trainings of BERT's
WordPiece vocabulary on the same text gave four different orderings of its 4,320 tokens (some a
different set), single-threaded too, because ties between equally frequent merges are broken in
hash-map order. Processes that each trained their own would map the same text to different ids.
So a tokenizer is trained once per (kind, settings, text) and stored in a cache folder under a
name that hashes those three (``<kind>-<key>.json``). The file is written under a temporary name
and hard-linked into place, which fails if the name exists: when processes race, the first to
finish wins and every process, the losers included, loads that one file. Each process then
hashes the file it loaded (sha256 of its JSON, recorded with the results) and, in a
multi-process run, checks that every process loaded the same one: processes on hosts that share
no cache folder stop with an error that says so, rather than train on different ids.

Beside each file, ``<kind>-<key>.json.sha256`` holds its sha256, written by the first process to
load it (from the bytes published, so racing processes write the same). A file that no longer
matches it (damaged in place, cut short) is named, deleted and trained again; a file without one
(cached before tokenizers carried checksums) is loaded as it is, and gets one.

The cache folder is ``config.data.cache_dir`` (the reproduction puts it in its work dir), or
``$XDG_CACHE_HOME/tasc-jax/tokenizers`` (``~/.cache/...``) when that is empty.
"""

import hashlib
import json
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import tokenizers


class Shared(NamedTuple):
  """A tokenizer every process of the run holds identically.

  Attributes:
    tokenizer: the ``tokenizers.Tokenizer``.
    sha256: hex digest of its serialised JSON, the same on every process.
    path: the cache file it was loaded from.
  """
  tokenizer: tokenizers.Tokenizer
  sha256: str
  path: str


def cache_dir(configured: str | None) -> pathlib.Path:
  """The cache folder: ``configured``, or ``$XDG_CACHE_HOME/tasc-jax/tokenizers``."""
  if configured:
    return pathlib.Path(configured)
  root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
  return root / "tasc-jax" / "tokenizers"


def text_sha256(documents: Iterable[str]) -> str:
  """sha256 of ``documents`` in order (each one's length in bytes, then its UTF-8 bytes)."""
  digest = hashlib.sha256()
  for document in documents:
    data = document.encode("utf-8", "surrogatepass")
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)
  return digest.hexdigest()


def shared(kind: str, settings: Mapping[str, Any], text_hash: str,
           train: Callable[[], tokenizers.Tokenizer], folder: str | None,
           expected_sha256: str = "") -> Shared:
  """The tokenizer ``kind`` with ``settings`` for the text hashing to ``text_hash``: loaded from
  the cache folder, or trained by ``train()`` and stored there first (see the module docstring).

  Args:
    kind: a name for the file (``"wordpiece"``, ``"bytelevel_bpe"``).
    settings: everything besides the text that decides the tokenizer (vocabulary size, ...).
    text_hash: :func:`text_sha256` (or any digest) of the training text.
    train: trains the tokenizer when the cache has none.
    folder: ``config.data.cache_dir`` ('' or None: the default, see :func:`cache_dir`).
    expected_sha256: the sha256 the tokenizer must have (``config.data.tokenizer_sha256``, as a
      results file records it), so that a rerun tokenizes as the run it repeats did; '' accepts
      the one found.

  Returns:
    A :class:`Shared`, identical on every process of the run.

  Raises:
    ValueError: the cached file cannot be read as a tokenizer (it names the file to delete), or
      its sha256 is not ``expected_sha256``. (A file that fails its checksum is trained again.)
    RuntimeError: in a multi-process run, processes loaded different tokenizers.
  """
  key = hashlib.sha256(json.dumps(
      {"kind": kind, "settings": dict(settings), "text": text_hash,
       "tokenizers": tokenizers.__version__}, sort_keys=True).encode()).hexdigest()[:24]
  directory = cache_dir(folder)
  path = directory / f"{kind}-{key}.json"
  checksum = path.with_name(path.name + ".sha256")
  data = _cached(path, checksum)
  if data is None:
    directory.mkdir(parents=True, exist_ok=True)
    publish_once(path, train().to_str().encode("utf-8"))
    data = path.read_bytes()
  try:
    tokenizer = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
  except Exception as e:  # pylint: disable=broad-except  # the library raises bare Exceptions
    raise ValueError(f"tokenizer: the cached file {path} cannot be read as a tokenizer "
                     f"({type(e).__name__}: {e}); delete it and it is trained again") from None
  digest = hashlib.sha256(data).hexdigest()
  if not checksum.exists():
    publish_once(checksum, digest.encode())
  if expected_sha256 and digest != expected_sha256:
    # Another training of the same text gives other ids (see the module docstring): a run that
    # pins its tokenizer must not silently get another one.
    raise ValueError(
        f"config.data.tokenizer_sha256={expected_sha256!r}, but the cached {kind} tokenizer "
        f"{path} has sha256 {digest!r}: token ids would differ from the run that recorded it. "
        "Put that run's tokenizer file in config.data.cache_dir, or set "
        "--config.data.tokenizer_sha256='' to accept this one")
  check_same_on_every_process(digest, f"the {kind} tokenizer ({path})")
  return Shared(tokenizer, digest, str(path))


def _cached(path: pathlib.Path, checksum: pathlib.Path) -> bytes | None:
  """The bytes of the cached tokenizer ``path``, or None when there is none, or when it does not
  match its ``checksum`` file (then both are deleted, with a notice, to be trained again)."""
  if not path.exists():
    return None
  data = path.read_bytes()
  try:
    recorded = checksum.read_text().strip()
  except FileNotFoundError:
    return data  # cached before tokenizers carried checksums
  if hashlib.sha256(data).hexdigest() == recorded:
    return data
  logging.warning("tokenizer: the cached file %s does not match the sha256 recorded in %s "
                  "(damaged after it was written); training it again", path, checksum)
  path.unlink(missing_ok=True)  # another process may have deleted them first
  checksum.unlink(missing_ok=True)
  return None


def publish_once(path: pathlib.Path, data: bytes) -> None:
  """Writes ``data`` to ``path`` unless a file is there already, atomically: a reader sees the
  whole file or none, and of writers racing for ``path`` exactly one wins (the others' data is
  dropped)."""
  with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
    f.write(data)
    temporary = f.name
  os.chmod(temporary, 0o644)  # readable by every user of a shared cache, as a plain file is
  try:
    os.link(temporary, path)
  except FileExistsError:
    pass
  finally:
    os.unlink(temporary)


def check_same_on_every_process(digest: str, what: str) -> None:
  """In a multi-process run, raises unless every process passes the same hex ``digest``."""
  if jax.process_count() == 1:
    return
  try:
    multihost_utils.assert_equal(np.frombuffer(bytes.fromhex(digest), np.uint8))
  except AssertionError:
    raise RuntimeError(
        f"process {jax.process_index()} of {jax.process_count()} loaded {what} with sha256 "
        f"{digest}, and another process loaded a different one; the processes must share "
        "config.data.cache_dir (one folder every host can read and write), so that the "
        "tokenizer is trained once and every process uses that one") from None
