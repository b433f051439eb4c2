"""gpusim's libnvidia-ml.so.1 through pynvml (nvidia-ml-py, NVIDIA's own binding).

Each test runs pynvml in a child process (the `sim` fixture's environment points it at
target/gpusim/lib and an isolated state file) and compares what NVML reports with the config
and with `gpusim status --json`, the ground truth. Processes holding memory come from the
simulated libcuda and are tested with it; here every GPU is idle.
"""

import json
import textwrap

# Prelude for child processes: pynvml and a helper printing one JSON document.
PRELUDE = textwrap.dedent(
    """
    import json, sys
    import pynvml as N

    def out(x):
        print(json.dumps(x))

    def err(f, *a):
        try:
            f(*a)
        except N.NVMLError as e:
            return e.value
        return 0
    """
)


def run_py(sim, code, **kw):
    p = sim.python(PRELUDE + textwrap.dedent(code), **kw)
    return json.loads(p.stdout.strip().splitlines()[-1])


THREE_GPUS = """
driver_version = "550.54.15"
cuda_version = 12040

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
uuid = "GPU-11111111-2222-3333-4444-000000000000"
memory_mib = 81559
reserved_mib = 512
sm_count = 132
max_threads_per_sm = 2048
compute_capability = "9.0"
pci_bus_id = "00000000:18:00.0"
power_limit_w = 700
numa_node = 0

[[gpu]]
name = "NVIDIA A100-PCIE-40GB"
uuid = "GPU-11111111-2222-3333-4444-000000000001"
memory_mib = 40960
sm_count = 108
max_threads_per_sm = 2048
compute_capability = "8.0"
pci_bus_id = "00000000:3B:00.0"
numa_node = 0

[[gpu]]
name = "Tesla T4"
uuid = "GPU-11111111-2222-3333-4444-000000000002"
memory_mib = 15360
sm_count = 40
max_threads_per_sm = 1024
compute_capability = "7.5"
pci_bus_id = "0000:AF:00.0"
numa_node = 1

[[link]]
gpus = [0, 1]
nvlinks = 4
pcie = "host-bridge"

[[link]]
gpus = [2, 0]
nvlinks = 2
pcie = "system"
"""

DEVICES = """
N.nvmlInit()
devs = []
for i in range(N.nvmlDeviceGetCount()):
    h = N.nvmlDeviceGetHandleByIndex(i)
    pci = N.nvmlDeviceGetPciInfo(h)
    m1 = N.nvmlDeviceGetMemoryInfo(h)
    m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    devs.append(dict(
        index=N.nvmlDeviceGetIndex(h),
        minor=N.nvmlDeviceGetMinorNumber(h),
        name=N.nvmlDeviceGetName(h),
        uuid=N.nvmlDeviceGetUUID(h),
        bus_id=pci.busId, bus_id_legacy=pci.busIdLegacy,
        domain=pci.domain, bus=pci.bus, device=pci.device,
        pci_device_id=pci.pciDeviceId,
        v1=[m1.total, m1.free, m1.used],
        v2=[m2.version, m2.total, m2.reserved, m2.free, m2.used],
        cc=list(N.nvmlDeviceGetCudaComputeCapability(h)),
        arch=N.nvmlDeviceGetArchitecture(h),
        cores=N.nvmlDeviceGetNumGpuCores(h),
        power_limit=N.nvmlDeviceGetPowerManagementLimit(h),
    ))
out(devs)
"""


def test_nvml_default_devices_match_status(sim):
    devs = run_py(sim, DEVICES)
    status = sim.status()["gpus"]
    assert len(devs) == len(status) == 2
    for d, s in zip(devs, status):
        assert d["index"] == d["minor"] == s["index"]
        assert d["name"] == s["name"] == "NVIDIA A100-SXM4-40GB"
        assert d["uuid"] == s["uuid"]
        assert d["bus_id"] == s["pci_bus_id"]
        assert d["bus_id_legacy"] == s["pci_bus_id"][4:]
        assert d["pci_device_id"] == 0x20B010DE
        total = 40960 << 20
        assert d["v1"] == [total, total, 0]
        assert d["v2"] == [0x02000028, total, 0, total, 0]
        assert d["cc"] == [8, 0] and d["arch"] == 7  # NVML_DEVICE_ARCH_AMPERE
        assert d["cores"] == 108 * 64
        assert d["power_limit"] == 400_000
    assert (devs[0]["domain"], devs[0]["bus"], devs[0]["device"]) == (0, 0x07, 0)
    assert (devs[1]["domain"], devs[1]["bus"], devs[1]["device"]) == (0, 0x0F, 0)


