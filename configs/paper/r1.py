"""R1, recommendation models: DLRM's tables placed across 8 simulated devices, their all-to-alls
compressed, hot rows replicated; runs of ``configs/dlrm.py`` (synthetic click logs, 64 steps).

  python -m experiments.reproduce --target=r1

The grid (:data:`CELLS`), each cell at seeds 0, 1, 2 (seed by seed: every cell's seed 0 first) (``config.seed``: the model's
initialisation and the batches' order; the click logs are the same):

* placements, the rows exchanged in float32: ``replicated`` (the tables in the dense
  all-reduce), ``table``, ``row``, ``column`` and ``auto`` (the planner's);
* exchange precision at the row placement: ``bf16`` and ``int8`` both ways (no error feedback:
  as TorchRec's quantised all-to-all), ``int4`` both ways with and without error feedback, and
  the forward rows in float32 with the gradients' ``topk`` at 0.1 of a bucket with error
  feedback (these two without a memory budget: their residual is a whole bank a device,
  8x the row-placed tables, over the config's 256 KiB);
* hot rows at the row placement: none (the ``row`` cell) and ``auto`` (the planner's, within
  the config's 256 KiB a device for the tables).

Every placed cell sizes its all-to-all's buckets from the skew (``embedding.capacity=-1``, the
planner's): with every lookup's room (``capacity=0``) hot rows could not shrink the buffers.
``replicated`` exchanges no rows and keeps the config's capacity and no planner (its tables,
1.1 MB, exceed the planner's budget, which only a placement choice needs). The planner's
capacity is the busiest owner's (whole tables on one owner get larger buckets than rows spread
over all). 11 cells, 33 runs: 38 minutes with 2 jobs on 2 cores that other runs shared (110 to
215 s a run, compiling and the bytes' programs included).

Arguments: ``seeds`` (3), ``cells`` (joined by ``+``; '': all), ``smoke`` (true: the config's
smoke length, 2 steps on fewer rows, for tests; its runs are not the grid's and must not share
its folder).
"""

import ml_collections

from configs import common

CONFIG = "configs/dlrm.py"
FLOAT32, BF16 = "row", "row_bf16"  # the baselines the gaps are taken to
# What every placed cell sets, before its own settings.
_PLACED = dict(capacity=-1, exchange="dense", gradient_exchange="dense", error_feedback=False,
               hot_rows="0")
# Cell -> (group, config.embedding settings).
CELLS = {
    "replicated": ("placement", dict(placement="replicated", capacity=0,
                                     error_feedback=False)),
    "table": ("placement", dict(_PLACED, placement="table")),
    "row": ("placement", dict(_PLACED, placement="row")),
    "column": ("placement", dict(_PLACED, placement="column")),
    "auto": ("placement", dict(_PLACED, placement="auto")),
    "row_bf16": ("exchange", dict(_PLACED, placement="row", exchange="bf16",
                                  gradient_exchange="bf16")),
    "row_int8": ("exchange", dict(_PLACED, placement="row", exchange="int8",
                                  gradient_exchange="int8")),
    "row_int4": ("exchange", dict(_PLACED, placement="row", exchange="int4",
                                  gradient_exchange="int4")),
    "row_int4_ef": ("exchange", dict(_PLACED, placement="row", exchange="int4",
                                     gradient_exchange="int4", error_feedback=True,
                                     budget_bytes=0)),
    "row_topk0.1_ef": ("exchange", dict(_PLACED, placement="row", gradient_exchange="topk",
                                        topk_fraction=0.1, error_feedback=True,
                                        budget_bytes=0)),
    "row_hot_auto": ("hot rows", dict(_PLACED, placement="row", hot_rows="auto")),
}


def run_name(cell: str, seed: int) -> str:
  return f"{cell}_s{seed}"


def chosen_cells(text: str) -> tuple[str, ...]:
  """The cells ``text`` names (joined by ``+``; '': all), in :data:`CELLS` order.

  Raises:
    ValueError: an unknown cell, in one line naming the allowed ones.
  """
  names = set(filter(None, str(text).split("+")))
  for name in sorted(names - set(CELLS)):
    raise ValueError(f"configs/paper/r1.py: cells={text!r}: {name!r}; allowed: {list(CELLS)} "
                     "joined by '+'")
  return tuple(c for c in CELLS if c in names or not names)


def get_config(arg=None):
  args = common.parse_args(arg, seeds=3, cells="", smoke=False)
  if args["seeds"] < 1:
    raise ValueError(f"configs/paper/r1.py: seeds={args['seeds']}; allowed: >= 1")
  config = CONFIG + (":smoke" if args["smoke"] else "")
  c = ml_collections.ConfigDict()
  c.runs = [{"name": run_name(cell, seed), "config": config,
             "overrides": {"seed": seed, "embedding": CELLS[cell][1]}}
            for seed in range(args["seeds"]) for cell in chosen_cells(args["cells"])]
  c.overrides = {}
  return c
