"""The standard-library language model on islands: the model sharded inside fast islands,
DiLoCo across the slow link between them (``config.mesh``, :mod:`compressors.parallel.fsdp`).

2 islands x 4 fsdp devices (8 in all). Inside an island the parameters, AdamW's two moments and
DiLoCo's state are sharded over the 4 devices (ZeRO-3); across the islands DiLoCo exchanges
int8 pseudo-gradients every :data:`EVERY` steps, each device its shard. The stated budget,
:data:`BUDGET` bytes a device for the parameters and the optimizer's and model's state, is what
makes it need islands: with ``fsdp=1`` (every device holding the whole model and its state) the
runner refuses the run before allocating anything, naming the bytes it would hold.

  python -m experiments.run --config=configs/lm_islands.py --workdir=runs/islands

Expected (8 simulated CPU devices, 1,000 steps, seed 0; the README's islands section): test loss
4.294 (dense across the islands, ``method=dense``: 4.083, as 8-way data parallelism); per
device and step 2,426 bytes across the islands (97.0x fewer than dense's 235,264) and
2,887,104 on the fast axis (ZeRO-3's gathers and reduce-scatter, each leaf gathered where the
loss reads it and again in the backward pass, whatever the method); 1,529,242 bytes of state per device, 0.265x of the 5,763,994 that ``fsdp=1`` would
hold. Runtime: about 2 minutes on 2 CPU cores.

Arguments: those of ``configs/lm_stdlib.py``, with the defaults ``variant=micro``,
``method=diloco`` and ``fsdp=4``.
"""

from configs import common
from configs import lm_stdlib

# Bytes one device may hold: a quarter of the micro decoder's replicated DiLoCo state fits,
# the whole does not.
BUDGET = 3 * 2**20
EVERY = 25  # DiLoCo's H: about 100x fewer bytes across the islands than a dense all-reduce


def get_config(arg=None):
  c = lm_stdlib.get_config("variant=micro,method=diloco,fsdp=4," + (arg or ""))
  c.max_state_bytes_per_device = BUDGET
  common.set_method_settings(c, every=EVERY, carrier="int8")
  return c
