"""The data-parallel harness: the training step around a compressing transformation.

:mod:`~compressors.parallel.data_parallel` writes the step (per-worker gradients, the state's
layout, the lockstep skip of non-finite steps, the bytes of the compiled program);
:mod:`~compressors.parallel.workers` says where the workers run (several simulated on one
device); :mod:`~compressors.parallel.per_worker` lays the state out per worker;
:mod:`~compressors.parallel.nonfinite` skips a step on every worker when one worker's gradient is
not finite; :mod:`~compressors.parallel.drift` checks that replicas are bit-identical;
:mod:`~compressors.parallel.hlo_bytes` reads the bytes on the wire from a compiled program.
"""
