"""What the runner does when things go wrong: a non-finite gradient on one device, replicas that
drift apart, a run killed at any moment (checkpoint writes included) and restarted, a checkpoint
that cannot be read, two runs on one workdir, a sweep's run that fails when it starts, a cached
token stream cut short, a process of a multi-process job that dies.

In-process runs compile with ``jax_disable_most_optimizations`` (the same programs, compiled
faster); subprocess runs set it through the environment. The subprocess tests (crashes, dead
processes) and the in-process runs of a minute or more are marked slow (CI runs them):
``python -m pytest -q -m slow tests/test_failures.py``.
"""

import csv
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import jax
from jax.sharding import NamedSharding
import numpy as np
import psutil
import pytest

from configs import cifar10_resnet20
from configs import digits
from experiments import checkpoint
from experiments import data
from experiments import interrupt
from experiments import launch
from experiments import lock
from experiments import logs
from experiments import train
from experiments import validation
from experiments.data import fake
from experiments.data import stdlib
from tests import harness
from tests.harness import cached_token_stream

pytestmark = pytest.mark.usefixtures("fast_compiles")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _leaves(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_bit_identical(actual, expected, skip=()):
  actual, expected = _leaves(actual), _leaves(expected)
  assert actual.keys() == expected.keys()
  differing = [k for k in actual if not any(s in k for s in skip)
               and (actual[k].dtype != expected[k].dtype
                    or actual[k].tobytes() != expected[k].tobytes())]
  assert not differing, f"leaves that differ: {differing}"


# ------------------------------------------------------------------------ non-finite gradients

POISONED_STEP, POISONED_DEVICE = 2, 3


def _poison_one_device(monkeypatch):
  """Makes one input of ``POISONED_DEVICE``'s batch NaN at step ``POISONED_STEP``."""
  load = data.load

  def poisoned_load(config, shards):
    dataset = load(config, shards)
    clean = dataset.train_batch

    def train_batch(step):
      batch = clean(step)
      if step == POISONED_STEP:
        batch = dict(batch, input=batch["input"].copy())
        batch["input"][POISONED_DEVICE, 0] = np.nan
      return batch

    dataset.train_batch = train_batch
    return dataset

  monkeypatch.setattr(data, "load", poisoned_load)


@pytest.mark.slow  # a minute or more of training and restarts: CI runs the slow failures
def test_a_nan_on_one_device_skips_the_step_on_every_device_and_training_goes_on(
    tmp_path, monkeypatch):
  """CIFAR ResNet (batch norm) with TASC: residuals, the curvature average (refreshed from the
  poisoned batch), momentum, batch statistics all stay as they were; replicas stay identical."""
  config = cifar10_resnet20.get_config("smoke,method=tasc")
  config.data_dir = fake.write_cifar(str(tmp_path / "cifar10"), num_train=40, num_test=16)
  config.num_steps = 4
  config.keep_checkpoints = 4
  config.compression.tasc.hessian_every = 2  # step 2 refreshes the curvature from the NaN batch
  _poison_one_device(monkeypatch)
  workdir = str(tmp_path / "run")
  results, state = train.train(config, workdir)

  records = [r for r in logs.read_metrics(workdir) if "loss" in r]
  assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1]
  assert results["skipped_steps"] == 1 and np.isfinite(results["test_loss"])
  before, skipped, after = (checkpoint.load_state(workdir, s) for s in (2, 3, 4))
  # Everything but the step and the skip counters is exactly as before the poisoned step: the
  # parameters, every device's residual, TASC's curvature average, the momentum, the keys, each
  # device's batch statistics.
  _assert_bit_identical(skipped, before, skip=("['step']", "['skipped']", "['last_skipped']"))
  assert int(skipped["step"]) == 3 and int(skipped["opt_state"]["skipped"]) == 1
  assert bool(skipped["opt_state"]["last_skipped"])
  # The next step trains again, from finite values.
  assert not bool(after["opt_state"]["last_skipped"])
  moved = [k for k, v in _leaves(after["params"]).items()
           if v.tobytes() != _leaves(skipped["params"])[k].tobytes()]
  assert moved and all(np.isfinite(v).all() for v in _leaves(after).values()
                       if np.issubdtype(v.dtype, np.floating))
  harness.assert_replicas_identical(state.params)


