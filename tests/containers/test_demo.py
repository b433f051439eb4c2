"""`scripts/demo --containers` keeps working: the demo's two pods as real containers, their
mounts as the engine made them, and their shares held (the demo prints gpusim's ground
truth; its 4 s averages are checked here against the shares with the limiter's ±2 pp)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "gpusim" / "e2e"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "vcuda"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "manager"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from gpusim_harness import cc, gpusim_built  # noqa: E402,F401  (fixtures)
from node_common import bins  # noqa: E402,F401
from test_real_containers import ROOT, engine_ready  # noqa: E402,F401

pytestmark = pytest.mark.skipif(bool(os.environ.get("VCUDA_NO_IMAGES")),
                                reason=f"real-container tests skipped: {os.environ.get('VCUDA_NO_IMAGES')}")


def test_the_demo_runs_its_pods_as_real_containers(engine_ready, bins, tmp_path):
    d = tmp_path / "demo-bin"
    d.mkdir()
    shutil.copy2(bins["fill"], d / "fill")
    shutil.copy2(bins["load"], d / "load")
    p = subprocess.run([sys.executable, ROOT / "tests" / "demo" / "demo.py", d, "--containers"],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    # The engine applied the answer's read-only flags as given.
    pairs = re.findall(r"answer (\S+)\s+(ro|rw)\s+<- (\S+)\n\s+docker (\S+)\s+(ro|rw)\s+<- (\S+)", out)
    assert len(pairs) == 5, out
    for a_path, a_mode, a_src, d_path, d_mode, d_src in pairs:
        assert (a_path, a_mode, a_src) == (d_path, d_mode, d_src), (a_path, d_path)
    a, b = map(float, re.search(r"4 s\s+([\d.]+)% on average\s+([\d.]+)% on average", out).groups())
    assert abs(a - 30) <= 2 and abs(b - 70) <= 2, (a, b)
    assert "allocation of 2048 MiB more refused" in out, out
