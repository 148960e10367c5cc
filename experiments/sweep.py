r"""Runs a sweep: the runs a sweep config lists, one after another, in one process.

  python -m experiments.sweep --config=configs/sweeps/cifar10_compression.py \
      --config.overrides.data_dir=/data/cifar10 --config.overrides.num_epochs=1 \
      --workdir=runs/sweep

A sweep config (``configs/sweeps/*.py``) holds ``runs``, a list of
``{"name": ..., "config": "path/to/config.py[:arg]", "overrides": {...}}`` run in that order, and
``overrides`` applied to every run. ``--config.overrides.<field>=<value>`` on the command line
sets a field of every run, nested ones too (``--config.overrides.compression.tasc.density=0.02``),
whether or not the sweep config lists it: the value is read as a Python literal (a number,
``true``/``false``, a tuple in quotes), else as a string, and every run's config must have the
field (fields are documented in ``configs/common.py``). Run ``name`` works in
``workdir/name``: a run whose ``results.json`` exists is skipped, an unfinished one resumes from
its checkpoint. After every run ``workdir/summary.csv`` lists all finished runs. All runs share
one device count.

Every run's config, overrides applied, is checked as the runner checks it before the first run
trains: a config refused is one line naming the run, and nothing trains. A run that diverges (see
``experiments.run``) is recorded as such (``diverged`` and ``divergence`` in ``summary.csv`` and
its ``results.json``), and a run that fails when it starts (its data cannot be read, another run
holds its workdir, a model field that breaks its shapes, any exception) is recorded with its
one-line error (``error`` in ``summary.csv``); the sweep goes on with the other runs and then
exits with status 1, naming the failed and the diverged runs. Bad input is one line without a
traceback (``--verbose`` or ``TASC_JAX_VERBOSE=1`` shows it). SIGINT or SIGTERM stops the sweep
at the current run's next step boundary, after a checkpoint, and prints the command that resumes
it (status 130 or 143).
"""

import ast
import csv
import json
import os
import sys
from typing import Any

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections
from ml_collections import config_flags

from experiments import cli
from experiments import distributed
from experiments import interrupt
from experiments import methods
from experiments import train
from experiments import validation

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Sweep config file; --config.overrides.<field>=<value> sets a field of every "
    "run (fields: configs/common.py).", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the sweep.", required=True)
flags.mark_flags_as_required(["config"])

_OVERRIDES_FLAG = "--config.overrides."
SUMMARY_FIELDS = ("name", "dataset", "model", "method", "step", "test_accuracy", "test_loss",
                  "train_loss", "wire_bytes", "dense_bytes", "compression_ratio",
                  "examples_per_sec", "wall_seconds", "skipped_steps", "diverged", "divergence",
                  "error")


def load_config(spec: str) -> ml_collections.ConfigDict:
  """Loads ``path/to/config.py[:arg]`` by calling its ``get_config(arg)``; whatever fails there
  is one line naming the file (:func:`experiments.cli.load_config`)."""
  return cli.load_config(spec, "sweep: run config")


def run_configs(sweep: ml_collections.ConfigDict, *,
                one_device_count: bool = True) -> dict[str, ml_collections.ConfigDict]:
  """The config of every run of ``sweep``, overrides applied, in the listed order.

  Args:
    sweep: the sweep config.
    one_device_count: refuse runs of different ``num_devices`` (they train in this process,
      whose devices are set once); False where each run trains in a process of its own.
  """
  unknown = sorted(set(sweep) - {"runs", "overrides"})
  if unknown:
    raise ValueError(f"sweep config: unknown field {unknown[0]!r}; allowed: 'runs', 'overrides' "
                     "(--config.overrides.<field> sets a field of every run)")
  if not sweep.get("runs"):
    raise ValueError("sweep config: `runs` is empty; list runs as "
                     "[{'name': ..., 'config': 'configs/x.py:arg', 'overrides': {...}}, ...]")
  configs = {}
  for run in sweep.runs:
    name = run.get("name")
    if set(run) - {"name", "config", "overrides"} or "config" not in run or not name:
      raise ValueError(f"sweep config: every run needs `name` and `config` and may have "
                       f"`overrides`; found {run!r}")
    if name in configs:
      raise ValueError(f"sweep config: two runs are named {name!r}")
    config = load_config(run["config"])
    for overrides in (sweep.get("overrides", {}), run.get("overrides", {})):
      _override(config, overrides, f"run {name!r}", "")
    methods.fill_equal_bytes(config)  # after the overrides, which may change the request
    configs[name] = config
  counts = {c.num_devices for c in configs.values()}
  if one_device_count and len(counts) > 1:
    raise ValueError(f"sweep config: all runs must use one num_devices, found {sorted(counts)} "
                     "(the runs train in this process, whose devices are set once; "
                     "experiments.reproduce trains each run in a process of its own)")
  return configs


