"""Every registered method through the same checks (tests/method_checks.py).

The parameters come from the registry when this file is collected, so a method added to the
registry (``compressors.registry.register``; the built-ins, TASC's with ``import tasc``) is
tested here with no test code of its own.
"""

import pytest

from compressors import registry
import tasc  # registers the method "tasc"
from tests import method_checks

pytestmark = pytest.mark.usefixtures("fast_compiles")


# method_checks.SLOW_CHECKS run with `-m slow` (CI runs them on the lowest JAX); simulated
# workers are checked in every layout by the slow test below, a superset of their check.
@pytest.mark.parametrize("check", [
    pytest.param(c, marks=pytest.mark.slow) if c in method_checks.SLOW_CHECKS else c
    for c in method_checks.CHECKS if c is not method_checks.check_simulated_workers_match_devices],
    ids=lambda c: c.__name__[len("check_"):])
@pytest.mark.parametrize("name", registry.names())
def test_every_method_passes_every_check(name, check):
  check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names())
def test_every_method_gives_simulated_workers_the_devices_results_in_every_layout(name):
  method_checks.check_simulated_workers_match_devices(name, layouts=method_checks.ALL_LAYOUTS)


def test_every_builtin_method_is_registered():
  assert set(registry.names()) >= {"dense", "fp16", "bf16", "topk", "randomk", "threshold",
                                   "dgc", "qsgd", "terngrad", "signsgd", "efsignsgd", "onebit",
                                   "powersgd", "tasc", "int8", "int4"}
