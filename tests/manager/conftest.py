"""The manager's end-to-end suites (vcuda-manager, vcuda-smi and the tenant's attacks on
them), against kubelet-sim and gpusim: node_common.py starts a node. gpusim's harness
(tests/gpusim/e2e/gpusim_harness.py) provides the fixtures; tests/vcuda's helpers read the
region and build the library's C programs."""

import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]
for d in (TESTS / "gpusim" / "e2e", TESTS / "vcuda"):
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))

from gpusim_harness import cc, gpusim_built, sim  # noqa: E402,F401  (fixtures)
