"""A catalogue of bad input across the public API, the configs, the data files, the workdir and
the command line. Every case must fail with a clear error (the field, the value, what is allowed)
before anything is compiled: each in-process case runs while a listener counts XLA compilations,
and must count none.
"""

import contextlib
import json
import os
import pickle
import re
import socket
import subprocess
import sys

import jax
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import pytest

import compressors
from configs import cifar10_resnet20
from configs import common
from configs import digits
from configs import dlrm
from configs import imagenet_resnet50
from configs import lm_stdlib
from configs import quickstart
from experiments import checkpoint
from experiments import cli
from experiments import distributed
from experiments import lock
from experiments import sweep
from experiments import train
from experiments import validation
from experiments.data import fake
import optimizers
import tasc
from tests import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: _compiles.append(event) if event == _BACKEND_COMPILE
    else None)


# ------------------------------------------------------------------------------------ helpers

def _lower_per_worker(tx, grads: dict, **extra_args):
  """Traces and lowers (never compiles) ``tx.update`` per worker inside ``shard_map``."""
  def step(g):
    g = jax.tree.map(lambda x: x[0], g)
    return tx.update(g, tx.init(g), g, **extra_args)[0]
  stacked = {k: jax.ShapeDtypeStruct((8,) + v.shape, v.dtype) for k, v in grads.items()}
  jax.jit(jax.shard_map(step, mesh=harness.mesh(), in_specs=P("data"), out_specs=P(),
                        check_vma=False)).lower(stacked)


def _digits(**fields):
  config = digits.get_config("smoke")
  config.update_from_flattened_dict(fields)
  return config


def _run(config, tmp_path):
  train.train_and_evaluate(config, str(tmp_path / "run"))


def _config(module, **fields):
  config = module.get_config("smoke")
  config.update_from_flattened_dict(fields)
  return config


def _with(config, field, value):
  config[field] = value
  return config


def _cifar_dir(tmp_path):
  return fake.write_cifar(str(tmp_path / "cifar10"), num_classes=10, num_train=40, num_test=16)


def _cifar_run(tmp_path, data_dir):
  config = cifar10_resnet20.get_config("smoke")
  config.data_dir = data_dir
  _run(config, tmp_path)


