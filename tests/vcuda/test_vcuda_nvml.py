"""NVML as a vcuda container sees it (issue 3, "What the container sees"): only its GPU(s),
the memory the size of its quota with its own usage, only its own processes.

Two GPUs (gpusim's default config); the container is given GPU 1 only, with a 2048 MiB
quota. pynvml, raw ctypes calls (for the unversioned and v1 entry points and the
`*infoCount` protocol) and nvitop run inside the container; gpusim's status is the ground
truth, and pynvml outside the container shows what the real NVML reports.
"""

import json
import sys
import textwrap
import time

import pytest

from gpusim_harness import C_COMMON, LIB, ROOT

C = C_COMMON  # gpusim's cuda_workload.c
VENV_BIN = ROOT / ".venv" / "bin"
QUOTA_MIB = 2048
MiB = 1 << 20

# NVML return codes (nvml.h)
SUCCESS, UNINITIALIZED, INVALID_ARGUMENT, NO_PERMISSION, NOT_FOUND, INSUFFICIENT_SIZE = 0, 1, 2, 4, 6, 7

PRELUDE = textwrap.dedent(
    """
    import ctypes, json, sys
    import pynvml as N

    def out(x):
        print(json.dumps(x), flush=True)

    def err(f, *a):
        try:
            f(*a)
        except N.NVMLError as e:
            return e.value
        return 0

    def fn(name):
        return N._nvmlGetFunctionPointer(name)

    class V1(ctypes.Structure):  # nvmlProcessInfo_v1_t
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    V3 = N.c_nvmlProcessInfo_t  # nvmlProcessInfo_v2_t / nvmlProcessInfo_t

    def raw_procs(name, handle, cap, entry=V3, null=False):
        # One raw call: (return code, *infoCount after, [(pid, memory)] written).
        n = ctypes.c_uint(cap)
        arr = None if null else (entry * max(cap, 1))()
        rc = fn(name)(handle, ctypes.byref(n), arr)
        got = [] if arr is None or rc != 0 else [(arr[i].pid, arr[i].usedGpuMemory) for i in range(n.value)]
        return [rc, n.value, got]
    """
)

