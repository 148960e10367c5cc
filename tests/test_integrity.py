"""Nothing lost, nothing silent: checkpoints carry checksums of their files, checked on restore;
a run resumes only on the data its checkpoints record; derived caches (token streams, tokenizers)
carry their own checksums; a data file that is not a regular file is refused; a full disk while
checkpointing is one line. (A checkpoint damaged in place during a run: tests/test_failures.py.)
"""

import errno
import gc
import json
import logging as std_logging
import os
import signal
import sys

import ml_collections
import numpy as np
import pytest

from configs import lm_stdlib
from experiments import checkpoint
from experiments import data
from experiments import train
from experiments import validation
from experiments.data import fake
from experiments.data import stdlib
from experiments.data import text
from tests.harness import cached_token_stream
from tests.test_stdlib_lm import _fake_stdlib

pytestmark = pytest.mark.usefixtures("fast_compiles")

SHARDS = data.ShardSpec(8, tuple(range(8)))
STATE = {"w": np.arange(64, dtype=np.float32), "b": np.zeros(3, np.float32)}


def _saved(workdir, steps, data_identity=None):
  saver = checkpoint.Checkpointer(str(workdir), keep=len(steps), data=data_identity)
  for step in steps:
    saver.save(step, STATE)
  return saver


def _data_config(dataset, folder):
  return ml_collections.ConfigDict(dict(dataset=dataset, data_dir=str(folder), data={},
                                        batch_size=8, eval_batch_size=8, seed=0))


def _flip_bytes_in_place(path, count=64):
  """Inverts ``count`` bytes in the middle of ``path``; its size stays the same."""
  content = bytearray(path.read_bytes())
  middle = (len(content) - count) // 2
  content[middle:middle + count] = bytes(b ^ 0xFF for b in content[middle:middle + count])
  path.write_bytes(bytes(content))


# ------------------------------------------------------------------------- checkpoint checksums

def test_every_checkpoint_file_has_its_sha256_recorded_and_checked(tmp_path):
  _saved(tmp_path, [1]).close()
  folder = tmp_path / "checkpoints" / "1"
  recorded = json.loads((folder / checkpoint.CHECKSUMS_FILE).read_text())["files"]
  files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
  assert set(recorded) == files - {checkpoint.CHECKSUMS_FILE} and len(recorded) > 3
  checkpoint.verify(str(folder))
  largest = max(recorded, key=lambda name: (folder / name).stat().st_size)
  _flip_bytes_in_place(folder / largest)
  with pytest.raises(checkpoint.ChecksumMismatch,
                     match=rf"^{largest} has sha256 [0-9a-f]{{16}}\.\.\., not the [0-9a-f]{{16}}"
                           r"\.\.\. that checksums.json records: damaged after it was written$"):
    checkpoint.verify(str(folder))
  with pytest.raises(ValueError, match=r"the checkpoint of step 1 under .* cannot be read "
                                       r"\(ChecksumMismatch: "):
    checkpoint.load_state(str(tmp_path))


def test_a_checkpoint_without_its_checksums_counts_as_cut_short(tmp_path, caplog):
  """Killed after orbax finalised step 2 and before its checksums were written: step 2 is moved
  aside as a cut-short checkpoint would be, and step 1 restored."""
  saver = _saved(tmp_path, [1, 2])
  (tmp_path / "checkpoints" / "2" / checkpoint.CHECKSUMS_FILE).unlink()
  step, state = saver.restore_latest(STATE)
  saver.close()
  assert step == 1 and np.array_equal(state["w"], STATE["w"])
  assert os.listdir(tmp_path / checkpoint.UNREADABLE_DIR) == ["2"]
  assert (f"checkpoint {tmp_path / 'checkpoints' / '2'} cannot be read (no checksums.json: cut "
          "short after its arrays were written); moved to") in caplog.text


def test_a_checkpoint_without_its_checksums_is_restored_unverified_when_it_is_the_only_one(
    tmp_path, caplog):
  """Killed between the arrays and the checksums of the first checkpoint (seen in CI's two-process
  kill test): the run resumes from it, with a notice, rather than lose it. A damaged one with it
  is still set aside."""
  _saved(tmp_path, [1, 2]).close()
  for step in (1, 2):
    (tmp_path / "checkpoints" / str(step) / checkpoint.CHECKSUMS_FILE).unlink()
  largest = max((tmp_path / "checkpoints" / "2").rglob("d/*"), key=lambda p: p.stat().st_size)
  with open(largest, "r+b") as f:
    f.truncate(10)
  saver = checkpoint.Checkpointer(str(tmp_path), keep=3)
  step, state = saver.restore_latest(STATE)
  saver.close()
  assert step == 1 and np.array_equal(state["w"], STATE["w"])
  assert os.listdir(tmp_path / checkpoint.UNREADABLE_DIR) == ["2"]
  assert (f"checkpoint {tmp_path / 'checkpoints' / '1'} has no checksums.json (stopped between "
          "writing its arrays and their checksums) and no checkpoint before it can be read; "
          "restoring it unverified") in caplog.text


