"""Large-batch optimizers (LAMB, LARS) as optax transformations, and their schedules."""

from optimizers.exclusions import default_exclude
from optimizers.lamb import lamb
from optimizers.lars import lars
from optimizers.schedules import MLPerfLarsPreset
from optimizers.schedules import mlperf_lars_preset
from optimizers.schedules import mlperf_lars_schedule
from optimizers.schedules import scale_learning_rate
from optimizers.schedules import warmup_polynomial_decay
from optimizers.trust_ratio import scale_by_layerwise_trust_ratio