def check_runs(configs: dict[str, ml_collections.ConfigDict]) -> None:
  """Checks every run's config as the runner does when the run starts
  (:func:`experiments.validation.check_config`), so that a bad value stops the sweep before its
  first run trains rather than after the runs before it.

  Raises:
    ValueError: naming each refused run and why, on one line.
  """
  refused: dict[str, list[str]] = {}  # why -> the runs refused for it, in order
  for name, config in configs.items():
    try:
      validation.check_workers(config)
      devices = jax.device_count() if config.num_devices is None else config.num_devices
      validation.check_config(config, devices * config.workers_per_device)
    except (ValueError, TypeError, KeyError, NameError) as e:
      refused.setdefault(cli.one_line(e), []).append(name)
  if refused:
    # An override refused in every run is said once, not once per run.
    reasons = "; ".join(f"run{'s' if len(names) > 1 else ''} "
                        f"{', '.join(repr(n) for n in names)}: {why}"
                        for why, names in refused.items())
    count = sum(len(names) for names in refused.values())
    raise ValueError(f"sweep config: {count} of {len(configs)} runs refused, nothing trained: "
                     f"{reasons}")


def _override(config, overrides, where, prefix):
  for key, value in overrides.items():
    field = prefix + key
    if key not in config:
      raise ValueError(f"sweep config: {where} overrides unknown field {field!r}")
    if isinstance(config[key], ml_collections.ConfigDict) and isinstance(
        value, (dict, ml_collections.ConfigDict)):
      _override(config[key], value, where, field + ".")
      continue
    try:
      config[key] = value
    except TypeError:
      raise ValueError(f"sweep config: {where} overrides field {field!r} "
                       f"({type(config[key]).__name__}) with {value!r} "
                       f"({type(value).__name__})") from None