# --------------------------------------------------------------------------------- divergence

def test_divergence_names_every_reason():
  config = digits.get_config("smoke")
  assert config.max_skipped_fraction == 0.1
  assert train.divergence(config, 100, 10, {"train_loss": 0.5, "test_loss": 0.7}) is None
  assert train.divergence(config, 100, 0, {"train_loss": None, "test_loss": 0.7}) is None
  assert train.divergence(config, 100, 11, {"train_loss": float("nan"), "test_loss": 0.7}) == (
      "the final train loss is nan; 11 of its 100 steps were skipped for a non-finite gradient "
      "(more than config.max_skipped_fraction=0.1)")
  config.max_skipped_fraction = 0.0
  assert train.divergence(config, 100, 1, {"test_loss": float("inf")}) == (
      "the final test loss is inf; 1 of its 100 steps were skipped for a non-finite gradient "
      "(more than config.max_skipped_fraction=0.0)")


@pytest.mark.slow  # a minute or more of training and restarts: CI runs the slow failures
def test_a_diverged_run_exits_non_zero_naming_the_skipped_steps(tmp_path):
  """The quickstart's smoke run at learning rate 1e30: its second step's gradient is not finite
  and is skipped, which is half of its steps."""
  workdir = tmp_path / "run"
  completed = subprocess.run(
      [sys.executable, "-m", "experiments.run", "--config=configs/quickstart.py:smoke",
       "--config.optimizer.learning_rate=1e30", f"--workdir={workdir}"],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=_STARTUP_SECONDS)
  assert completed.returncode == 1, completed.stderr[-3000:]
  assert "after 2 steps, 1 skipped (non-finite gradient)" in completed.stdout
  reason = ("1 of its 2 steps were skipped for a non-finite gradient (more than "
            "config.max_skipped_fraction=0.1)")
  assert "experiments.run: the run diverged: " in completed.stderr and reason in completed.stderr
  with open(workdir / train.RESULTS_FILE) as f:
    results = json.load(f)
  assert results["diverged"] is True and reason in results["divergence"]
  assert results["skipped_steps"] == 1


# ------------------------------------------------------------------------------ replica drift

DRIFT_AFTER_STEP, DRIFT_DEVICE = 3, 5


def _flip_one_bit(x: jax.Array, device: int) -> jax.Array:
  """``x`` (replicated) with one bit flipped in ``device``'s copy only."""
  copies = []
  for i, shard in enumerate(x.addressable_shards):
    copy = np.array(shard.data)
    if i == device:
      copy.reshape(-1).view(np.uint32)[0] ^= 1
    copies.append(jax.device_put(copy, shard.device))
  assert isinstance(x.sharding, NamedSharding)
  return jax.make_array_from_single_device_arrays(x.shape, x.sharding, copies)


class _StepThen:
  """A training step followed by ``after(state)``, which returns the state to go on with."""

  def __init__(self, step, after):
    self._step, self._after = step, after
    self.lower = step.lower  # wire_bytes compiles the real step

  def __call__(self, state, batch, **kwargs):
    state, metrics = self._step(state, batch, **kwargs)
    return self._after(state), metrics


def _drift(state):
  """One device's parameters drift (a flipped bit) after step DRIFT_AFTER_STEP."""
  if int(state.step) == DRIFT_AFTER_STEP:
    leaves, treedef = jax.tree.flatten(state.params)
    leaves[0] = _flip_one_bit(leaves[0], DRIFT_DEVICE)
    state = state._replace(params=jax.tree.unflatten(treedef, leaves))
  return state


def _wrap_train_steps(monkeypatch, after):
  """Makes the runner's compiled train step run ``after(state)`` once it is done; returns the
  unwrapped builder."""
  build = train._data_parallel  # pylint: disable=protected-access

  def wrapped(*args, **kwargs):
    dp = build(*args, **kwargs)
    return dp._replace(train_step=_StepThen(dp.train_step, after))

  monkeypatch.setattr(train, "_data_parallel", wrapped)
  return build


