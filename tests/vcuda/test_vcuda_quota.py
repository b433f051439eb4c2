"""libvcuda's device-memory quota at every allocation entry point, at, just under and just
over the quota, judged twice: by what the call returns, and by gpusim's ground truth (the
container's processes never hold more than the quota on the GPU, at any instant: gpusim's
`memory_peak` is the high-water mark of the GPU, and only the container uses it here).

Expected figures are gpusim's documented accounting (tests/gpusim/README.md, "Memory"):
a context costs 300 MiB, a module 1 MiB, linear memory is charged rounded up to 512 B,
arrays to 64 KiB, VMM handles and pool growth come in 2 MiB granules. Every test process
makes a context and loads one module first, so with a quota of Q it can allocate exactly
Q - 301 MiB ("avail" below): the hidden context and module memory counts.

Over the quota the call returns CUDA_ERROR_OUT_OF_MEMORY and the process carries on: each
test makes a smaller allocation afterwards.
"""

import shutil

import pytest

from gpusim_harness import GPUSIM, LIB, ROOT

from vcuda_common import (
    ALLOC_GRANULE,
    ARRAY_GRANULE,
    CONTEXT,
    CU_AD_FORMAT_FLOAT,
    CU_AD_FORMAT_UNSIGNED_INT8,
    CU_AD_FORMAT_UNSIGNED_INT16,
    CUDA_ERROR_OUT_OF_MEMORY as OOM,
    KiB,
    MiB,
    MODULE,
    VMM_GRANULE,
    Shell,
    build,
    gpu_status,
    proc_memory,
    region_slots,
    region_used,
)


# no address-space randomisation, for gpusim's 32-bit allocations (see below)
SETARCH = ("setarch", "-R") if shutil.which("setarch") else ()


@pytest.fixture(scope="module")
def shell_bin(cc, tmp_path_factory):
    return build(cc, tmp_path_factory.mktemp("bin"), "vcuda_shell")


class Quota:
    """One container with one process (a CUDA shell) that has its context and module."""

    def __init__(self, sim, shell_bin, quota_mib, module=True, prefix=()):
        self.sim = sim
        self.quota = quota_mib * MiB
        self.container = sim.container(quota_mib)
        self.sh = Shell(self.container, shell_bin, prefix=prefix).start(module=module)
        self.avail = self.quota - CONTEXT - (MODULE if module else 0)

    def used(self):
        return gpu_status(self.sim)["memory_used"]

    def peak(self):
        return gpu_status(self.sim)["memory_peak"]

    def check_peak(self):
        peak = self.peak()
        assert peak <= self.quota, f"gpusim: the container held {peak - self.quota} B more than its quota"

    def info(self):
        r = self.sh.ok("info")
        return r["free"], r["total"]


@pytest.fixture
def q(sim, shell_bin):
    made = []

    def make(quota_mib=1024, module=True, prefix=()):
        made.append(Quota(sim, shell_bin, quota_mib, module, prefix))
        return made[-1]

    yield make
    for m in made:
        m.sh.close()


# ---- linear memory ---------------------------------------------------------------------------


def test_context_and_module_count_against_the_quota(q):
    """cuMemGetInfo sees the quota as the total, and the context and module as used."""
    t = q(1024, module=False)
    assert t.info() == (1024 * MiB - CONTEXT, 1024 * MiB)
    t.sh.ok("module")
    assert t.info() == (t.avail - MODULE, 1024 * MiB)
    assert proc_memory(t.sim, t.sh.pid) == CONTEXT + MODULE
    assert t.sh.rc(f"alloc {1024 * MiB - CONTEXT}") == OOM, "1024 MiB minus the context does not fit"
    t.sh.ok(f"alloc {1024 * MiB - CONTEXT - MODULE}")
    assert t.used() == 1024 * MiB
    t.check_peak()


def test_memory_no_hook_sees_counts_before_the_first_allocation(q):
    """A module loaded through the runtime's private table (CUDART_INTERFACE [1], gpusim
    charges 1 MiB) passes no hooked call. Before the first reservation relies on the books,
    libvcuda asks NVML what the driver charges the process: the context and that module. So
    the quota less the context no longer fits, the quota less both does."""
    t = q(1024, module=False)
    t.sh.ok("privmodule")
    assert proc_memory(t.sim, t.sh.pid) == CONTEXT + MODULE
    assert t.sh.rc(f"alloc {1024 * MiB - CONTEXT}") == OOM, "the private module was not counted"
    t.sh.ok(f"alloc {1024 * MiB - CONTEXT - MODULE}")
    assert t.used() == 1024 * MiB
    t.check_peak()


