"""CuPy (cupy-cuda12x, its CUDA 12 runtime linked in; NVRTC from nvidia-cuda-nvrtc-cu12)
under libvcuda on gpusim: the quota is the memory CuPy sees, an allocation past it is
CuPy's OutOfMemoryError and the process carries on, CuPy's memory pool counts against the
quota until it gives its blocks back, one container's processes share one quota, and a
RawKernel loop is held to the container's share of device time.

Judged by what CuPy returns and by gpusim's ground truth (`gpusim status --json`: each
process's memory and busy time). Memory figures are gpusim's accounting
(tests/gpusim/README.md "Memory"): cudart's primary context costs 300 MiB; `cupy.empty`
asks the driver for exactly its size when that is a multiple of 512 B (CuPy's pool rounds
up to 512 B).

cupy_shell.py (tests/gpusim/e2e) is the CuPy process the memory tests step through;
cupy_load.py (here) is the kernel loop the share test runs, as c/vcuda_load.c is for the
limiter's own tests (test_vcuda_limit.py, whose measurement this follows).
"""

import pathlib
import sys

import pytest

from cupy_common import CupyShell, check_installed, cupy_env
from limit_common import Machine
from vcuda_common import CONTEXT, MiB, gpu_status, proc_memory, region_used

LOAD = pathlib.Path(__file__).resolve().parent / "cupy_load.py"
OOM = {"rc": 2, "oom": 1}  # cupy.cuda.memory.OutOfMemoryError
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation, from cupy.cuda.runtime.malloc


@pytest.fixture
def cupy(sim):
    """start(container) -> a CuPy process in it; every process is closed (and must exit 0)."""
    check_installed()
    made = []

    def start(box, name="cupy"):
        cupy_env(box.env)
        made.append(CupyShell(box, name))
        return made[-1]

    yield start
    for s in made:
        s.close()


def held(sim, pid):
    return proc_memory(sim, pid) or 0


def check_peak(sim, quota):
    peak = gpu_status(sim)["memory_peak"]
    assert peak <= quota, f"gpusim: the container held {(peak - quota) / MiB:.1f} MiB more than its quota"


def test_the_quota_is_the_memory_cupy_sees(sim, cupy):
    box = sim.container(1024)
    c = cupy(box)
    r = c.ok("init")
    assert r["count"] == 1, "the container's one GPU"
    assert r["total"] == 1024 * MiB
    assert r["free"] <= r["total"]
    c.ok(f"alloc {100 * MiB}")
    # once the process has allocated, the context cudart made counts as used
    assert c.ok("info") == {"rc": 0, "free": (1024 - 100) * MiB - CONTEXT, "total": 1024 * MiB}
    assert held(sim, c.pid) == CONTEXT + 100 * MiB
    assert region_used(box.region) == CONTEXT + 100 * MiB


def test_past_the_quota_cupy_raises_out_of_memory_and_carries_on(sim, cupy):
    box = sim.container(1024)
    c = cupy(box)
    c.ok("init")
    assert c.do(f"alloc {1024 * MiB}") == OOM
    assert held(sim, c.pid) == CONTEXT, "a refused allocation never reached the driver"
    a = c.ok(f"alloc {400 * MiB}")["id"]
    assert c.do(f"alloc {400 * MiB}") == OOM, "300 + 400 + 400 MiB is past 1024"
    assert c.ok("pool") == {"rc": 0, "used": 400 * MiB, "total": 400 * MiB}
    c.ok(f"del {a}")
    c.ok("freeall")
    c.ok(f"alloc {700 * MiB}")  # all the quota leaves beside the context
    assert held(sim, c.pid) == CONTEXT + 700 * MiB
    assert c.ok("info")["free"] == 24 * MiB
    assert c.do(f"alloc {24 * MiB + 512}") == OOM
    c.ok(f"alloc {24 * MiB}")
    assert gpu_status(sim)["memory_used"] == 1024 * MiB
    check_peak(sim, 1024 * MiB)


