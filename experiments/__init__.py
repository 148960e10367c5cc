"""The experiment runner: configs in, trained models, logs, checkpoints and sweeps out.

Entry points: ``python -m experiments.run`` (one run), ``experiments.sweep`` (a list of runs),
``experiments.launch`` (N local processes); in Python, ``experiments.train.train_and_evaluate``.
Importing this package imports nothing else, JAX included: the runner must set the CPU device
count before JAX starts (see :mod:`experiments.distributed`), so import submodules explicitly.
"""
