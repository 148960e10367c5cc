"""F2 settings: communication time from the alpha-beta cost model (compressors.network.topology).

  python -m experiments.reproduce --target=f2

VGG-19 (CIFAR) on 1 and 2 nodes of 8 V100s (NVLink inside, 25 Gbit/s Ethernet between); ResNet-50
scaling from 8 to 512 GPUs with an assumed compute time per step; TASC's shared-support
all-reduce against dense ring for three models and topologies. Runs in seconds; ``full`` is the
same.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  common.parse_args(arg, full=False)
  c = ml_collections.ConfigDict()
  c.topology = "v100_nvlink_25gbe"
  c.gpus_per_node = 8
  c.densities = (0.01, 0.001)  # TASC block densities priced (the first is the headline)
  c.block_size = 256
  c.vgg = dict(model="vgg19_cifar", nodes=(1, 2))
  # Assumption: a V100 trains ResNet-50 at about 1,200 images/s in mixed precision (NVIDIA's
  # published figures are 1,200-1,400); 256 images per GPU per step.
  c.scaling = dict(nodes=(1, 2, 4, 8, 16, 32, 64), images_per_second=1200.0, batch_per_gpu=256)
  c.sparse = dict(models=("resnet50", "vgg19_cifar", "bert_base"),
                  topologies=(("v100_nvlink_25gbe", 2, 8), ("v100_nvlink_25gbe", 8, 8),
                              ("cloud_10gbe", 8, 1)),
                  densities=(0.1, 0.01, 0.001))
  return c