def test_replica_drift_stops_the_run_at_the_step_it_is_found(tmp_path, monkeypatch):
  _wrap_train_steps(monkeypatch, _drift)
  config = digits.get_config("smoke")
  config.num_steps = 5
  assert config.check_replicas_every == 1
  with pytest.raises(train.ReplicaDriftError,
                     match=rf"replica drift detected at step {DRIFT_AFTER_STEP}: .*\['Conv_0'\]"
                           rf"\['bias'\] on devices \[{DRIFT_DEVICE}\] \(vs device 0\)"):
    train.train_and_evaluate(config, str(tmp_path))
  # The drifted state was not checkpointed.
  assert checkpoint.Checkpointer(str(tmp_path), keep=2).latest_step() == DRIFT_AFTER_STEP - 1


# ------------------------------------------------------------------------ resuming a workdir

def test_resuming_accepts_bookkeeping_changes_and_names_every_other_change(tmp_path):
  stored = digits.get_config("smoke")
  logs.write_json(str(tmp_path / validation.CONFIG_FILE), stored.to_dict())
  changed = digits.get_config("smoke")
  changed.update_from_flattened_dict({
      "log_every": 10, "checkpoint_every": 5, "keep_checkpoints": 9, "data_dir": "/elsewhere",
      "check_replicas_every": 0, "distributed.heartbeat_timeout_seconds": 60,
      "distributed.coordinator_address": "127.0.0.1:1234"})
  validation.check_resume(changed, str(tmp_path), checkpoint_step=2)
  validation.check_resume(digits.get_config("smoke,method=topk"), str(tmp_path), None)
  changed.update_from_flattened_dict({"seed": 1, "model.hidden": 16, "skip_nonfinite": False})
  with pytest.raises(ValueError, match=r"model.hidden: 8 there, 16 now; seed: 0 there, 1 now; "
                                       r"skip_nonfinite: True there, False now\)"):
    validation.check_resume(changed, str(tmp_path), checkpoint_step=2)


def test_a_workdir_older_than_a_config_field_resumes_with_that_field_at_its_default(tmp_path):
  """A checkpoint written before a field was added to the configs (its config.json lacks it)
  resumes while the field keeps its default, and not once it is changed."""
  stored = digits.get_config("smoke,method=topk").to_dict()
  del stored["compression"]["topk"]["selection"]
  logs.write_json(str(tmp_path / validation.CONFIG_FILE), stored)
  validation.check_resume(digits.get_config("smoke,method=topk"), str(tmp_path), 2)
  changed = digits.get_config("smoke,method=topk")
  changed.compression.topk.selection = "sampled"
  with pytest.raises(ValueError, match=r"compression.topk.selection: <absent> there, 'sampled' "
                                       r"now"):
    validation.check_resume(changed, str(tmp_path), checkpoint_step=2)


# --------------------------------------------------------------------------- damaged checkpoints

def _cut_short(path) -> None:
  with open(path, "r+b") as f:
    f.truncate(10)


def _three_checkpoints(tmp_path):
  """``(config, workdir, final state, training records)`` of a run that checkpointed steps 1 to
  3, for a resume after damage to compare with."""
  config = digits.get_config("smoke,method=topk")
  config.update_from_flattened_dict({"num_steps": 3, "checkpoint_every": 1,
                                     "keep_checkpoints": 3})
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config, workdir)
  return config, workdir, checkpoint.load_state(workdir), _training_records(workdir)


@pytest.mark.slow  # a minute or more of training and restarts: CI runs the slow failures
def test_an_unreadable_checkpoint_is_moved_aside_and_the_newest_readable_one_restored(tmp_path):
  """Step 3's metadata and a data file of step 2 cut short: the resume restores step 1, moves
  3 and 2 aside (kept), and ends bit-identical to the run before the damage, logs included."""
  config, workdir, uninterrupted, records = _three_checkpoints(tmp_path)
  folder = tmp_path / "run" / "checkpoints"
  _cut_short(folder / "3" / "default" / "_METADATA")
  for data_file in (folder / "2" / "default" / "d").iterdir():
    _cut_short(data_file)

  train.train_and_evaluate(config, workdir)
  aside = tmp_path / "run" / checkpoint.UNREADABLE_DIR
  assert sorted(p.name for p in aside.iterdir()) == ["2", "3"]
  assert sorted(p.name for p in folder.iterdir()) == ["1", "2", "3"]  # 2 and 3 written again
  _assert_bit_identical(checkpoint.load_state(workdir), uninterrupted)
  assert _training_records(workdir) == records


