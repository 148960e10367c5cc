"""The language-modelling workload: the standard-library corpus, its split, the tokenizer trained
once and shared (also BERT's), bits per byte, and a smoke run of ``configs/lm_stdlib.py``."""

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import ml_collections
import numpy as np
import pytest
from tokenizers import ByteLevelBPETokenizer

from configs import lm_stdlib
from experiments import data
from experiments import train
from experiments.data import stdlib
from experiments.data import text
from tests import test_method_families

pytestmark = pytest.mark.usefixtures("fast_compiles")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARDS = data.ShardSpec(8, tuple(range(8)))


def _config(data_dir="", **options):
  options = {"seq_len": 16, "vocab_size": 300, "eval_sequences": 16, **options}
  return ml_collections.ConfigDict(dict(dataset="stdlib_lm", data_dir=str(data_dir),
                                        data=options, batch_size=16, eval_batch_size=16, seed=0))


def _fake_stdlib(folder, files=40):
  """A folder laid out like a standard library: modules, a package, and test folders."""
  rng = np.random.default_rng(0)
  words = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "(", ")", ":"]
  for i in range(files):
    path = folder / ("pkg" if i % 3 else "") / f"mod{i}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(60)))
  for excluded in ("test", "pkg/tests", "idlelib/idle_test", "site-packages/x"):
    (folder / excluded).mkdir(parents=True, exist_ok=True)
    (folder / excluded / "test_it.py").write_text("assert False\n")
  return folder


def test_the_corpus_is_the_stdlib_source_outside_test_folders(tmp_path):
  corpus = stdlib.read_corpus(str(_fake_stdlib(tmp_path)))
  assert len(corpus.paths) == 40 and not any("test" in p for p in corpus.paths)
  assert corpus.paths == tuple(sorted(corpus.paths)) and "pkg/mod1.py" in corpus.paths
  real = stdlib.read_corpus()
  assert real.root == sysconfig.get_paths()["stdlib"] and len(real.paths) > 300
  assert not any(set(p.split("/")) & stdlib.EXCLUDED_FOLDERS for p in real.paths)
  assert "os.py" in real.paths and "json/decoder.py" in real.paths


def test_the_split_is_by_a_hash_of_the_path_alone(tmp_path):
  corpus = stdlib.read_corpus()
  held_out = {p for p in corpus.paths if stdlib.is_validation(p, 0.05)}
  assert 0.02 < len(held_out) / len(corpus.paths) < 0.09
  assert held_out == {p for p in corpus.paths if int.from_bytes(
      hashlib.sha256(p.encode()).digest()[:8], "big") < 0.05 * 2**64}
  train_texts, eval_texts = corpus.split(0.05)
  assert (len(train_texts), len(eval_texts)) == (len(corpus.paths) - len(held_out), len(held_out))
  # A file's side does not depend on what else the folder holds.
  small = stdlib.read_corpus(str(_fake_stdlib(tmp_path / "small", files=40)))
  large = stdlib.read_corpus(str(_fake_stdlib(tmp_path / "large", files=80)))
  split = lambda c: {p for p in c.paths if stdlib.is_validation(p, 0.3)}
  assert split(small) == split(large) & set(small.paths) and split(small)


def test_a_missing_stdlib_folder_is_a_clear_error(tmp_path, monkeypatch):
  missing = str(tmp_path / "lib" / "python3.11")
  with pytest.raises(FileNotFoundError, match=r"the standard-library folder .*python3.11.* "
                                              r"\(config.data_dir\) does not exist"):
    data.load(_config(missing), SHARDS)
  monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": missing})
  stdlib.read_corpus.cache_clear()
  try:
    with pytest.raises(FileNotFoundError, match=r'sysconfig.get_paths\(\)\["stdlib"\], this '
                                                r"Python's standard library\) does not exist"):
      data.load(_config(), SHARDS)
  finally:
    stdlib.read_corpus.cache_clear()
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no .py file outside test folders"):
    data.load(_config(tmp_path / "empty"), SHARDS)


def test_the_tokenizer_is_trained_once_and_cached(tmp_path, monkeypatch):
  folder, cache = _fake_stdlib(tmp_path / "lib"), str(tmp_path / "cache")
  first = data.load(_config(folder, cache_dir=cache), SHARDS)

  def never(*args, **kwargs):
    raise AssertionError("trained again")

  monkeypatch.setattr(ByteLevelBPETokenizer, "train_from_iterator", never)
  second = data.load(_config(folder, cache_dir=cache), SHARDS)
  assert first.info == second.info and len(first.info["tokenizer_sha256"]) == 64
  assert sorted(f.split("-")[0] for f in os.listdir(cache)) == [
      "bytelevel_bpe", "bytelevel_bpe", "tokens", "tokens"]  # the tokenizer and its checksum
  for a, b in ((first.train_batch(3), second.train_batch(3)),
               (next(first.eval_batches()), next(second.eval_batches()))):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
  # Another vocabulary is another tokenizer (and would be trained).
  monkeypatch.undo()
  third = data.load(_config(folder, cache_dir=cache, vocab_size=280), SHARDS)
  assert third.info["tokenizer_sha256"] != first.info["tokenizer_sha256"]


