"""CuPy (the cupy-cuda12x wheel, its CUDA 12 runtime linked in, kernels compiled by the
nvidia-cuda-nvrtc-cu12 wheel) on gpusim, bare: what a user's first CuPy session does, judged
by what CuPy returns and by gpusim's ground truth (`gpusim status --json`).

Each test steps one CuPy process (cupy_shell.py) through its commands; cupy_common.py says
how CuPy finds its libraries. gpusim kernels compute nothing, so only copies and sets give
values worth checking; kernels are checked by the device time gpusim's cost model gives a
named kernel (`spin_20ms` runs 20 ms, `twice_1ms` 1 ms)."""

import pytest

from cupy_common import MiB, CupyShell, check_installed, cupy_env

CONTEXT = 300 * MiB  # gpusim's context_overhead_mib
CUDA_ERROR_NOT_FOUND = 500


@pytest.fixture
def cupy(sim):
    check_installed()
    cupy_env(sim.env)
    made = []

    def start(name="cupy"):
        made.append(CupyShell(sim, name))
        return made[-1]

    yield start
    for s in made:
        s.close()


def process(sim, pid, gpu=0):
    """gpusim's record of process `pid` on `gpu` (memory, busy_ns), or None."""
    for p in sim.status()["gpus"][gpu]["processes"]:
        if p["pid"] == pid:
            return p
    return None


def test_cupy_sees_gpusims_gpus_and_their_memory(sim, cupy):
    c = cupy()
    assert c.ok("count")["count"] == 2, "gpusim's default machine has two A100s"
    r = c.ok("init")
    assert r["total"] == 40960 * MiB
    # the primary context cudart made on device 0 is charged, and memGetInfo says so
    assert r["free"] == 40960 * MiB - CONTEXT
    assert process(sim, c.pid)["memory"] == CONTEXT


def test_cupy_makes_a_context_only_on_the_gpu_it_uses(sim, cupy):
    """cudart asks the driver for every device's primary context when it starts, and makes
    current and retains only the one it uses: as with a real driver, counting devices
    creates no context, and the process shows on the GPU it uses only."""
    c = cupy()
    assert c.ok("count")["count"] == 2
    assert [g["processes"] for g in sim.status()["gpus"]] == [[], []]
    c.ok("init")
    assert process(sim, c.pid)["memory"] == CONTEXT
    assert process(sim, c.pid, gpu=1) is None


def test_cupy_sees_only_the_visible_devices(sim, cupy):
    sim.env["CUDA_VISIBLE_DEVICES"] = "1"
    c = cupy()
    assert c.ok("init")["count"] == 1
    assert process(sim, c.pid, gpu=1)["memory"] == CONTEXT
    assert process(sim, c.pid, gpu=0) is None


def test_cupy_empty_is_charged_and_its_pool_keeps_it_until_free_all_blocks(sim, cupy):
    c = cupy()
    c.ok("init")
    a = c.ok(f"alloc {256 * MiB}")["id"]
    assert process(sim, c.pid)["memory"] == CONTEXT + 256 * MiB
    assert c.ok("pool") == {"rc": 0, "used": 256 * MiB, "total": 256 * MiB}
    assert c.ok("info")["free"] == 40960 * MiB - CONTEXT - 256 * MiB
    c.ok(f"del {a}")
    # the array is gone; CuPy's pool keeps its block, and the driver still holds it
    assert c.ok("pool") == {"rc": 0, "used": 0, "total": 256 * MiB}
    assert process(sim, c.pid)["memory"] == CONTEXT + 256 * MiB
    c.ok("freeall")
    assert c.ok("pool")["total"] == 0
    assert process(sim, c.pid)["memory"] == CONTEXT
    assert c.ok("info")["free"] == 40960 * MiB - CONTEXT


def test_host_device_copies_round_trip(cupy):
    c = cupy()
    assert c.ok("roundtrip 100000")["same"] == 1


def test_nvrtc_kernels_load_and_run_on_gpusim(sim, cupy):
    """CuPy's own elementwise kernels and an ElementwiseKernel, then a RawKernel: NVRTC
    compiles each to a cubin, gpusim loads it (its symbols read: a name the source does not
    declare is CUDA_ERROR_NOT_FOUND) and runs the kernels for their named time."""
    sim.env["GPUSIM_LOG"] = "1"
    c = cupy()
    c.ok("init")
    # device time between two events: the kernel's, and whatever gap the launch itself left
    # on an idle GPU (a loaded machine can add milliseconds); a kernel run as waves would
    # take microseconds
    us = c.ok("elementwise")["us"]
    assert 990 <= us <= 5_000, f"twice_1ms took {us} µs of device time"
    us = c.ok("rawkernel spin_20ms")["us"]
    assert 19_900 <= us <= 30_000, f"spin_20ms took {us} µs of device time"
    assert c.rc("rawkernel absent") == CUDA_ERROR_NOT_FOUND
    assert c.ok("info")["total"] == 40960 * MiB, "the process carries on"
    me = process(sim, c.pid)
    # twice_1ms and spin_20ms ran twice each (a first launch, then the timed one)
    assert me["busy_ns"] >= 2 * 20_000_000 + 2 * 1_000_000, me
    err = c.close()
    # Every request CuPy made is one gpusim serves, but for two optional driver-private
    # tables: one cudart asks for at start, one NVRTC asks for when it first compiles;
    # both carry on when refused.
    tolerated = (
        "gpusim: cuGetExportTable: unknown table {f8cff951-2146-8b4e-b9e2-fb469e7c0dd9}",  # cudart
        "gpusim: cuGetExportTable: unknown table {da9151d3-3ae6-cc41-a5c0-4f26d533e328}",  # NVRTC
    )
    logged = [line for line in err.splitlines() if line.startswith("gpusim:")]
    assert all(line.startswith(tolerated) for line in logged), "\n".join(logged)