@pytest.mark.parametrize("teardown", ["ctxdestroy", "primary"])
def test_what_a_torn_down_context_held_is_no_longer_counted(q, teardown):
    """cuCtxDestroy, or cuDevicePrimaryCtxReset, frees the context's memory with no cuMemFree
    the library sees: the books forget it, so the next context can fill the quota again,
    and no more than the quota is ever held."""
    t = q(1024)
    if teardown == "primary":
        t.sh.ok("ctxdestroy")
        t.sh.ok("primary 0")
        t.sh.ok(f"alloc {1024 * MiB - CONTEXT}")
        assert t.sh.rc(f"alloc {ALLOC_GRANULE}") == OOM, "the quota is full"
        t.sh.ok("primaryreset 0")
        t.sh.ok("primary 0")
    else:
        t.sh.ok(f"alloc {t.avail}")
        assert t.sh.rc(f"alloc {ALLOC_GRANULE}") == OOM, "the quota is full"
        t.sh.ok("ctxdestroy")
        t.sh.ok("ctx 0")
    assert t.info() == (1024 * MiB - CONTEXT, 1024 * MiB)
    t.sh.ok(f"alloc {1024 * MiB - CONTEXT}")
    assert t.sh.rc(f"alloc {ALLOC_GRANULE}") == OOM
    t.check_peak()


@pytest.mark.parametrize("cmd", ["alloc", "managed"])
def test_linear_allocation_at_under_and_over_the_quota(q, cmd):
    """cuMemAlloc_v2 / cuMemAllocManaged: one byte over is refused, exactly the rest fits
    (gpusim then holds exactly the quota), and a free gives it all back."""
    t = q(1024)
    assert t.sh.rc(f"{cmd} {t.avail + 1}") == OOM
    assert t.used() == CONTEXT + MODULE, "a refused allocation never reached the driver"
    r = t.sh.ok(f"{cmd} {t.avail}")
    assert t.used() == t.quota
    assert t.info()[0] == 0
    assert t.sh.rc(f"{cmd} 1") == OOM
    t.sh.ok(f"free {r['id']}")
    assert t.used() == CONTEXT + MODULE and t.info()[0] == t.avail
    # just under: one byte less than the rest (gpusim rounds it up to the same 512 B granule)
    r = t.sh.ok(f"{cmd} {t.avail - 1}")
    assert t.used() == t.quota
    t.sh.ok(f"free {r['id']}")
    t.sh.ok(f"{cmd} {64 * MiB}")  # the process carries on after a refusal
    t.check_peak()


def test_gpusim_32bit_allocations_work_with_aslr(sim, shell_bin):
    """Precondition of the next test, about gpusim alone (no libvcuda): its 32-bit
    cuMemAlloc maps a 1 GiB MAP_32BIT region, but with address-space randomisation (the
    default) the kernel's MAP_32BIT window is [1 GiB + up to 32 MiB, 2 GiB), smaller than
    1 GiB, so every 32-bit allocation fails with CUDA_ERROR_OUT_OF_MEMORY."""
    sh = Shell(sim, shell_bin)
    try:
        sh.ok("init")
        sh.ok("ctx 0")
        assert sh.rc(f"alloc1 {64 * MiB}") == 0
    finally:
        sh.close()


def test_32bit_cuMemAlloc_v1(q):
    """The v1 entry point (32-bit pointer and size) is held to the same quota. Run without
    address-space randomisation (setarch -R) to sidestep the gpusim bug above."""
    t = q(1024, prefix=SETARCH)
    assert t.avail < 1 << 32
    assert t.sh.rc(f"alloc1 {t.avail + 1}") == OOM
    r = t.sh.ok(f"alloc1 {t.avail}")
    assert 0 < r["ptr"] < 1 << 32
    assert t.used() == t.quota
    assert t.sh.rc("alloc1 512") == OOM
    t.sh.ok(f"free {r['id']}")  # cuMemFree (v1)
    assert t.used() == CONTEXT + MODULE
    r = t.sh.ok(f"alloc1 {t.avail - 1}")
    t.sh.ok(f"free {r['id']}")
    t.sh.ok(f"alloc {t.avail}")  # everything the v1 calls held was released
    t.check_peak()


