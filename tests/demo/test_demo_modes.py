"""`scripts/demo --modes` keeps working and shows what it says: one vcuda-manager with
`--modes whole,slice,shared --slices 2` on four simulated 40 GiB GPUs, and the kubelet's
capacities of seed 002's worked example after each step (whole GPUs / slices / vcuda-core /
vcuda-memory: 4/8/400/640, 2/8/200/320, 1/6/200/320, 1/4/100/160, then 4/8/400/640 again
once the pods are deleted). The acceptance test of the same steps is
tests/manager/test_modes.py; this one checks the demo's printout."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpusim" / "e2e"))

from gpusim_harness import gpusim_built  # noqa: E402,F401  (fixture: the builds it needs)

# The seed's steps in our units (160 vcuda-memory units of 256 MiB per 40 GiB GPU).
STEPS = [
    ("start", (4, 8, 400, 640), (0, 0, 0, 0)),
    ("+ experiment", (2, 8, 200, 320), (0, 2, 0, 0)),
    ("+ inference", (1, 6, 200, 320), (0, 2, 30, 10)),
    ("+ training", (1, 4, 100, 160), (1, 2, 30, 10)),
    ("- all three deleted", (4, 8, 400, 640), (0, 0, 0, 0)),
]
CELL = r"\s+(\d+) \((\d+)\)"
ROW = re.compile(r"^  (start|\+ experiment|\+ inference|\+ training|- all three deleted)\b.*?" + CELL * 4 +
                 r"\s+\[(\d+\.\d+) s\](.*)$", re.M)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """What `scripts/demo --modes` prints (run once for the module; the scene needs no
    workload binaries, so the bin directory is empty)."""
    d = tmp_path_factory.mktemp("demo-bin")
    p = subprocess.run([sys.executable, ROOT / "tests" / "demo" / "demo.py", d, "--modes"],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_the_mixed_mode_scene_shows_the_seeds_capacities_step_by_step(out):
    assert "!!" not in out, out
    rows = ROW.findall(out)
    assert [r[0] for r in rows] == [s[0] for s in STEPS], out
    for (step, cap, used), row in zip(STEPS, rows):
        nums = list(map(int, row[1:9]))
        assert tuple(nums[0::2]) == cap, (step, out)
        assert tuple(nums[1::2]) == used, (step, out)
    # the three pods lock three different GPUs, one per mode, and the capacities are back
    # within the control loop's ~1-2 s of the deletes
    locked = {m: g for g, m in re.findall(r"-> (GPU \d(?:, GPU \d)*) locked to (\w+)", out)}
    assert set(locked) == {"slice", "shared", "whole"}, out
    gpus = [g for v in locked.values() for g in v.split(", ")]
    assert len(gpus) == len(set(gpus)) == 4, f"sgpu: 2 takes two GPUs, the others one each: {locked}"
    took = float(rows[-1][9])
    assert took < 5, f"the capacities came back {took} s after the deletes; the manager should unlock a GPU " \
                     f"within the control loop's ~1-2 s of its last container leaving PodResources\n{out}"


def test_the_whole_gpu_gets_no_library_and_the_slices_half_a_gpu_each(out):
    (whole,) = re.findall(r"^  training \(whole\): .*$\n^ +NVIDIA_VISIBLE_DEVICES=(\S+) .*$", out, re.M)
    assert re.fullmatch(r"GPU-[0-9a-f-]{36}", whole), out
    assert re.search(r"^  training \(whole\): .*libvcuda NOT mounted, no preload", out, re.M), out
    assert re.search(r"mounts: none$", out, re.M), out
    assert re.search(r"^  experiment \(slice\): .*libvcuda mounted and preloaded", out, re.M), out
    (quotas,) = re.findall(r"^  experiment \(slice\): .*$\n^ +its config: (.*)$", out, re.M)
    mib = re.findall(r"GPU \d: (\d+) MiB", quotas)
    assert mib == ["20480", "20480"], f"two slices, each half of a 40 GiB GPU: {quotas}"
