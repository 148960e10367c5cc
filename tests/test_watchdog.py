"""No silent hang: a step that never completes, a signal while the first step waits, a device
count that deadlocks the first collective, a process of a job that waits for one that never
comes.

The watchdog and the signal thread end the process (``os._exit``): in process, the tests put a
stand-in for :func:`experiments.watchdog.stop_process` that records the line and lets the
blocked step go on; the subprocess tests see the real exit. The subprocess test of a real
deadlock (257 simulated devices) is marked slow.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import ml_collections
import pytest

from configs import common
from configs import digits
from experiments import distributed
from experiments import launch
from experiments import provenance
from experiments import train
from experiments import watchdog

pytestmark = pytest.mark.usefixtures("fast_compiles")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _BlockedFirstStep:
  """The runner's train step, whose first call runs ``on_block()`` and then waits until
  ``release`` is set (at most a minute), as a step blocked in a collective waits."""

  def __init__(self, step, on_block, release: threading.Event):
    self._step, self._on_block, self._release = step, on_block, release
    self.lower = step.lower  # the runner compiles the real step before the step's clock starts

  def __call__(self, state, batch, **kwargs):
    if not self._release.is_set():
      self._on_block()
      assert self._release.wait(60), "the blocked step was never released"
    return self._step(state, batch, **kwargs)


@pytest.fixture(name="blocked_run")
def _blocked_run(monkeypatch):
  """``(on_block) -> stopped``: makes the runner's first step block (after ``on_block()``)
  until :func:`experiments.watchdog.stop_process` is called, which records ``(line, status)``
  in ``stopped`` instead of ending the process."""
  build = train._data_parallel  # pylint: disable=protected-access

  def block_with(on_block):
    release, stopped = threading.Event(), []

    def stop_process(line, status):
      stopped.append((line, status))
      release.set()

    monkeypatch.setattr(watchdog, "stop_process", stop_process)
    monkeypatch.setattr(train, "_data_parallel", lambda *args, **kwargs: (
        dp := build(*args, **kwargs))._replace(
            train_step=_BlockedFirstStep(dp.train_step, on_block, release)))
    return stopped
  return block_with


def test_a_step_that_never_completes_is_named_and_stops_the_run(blocked_run, tmp_path):
  stopped = blocked_run(lambda: None)
  config = digits.get_config("smoke")
  config.stall_timeout_seconds = 1
  train.train_and_evaluate(config, str(tmp_path))
  [(line, status)] = stopped
  assert status == 1
  assert re.fullmatch(
      rf"stalled: step 0 \(kind '\w+'\) of {tmp_path} on 8 workers has not completed within "
      r"config.stall_timeout_seconds=1 s; its collectives wait for every device and every "
      r"process, .* a restart resumes from it \(a step that is only slow needs a larger value\)",
      line)


def test_a_signal_before_the_first_step_completed_stops_the_run_at_once(
    blocked_run, tmp_path, monkeypatch):
  """In process: the signal's thread stops the run while its first step waits (the stand-in
  then lets it go on; the watchdog, whose time is long, says nothing); the handler is put back
  afterwards. (SIGINT takes the same path as SIGTERM.)"""
  signum = signal.SIGTERM
  monkeypatch.setenv(provenance.COMMAND_ENV, "python -m experiments.run --workdir=w")
  stopped = blocked_run(lambda: os.kill(os.getpid(), signum))
  handler = signal.getsignal(signum)
  train.train_and_evaluate(digits.get_config("smoke"), str(tmp_path))
  assert stopped == [(f"interrupted by {signal.Signals(signum).name} before the run's first step "
                      "completed: stopped at once, nothing lost since its last checkpoint; "
                      "resume with: python -m experiments.run --workdir=w", 128 + signum)]
  assert signal.getsignal(signum) is handler


def _smoke_digits(**fields) -> ml_collections.ConfigDict:
  config = digits.get_config("smoke")
  config.update_from_flattened_dict(fields)
  return config


def test_a_device_count_that_deadlocks_the_first_collective_is_refused_before_jax_starts():
  with pytest.raises(ValueError, match=r"config.num_devices=512 over 1 process\(es\) runs 512 "
                                       r"simulated CPU devices in each; allowed: at most 256 per "
                                       r"process \(XLA's CPU runtime .*config.workers_per_device"):
    distributed.expose_cpu_devices(_smoke_digits(num_devices=512, batch_size=512,
                                                 eval_batch_size=512))
  with pytest.raises(ValueError, match=r"config.num_devices=1028 over 2 process\(es\) runs 514"):
    distributed.check_running_cpu_devices(514, 2)
  distributed.check_running_cpu_devices(256)
  # Simulated workers beyond the mesh's devices are compiled for, never run.
  distributed.expose_cpu_devices(_smoke_digits(workers_per_device=64, batch_size=512,
                                               eval_batch_size=512))


def test_the_exposed_device_count_is_bounded_by_memory(monkeypatch):
  sysconf = os.sysconf
  monkeypatch.setattr(os, "sysconf", lambda name: (1 << 30) // 4096 if name == "SC_PHYS_PAGES"
                      else 4096 if name == "SC_PAGE_SIZE" else sysconf(name))
  assert distributed.max_cpu_devices() == 256  # 1 GiB, 4 MiB each
  with pytest.raises(ValueError, match=r"asks each process for 512 devices; allowed: at most 256 "
                                       "per process"):
    distributed.expose_cpu_devices(_smoke_digits(workers_per_device=64, batch_size=512,
                                                 eval_batch_size=512))


@pytest.mark.parametrize("field, value, message", [
    ("stall_timeout_seconds", -1, r"config.stall_timeout_seconds=-1 is below 0"),
    ("distributed.join_timeout_seconds", 0,
     r"config.distributed.join_timeout_seconds=0 is below 1; it must be an int >= 1"),
])
def test_the_timeouts_are_checked_where_they_are_declared(field, value, message):
  config = common.base()
  config.update_from_flattened_dict({field: value})
  with pytest.raises((TypeError, ValueError), match=message):
    common.check(config)
  if field.startswith("distributed."):
    with pytest.raises(ValueError, match=message):
      distributed.join_timeout(config)


def _env(**extra):
  return dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1", XLA_FLAGS="", JAX_PLATFORMS="cpu",
              **extra)


@pytest.mark.parametrize("process_id, missing", [
    (0, "process 1"), (1, "process 0, the coordinator: nothing answers at its address")])
def test_a_process_whose_job_never_joins_says_so_at_once_and_names_the_missing_one(
    process_id, missing):
  """One process of a two-process job started alone: it says at once that it waits, and after
  the join timeout names what is missing and exits 1, without JAX's C++ fatal-error dump."""
  address = f"127.0.0.1:{launch.free_port()}"
  started = time.monotonic()
  completed = subprocess.run(
      [sys.executable, "-m", "experiments.run", "--config=configs/digits.py:smoke",
       "--config.distributed.join_timeout_seconds=2", "--workdir=unused"],
      cwd=ROOT, capture_output=True, text=True, timeout=120,
      env=_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(process_id)))
  assert completed.returncode == 1, completed.stderr[-3000:]
  assert time.monotonic() - started < 60
  assert completed.stderr.splitlines() == [
      f"process {process_id} of 2: waiting for the 2 processes to join at {address} (up to 2 s: "
      "config.distributed.join_timeout_seconds)",
      f"stalled: process {process_id} of 2: the join of the job's 2 processes at {address} "
      f"(missing: {missing}) has not completed within config.distributed.join_timeout_seconds=2 "
      "s; start every process of the job, each with its own process id and the same coordinator "
      "address and process count (experiments.launch does), or raise the timeout"]


