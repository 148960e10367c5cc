"""Adding a method takes its module and its test: a toy compressor registered here runs through
the runner's smoke config and every shared check (tests/method_checks.py), with per-step inputs
the trainer makes without naming it, and no change anywhere else. Also the registry's own API.
"""

import ast
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import compressors
from compressors import registry
from compressors.network import topology
from configs import quickstart
from experiments import methods
from experiments import train
from tests import method_checks

pytestmark = pytest.mark.usefixtures("fast_compiles")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TRACED_INPUTS = []


def halves(first: int = 0) -> compressors.Compressor:
  """A toy: every step sends the entries of one parity (even, then odd, from ``first``), at
  indices every worker knows, so payloads are summed. A per-step input ``weight`` (a pytree like
  the gradients), when the step passes one, scales the payload before the sum."""
  def indices(ctx):
    """``ceil(d / 2)`` slots (static); an odd step of an odd ``d`` leaves the last one past the
    end, where gathers read 0 and scatters drop it."""
    return 2 * jnp.arange(-(-ctx.size // 2)) + (ctx.step + first) % 2

  def encode(x, state, ctx):
    values = x.at[indices(ctx)].get(mode="fill", fill_value=0)
    if "weight" in ctx.extras:
      values = values * ctx.extras["weight"].at[indices(ctx)].get(mode="fill", fill_value=0)
    return values, state

  def decode(values, ctx):
    return jnp.zeros((ctx.size,), values.dtype).at[indices(ctx)].set(values, mode="drop")

  def sent_mask_of(values, ctx):
    del values
    return jnp.zeros((ctx.size,), bool).at[indices(ctx)].set(True, mode="drop")

  return compressors.Compressor(name="halves", encode=encode, decode=decode, exchange="psum",
                                sent_mask_of=sent_mask_of, extra_args=("weight",))


@dataclasses.dataclass(frozen=True)
class HalvesSettings:
  first: int = 0
  weigh_every: int = 2


def _weights(s: HalvesSettings) -> registry.StepInputs:
  def make(loss_fn, params, batch, key, axis_name):
    del loss_fn, batch, key, axis_name
    _TRACED_INPUTS.append(True)
    return {"weight": jax.tree.map(jnp.ones_like, params)}
  return registry.StepInputs(every=s.weigh_every, make=make)


HALVES = registry.Method(
    name="halves", summary="a toy: one parity of the entries per step", settings=HalvesSettings,
    compressor=lambda s: halves(s.first), step_inputs=_weights,
    cost=lambda s, shapes, topo, schedule: topology.all_reduce_cost(
        schedule, topo, -(-registry.num_elements(shapes) // 2)))


@pytest.fixture
def toy():
  registry.register(HALVES)
  yield HALVES
  registry.unregister("halves")


@pytest.mark.slow  # a variant of the runner's smoke runs
def test_a_registered_toy_trains_through_the_runner(toy, tmp_path):
  del _TRACED_INPUTS[:]
  config = quickstart.get_config("smoke")
  config.method = "halves"
  config.num_steps = 3
  results = train.train_and_evaluate(config, str(tmp_path))
  assert _TRACED_INPUTS, "the trainer did not make the method's per-step inputs"
  # Half the entries of the float32 all-reduce, by the compiled program.
  assert results["compression_ratio"] == pytest.approx(2, rel=1e-3)
  with open(os.path.join(tmp_path, "config.json")) as f:
    assert json.load(f)["compression"]["halves"] == {"first": 0, "weigh_every": 2}


def test_a_registered_toy_passes_every_shared_check(toy):
  method_checks.run_all("halves", slow=False)


@pytest.mark.slow
def test_a_registered_toy_passes_the_slow_shared_checks(toy):
  for check in method_checks.SLOW_CHECKS:
    check("halves")


def test_registering_twice_needs_replace_and_unknown_names_list_the_known(toy):
  with pytest.raises(ValueError, match="'halves' is registered already; pass replace=True"):
    registry.register(HALVES)
  registry.register(HALVES, replace=True)
  with pytest.raises(ValueError, match=r"method 'halvez' is not registered; registered methods: "
                                       r"\[.*'halves'"):
    registry.get("halvez")


def test_a_method_needs_one_builder_and_defaults_for_every_setting():
  @dataclasses.dataclass(frozen=True)
  class NoDefault:
    density: float

  cost = lambda s, shapes, topo, schedule: None
  with pytest.raises(ValueError,
                     match="exactly one of compressor=, transformation=, optimizer= or local="):
    registry.Method(name="x", summary="", settings=HalvesSettings, cost=cost)
  with pytest.raises(ValueError, match=r"settings fields \['density'\] have no default"):
    registry.Method(name="x", summary="", settings=NoDefault, cost=cost,
                    compressor=lambda s: halves())


def test_unknown_settings_and_common_settings_that_do_not_fit_are_named():
  with pytest.raises(ValueError, match="method 'topk' has no setting 'rank'; its settings: "
                                       r"\['density', 'sample_fraction', 'selection'\]"):
    registry.default_settings("topk", rank=2)
  with pytest.raises(ValueError, match=r"clip_norm=1.0 is momentum correction's local clipping, "
                                       "but momentum_correction=0"):
    registry.transformation("topk", axis_name="data", common=registry.Common(clip_norm=1.0))
  with pytest.raises(ValueError, match="momentum_correction=0.9 with method 'signsgd' needs "
                                       "error feedback"):
    registry.transformation("signsgd", axis_name="data",
                            common=registry.Common(momentum_correction=0.9))


def test_the_trainer_and_configs_name_no_method():
  """The runner reads methods from the registry: no method name in the trainer, and every
  registered method has its config block."""
  with open(train.__file__) as f:
    source = f.read()
  assert not [m for m in registry.names() if f'"{m}"' in source or f"'{m}'" in source
              if m != "dense"]  # dense: the baseline the trainer compiles for the ratio
  config = quickstart.get_config()
  assert set(registry.names()) <= set(config.compression)
  assert methods.settings(config) == registry.default_settings(
      "tasc", **config.compression.tasc.to_dict())


def test_tasc_joins_the_table_when_imported_and_compressors_never_imports_it():
  """No hidden import: the registry lists compressors' own built-ins and does not import tasc;
  importing tasc registers TASC's method, and then every built-in is listed in the order of
  ``BUILTIN`` (which also says that each built-in module adds exactly its methods)."""
  script = ("import sys\n"
            "from compressors import registry\n"
            "assert 'tasc' not in sys.modules, 'importing the registry imported tasc'\n"
            "assert 'tasc' not in registry.names()\n"
            "import tasc\n"
            "assert registry.names() == registry.BUILTIN, registry.names()\n"
            "assert registry.get('tasc').name == 'tasc'\n")
  subprocess.run([sys.executable, "-c", script], check=True, cwd=_ROOT, timeout=300)


def _method_modules() -> dict[str, str]:
  """Module name -> path of every module that declares built-in ``METHODS``."""
  found = {}
  for package in ("compressors", "tasc"):
    for name in sorted(os.listdir(os.path.join(_ROOT, package))):
      path = os.path.join(_ROOT, package, name)
      if name.endswith(".py"):
        with open(path) as f:
          if "\nMETHODS = " in f.read():
            found[f"{package}.{name[:-3]}"] = path
  return found


def test_method_modules_declare_and_do_not_register_or_import_the_wrapper():
  """Each built-in module declares its ``METHODS`` (added by the registry, or by tasc's
  package); none calls ``register``, no module of a compressor method imports
  ``wrapper``/``_momentum`` (a method that is its own optimizer, as 1-bit Adam, or a
  transformation, as TASC, runs a compressor through the wrapper, a layer above it), and the
  table imports neither."""
  modules = _method_modules()
  assert {m.name for name in modules
          for m in __import__(name, fromlist=["METHODS"]).METHODS} == set(registry.BUILTIN)
  per_step = {name for name in modules  # TASC's transformation runs the wrapper itself
              if all(m.compressor is not None
                     for m in __import__(name, fromlist=["METHODS"]).METHODS)}
  for module_name, path in {**modules, "compressors.method_table": os.path.join(
      _ROOT, "compressors", "method_table.py")}.items():
    with open(path) as f:
      tree = ast.parse(f.read())
    imported = {alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    if module_name in per_step | {"compressors.method_table"}:
      assert not imported & {"wrapper", "_momentum"}, module_name
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "register"]
    assert not calls, f"{module_name} calls register; declare METHODS instead"


def test_old_names_warn_or_say_the_new_one():
  with pytest.warns(DeprecationWarning, match='names\\(family="per_step"\\)'):
    assert registry.names("exchange") == registry.names("per_step")
  from compressors.parallel import step_kinds  # pylint: disable=import-outside-toplevel
  with pytest.raises(AttributeError, match="now compressors.method_protocol.in_stages"):
    step_kinds.in_stages  # pylint: disable=pointless-statement


def test_a_local_update_method_names_its_carrier():
  """What the assembly needs of a local-update family is a hook of its record: its carrier
  (the per-step method that exchanges its pseudo-gradient) prices it and makes its inputs."""
  diloco = registry.get("diloco")
  assert diloco.carrier(diloco.settings(carrier="tasc")) == "tasc"
  assert registry.steps_per_exchange("diloco", diloco.settings(every=7)) == 7
  assert registry.steps_per_exchange("topk") == 1
  with pytest.raises(ValueError, match="a local-update method \\(local=\\) needs carrier="):
    registry.Method(name="x", summary="", settings=diloco.settings, local=lambda *a, **k: None)


def test_a_local_update_methods_h_and_synchronisation_are_read_through_its_hooks():
  """The solver sets H through ``with_sends_every`` (the method's own checks run); the kinds
  declare what they send and land: DiLoCo's synchronisation the whole model, Streaming
  DiLoCo's kinds one fragment each, as their options run it (``Method.parts`` gives the
  fragments' shapes)."""
  diloco = registry.with_steps_per_exchange("diloco", registry.default_settings("diloco"), 7)
  assert registry.steps_per_exchange("diloco", diloco) == 7
  with pytest.raises(ValueError, match="every=2 with fragments=4"):
    registry.with_steps_per_exchange("streaming_diloco",
                                     registry.default_settings("streaming_diloco"), 2)
  with pytest.raises(ValueError, match="'topk' exchanges every step"):
    registry.with_steps_per_exchange("topk", registry.default_settings("topk"), 2)
  with pytest.raises(ValueError, match="sends_every= and with_sends_every= come together"):
    registry.Method(name="x", summary="", settings=type(diloco), local=lambda *a, **k: None,
                    carrier=lambda s: "dense", sends_every=lambda s: 1)
  kinds = {k.name: k for k in registry.step_kinds("diloco", diloco)}
  whole = compressors.method_protocol.WHOLE_MODEL
  assert (kinds["sync"].sends, kinds["sync"].lands) == (whole, whole)
  assert kinds["sync"].synchronises and not kinds["local"].synchronises
  assert (kinds["local"].sends, kinds["local"].lands) == (None, None)
  streaming = registry.default_settings("streaming_diloco", every=8, fragments=2, overlap=1)
  for kind in registry.step_kinds("streaming_diloco", streaming):
    options = kind.update_kwargs()
    assert (kind.sends, kind.lands) == (options.get("sync"), options.get("apply")), kind.name
    assert not kind.synchronises
  # 22 entries: the (6, 3) leaf cut into two pieces of 3 rows, the (4,) one whole.
  parts = registry.get("streaming_diloco").parts(streaming, [(6, 3), (4,)])
  assert parts == [[(3, 3), (4,)], [(3, 3)]]
