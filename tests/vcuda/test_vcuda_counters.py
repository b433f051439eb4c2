"""The region's statistics counters (vcuda/contract/src/region.rs, layout version 4), which
the manager exports as metrics: per GPU, the nanoseconds the container's processes waited in
the compute limiter (`throttled_ns`) and the calls libvcuda refused for the quota
(`oom_refusals`). Real CUDA programs run under the library against gpusim; the counters are
read from the region file (vcuda_common.region_counters).

Counters are per *config* GPU (the container's GPUs in config order), not per CUDA ordinal:
where it matters, a process selects the container's second GPU with CUDA_VISIBLE_DEVICES=1,
so it sees it as device 0 and an attribution by ordinal would land on the wrong GPU.
"""

import time

import pytest

from gpusim_harness import Container
from limit_common import Machine, build_load
from vcuda_common import (
    ARRAY_GRANULE,
    CONTEXT,
    CU_AD_FORMAT_UNSIGNED_INT8,
    CUDA_ERROR_OUT_OF_MEMORY as OOM,
    CUDA_SUCCESS,
    KiB,
    MiB,
    MODULE,
    Shell,
    build,
    region_counters,
)

RUN_S = 2.0
SHARE = 30


@pytest.fixture(scope="module")
def bins(cc, tmp_path_factory):
    out = tmp_path_factory.mktemp("counters-bin")
    return {"load": build_load(cc, out), "shell": build(cc, out, "vcuda_shell")}


def on_second_gpu(container):
    """The same container, its processes seeing only its second GPU (as CUDA device 0)."""
    return Container(container.sim, container.dir, {**container.env, "CUDA_VISIBLE_DEVICES": "1"})


def test_throttled_time_is_counted_under_a_share_and_not_when_exclusive(tmp_path, bins):
    """Container A (two GPUs, 30 % share) runs a saturating 1 ms-kernel loop for 2 s on its
    second GPU; container B (one GPU, exclusive) runs the same loop on another GPU.

    How much A must wait: the limiter admits at most share × T + capacity (10 ms of
    earnings) + one launch of device time in T seconds, i.e. 0.3 × 2 + 0.01 + 0.001 ≈ 0.61 s
    of kernels. Launches are asynchronous and take microseconds of host time, so the
    single-threaded loop spends the rest of its 2 s, about 1.4 s, asleep in the limiter
    (more while the first launch is probed and the starting cost guess is high). Requiring
    0.5 s leaves room for a slow, loaded host. And one thread cannot wait longer than it
    ran: the counter stays below the process's wall time (double counting would break it).
    B's launches never reach the limiter's slow path: its counter stays exactly 0."""
    m = Machine(tmp_path / "m", 3, bins["load"])
    a = m.sim.container([4096, 4096], gpus=m.uuids[:2], name="a", core=SHARE)
    b = m.sim.container([4096], gpus=[m.uuids[2]], name="b", core=100)

    t0 = time.monotonic()
    la = m.start(on_second_gpu(a), 1, "spin_1ms", RUN_S)
    assert region_counters(a.region)["throttled_ns"] == [0, 0], "nothing launched yet"
    lb = m.start(b, 2, "spin_1ms", RUN_S)
    out_a = la.wait()
    wall_a = time.monotonic() - t0
    out_b = lb.wait()

    waited = region_counters(a.region)["throttled_ns"]
    assert waited[0] == 0, f"GPU 0 of A ran nothing, yet counts {waited[0]} ns of waiting"
    assert 0.5e9 <= waited[1], f"a saturating loop at {SHARE}% waited only {waited[1] / 1e9:.3f} s of {RUN_S} s"
    assert waited[1] <= wall_a * 1e9, f"one thread waited {waited[1] / 1e9:.3f} s in a {wall_a:.3f} s run"
    assert int(out_a.split("kernels=")[1]) > 0

    assert int(out_b.split("kernels=")[1]) > 0, "the exclusive loop ran"
    assert region_counters(b.region) == {"throttled_ns": [0], "oom_refusals": [0]}


def test_quota_refusals_are_counted_once_per_refused_call(sim, bins):
    """Every allocation entry point, over the quota: each refused call adds exactly one on
    its GPU. Successful calls, and a driver error that is not about the quota (gpusim does
    not implement the 32-bit cuMemAllocPitch), add nothing."""
    c = sim.container([1024, 1024])
    sh = Shell(c, bins["shell"]).start()  # device 0: the container's first GPU
    try:
        avail = 1024 * MiB - CONTEXT - MODULE
        assert avail % 1024 == 0 and avail % ARRAY_GRANULE == 0
        assert sh.rc("pitch1 1024 4 4") not in (CUDA_SUCCESS, OOM), "precondition: a driver error"
        assert region_counters(c.region)["oom_refusals"] == [0, 0], "the driver's errors are not counted"
        u8 = CU_AD_FORMAT_UNSIGNED_INT8
        script = [
            (f"alloc {avail + 1}", OOM),
            (f"managed {avail + 1}", OOM),
            (f"pitch 1000 {avail // 1024 + 1} 4", OOM),
            (f"array 65536 {avail // ARRAY_GRANULE + 1} {u8} 1", OOM),
            (f"array3d 65536 {avail // ARRAY_GRANULE + 1} 1 {u8} 1", OOM),
            (f"mipmap 65536 {avail // ARRAY_GRANULE + 1} 0 {u8} 1 1", OOM),
            (f"vmm {1024 * MiB} dev", OOM),
            (f"async {avail + 1}", OOM),
            (f"pool {avail + 1}", OOM),
            (f"alloc {(1 << 64) - 4096}", OOM),  # an absurd size: refused by the quota too
            (f"alloc {avail - 4 * KiB}", CUDA_SUCCESS),
            ("alloc 4096", CUDA_SUCCESS),
            ("alloc 1", OOM),
        ]
        for cmd, want in script:
            assert sh.rc(cmd) == want, cmd
        # 1-byte allocations into a full quota: the first is refused and ends the loop
        r = sh.do("many 8 1")
        assert (r["rc"], r["done"]) == (OOM, 0), r
        refused = sum(want == OOM for _, want in script) + 1
        assert refused == 12
        assert region_counters(c.region)["oom_refusals"] == [refused, 0]
    finally:
        sh.close()
    assert region_counters(c.region)["oom_refusals"] == [refused, 0], "kept after the process exits"


def test_context_refusals_are_counted_per_gpu_across_processes(sim, bins):
    """Quotas smaller than a context (300 MiB on gpusim): creating one is refused, first
    after measuring it (the first process on a GPU must learn what one costs), then before
    asking the driver (the learned cost is reserved ahead). Three processes of one
    container share the counters; each refusal lands on the GPU it was for."""
    c = sim.container([200, 200])
    shells = [
        ("a", c, "ctx 1", "primary 1"),  # GPU 1: learns the cost, then refused ahead
        ("b", on_second_gpu(c), "ctx 0", "primary 0"),  # GPU 1 again, as its device 0
        ("c", c, "ctx 0", "primary 0"),  # GPU 0: learns its own cost
    ]
    want = [0, 0]
    for name, env, ctx, primary in shells:
        sh = Shell(env, bins["shell"], name)
        try:
            sh.ok("init")
            assert sh.rc(ctx) == OOM, f"{name}: {ctx}"
            assert sh.rc(primary) == OOM, f"{name}: {primary}"
        finally:
            sh.close()
        want[0 if name == "c" else 1] += 2
        assert region_counters(c.region)["oom_refusals"] == want, f"after process {name}"
    assert want == [2, 4]
