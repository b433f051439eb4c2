"""Every way a program reaches the driver lands in libvcuda's wrappers (reference
cuda-interposition.md §1, §2): dlopen + dlsym on the driver's handle, dlsym(RTLD_DEFAULT),
dlsym(RTLD_NEXT), cuGetProcAddress (the 11.x name, 4 arguments), cuGetProcAddress_v2, and the
per-thread-default-stream flag, which must give our cuMemAllocAsync_ptsz wrapper. A wrapper
is proven reached by behaviour: the program (c/vcuda_dlsym.c, not linked with libcuda)
allocates the whole quota, which the 40 GiB simulated GPU would grant, and gets
CUDA_ERROR_OUT_OF_MEMORY. Lookups that are not ours behave as without libvcuda."""

import pytest

from gpusim_harness import VCUDA_LIB
from vcuda_common import C, CUDA_ERROR_OUT_OF_MEMORY as OOM, build

QUOTA_MIB = 1024


def kv(text):
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.fixture(scope="module")
def bins(cc, tmp_path_factory):
    out = tmp_path_factory.mktemp("bin")
    return {
        "dlsym": build(cc, out, "vcuda_dlsym", "-ldl", link_cuda=False),
        "other": cc(C / "vcuda_other.c", out / "libvcuda_other.so", "-shared", "-fPIC"),
        "interposer": cc(C / "vcuda_interposer.c", out / "libinterposer.so", "-shared", "-fPIC", "-ldl"),
    }


@pytest.fixture
def run(sim, bins):
    c = sim.container(QUOTA_MIB)
    p = c.run([bins["dlsym"], QUOTA_MIB, bins["other"]])
    r = kv(p.stdout)
    assert r.get("done") == "1", p.stdout + p.stderr
    return r


def test_dlopen_and_dlsym_reach_the_wrappers(run):
    r = run
    for way in ("handle", "default", "next"):  # dlsym(h, …), dlsym(RTLD_DEFAULT, …), RTLD_NEXT
        assert r[f"{way}_lib"] == "libvcuda.so", way
        assert int(r[f"{way}_over"]) == OOM, f"{way}: the whole quota was not refused"
        assert r[f"{way}_small"] == "0", f"{way}: the program carries on"
    assert r["same_wrapper"] == "1"
    assert r["init_lib"] == r["free_lib"] == "libvcuda.so"


def test_unwrapped_entry_points_are_the_drivers(run):
    assert run["unwrapped_lib"] == "libcuda.so.1"  # cuDeviceGetName: nothing to control


def test_cuGetProcAddress_v1_name(run):
    """The 4-argument cuGetProcAddress (CUDA 11.3 ABI), found with dlsym: "cuMemAlloc" at
    12000 is our cuMemAlloc_v2 wrapper, at 2000 our 32-bit cuMemAlloc wrapper."""
    r = run
    assert r["gpa1_lib"] == "libvcuda.so"
    assert r["gpa1_alloc_is_v2_wrapper"] == "1"
    assert int(r["gpa1_alloc_over"]) == OOM and r["gpa1_alloc_small"] == "0"
    assert r["gpa1_alloc2000_is_v1_wrapper"] == "1"
    assert int(r["gpa1_v1_over"]) == OOM


def test_cuGetProcAddress_v2(run):
    r = run
    assert r["gpa2_lib"] == "libvcuda.so"
    assert r["gpa2_alloc_status"] == "0"  # CU_GET_PROC_ADDRESS_SUCCESS
    assert r["gpa2_alloc_is_v2_wrapper"] == "1"
    assert int(r["gpa2_alloc_over"]) == OOM and r["gpa2_alloc_small"] == "0"


def test_per_thread_flag_gives_the_ptsz_wrapper(run):
    """CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM for cuMemAllocAsync is the driver's
    cuMemAllocAsync_ptsz, so it must be our wrapper of exactly that (the address
    dlsym(RTLD_DEFAULT, "cuMemAllocAsync_ptsz") gives), and the quota applies to it; the
    legacy flag gives the plain cuMemAllocAsync wrapper."""
    r = run
    assert r["ptsz_status"] == "0"
    assert r["ptsz_lib"] == "libvcuda.so"
    assert r["ptsz_is_ptsz_wrapper"] == "1"
    assert int(r["ptsz_over"]) == OOM
    assert r["ptsz_small"] == "0"
    assert r["legacy_is_plain_wrapper"] == "1"


def test_cuGetProcAddress_of_itself_stays_inside(run):
    """A runtime asking cuGetProcAddress for "cuGetProcAddress" gets our wrapper, or its
    nested lookups would escape the library (reference §1)."""
    assert run["gpa_self_status"] == "0" and run["gpa_self_is_wrapper"] == "1"


def test_status_out_parameter_is_the_drivers(run):
    """Unknown symbol: CUDA_SUCCESS, NULL, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND (1); a
    symbol newer than the requested version: NULL, VERSION_NOT_SUFFICIENT (2)."""
    r = run
    assert (r["unknown_rc"], r["unknown_null"], r["unknown_status"]) == ("0", "1", "1")
    assert (r["too_new_rc"], r["too_new_null"], r["too_new_status"]) == ("0", "1", "2")


def test_other_lookups_behave_as_without_libvcuda(run):
    r = run
    assert r["next_puts_is_libc"] == "1"  # dlsym(RTLD_NEXT, "puts") from the program
    assert r["missing_null"] == "1" and r["missing_dlerror"] == "1"
    assert r["missing_cu_null"] == "1" and r["missing_cu_dlerror"] == "1"
    # a library that is not the driver but exports a cuMemAlloc_v2 of its own keeps it
    assert r["other_lib"] == "libvcuda_other.so" and r["other_rc"] == "4242"


def test_rtld_next_from_another_interposer(sim, bins):
    """Another preloaded library, after libvcuda, wraps puts and finds the real one with
    dlsym(RTLD_NEXT, "puts"). libvcuda's dlsym must search after that library (its caller),
    or the lookup finds the interposer's own puts and recurses until the stack overflows."""
    c = sim.container(QUOTA_MIB)
    c.env["LD_PRELOAD"] = f"{VCUDA_LIB} {bins['interposer']}"
    p = c.run([bins["dlsym"], QUOTA_MIB], timeout=30)
    lines = p.stdout.splitlines()
    assert "[interposed] done=1" in lines, p.stdout + p.stderr
    assert "handle_over=2" in lines, "the wrappers are still reached with both preloaded"