# Everything the container's NVML shows, as one JSON document. argv: GPU 0's uuid, bus id,
# serial; GPU 1's uuid.
INSIDE = PRELUDE + textwrap.dedent(
    """
    gpu0_uuid, gpu0_bus, gpu0_serial, gpu1_uuid = sys.argv[1:5]
    # before nvmlInit: the caller's NVML is not initialised, whatever libvcuda does
    N._LoadNvmlLibrary()
    c, hv = ctypes.c_uint(99), N.c_nvmlDevice_t()
    uninit = [fn("nvmlDeviceGetCount_v2")(ctypes.byref(c)), fn("nvmlDeviceGetHandleByIndex_v2")(0, ctypes.byref(hv))]
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    m1 = N.nvmlDeviceGetMemoryInfo(h)
    m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    r = {
        "uninit": uninit,
        "count": N.nvmlDeviceGetCount(),
        "uuid": N.nvmlDeviceGetUUID(h),
        "name": N.nvmlDeviceGetName(h),
        "bus_id": N.nvmlDeviceGetPciInfo(h).busId,
        "index": N.nvmlDeviceGetIndex(h),
        "mem_v1": [m1.total, m1.used, m1.free],
        "mem_v2": [m2.total, m2.reserved, m2.used, m2.free],
        "procs": [[p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses(h)],
        "procs_v2": [[p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses_v2(h)],
        "graphics": [p.pid for p in N.nvmlDeviceGetGraphicsRunningProcesses(h)],
        "mps": [p.pid for p in N.nvmlDeviceGetMPSComputeRunningProcesses(h)],
        "index_1": err(N.nvmlDeviceGetHandleByIndex, 1),
        "gpu0_by_uuid": err(N.nvmlDeviceGetHandleByUUID, gpu0_uuid),
        "gpu0_by_bus": err(N.nvmlDeviceGetHandleByPciBusId, gpu0_bus),
        "gpu0_by_serial": err(N.nvmlDeviceGetHandleBySerial, gpu0_serial),
        "gpu1_by_uuid_is_h": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(gpu1_uuid)),
    }
    # unversioned (v1) entry points, straight through ctypes
    c = ctypes.c_uint(99)
    r["count_v1"] = [fn("nvmlDeviceGetCount")(ctypes.byref(c)), c.value]
    hv = N.c_nvmlDevice_t()
    r["index_v1"] = [fn("nvmlDeviceGetHandleByIndex")(0, ctypes.byref(hv)), N.nvmlDeviceGetUUID(hv)]
    r["index_v1_1"] = fn("nvmlDeviceGetHandleByIndex")(1, ctypes.byref(hv))
    r["bus_v1_gpu0"] = fn("nvmlDeviceGetHandleByPciBusId")(gpu0_bus.encode(), ctypes.byref(hv))
    r["procs_v1"] = raw_procs("nvmlDeviceGetComputeRunningProcesses", h, 8, entry=V1)
    # the *infoCount protocol
    r["size_query"] = raw_procs("nvmlDeviceGetComputeRunningProcesses_v3", h, 0, null=True)
    r["null_infos"] = raw_procs("nvmlDeviceGetComputeRunningProcesses_v3", h, 4, null=True)
    r["exact"] = raw_procs("nvmlDeviceGetComputeRunningProcesses_v3", h, 1)
    r["mps_size_query"] = raw_procs("nvmlDeviceGetMPSComputeRunningProcesses", h, 0, entry=V1, null=True)
    r["graphics_v2_size_query"] = raw_procs("nvmlDeviceGetGraphicsRunningProcesses_v2", h, 0, null=True)
    out(r)
    """
)

# The machine as the real NVML shows it (run outside the container): per GPU uuid, bus id,
# serial and compute processes.
OUTSIDE = PRELUDE + textwrap.dedent(
    """
    N.nvmlInit()
    r = []
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        r.append({
            "uuid": N.nvmlDeviceGetUUID(h),
            "bus_id": N.nvmlDeviceGetPciInfo(h).busId,
            "serial": N.nvmlDeviceGetSerial(h),
            "procs": [[p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses(h)],
            "size_query": raw_procs("nvmlDeviceGetComputeRunningProcesses_v3", h, 0, null=True),
        })
    out(r)
    """
)


@pytest.fixture(scope="module")
def workload(cc, tmp_path_factory):
    out = tmp_path_factory.mktemp("bin")
    return cc(C / "cuda_workload.c", out / "cuda_workload", "-L", str(LIB), "-lcuda")


def machine(sim):
    p = sim.python(OUTSIDE)
    return json.loads(p.stdout.strip().splitlines()[-1])


def inside(container, gpus):
    args = [gpus[0]["uuid"], gpus[0]["bus_id"], gpus[0]["serial"], gpus[1]["uuid"]]
    p = container.python(INSIDE, *args)
    return json.loads(p.stdout.strip().splitlines()[-1]), p


def hold(runner, workload, mib, *extra):
    """Start a workload holding `mib` MiB and wait until it has (its "ready" line)."""
    p = runner.popen([workload, "--hold-mib", mib, "--count", "0", "--wait", *extra])
    line = p.stdout.readline()
    assert line.startswith("ready pid="), line + p.stderr.read()
    return p


def stop(*procs):
    for p in procs:
        p.kill()
        p.wait()


def gpu_procs(sim, gpu):
    return {p["pid"]: p["memory"] for p in sim.status()["gpus"][gpu]["processes"]}


@pytest.fixture
def setup(sim):
    gpus = machine(sim)
    container = sim.container([QUOTA_MIB], gpus=[gpus[1]["uuid"]])
    return sim, container, gpus


