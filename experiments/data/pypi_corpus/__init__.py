"""A larger language-model corpus: the Python source of a pinned list of packages from PyPI.

The standard library gives ``stdlib_lm`` about 4M training tokens at a vocabulary of 8,192, which
a GPU-sized model sees four times in 1,000 steps of 16,384 tokens (and overfits). This corpus is
the ``.py`` files of :data:`ARCHIVES`, 15 large, mostly pure-Python, permissively licensed
packages (BSD, MIT, Apache-2.0), each pinned by name, version, file name and sha256: 25.3 MB of
wheels, 85.9 MB of source in 5,277 files, of which the training split (95%: 5,010 files, 80.7 MB)
is 22.9M tokens with the 8,192-token BPE of ``configs/lm_stdlib.py``'s ``base`` tier (0.284 a
byte). ``stdlib_lm`` reads it with ``config.data.corpus='pypi'`` (``configs/lm_stdlib.py``'s
``corpus=pypi``) through the same reader, split and tokenizer as the standard library
(:func:`experiments.data.stdlib.read_corpus`).

The cache folder (``config.data_dir`` of a run, ``--cache_dir`` of the command line; default
``$XDG_CACHE_HOME/tasc-jax/pypi_corpus``, ``~/.cache/...``) holds::

  archives/<file name>               the archives as PyPI serves them (wheels: zip; sdists: tar.gz)
  corpus-<key>/<name>-<version>/...  their .py files, extracted on first use

* :func:`fetch` downloads the archives that are missing (with pip, the ordinary client: no
  dependency, the pinned version and file) and refuses one whose sha256 is not the pinned one.
  Only this step needs the network: a machine without it gets the ``archives`` folder copied
  (25.3 MB), and a run there extracts it.
* :func:`extract` (what a run calls) needs no network: it checks every archive's sha256, writes
  each one's ``.py`` files outside test folders (the files that
  :func:`~experiments.data.stdlib.read_corpus` reads) under ``<name>-<version>/`` (a wheel's paths
  as they are, an sdist's without its top folder) into a temporary folder, and renames that to
  ``corpus-<key>`` (``key``: a hash of the pinned list), so that runs started together extract
  once and a reader never sees half a corpus. The files' paths and contents depend on the archives
  alone, not on the order of their members: the corpus's sha256 (:data:`CORPUS_SHA256`, what
  ``configs/lm_stdlib.py`` pins) is the same on every machine and Python. A member that is not a
  regular file is skipped; one whose path leaves its folder, or two members at one path, are
  refused.

  python -m experiments.data.pypi_corpus --cache_dir=/path/to/cache [--tokens=8192]

fetches, extracts and prints the corpus's size and sha256 (and, with ``--tokens``, its training
tokens at that vocabulary).
"""

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class Archive:
  """One pinned archive: ``pip download <name>==<version>`` gives ``filename``, whose sha256 is
  ``sha256`` (``size`` bytes); ``license`` as its metadata states it."""
  name: str
  version: str
  filename: str
  sha256: str
  size: int
  license: str

  @property
  def folder(self) -> str:
    """The folder of its files in the corpus."""
    return f"{self.name}-{self.version}"

  @property
  def is_wheel(self) -> bool:
    return self.filename.endswith(".whl")


