"""CUDA 13.0's location-based memory-pool calls on gpusim: cuMemGetDefaultMemPool,
cuMemGetMemPool and cuMemSetMemPool, reached through cuGetProcAddress_v2 at version 13000 as
cudart 13 reaches them (e2e/c/mempool_cuda13.c, built against the CUDA 13.x cuda.h), and the
CUDA 13.5 runtime's cudaMemGetDefaultMemPool / cudaMemGetMemPool / cudaMemSetMemPool over
them (e2e/c/mempool_cudart13.c). gpusim runs as a CUDA 13.5 driver, configured with
`gpusim default-config --cuda-version 13050`.

They share their state with cuDeviceGetDefaultMemPool / cuDeviceGetMemPool /
cuDeviceSetMemPool: a pool made current by either API is what the other reports and what
cuMemAllocAsync takes from."""

import pathlib
import subprocess

import pytest

from gpusim_harness import C_COMMON

DRIVER_PROBE = C_COMMON / "mempool_cuda13.c"
RUNTIME_PROBE = C_COMMON / "mempool_cudart13.c"

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_NOT_SUPPORTED = 801
SUCCESS, VERSION_NOT_SUFFICIENT = 0, 2  # CUdriverProcAddressQueryResult
MIB = 1 << 20


def cu13_dir():
    """nvidia/cu13 of the nvidia-cuda-runtime 13.x wheel: include/cuda.h, lib/libcudart.so.13."""
    import nvidia  # type: ignore

    for base in nvidia.__path__:
        d = pathlib.Path(base) / "cu13"
        if (d / "include" / "cuda.h").exists() and (d / "lib" / "libcudart.so.13").exists():
            return d
    raise RuntimeError("nvidia/cu13 (cuda.h 13.x, libcudart.so.13) not found; run scripts/setup-test-deps")


def build13(src, out, *extra):
    """Compile against the CUDA 13.x headers (the harness's `cc` puts the 12.9 ones first)."""
    cmd = [
        "gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-deprecated-declarations", "-O1", "-g",
        f"-I{cu13_dir() / 'include'}", f"-I{C_COMMON}", str(src), "-o", str(out), *extra,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stderr}"
    return out


@pytest.fixture(scope="module")
def driver_probe(cc, tmp_path_factory):  # cc: the harness's check that gcc exists
    return build13(DRIVER_PROBE, tmp_path_factory.mktemp("mempool") / "mempool_cuda13", "-ldl")


@pytest.fixture(scope="module")
def runtime_probe(cc, tmp_path_factory):
    lib = cu13_dir() / "lib"
    out = tmp_path_factory.mktemp("mempool") / "mempool_cudart13"
    return build13(RUNTIME_PROBE, out, f"-L{lib}", "-l:libcudart.so.13", f"-Wl,-rpath,{lib}")


def configure_cuda13(sim):
    """The documented CUDA 13 config (tests/gpusim/README.md, "CUDA 13")."""
    sim.configure_cuda(13050)


def kv(stdout):
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def codes(value):
    return [int(x) for x in value.split()]