def test_nvml_custom_config_is_reflected(sim):
    sim.write_config(THREE_GPUS)
    devs = run_py(sim, DEVICES)
    status = sim.status()["gpus"]
    assert [d["name"] for d in devs] == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-PCIE-40GB", "Tesla T4"]
    assert [d["uuid"] for d in devs] == [s["uuid"] for s in status]
    assert [d["bus_id"] for d in devs] == ["00000000:18:00.0", "00000000:3B:00.0", "00000000:AF:00.0"]
    assert [d["v1"][0] for d in devs] == [81559 << 20, 40960 << 20, 15360 << 20]
    assert [d["v1"][0] for d in devs] == [s["memory_total"] for s in status]
    # v1 counts the driver's reserve as used; v2 reports it apart
    h100_total, reserved = 81559 << 20, 512 << 20
    assert devs[0]["v1"] == [h100_total, h100_total - reserved, reserved]
    assert devs[0]["v2"] == [0x02000028, h100_total, reserved, h100_total - reserved, 0]
    assert [d["arch"] for d in devs] == [9, 7, 6]  # Hopper, Ampere, Turing
    assert [d["cc"] for d in devs] == [[9, 0], [8, 0], [7, 5]]
    assert devs[0]["power_limit"] == 700_000


def test_nvml_versions(sim):
    sim.write_config(THREE_GPUS)
    v = run_py(
        sim,
        """
        N.nvmlInit()
        out([N.nvmlSystemGetDriverVersion(), N.nvmlSystemGetNVMLVersion(),
             N.nvmlSystemGetCudaDriverVersion(), N.nvmlSystemGetCudaDriverVersion_v2()])
        """,
    )
    assert v == ["550.54.15", "12.550.54.15", 12040, 12040]


def test_nvml_default_versions(sim):
    v = run_py(
        sim,
        """
        N.nvmlInit()
        out([N.nvmlSystemGetDriverVersion(), N.nvmlSystemGetNVMLVersion(), N.nvmlSystemGetCudaDriverVersion()])
        """,
    )
    assert v == ["575.57.08", "12.575.57.08", 12090]


def test_nvml_lookup_by_uuid_and_bus_id(sim):
    sim.write_config(THREE_GPUS)
    r = run_py(
        sim,
        """
        N.nvmlInit()
        idx = N.nvmlDeviceGetIndex
        out(dict(
            uuid=idx(N.nvmlDeviceGetHandleByUUID("GPU-11111111-2222-3333-4444-000000000002")),
            uuid1=idx(N.nvmlDeviceGetHandleByUUID("GPU-11111111-2222-3333-4444-000000000001")),
            bus_long=idx(N.nvmlDeviceGetHandleByPciBusId("00000000:3B:00.0")),
            bus_short=idx(N.nvmlDeviceGetHandleByPciBusId("0000:af:00.0")),
            bus_no_domain=idx(N.nvmlDeviceGetHandleByPciBusId("18:00.0")),
            bus_no_function=idx(N.nvmlDeviceGetHandleByPciBusId("0000:3b:00")),
            uuid_unknown=err(N.nvmlDeviceGetHandleByUUID, "GPU-99999999-2222-3333-4444-000000000002"),
            uuid_garbage=err(N.nvmlDeviceGetHandleByUUID, "not-a-uuid"),
            bus_unknown=err(N.nvmlDeviceGetHandleByPciBusId, "0000:99:00.0"),
            bus_garbage=err(N.nvmlDeviceGetHandleByPciBusId, "zz"),
            index_past_end=err(N.nvmlDeviceGetHandleByIndex, 3),
        ))
        """,
    )
    assert r == dict(
        uuid=2,
        uuid1=1,
        bus_long=1,
        bus_short=2,
        bus_no_domain=0,
        bus_no_function=1,
        uuid_unknown=6,  # NVML_ERROR_NOT_FOUND
        uuid_garbage=2,  # NVML_ERROR_INVALID_ARGUMENT
        bus_unknown=6,
        bus_garbage=2,
        index_past_end=2,
    )