def test_nvml_shows_only_the_containers_gpu(setup):
    sim, container, gpus = setup
    r, p = inside(container, gpus)
    assert p.stderr == "", p.stderr
    assert r["uninit"] == [UNINITIALIZED, UNINITIALIZED]
    assert r["count"] == 1 and r["count_v1"] == [SUCCESS, 1]
    assert r["uuid"] == gpus[1]["uuid"] and r["bus_id"] == gpus[1]["bus_id"]
    assert r["name"] == sim.status()["gpus"][1]["name"]
    assert r["index"] == 0 and r["gpu1_by_uuid_is_h"] == 0
    assert r["index_v1"] == [SUCCESS, gpus[1]["uuid"]]
    # GPU 0 cannot be had in any way, and there is no index 1
    assert r["index_1"] == INVALID_ARGUMENT and r["index_v1_1"] == INVALID_ARGUMENT
    assert r["gpu0_by_uuid"] == NOT_FOUND
    assert r["gpu0_by_bus"] == NOT_FOUND and r["bus_v1_gpu0"] == NOT_FOUND
    assert r["gpu0_by_serial"] == NOT_FOUND
    # memory: the quota, and nothing used yet
    assert r["mem_v1"] == [QUOTA_MIB * MiB, 0, QUOTA_MIB * MiB]
    assert r["mem_v2"] == [QUOTA_MIB * MiB, 0, 0, QUOTA_MIB * MiB]
    # no processes: every list empty, and the size query succeeds with 0
    assert r["procs"] == [] and r["procs_v2"] == [] and r["graphics"] == [] and r["mps"] == []
    assert r["size_query"] == [SUCCESS, 0, []]
    assert r["mps_size_query"] == [SUCCESS, 0, []] and r["graphics_v2_size_query"] == [SUCCESS, 0, []]


REINIT = PRELUDE + textwrap.dedent(
    """
    # The handles libvcuda keeps between calls (issue 22) are the caller's NVML's only while
    # it stays initialised: after nvmlShutdown every lookup is UNINITIALIZED again, as
    # without libvcuda, and after a new nvmlInit the container's GPU is found again.
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    before = [N.nvmlDeviceGetMemoryInfo(h).total for _ in range(3)]
    N.nvmlShutdown()
    c, hv = ctypes.c_uint(99), N.c_nvmlDevice_t()
    after_shutdown = [fn("nvmlDeviceGetHandleByIndex_v2")(0, ctypes.byref(hv)),
                      fn("nvmlDeviceGetHandleByIndex")(0, ctypes.byref(hv)),
                      fn("nvmlDeviceGetCount_v2")(ctypes.byref(c))]
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    out({"before": before, "after_shutdown": after_shutdown,
         "again": [N.nvmlDeviceGetUUID(h), N.nvmlDeviceGetMemoryInfo(h).total, N.nvmlDeviceGetCount()]})
    """
)


def test_the_kept_handles_follow_the_callers_nvml_shutdown_and_init(setup):
    sim, container, gpus = setup
    p = container.python(REINIT)
    assert p.stderr == "", p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["before"] == [QUOTA_MIB * MiB] * 3
    assert r["after_shutdown"] == [UNINITIALIZED] * 3
    assert r["again"] == [gpus[1]["uuid"], QUOTA_MIB * MiB, 1]


PROC_UTIL = PRELUDE + textwrap.dedent(
    """
    # per-process utilization samples, both forms, and the accounting lists
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    r = {}
    try:
        r["v1"] = sorted({s.pid for s in N.nvmlDeviceGetProcessUtilization(h, 0)})
    except N.NVMLError as e:
        r["v1"] = e.value
    try:
        r["info"] = sorted({s.pid for s in N.nvmlDeviceGetProcessesUtilizationInfo(h, 0)})
    except N.NVMLError as e:
        r["info"] = e.value
    r["accounting"] = err(N.nvmlDeviceGetAccountingPids, h)
    out(r)
    """
)


