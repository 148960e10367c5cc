"""One home for each setting's rule: every field declares its type and range once, and a run, each
sweep run and the Python API's factories all check it from there, before anything is compiled.
Settings a run would not do as asked (an optimizer block a method ignores, an equal-bytes tier it
cannot meet, a warm-up longer than the run) are refused or warned about."""

import dataclasses
import json
import logging
import math
import os

import ml_collections
import pytest

import compressors
from compressors import checks
from compressors import registry
from configs import common
from configs import digits
from configs import lm_stdlib
from configs.paper import lm
from experiments import methods
from experiments import sweep
from experiments import train
from experiments import validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _digits(**fields):
  config = digits.get_config("smoke")
  config.update_from_flattened_dict(fields)
  return config


# ------------------------------------------------------------------------------------ the rules

@pytest.mark.parametrize("rule, value, error, message", [
    (checks.Rule(int, low=1), 0, ValueError, "x=0 is below 1; it must be an int >= 1"),
    (checks.Rule(int, low=1), 2.0, TypeError, "x must be an int >= 1, got 2.0"),
    (checks.Rule(int, low=1), True, TypeError, "x must be an int >= 1, got True"),
    (checks.SEED, 2**32, ValueError,
     "x=4294967296 is above 4294967295; it must be an int in [0, 4294967295]"),
    (checks.Rule(float, low=0, high=1, high_open=True), 1.0, ValueError, "x=1.0 is outside [0, 1)"),
    (checks.Rule(float, low=0), math.nan, ValueError, "x=nan is outside [0, inf)"),
    (checks.Rule(float, low=0, low_open=True), math.inf, ValueError, "x=inf is outside (0, inf)"),
    (checks.Rule(float, low=0), "1", TypeError, "x must be a number in [0, inf), got '1'"),
    (checks.Rule(str, choices=("a", "b")), "c", ValueError,
     "x='c' is unknown; allowed: ('a', 'b')"),
    (checks.Rule(bool), 1, TypeError, "x must be True or False, got 1"),
    (checks.Rule(float, low=0, high=1, each=True), (0.5, 1.5), ValueError,
     "x[1]=1.5 is outside [0, 1]"),
    (checks.Rule(float, low=0, optional=True), -1.0, ValueError, "x=-1.0 is outside [0, inf)"),
])
def test_a_rule_names_the_setting_the_value_and_what_is_allowed(rule, value, error, message):
  with pytest.raises(error) as raised:
    rule.check(value, "x")
  assert str(raised.value) == message


def test_a_rule_takes_what_it_allows():
  assert checks.Rule(float, low=0, optional=True).check(None, "x") is None
  assert checks.Rule(float, low=0, high=1).check(1, "x") == 1  # an int is a number
  assert checks.SEED.check(2**32 - 1, "x") == 2**32 - 1
  assert checks.Rule(float, low=0, high=1, each=True).check((0.5, 0.75), "x") == (0.5, 0.75)


def test_every_field_of_the_configs_declares_its_rule():
  """A field added to configs/common.py's base() without a rule in RULES fails here: the rule is
  what a run, a sweep and the factories check."""
  def paths(block, prefix=""):
    for key, value in block.items():
      if isinstance(value, ml_collections.ConfigDict) and key not in ("data", "model"):
        yield from paths(value, f"{prefix}{key}.")
      else:
        yield prefix + key
  # `data` and `model` are the dataset's and the model's to check; `compression.<method>` the
  # method's own settings (below).
  declared = common.rules()
  undeclared = [p for p in paths(common.base())
                if p not in declared and p not in ("data", "model")
                and p.split(".")[1:2] not in ([n] for n in registry.names())]
  assert not undeclared
  assert set(checks.rules_of(registry.Common)) == {f.name for f in dataclasses.fields(
      registry.Common)}


@pytest.mark.parametrize("name", [n for n in registry.names()
                                  if checks.rules_of(registry.get(n).settings)])
def test_a_methods_settings_check_their_declared_rules_when_made(name):
  settings = registry.get(name).settings
  for field in checks.rules_of(settings):
    with pytest.raises(TypeError, match=rf": {field} must be "):
      settings(**{field: object()})