# Every one a py3-none-any wheel. Measured (the command above with --tokens=8192): the training
# split is 22.9M tokens; the first list, with django, sphinx, twisted, mypy, networkx, dask,
# distributed and ibis-framework too, gave 31.2M from 50.5 MB of wheels.
ARCHIVES = (
    Archive("celery", "5.7.0", "celery-5.7.0-py3-none-any.whl",
            "18310a9c919f9029e4735367484d93e6a25cdfd30afdc474622cc263d9b35f6e", 519594,
            "BSD-3-Clause"),
    Archive("cirq-core", "1.7.0", "cirq_core-1.7.0-py3-none-any.whl",
            "9d2e9610b06e2b2b2195184f44c0df4e94f31485831f8e1c6a96c858b7897bce", 2116400,
            "Apache-2.0"),
    Archive("dagster", "1.13.29", "dagster-1.13.29-py3-none-any.whl",
            "65f7bf2f52c0c1219cb1ca63a1f0f95a1af83d12e94ebec7598e47ee49889859", 2042111,
            "Apache-2.0"),
    Archive("ipython", "9.18.1", "ipython-9.18.1-py3-none-any.whl",
            "997ce9140d374531a61069c70c0f9ef299d6dd3559ea0f94b8af589726e3c1d5", 649819,
            "BSD-3-Clause"),
    Archive("jax", "0.12.0.1", "jax-0.12.0.1-py3-none-any.whl",
            "e9dfd256ba090259b10f97f0755d4fc92535b8cb38c0a40df6488a8c8a7dd8ae", 3466959,
            "Apache-2.0"),
    Archive("mpmath", "1.4.1", "mpmath-1.4.1-py3-none-any.whl",
            "dc4f0ea2304480d4a9a48a94c1020571558ade522b44a6912efac63a586e140f", 567787,
            "BSD-3-Clause"),
    Archive("nltk", "3.10.4", "nltk-3.10.4-py3-none-any.whl",
            "769ba5413f265b7d3e87cd163cc28efa01e29eeef8bb6080bc907949d9fcfb51", 1722994,
            "Apache-2.0"),
    Archive("pydantic", "2.14.4", "pydantic-2.14.4-py3-none-any.whl",
            "653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc", 494865, "MIT"),
    Archive("pygments", "2.21.0", "pygments-2.21.0-py3-none-any.whl",
            "2363c69b61c4a97c838da3b130dcd6468f4848992b21a82f2a63ec34377137d9", 1250147,
            "BSD-2-Clause"),
    Archive("sqlalchemy", "2.1.9", "sqlalchemy-2.1.9-py3-none-any.whl",
            "449fed5c2caa3b278cc57499d09db001fb3f28dc7f18affc48142aee4dcc0cdf", 2071860, "MIT"),
    Archive("sqlfluff", "4.5.0", "sqlfluff-4.5.0-py3-none-any.whl",
            "471a9abcad8061e36b69f711a6d89393241e30f9d1e0869f79965c0ae2c889c7", 1152828, "MIT"),
    Archive("sqlglot", "30.30.0", "sqlglot-30.30.0-py3-none-any.whl",
            "06c4c212a7868c7dcff0fd0fda348dd3c5cbad40137b3083a70ecdfe22921cf9", 807597, "MIT"),
    Archive("sympy", "1.14.0", "sympy-1.14.0-py3-none-any.whl",
            "e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5", 6299353,
            "BSD-3-Clause"),
    Archive("textual", "8.2.8", "textual-8.2.8-py3-none-any.whl",
            "267375fd402dc8d981457212efa71f0e3365fd17bba144ba9bb3ed7563cb374a", 731418, "MIT"),
    Archive("xarray", "2026.9.0", "xarray-2026.9.0-py3-none-any.whl",
            "fe349fa871628b1a0a5217af3fe1283a2862d5485156e6eda354fffb81c3bb7c", 1445445,
            "Apache-2.0"),
)
# stdlib.read_corpus(extract(cache)).sha256 of ARCHIVES: what configs/lm_stdlib.py pins.
CORPUS_SHA256 = "578345c5c63f58382bdfd097dc585a0945b7badf0ae8cf75924ff3deb1c80815"
ARCHIVES_FOLDER = "archives"
# The folders stdlib.read_corpus skips (tests/test_pypi_corpus.py checks that they agree); not
# extracted.
EXCLUDED_FOLDERS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
COMMAND = "python -m experiments.data.pypi_corpus"


def default_cache_dir() -> str:
  """``$XDG_CACHE_HOME/tasc-jax/pypi_corpus`` (``~/.cache/...`` when that is unset)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "tasc-jax", "pypi_corpus")


def archives_folder(cache_dir: str) -> str:
  """Where the archives lie: the folder to copy to a machine without the network."""
  return os.path.join(cache_dir, ARCHIVES_FOLDER)


def corpus_folder(cache_dir: str, archives: Sequence[Archive] | None = None) -> str:
  """Where :func:`extract` puts the source of ``archives``: named by a hash of the list."""
  archives = ARCHIVES if archives is None else archives
  digest = hashlib.sha256()
  for archive in archives:
    digest.update(f"{archive.folder}\0{archive.filename}\0{archive.sha256}\0".encode())
  return os.path.join(cache_dir, f"corpus-{digest.hexdigest()[:16]}")


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def check_archive(archive: Archive, path: str) -> None:
  """Raises ValueError, in one line naming the file and both hashes, unless the file at
  ``path`` has the pinned sha256."""
  found = file_sha256(path)
  if found != archive.sha256:
    raise ValueError(
        f"pypi_corpus: {path} has sha256 {found}, but {archive.filename} is pinned at sha256 "
        f"{archive.sha256}: refused (not the pinned file, or damaged); delete it, and {COMMAND} "
        "downloads it again")


def missing(cache_dir: str, archives: Sequence[Archive] | None = None) -> list[Archive]:
  """The archives not in the cache's archives folder (their sha256 unchecked)."""
  archives = ARCHIVES if archives is None else archives
  folder = archives_folder(cache_dir)
  return [a for a in archives if not os.path.isfile(os.path.join(folder, a.filename))]


def download(archive: Archive, dest: str) -> None:
  """Downloads ``archive`` into the folder ``dest`` with pip: the pinned version alone (no
  dependency); a wheel for any platform and Python (its files are only read), an sdist as
  published (pip prepares its metadata, which may fetch its build requirements).

  Raises:
    OSError: pip failed (no network, ...); the message is pip's last error line.
  """
  kind = (["--only-binary=:all:", "--platform=any", "--implementation=py", "--abi=none"]
          if archive.is_wheel else ["--no-binary=:all:"])
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "--ignore-requires-python",
             "--disable-pip-version-check", "--retries=1", "--timeout=30", *kind, "--dest",
             dest, f"{archive.name}=={archive.version}"]
  done = subprocess.run(command, capture_output=True, text=True, check=False)
  if done.returncode:
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")] or lines or ["no output"]
    unreachable = any("connection" in line.lower() for line in lines)
    raise OSError(f"pip download {archive.name}=={archive.version} failed (status "
                  f"{done.returncode}): {errors[-1]}"
                  + (" (pip could not connect to the package index)" if unreachable else ""))


