"""Configs: every file loads in every variant, and bad values fail clearly before compiling."""

import ast
import glob
import importlib
import os
import subprocess
import sys

import ml_collections
import pytest

from compressors import registry
from configs import common
from experiments import methods
from experiments import sweep
from experiments import validation
import optimizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                     if os.path.basename(p) not in ("__init__.py", "common.py", "cifar.py"))
SWEEP_CONFIGS = sorted(os.path.basename(p)[:-3]
                       for p in glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.py"))
                       if not p.endswith("__init__.py"))


def _get(name, arg=None):
  return importlib.import_module(f"configs.{name}").get_config(arg)


def test_every_documented_config_exists():
  expected = {"quickstart", "digits", "cifar10_resnet20", "cifar10_wrn", "cifar10_vgg19",
              "cifar100_resnet56", "cifar100_wrn", "cifar100_vgg19", "imagenet_resnet50", "bert"}
  assert expected <= set(RUN_CONFIGS)


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_configs_are_valid_and_documented(name):
  module = importlib.import_module(f"configs.{name}")
  for part in ("python -m experiments.run", "Expected", "untime"):
    assert part in module.__doc__, f"configs/{name}.py's docstring lacks {part!r}"
  config, smoke = module.get_config(), module.get_config("smoke")
  assert isinstance(config, ml_collections.ConfigDict)
  for c in (config, smoke):
    validation.check_config(c, c.num_devices or 8)
  assert smoke.num_steps == 2 and smoke.num_epochs == 0


@pytest.mark.parametrize("name", [n for n in RUN_CONFIGS if n.startswith("cifar")])
@pytest.mark.parametrize("method", registry.names())
def test_cifar_configs_take_every_method(name, method):
  config = _get(name, f"method={method}")
  assert config.method == method
  validation.check_config(config, 8)


@pytest.mark.parametrize("name", SWEEP_CONFIGS)
def test_sweep_configs_list_loadable_runs(name):
  for arg in (None, "smoke"):
    sweep_config = importlib.import_module(f"configs.sweeps.{name}").get_config(arg)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
      configs = sweep.run_configs(sweep_config)
    finally:
      os.chdir(cwd)
    assert configs
    for config in configs.values():
      validation.check_config(config, config.num_devices)
      if arg == "smoke":
        assert config.num_steps == 2


def test_bert_variants():
  base, tiny = _get("bert", "base"), _get("bert", "tiny,pydoc=true")
  assert (base.model.hidden, base.model.num_layers, base.data.vocab_size) == (768, 12, 30522)
  assert (tiny.model.hidden, tiny.model.num_layers, tiny.dataset) == (128, 2, "pydoc_text")
  assert base.dataset == "text" and base.optimizer.name == "lamb"
  with pytest.raises(ValueError, match="variant 'huge'"):
    _get("bert", "huge")


def test_imagenet_uses_lars_with_the_mlperf_schedule():
  config = _get("imagenet_resnet50", "method=tasc")
  assert (config.optimizer.name, config.schedule.name, config.method) == (
      "lars", "mlperf_lars", "tasc")


@pytest.mark.parametrize("arg, message", [
    ("methd=topk", "unknown key 'methd'"),
    ("smoke=maybe", "must be true or false"),
])
def test_bad_config_arguments(arg, message):
  with pytest.raises(ValueError, match=message):
    _get("cifar10_resnet20", arg)


def test_parse_args_types():
  assert common.parse_args("smoke,method=topk,tiny", method="dense", smoke=False,
                           variant="base") == {"method": "topk", "smoke": True, "variant": "tiny"}


def _with(**fields):
  config = _get("quickstart", "smoke")
  config.update_from_flattened_dict(fields)
  return config


@pytest.mark.parametrize("fields, message", [
    (dict(method="gzip"), "config.method='gzip' is not a known method; known: .*'tasc'"),
    (dict(**{"model.name": "transformer9"}), "config.model.name='transformer9' is not a known model"),
    (dict(dataset="mnist"), "config.dataset='mnist' is not a known dataset"),
    (dict(**{"optimizer.name": "adagrad"}), "config.optimizer.name='adagrad'"),
    (dict(**{"schedule.name": "linear"}), "config.schedule.name='linear'"),
    (dict(batch_size=100), "config.batch_size=100 must be divisible by the 8 workers"),
    (dict(batch_size=0), "config.batch_size=0 is below 1; it must be an int >= 1"),
    (dict(num_steps=0), "exactly one of config.num_steps=0 and config.num_epochs=0"),
    (dict(**{"optimizer.learning_rate": -1.0}), r"learning_rate=-1.0 is outside \[0, inf\)"),
    (dict(**{"compression.tasc.hessian_every": 0}),
     r"config.method='tasc' with config.compression.tasc=.*hessian_every=0 is below 1"),
    (dict(**{"compression.tasc.density": 1.5}), r"config.compression.tasc=.*density=1.5"),
    (dict(log_every=-1), "config.log_every=-1"),
])
def test_bad_values_fail_validation(fields, message):
  with pytest.raises(ValueError, match=message):
    validation.check_config(_with(**fields), 8)