@pytest.mark.slow  # a minute or more of training and restarts: CI runs the slow failures
def test_a_checkpoint_damaged_in_place_is_moved_aside_and_the_resume_ends_bit_identical(
    tmp_path, caplog):
  """Case 1 of issue 41: 64 bytes flipped inside the newest checkpoint's largest file (same size,
  so orbax reads it and restores a state that differs in a leaf). Its checksums catch it: it is
  moved aside with a notice naming its folder, and the run ends as the undamaged one did."""
  config, workdir, uninterrupted, records = _three_checkpoints(tmp_path)
  newest = tmp_path / "run" / "checkpoints" / "3"
  largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  content = bytearray(largest.read_bytes())
  middle = len(content) // 2
  content[middle:middle + 64] = bytes(b ^ 0xFF for b in content[middle:middle + 64])
  largest.write_bytes(bytes(content))

  train.train_and_evaluate(config, workdir)
  aside = tmp_path / "run" / checkpoint.UNREADABLE_DIR / "3"
  assert (f"checkpoint {newest} cannot be read (ChecksumMismatch: "
          f"{largest.relative_to(newest)} has sha256 ") in caplog.text
  assert f"moved to {aside}; resuming from the checkpoint of step 2" in caplog.text
  _assert_bit_identical(checkpoint.load_state(workdir), uninterrupted)
  assert _training_records(workdir) == records


def test_when_no_checkpoint_can_be_read_the_error_says_how_to_start_afresh(tmp_path):
  saver = checkpoint.Checkpointer(str(tmp_path), keep=2)
  state = {"w": np.zeros(3, np.float32)}
  for step in (1, 2):
    saver.save(step, state)
    _cut_short(tmp_path / "checkpoints" / str(step) / "default" / "_METADATA")
  folder = tmp_path / "checkpoints"
  with pytest.raises(ValueError, match=rf"none of the 2 checkpoints under {folder} can be read "
                                       r"\(step 2: ChecksumMismatch: default/_METADATA has "
                                       r"sha256 .*; step 1: .*\); they are "
                                       rf"left in place. To start afresh, move {folder} "
                                       "elsewhere"):
    saver.restore_latest(state)
  assert saver.latest_step() == 2 and not (tmp_path / checkpoint.UNREADABLE_DIR).exists()
  saver.close()


def test_a_checkpoint_that_an_older_layout_wrote_is_refused_in_one_line_and_kept(tmp_path):
  """A checkpoint whose state has another structure than the code's (here a hot bank's optimizer
  state as written before the hot rows' exchange kept its own state: one leaf where there are
  now four) is never restored in part: refused in one line, left in place."""
  saver = checkpoint.Checkpointer(str(tmp_path), keep=2)
  rows = np.zeros((4, 8), np.float32)
  saver.save(1, {"params": {"hot": rows}, "opt_state": {"hot": (rows,)}})
  now = {"params": {"hot": rows},
         "opt_state": {"hot": (np.zeros((), np.int32), np.zeros(2, np.uint32), rows, rows)}}
  folder = tmp_path / "checkpoints"
  with pytest.raises(ValueError, match=rf"^none of the 1 checkpoints under {folder} can be read "
                                       r"\(step 1: ValueError: .*tree structures do not match"
                                       r".*\); they are left in place") as error:
    saver.restore_latest(now)
  assert "\n" not in str(error.value)
  assert saver.latest_step() == 1 and not (tmp_path / checkpoint.UNREADABLE_DIR).exists()
  saver.close()


# ------------------------------------------------------------------------- one run per workdir

def test_a_workdir_held_by_a_live_process_is_refused_naming_it(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from experiments import lock\n"
       f"with lock.hold({str(tmp_path)!r}):\n  print('held', flush=True); time.sleep(600)"],
      cwd=ROOT, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(lock.WorkdirInUse,
                       match=rf"is in use by another run \(pid {holder.pid} on host "
                             rf"{re.escape(socket.gethostname())}, since .*: .* -c .*\); one run "
                             "per workdir"):
      with lock.hold(str(tmp_path)):
        pass
  finally:
    holder.kill()
    holder.wait()
  with lock.hold(str(tmp_path)):  # its holder is dead: free again
    pass


