"""The data-parallel harness: the training step around a compressing transformation.

It knows no method: of the project it imports the network model and the method protocol
(:mod:`compressors.method_protocol`), through which a method declares its step kinds and how its
updates land on per-worker parameters.

:mod:`~compressors.parallel.data_parallel` writes the step and lays its state out (per-worker
gradients, the lockstep skip of non-finite steps); :mod:`~compressors.parallel.train_state` is a
run's state; :mod:`~compressors.parallel.step_kinds` schedules a method's step kinds;
:mod:`~compressors.parallel.workers` says where the workers run (several simulated on one
device); :mod:`~compressors.parallel.per_worker` lays the state out per worker;
:mod:`~compressors.parallel.nonfinite` skips a step on every worker when one worker's gradient is
not finite; :mod:`~compressors.parallel.drift` checks that replicas are bit-identical;
:mod:`~compressors.parallel.evaluation` sums an evaluation over the workers;
:mod:`~compressors.parallel.fsdp` lays parameters out sharded over an island's fast axis, and
:mod:`~compressors.parallel.gather_on_use` gathers each where the loss reads it;
:mod:`~compressors.parallel.step_bytes` reads a step's bytes (and its peak memory) from its
compiled programs, with
:mod:`~compressors.parallel.hlo_bytes` reading the bytes on the wire of any compiled program.
"""