def test_pitched_allocation_uses_the_drivers_pitch(q):
    """cuMemAllocPitch_v2 is charged pitch × height, the pitch being the driver's (gpusim
    pads rows to 512 B): a 1000-byte row costs 1024 B."""
    t = q(1024)
    rows = t.avail // 1024
    assert rows * 1024 == t.avail
    assert t.sh.rc(f"pitch 1000 {rows + 1} 4") == OOM, "one row over"
    assert t.sh.rc(f"pitch 1025 {rows} 4") == OOM, "one byte wider: the pitch becomes 1536"
    r = t.sh.ok(f"pitch 1000 {rows} 4")
    assert r["pitch"] == 1024
    assert t.used() == t.quota
    assert t.sh.rc("alloc 1") == OOM
    t.sh.ok(f"free {r['id']}")
    r = t.sh.ok(f"pitch 1024 {rows - 1} 4")  # just under: one row less
    assert t.used() == t.quota - 1024
    assert t.sh.rc("alloc 1025") == OOM
    t.sh.ok("alloc 1024")
    t.check_peak()


def test_failed_driver_call_rolls_the_reservation_back(q):
    """gpusim does not simulate the 32-bit cuMemAllocPitch (CUDA_ERROR_NOT_SUPPORTED): the
    wrapper reserved the whole rest of the quota before calling it and must give it back."""
    t = q(1024)
    assert t.sh.rc(f"pitch1 1024 {t.avail // 1024} 4") not in (0, OOM)
    t.sh.ok(f"alloc {t.avail}")
    t.check_peak()


def test_small_allocations_are_charged_as_the_driver_charges_them(q):
    """gpusim charges every linear allocation rounded up to 512 B, so 1-byte allocations cost
    512 B each. With 4 KiB of the quota left, at most 8 of them fit; the container must not
    end up holding more than its quota by gpusim's count."""
    t = q(1024)
    t.sh.ok(f"alloc {t.avail - 4 * KiB}")
    r = t.sh.do("many 64 1")
    t.check_peak()
    assert r["done"] == 4 * KiB // ALLOC_GRANULE and r["rc"] == OOM, r


# ---- arrays ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["array", "array1", "array3d", "array3d1"])
def test_arrays_at_and_over_the_quota(q, cmd):
    """cuArrayCreate(_v2) / cuArray3DCreate(_v2): charged what cuArrayGetMemoryRequirements
    reports (format bytes × channels × extent, rounded up to 64 KiB); bits are not bytes."""
    t = q(1024)
    granules = t.avail // ARRAY_GRANULE
    assert granules * ARRAY_GRANULE == t.avail

    def shape(w, h, fmt, ch):
        return f"{w} {h} {fmt} {ch}" if "3d" not in cmd else f"{w} {h} 1 {fmt} {ch}"

    # one 64 KiB granule over: refused
    assert t.sh.rc(f"{cmd} {shape(65536, granules + 1, CU_AD_FORMAT_UNSIGNED_INT8, 1)}") == OOM
    # exactly the rest
    r = t.sh.ok(f"{cmd} {shape(65536, granules, CU_AD_FORMAT_UNSIGNED_INT8, 1)}")
    assert t.sh.ok(f"reqs {r['id']}")["size"] == t.avail
    assert t.used() == t.quota
    assert t.sh.rc("alloc 1") == OOM
    t.sh.ok(f"destroy {r['id']}")
    assert t.used() == CONTEXT + MODULE
    # 1024 × 1024 × 4 channels × UNSIGNED_INT16 is 8 MiB, and fits in the last 8 MiB
    t.sh.ok(f"alloc {t.avail - 8 * MiB}")
    r = t.sh.ok(f"{cmd} {shape(1024, 1024, CU_AD_FORMAT_UNSIGNED_INT16, 4)}")
    assert t.used() == t.quota
    t.sh.ok(f"destroy {r['id']}")
    # just under: 64 KiB less than the rest is 1 granule free, then one byte over it is not
    r = t.sh.ok(f"{cmd} {shape(65536, 127, CU_AD_FORMAT_UNSIGNED_INT8, 1)}")
    assert t.sh.rc(f"{cmd} {shape(65537, 1, CU_AD_FORMAT_UNSIGNED_INT8, 1)}") == OOM
    t.sh.ok(f"{cmd} {shape(65536, 1, CU_AD_FORMAT_UNSIGNED_INT8, 1)}")
    t.check_peak()


