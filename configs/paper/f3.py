"""F3 settings: measured exchange times over a rate-limited loopback, beside the model.

  python -m experiments.reproduce --target=f3              # needs root and `ip netns`
  python -m experiments.reproduce --target=f3 --full       # own folder, runs/paper/f3_full

For 2 and 4 processes at 1 and 10 Gbit/s: :func:`experiments.bench.calibrate.calibrate` fits the
loopback's alpha and beta, :func:`experiments.bench.links.link_times` times dense, top-k and
TASC exchanges of one gradient, and the cost model predicts each. Without network namespaces (not
root, no `ip`/`tc`) nothing runs and the report says why. Quick (default): a 4M-element gradient
(16 MB); ``full``: ResNet-50's 25,557,032 elements and 5 repeats.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  args = common.parse_args(arg, full=False)
  c = ml_collections.ConfigDict()
  c.processes = (2, 4)
  c.rates = ("1gbit", "10gbit")
  c.methods = ("dense", "topk", "tasc")
  c.elements = 25_557_032 if args["full"] else 4_000_000
  c.density = 0.01  # what experiments.bench.links uses (the runner's defaults)
  c.block_size = 256
  c.message_bytes = (64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
  c.repeats = 5 if args["full"] else 3
  c.timeout_s = 1200.0
  return c