def _truncated_cifar(tmp_path):
  data_dir = _cifar_dir(tmp_path)
  path = os.path.join(data_dir, "data_batch_3")
  with open(path, "rb") as f:
    payload = f.read()
  with open(path, "wb") as f:
    f.write(payload[:len(payload) // 2])
  _cifar_run(tmp_path, data_dir)


def _misshapen_cifar(tmp_path):
  data_dir = _cifar_dir(tmp_path)
  with open(os.path.join(data_dir, "test_batch"), "wb") as f:
    pickle.dump({b"data": np.zeros((16, 1024), np.uint8), b"labels": [0] * 16}, f)
  _cifar_run(tmp_path, data_dir)


def _imagenet(tmp_path, corrupt):
  data_dir = fake.write_imagenet(str(tmp_path / "imagenet"), num_classes=2, train_per_class=8,
                                 val_per_class=8)
  corrupt(data_dir)
  config = imagenet_resnet50.get_config("smoke")
  config.data_dir = data_dir
  _run(config, tmp_path)


def _garbage_jpeg(data_dir):
  with open(os.path.join(data_dir, "train", "n00000001", "n00000001_3.JPEG"), "wb") as f:
    f.write(b"\xff\xd8 this is not a JPEG")


def _unknown_val_class(data_dir):
  os.makedirs(os.path.join(data_dir, "val", "n99999999"))


def _write_checkpoint(tmp_path, stored_config, *, with_config=True):
  """Makes ``tmp_path/run`` a workdir holding a (tiny) checkpoint written by ``stored_config``."""
  workdir = tmp_path / "run"
  saver = checkpoint.Checkpointer(str(workdir), keep=1)
  saver.save(1, {"w": np.zeros(3, np.float32)})
  saver.close()
  if with_config:
    with open(workdir / "config.json", "w") as f:
      json.dump(stored_config.to_dict(), f)


def _other_configs_checkpoint(tmp_path):
  _write_checkpoint(tmp_path, _digits(method="dense"))
  _run(_digits(**{"method": "topk", "optimizer.learning_rate": 0.5, "log_every": 7}), tmp_path)


def _checkpoint_without_config(tmp_path):
  _write_checkpoint(tmp_path, None, with_config=False)
  _run(_digits(), tmp_path)


def _workdir_is_a_file(tmp_path):
  (tmp_path / "run").write_text("not a directory")
  _run(_digits(), tmp_path)


def _sweep_override(tmp_path, **fields):
  del tmp_path
  run = {"name": "a", "config": os.path.join(ROOT, "configs", "digits.py") + ":smoke",
         "overrides": {"bach_size": 64}}
  sweep.run_configs(ml_collections.ConfigDict({"runs": [run], **fields}))


def _busy_workdir(tmp_path):
  with lock.hold(str(tmp_path / "run")):
    _run(_digits(), tmp_path)


def _sweep_refusing_a_run(tmp_path):
  """A sweep whose override only TASC's run uses, with a value TASC refuses."""
  del tmp_path
  runs = [{"name": m, "config": os.path.join(ROOT, "configs", "digits.py") + f":smoke,method={m}"}
          for m in ("dense", "topk", "tasc")]
  configs = sweep.run_configs(ml_collections.ConfigDict(
      {"runs": runs, "overrides": {"compression": {"tasc": {"density": -1.0}}}}))
  sweep.check_runs(configs)


def _data_parallel_on(batch_rows: int):
  tx = compressors.compress(compressors.topk(0.5), axis_name="data")
  params = {"w": np.ones(4, np.float32)}
  return compressors.data_parallel(lambda p, b: (b["x"] @ p["w"]).sum(), tx, harness.mesh(),
                                   params, {"x": np.ones((batch_rows, 4), np.float32)})


def _step_of_kind(kind: str):
  """A step of a kind the method does not have (its state is never made: nothing compiles)."""
  dp = _data_parallel_on(8)
  dp.step({"w": np.ones(4, np.float32)}, None, {"x": np.ones((8, 4), np.float32)}, kind=kind)


# ------------------------------------------------------------------------------- the catalogue
# (id, fails(tmp_path), error type, pattern the message must match)
_API = [
    ("topk-density-above-1", lambda t: compressors.topk(1.5), ValueError,
     r"topk: density=1.5 is outside \(0, 1\]"),
    ("topk-density-string", lambda t: compressors.topk("0.01"), TypeError,
     r"topk: density must be a number in \(0, 1\], got '0.01'"),
    ("randomk-density-zero", lambda t: compressors.randomk(0.0), ValueError,
     r"randomk: density=0.0 is outside \(0, 1\]"),
    ("dgc-sample-fraction-1.5", lambda t: compressors.dgc(0.01, sample_fraction=1.5), ValueError,
     r"dgc: sample_fraction=1.5 is outside \(0, 1\]"),
    ("momentum-correction-1.5", lambda t: compressors.momentum_correction(
        compressors.compress(compressors.topk(0.01), axis_name="data", report_sent=True), 1.5),
     ValueError, r"momentum_correction: momentum=1.5; allowed: a number in \[0, 1\)"),
    ("qsgd-levels-float", lambda t: compressors.qsgd(2.5), TypeError,
     r"qsgd: levels must be an int >= 1, got 2.5"),
    ("cast-int8", lambda t: compressors.cast("int8"), ValueError,
     r"cast: dtype=int8 is not supported; allowed"),
    ("powersgd-rank-0", lambda t: compressors.powersgd(0), ValueError,
     r"powersgd: rank=0; allowed: an int >= 1"),
    ("powersgd-rank-sending-more-than-its-matrix",  # rate 2048 / 3072: more than dense
     lambda t: _lower_per_worker(
         compressors.compress(compressors.powersgd(32, min_compression_rate=0.0),
                              axis_name="data", fuse=False), {"w": np.ones((64, 32), np.float32)}),
     ValueError, r"^powersgd: rank=32 for params leaf \['w'\], shape \(64, 32\) compressed as a "
     r"64 x 32 matrix, sends rank x \(rows \+ cols\) = 3,072 numbers, more than the 2,048 of "
     r"the matrix itself; allowed: rank <= 21 for this leaf"),
    ("tasc-density-2", lambda t: tasc.tasc_compress(axis_name="data", density=2.0), ValueError,
     r"tasc: density=2.0 is outside"),
    ("tasc-unknown-sensitivity",
     lambda t: tasc.tasc_compress(axis_name="data", density=0.1, sensitivity="psychic"),
     ValueError, r"sensitivity='psychic' is unknown; allowed"),
    ("compress-not-a-compressor", lambda t: compressors.compress("topk", axis_name="data"),
     TypeError, r"compress: compressor must be a compressors.Compressor"),
    ("axis-not-bound",
     lambda t: _lower_per_worker(compressors.compress(compressors.topk(0.5), axis_name="batch"),
                                 {"w": np.ones(64, np.float32)}),
     NameError, r"axis 'batch', which is not bound; the bound axes are \['data'\]"),
    ("curvature-pytree-mismatch",
     lambda t: _lower_per_worker(tasc.tasc_compress(axis_name="data", density=0.5, block_size=8),
                                 {"w": np.ones(64, np.float32)},
                                 curvature={"v": np.ones(64, np.float32)}),
     ValueError, r"tasc_compress: curvature must be a pytree like the gradients"),
    ("lamb-b1-1.5", lambda t: optimizers.lamb(1e-3, b1=1.5), ValueError,
     r"lamb: b1=1.5 is not allowed; b1 must be in \[0, 1\)"),
    ("data-parallel-batch-not-divisible", lambda t: _data_parallel_on(250), ValueError,
     r"data_parallel: batch leaf \['x'\] has shape \(250, 4\); every leaf is split over the 8 "
     r"workers along its first axis, so that axis must be a multiple of 8"),
    ("step-unknown-kind", lambda t: _step_of_kind("refresh"), ValueError,
     r"^kind='refresh' is not a step kind of this method; allowed: \['step'\]$"),
    ("hutchinson-zero-probes",
     lambda t: tasc.hutchinson_diagonal(lambda p: (p["w"] ** 2).sum(),
                                        {"w": np.ones(4, np.float32)}, None, 0),
     ValueError, r"num_samples must be >= 1; got 0"),
]
_CONFIGS = [
    ("embedding-placement-unknown",
     lambda t: _run(_config(dlrm, **{"embedding.placement": "diagonal"}), t), ValueError,
     r"config.embedding.placement='diagonal' is not allowed; allowed: \['replicated', "
     r"'table', 'row', 'column', 'auto'\]"),
    ("embedding-override-of-a-missing-table",
     lambda t: _run(_config(dlrm, **{"embedding.placement": "row",
                                     "embedding.overrides": "99:table"}), t), ValueError,
     r"config.embedding.overrides names table 99; allowed: tables 0 .. 25"),
    ("embedding-hot-exchange-unknown",
     lambda t: _run(_config(dlrm, **{"embedding.placement": "row", "embedding.hot_rows": "4",
                                     "embedding.hot_exchange": "zip"}), t), ValueError,
     r"config.embedding.hot_exchange='zip' is not allowed; allowed: 'same' or a per-step "
     r"method without per-step inputs: \['dense', .*'topk'"),
    ("workers-speed-spread-negative",
     lambda t: _run(_config(quickstart, method="diloco", aggregation="quorum",
                            **{"workers.speed_spread": -1.0}), t), ValueError,
     r"config.workers.speed_spread=-1.0 is outside \[0, inf\)"),
    ("workers-dropout-rate-1",
     lambda t: _run(_config(quickstart, method="diloco", aggregation="quorum",
                            **{"workers.dropout_rate": 1.0}), t), ValueError,
     r"config.workers.dropout_rate=1.0 is outside \[0, 1\)"),
    ("quorum-deadline-0",
     lambda t: _run(_config(quickstart, method="diloco", aggregation="quorum",
                            **{"quorum.deadline": 0.0}), t), ValueError,
     r"config.quorum.deadline=0.0 is outside \(0, inf\)"),
    ("config-arg-unknown-key", lambda t: digits.get_config("methd=topk"), ValueError,
     r"config argument 'methd=topk': unknown key 'methd' \(did you mean 'method'\?\); allowed "
     r"keys: \['method', 'smoke'\]"),
    ("config-arg-not-an-int", lambda t: lm_stdlib.get_config("smoke,steps=two"), ValueError,
     r"config argument 'steps=two': steps='two' is not allowed; allowed: an int \(default 0\)"),
    ("config-field-wrong-type", lambda t: _with(_digits().compression.topk, "density", "0.01"),
     TypeError, r"density"),
    ("method-unknown", lambda t: _run(_digits(method="zip"), t), ValueError,
     r"config.method='zip' is not a known method; known: \[.*'topk'"),
    ("dataset-unknown", lambda t: _run(_digits(dataset="mnist2d"), t), ValueError,
     r"config.dataset='mnist2d' is not a known dataset; available: \[.*'digits'"),
    ("model-unknown", lambda t: _run(_digits(**{"model.name": "transformer9"}), t), ValueError,
     r"config.model.name='transformer9' is not a known model; available: \["),
    ("optimizer-unknown", lambda t: _run(_digits(**{"optimizer.name": "adagrad"}), t),
     ValueError, r"config.optimizer.name='adagrad' is not allowed; allowed: \[.*'lamb'"),
    ("learning-rate-negative",
     lambda t: _run(_digits(**{"optimizer.learning_rate": -0.1}), t), ValueError,
     r"config.optimizer.learning_rate=-0.1 is outside \[0, inf\)"),
    ("learning-rate-nan", lambda t: _run(_digits(**{"optimizer.learning_rate": float("nan")}), t),
     ValueError, r"config.optimizer.learning_rate=nan is not a finite number; allowed: a finite"),
    ("learning-rate-inf", lambda t: _run(_digits(**{"optimizer.learning_rate": float("inf")}), t),
     ValueError, r"config.optimizer.learning_rate=inf is not a finite number"),
    ("nested-field-nan",
     lambda t: _run(_digits(**{"compression.tasc.curvature_decay": float("nan")}), t),
     ValueError, r"config.compression.tasc.curvature_decay=nan is not a finite number"),
    ("weight-decay-nan-range-check", lambda t: common.RULES["optimizer.weight_decay"].check(
        float("nan"), "config.optimizer.weight_decay"), ValueError,
     r"config.optimizer.weight_decay=nan is outside \[0, inf\)"),
    ("device-count-batch-before-jax",
     lambda t: validation.check_workers(_digits(num_devices=100000)), ValueError,
     r"config.batch_size=\d+ must be divisible by the 100000 workers"),
    ("device-count-above-bound",
     lambda t: distributed.expose_cpu_devices(_digits(num_devices=8192, batch_size=8192,
                                                      eval_batch_size=8192)), ValueError,
     r"config.num_devices=8192 .* asks each process for 8192 devices; allowed: at most 4096"),
    ("batch-not-divisible", lambda t: _run(_digits(batch_size=100), t), ValueError,
     r"config.batch_size=100 must be divisible by the 8 workers"),
    ("no-training-length", lambda t: _run(_digits(num_steps=0), t), ValueError,
     r"exactly one of config.num_steps=0 and config.num_epochs=0.0 must be > 0"),
    ("too-many-devices",
     lambda t: _run(_digits(num_devices=16, batch_size=64, eval_batch_size=64), t), ValueError,
     r"config.num_devices=16 but only 8 cpu devices exist"),
    ("density-via-config",
     lambda t: _run(_digits(**{"method": "topk", "compression.topk.density": 1.5}), t), ValueError,
     r"density=1.5 is outside \(0, 1\]"),
    ("rank-via-config",
     lambda t: _run(_digits(**{"method": "powersgd", "compression.powersgd.rank": 0}), t),
     ValueError,
     r"config.compression.powersgd.rank=0 is below 1; it must be an int >= 1"),
    ("rank-above-every-matrix",  # every leaf would be all-reduced densely, under PowerSGD's name
     lambda t: _run(_digits(**{"method": "powersgd", "compression.powersgd.rank": 4096}), t),
     ValueError, r"config.compression.powersgd=.*rank=4096.* compresses none of this model's "
     r"parameters: by the cost model it sends 1x dense's bytes"),
    ("tasc-block-larger-than-the-model",
     lambda t: _run(_digits(**{"method": "tasc", "compression.tasc.block_size": 10_000_000}), t),
     ValueError, r"^tasc: block_size=10000000 is larger than the model's gradient \(\d+ leaves "
     r"fused\), [\d,]+ elements: its one block, padded to 10,000,000 elements, would send more "
     r"than the buffer; allowed: block_size <= \d+ \(or None, which picks it from the size\)$"),
    ("momentum-correction-with-dgc",
     lambda t: _run(_digits(**{"method": "dgc", "compression.momentum_correction": 0.9}), t),
     ValueError, r"config.method='dgc' with config.compression.dgc=.*momentum_correction=0.9 "
     r"with method 'dgc', which corrects momentum itself.*allowed: 0"),
    ("momentum-correction-twice",
     lambda t: _run(_digits(**{"method": "topk", "compression.momentum_correction": 0.9,
                               "optimizer.name": "momentum"}), t),
     ValueError, r"config.optimizer.name='momentum' with .*momentum twice; allowed: 'sgd'"),
    ("momentum-correction-out-of-range",
     lambda t: _run(_digits(**{"method": "topk", "compression.momentum_correction": 1.5,
                               "optimizer.name": "sgd"}), t),
     ValueError, r"config.compression.momentum_correction=1.5 is outside \[0, 1\)"),
    ("adam-b1-above-1", lambda t: _run(_digits(**{"optimizer.b1": 1.5}), t), ValueError,
     r"config.optimizer.b1=1.5 is outside \[0, 1\)"),
    ("momentum-negative",
     lambda t: _run(_digits(**{"optimizer.name": "momentum", "optimizer.momentum": -0.5}), t),
     ValueError, r"config.optimizer.momentum=-0.5 is outside \[0, 1\)"),
    ("boundaries-outside-0-1",
     lambda t: _run(_digits(**{"schedule.name": "step", "schedule.boundaries": (0.5, 2.0)}), t),
     ValueError, r"config.schedule.boundaries\[1\]=2.0 is outside \[0, 1\]"),
    ("compression-seed-negative", lambda t: _run(_digits(**{"compression.seed": -1}), t),
     ValueError, r"config.compression.seed=-1 is below 0; it must be an int in \[0, 4294967295\]"),
    ("seed-above-uint32", lambda t: _run(_digits(seed=2**32), t), ValueError,
     r"config.seed=4294967296 is above 4294967295; it must be an int in \[0, 4294967295\]"),
    ("replica-check-negative", lambda t: _run(_digits(check_replicas_every=-1), t), ValueError,
     r"config.check_replicas_every=-1 is below 0; it must be an int >= 0"),
    ("skipped-fraction-above-1", lambda t: _run(_digits(max_skipped_fraction=1.5), t),
     ValueError, r"config.max_skipped_fraction=1.5 is outside \[0, 1\]"),
    ("heartbeat-zero",
     lambda t: _run(_digits(**{"distributed.heartbeat_timeout_seconds": 0}), t), ValueError,
     r"config.distributed.heartbeat_timeout_seconds=0 is below 1; it must be an int >= 1"),
    ("warmup-longer-than-training",
     lambda t: _run(_digits(**{"schedule.warmup_epochs": 5.0}), t), ValueError,
     r"config.schedule.warmup_epochs=5.0 is \d+ steps, not fewer than the 2 training steps"),
    ("model-field-breaking-shape-inference",
     lambda t: _run(_with(quickstart.get_config("smoke"), "model",
                          {"name": "cnn1d", "kernel_size": 0}), t), ValueError,
     r"^config.model.kernel_size=0 is not allowed for model 'cnn1d'; allowed: an int >= 1$"),
    ("mnist1d-zero-samples",
     lambda t: _run(_with(quickstart.get_config("smoke"), "data", {"num_samples": 0}), t),
     ValueError, r"config.data.num_samples=0 must be a positive int"),
    ("sweep-unknown-override", _sweep_override, ValueError,
     r"sweep config: run 'a' overrides unknown field 'bach_size'"),
    ("sweep-unknown-nested-override",
     lambda t: _sweep_override(t, overrides={"optimizer": {"learning_rat": 0.1}}), ValueError,
     r"sweep config: run 'a' overrides unknown field 'optimizer.learning_rat'"),
    ("sweep-override-wrong-type",
     lambda t: _sweep_override(t, overrides={"num_steps": "many"}), ValueError,
     r"sweep config: run 'a' overrides field 'num_steps' \(int\) with 'many' \(str\)"),
    ("sweep-unknown-field", lambda t: _sweep_override(t, overides={}), ValueError,
     r"sweep config: unknown field 'overides'; allowed: 'runs', 'overrides'"),
    ("sweep-run-refused-before-any-trains", _sweep_refusing_a_run, ValueError,
     r"sweep config: 1 of 3 runs refused, nothing trained: run 'tasc': .*tasc: density=-1.0 is "
     r"outside \(0, 1\]"),
]
_DATA_AND_WORKDIR = [
    ("cifar-dir-missing", lambda t: _cifar_run(t, str(t / "nowhere")), FileNotFoundError,
     r"cifar10: config.data_dir='.*nowhere' does not exist; config.data_dir must hold the "
     r"cifar10 python-pickle files \(data_batch_1"),
    ("cifar-truncated-pickle", _truncated_cifar, ValueError,
     r"cifar10: .*data_batch_3 is not a python pickle of a CIFAR batch \(.*\)"),
    ("cifar-misshapen-batch", _misshapen_cifar, ValueError,
     r"cifar10: .*test_batch b'data' must be uint8 \[N, 3072\] with N labels; found shape "
     r"\(16, 1024\)"),
    ("imagenet-unreadable-jpeg", lambda t: _imagenet(t, _garbage_jpeg), ValueError,
     r"config.dataset='imagenet', config.data_dir='.*': a file of the training batch of step 0 "
     r"cannot be read \(UnidentifiedImageError: .*n00000001_3.JPEG"),
    ("imagenet-val-class-not-in-train", lambda t: _imagenet(t, _unknown_val_class), ValueError,
     r"imagenet: .*val has class folders absent from train/: \['n99999999'\]"),
    ("workdir-other-configs-checkpoint", _other_configs_checkpoint, ValueError,
     r"workdir='.*' holds a checkpoint \(step 1\) of another config \(method: 'dense' there, "
     r"'topk' now; optimizer.learning_rate: 0.001 there, 0.5 now\)\. A run resumes only"),
    ("workdir-checkpoint-without-config", _checkpoint_without_config, ValueError,
     r"holds a checkpoint \(step 1\) but its config .*config.json cannot be read"),
    ("workdir-is-a-file", _workdir_is_a_file, ValueError,
     r"workdir='.*run' exists and is not a directory"),
    ("workdir-in-use", _busy_workdir, lock.WorkdirInUse,
     rf"workdir='.*run' is in use by another run \(pid {os.getpid()} on host "
     rf"{re.escape(socket.gethostname())}, since .*\); one run per workdir"),
]


def _cases(table):
  return [pytest.param(fails, error, pattern, id=name) for name, fails, error, pattern in table]


@pytest.mark.parametrize("fails, error, pattern", _cases(_API + _CONFIGS + _DATA_AND_WORKDIR))
def test_bad_input_fails_clearly_before_compiling(fails, error, pattern, tmp_path):
  del _compiles[:]
  with pytest.raises(error) as raised:
    fails(tmp_path)
  print(f"{type(raised.value).__name__}: {raised.value}")
  assert re.search(pattern, str(raised.value)), str(raised.value)
  assert not _compiles, f"{len(_compiles)} programs were compiled before the error"
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


_CLI = [
    ("cli-unknown-field", ["experiments.run", "--config=configs/digits.py:smoke",
                           "--config.batch_szie=64", "--workdir=w"], r"batch_szie"),
    ("cli-value-of-wrong-type", ["experiments.run", "--config=configs/digits.py:smoke",
                                 "--config.batch_size=many", "--workdir=w"],
     r"batch_size.*many|many.*batch_size"),
    ("cli-missing-config-file", ["experiments.run", "--config=configs/nope.py", "--workdir=w"],
     r"configs/nope.py"),
    ("cli-no-workdir", ["experiments.run", "--config=configs/digits.py:smoke"],
     r"(?m)^experiments.run: flag --workdir=None: Flag --workdir must have a value other than "
     r"None\. \(--helpshort lists the flags\)$"),
    ("cli-unexpected-argument", ["experiments.run", "--config=configs/digits.py:smoke",
                                 "--workdir=w", "smoke"],
     r"(?m)^experiments.run: unexpected arguments \['smoke'\]; every option is a flag"),
    ("cli-launch-zero-processes", ["experiments.launch", "--num_processes=0", "--"],
     r"flag --num_processes=0: 0 is not a positive integer"),
]


@pytest.mark.parametrize("argv, pattern",
                         [pytest.param(a, p, id=name) for name, a, p in _CLI])
def test_bad_command_lines_fail_before_jax_starts(argv, pattern, tmp_path):
  """The error comes before JAX starts a backend: with a platform that does not exist, a backend
  would fail to start; the launcher does not even import JAX."""
  argv = [a.replace("--workdir=w", f"--workdir={tmp_path / 'run'}") for a in argv]
  completed = subprocess.run([sys.executable, "-X", "importtime", "-m", *argv], cwd=ROOT,
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, JAX_PLATFORMS="no_such_platform"))
  assert completed.returncode != 0
  stderr = completed.stderr
  messages = "\n".join(line for line in stderr.splitlines() if not line.startswith("import time"))
  assert re.search(pattern, messages), messages[-2000:]
  assert "no_such_platform" not in messages, "a JAX backend was started"
  if argv[0] == "experiments.launch":
    assert not re.search(r"\|\s+jax$", stderr, re.MULTILINE), "jax was imported"


_DIGITS = ["--config=configs/digits.py:smoke", "--workdir=w"]
# (id, command line, pattern the last line of stderr must match); "w" becomes a fresh workdir, and
# the run of "run-busy-workdir" finds it held by this process.
_ONE_LINE = [
    ("run-typo-nested-field", ["experiments.run", *_DIGITS, "--config.optimzer.learning_rate=0.1"],
     r"^experiments.run: --config.optimzer.learning_rate=0.1: the config has no field 'optimzer'; "
     r"Did you mean \"optimizer\" instead of \"optimzer\"\? \(every field: configs/common.py\)$"),
    ("run-huge-device-count", ["experiments.run", *_DIGITS, "--config.num_devices=100000"],
     r"^experiments.run: config.batch_size=\d+ must be divisible by the 100000 workers"),
    ("run-learning-rate-nan", ["experiments.run", *_DIGITS, "--config.optimizer.learning_rate=nan"],
     r"^experiments.run: config.optimizer.learning_rate=nan is not a finite number"),
    ("run-method-settings", ["experiments.run", *_DIGITS, "--config.method=topk",
                             "--config.compression.topk.density=1.5"],
     r"^experiments.run: config.compression.topk.density=1.5 is outside \(0, 1\]$"),
    ("run-seed-above-uint32", ["experiments.run", *_DIGITS, "--config.seed=4294967296"],
     r"^experiments.run: config.seed=4294967296 is above 4294967295; it must be an int in "
     r"\[0, 4294967295\]$"),
    ("run-busy-workdir", ["experiments.run", *_DIGITS],
     r"^experiments.run: workdir='.*' is in use by another run \(pid \d+ on host "),
    ("sweep-refused-run", ["experiments.sweep", "--config=configs/sweeps/quickstart_methods.py:smoke",
                           "--config.overrides.compression.tasc.density=-1", "--workdir=w"],
     r"^experiments.sweep: sweep config: 1 of 3 runs refused, nothing trained: run 'tasc': "
     r".*density=-1.0 is outside"),
    ("reproduce-out-is-a-file", ["experiments.reproduce", "--target=f2", "--workdir=w",
                                 "--out=README.md"],
     r"^experiments.reproduce: \[Errno 17\] File exists: 'README.md'$"),
    ("bench-bad-size", ["experiments.bench", "compression", "--sizes", "0m", "--out", "w"],
     r"^experiments.bench: --sizes: '0m' is not a size"),
    ("bench-out-is-a-file", ["experiments.bench", "bytes", "--out", "README.md"],
     r"^experiments.bench: --out='README.md' is not a folder; allowed: a folder, or a path where "
     r"one can be made, for <name>.json and <name>.md$"),
    ("run-flag-named-as-a-config-field", ["experiments.run", *_DIGITS, "--method=topk"],
     r"^experiments.run: Unknown command line flag 'method'; the config has a field 'method': "
     r"set it with --config.method=topk \(--helpshort lists the flags\)$"),
    ("launch-unknown-module", ["experiments.launch", "--module=experiments.rnu", "--"],
     r"^experiments.launch: --module='experiments.rnu' names no module"),
    # ml_collections puts the traceback of get_config's error into the flag's message.
    ("run-config-argument-typo", ["experiments.run", "--config=configs/digits.py:smok",
                                  "--workdir=w"],
     r"^experiments.run: --config='configs/digits.py:smok': config argument 'smok': not "
     r"key=value, and the config has no variants \(did you mean 'smoke'\?\); allowed keys: "),
    ("sweep-config-not-python", ["experiments.sweep", "--config=README.md", "--workdir=w"],
     r"^experiments.sweep: --config='README.md': README.md cannot be run as a Python config file "
     r"\(SyntaxError: .*\); a config file is Python that defines get_config\(arg=None\)"),
    ("run-seed-above-2**32", ["experiments.run", *_DIGITS, "--config.seed=5000000000"],
     r"^experiments.run: config.seed=5000000000 .*4294967295"),
]


def _command_line(argv, tmp_path, *extra, verbose_env=None):
  argv = [str(tmp_path / "run") if a == "w" else a.replace("=w", f"={tmp_path / 'run'}")
          for a in argv]
  env = {k: v for k, v in os.environ.items() if k != cli.VERBOSE_ENV}
  env.update(JAX_DISABLE_MOST_OPTIMIZATIONS="1", XLA_FLAGS="", JAX_PLATFORMS="cpu")
  if verbose_env:
    env[cli.VERBOSE_ENV] = verbose_env
  return subprocess.run([sys.executable, "-m", *argv, *extra], cwd=ROOT, capture_output=True,
                        text=True, timeout=180, env=env)


# Slow: config validation's messages, each checked in-process above; on the command line they
# take the same one-line path as "run-typo-nested-field".
_ONE_LINE_SLOW = {"run-huge-device-count", "run-learning-rate-nan", "run-method-settings",
                  "run-seed-above-uint32", "run-seed-above-2**32"}


@pytest.mark.parametrize("name, argv, pattern", [
    pytest.param(*case, id=case[0], marks=[pytest.mark.slow] if case[0] in _ONE_LINE_SLOW else [])
    for case in _ONE_LINE])
def test_bad_input_on_a_command_line_is_one_line_without_a_traceback(name, argv, pattern,
                                                                      tmp_path):
  busy = name == "run-busy-workdir"
  with lock.hold(str(tmp_path / "run")) if busy else contextlib.nullcontext():
    completed = _command_line(argv, tmp_path)
  assert completed.returncode == 1, completed.stderr[-3000:]
  assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
  last = completed.stderr.strip().splitlines()[-1]
  assert re.search(pattern, last), completed.stderr[-3000:]


@pytest.mark.parametrize("how", ["--verbose", cli.VERBOSE_ENV])
def test_verbose_shows_the_traceback(how, tmp_path):
  argv = ["experiments.run", *_DIGITS, "--config.optimzer.learning_rate=0.1"]
  completed = (_command_line(argv, tmp_path, how) if how == "--verbose"
               else _command_line(argv, tmp_path, verbose_env="1"))
  assert completed.returncode == 1
  assert "Traceback" in completed.stderr and "optimzer" in completed.stderr