def test_array_rounding_never_takes_the_container_over(q):
    """An array whose raw size fits in what is left but whose driver size (rounded up to
    64 KiB) does not: refused, and gpusim never held more than the quota meanwhile."""
    t = q(1024)
    left = 2 * ARRAY_GRANULE + 512
    t.sh.ok(f"alloc {t.avail - left}")
    raw = 2 * ARRAY_GRANULE + 100  # fits in `left` as bytes, needs 3 granules
    assert t.sh.rc(f"array {raw} 1 {CU_AD_FORMAT_UNSIGNED_INT8} 1") == OOM
    assert t.used() == t.quota - left
    t.sh.ok(f"array {2 * ARRAY_GRANULE} 1 {CU_AD_FORMAT_UNSIGNED_INT8} 1")
    t.check_peak()


def test_mipmapped_array(q):
    """cuMipmappedArrayCreate: 256² floats, 9 levels = 349524 B, each level rounded to 512 B
    and the total to 64 KiB: 393216 B (cuMipmappedArrayGetMemoryRequirements)."""
    t = q(1024)
    size = 393216
    desc = f"256 256 0 {CU_AD_FORMAT_FLOAT} 1 9"
    r = t.sh.ok(f"mipmap {desc}")
    assert t.sh.ok(f"reqs {r['id']}")["size"] == size
    assert t.used() == CONTEXT + MODULE + size
    t.sh.ok(f"destroy {r['id']}")
    a = t.sh.ok(f"alloc {t.avail - size + ARRAY_GRANULE}")
    assert t.sh.rc(f"mipmap {desc}") == OOM, "one granule short"
    t.sh.ok(f"free {a['id']}")
    t.sh.ok(f"alloc {t.avail - size}")
    t.sh.ok(f"mipmap {desc}")
    assert t.used() == t.quota
    assert t.sh.rc("alloc 1") == OOM
    t.check_peak()


# ---- virtual memory management ---------------------------------------------------------------


def test_vmm_device_memory_and_host_memory(q):
    """cuMemCreate on a DEVICE location is charged its size (2 MiB granules); a HOST location
    is host memory and must not count, even far beyond the quota."""
    t = q(1025)  # 1025 - 301 = 724 MiB: a whole number of 2 MiB granules
    assert t.avail % VMM_GRANULE == 0
    assert t.sh.rc(f"vmm {t.avail + VMM_GRANULE} dev") == OOM
    r = t.sh.ok(f"vmm {t.avail} dev")
    assert t.used() == t.quota
    assert t.sh.rc(f"vmm {VMM_GRANULE} dev") == OOM
    h = t.sh.ok(f"vmm {4096 * MiB} host")  # 4 GiB of host memory at a full quota
    t.sh.ok(f"release {h['id']}")
    t.sh.ok(f"release {r['id']}")
    assert t.used() == CONTEXT + MODULE
    r = t.sh.ok(f"vmm {t.avail - VMM_GRANULE} dev")  # just under: one granule less
    t.sh.ok(f"vmm {VMM_GRANULE} dev")
    t.check_peak()


def test_vmm_memory_is_released_when_released_and_unmapped(q):
    """Physical VMM memory goes back only when the handle is released AND unmapped, in either
    order; until then it still counts."""
    t = q(1025)
    r = t.sh.ok(f"vmm {t.avail} dev")
    t.sh.ok(f"map {r['id']}")
    t.sh.ok(f"release {r['id']}")
    assert t.used() == t.quota, "released but still mapped: gpusim still holds it"
    assert t.sh.rc(f"alloc {VMM_GRANULE}") == OOM
    t.sh.ok(f"unmap {r['id']}")
    assert t.used() == CONTEXT + MODULE
    r = t.sh.ok(f"vmm {t.avail} dev")  # the whole quota is back
    t.sh.ok(f"map {r['id']}")
    t.sh.ok(f"unmap {r['id']}")  # the other order: unmapped first ...
    assert t.sh.rc(f"alloc {VMM_GRANULE}") == OOM, "... it still counts until released"
    t.sh.ok(f"release {r['id']}")
    t.sh.ok(f"alloc {t.avail}")
    t.check_peak()