def test_a_config_without_the_methods_block_names_it():
  config = _with(method="topk")
  del config.compression["topk"]
  with pytest.raises(ValueError, match="config.compression has no block 'topk'"):
    validation.check_config(config, 8)


@pytest.mark.parametrize("schedule, warmup_epochs, expected", [
    # steps_per_epoch=10, 100 steps, peak 0.4
    ("constant", 0.5, {0: 0.0, 2: 0.16, 5: 0.4, 99: 0.4}),
    ("step", 0.0, {0: 0.4, 49: 0.4, 50: 0.04, 74: 0.04, 75: 0.004, 99: 0.004}),
    ("cosine", 0.0, {0: 0.4, 50: 0.2, 100: 0.0}),
    ("cosine", 1.0, {0: 0.0, 5: 0.2, 10: 0.4, 55: 0.2}),
    ("warmup_poly", 1.0, {0: 0.0, 10: 0.4, 55: 0.2, 100: 0.0}),
])
def test_learning_rate_schedules(schedule, warmup_epochs, expected):
  config = _get("quickstart")
  config.optimizer.learning_rate = 0.4
  config.schedule.update(dict(name=schedule, warmup_epochs=warmup_epochs, power=1.0))
  lr = methods.learning_rate_schedule(config, steps_per_epoch=10, total_steps=100)
  for step, value in expected.items():
    assert float(lr(step)) == pytest.approx(value, abs=1e-7), step


def test_mlperf_schedule_comes_from_the_optimizers_package():
  config = _get("imagenet_resnet50")
  lr = methods.learning_rate_schedule(config, steps_per_epoch=312, total_steps=12792)
  reference = optimizers.mlperf_lars_schedule(4096, 312, 12792)
  for step in (0, 100, 1560, 5000, 12792):
    assert float(lr(step)) == float(reference(step))


def test_warmup_in_steps():
  config = _get("quickstart")
  config.optimizer.learning_rate = 0.4
  config.schedule.update(dict(name="cosine", warmup_epochs=0.0, warmup_steps=10))
  lr = methods.learning_rate_schedule(config, steps_per_epoch=1000, total_steps=100)
  for step, value in {0: 0.0, 5: 0.2, 10: 0.4, 55: 0.2}.items():
    assert float(lr(step)) == pytest.approx(value, abs=1e-7), step
  config.schedule.warmup_epochs = 1.0
  with pytest.raises(ValueError, match="warmup_epochs=1.0 and warmup_steps=10 are both set"):
    methods.learning_rate_schedule(config, steps_per_epoch=10, total_steps=100)
  config.schedule.update(dict(warmup_epochs=0.0, warmup_steps=100))
  with pytest.raises(ValueError, match="warmup_steps=100 not fewer than the 100 training steps"):
    methods.learning_rate_schedule(config, steps_per_epoch=10, total_steps=100)


def test_warmup_longer_than_training_is_rejected():
  config = _get("quickstart")
  with pytest.raises(ValueError, match="warmup_epochs=2.0 is 20 steps, not fewer than the 20"):
    methods.learning_rate_schedule(config, steps_per_epoch=10, total_steps=20)


CONFIG_MODULES = sorted(
    os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".")
    for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.py"), recursive=True)
    if not p.endswith("__init__.py"))

_CONFIGS_ARE_DATA = """
import importlib, sys
modules = sys.argv[1:]
for name in modules:
  importlib.import_module(name)
assert "experiments" not in sys.modules, "importing configs imported experiments"
for name in modules:
  module = sys.modules[name]
  if hasattr(module, "get_config"):
    module.get_config()
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "experiments")
assert not loaded, f"get_config imported {loaded}"
"""


def test_no_config_imports_experiments():
  """Configs are data: no module under configs/ imports ``experiments`` (what traces a model or
  reads a corpus lives there)."""
  for name in CONFIG_MODULES:
    with open(os.path.join(ROOT, *name.split(".")) + ".py") as f:
      tree = ast.parse(f.read())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names]
    imported += [node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module]
    assert not [m for m in imported if m.split(".")[0] == "experiments"], name


def test_getting_every_config_reads_no_corpus_and_traces_no_model():
  """In a fresh process, importing every config and calling each ``get_config()`` leaves
  ``experiments`` (the corpus reader, the models) unimported."""
  subprocess.run([sys.executable, "-c", _CONFIGS_ARE_DATA, *CONFIG_MODULES], check=True,
                 cwd=ROOT, timeout=600)
