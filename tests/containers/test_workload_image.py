"""The workload image (issue 17 §1): `vcuda/workload:latest` (tests/containers/workload,
built by scripts/build-images) carries its own test programs and Python clients, so a pod
runs it as a user's image, with nothing from the host but what a GPU node injects (gpusim's
libraries, state file and pid socket standing in for the driver's, as the NVIDIA container
toolkit injects them) and what vcuda-manager's answer mounts. kubelet-sim plays the kubelet
and the runtime (`serve --runtime docker`, test_kubelet_runtime.DockerNode) with no tools
directory mounted. Ground truth is gpusim's.
"""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from test_kubelet_runtime import DockerNode  # noqa: E402
from test_real_containers import (  # noqa: E402,F401  (gpusim_built: a fixture)
    MiB, _unavailable, fill_registered, gpusim_built, held_mib, peak,
)
import runtime  # noqa: E402

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or "")

WORKLOAD = "vcuda/workload:latest"
QUOTA = 1024 * MiB  # memory=4: four 256 MiB units

# What a user's first session does: the quota as pynvml and CuPy see it, an allocation past
# it, then more work in the same process. Prints one JSON line.
PROBE = r"""
import json, numpy, pynvml, cupy
pynvml.nvmlInit()
nvml_total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
free, total = cupy.cuda.runtime.memGetInfo()
try:
    cupy.empty(total + (64 << 20), dtype=cupy.uint8)
    oom = None
except cupy.cuda.memory.OutOfMemoryError as e:
    oom = str(e)
host = numpy.arange(1 << 20, dtype=numpy.int32)
same = bool(numpy.array_equal(cupy.asnumpy(cupy.asarray(host)), host))
cupy.empty(1 << 20, dtype=cupy.float32) * 2 + 1  # CuPy's kernels, compiled by NVRTC
cupy.cuda.Device().synchronize()
print(json.dumps({"nvml_total": nvml_total, "cupy_total": total, "oom": oom, "roundtrip": same}))
"""


@pytest.fixture
def workload_node(tmp_path):
    why = runtime.engine_unavailable()
    if why:
        pytest.fail(f"real containers need a Docker engine: {why}")
    if runtime.image_missing(WORKLOAD):
        pytest.fail(f"image {WORKLOAD} is missing: run scripts/build-images workload (scripts/test does)")
    n = DockerNode(tmp_path, tools=None, image=WORKLOAD)
    yield n
    n.close()


def test_the_workload_image_runs_pynvml_cupy_and_fill_held_to_the_quota(workload_node):
    """In a pod admitted at 30 % + 1 GiB, the image's own software, with no host mount of
    tools or Python packages: pynvml reports a 1 GiB GPU; CuPy's memGetInfo total is 1 GiB,
    an allocation past it is CuPy's OutOfMemoryError and the same process then copies 4 MiB
    to the GPU and back intact and runs CuPy's NVRTC-compiled kernels (the image's headers
    and NVRTC); the image's `fill` is refused at the quota, and gpusim's high-water mark never
    passes 1 GiB."""
    n = workload_node
    _, c = n.admit("w", core=30, memory=4)
    mounted = [m["Destination"] for m in c.inspect()["Mounts"]]
    from_host = ("/opt", "/usr/local/lib/python3", "/usr/lib/python3")
    assert not [p for p in mounted if p.startswith(from_host)], f"host software mounted into the pod: {mounted}"
    n.sim.gpusim("reset-peak")

    r = c.exec("python3", "-c", PROBE, timeout=60)
    assert r.returncode == 0, f"the probe exited {r.returncode}: {r.stdout}{r.stderr}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["nvml_total"] == QUOTA, got
    assert got["cupy_total"] == QUOTA, got
    assert got["oom"] and "Out of memory" in got["oom"], got
    assert got["roundtrip"], got
    # The CUDA runtime's destructors call the driver at exit, after its thread-local
    # context stack is gone: the simulated driver answers them rather than panicking.
    assert "panicked" not in r.stderr, r.stderr

    out = fill_registered(n.node, c, 64, 100000)
    assert "refused" in out and held_mib(out) < 1024, out
    assert peak(n.node) <= QUOTA, f"gpusim's high-water mark {peak(n.node) / MiB:.0f} MiB > 1024 MiB"
    assert "not in the cgroup" not in n.node.log()