# ---- stream-ordered allocation ---------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["async", "pool"])
def test_stream_ordered_allocation(q, cmd):
    """cuMemAllocAsync (the device's default pool) and cuMemAllocFromPoolAsync (a pool of
    our own) are charged the pool's growth, in 2 MiB steps; cuMemFreeAsync and a
    synchronisation give it back (release threshold 0)."""
    t = q(1025)
    assert t.sh.rc(f"{cmd} {t.avail + 1}") == OOM, "the pool would grow one granule too far"
    r = t.sh.ok(f"{cmd} {t.avail}")
    assert t.used() == t.quota
    assert t.sh.rc(f"{cmd} 512") == OOM
    assert t.sh.rc("alloc 512") == OOM
    t.sh.ok(f"freeasync {r['id']}")
    t.sh.ok("sync")
    assert t.used() == CONTEXT + MODULE
    t.sh.ok(f"alloc {t.avail}")  # the pool's memory is no longer counted
    t.sh.ok("freeall")
    r = t.sh.ok(f"{cmd} {t.avail - 1}")  # just under
    assert t.sh.ok("poolreserved")["reserved"] == t.avail
    assert t.used() == t.quota
    t.sh.ok(f"freeasync {r['id']}")
    t.sh.ok("sync")
    t.sh.ok(f"{cmd} {64 * MiB}")
    t.check_peak()


def test_pool_reuse_is_not_refused(q):
    """An allocation the pool can serve from memory it already reserved does not grow it:
    the driver charges nothing more, and the quota must not refuse it. Here the pool holds
    724 MiB with 723 MiB + 512 B in use and the container is exactly at its quota."""
    t = q(1025)
    t.sh.ok(f"async {t.avail - MiB + 1}")
    assert t.sh.ok("poolreserved")["reserved"] == t.avail
    assert t.used() == t.quota
    assert t.sh.rc(f"async {512 * KiB}") == 0, "fits in the pool's free reserve; nothing to charge"
    assert t.used() == t.quota
    t.check_peak()


# ---- graph memory nodes ----------------------------------------------------------------------


def test_graph_memory_nodes_are_counted_after_launch(q):
    """Graph memory nodes "where the driver API allows seeing them": a memory-allocation
    node only declares a size; the memory appears in the device's graph pool when the graph
    is launched (or uploaded), and only cuDeviceGetGraphMemAttribute(RESERVED_MEM_CURRENT)
    shows it. libvcuda counts it right after cuGraphLaunch returns, so from then on the rest
    of the container sees it; cuMemFree + cuDeviceGraphMemTrim give it back."""
    t = q(1024)
    g = t.sh.ok(f"graph {64 * MiB}")  # build, instantiate, launch, synchronise
    assert t.sh.ok("graphreserved")["reserved"] == 64 * MiB
    assert t.used() == CONTEXT + MODULE + 64 * MiB
    assert t.info()[0] == t.avail - 64 * MiB
    assert t.sh.rc(f"alloc {t.avail - 64 * MiB + 1}") == OOM
    a = t.sh.ok(f"alloc {t.avail - 64 * MiB}")
    t.check_peak()
    t.sh.ok(f"free {a['id']}")
    t.sh.ok(f"graphfree {g['id']}")
    # freed, but the graph pool keeps the memory until trimmed
    assert t.sh.ok("graphreserved")["reserved"] == 64 * MiB
    assert t.sh.rc(f"alloc {t.avail}") == OOM
    t.sh.ok("trim")
    assert t.used() == CONTEXT + MODULE
    t.sh.ok(f"alloc {t.avail}")
    t.check_peak()


def test_graph_launch_over_the_quota_is_counted_at_once(q):
    """A launch that grows the graph pool past the quota cannot be refused by looking at the
    pool (its growth shows only afterwards); what libvcuda guarantees is that the container
    sees it at once: it is then full and every further allocation is refused until the
    graph memory is freed and trimmed."""
    t = q(1024)
    g = t.sh.ok(f"graph {t.avail + 64 * MiB}")
    assert t.info()[0] == 0
    assert t.sh.rc("alloc 512") == OOM
    assert region_used(t.container.region) >= t.quota
    t.sh.ok(f"graphfree {g['id']}")
    t.sh.ok("trim")
    t.sh.ok(f"alloc {t.avail}")