# ------------------------------------------------------------- refused before anything compiles

@pytest.mark.parametrize("fields, message", [
    ({"optimizer.name": "adam", "optimizer.b1": 1.5},
     r"config.optimizer.b1=1.5 is outside \[0, 1\)"),
    ({"optimizer.name": "momentum", "optimizer.momentum": -0.5},
     r"config.optimizer.momentum=-0.5 is outside \[0, 1\)"),
    ({"optimizer.eps": 0.0}, r"config.optimizer.eps=0.0 is outside \(0, inf\)"),
    ({"schedule.name": "step", "schedule.boundaries": (0.5, 1.5)},
     r"config.schedule.boundaries\[1\]=1.5 is outside \[0, 1\]"),
    ({"compression.seed": -1}, r"config.compression.seed=-1 is below 0; it must be an int in "
                               r"\[0, 4294967295\]"),
    ({"compression.seed": 2**32}, r"config.compression.seed=4294967296 is above 4294967295"),
    ({"seed": 2**40}, r"config.seed=1099511627776 is above 4294967295"),
    ({"schedule.warmup_steps": 2}, r"config.schedule.warmup_steps=2 not fewer than the 2 "
                                   r"training steps \(config.num_steps\)"),
    ({"schedule.name": "mlperf_lars", "schedule.warmup_epochs": 1.0},
     r"config.schedule.warmup_epochs=1.0 with schedule.name='mlperf_lars', whose warm-up comes "
     r"from the batch size"),
    ({"method": "powersgd", "compression.powersgd.rank": 0},
     r"config.compression.powersgd.rank=0 is below 1"),
    ({"method": "threshold", "compression.threshold.value": -1.0},
     r"config.compression.threshold.value=-1.0 is outside \(0, inf\)"),
    ({"method": "topk", "compression.exchanged": "weights"},
     r"config.compression.exchanged='weights' is unknown; allowed: \('gradient', 'update'\)"),
    ({"method": "dgc", "compression.dgc.momentum": 1.0},
     r"config.compression.dgc.momentum=1.0 is outside \[0, 1\)"),
    ({"method": "demo", "compression.error_feedback": False},
     r"error_feedback=False with method 'demo', which is its own optimizer"),
])
def test_a_setting_outside_its_rule_is_refused_naming_the_field(fields, message):
  with pytest.raises((ValueError, TypeError), match=message):
    validation.check_config(_digits(**fields), 8)


def test_a_sweep_override_is_checked_by_the_same_rules():
  run = {"name": "a", "config": os.path.join(ROOT, "configs", "digits.py") + ":smoke"}
  configs = sweep.run_configs(ml_collections.ConfigDict(
      {"runs": [run], "overrides": {"optimizer": {"b1": 1.5}, "compression": {"seed": -3}}}))
  with pytest.raises(ValueError, match=r"run 'a': config.optimizer.b1=1.5 is outside \[0, 1\)"):
    sweep.check_runs(configs)


def test_the_python_apis_factories_check_the_same_rules():
  config = _digits(**{"optimizer.name": "adam", "optimizer.b1": 1.5})
  with pytest.raises(ValueError, match=r"config.optimizer.b1=1.5 is outside \[0, 1\)"):
    methods.optimizer(config, 0.1)
  with pytest.raises(ValueError, match=r"config.optimizer.name='adagrad' is not allowed"):
    methods.optimizer(_digits(**{"optimizer.name": "adagrad"}), 0.1)
  with pytest.raises(ValueError, match=r"config.schedule.name='linear' is not allowed"):
    methods.learning_rate_schedule(_digits(**{"schedule.name": "linear"}), 10, 100)
  with pytest.raises(ValueError, match=r"Common: seed=4294967296 is above 4294967295"):
    registry.Common(seed=2**32)
  with pytest.raises(ValueError, match=r"powersgd: rank=0 is below 1"):
    registry.default_settings("powersgd", rank=0)
  with pytest.raises(ValueError, match=r"threshold: value=inf is outside \(0, inf\)"):
    registry.default_settings("threshold", value=math.inf)
  with pytest.raises(ValueError, match=r"threshold: value=inf must be a positive number .*finite"):
    compressors.threshold(math.inf)
  with pytest.raises(ValueError, match=r"local updates: outer_momentum=1.0 is outside \[0, 1\)"):
    registry.default_settings("sparseloco", outer_momentum=1.0)