def fetch(cache_dir: str, archives: Sequence[Archive] | None = None) -> list[str]:
  """Downloads the archives missing from ``cache_dir`` and checks every archive's sha256.

  Returns:
    The archives' paths, in the order of ``archives``.

  Raises:
    ValueError: an archive (downloaded, or found in the cache) is not the pinned file.
    OSError: a download failed (no network): one line naming the archives still missing and the
      command that fetches them on a machine that reaches PyPI.
  """
  archives = ARCHIVES if archives is None else archives
  folder = archives_folder(cache_dir)
  os.makedirs(folder, exist_ok=True)
  for archive in missing(cache_dir, archives):
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as scratch:
      try:
        download(archive, scratch)
      except OSError as e:
        raise OSError(f"{e}; {_missing_message(cache_dir, missing(cache_dir, archives))}") from e
      got = os.path.join(scratch, archive.filename)
      if not os.path.isfile(got):
        raise ValueError(f"pypi_corpus: pip download {archive.name}=={archive.version} gave "
                         f"{sorted(os.listdir(scratch))}, not the pinned {archive.filename}")
      check_archive(archive, got)
      os.replace(got, os.path.join(folder, archive.filename))
  paths = [os.path.join(folder, a.filename) for a in archives]
  for archive, path in zip(archives, paths):
    check_archive(archive, path)
  return paths


def _missing_message(cache_dir: str, absent: Sequence[Archive]) -> str:
  names = ", ".join(a.filename for a in absent)
  return (f"{len(absent)} pinned archive(s) missing from {archives_folder(cache_dir)} ({names}): "
          f"on a machine that reaches PyPI run `{COMMAND} --cache_dir=DIR` and copy "
          f"DIR/{ARCHIVES_FOLDER} to {archives_folder(cache_dir)}")


def extract(cache_dir: str, archives: Sequence[Archive] | None = None) -> str:
  """The folder of the archives' ``.py`` files (see the module docstring), extracted on first
  use without the network.

  Raises:
    FileNotFoundError: archives are missing (one line naming them and the command to fetch them).
    ValueError: an archive is not the pinned file, or holds a path that leaves its folder or
      two members at one path.
  """
  archives = ARCHIVES if archives is None else archives
  target = corpus_folder(cache_dir, archives)
  if os.path.isdir(target):
    return target
  absent = missing(cache_dir, archives)
  if absent:
    raise FileNotFoundError(f"pypi_corpus: {_missing_message(cache_dir, absent)}")
  scratch = tempfile.mkdtemp(dir=cache_dir, prefix=f".{os.path.basename(target)}-")
  try:
    for archive in archives:
      path = os.path.join(archives_folder(cache_dir), archive.filename)
      check_archive(archive, path)
      write_sources(archive, path, os.path.join(scratch, archive.folder))
    try:
      os.rename(scratch, target)
    except OSError:
      if not os.path.isdir(target):  # not another process's extraction, finished first
        raise
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  return target


def write_sources(archive: Archive, path: str, dest: str) -> int:
  """Writes the ``.py`` files of the archive at ``path`` (outside :data:`EXCLUDED_FOLDERS`)
  under ``dest``; returns how many."""
  written = set()
  for name, data in sources(archive, path):
    if name in written:
      raise ValueError(f"pypi_corpus: {path} holds two members at {name!r}; refused (which one "
                       "would be read would depend on the archive's order)")
    written.add(name)
    out = pathlib.Path(dest, *name.split("/"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
  return len(written)


def sources(archive: Archive, path: str) -> Iterator[tuple[str, bytes]]:
  """``(relative path, bytes)`` of each ``.py`` file of the archive outside test folders (an
  sdist's paths without its top folder); members that are not regular files are skipped."""
  for name, read in _members(path):
    parts = name.removeprefix("./").split("/")
    if not parts[-1].endswith(".py") or set(parts[:-1]) & EXCLUDED_FOLDERS:
      continue
    if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
      raise ValueError(f"pypi_corpus: {path} holds a member at {name!r}, a path that leaves "
                       "its folder or is not plain; refused")
    if not archive.is_wheel:
      parts = parts[1:]
    if parts:
      yield "/".join(parts), read()


def _members(path: str):
  """``(name, read)`` of each regular file in the zip or tar archive at ``path``."""
  if zipfile.is_zipfile(path):
    with zipfile.ZipFile(path) as archive:
      for info in archive.infolist():
        if not info.is_dir():
          yield info.filename, lambda info=info: archive.read(info)
    return
  with tarfile.open(path, "r:*") as archive:
    for member in archive:
      if member.isreg():
        yield member.name, lambda member=member: archive.extractfile(member).read()