def test_nvml_topology_p2p_and_nvlink(sim):
    sim.write_config(THREE_GPUS)
    r = run_py(
        sim,
        """
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
        idx = N.nvmlDeviceGetIndex
        # NVML_P2P_CAPS_INDEX_*: pynvml 12.575.51 defines READ as a tuple (a stray comma)
        READ, NVLINK, ATOMICS = 0, 2, 3
        def p2p(a, b, cap):
            return N.nvmlDeviceGetP2PStatus(h[a], h[b], cap)
        def links(i):
            return [N.nvmlDeviceGetNvLinkState(h[i], l) for l in range(N.NVML_NVLINK_MAX_LINKS)]
        def remote(i):
            return [N.nvmlDeviceGetNvLinkRemotePciInfo(h[i], l).busId
                    for l in range(N.NVML_NVLINK_MAX_LINKS) if N.nvmlDeviceGetNvLinkState(h[i], l)]
        out(dict(
            ancestor=[[N.nvmlDeviceGetTopologyCommonAncestor(h[a], h[b]) for b in range(3)] for a in range(3)],
            nearest_hostbridge=[idx(d) for d in N.nvmlDeviceGetTopologyNearestGpus(h[0], N.NVML_TOPOLOGY_HOSTBRIDGE)],
            nearest_system=sorted(idx(d) for d in N.nvmlDeviceGetTopologyNearestGpus(h[0], N.NVML_TOPOLOGY_SYSTEM)),
            nearest_single=[idx(d) for d in N.nvmlDeviceGetTopologyNearestGpus(h[0], N.NVML_TOPOLOGY_SINGLE)],
            nvlink=[p2p(0, 1, NVLINK), p2p(0, 2, NVLINK),
                    p2p(1, 2, NVLINK)],
            read=[p2p(0, 1, READ), p2p(0, 2, READ),
                  p2p(1, 2, READ)],
            atomics_1_2=p2p(1, 2, ATOMICS),
            links=[sum(links(i)) for i in range(3)],
            link_past_max=err(N.nvmlDeviceGetNvLinkState, h[0], N.NVML_NVLINK_MAX_LINKS),
            remote0=remote(0),
            remote2=remote(2),
            version=N.nvmlDeviceGetNvLinkVersion(h[0], 0),
            cap_p2p=N.nvmlDeviceGetNvLinkCapability(h[0], 0, N.NVML_NVLINK_CAP_P2P_SUPPORTED),
            cap_inactive=N.nvmlDeviceGetNvLinkCapability(h[1], 5, N.NVML_NVLINK_CAP_P2P_SUPPORTED),
            link_count=[N.nvmlDeviceGetFieldValues(h[i], [N.NVML_FI_DEV_NVLINK_LINK_COUNT])[0].value.uiVal
                        for i in range(3)],
            numa=[N.nvmlDeviceGetNumaNodeId(h[i]) for i in range(3)],
        ))
        """,
    )
    SINGLE, HOSTBRIDGE, NODE, SYSTEM = 10, 30, 40, 50
    assert r["ancestor"] == [[0, HOSTBRIDGE, SYSTEM], [HOSTBRIDGE, 0, SYSTEM], [SYSTEM, SYSTEM, 0]]
    assert r["nearest_hostbridge"] == [1]
    assert r["nearest_system"] == [1, 2]
    assert r["nearest_single"] == []
    OK, CHIPSET_NOT_SUPPORTED, NOT_SUPPORTED = 0, 1, 5
    assert r["nvlink"] == [OK, OK, NOT_SUPPORTED]
    assert r["read"] == [OK, OK, CHIPSET_NOT_SUPPORTED]
    assert r["atomics_1_2"] == CHIPSET_NOT_SUPPORTED
    assert r["links"] == [6, 4, 2]
    assert r["link_past_max"] == 2
    # GPU 0's lanes: 4 to GPU 1 (first [[link]]), then 2 to GPU 2
    assert r["remote0"] == ["00000000:3B:00.0"] * 4 + ["00000000:AF:00.0"] * 2
    assert r["remote2"] == ["00000000:18:00.0"] * 2
    assert r["version"] == 6  # NVML_NVLINK_VERSION_4_0 (Hopper)
    assert (r["cap_p2p"], r["cap_inactive"]) == (1, 0)
    assert r["link_count"] == [6, 4, 2]
    assert r["numa"] == [0, 0, 1]


