"""The PyPI corpus (``experiments/data/pypi_corpus``): archives fetched once and checked by their
sha256, their ``.py`` files extracted offline and deterministically, read by ``stdlib_lm``. Offline:
a tiny wheel (zip) and sdist (tar.gz) made here stand for PyPI, served by a stand-in for pip."""

import io
import gzip
import hashlib
import os
import subprocess
import tarfile
import types
import zipfile

import ml_collections
import numpy as np
import pytest

from configs import lm_stdlib
from experiments import data
from experiments.data import pypi_corpus
from experiments.data import stdlib
from experiments.data.pypi_corpus import __main__ as command

SHARDS = data.ShardSpec(8, tuple(range(8)))
WORDS = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "(", ")", ":"]


def _module(i: int) -> bytes:
  rng = np.random.default_rng(i)
  return "\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(40)).encode()


def _wheel_members():
  """(path, bytes) of a wheel: a package with modules, a test folder and files that are not .py."""
  members = [(f"pkg/{'sub/' if i % 2 else ''}mod{i}.py", _module(i)) for i in range(30)]
  members += [("pkg/__init__.py", b"from pkg import mod0\n"), ("pkg/tests/test_mod.py", b"1/0\n"),
              ("pkg/sub/__pycache__/mod1.py", b"1/0\n"), ("pkg/data.json", b"{}"),
              ("pkg/stub.pyi", b"x: int\n"), ("pkg-1.0.dist-info/METADATA", b"Name: pkg\n")]
  return members


def _sdist_members():
  """(path, bytes) of an sdist: its files under one top folder, tests beside the package."""
  members = [(f"other-2.0/other/core{i}.py", _module(100 + i)) for i in range(20)]
  return members + [("other-2.0/setup.py", b"import setuptools\n"),
                    ("other-2.0/test/test_core.py", b"1/0\n"),
                    ("other-2.0/idle_test/x.py", b"1/0\n"), ("other-2.0/README.md", b"# other\n")]


# Archives are built with fixed timestamps: the same members give the same bytes, whatever the
# clock (a test rebuilds a pinned archive and must get its sha256 again).
_EPOCH = (1980, 1, 1, 0, 0, 0)


def _zip(members) -> bytes:
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
    for name, content in members:
      archive.writestr(zipfile.ZipInfo(name, date_time=_EPOCH), content,
                       compress_type=zipfile.ZIP_DEFLATED)
  return buffer.getvalue()


def _tar(members, *, links=True) -> bytes:
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w") as archive:
    folder = tarfile.TarInfo("other-2.0/other")
    folder.type = tarfile.DIRTYPE
    archive.addfile(folder)
    for name, content in members:
      info = tarfile.TarInfo(name)
      info.size = len(content)
      archive.addfile(info, io.BytesIO(content))
    if links:  # not regular files: skipped, never followed
      link = tarfile.TarInfo("other-2.0/other/link.py")
      link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
      archive.addfile(link)
  return gzip.compress(buffer.getvalue(), mtime=0)


def _pinned(name, version, filename, content):
  return pypi_corpus.Archive(name, version, filename, hashlib.sha256(content).hexdigest(),
                             len(content), "MIT")


def _index(order=1):
  """``(archives, served)``: the pinned list of a wheel and an sdist, and the bytes pip would
  download for each file name (``order=-1``: the same members in the reverse order)."""
  wheel, sdist = _zip(_wheel_members()[::order]), _tar(_sdist_members()[::order])
  archives = (_pinned("pkg", "1.0", "pkg-1.0-py3-none-any.whl", wheel),
              _pinned("other", "2.0", "other-2.0.tar.gz", sdist))
  return archives, {"pkg-1.0-py3-none-any.whl": wheel, "other-2.0.tar.gz": sdist}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
  """pip is never run: a test that reaches it without a stand-in fails."""
  def run(command, **kwargs):
    raise AssertionError(f"a test ran {command}")
  monkeypatch.setattr(pypi_corpus, "subprocess",
                      types.SimpleNamespace(run=run, CompletedProcess=subprocess.CompletedProcess))


@pytest.fixture
def index(monkeypatch):
  """The pinned list, with pip replaced by a stand-in that serves ``served`` and counts."""
  archives, served = _index()
  calls = []

  def download(archive, dest):
    calls.append(archive.filename)
    with open(os.path.join(dest, archive.filename), "wb") as f:
      f.write(served[archive.filename])

  monkeypatch.setattr(pypi_corpus, "download", download)
  return archives, served, calls


EXPECTED = sorted([f"pkg-1.0/pkg/{'sub/' if i % 2 else ''}mod{i}.py" for i in range(30)]
                  + ["pkg-1.0/pkg/__init__.py", "other-2.0/setup.py"]
                  + [f"other-2.0/other/core{i}.py" for i in range(20)])