# ---- CUDA 13 ABIs ------------------------------------------------------------------------------


@pytest.fixture
def q13(sim, q):
    """`q` on gpusim configured as a CUDA 13.5 driver, which hands out the 13.x ABIs."""
    sim.configure_cuda(13050)
    return q


def test_cuda13_ctx_synchronize_gives_pool_memory_back(q13):
    """cudart 13 synchronises a device through cuCtxSynchronize's 13.0 ABI
    (`cuCtxSynchronize_v2(CUcontext)`, from cuGetProcAddress_v2 at 13000): that must be
    libvcuda's wrapper, which lets the pools' cached memory go from the books as
    cuCtxSynchronize does."""
    t = q13(1025)
    r = t.sh.ok(f"async {t.avail}")
    assert t.sh.rc("alloc 512") == OOM
    t.sh.ok(f"freeasync {r['id']}")
    s = t.sh.ok("ctxsync13")
    assert (s["lib"], s["fn"]) == ("libvcuda.so", "cuCtxSynchronize_v2"), s
    assert t.used() == CONTEXT + MODULE
    t.sh.ok(f"alloc {t.avail}")  # the pool's memory is no longer counted
    t.check_peak()


def test_cuda13_graph_add_node_v3_memory_is_counted(q13):
    """A memory-allocation node made through cuGraphAddNode's 13.4 ABI (`cuGraphAddNode_v3`,
    from cuGetProcAddress_v2 at 13040) is seen by libvcuda's wrapper: after the launch the
    graph pool's memory counts against the quota, as with cuGraphAddMemAllocNode."""
    t = q13(1024)
    g = t.sh.ok(f"graph13 {64 * MiB}")
    assert (g["lib"], g["fn"]) == ("libvcuda.so", "cuGraphAddNode_v3"), g
    assert t.sh.ok("graphreserved")["reserved"] == 64 * MiB
    assert t.info()[0] == t.avail - 64 * MiB
    assert t.sh.rc(f"alloc {t.avail - 64 * MiB + 1}") == OOM
    t.sh.ok(f"alloc {t.avail - 64 * MiB}")
    t.check_peak()


# ---- several processes, one container ------------------------------------------------------


def test_processes_of_a_container_share_one_quota(sim, shell_bin):
    """Two processes of one container: each pays its own context and module, and together
    they get exactly the quota. A third container on the same GPU is not affected."""
    c = sim.container(2048)
    a = Shell(c, shell_bin, "a").start()
    b = Shell(c, shell_bin, "b").start()
    try:
        quota = 2048 * MiB
        rest = quota - 2 * (CONTEXT + MODULE)
        a.ok(f"alloc {rest - 100 * MiB}")
        assert b.rc(f"alloc {100 * MiB + 512}") == OOM
        b.ok(f"alloc {100 * MiB}")
        assert a.rc("alloc 512") == OOM
        slots = {s["pid"]: s for s in region_slots(c.region)}
        assert slots[a.pid]["api"][0] == rest - 100 * MiB and slots[b.pid]["api"][0] == 100 * MiB
        assert slots[a.pid]["hidden"][0] == slots[b.pid]["hidden"][0] == CONTEXT + MODULE
        other = sim.container(1024, name="other")
        o = Shell(other, shell_bin, "other").start()
        o.ok(f"alloc {1024 * MiB - CONTEXT - MODULE}")
        o.close()
        st = gpu_status(sim)
        assert proc_memory(sim, a.pid) + proc_memory(sim, b.pid) == quota
        assert st["memory_peak"] <= quota + 1024 * MiB
    finally:
        a.close()
        b.close()


def test_context_larger_than_the_quota(sim, shell_bin):
    """A quota smaller than one context: context creation fails with
    CUDA_ERROR_OUT_OF_MEMORY and leaves nothing behind. The first process has to create
    one to learn what it costs (gpusim holds it for a moment); the learned cost is kept in
    the region, so later processes are refused before the driver is asked."""
    c = sim.container(200)
    first = Shell(c, shell_bin, "first")
    first.ok("init")
    assert first.rc("ctx 0") == OOM
    assert first.rc("primary 0") == OOM
    assert gpu_status(sim)["memory_used"] == 0
    first.close()
    sim.gpusim("reset-peak")
    second = Shell(c, shell_bin, "second")
    second.ok("init")
    assert second.rc("ctx 0") == OOM
    assert second.rc("primary 0") == OOM
    assert gpu_status(sim)["memory_peak"] == 0, "refused without creating a context"
    second.close()