def test_a_ctrl_c_while_a_process_waits_for_its_job_ends_it_at_once():
  """It ends by the signal, or, if the signal came before the wait, as an interrupted run."""
  address = f"127.0.0.1:{launch.free_port()}"
  process = subprocess.Popen(
      [sys.executable, "-m", "experiments.run", "--config=configs/digits.py:smoke",
       "--workdir=unused"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
      env=_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0"))
  try:
    assert "waiting for the 2 processes to join" in process.stderr.readline()
    time.sleep(1)  # into the wait
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=10) in (-signal.SIGINT, 128 + signal.SIGINT)
  finally:
    process.kill()
    process.stderr.close()


# experiments.run with the bound on running devices lifted, to reach the deadlock it refuses.
_RUN_PAST_THE_BOUND = """
from absl import app
from experiments import cli, distributed, run
distributed.MAX_RUNNING_CPU_DEVICES = 1024
app.run(run.main, flags_parser=cli.flags_parser("experiments.run"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["watchdog", "sigterm"])
def test_a_run_deadlocked_in_its_first_collective_stops_with_one_line(stop, tmp_path):
  """257 simulated devices: 256 reach the first all-reduce, which waits forever. The watchdog
  names the step (exit 1); a SIGTERM stops it at once (exit 143), both without a traceback."""
  log = tmp_path / "log"
  command = [sys.executable, "-c", _RUN_PAST_THE_BOUND, "--config=configs/quickstart.py:smoke",
             "--config.num_devices=257", "--config.batch_size=257",
             "--config.eval_batch_size=257", f"--workdir={tmp_path / 'run'}",
             f"--config.stall_timeout_seconds={5 if stop == 'watchdog' else 0}"]
  with open(log, "wb") as out:
    run = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
  try:
    if stop == "sigterm":
      deadline = time.monotonic() + 300
      while "0/2" not in log.read_text():  # the loop has started: the first step follows
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
      time.sleep(5)  # compiled, and waiting in the all-reduce
      run.send_signal(signal.SIGTERM)
      signalled = time.monotonic()
      assert run.wait(timeout=30) == 128 + signal.SIGTERM
      assert time.monotonic() - signalled < 5
    else:
      assert run.wait(timeout=300) == 1
  finally:
    run.kill()
  output = log.read_text()
  assert "Traceback" not in output
  if stop == "sigterm":
    assert "interrupted by SIGTERM before the run's first step completed: stopped at once" in output
  else:
    assert re.search(r"stalled: step 0 \(kind '\w+'\) of \S+ on 257 workers has not completed "
                     r"within config.stall_timeout_seconds=5 s", output)
