"""Fake run directories of the language-model tables (T1-LM, F4-LM, F5), as the runner leaves
them: nothing is trained or compiled, the configs are ``configs/paper/t1_lm.py``'s own, solved as
the runner solves them."""

import functools
import json
import os

from configs.paper import f6_lm
from configs.paper import f7_lm
from configs.paper import lm
from configs.paper import t1_lm as sweep_config
from experiments import methods
from experiments import provenance
from experiments.reproduce import report as reproduce_report
from experiments.reproduce import t1_lm

PROV = reproduce_report.Provenance(
    provenance.record(command_line="python -m experiments.reproduce --target=t1_lm"), "quick")


CPU_TIER_PARAMS = 235_264  # the CPU tier's decoder, as its runs' results.json report it


@functools.cache
def _solved_dict(arg: str) -> str:
  config = lm.get_config(arg)
  methods.fill_equal_bytes(config)
  return json.dumps(config.to_dict())


def solved(arg: str) -> dict:
  """``configs/paper/lm.py:arg`` as the runner trains it (its equal-bytes request solved), as a
  dict (its config.json)."""
  return json.loads(_solved_dict(arg))


def config_arg(label: str, scale: float, seed: int) -> str:
  """The ``configs/paper/lm.py`` argument of a run of a T1-LM, F6-LM or F7-LM label (F7-LM's:
  ``<row>_len<k>``)."""
  if "_len" in label:
    row, length = f7_lm.parse_label(label)
    return config_arg(row, scale, seed) + f",steps_scale={length}"
  if label in sweep_config.rows() or label in sweep_config.f4_rows():
    return sweep_config.config_arg(label, "cpu", scale, seed, 8)
  return f6_lm.config_arg(label, scale, seed)


def fake_run(workdir, label, seed, *, scale=1.0, val_losses, train_loss=None, step_s=0.5,
             wire=1000.0, dense=1e5, bytes_by_kind=None, corpus="c0ffee", **args):
  """A finished run of row ``label`` at rate scale ``scale``: validation losses at steps 10, 20,
  ...; training losses ``train_loss`` (a float: every logged step; default the validation loss
  + 0.1); ``step_s`` seconds a step; ``bytes_by_kind`` each step kind's bytes (default ``wire``
  for every kind of the row's method), charged as the runner charges them (``wire_bytes`` their
  mean over the steps run) against dense's ``dense``; ``corpus`` the corpus's sha256 it records.
  ``args`` override the row's ``configs/paper/lm.py`` arguments."""
  arg = config_arg(label, scale, seed)
  if args:
    arg += "," + ",".join(f"{k}={v}" for k, v in args.items())
  config = solved(arg)
  steps = [10 * (i + 1) for i in range(len(val_losses))]
  counts = t1_lm.kind_counts(config, steps[-1])
  by_kind = bytes_by_kind or {kind: wire for kind in counts}
  mean = sum(by_kind[k] * n for k, n in counts.items() if n) / steps[-1]
  records = [{"step": s, "loss": (loss + 0.1) if train_loss is None else train_loss,
              "examples_per_sec": config["batch_size"] / step_s}
             for s, loss in zip(steps, val_losses)]
  records += [{"step": s, "test_loss": loss} for s, loss in zip(steps, val_losses)]
  reproduce_report.write_run(
      os.path.join(workdir, sweep_config.run_name(label, scale, seed)), config, records,
      {"test_loss": val_losses[-1], "test_bits_per_byte": val_losses[-1] / 2,
       "wire_bytes": mean, "dense_bytes": dense, "compression_ratio": dense / mean if mean else None,
       "bytes_by_kind": by_kind, "python_version": "3.11.7",
       "corpus_sha256": corpus, "corpus_files": 734, "corpus_bytes": 12_000_000,
       "tokenizer_sha256": "beef", "step": steps[-1], "num_params": CPU_TIER_PARAMS,
       "num_workers": config["num_devices"] * config["workers_per_device"]})


def tuned_row(workdir, label, *, chosen, val_losses, seeds=1, worse=0.2, **kwargs):
  """Row ``label``'s tuning budget (the grid's rate scales and, where ``chosen`` is an end of
  them, the ladder's scales past it up to one beyond ``chosen``; seed 0) with ``chosen`` the scale
  of the lowest training loss (the others' ``worse`` higher), and ``seeds`` seeds at ``chosen``
  whose validation losses are ``val_losses`` (seed s: every value + 0.2 s)."""
  low = min(sweep_config.LR_SCALES[0], chosen / 2)
  high = max(sweep_config.LR_SCALES[-1], chosen * 2)
  for scale in [s for s in sweep_config.LR_LADDER if low <= s <= high]:
    for seed in range(seeds if scale == chosen else 1):
      losses = [v + 0.2 * seed for v in val_losses]
      train = losses[-1] + (0 if scale == chosen else worse)
      fake_run(workdir, label, seed, scale=scale, val_losses=losses, train_loss=train, **kwargs)