def test_a_run_killed_before_the_checksums_still_has_the_checkpoint_before(tmp_path, monkeypatch):
  """With one checkpoint kept, the older one is removed only once the new one's checksums exist:
  a run killed in between (here, while hashing) resumes from the older one."""
  saver = checkpoint.Checkpointer(str(tmp_path), keep=1)
  saver.save(1, STATE)

  def killed(folder):
    raise KeyboardInterrupt(f"killed while hashing {folder}")
  monkeypatch.setattr(checkpoint, "_file_checksums", killed)
  with pytest.raises(KeyboardInterrupt):
    saver.save(2, STATE)
  saver.close()
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  saver = checkpoint.Checkpointer(str(tmp_path), keep=1)
  step, state = saver.restore_latest(STATE)
  saver.save(3, STATE)
  saver.close()
  assert step == 1 and np.array_equal(state["w"], STATE["w"])
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]


def test_checkpoints_older_than_checksums_are_restored_unverified_with_a_notice(tmp_path, caplog):
  """A workdir of a version that wrote no checksums resumes; its first checkpoint with checksums
  is where checksums become required."""
  _saved(tmp_path, [1, 2]).close()
  for step in (1, 2):
    (tmp_path / "checkpoints" / str(step) / checkpoint.CHECKSUMS_FILE).unlink()
  (tmp_path / checkpoint.CHECKSUMS_SINCE_FILE).unlink()
  saver = checkpoint.Checkpointer(str(tmp_path), keep=3)
  assert saver.restore_latest(STATE)[0] == 2
  assert (f"checkpoint {tmp_path / 'checkpoints' / '2'} was written before checkpoints carried "
          "checksums; restoring it unverified") in caplog.text
  saver.save(3, STATE)
  saver.close()
  assert json.loads((tmp_path / checkpoint.CHECKSUMS_SINCE_FILE).read_text()) == 3
  # Step 3 without checksums would be cut short; step 2 still predates them.
  (tmp_path / "checkpoints" / "3" / checkpoint.CHECKSUMS_FILE).unlink()
  saver = checkpoint.Checkpointer(str(tmp_path), keep=3)
  assert saver.restore_latest(STATE)[0] == 2
  saver.close()
  assert os.listdir(tmp_path / checkpoint.UNREADABLE_DIR) == ["3"]


def test_a_checkpoint_orbax_cannot_read_is_set_aside_without_its_noise(
    tmp_path, capfd, caplog, monkeypatch):
  """An unverified (older than checksums) checkpoint whose array files are cut short: orbax's
  failed reads leave "Event loop is closed" per array (a traceback each); only the notice
  shows."""
  state = {f"w{i}": np.arange(5000 + i, dtype=np.float32) for i in range(40)}  # many reads
  saver = checkpoint.Checkpointer(str(tmp_path), keep=2)
  for step in (1, 2):
    saver.save(step, state)
    (tmp_path / "checkpoints" / str(step) / checkpoint.CHECKSUMS_FILE).unlink()
  saver.close()
  (tmp_path / checkpoint.CHECKSUMS_SINCE_FILE).unlink()
  largest = max((tmp_path / "checkpoints" / "2").rglob("d/*"), key=lambda p: p.stat().st_size)
  with open(largest, "r+b") as f:
    f.truncate(10)
  unraisable = []  # what Python would print as "Exception ignored in ...", with a traceback
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  saver = checkpoint.Checkpointer(str(tmp_path), keep=2)
  assert saver.restore_latest(state)[0] == 1
  saver.close()
  gc.collect()
  assert not unraisable
  err = capfd.readouterr().err
  assert "Traceback" not in err and "Event loop is closed" not in err
  assert not [r for r in caplog.records if r.levelname == "ERROR"]
  assert f"checkpoint {tmp_path / 'checkpoints' / '2'} cannot be read (" in caplog.text


# ----------------------------------------------------------------------------- data identity