def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_notice_and_released_at_exit(
    tmp_path, caplog):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  stale = {"pid": dead.pid, "host": socket.gethostname(), "since": "yesterday",
           "command": "python -m experiments.run --workdir=x"}
  (tmp_path / lock.LOCK_FILE).write_text(json.dumps(stale))
  with pytest.raises(ZeroDivisionError):  # released however the run ends
    with lock.hold(str(tmp_path)):
      held = json.loads((tmp_path / lock.LOCK_FILE).read_text())
      assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())
      1 / 0  # pylint: disable=pointless-statement
  assert f"taking over the lock of a run that ended without releasing it (pid {dead.pid}" in (
      caplog.text)
  assert (tmp_path / lock.LOCK_FILE).read_text() == ""


# ----------------------------------------------------------------------------------- sweeps

@pytest.mark.slow
def test_a_sweep_run_that_fails_when_it_starts_is_recorded_and_the_others_train(tmp_path):
  """Run "busy" finds its workdir held by another run: summary.csv records its error, "ok"
  trains, and the sweep exits 1 naming the failed run."""
  path = tmp_path / "sweep.py"
  runs = [{"name": n, "config": "configs/digits.py:smoke"} for n in ("busy", "ok")]
  path.write_text("import ml_collections\n\n\ndef get_config(arg=None):\n"
                  f"  return ml_collections.ConfigDict({{'runs': {runs!r}}})\n")
  workdir = tmp_path / "w"
  with lock.hold(str(workdir / "busy")):
    completed = subprocess.run(
        [sys.executable, "-m", "experiments.sweep", f"--config={path}", f"--workdir={workdir}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=_STARTUP_SECONDS)
  assert completed.returncode == 1, completed.stderr[-3000:]
  assert completed.stderr.strip().splitlines()[-1] == (
      f"experiments.sweep: 1 of 2 runs failed (busy); see {workdir / 'summary.csv'}")
  with open(workdir / "summary.csv") as f:
    rows = {r["name"]: r for r in csv.DictReader(f)}
  assert "is in use by another run" in rows["busy"]["error"] and not rows["busy"]["step"]
  assert rows["ok"]["error"] == "" and rows["ok"]["step"] == "2"
  assert "busy: failed: workdir=" in completed.stdout


# ------------------------------------------------------------------------------ derived data

def test_a_token_cache_cut_short_is_named_and_encoded_again(tmp_path, caplog):
  texts, shared, stream, cached = cached_token_stream(tmp_path)
  whole = cached.read_bytes()
  cached.write_bytes(whole[:len(whole) - 8])
  np.testing.assert_array_equal(stdlib.token_stream(shared, texts, tmp_path), stream)
  assert f"the cached token stream {cached} cannot be read" in caplog.text
  assert cached.read_bytes() == whole


# --------------------------------------------------------------------------------------- signals

SIGNAL_AFTER_STEP = 3


def _send_sigint(state):
  """Sends this process SIGINT (a Ctrl-C) once step SIGNAL_AFTER_STEP is done."""
  if int(state.step) == SIGNAL_AFTER_STEP:
    os.kill(os.getpid(), signal.SIGINT)
  return state


@pytest.mark.slow  # a minute or more of training and restarts: CI runs the slow failures
def test_a_signal_stops_the_run_at_the_next_step_boundary_after_a_checkpoint(
    tmp_path, monkeypatch):
  """In process: the run stops at step 3 with Interrupted (exit status 130 for SIGINT),
  checkpointed there although no checkpoint was due, puts back the SIGINT handler, and resumes
  to the parameters, optimizer state and logs of an uninterrupted run."""
  config = digits.get_config("smoke,method=topk")
  config.update_from_flattened_dict({"num_steps": 6, "checkpoint_every": 0})
  reference = str(tmp_path / "reference")
  train.train_and_evaluate(config, reference)

  build = _wrap_train_steps(monkeypatch, _send_sigint)
  workdir = str(tmp_path / "run")
  # What was there before the run (Python's default, or SIG_IGN in a shell's background job).
  handler = signal.getsignal(signal.SIGINT)
  with pytest.raises(interrupt.Interrupted) as stopped:
    train.train_and_evaluate(config, workdir)
  assert (stopped.value.step, stopped.value.signum) == (SIGNAL_AFTER_STEP, signal.SIGINT)
  assert stopped.value.exit_status == 130 and stopped.value.workdir == workdir
  assert signal.getsignal(signal.SIGINT) is handler
  assert checkpoint.Checkpointer(workdir, keep=2).latest_step() == SIGNAL_AFTER_STEP
  assert not os.path.exists(os.path.join(workdir, train.RESULTS_FILE))

  monkeypatch.setattr(train, "_data_parallel", build)
  train.train_and_evaluate(config, workdir)
  _assert_bit_identical(checkpoint.load_state(workdir), checkpoint.load_state(reference))
  assert _training_records(workdir) == _training_records(reference)


# ------------------------------------------------------------- crashes and restarts (subprocess)

# experiments.run, with an optional test hook: while committing checkpoint HOLD_CHECKPOINT_STEP
# (its files written into orbax's temporary directory, not yet renamed into place), touch
# HOLD_MARKER and wait to be killed. Orbax is imported only after the runner exposes the devices.
_RUN_WITH_HOOK = """
import asyncio, os
from absl import app
from experiments import distributed, run

def expose_then_hold(config, expose=distributed.expose_cpu_devices):
  expose(config)
  from orbax.checkpoint._src.path import atomicity
  finalize = atomicity.AtomicRenameTemporaryPath.finalize
  async def held_finalize(self):
    if self._final_path.name == os.environ["HOLD_CHECKPOINT_STEP"]:
      open(os.environ["HOLD_MARKER"], "w").close()
      await asyncio.sleep(3600)
    await finalize(self)
  atomicity.AtomicRenameTemporaryPath.finalize = held_finalize

if os.environ.get("HOLD_CHECKPOINT_STEP"):
  distributed.expose_cpu_devices = expose_then_hold
app.run(run.main)
"""
_STARTUP_SECONDS = 300  # start-up and compilation on a loaded 2-core machine


def _env(**extra):
  return dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1", XLA_FLAGS="", JAX_PLATFORMS="cpu",
              **extra)


def _start(command, log_path, **env) -> subprocess.Popen:
  with open(log_path, "ab") as log:
    return subprocess.Popen([sys.executable, *command], cwd=ROOT, env=_env(**env), stdout=log,
                            stderr=subprocess.STDOUT)


def _wait_until(condition, processes, timeout=_STARTUP_SECONDS):
  deadline = time.monotonic() + timeout
  while not condition():
    ended = [p.args for p in processes if p.poll() is not None]
    assert not ended, f"ended before the moment to kill them: {ended}"
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


def _finish(command, log_path, timeout=600):
  process = _start(command, log_path)
  try:
    assert process.wait(timeout) == 0, open(log_path).read()[-3000:]
  finally:
    process.kill()


def _training_records(workdir):
  return [{k: v for k, v in r.items() if k != "examples_per_sec"}
          for r in logs.read_metrics(workdir)]


CRASH_CONFIGS = {
    "tasc": "configs/quickstart.py:smoke",  # residuals, curvature average, LAMB moments
    "powersgd": "configs/digits.py:smoke,method=powersgd",  # warm-start bases, residuals
    "dgc": "configs/digits.py:smoke,method=dgc",  # momentum correction, residuals
}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(CRASH_CONFIGS))
def test_a_run_killed_at_any_moment_resumes_bit_identically(method, tmp_path):
  """kill -9 mid-training, then kill -9 while checkpoint 6 is being committed, then a restart:
  the final state (parameters, every device's compressor state, optimizer moments, keys, step)
  and the logs equal those of an uninterrupted run, bit for bit."""
  reference, workdir, log = tmp_path / "reference", tmp_path / "run", tmp_path / "log"

  def command(directory):
    return ["-c", _RUN_WITH_HOOK, f"--config={CRASH_CONFIGS[method]}", "--config.num_steps=10",
            "--config.checkpoint_every=2", "--config.keep_checkpoints=2",
            f"--workdir={directory}"]

  _finish(command(reference), log)
  checkpoints = workdir / "checkpoints"

  run = _start(command(workdir), log)  # killed in the middle of training
  try:
    _wait_until((checkpoints / "2").is_dir, [run])
  finally:
    run.kill()
  run.wait()
  assert not (workdir / train.RESULTS_FILE).exists()

  marker = tmp_path / "holding"
  run = _start(command(workdir), log, HOLD_CHECKPOINT_STEP="6", HOLD_MARKER=str(marker))
  try:
    _wait_until(marker.exists, [run])
  finally:
    run.kill()
  run.wait()
  partial = list(checkpoints.glob("6.orbax-checkpoint-tmp*"))
  assert partial and os.listdir(partial[0]), "checkpoint 6 should be written, not committed"
  assert sorted(os.listdir(checkpoints)) == ["2", "4", partial[0].name]

  _finish(command(workdir), log)
  assert "resuming from the checkpoint of step 4" in log.read_text()
  _assert_bit_identical(checkpoint.load_state(str(workdir)),
                        checkpoint.load_state(str(reference)))
  assert _training_records(workdir) == _training_records(reference)