def test_fetch_downloads_the_missing_archives_once_and_extract_gives_their_py_files(
    tmp_path, index):
  archives, served, calls = index
  paths = pypi_corpus.fetch(str(tmp_path), archives)
  assert calls == [a.filename for a in archives]
  assert [open(p, "rb").read() for p in paths] == [served[a.filename] for a in archives]
  assert pypi_corpus.fetch(str(tmp_path), archives) == paths and len(calls) == 2  # cached
  assert sorted(os.listdir(tmp_path / "archives")) == sorted(served)  # no download folder left
  folder = pypi_corpus.extract(str(tmp_path), archives)
  assert folder == pypi_corpus.corpus_folder(str(tmp_path), archives)
  corpus = stdlib.read_corpus(folder)
  # .py files alone, outside test and __pycache__ folders, as stdlib.read_corpus reads them; the
  # sdist's top folder and its links left out.
  assert list(corpus.paths) == EXPECTED
  assert sorted(os.path.relpath(os.path.join(d, n), folder).replace(os.sep, "/")
                for d, _, names in os.walk(folder) for n in names) == EXPECTED
  assert corpus.texts[corpus.paths.index("other-2.0/other/core3.py")] == _module(103).decode()
  assert pypi_corpus.EXCLUDED_FOLDERS == stdlib.EXCLUDED_FOLDERS
  assert sorted(os.listdir(tmp_path)) == ["archives", os.path.basename(folder)]  # no scratch


def test_a_sha256_mismatch_is_refused_in_one_line_naming_the_file_and_both_hashes(
    tmp_path, index):
  archives, served, _ = index
  pinned = archives[0]
  served[pinned.filename] = b"not the pinned wheel"
  found = hashlib.sha256(b"not the pinned wheel").hexdigest()
  with pytest.raises(ValueError) as refused:
    pypi_corpus.fetch(str(tmp_path), archives)
  message = str(refused.value)
  assert "\n" not in message and pinned.filename in message
  assert found in message and pinned.sha256 in message
  assert not os.path.exists(tmp_path / "archives" / pinned.filename)  # not kept
  # An archive damaged in the cache: refused by fetch and by extract alike, nothing extracted.
  served[pinned.filename] = _index()[1][pinned.filename]
  pypi_corpus.fetch(str(tmp_path), archives)
  (tmp_path / "archives" / pinned.filename).write_bytes(b"damaged")
  for step in (pypi_corpus.fetch, pypi_corpus.extract):
    with pytest.raises(ValueError, match=rf"^pypi_corpus: .*{pinned.filename} has sha256 "
                                         rf"{hashlib.sha256(b'damaged').hexdigest()}, but .*"
                                         rf"pinned at sha256 {pinned.sha256}: refused"):
      step(str(tmp_path), archives)
  assert sorted(os.listdir(tmp_path)) == ["archives"]


def test_extraction_is_deterministic_whatever_the_order_of_the_members(tmp_path, monkeypatch):
  hashes = []
  for name, order in (("first", 1), ("again", 1), ("reversed", -1)):
    archives, served = _index(order)
    monkeypatch.setattr(pypi_corpus, "download",
                        lambda a, dest: open(os.path.join(dest, a.filename), "wb").write(
                            served[a.filename]))
    pypi_corpus.fetch(str(tmp_path / name), archives)
    hashes.append(stdlib.read_corpus(pypi_corpus.extract(str(tmp_path / name), archives)).sha256)
  assert _index(-1)[0] != _index(1)[0]  # other archives (their bytes differ)...
  assert hashes[0] == hashes[1] == hashes[2]  # ...the same corpus


@pytest.mark.parametrize("member", ["../evil.py", "pkg/../../evil.py", "/abs/evil.py"])
def test_a_member_that_leaves_its_folder_is_refused(tmp_path, member):
  archives = (_pinned("pkg", "1.0", "pkg-1.0-py3-none-any.whl", _zip([(member, b"x = 1\n")])),)
  os.makedirs(tmp_path / "archives")
  (tmp_path / "archives" / archives[0].filename).write_bytes(_zip([(member, b"x = 1\n")]))
  with pytest.raises(ValueError, match="a path that leaves its folder or is not plain; refused"):
    pypi_corpus.extract(str(tmp_path), archives)
  assert sorted(os.listdir(tmp_path)) == ["archives"]


def test_two_members_at_one_path_are_refused(tmp_path):
  content = _tar([("other-2.0/a.py", b"x = 1\n"), ("other-2.0/a.py", b"x = 2\n")], links=False)
  archives = (_pinned("other", "2.0", "other-2.0.tar.gz", content),)
  os.makedirs(tmp_path / "archives")
  (tmp_path / "archives" / "other-2.0.tar.gz").write_bytes(content)
  with pytest.raises(ValueError, match=r"holds two members at 'a.py'; refused"):
    pypi_corpus.extract(str(tmp_path), archives)