def take_overrides(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
  """Takes ``--config.overrides.<field>=<value>`` (or ``... <value>``) out of a command line.

  ml_collections accepts an override only of a field the sweep config has, and the fields to
  override are the runs' (:func:`add_overrides` puts them in the sweep config).

  Returns:
    The other arguments, and the overrides by dotted field name, values as written.

  Raises:
    ValueError: a flag without a value.
  """
  rest, overrides = [], {}
  args = iter(argv)
  for arg in args:
    name, sep, value = arg.partition("=")
    if not name.startswith(_OVERRIDES_FLAG):
      rest.append(arg)
      continue
    if not sep:
      value = next(args, None)
      if value is None:
        raise ValueError(f"{name} has no value; write {name}=<value>")
    overrides[name[len(_OVERRIDES_FLAG):]] = value
  return rest, overrides


def add_overrides(sweep: ml_collections.ConfigDict, overrides: dict[str, str]) -> None:
  """Adds command-line overrides (from :func:`take_overrides`) to ``sweep.overrides``.

  A value is read as a Python literal (``true``/``false`` too), else kept as written; where the
  sweep config already overrides the field with a string, as written.

  Raises:
    ValueError: a field whose parent the sweep config overrides with a value, not a block.
  """
  if "overrides" not in sweep:
    sweep.overrides = {}
  for field, text in overrides.items():
    *parents, name = field.split(".")
    node = sweep.overrides
    for i, parent in enumerate(parents):
      if parent not in node:
        node[parent] = {}
      node = node[parent]
      if not isinstance(node, ml_collections.ConfigDict):
        raise ValueError(f"{_OVERRIDES_FLAG}{field}: the sweep config overrides "
                         f"{'.'.join(parents[:i + 1])!r} with {node!r}, not a block of fields")
    node[name] = text if isinstance(node.get(name), str) else _literal(text)


def _literal(text: str) -> Any:
  if text in ("true", "false"):
    return text == "true"
  try:
    return ast.literal_eval(text)
  except (SyntaxError, ValueError):
    return text


def write_summary(workdir: str, configs: dict[str, ml_collections.ConfigDict],
                  failures: dict[str, str] | None = None) -> list[dict]:
  """Writes ``workdir/summary.csv`` with one row per finished run and per run of ``failures``
  (name -> error), in the order of ``configs``; returns the rows."""
  rows = []
  for name in configs:
    path = os.path.join(workdir, name, train.RESULTS_FILE)
    if not os.path.exists(path):
      if failures and name in failures:
        config = configs[name]
        rows.append({"name": name, "dataset": config.dataset, "model": config.model.get("name"),
                     "method": config.method, "error": failures[name]})
      continue
    with open(path) as f:
      results = json.load(f)
    with open(os.path.join(workdir, name, "config.json")) as f:
      config = json.load(f)
    rows.append({"name": name, "dataset": config["dataset"], "model": config["model"]["name"],
                 "method": config["method"], **{k: results[k] for k in SUMMARY_FIELDS
                                                if k in results}})
  # A sweep's first run may fail before it made its folder, or the sweep's.
  os.makedirs(workdir, exist_ok=True)
  tmp = os.path.join(workdir, "summary.csv.tmp")
  with open(tmp, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
    writer.writeheader()
    writer.writerows(rows)
  os.replace(tmp, os.path.join(workdir, "summary.csv"))
  return rows


def run_sweep(configs: dict[str, ml_collections.ConfigDict], workdir: str) -> list[dict]:
  """Runs every unfinished run of ``configs`` (from :func:`run_configs`) under ``workdir``;
  returns the summary rows. A run that raises (bad input, :data:`experiments.cli.BAD_INPUT`, or
  anything else: a model field that breaks its shapes, a crash in a library) is recorded with
  its one-line error (its row's ``error``; the traceback is logged with ``--verbose``) and the
  sweep goes on. A stop on a signal (:class:`experiments.interrupt.Interrupted`, Ctrl-C) is no
  run's failure: it stops the sweep."""
  is_main = jax.process_index() == 0
  failures = {}
  for name, config in configs.items():
    run_dir = os.path.join(workdir, name)
    if os.path.exists(os.path.join(run_dir, train.RESULTS_FILE)):
      logging.warning("sweep: %s is finished; skipping", name)
      continue
    try:
      train.train_and_evaluate(config, run_dir)
    except Exception as e:  # pylint: disable=broad-except  # recorded, the sweep goes on
      # Bad input's message says it all; anything else is named by its type too.
      failures[name] = (cli.one_line(e) if isinstance(e, cli.BAD_INPUT)
                        else f"{type(e).__name__}: {cli.one_line(e)}")
      logging.error("sweep: run %s failed: %s", name, failures[name], exc_info=cli.verbose())
    if is_main:
      write_summary(workdir, configs, failures)
  return write_summary(workdir, configs, failures) if is_main else []


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  with cli.errors_in_one_line("experiments.sweep"):
    configs = run_configs(_CONFIG.value)
    first = next(iter(configs.values()))
    validation.check_workers(first)  # before JAX builds the devices (all runs share them)
    distributed.expose_cpu_devices(first)
    check_runs(configs)
  try:
    rows = run_sweep(configs, _WORKDIR.value)
  except (interrupt.Interrupted, KeyboardInterrupt) as e:
    cli.exit_interrupted(e, is_main=distributed.process_settings(first)[2] == 0, name_run=True)
  for row in rows:
    print(f"{row['name']}: " + (f"failed: {row['error']}" if row.get("error") else
                                f"test accuracy {row['test_accuracy']:.4f}, "
                                f"{row['compression_ratio']:.1f}x fewer bytes than dense")
          + (f"; diverged: {row['divergence']}" if row.get("diverged") else ""), flush=True)
  failed = [row["name"] for row in rows if row.get("error")]
  diverged = [row["name"] for row in rows if row.get("diverged")]
  outcomes = []
  if failed:
    outcomes.append(f"{len(failed)} of {len(rows)} runs failed ({', '.join(failed)})")
  if diverged:
    outcomes.append(f"{len(diverged)} of {len(rows)} runs diverged ({', '.join(diverged)})")
  if outcomes:
    sys.exit(f"experiments.sweep: {'; '.join(outcomes)}; see "
             f"{os.path.join(_WORKDIR.value, 'summary.csv')}")


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with ``--config.overrides.<field>=<value>`` taken out first and added
  to the sweep config once it is loaded; a bad override is a one-line error."""
  with cli.errors_in_one_line("experiments.sweep", show_traceback=cli.verbose(argv)):
    argv, overrides = take_overrides(argv)
    sys.argv = argv  # ml_collections reads the config's overrides from sys.argv
    rest = cli.flags_parser("experiments.sweep")(argv)
    add_overrides(_CONFIG.value, overrides)
  return rest


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