_RESUME_LINE = re.compile(r"^interrupted at step (\d+); resume with: (.+)$", re.MULTILINE)


@pytest.mark.slow
def test_sigterm_stops_a_run_that_the_printed_command_resumes_bit_identically(tmp_path):
  """kill -TERM mid-training: exit status 143 and the resume line, a checkpoint at that step
  (none was due), and the printed command ends where an uninterrupted run does, bit for bit."""
  reference, workdir, log = tmp_path / "reference", tmp_path / "run", tmp_path / "log"

  def command(directory):
    return ["-m", "experiments.run", "--config=configs/quickstart.py:smoke",
            "--config.num_steps=200", "--config.checkpoint_every=0",
            "--config.check_replicas_every=0", f"--workdir={directory}"]

  _finish(command(reference), log)
  run = _start(command(workdir), log)
  try:
    _wait_until(lambda: len(logs.read_metrics(str(workdir))) >= 3, [run])
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM
  finally:
    run.kill()
  output = log.read_text()
  assert "Traceback" not in output
  [(step, resume)] = _RESUME_LINE.findall(output)
  assert 3 <= int(step) < 200 and not (workdir / train.RESULTS_FILE).exists()
  assert os.listdir(workdir / "checkpoints") == [step]
  assert shlex.split(resume) == [sys.executable, *command(workdir)]

  completed = subprocess.run(shlex.split(resume), cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=600)
  assert completed.returncode == 0, completed.stderr[-3000:]
  assert f"resuming from the checkpoint of step {step}" in completed.stderr
  _assert_bit_identical(checkpoint.load_state(str(workdir)),
                        checkpoint.load_state(str(reference)))
  assert _training_records(workdir) == _training_records(reference)


