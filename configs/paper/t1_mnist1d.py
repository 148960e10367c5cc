"""T1 sweep: accuracy against wire compression for every gradient exchange, MNIST-1D, 8 workers.

  python -m experiments.sweep --config=configs/paper/t1_mnist1d.py --workdir=runs/paper/t1_mnist1d

(or ``python -m experiments.reproduce --target=t1``, which also writes the table). One run per
row and seed of ``configs/paper/mnist1d.py``; run ``<row>_s<seed>`` works in
``workdir/<row>_s<seed>``. The rows (:func:`rows`) cover every registered method
(:mod:`compressors.registry`): the settings chosen for the table (:data:`ROWS`), and the
defaults of any method without a row of its own, under the method's name (fp16, bf16 and
threshold today; a method registered later, by a plugin, too). The reproduction's report
(``paper_figures/t1.md``) records how long its runs took.

Arguments: ``full`` (the config's full settings), ``seeds=N`` (default 3), ``subset=f4`` (only the
runs of F4's loss curves: TASC with each sensitivity and top-k at 1% density, all with error
feedback).
"""

import ml_collections

from compressors import registry
from configs import common

CONFIG = "configs/paper/mnist1d.py"

# Row label -> the method's settings (fields of configs/paper/mnist1d.py's argument), chosen for
# the table; order is the table's. Results are keyed by these labels: keep them.
ROWS = {
    "dense": dict(method="dense"),
    "topk_d0.01": dict(method="topk", density=0.01, ef=True),
    "topk_d0.001": dict(method="topk", density=0.001, ef=True),
    "topk_d0.01_noef": dict(method="topk", density=0.01, ef=False),
    "topk_d0.001_noef": dict(method="topk", density=0.001, ef=False),
    "randomk_d0.01": dict(method="randomk", density=0.01, ef=True),
    "dgc_d0.001": dict(method="dgc", density=0.001),
    "qsgd_s16": dict(method="qsgd"),
    "terngrad": dict(method="terngrad"),
    "signsgd": dict(method="signsgd"),
    "efsignsgd": dict(method="efsignsgd"),
    "onebit": dict(method="onebit"),
    "powersgd_r2": dict(method="powersgd"),
    **{f"tasc_d{d}_{s}": dict(method="tasc", density=d, sensitivity=s)
       for d in (0.01, 0.001) for s in ("hutchinson", "fisher", "none")},
    # float16 on the wire halves the bytes of scores and payload, so 1.6% of the blocks go at
    # 102x, where float32 allows 0.5% (configs/paper/t1_tasc_search.py).
    "tasc_d0.016_hutchinson_f16": dict(method="tasc", density=0.016, sensitivity="hutchinson",
                                       wire="float16"),
}
F4_METHODS = ("tasc_d0.01_hutchinson", "tasc_d0.01_fisher", "tasc_d0.01_none", "topk_d0.01")


def rows() -> dict[str, dict]:
  """Every row of the table, label -> settings: :data:`ROWS`, then a row of default settings,
  labelled with the method's name, for each registered method that no row of :data:`ROWS` runs
  (read from the registry on every call, so a method registered later gets its row)."""
  covered = {settings["method"] for settings in ROWS.values()}
  return {**ROWS, **{name: dict(method=name) for name in registry.names() if name not in covered}}


def config_arg(method: str) -> str:
  """``configs/paper/mnist1d.py``'s argument for ``method`` (a label of :func:`rows`)."""
  return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                  for k, v in rows()[method].items())


def run_name(method: str, seed: int) -> str:
  """The run directory's name of ``method`` (a label of :func:`rows`) with ``seed``."""
  return f"{method}_s{seed}"


def get_config(arg=None):
  args = common.parse_args(arg, full=False, seeds=3, subset="all")
  if args["subset"] not in ("all", "f4"):
    raise ValueError(f"configs/paper/t1_mnist1d.py: subset={args['subset']!r}; allowed: all, f4")
  if args["seeds"] < 1:
    raise ValueError(f"configs/paper/t1_mnist1d.py: seeds={args['seeds']}; allowed: >= 1")
  methods = F4_METHODS if args["subset"] == "f4" else tuple(rows())
  full = ",full=true" if args["full"] else ""
  c = ml_collections.ConfigDict()
  c.runs = [{"name": run_name(m, seed), "config": f"{CONFIG}:{config_arg(m)},seed={seed}{full}"}
            for seed in range(args["seeds"]) for m in methods]
  c.overrides = {}
  return c
