"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere."""
import os
import subprocess

import pytest

# Eight simulated devices on two cores: single-threaded Eigen keeps each device's work on its own
# thread, so a device cannot starve the others inside a collective (seen as rare hangs).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") +
    " --xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_collection_modifyitems(config, items):
  """Tests marked ``gpu`` are skipped unless JAX's default backend is a GPU."""
  del config
  if not any(item.get_closest_marker("gpu") for item in items):
    return
  import jax  # pylint: disable=import-outside-toplevel  # after the flags above
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU: JAX_PLATFORMS=cuda,cpu pytest -m gpu -n 0")
  for item in items:
    if item.get_closest_marker("gpu"):
      item.add_marker(skip)


@pytest.fixture(scope="module")
def fast_compiles():
  """A module's compiles with ``jax_disable_most_optimizations`` (``pytestmark =
  pytest.mark.usefixtures("fast_compiles")``): the programs and their collectives are the same,
  they compile in a fraction of the time. Tests of what optimisation does (fusion, memory
  traffic, the README's timed job) run without it, and so do those that match numpy to a
  float's last bits where XLA's rewrites round differently (``tests/test_quantized.py``: QSGD's
  scales differ by more than 1e-6 relative with optimisations off)."""
  import jax  # pylint: disable=import-outside-toplevel  # after the flags above
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory):
  """One tokenizer and token-stream cache folder for the whole run, shared by xdist's workers: the
  standard library's BPE is trained and its corpus encoded about once a run, not once a module
  (some 15 s each). Tests of the cache itself keep folders of their own."""
  root = tmp_path_factory.getbasetemp()
  folder = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "tokenizers"
  folder.mkdir(exist_ok=True)
  return str(folder)


@pytest.fixture
def small_disk(tmp_path):
  """A 120 KiB tmpfs: room for one tiny checkpoint and part of a second (needs root)."""
  folder = tmp_path / "disk"
  folder.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120k", "tmpfs", str(folder)],
                           capture_output=True, check=False)
  if mounted.returncode:
    pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
  yield folder
  subprocess.run(["umount", str(folder)], check=True)