def test_a_run_that_loses_the_race_to_cache_the_tokens_keeps_the_winners_file(tmp_path,
                                                                             tokenizer_cache):
  """Runs started together (``--jobs=2``) all miss the token cache and all write it: each must
  get its stream, one whole file must stay, and no temporary file may be left behind."""
  texts = ["def f(x):\n    return x\n"] * 20
  shared = stdlib.build_tokenizer(texts, 300, tokenizer_cache)
  folder = tmp_path / "tokens"
  folder.mkdir()
  first = stdlib.token_stream(shared, texts, folder)
  (cached,) = os.listdir(folder)
  winner = os.stat(folder / cached)
  # The second writer checked before the first had published, so it encodes and writes too.
  real_exists = type(folder).exists
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(type(folder), "exists",
                  lambda p: False if p.name == cached else real_exists(p))
    second = stdlib.token_stream(shared, texts, folder)
  np.testing.assert_array_equal(first, second)
  # The winner's file itself stays (a reader holding it open is never handed another).
  assert os.listdir(folder) == [cached] and os.stat(folder / cached).st_ino == winner.st_ino
  np.testing.assert_array_equal(np.load(folder / cached), first)


def test_windows_overlap_by_one_and_bits_per_byte_count_the_source_bytes(tmp_path,
                                                                          tokenizer_cache):
  dataset = data.load(_config(_fake_stdlib(tmp_path), cache_dir=tokenizer_cache), SHARDS)
  assert dataset.task == "causal_lm"
  np.testing.assert_array_equal(stdlib.windows(np.arange(10), 3),
                                [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]])
  shared = stdlib.build_tokenizer(stdlib.read_corpus(str(tmp_path)).split(0.05)[0], 300,
                                  tokenizer_cache)
  assert shared.sha256 == dataset.info["tokenizer_sha256"]  # the one data.load cached
  # The vocabulary is what the merges could make of a tiny corpus: at most the size asked.
  assert dataset.model_fields == {"vocab_size": shared.tokenizer.get_vocab_size()}
  sizes = stdlib.token_byte_sizes(shared.tokenizer)
  for source in ("def f(x):\n    return x  # é, ü\n", "naïve = 'ß' * 3\n"):
    assert sizes[shared.tokenizer.encode(source).ids].sum() == len(source.encode("utf-8"))
  info = dataset.info
  derived = dataset.derive({"test_loss": 2.0, "test_accuracy": 0.5})
  assert derived["test_bits_per_byte"] == pytest.approx(
      2.0 * info["eval_tokens"] / (np.log(2) * info["eval_bytes"]))


def test_the_config_pins_the_python_and_the_corpus(tmp_path, tokenizer_cache):
  config = lm_stdlib.get_config("smoke")
  assert config.data.python_version == stdlib.read_corpus().python_version
  assert config.data.corpus_sha256 == ""  # the loader hashes the corpus; the config may pin it
  config.data.cache_dir = tokenizer_cache
  config.data.corpus_sha256 = "0" * 64
  with pytest.raises(ValueError, match=r"config.data.corpus_sha256='0000.*but the corpus read "
                                       r"from .* has corpus_sha256 '[0-9a-f]{64}'"):
    data.load(config, SHARDS)
  config.data.corpus_sha256 = ""  # accepts what is found
  config.data.python_version = "2.7.18"
  with pytest.raises(ValueError, match=r"config.data.python_version='2.7.18'"):
    data.load(config, SHARDS)
  with pytest.raises(ValueError, match="config.data.vocab_size=100 is too small; allowed: >= 258"):
    data.load(_config(vocab_size=100), SHARDS)


def test_the_smoke_config_trains_and_records_the_corpus(tmp_path, tokenizer_cache):
  config = lm_stdlib.get_config(f"smoke,cache={tokenizer_cache}")
  results, _ = train.train(config, str(tmp_path))
  assert results["step"] == 2 and np.isfinite(results["test_loss"])
  assert results["test_bits_per_byte"] > 0
  assert results["corpus_sha256"] == stdlib.read_corpus().sha256
  assert results["python_version"] == config.data.python_version
  with open(tmp_path / "results.json") as f:
    recorded = json.load(f)
  assert recorded["corpus_sha256"] == results["corpus_sha256"]
  assert recorded["tokenizer_sha256"] == results["tokenizer_sha256"]


