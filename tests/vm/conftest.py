"""The VM backends' suites (issue 20): sysfs-sim (tests/sysfs-sim) plays the node's /sys and
/dev, tests/manager's node_common.py the rest of the node (gpusim, kubelet-sim, the manager)."""

import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]
for d in (TESTS / "gpusim" / "e2e", TESTS / "vcuda", TESTS / "manager", TESTS / "vm"):
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))

from gpusim_harness import cc, gpusim_built, sim  # noqa: E402,F401  (fixtures)
