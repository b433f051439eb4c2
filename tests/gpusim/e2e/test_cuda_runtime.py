"""The CUDA runtime (libcudart 12.9 from the nvidia-cuda-runtime-cu12 wheel) on gpusim: it
initialises through gpusim's export tables (the integrity check among them), then a C
program on the runtime API allocates, sets, copies and frees, bare and under libvcuda with
a quota; and a kernel registered the way nvcc's host code does it (a hand-built fatbin
behind a `__fatBinC_Wrapper_t`, which cudart hands to cuLibraryLoadData) is launched with
cudaLaunchKernel and timed with events.

The same probes run against the CUDA 13.5 runtime (libcudart.so.13 from the cu13 wheel)
with gpusim configured as a 13050 driver; cudart 13.5 also asks for the CUEXP_CONTEXT
table."""

import pathlib

import pytest

from gpusim_harness import C_COMMON, cudart_lib_dir

PROBE = C_COMMON / "cudart_basic.c"
LAUNCH = C_COMMON / "cudart_launch.c"


def build_probe(cc, tmp_path_factory, source, major):
    """`source` linked against the wheel's libcudart.so.`major` only; cudart dlopens
    libcuda.so.1 itself, and finds gpusim's first on LD_LIBRARY_PATH."""
    lib = cudart_lib_dir(major)
    out = tmp_path_factory.mktemp(f"cudart{major}") / pathlib.Path(source).stem
    return cc(source, out, f"-L{lib}", f"-l:libcudart.so.{major}", f"-Wl,-rpath,{lib}")


@pytest.fixture(scope="module")
def probe(cc, tmp_path_factory):
    return build_probe(cc, tmp_path_factory, PROBE, 12)


@pytest.fixture(scope="module")
def launch_probe(cc, tmp_path_factory):
    return build_probe(cc, tmp_path_factory, LAUNCH, 12)


@pytest.fixture(scope="module")
def probe13(cc, tmp_path_factory):
    return build_probe(cc, tmp_path_factory, PROBE, 13)


@pytest.fixture(scope="module")
def launch_probe13(cc, tmp_path_factory):
    return build_probe(cc, tmp_path_factory, LAUNCH, 13)


def parse(stdout):
    """{call: [(rc, rest), ...]} from the probe's lines."""
    calls = {}
    for line in stdout.splitlines():
        if line.startswith("registered"):
            continue
        head, rest = line[:22].strip(), line[22:].split(None, 2)
        calls.setdefault(head, []).append((int(rest[0]), rest[2] if len(rest) > 2 else ""))
    return calls


def test_runtime_initialises_and_runs_on_gpusim(sim, probe):
    p = sim.run([probe, "5000"])
    print(p.stdout)
    c = parse(p.stdout)
    assert c["cudaDriverGetVersion"] == [(0, "12090")]
    assert c["cudaGetDeviceCount"] == [(0, "2")], p.stdout
    rc, info = c["cudaMemGetInfo"][0]
    assert rc == 0 and info.endswith("total 40960 MiB"), info
    assert c["cudaMalloc(64 MiB)"][0][0] == 0
    assert c["cudaMemset"] == [(0, "")]
    assert c["cudaMemcpy DtoH"] == [(0, "memset bytes seen: yes"), (0, "roundtrip: yes")]
    assert c["cudaMemcpy HtoD"][0][0] == 0
    assert c["cudaDeviceSynchronize"][0][0] == 0
    assert c["cudaMalloc(big)"][0][0] == 0, "5000 MiB fits on a 40 GiB GPU"
    assert c["cudaFree(big)"][0][0] == 0
    # After cudaDeviceReset (primary context reset: the runtime's storage destructors run)
    # the runtime carries on with a fresh context.
    assert c["cudaDeviceReset"] == [(0, "")]
    assert c["cudaMalloc(64 MiB)"] == [(0, ""), (0, "after the reset")]
    assert [rc for rc, _ in c["cudaFree"]] == [0, 0]