def test_the_repositorys_configs_keep_to_the_rules():
  """Every default, and the paper's LM grid as the runner solves it, passes (the run configs
  and the sweeps are checked in tests/test_configs.py)."""
  for name in registry.names():
    registry.get(name).settings()
  validation.check_config(lm.get_config("method=powersgd,ratio=100"), 8)


# ---------------------------------------------------------------------- said, when not refused

def test_a_method_that_is_its_own_optimizer_names_the_optimizer_fields_it_ignores(caplog):
  config = _digits(**{"method": "demo"})  # digits trains with Adam (eps 1e-8)
  with caplog.at_level(logging.WARNING):
    validation.check_config(config, 8)
  assert ("config.method='demo' is its own optimizer (its settings: config.compression.demo; of "
          "config.optimizer it takes only learning_rate, under config.schedule): "
          "config.optimizer's eps=1e-08, name='adam' are not used"
          in caplog.text)
  assert not validation.unused_settings(_digits(**{"method": "topk"}))


def test_optimizer_and_schedule_fields_the_named_ones_ignore_are_named():
  lines = validation.unused_settings(_digits(**{"optimizer.weight_decay": 1e-4,
                                                "schedule.power": 2.0}))
  assert lines == ["config.optimizer.name='adam' does not use config.optimizer's "
                   "weight_decay=0.0001 (it takes b1, b2, eps)",
                   "config.schedule.name='cosine' does not use config.schedule's power=2.0"]


def test_step_kinds_that_no_step_of_the_run_reaches_are_named():
  lines = validation.unused_settings(_digits(**{"method": "onebit_adam"}))
  assert [line for line in lines if "step kinds" in line] == [
      "config.method='onebit_adam': none of the run's 2 steps (config.num_steps) is of its step "
      "kinds 'compressed' (from step 100, every 1): a warm-up or a period longer than the run"]


@pytest.mark.parametrize("arg, met, on_tier", [
    ("method=topk,ratio=10000000", 29408.0, False),
    ("method=fp16,ratio=1000", 2.0, False),
    ("method=powersgd,ratio=100", 33.9, False),  # T1-LM's row off its tier on purpose
    ("method=tasc,ratio=100", 98.8, True),
    ("method=dense,ratio=100", 1.0, False),
])
def test_an_equal_bytes_tier_that_is_not_met_is_warned_about_and_recorded(arg, met, on_tier):
  config = lm.get_config(arg)
  methods.fill_equal_bytes(config)
  tier = methods.equal_bytes_tier(config)
  assert tier["ratio"] == config.equal_bytes.ratio and tier["workers"] == 8
  assert tier["met_ratio"] == pytest.approx(met, rel=1e-3) and tier["on_tier"] == on_tier
  lines = [line for line in validation.unused_settings(config) if "equal_bytes" in line]
  if on_tier or met == 1:  # dense is the reference the tiers are measured from
    assert not lines
  else:
    assert lines == [f"config.equal_bytes.ratio={config.equal_bytes.ratio!r} is not met by "
                     f"config.method={config.method!r}: it sends {met:.3g}x fewer bytes than "
                     f"dense at 8 workers ({tier['note']}); the run trains off its tier "
                     "(recorded in results.json)"]
  del config.equal_bytes
  assert methods.equal_bytes_tier(config) is None


@pytest.mark.slow
def test_results_record_the_tier_asked_and_met(tmp_path):
  config = lm_stdlib.get_config(f"smoke,cache={tmp_path / 'tokenizers'}")
  config.method = "topk"
  config.equal_bytes = ml_collections.ConfigDict(dict(ratio=1e7, workers=8))
  train.train(config, str(tmp_path / "run"))
  with open(tmp_path / "run" / "results.json") as f:
    recorded = json.load(f)["equal_bytes"]
  assert recorded["ratio"] == 1e7 and not recorded["on_tier"] and recorded["met_ratio"] > 1
