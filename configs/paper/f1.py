"""F1 settings: wire bytes per device against the number of workers (compile only).

  python -m experiments.reproduce --target=f1              # quick: 2, 16 and 256 workers
  python -m experiments.reproduce --target=f1 --full       # every power of two, 2 to 256

Calls :func:`experiments.bench.bytes.bytes_vs_workers` once per worker count (a child process
simulating that many CPU devices compiles each exchange of a ResNet-50 and a BERT-base gradient;
nothing runs). Quick (default): 2 workers (the smallest), 16 (two nodes of 8: the first count
where the hierarchical mode has links between nodes, and TASC's 2 x 8 GPU setting) and 256 (the
largest); every claim of the figure is answered at these three. ``full``: every power of two
from 2 to 256, about three times as long.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  args = common.parse_args(arg, full=False)
  c = ml_collections.ConfigDict()
  c.workers = (2, 4, 8, 16, 32, 64, 128, 256) if args["full"] else (2, 16, 256)
  c.sizes = ("resnet50", "bert_base")
  c.methods = ("dense", "topk", "randomk", "powersgd", "onebit", "tasc", "tasc_hierarchical")
  c.timeout_s = 1800.0
  return c
