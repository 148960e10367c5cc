"""The paper reproduction: one module per table or figure, their outputs in ``paper_figures/``.

``python -m experiments.reproduce --target=...`` (:mod:`experiments.reproduce.__main__`) runs
the targets :mod:`.t1` (with its TASC settings investigation), :mod:`.t1_cifar10`, :mod:`.t2`,
:mod:`.f1`, :mod:`.f2`, :mod:`.f3` and :mod:`.f4`. Each has ``TITLE`` and
``produce(options) -> report.Report``: it runs what is missing and builds its report from the run
directories alone. :mod:`.common` holds the command line's options and runs sweep configs, in
child processes where asked; :mod:`.report` reads and writes run directories and writes the
outputs (Markdown, CSV, PNG) with their provenance, the figures drawn with :mod:`.plots`.
Importing this package imports none of them.
"""