# ---------------------------------------------------------------- a full disk (subprocess)

@pytest.mark.slow
def test_a_full_disk_under_the_workdir_ends_in_one_line_and_verbose_shows_orbaxs_trace(
    small_disk):
  """A new user's run on a disk without room for its checkpoint: the last line of stderr is the
  error's, naming the folder, the bytes and what is kept (not the progress bar's line, which the
  error once ran into, nor the late reports of orbax's threads and abandoned writes); nothing of
  orbax shows. ``--verbose`` shows its traceback."""
  command = [sys.executable, "-m", "experiments.run", "--config=configs/quickstart.py:smoke",
             f"--workdir={small_disk / 'run'}"]
  completed = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=600)
  assert completed.returncode == 1, completed.stderr[-3000:]
  assert "Traceback" not in completed.stderr and "orbax" not in completed.stderr
  last = completed.stderr.splitlines()[-1]  # \r ends a line too: the bar's updates
  assert re.fullmatch(
      rf"experiments.run: {small_disk / 'run'}(/checkpoints|/metrics.jsonl)?: the disk is full "
      r".*(\([\d,]+ bytes of arrays\) could not be written|the log could not be written)"
      r".*and run again with the same --workdir to resume", last), completed.stderr[-3000:]
  verbose = subprocess.run([*command, "--verbose"], cwd=ROOT, env=_env(), capture_output=True,
                           text=True, timeout=600)
  assert verbose.returncode == 1 and "Traceback" in verbose.stderr
  assert "experiments.checkpoint.DiskFull" in verbose.stderr or "OSError" in verbose.stderr