def test_nvml_idle_figures(sim):
    p = sim.python(
        PRELUDE
        + textwrap.dedent(
            """
            N.nvmlInit()
            h = N.nvmlDeviceGetHandleByIndex(1)
            u = N.nvmlDeviceGetUtilizationRates(h)
            out(dict(
                util=[u.gpu, u.memory],
                compute=[len(N.nvmlDeviceGetComputeRunningProcesses(h)),
                         len(N.nvmlDeviceGetComputeRunningProcesses_v2(h)),
                         len(N.nvmlDeviceGetComputeRunningProcesses_v3(h))],
                graphics=len(N.nvmlDeviceGetGraphicsRunningProcesses(h)),
                mps=len(N.nvmlDeviceGetMPSComputeRunningProcesses(h)),
                proc_util=err(N.nvmlDeviceGetProcessUtilization, h, 0),
                samples_type=N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, 0)[0],
                samples=sorted({s.sampleValue.uiVal
                                for s in N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, 0)[1]}),
                power_samples=err(N.nvmlDeviceGetSamples, h, N.NVML_TOTAL_POWER_SAMPLES, 0),
                enc=list(N.nvmlDeviceGetEncoderUtilization(h)),
                temp=N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU),
                temp_v=N.nvmlDeviceGetTemperatureV(h, N.NVML_TEMPERATURE_GPU),
                thresholds=[N.nvmlDeviceGetTemperatureThreshold(h, t) for t in (0, 1, 3)],
                power=N.nvmlDeviceGetPowerUsage(h),
                pstate=N.nvmlDeviceGetPerformanceState(h),
                sm_clock=N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM),
                max_sm_clock=N.nvmlDeviceGetMaxClockInfo(h, N.NVML_CLOCK_SM),
                mem_clock=N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_MEM),
                fan=err(N.nvmlDeviceGetFanSpeed, h),
                mig=err(N.nvmlDeviceGetMigMode, h),
                compute_mode=N.nvmlDeviceGetComputeMode(h),
                persistence=N.nvmlDeviceGetPersistenceMode(h),
                ecc=list(N.nvmlDeviceGetEccMode(h)),
                ecc_errors=N.nvmlDeviceGetTotalEccErrors(h, 1, 0),
                pcie=[N.nvmlDeviceGetCurrPcieLinkGeneration(h), N.nvmlDeviceGetCurrPcieLinkWidth(h)],
            ))
            """
        )
    )
    r = json.loads(p.stdout)
    assert r["util"] == [0, 0]
    assert r["compute"] == [0, 0, 0]
    assert r["graphics"] == r["mps"] == 0
    assert r["proc_util"] == 6  # NVML_ERROR_NOT_FOUND: no process ran in any sample period
    assert r["samples_type"] == 1  # NVML_VALUE_TYPE_UNSIGNED_INT
    assert r["samples"] == [0]
    assert r["power_samples"] == 3  # NVML_ERROR_NOT_SUPPORTED
    assert r["enc"] == [0, 166667]
    assert r["temp"] == r["temp_v"] == 33
    assert r["thresholds"] == [92, 89, 87]
    assert r["power"] == 55_000
    assert r["pstate"] == 8
    assert (r["sm_clock"], r["max_sm_clock"], r["mem_clock"]) == (210, 1410, 1215)
    assert r["fan"] == 3 and r["mig"] == 0  # MIG-capable, disabled (test_nvml_every_function.py)
    assert r["compute_mode"] == 0 and r["persistence"] == 1
    assert r["ecc"] == [1, 1] and r["ecc_errors"] == 0
    assert r["pcie"] == [4, 16]