def test_a_resume_on_other_data_is_refused_before_compiling_naming_both_hashes(tmp_path):
  """Case 2 of issue 41: the language model's checkpoint, resumed with another data_dir (another
  corpus, so another tokenizer), would read token ids as other strings."""
  config = lm_stdlib.get_config(f"smoke,cache={tmp_path / 'cache'}")
  config.data_dir = str(_fake_stdlib(tmp_path / "first"))
  first = data.load(config, SHARDS).identity
  assert sorted(first) == ["corpus_sha256", "tokenizer_sha256"]
  workdir = tmp_path / "run"
  _saved(workdir, [2], first).close()
  with open(workdir / validation.CONFIG_FILE, "w") as f:
    json.dump(config.to_dict(), f)
  config.data_dir = str(_fake_stdlib(tmp_path / "second", files=41))
  second = data.load(config, SHARDS).identity

  def never(*args, **kwargs):
    raise AssertionError("compiled")

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train, "_data_parallel", never)
    with pytest.raises(ValueError) as refused:
      train.train_and_evaluate(config, str(workdir))
  message = str(refused.value)
  assert "\n" not in message and message.startswith(
      f"workdir={str(workdir)!r} holds a checkpoint (step 2) trained on other data (corpus_sha256"
      f": {first['corpus_sha256']!r} there, {second['corpus_sha256']!r} now; tokenizer_sha256: "
      f"{first['tokenizer_sha256']!r} there, {second['tokenizer_sha256']!r} now)")
  assert "--config.resume_on_other_data=True if the change is meant" in message
  assert "resume_on_other_data" in validation.RESUMABLE_CHANGES


def test_a_meant_change_of_data_is_logged_and_recorded_from_then_on(tmp_path, caplog):
  _saved(tmp_path, [1], {"corpus_sha256": "aaa", "tokenizer_sha256": "ttt"}).close()
  saver = checkpoint.Checkpointer(str(tmp_path), keep=2,
                                  data={"corpus_sha256": "bbb", "tokenizer_sha256": "ttt"})
  with pytest.raises(ValueError, match=r"\(corpus_sha256: 'aaa' there, 'bbb' now\)"):
    saver.check_data(changed_ok=False)
  saver.check_data(changed_ok=True)
  assert ("resuming on other data than the checkpoint of step 1 was trained on (corpus_sha256: "
          "'aaa' there, 'bbb' now), as config.resume_on_other_data=True allows") in caplog.text
  saver.save(2, STATE)
  saver.close()
  recorded = json.loads((tmp_path / "checkpoints" / "2" / checkpoint.CHECKSUMS_FILE).read_text())
  assert recorded["data"] == {"corpus_sha256": "bbb", "tokenizer_sha256": "ttt"}
  # The same data, and hashes only one side has, resume without a word.
  checkpoint.Checkpointer(str(tmp_path), keep=2, data={"corpus_sha256": "bbb", "new_sha256": "x"}
                          ).check_data(changed_ok=False)


@pytest.mark.parametrize("dataset", ["cifar10", "imagenet"])
def test_image_files_are_part_of_the_data_identity(dataset, tmp_path):
  """CIFAR's binaries by name, size and content; ImageNet's listing by names and sizes."""
  def identity(folder, seed):
    if dataset == "cifar10":
      fake.write_cifar(str(folder), num_train=40, num_test=16, seed=seed)
    else:
      fake.write_imagenet(str(folder), num_classes=2, train_per_class=8, val_per_class=8,
                          seed=seed, size=(48 + seed, 40))
    config = _data_config(dataset, folder)
    loaded = data.load(config, SHARDS)
    assert loaded.info["files_sha256"] == loaded.identity["files_sha256"]
    return loaded.identity

  assert identity(tmp_path / "a", 0) == identity(tmp_path / "b", 0)
  assert identity(tmp_path / "a", 0) != identity(tmp_path / "c", 1)


# ------------------------------------------------------------------------------ derived caches

def test_a_zero_filled_token_stream_is_named_and_encoded_again(tmp_path, caplog):
  """Case 4 of issue 41: the header and the size intact, every token 0."""
  texts, shared, stream, cached = cached_token_stream(tmp_path)
  whole = cached.read_bytes()
  np.testing.assert_array_equal(np.load(cached), stream)  # still an .npy file numpy reads
  header = len(whole) - 32 - stream.nbytes
  cached.write_bytes(whole[:header] + bytes(stream.nbytes) + whole[-32:])
  np.testing.assert_array_equal(stdlib.token_stream(shared, texts, tmp_path), stream)
  assert (f"the cached token stream {cached} cannot be read (ValueError: its bytes do not match "
          "the sha256 recorded at its end") in caplog.text
  assert cached.read_bytes() == whole


