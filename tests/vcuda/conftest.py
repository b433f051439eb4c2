"""The library's end-to-end suites: libvcuda preloaded into C programs (c/), cuda-python and
NVML clients, judged by gpusim's ground truth. gpusim's harness (tests/gpusim/e2e/
gpusim_harness.py) provides the fixtures; tests/manager's node_common starts a node for
the suites that need a manager."""

import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]
for d in (TESTS / "gpusim" / "e2e", TESTS / "manager"):
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))

from gpusim_harness import cc, gpusim_built, sim  # noqa: E402,F401  (fixtures)