# --------------------------------------------------------------- a process dies (multi-process)

_MULTI_PROCESS_ARGS = ["--config=configs/digits.py:smoke", "--config.num_steps=40",
                       "--config.checkpoint_every=4", "--config.log_every=4"]
_STOP_WITHIN_SECONDS = 60


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["worker", "coordinator", "worker under the launcher"])
def test_when_a_process_dies_the_others_stop_within_a_minute_and_a_restart_resumes(
    victim, tmp_path):
  workdir = tmp_path / "run"
  args = [*_MULTI_PROCESS_ARGS, f"--workdir={workdir}"]
  logs_ = [tmp_path / "process0", tmp_path / "process1"]
  if victim == "worker under the launcher":
    launcher = _start(["-m", "experiments.launch", "--num_processes=2", "--", *args],
                      tmp_path / "launcher")
    processes = [launcher]
  else:
    address = f"127.0.0.1:{launch.free_port()}"
    processes = [_start(["-m", "experiments.run", *args], logs_[i],
                        JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                        JAX_PROCESS_ID=str(i)) for i in range(2)]
  try:
    _wait_until((workdir / "checkpoints" / "4").is_dir, processes)
    if victim == "worker under the launcher":
      children = psutil.Process(launcher.pid).children()
      killed = next(c for c in children if c.environ()["JAX_PROCESS_ID"] == "1")
      killed.kill()
      survivor, survivor_log = launcher, tmp_path / "launcher"
    else:
      dead = 0 if victim == "coordinator" else 1
      processes[dead].kill()
      survivor, survivor_log = processes[1 - dead], logs_[1 - dead]
    killed_at = time.monotonic()
    code = survivor.wait(timeout=_STOP_WITHIN_SECONDS)
    stopped_after = time.monotonic() - killed_at
  finally:
    for p in processes:
      p.kill()
  message = survivor_log.read_text()
  assert code != 0 and stopped_after < _STOP_WITHIN_SECONDS
  if victim == "worker under the launcher":
    assert code == 128 + signal.SIGKILL
    assert "experiments.launch: process 1 of 2 was killed by SIGKILL; stopping the others" in (
        message)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
  else:
    assert ("Terminating process because the JAX distributed service detected fatal errors. "
            "This most likely indicates that another task died") in message

  last = checkpoint.Checkpointer(str(workdir), keep=2).latest_step()
  _finish(["-m", "experiments.launch", "--num_processes=2", "--", *args], tmp_path / "restart")
  assert f"resuming from the checkpoint of step {last}" in (tmp_path / "restart").read_text()
  steps = [r["step"] for r in logs.read_metrics(str(workdir)) if "loss" in r]
  assert steps == list(range(4, 41, 4))


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_process_at_one_step(tmp_path):
  """The launcher passes SIGTERM on and waits: within 10 s no process is left, all stopped at
  the same step after a checkpoint, and process 0 names the launcher's command to resume
  with."""
  workdir, log = tmp_path / "run", tmp_path / "launcher"
  launch_command = ["-m", "experiments.launch", "--num_processes=2", "--",
                    "--config=configs/digits.py:smoke", "--config.num_steps=4000",
                    "--config.checkpoint_every=4", "--config.log_every=4", f"--workdir={workdir}"]
  launcher = _start(launch_command, log)
  try:
    _wait_until((workdir / "checkpoints" / "4").is_dir, [launcher])
    children = psutil.Process(launcher.pid).children()
    assert len(children) == 2
    launcher.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code = launcher.wait(timeout=10)
    alive = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive and time.monotonic() - signalled < 10
  finally:
    launcher.kill()
  output = log.read_text()
  assert code == 128 + signal.SIGTERM, output[-3000:]
  assert "experiments.launch: received SIGTERM; passed on to the 2 running processes" in output
  [(step, resume)] = _RESUME_LINE.findall(output)
  assert shlex.split(resume) == [sys.executable, *launch_command]
  assert checkpoint.Checkpointer(str(workdir), keep=2).latest_step() == int(step)
  assert "Traceback" not in output