def run_kernels(runner, workload, *extra):
    """A workload that runs 300 spin_1ms kernels and then waits: returns once they ran."""
    p = runner.popen([workload, "--kernel", "spin_1ms", "--count", "300", "--hold-mib", "16", "--wait", *extra])
    assert p.stdout.readline().startswith("ready pid="), p.stderr.read()
    for line in p.stdout:
        if line.startswith("kernels="):
            return p
    raise AssertionError(p.stderr.read())


def test_per_process_utilization_shows_only_the_containers_processes(setup, workload):
    # Without the filter a tenant read every other container's host pids, and how busy each
    # was, from nvmlDeviceGetProcessUtilization (issue 22, found on the way).
    sim, container, gpus = setup
    outsider = run_kernels(sim, workload, "--dev", "1")  # same GPU, not in the container
    try:
        r = json.loads(container.python(PROC_UTIL).stdout.strip().splitlines()[-1])
        assert r["v1"] == NOT_FOUND and r["info"] == NOT_FOUND, r  # none of its own ran
        assert r["accounting"] == 3, r  # gpusim: accounting off, NOT_SUPPORTED passes through
        real = json.loads(sim.python(PROC_UTIL.replace("ByIndex(0)", "ByIndex(1)")).stdout.strip().splitlines()[-1])
        assert real["v1"] == [outsider.pid] and real["info"] == [outsider.pid], real
        mine = run_kernels(container, workload)
        try:
            r = json.loads(container.python(PROC_UTIL).stdout.strip().splitlines()[-1])
            assert r["v1"] == [mine.pid] and r["info"] == [mine.pid], r
            real = json.loads(sim.python(PROC_UTIL.replace("ByIndex(0)", "ByIndex(1)")).stdout.strip().splitlines()[-1])
            assert real["v1"] == sorted([outsider.pid, mine.pid]), real
        finally:
            stop(mine)
    finally:
        stop(outsider)


def test_nvml_lists_and_counts_only_the_containers_processes(setup, workload):
    sim, container, gpus = setup
    outsider = hold(sim, workload, 256, "--dev", "1")  # same GPU, not in the container
    try:
        # Only an outsider on the GPU: the container sees no process (the real NVML sees one).
        r, _ = inside(container, gpus)
        assert r["procs"] == [] and r["size_query"] == [SUCCESS, 0, []], r
        assert r["mem_v1"][1] == 0, "the outsider's memory is not the container's"
        real = machine(sim)[1]
        assert [pid for pid, _ in real["procs"]] == [outsider.pid]
        assert real["size_query"] == [INSUFFICIENT_SIZE, 1, []]

        mine = hold(container, workload, 512)  # device 0 in the container is GPU 1
        try:
            truth = gpu_procs(sim, 1)
            assert set(truth) == {outsider.pid, mine.pid}
            held = truth[mine.pid]
            assert held == (512 + 300 + 1) * MiB, "allocation + context + module, by gpusim"
            # The container's usage reaches what the driver charges its process once the
            # library has measured the context and module (at once or at its next sweep).
            deadline = time.time() + 10
            while True:
                r, _ = inside(container, gpus)
                if r["mem_v1"][1] == held or time.time() > deadline:
                    break
                time.sleep(0.2)
            assert r["mem_v1"] == [QUOTA_MIB * MiB, held, QUOTA_MIB * MiB - held]
            assert r["mem_v2"] == [QUOTA_MIB * MiB, 0, held, QUOTA_MIB * MiB - held]
            # processes: the container's one, with the memory the driver reports for it
            assert r["procs"] == [[mine.pid, held]]
            assert r["procs_v2"] == [[mine.pid, held]]
            assert r["procs_v1"] == [SUCCESS, 1, [[mine.pid, held]]]
            assert r["size_query"] == [INSUFFICIENT_SIZE, 1, []]
            assert r["null_infos"][0] == INVALID_ARGUMENT, "NULL infos only for the size query"
            assert r["exact"] == [SUCCESS, 1, [[mine.pid, held]]]
            # outside, the real NVML lists both
            real = machine(sim)[1]
            assert sorted(real["procs"]) == sorted([[outsider.pid, truth[outsider.pid]], [mine.pid, held]])
            assert gpu_procs(sim, 1)[mine.pid] == held
        finally:
            stop(mine)
    finally:
        stop(outsider)