def test_integrity_check_is_exact(sim, probe):
    """One bit off in the driver's answer and cudart refuses the driver."""
    sim.env["GPUSIM_FAULT_INTEGRITY"] = "1"
    p = sim.run([probe])
    c = parse(p.stdout)
    assert c["cudaGetDeviceCount"][0][0] == 103, p.stdout  # cudaErrorSoftwareValidityNotEstablished


def test_integrity_check_hashes_the_visible_devices(sim, probe):
    sim.env["CUDA_VISIBLE_DEVICES"] = "1"
    c = parse(sim.run([probe]).stdout)
    assert c["cudaGetDeviceCount"] == [(0, "1")]
    assert c["cudaFree"][0][0] == 0


def test_unknown_export_table_is_logged(sim, probe):
    """cudart first asks for a table no driver-side description names; gpusim refuses it
    (cudart carries on) and says so when its log is on."""
    sim.env["GPUSIM_LOG"] = "1"
    p = sim.run([probe])
    assert parse(p.stdout)["cudaGetDeviceCount"] == [(0, "2")]
    assert "gpusim: cuGetExportTable: unknown table {f8cff951-2146-8b4e-b9e2-fb469e7c0dd9}" in p.stderr, p.stderr
    del sim.env["GPUSIM_LOG"]
    quiet = sim.run([probe])
    assert "cuGetExportTable" not in quiet.stderr


def test_runtime_under_vcuda_sees_the_quota(sim, probe):
    box = sim.container(4096)
    p = box.run([probe, "5000"])
    print(p.stdout)
    c = parse(p.stdout)
    assert c["cudaGetDeviceCount"][0][0] == 0, p.stdout + p.stderr
    rc, info = c["cudaMemGetInfo"][0]
    # the runtime's primary context (gpusim charges 300 MiB) already counts
    assert rc == 0 and info == "free 3796 MiB total 4096 MiB", info
    assert c["cudaMemcpy DtoH"] == [(0, "memset bytes seen: yes"), (0, "roundtrip: yes")]
    assert c["cudaMalloc(big)"][0][0] == 2, "past the quota: cudaErrorMemoryAllocation"
    # The failure is not sticky: it is reported once, and the process carries on.
    assert c["cudaGetLastError"] == [(2, "")]
    assert c["cudaMalloc(64 MiB)"] == [(0, ""), (0, "after the failure"), (0, "after the reset")]
    assert [rc for rc, _ in c["cudaFree"]] == [0, 0, 0]


def check_launch(p):
    c = parse(p.stdout)
    launches = c["cudaLaunchKernel"]
    assert [rc for rc, _ in launches[:3]] == [0, 0, 0], p.stdout + p.stderr
    rc, elapsed = c["cudaEventElapsedTime"][0]
    ms = float(elapsed.split()[0])
    # gpusim's cost model: a kernel named *_20ms runs 20 ms.
    assert rc == 0 and 19.5 <= ms <= 25.0, p.stdout
    # The fatbin was read, not taken on trust: a registered name it does not declare fails
    # (cuLibraryGetKernel: CUDA_ERROR_NOT_FOUND -> cudaErrorSymbolNotFound), once.
    assert launches[3] == (500, "not_in_the_fatbin"), p.stdout
    assert c["cudaGetLastError"] == [(500, "")]
    assert [rc for rc, _ in c["cudaDeviceSynchronize"]] == [0, 0, 0]
    assert c["cudaFree"] == [(0, "")]


@pytest.mark.parametrize("loading", ["LAZY", "EAGER"])
def test_registered_fatbin_kernel_launches_on_gpusim(sim, launch_probe, loading):
    sim.env["CUDA_MODULE_LOADING"] = loading
    p = sim.run([launch_probe])
    print(p.stdout)
    check_launch(p)


def test_registered_fatbin_kernel_launches_under_vcuda(sim, launch_probe):
    box = sim.container(4096)
    p = box.run([launch_probe])
    print(p.stdout)
    check_launch(p)