def test_cupys_pool_counts_against_the_quota_until_it_gives_its_blocks_back(sim, cupy):
    box = sim.container(1024)
    c = cupy(box)
    c.ok("init")
    a = c.ok(f"alloc {400 * MiB}")["id"]
    c.ok(f"del {a}")
    # the array is gone, but CuPy's pool keeps its block: the driver still holds it, and
    # so does the quota
    assert c.ok("pool") == {"rc": 0, "used": 0, "total": 400 * MiB}
    assert held(sim, c.pid) == CONTEXT + 400 * MiB
    assert region_used(box.region) == CONTEXT + 400 * MiB
    assert c.ok("info")["free"] == (1024 - 400) * MiB - CONTEXT
    # an allocation past the pool (cudaMalloc) does not fit beside the cached block
    assert c.do(f"raw {500 * MiB}") == {"rc": CUDA_ERROR_MEMORY_ALLOCATION}
    c.ok("freeall")
    assert c.ok("pool")["total"] == 0
    assert held(sim, c.pid) == CONTEXT
    assert c.ok("info")["free"] == 1024 * MiB - CONTEXT
    p = c.ok(f"raw {500 * MiB}")["id"]  # now it fits
    c.ok(f"rawfree {p}")
    # CuPy's own allocations need no free_all_blocks: refused, the pool gives its cached
    # blocks back and asks again (500 MiB beside 400 cached would be past the quota)
    b = c.ok(f"alloc {400 * MiB}")["id"]
    c.ok(f"del {b}")
    c.ok(f"alloc {500 * MiB}")
    assert c.ok("pool") == {"rc": 0, "used": 500 * MiB, "total": 500 * MiB}
    assert held(sim, c.pid) == CONTEXT + 500 * MiB
    check_peak(sim, 1024 * MiB)


def test_a_containers_cupy_processes_share_its_quota(sim, cupy):
    box = sim.container(2048)
    first, second = cupy(box, "first"), cupy(box, "second")
    first.ok("init")
    a = first.ok(f"alloc {1000 * MiB}")["id"]
    second.ok("init")
    # both contexts and the first's 1000 MiB leave 448 MiB
    assert second.do(f"alloc {600 * MiB}") == OOM
    assert held(sim, second.pid) == CONTEXT
    assert second.ok("info")["free"] == 448 * MiB
    first.ok(f"del {a}")
    first.ok("freeall")
    assert held(sim, first.pid) == CONTEXT
    assert second.ok("info")["free"] == 1448 * MiB
    second.ok(f"alloc {600 * MiB}")
    assert held(sim, second.pid) == CONTEXT + 600 * MiB
    assert region_used(box.region) == 2 * CONTEXT + 600 * MiB
    check_peak(sim, 2048 * MiB)


ACCURACY = 0.02  # test_vcuda_limit.py's: a saturating tenant's average is its share ± 2 pp
SECONDS = 5


def test_a_cupy_rawkernel_loop_is_held_to_the_containers_share(tmp_path):
    """A RawKernel named spin_1ms (1 ms a launch in gpusim's cost model) launched back to
    back at a 30 % share: 30 % ± 2 pp of the GPU by gpusim's busy time, averaged from 1 s
    after the loop starts (CuPy is imported, NVRTC has compiled and the module is loaded
    by then) to the end, as test_vcuda_limit.py measures a tenant."""
    check_installed()
    m = Machine(tmp_path / "m", 1, sys.executable)
    try:
        c = m.tenant(0, "cupy", core=30)
        cupy_env(c.env)
        m.sample()
        ld = m.spawn(c, 0, [LOAD, "--kernel", "spin_1ms", "--seconds", SECONDS])
        out = ld.wait(timeout=SECONDS + 60)
    finally:
        m.stop()
    got = ld.util(1.0, SECONDS - 0.2)
    print(f"CuPy RawKernel loop at a 30% share: {got:.2%} of the GPU ({out.strip()})")
    assert abs(got - 0.30) <= ACCURACY, f"the CuPy loop got {got:.2%} at a 30% share ({out.strip()})"
    # every 1 s window within the 2 pp and what the limiter's bucket spends at once (20 ms
    # of earnings: 0.6 pp at 30 %), as test_vcuda_limit.py's window_slack
    worst = max(m.windows(ld, 1.0, SECONDS - 0.2))
    assert worst <= 0.30 + ACCURACY + 0.020 * 0.30, f"a 1 s window reached {worst:.2%}"
