"""F1 settings: wire bytes per device against the number of workers (compile only).

  python -m experiments.reproduce --target=f1

Calls :func:`experiments.bench_bytes.bytes_vs_workers` once per worker count (a child process
simulating that many CPU devices compiles each exchange of a ResNet-50 and a BERT-base gradient;
nothing runs). Quick (default): 2, 8, 32, 128 and 256 workers (one compile-only child process
each, a few minutes each on 2 CPU cores); ``full``: every power of two from 2 to 256.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  args = common.parse_args(arg, full=False)
  c = ml_collections.ConfigDict()
  c.workers = (2, 4, 8, 16, 32, 64, 128, 256) if args["full"] else (2, 8, 32, 128, 256)
  c.sizes = ("resnet50", "bert_base")
  c.methods = ("dense", "topk", "randomk", "powersgd", "onebit", "tasc", "tasc_hierarchical")
  c.timeout_s = 7200.0 if args["full"] else 1800.0
  return c