def test_location_calls_share_the_device_pools(sim, driver_probe):
    configure_cuda13(sim)
    p = sim.run([driver_probe])
    print(p.stdout)
    r = kv(p.stdout)
    assert r.get("done") == "1", p.stdout + p.stderr
    # 13.0 entry points: handed out at 13000 (the exported symbol), not to a 12.x caller
    for name in ["cuMemGetDefaultMemPool", "cuMemGetMemPool", "cuMemSetMemPool"]:
        assert codes(r[f"{name}_13000"]) == [SUCCESS, 1], name
        assert codes(r[f"{name}_12090"]) == [VERSION_NOT_SUFFICIENT, 1], name
    assert int(r["before_init"]) == CUDA_ERROR_NOT_INITIALIZED
    # a device location with PINNED is the device's default / current pool
    assert r["default_is_device_default"] == "1"
    assert r["devices_have_own_defaults"] == "1"
    assert r["current_is_default"] == "1"
    # cuMemSetMemPool is seen by cuDeviceGetMemPool, cuMemGetMemPool and cuMemAllocAsync
    assert int(r["set_mem"]) == CUDA_SUCCESS
    assert r["set_mem_seen_by_device_get"] == "1"
    assert r["set_mem_seen_by_mem_get"] == "1"
    assert r["default_unchanged"] == "1"
    assert r["other_device_unchanged"] == "1"
    assert int(r["alloc_async_used_mine"]) == 4 * MIB
    assert int(r["alloc_async_used_default"]) == 0
    # cuDeviceSetMemPool is seen by cuMemGetMemPool and cuMemAllocAsync
    assert r["device_set_seen_by_mem_get"] == "1"
    assert int(r["after_device_set_used_mine"]) == 0
    assert int(r["after_device_set_used_default"]) == 2 * MIB
    # destroying the current pool makes the default current again
    assert r["destroyed_current_falls_back"] == "1"
    assert int(r["set_destroyed"]) == CUDA_ERROR_INVALID_VALUE
    # "the location ... must match those of the pool otherwise CUDA_ERROR_INVALID_VALUE"
    assert int(r["set_other_devices_pool"]) == CUDA_ERROR_INVALID_VALUE
    assert int(r["set_own_devices_pool"]) == CUDA_SUCCESS and r["set_dev1_seen"] == "1"
    assert int(r["set_null_pool"]) == CUDA_ERROR_INVALID_VALUE


def test_location_calls_errors(sim, driver_probe):
    """The errors cuda.h documents: NULL pointers, a bad allocation type, a location type the
    calls do not take are CUDA_ERROR_INVALID_VALUE; an ordinal that is no device is
    CUDA_ERROR_INVALID_DEVICE for cuMemGetDefaultMemPool (which documents it) and
    CUDA_ERROR_INVALID_VALUE for the other two (which document only that). What gpusim does not
    simulate (host, host-NUMA and managed pools, locality domains) is CUDA_ERROR_NOT_SUPPORTED,
    which all three document."""
    configure_cuda13(sim)
    r = kv(sim.run([driver_probe]).stdout)
    inval, nodev, unsup = CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_NOT_SUPPORTED
    assert codes(r["null_pool_out"]) == [inval, inval]
    assert codes(r["null_location"]) == [inval, inval, inval]
    assert codes(r["bad_device"]) == [nodev, inval, inval]
    assert codes(r["negative_device"]) == [nodev, inval, inval]
    assert codes(r["bad_alloc_type"]) == [inval, inval, inval]
    assert codes(r["host"]) == [unsup, unsup, unsup]
    assert codes(r["host_numa"]) == [unsup, unsup, unsup]
    assert codes(r["managed"]) == [unsup, unsup, unsup]
    assert codes(r["locality_domain"]) == [unsup]
    assert codes(r["not_allowed"]) == [inval, inval, inval]
    # none of the failed calls changed the current pool
    assert r["still_default"] == "1"


def test_cuda13_runtime_pools_on_gpusim(sim, runtime_probe):
    """cudart 13.5's cudaMemGetDefaultMemPool / cudaMemSetMemPool / cudaMemGetMemPool work on
    gpusim and agree with cudaDeviceGetMemPool / cudaDeviceSetMemPool and cudaMallocAsync."""
    configure_cuda13(sim)
    p = sim.run([runtime_probe])
    print(p.stdout)
    check_runtime(kv(p.stdout), p)


def test_cuda13_runtime_pools_under_vcuda(sim, runtime_probe):
    configure_cuda13(sim)
    box = sim.container(4096)
    p = box.run([runtime_probe])
    print(p.stdout)
    check_runtime(kv(p.stdout), p)


def check_runtime(r, p):
    assert r.get("done") == "1", p.stdout + p.stderr
    assert r["runtime"] == "13050"
    assert int(r["mem_get_default"]) == 0 and r["same_default"] == "1"
    assert int(r["mem_set"]) == 0 and r["mem_set_seen_by_device_get"] == "1"
    assert codes(r["mem_set_alloc_used"]) == [4 * MIB, 0]
    assert int(r["mem_get"]) == 0 and r["device_set_seen_by_mem_get"] == "1"
    assert codes(r["device_set_alloc_used"]) == [0, 2 * MIB]
