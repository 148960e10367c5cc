"""The network model: who exchanges with whom, and what it costs.

:mod:`~compressors.network.axes` names the workers' axes and wraps the collectives over them
(several mesh axes, simulated workers); :mod:`~compressors.network.collectives` writes the
all-reduce schedules (ring, butterfly, Rabenseifner, hierarchical) from ``ppermute``;
:mod:`~compressors.network.topology` is the alpha-beta cost model of links and schedules;
:mod:`~compressors.network.planner` chooses schedules by integer programming (it needs scipy:
imported by whoever plans, ``from compressors.network import planner``; ``import compressors``
does not load it).
"""