@pytest.mark.slow  # a variant of the smoke config's run
def test_diloco_with_int8_pseudo_gradients_trains_the_language_model(tmp_path, tokenizer_cache):
  """INTELLECT-1's form: DiLoCo's pseudo-gradient in 8 bits, on the LM's smoke config."""
  config = lm_stdlib.get_config(f"smoke,cache={tokenizer_cache}")
  config.update_from_flattened_dict({"method": "diloco", "num_steps": 4,
                                     "compression.diloco.every": 2,
                                     "compression.diloco.carrier": "int8"})
  results, _ = train.train(config, str(tmp_path))
  assert np.isfinite(results["test_loss"]) and results["bytes_by_kind"]["local"] == 0
  assert 3.5 < results["compression_ratio"] / 2 < 4  # int8 (with scales) once every 2 steps


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "sparseloco", "streaming_diloco", "demo",
                                    "onebit_adam", "int4"])
def test_every_new_method_trains_the_language_model_smoke(method, tmp_path, tokenizer_cache):
  config = lm_stdlib.get_config(f"smoke,cache={tokenizer_cache}")
  config.update_from_flattened_dict({"method": method, "num_steps": 4,
                                     **test_method_families.SHORT.get(method, {})})
  results, _ = train.train(config, str(tmp_path))
  assert results["step"] == 4 and np.isfinite(results["test_loss"]) and not results["diverged"]


# ----------------------------------------------------------------------- one shared tokenizer

_TRAIN_WORDPIECE = """
import sys
from experiments.data import text
from pydoc_data import topics
documents = [topics.topics[k] for k in sorted(topics.topics)]
shared = text.build_tokenizer(documents, vocab_size=2000, cache_dir=sys.argv[1])
vocab = shared.tokenizer.get_vocab()
print(shared.sha256, hash(tuple(sorted(vocab, key=vocab.get))))
"""


def test_processes_racing_to_train_the_bert_tokenizer_all_get_the_same_vocabulary(tmp_path):
  """WordPiece training is not deterministic (its vocabulary's order changes from one training
  to the next); two processes started together on an empty cache still hold one vocabulary,
  the one the first to finish published, and a later process loads it."""
  def start():
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(_TRAIN_WORDPIECE),
                             str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONHASHSEED="0"))
  racing = [start(), start()]
  outputs = [p.communicate(timeout=300)[0] for p in racing]
  assert all(p.returncode == 0 for p in racing)
  later = start().communicate(timeout=300)[0]
  # One tokenizer file, and its checksum.
  assert outputs[0] == outputs[1] == later and len(os.listdir(tmp_path)) == 2


def test_two_builds_of_the_bert_tokenizer_give_identical_vocabularies(tmp_path):
  documents = [f"the gradient of worker {i} is compressed and summed" for i in range(200)]
  first, second = (text.build_tokenizer(documents, vocab_size=120, cache_dir=str(tmp_path))
                   for _ in range(2))
  assert first.sha256 == second.sha256
  assert first.tokenizer.get_vocab() == second.tokenizer.get_vocab()


def test_two_builds_of_the_bpe_give_identical_vocabularies_and_a_pinned_hash_is_checked(tmp_path):
  texts = stdlib.read_corpus(str(_fake_stdlib(tmp_path / "lib"))).split(0.05)[0]
  cache = str(tmp_path / "cache")
  first, second = (stdlib.build_tokenizer(texts, 300, cache) for _ in range(2))
  assert first.sha256 == second.sha256 and first.path == second.path
  assert first.tokenizer.get_vocab() == second.tokenizer.get_vocab()
  assert stdlib.build_tokenizer(texts, 300, cache, first.sha256).sha256 == first.sha256
  # A cached file that is not the pinned tokenizer (another training, an edit, each cached with
  # its checksum) is refused.
  with open(first.path, "a") as f:
    f.write(" ")
  with open(first.path, "rb") as f:
    edited = hashlib.sha256(f.read()).hexdigest()
  with open(first.path + ".sha256", "w") as f:
    f.write(edited)
  with pytest.raises(ValueError, match=r"config.data.tokenizer_sha256='[0-9a-f]{64}', but the "
                                       r"cached bytelevel_bpe tokenizer .*bytelevel_bpe-.*\.json "
                                       r"has sha256 '[0-9a-f]{64}'"):
    stdlib.build_tokenizer(texts, 300, cache, first.sha256)
