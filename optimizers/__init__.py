"""Large-batch optimizers (LAMB, LARS) as optax transformations, and their schedules; row-wise
Adagrad for embedding tables."""

from optimizers.exclusions import default_exclude
from optimizers.lamb import lamb
from optimizers.lars import lars
from optimizers.rowwise_adagrad import rowwise_adagrad
from optimizers.rowwise_adagrad import scale_by_rowwise_adagrad
from optimizers.schedules import MLPerfLarsPreset
from optimizers.schedules import mlperf_lars_preset
from optimizers.schedules import mlperf_lars_schedule
from optimizers.schedules import scale_learning_rate
from optimizers.schedules import warmup_polynomial_decay
from optimizers.trust_ratio import scale_by_layerwise_trust_ratio