def test_nvml_energy_grows(sim):
    r = run_py(
        sim,
        """
        import time
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        e1 = N.nvmlDeviceGetTotalEnergyConsumption(h)
        time.sleep(0.1)
        out(N.nvmlDeviceGetTotalEnergyConsumption(h) - e1)
        """,
    )
    # 55 W idle for 0.1 s is 5.5 J; allow for scheduling delays upward only
    assert 5000 <= r < 60000


def test_nvml_init_is_reference_counted(sim):
    r = run_py(
        sim,
        """
        before = err(N.nvmlDeviceGetCount)
        N.nvmlInit()
        N.nvmlInit()
        N.nvmlShutdown()
        still = N.nvmlDeviceGetCount()
        N.nvmlShutdown()
        after = err(N.nvmlDeviceGetCount)
        extra = err(N.nvmlShutdown)
        N.nvmlInit()
        again = N.nvmlDeviceGetCount()
        out([before, still, after, extra, again])
        """,
    )
    UNINITIALIZED = 1
    assert r == [UNINITIALIZED, 2, UNINITIALIZED, UNINITIALIZED, 2]


def test_nvml_argument_errors(sim):
    r = run_py(
        sim,
        """
        import ctypes
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        lib = N.nvmlLib
        name = ctypes.create_string_buffer(96)
        short = ctypes.create_string_buffer(8)
        m2 = N.c_nvmlMemory_v2_t()
        m2.version = 0x01000028
        count = ctypes.c_uint(0)
        out(dict(
            bogus_handle=lib.nvmlDeviceGetName(ctypes.c_void_p(0x1000), name, 96),
            null_handle=lib.nvmlDeviceGetName(None, name, 96),
            short_name=lib.nvmlDeviceGetName(h, short, 8),
            null_name=lib.nvmlDeviceGetName(h, None, 96),
            exact_name=lib.nvmlDeviceGetName(h, name, len("NVIDIA A100-SXM4-40GB") + 1),
            mem_v2_wrong_version=lib.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(m2)),
            null_memory=lib.nvmlDeviceGetMemoryInfo(h, None),
            null_count=lib.nvmlDeviceGetCount_v2(None),
            procs_null_count=lib.nvmlDeviceGetComputeRunningProcesses_v3(h, None, None),
            procs_size_query=lib.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(count), None),
            driver_short=lib.nvmlSystemGetDriverVersion(short, 8),
            error_strings=[N.nvmlErrorString(c) for c in list(range(30)) + [999]],
        ))
        """,
    )
    assert r["bogus_handle"] == r["null_handle"] == 2  # NVML_ERROR_INVALID_ARGUMENT
    assert r["short_name"] == 7  # NVML_ERROR_INSUFFICIENT_SIZE
    assert r["null_name"] == 2
    assert r["exact_name"] == 0
    assert r["mem_v2_wrong_version"] == 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert r["null_memory"] == r["null_count"] == r["procs_null_count"] == 2
    assert r["procs_size_query"] == 0  # nothing running: success with count 0
    assert r["driver_short"] == 7
    strings = r["error_strings"]
    assert strings[0] == "Success" and strings[-1] == "Unknown Error"
    assert len(set(strings)) == len(strings), "every code has its own text"


def test_nvml_process_name(sim):
    r = run_py(
        sim,
        """
        import os
        N.nvmlInit()
        out([N.nvmlSystemGetProcessName(os.getpid()), err(N.nvmlSystemGetProcessName, 0x7ffffff0)])
        """,
    )
    assert "python" in r[0]
    assert r[1] == 6  # NVML_ERROR_NOT_FOUND


def test_nvml_malformed_config_fails_init_with_one_line(sim):
    cfg = sim.write_config("context_overhead_mib = 300\n\n[[gpu]]\nname = \"x\"\nuuid = \n")
    p = sim.python(
        PRELUDE
        + textwrap.dedent(
            """
            codes = []
            for _ in range(3):
                try:
                    N.nvmlInit()
                    codes.append(0)
                except N.NVMLError_DriverNotLoaded as e:
                    codes.append(e.value)
            out(codes)
            """
        )
    )
    assert json.loads(p.stdout) == [9, 9, 9]  # NVML_ERROR_DRIVER_NOT_LOADED every time
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"gpusim: config {cfg}: line 5:"), lines[0]