def test_malformed_fatbin_is_an_invalid_image(sim, launch_probe):
    """The probe's fatbin with its entries declared 1 TiB long: gpusim refuses the image
    (CUDA_ERROR_INVALID_IMAGE, which cudart reports as cudaErrorInvalidKernelImage) rather
    than read past it, and the process carries on."""
    p = sim.run([launch_probe, "broken"])
    print(p.stdout)
    c = parse(p.stdout)
    launches = c["cudaLaunchKernel"]
    assert launches[0] == (200, "warm-up"), p.stdout
    # cudart's own bookkeeping answers a second launch of the same failed kernel with
    # cudaErrorInvalidResourceHandle; nothing launches.
    assert all(rc != 0 for rc, _ in launches), p.stdout
    assert c["cudaMalloc"] == [(0, "")]
    assert c["cudaFree"] == [(0, "")]


CUDA13_PROBE = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def proc(name, version):
    fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
    rc = cuda.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), version, 0, ctypes.byref(status))
    return rc, status.value, fn.value
# Before cuInit: the configured cuda_version bounds the versions callers may ask for.
print("before", proc("cuCtxGetDevice", 13000), proc("cuMemcpyBatchAsync", 13000)[:2], proc("cuMemAlloc", 13060)[0])
batch = proc("cuMemcpyBatchAsync", 13000)[2]
addr = lambda name: ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value
print("batch13", batch == addr("cuMemcpyBatchAsync_v2"), batch == addr("cuMemcpyBatchAsync"))
assert cuda.cuInit(0) == 0
ctx, dev = ctypes.c_void_p(), ctypes.c_int(-1)
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
get_dev = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_void_p)(proc("cuCtxGetDevice", 13000)[2])
sync = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(proc("cuCtxSynchronize", 13000)[2])
print("no_current", get_dev(ctypes.byref(dev), None), sync(None))
print("explicit", get_dev(ctypes.byref(dev), ctx), dev.value, sync(ctx))
assert cuda.cuCtxSetCurrent(ctx) == 0
dev.value = -1
print("current", get_dev(ctypes.byref(dev), None), dev.value, sync(None))
"""


def test_cuda13_abis_and_version_before_init(sim):
    """With cuda_version = 13050 configured, cuGetProcAddress takes 13.x requests before
    cuInit (cudart 13 asks then) and hands out the 13.0 ABIs cudart 13 requires."""
    sim.configure_cuda(13050)
    p = sim.python(CUDA13_PROBE)
    print(p.stdout)
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    before = lines["before"]
    assert before.startswith("(0, 0, ") and "None" not in before.split(")")[0], before
    # A 13.0 ABI gpusim only stubs (issue 22: every cuda.h function is exported) is that ABI's
    # symbol, never the 12.x one; a version past the configured one is refused.
    assert before.endswith("(0, 0) 1"), before
    assert lines["batch13"] == "True False"
    assert lines["no_current"] == "201 201"  # CUDA_ERROR_INVALID_CONTEXT
    assert lines["explicit"] == "0 1 0"
    assert lines["current"] == "0 1 0"


def configure_cuda13(sim):
    """gpusim as a CUDA 13.5 driver (cuda_version = 13050): what cudart 13.5 requires."""
    sim.configure_cuda(13050)


def test_cuda13_runtime_initialises_and_runs_on_gpusim(sim, probe13):
    """cudart 13.5 asks for CUEXP_CONTEXT {21318c60-...} (refused, cudaGetDeviceCount fails
    with cudaErrorInvalidValue); gpusim serves it, and cudart only reads its header: with
    GPUSIM_LOG on, no slot reports a call."""
    configure_cuda13(sim)
    sim.env["GPUSIM_LOG"] = "1"
    p = sim.run([probe13, "5000"])
    print(p.stdout)
    print(p.stderr)
    c = parse(p.stdout)
    assert c["cudaDriverGetVersion"] == [(0, "13050")]
    assert c["cudaRuntimeGetVersion"] == [(0, "13050")]
    assert c["cudaGetDeviceCount"] == [(0, "2")], p.stdout + p.stderr
    rc, info = c["cudaMemGetInfo"][0]
    assert rc == 0 and info.endswith("total 40960 MiB"), info
    assert c["cudaMemcpy DtoH"] == [(0, "memset bytes seen: yes"), (0, "roundtrip: yes")]
    assert c["cudaDeviceSynchronize"][0][0] == 0
    assert c["cudaMalloc(big)"][0][0] == 0, "5000 MiB fits on a 40 GiB GPU"
    assert c["cudaFree(big)"][0][0] == 0
    assert c["cudaDeviceReset"] == [(0, "")]
    assert c["cudaMalloc(64 MiB)"] == [(0, ""), (0, "after the reset")]
    assert [rc for rc, _ in c["cudaFree"]] == [0, 0]
    assert "21318c60" not in p.stderr, p.stderr
    assert "CUEXP_CONTEXT[" not in p.stderr, p.stderr


def test_cuda13_runtime_under_vcuda_sees_the_quota(sim, probe13):
    configure_cuda13(sim)
    box = sim.container(4096)
    p = box.run([probe13, "5000"])
    print(p.stdout)
    c = parse(p.stdout)
    assert c["cudaDriverGetVersion"] == [(0, "13050")]
    assert c["cudaGetDeviceCount"][0][0] == 0, p.stdout + p.stderr
    rc, info = c["cudaMemGetInfo"][0]
    assert rc == 0 and info == "free 3796 MiB total 4096 MiB", info
    assert c["cudaMemcpy DtoH"] == [(0, "memset bytes seen: yes"), (0, "roundtrip: yes")]
    assert c["cudaMalloc(big)"][0][0] == 2, "past the quota: cudaErrorMemoryAllocation"
    assert c["cudaGetLastError"] == [(2, "")]
    assert c["cudaMalloc(64 MiB)"] == [(0, ""), (0, "after the failure"), (0, "after the reset")]
    assert [rc for rc, _ in c["cudaFree"]] == [0, 0, 0]


@pytest.mark.parametrize("runtime", ["12.9", "13.5"])
def test_the_runtimes_context_counts_before_the_first_allocation(sim, probe, probe13, runtime):
    """cudart takes its primary context's handle from the driver's private table and
    activates it with cuDevicePrimaryCtxRetain, which libvcuda holds for. So right after
    start, with a 4096 MiB quota, 3796 MiB fit (gpusim charges 300 MiB for a context) and
    3797 MiB do not; after cudaDeviceReset the new primary context is counted again."""
    if runtime == "13.5":
        configure_cuda13(sim)
    exe = probe if runtime == "12.9" else probe13
    box = sim.container(4096)
    box.env["PROBE_FIRST_MALLOC_MIB"] = "3797"
    c = parse(box.run([exe, "3797"]).stdout)
    assert c["cudaMalloc(first)"] == [(2, "3797 MiB")], c
    assert c["cudaMalloc(big)"] == [(2, "3797 MiB")], c
    box.env["PROBE_FIRST_MALLOC_MIB"] = "3796"
    c = parse(box.run([exe, "3796"]).stdout)
    assert c["cudaMalloc(first)"] == [(0, "3796 MiB")], c
    assert c["cudaMalloc(big)"] == [(0, "3796 MiB")], c
    assert c["cudaMalloc(64 MiB)"] == [(0, ""), (0, "after the reset")]


@pytest.mark.parametrize("loading", ["LAZY", "EAGER"])
def test_cuda13_registered_fatbin_kernel_launches_on_gpusim(sim, launch_probe13, loading):
    configure_cuda13(sim)
    sim.env["CUDA_MODULE_LOADING"] = loading
    sim.env["GPUSIM_LOG"] = "1"
    p = sim.run([launch_probe13])
    print(p.stdout)
    check_launch(p)
    assert "CUEXP_CONTEXT[" not in p.stderr, p.stderr


def test_cuda13_registered_fatbin_kernel_launches_under_vcuda(sim, launch_probe13):
    configure_cuda13(sim)
    box = sim.container(4096)
    p = box.run([launch_probe13])
    print(p.stdout)
    check_launch(p)