def test_a_cached_tokenizer_damaged_in_place_is_trained_again(tmp_path, caplog):
  texts = ["def f(x):\n  return x + 1\n", "class A:\n  pass\n"] * 20
  first = stdlib.build_tokenizer(texts, vocab_size=300, cache_dir=str(tmp_path))
  path = tmp_path / os.path.basename(first.path)
  checksum = path.with_name(path.name + ".sha256")
  assert checksum.read_text() == first.sha256
  whole = path.read_bytes()
  # Two tokens' ids swapped: still a tokenizer, that maps text to other ids.
  damaged = json.loads(whole)
  vocab = damaged["model"]["vocab"]
  vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
  path.write_text(json.dumps(damaged))
  again = stdlib.build_tokenizer(texts, vocab_size=300, cache_dir=str(tmp_path))
  assert again.sha256 == first.sha256 and path.read_bytes() == whole
  assert (f"tokenizer: the cached file {path} does not match the sha256 recorded in {checksum} "
          "(damaged after it was written); training it again") in caplog.text
  # A file cached before tokenizers carried checksums is loaded, and gets one.
  checksum.unlink()
  assert stdlib.build_tokenizer(texts, vocab_size=300, cache_dir=str(tmp_path)).sha256 == (
      first.sha256)
  assert checksum.read_text() == first.sha256


# ------------------------------------------------------------------------ non-regular data files

@pytest.fixture
def no_hang():
  """Fails a test that blocks for 20 s (opening a FIFO waits for a writer) instead of hanging."""
  def stop(signum, frame):
    raise TimeoutError("blocked: the FIFO was opened")
  previous = signal.signal(signal.SIGALRM, stop)
  signal.alarm(20)
  yield
  signal.alarm(0)
  signal.signal(signal.SIGALRM, previous)


def test_a_fifo_in_a_language_model_data_dir_is_refused_in_one_line(tmp_path, no_hang):
  folder = _fake_stdlib(tmp_path / "lib")
  os.mkfifo(folder / "pkg" / "pipe.py")
  stdlib.read_corpus.cache_clear()
  with pytest.raises(ValueError, match=rf"^stdlib_lm: {folder / 'pkg' / 'pipe.py'} \(under "
                                       r"config.data_dir\) is a FIFO \(named pipe\); every data "
                                       r"file must be a regular file: move it out of "
                                       r"config.data_dir$"):
    stdlib.read_corpus(str(folder))
  texts = fake.write_text(str(tmp_path / "text"))
  os.mkfifo(os.path.join(texts, "more.txt"))
  with pytest.raises(ValueError, match=r"^text: .*more.txt \(under config.data_dir\) is a FIFO"):
    text.text(_data_config("text", texts), SHARDS)


# ---------------------------------------------------------------------------------- full disk

def test_a_full_disk_while_checkpointing_is_one_line_naming_what_was_kept(
    small_disk, capfd, caplog):
  """Orbax's threads each log their error with a traceback, and its abandoned writes report
  "Event loop is closed" when collected: none of it shows; the step's partial files go."""
  state = {"w": np.zeros(12_000, np.float32)}  # 48 KB: the second checkpoint does not fit
  saver = checkpoint.Checkpointer(str(small_disk), keep=3)
  saver.save(1, state)
  with pytest.raises(checkpoint.DiskFull) as full:
    saver.save(2, state)
    saver.save(3, state)
  saver.close()
  step = full.value.strerror.split("checkpoint of step ")[1].split()[0]
  assert full.value.errno == errno.ENOSPC and str(full.value) == (
      f"{small_disk / 'checkpoints'}: the disk is full (no space left on device): the checkpoint "
      f"of step {step} (48,000 bytes of arrays) could not be written, and its partial files "
      f"were removed; kept: the "
      f"checkpoint{'s of steps 1, 2' if step == '3' else ' of step 1'}. Free space on that disk "
      "and run again with the same --workdir to resume")
  assert sorted(os.listdir(small_disk / "checkpoints")) == [str(s) for s in range(1, int(step))]
  assert "Traceback" not in capfd.readouterr().err
  assert not [r for r in caplog.records if r.levelname == "ERROR"]
  # What orbax's threads, or the operations it abandoned, report later of the same failure.
  late = [std_logging.LogRecord("absl", std_logging.ERROR, os.path.join("x", "orbax", "f.py"), 1,
                                "_SignalingThread.run() raised", None, None),
          std_logging.LogRecord("asyncio", std_logging.ERROR, "base_events.py", 1,
                                "_GatheringFuture exception was never retrieved", None, None)]
  absl_logger = std_logging.getLogger("absl")
  try:
    assert not absl_logger.filter(late[0])
    assert not std_logging.getLogger("asyncio").filter(late[1])
  finally:  # the run ends there; this test process goes on
    absl_logger.removeFilter(checkpoint._not_from_orbax)  # pylint: disable=protected-access
