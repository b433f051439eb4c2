"""gpusim's harness (gpusim_harness.py) as pytest sees it here: its fixtures, for gpusim's own
suites in this directory. The library's and the manager's suites (tests/vcuda,
tests/manager) load the same harness through their own conftest.py."""

from gpusim_harness import cc, gpusim_built, sim  # noqa: F401  (fixtures)