def test_each_gpu_has_its_own_quota(sim, shell_bin):
    """A container given GPU 1 (1024 MiB) and GPU 0 (2048 MiB), in that order: CUDA device 0
    is GPU 1 and device 1 is GPU 0, and allocations count against their own GPU's quota."""
    gpus = sim.status()["gpus"]
    c = sim.container([1024, 2048], gpus=[gpus[1]["uuid"], gpus[0]["uuid"]])
    a = Shell(c, shell_bin, "a")
    b = Shell(c, shell_bin, "b")
    try:
        for sh, dev in ((a, 0), (b, 1)):
            sh.ok("init")
            sh.ok(f"ctx {dev}")
            sh.ok("module")
        assert a.ok("info")["total"] == 1024 * MiB and b.ok("info")["total"] == 2048 * MiB
        assert a.ok("totalmem 1")["total"] == 2048 * MiB
        rest0, rest1 = 1024 * MiB - CONTEXT - MODULE, 2048 * MiB - CONTEXT - MODULE
        assert a.rc(f"alloc {rest0 + 512}") == OOM
        assert b.rc(f"alloc {rest1 + 512}") == OOM
        a.ok(f"alloc {rest0}")
        b.ok(f"alloc {rest1}")
        st = sim.status()["gpus"]
        assert st[1]["memory_used"] == 1024 * MiB and st[0]["memory_used"] == 2048 * MiB
        assert st[1]["memory_peak"] <= 1024 * MiB and st[0]["memory_peak"] <= 2048 * MiB
        assert [s["api"] for s in region_slots(c.region) if s["pid"] == a.pid] == [[rest0, 0]]
    finally:
        a.close()
        b.close()


def test_an_absurd_size_leaves_the_count_intact(q):
    """A size near 2^64, as a buggy program computing a negative size passes ((size_t)-4096):
    refused, and what the process already holds stays counted, so it still cannot allocate
    more than the rest of its quota."""
    t = q(1024)
    t.sh.ok(f"alloc {100 * MiB}")
    assert t.sh.rc(f"alloc {(1 << 64) - 4096}") != 0
    assert region_used(t.container.region) == t.quota - t.avail + 100 * MiB
    assert t.info()[0] == t.avail - 100 * MiB
    assert t.sh.rc(f"alloc {t.avail}") == OOM
    t.check_peak()


@pytest.mark.skipif(shutil.which("unshare") is None or __import__("os").geteuid() != 0,
                    reason="a pid namespace needs unshare and root")
def test_a_first_context_is_measured_before_the_driver_knows_the_process(sim, cc, tmp_path):
    """In a container the driver names a process by its host pid, which libvcuda learns only
    when the manager answers its registration, on a thread of its own: a first context made
    before that cannot be found in NVML's process list. The library then measures it from
    the device's free memory before and after; that reading took `cuMemGetInfo`, which has
    no context to answer from before the first one, so the context was counted at the
    provisional 512 MiB: a 1 GiB container's first process got 512 MiB instead of 724.
    Here: a pid namespace, gpusim giving host pids (`gpusim pid-service`), no manager."""
    import subprocess

    fill = cc(ROOT / "tests" / "demo" / "fill.c", tmp_path / "fill", f"-L{LIB}", "-lcuda")
    svc = subprocess.Popen([GPUSIM, "pid-service", "--socket", tmp_path / "pid.sock"], stdout=subprocess.PIPE, text=True)
    try:
        assert svc.stdout.readline().strip() == "ready"
        c = sim.container(1024)
        c.env["GPUSIM_PID_SOCKET"] = str(tmp_path / "pid.sock")
        p = c.run(["unshare", "--pid", "--fork", "--mount-proc", fill, 64, 100000], stdin=subprocess.DEVNULL)
    finally:
        svc.kill()
        svc.wait()
    assert f"{1024 - CONTEXT // MiB} MiB free" in p.stdout, p.stdout + p.stderr
    assert gpu_status(sim)["memory_peak"] <= 1024 * MiB