def test_nvitop_in_the_container_shows_one_gpu_of_the_quota(setup, workload):
    sim, container, gpus = setup
    container.env.update({"TERM": "xterm-256color", "COLUMNS": "120", "LINES": "50"})
    outsider = hold(sim, workload, 256, "--dev", "1")
    mine = hold(container, workload, 64)
    try:
        p = container.run([VENV_BIN / "nvitop", "-1", "--ascii"])
        out = p.stdout
        assert "FunctionNotFound" not in p.stderr and "ERROR" not in p.stderr, p.stderr
        assert gpus[1]["bus_id"] in out and gpus[0]["bus_id"] not in out, out
        gpu_rows = [line for line in out.splitlines() if "A100-SXM4-40GB" in line]
        assert len(gpu_rows) == 1, out
        # nvitop prints totals under 20 GiB in MiB: 2 GiB is "2048MiB"
        assert "/ 2048MiB" in out, out
        assert "40960MiB" not in out and "40.00GiB" not in out, out
        proc_rows = [line for line in out.splitlines() if "cuda_workload" in line]
        assert len(proc_rows) == 1 and str(mine.pid) in proc_rows[0], out
        assert str(outsider.pid) not in out, out
    finally:
        stop(mine, outsider)


def test_missing_config_refuses_nvml_with_one_line(setup):
    sim, container, gpus = setup
    container.env["VCUDA_CONFIG"] = str(container.dir / "does-not-exist.toml")
    code = PRELUDE + textwrap.dedent(
        """
        rc = err(N.nvmlInit)
        out({"rc": rc, "no_permission": rc == N.NVML_ERROR_NO_PERMISSION})
        try:
            N.nvmlInit()
        except N.NVMLError_NoPermission:
            pass
        """
    )
    p = container.python(code)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r == {"rc": NO_PERMISSION, "no_permission": True}
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vcuda: config"), p.stderr
    assert "does-not-exist.toml" in lines[0], p.stderr


def test_cuda_and_nvml_agree_in_the_container(setup):
    """The container's CUDA device 0 and NVML index 0 are the same GPU (UUID), and the
    totals both report are the quota."""
    sim, container, gpus = setup
    code = textwrap.dedent(
        """
        import json
        import pynvml as N
        from cuda.bindings import driver as cu
        def ok(r):
            err, *rest = r
            assert err == cu.CUresult.CUDA_SUCCESS, r
            return rest[0] if rest else None
        ok(cu.cuInit(0))
        dev = ok(cu.cuDeviceGet(0))
        u = ok(cu.cuDeviceGetUuid(dev)).bytes.hex()
        cuda_uuid = "GPU-%s-%s-%s-%s-%s" % (u[:8], u[8:12], u[12:16], u[16:20], u[20:])
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        print(json.dumps({
            "cuda_count": ok(cu.cuDeviceGetCount()),
            "cuda_uuid": cuda_uuid,
            "cuda_total": ok(cu.cuDeviceTotalMem(dev)),
            "nvml_uuid": N.nvmlDeviceGetUUID(h),
            "nvml_total": N.nvmlDeviceGetMemoryInfo(h).total,
        }))
        """
    )
    p = container.run([sys.executable, "-c", code])
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["cuda_count"] == 1
    assert r["cuda_uuid"] == r["nvml_uuid"] == gpus[1]["uuid"]
    assert r["cuda_total"] == r["nvml_total"] == QUOTA_MIB * MiB