def test_without_the_network_fetch_and_extract_fail_in_one_line(tmp_path, monkeypatch):
  archives, _ = _index()

  def offline(command, **kwargs):
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
    return subprocess.CompletedProcess(command, 1, "", (
        "WARNING: Retrying after connection broken by 'NewConnectionError'\n"
        "ERROR: Could not find a version that satisfies the requirement pkg==1.0\n"
        "ERROR: No matching distribution found for pkg==1.0\n"))

  monkeypatch.setattr(pypi_corpus.subprocess, "run", offline)  # pip without the network
  with pytest.raises(OSError) as failed:
    pypi_corpus.fetch(str(tmp_path), archives)
  message = str(failed.value)
  assert "\n" not in message
  assert message.startswith("pip download pkg==1.0 failed (status 1): ERROR: No matching "
                            "distribution found for pkg==1.0 (pip could not connect to the "
                            "package index); 2 pinned archive(s) missing from ")
  assert ("(pkg-1.0-py3-none-any.whl, other-2.0.tar.gz): on a machine that reaches PyPI run "
          "`python -m experiments.data.pypi_corpus --cache_dir=DIR` and copy DIR/archives to "
          in message)
  with pytest.raises(FileNotFoundError, match=r"^pypi_corpus: 2 pinned archive\(s\) missing"):
    pypi_corpus.extract(str(tmp_path), archives)
  # The command line: one line, exit status 1, no traceback.
  monkeypatch.setattr(pypi_corpus, "ARCHIVES", archives)
  monkeypatch.delenv("TASC_JAX_VERBOSE", raising=False)
  with pytest.raises(SystemExit) as exited:
    command.main([f"--cache_dir={tmp_path}"])
  line = str(exited.value.code)
  assert "\n" not in line and line.startswith(
      "experiments.data.pypi_corpus: pip download pkg==1.0 failed (status 1): ERROR: ")


def test_the_command_line_prints_the_corpus_and_its_tokens(tmp_path, index, monkeypatch,
                                                           capsys):
  archives, _, _ = index
  monkeypatch.setattr(pypi_corpus, "ARCHIVES", archives)
  command.main([f"--cache_dir={tmp_path}", "--tokens=300", "--eval_fraction=0.3",
                f"--tokenizer_cache={tmp_path / 'tokenizers'}"])
  printed = capsys.readouterr().out
  corpus = stdlib.read_corpus(pypi_corpus.corpus_folder(str(tmp_path), archives))
  assert f"corpus sha256: {corpus.sha256} (NOT the pinned " in printed
  assert f"{len(EXPECTED)} files" in printed and "training tokens (BPE of 300, " in printed


def _config(cache, **options):
  options = {"seq_len": 16, "vocab_size": 300, "eval_sequences": 16, "eval_fraction": 0.3,
             "corpus": "pypi", "cache_dir": str(cache / "tokenizers"), **options}
  return ml_collections.ConfigDict(dict(dataset="stdlib_lm", data_dir=str(cache), data=options,
                                        batch_size=16, eval_batch_size=16, seed=0))


def test_stdlib_lm_reads_the_pypi_corpus_from_its_cache_offline(tmp_path, index, monkeypatch):
  archives, _, calls = index
  pypi_corpus.fetch(str(tmp_path), archives)
  monkeypatch.setattr(pypi_corpus, "ARCHIVES", archives)
  dataset = data.load(_config(tmp_path), SHARDS)  # extracts on first use
  corpus = stdlib.read_corpus(pypi_corpus.corpus_folder(str(tmp_path), archives))
  assert dataset.info["corpus_sha256"] == corpus.sha256 and dataset.info["corpus_files"] == len(
      EXPECTED)
  assert dataset.num_train > 0 and len(calls) == 2  # nothing downloaded by the run
  with pytest.raises(ValueError, match=r"config.data.corpus_sha256='0000.*: the pinned packages' "
                                       r"source was changed .* Delete .*corpus-"):
    data.load(_config(tmp_path, corpus_sha256="0" * 64), SHARDS)
  with pytest.raises(ValueError, match=r"config.data.corpus='pip'; allowed: stdlib, pypi"):
    data.load(_config(tmp_path, corpus="pip"), SHARDS)
  with pytest.raises(FileNotFoundError, match=r"pypi_corpus: 2 pinned archive\(s\) missing"):
    data.load(_config(tmp_path / "elsewhere"), SHARDS)


def test_the_config_asks_for_the_pypi_corpus_and_pins_its_hash():
  config = lm_stdlib.get_config("base,corpus=pypi,corpus_dir=/cache/pypi")
  assert config.data.corpus == "pypi" and config.data_dir == "/cache/pypi"
  assert config.data.corpus_sha256 == pypi_corpus.CORPUS_SHA256 != ""
  assert config.data.python_version == ""  # the packages' source is the same on every Python
  plain = lm_stdlib.get_config("base")
  assert "corpus" not in plain.data and plain.data_dir == ""  # the standard library, as before
  with pytest.raises(ValueError, match=r"corpus='pip'.*allowed: .*pypi"):
    lm_stdlib.get_config("base,corpus=pip")
