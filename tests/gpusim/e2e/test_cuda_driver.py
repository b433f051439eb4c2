"""gpusim's libcuda seen from C programs built against the official cuda.h (CUDA 12.9 wheel),
both linked directly (-lcuda) and reached the way cudart does (dlopen + cuGetProcAddress_v2)."""

import pathlib
import re

import pytest

from gpusim_harness import HERE, LIB

C = HERE / "c"

THREE_GPUS = """
context_overhead_mib = 100
[[gpu]]
name = "Sim GPU Small"
uuid = "GPU-00000000-0000-0000-0000-000000000001"
memory_mib = 2048
sm_count = 20
max_threads_per_sm = 1024
compute_capability = "7.5"
pci_bus_id = "0000:3b:00.0"
numa_node = 0
[[gpu]]
name = "Sim GPU Mid"
uuid = "GPU-00000000-0000-0000-0000-000000000002"
memory_mib = 8192
sm_count = 40
max_threads_per_sm = 2048
compute_capability = "8.6"
pci_bus_id = "0000:5e:00.0"
numa_node = 0
[[gpu]]
name = "Sim GPU Big"
uuid = "GPU-00000000-0000-0000-0000-000000000003"
memory_mib = 16384
sm_count = 132
max_threads_per_sm = 2048
compute_capability = "9.0"
pci_bus_id = "0000:af:00.0"
numa_node = 1
"""


def kv(text):
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.fixture(scope="module")
def programs(cc, tmp_path_factory):
    out = tmp_path_factory.mktemp("bin")
    link = ["-L", str(LIB), "-lcuda"]
    return {
        "basic": cc(C / "cuda_basic.c", out / "cuda_basic", *link),
        "workload": cc(C / "cuda_workload.c", out / "cuda_workload", *link),
        "procaddr": cc(C / "cuda_procaddr.c", out / "cuda_procaddr", "-ldl"),
    }


def test_c_program_against_official_header(sim, programs):
    r = kv(sim.run([programs["basic"]]).stdout)
    status = sim.status()
    assert r["done"] == "1"
    assert r["driver_version"] == "12090"
    assert int(r["device_count"]) == len(status["gpus"]) == 2
    for g in status["gpus"]:
        i = g["index"]
        assert r[f"dev{i}_name"] == g["name"]
        assert r[f"dev{i}_uuid"].lower() == g["uuid"].lower()
        assert int(r[f"dev{i}_total"]) == g["memory_total"]
        assert r[f"dev{i}_bus"] == g["pci_bus_id"]
        assert r[f"dev{i}_sms"] == "108" and r[f"dev{i}_cc"] == "8.0"
    # a context costs the configured 300 MiB; a 64 MiB allocation costs 64 MiB
    assert int(r["after_ctx_total"]) - int(r["after_ctx_free"]) == 300 << 20
    assert int(r["alloc_64mib_delta"]) == 64 << 20
    assert r["roundtrip_ok"] == "1" and r["memset_ok"] == "1"
    assert r["pitch"] == "1024"
    # 1024 × 1024 × 4 channels × 16 bits = 8 MiB (bits are not bytes)
    assert int(r["array_bytes"]) == 8 << 20
    # VMM memory is freed when released *and* unmapped
    assert int(r["vmm_freed_on_unmap"]) == 8 << 20
    assert r["global_size"] == "256"
    # kernels of known duration, timed by events on the device timeline. A start event lands
    # on an idle device at record time, so a host stall before the first launch adds to the
    # elapsed time (as on a real GPU) but nothing can take time away: one-sided tolerance.
    def timed(key, ms):
        assert ms <= float(r[key]) < ms + 2.0, (key, r[key])

    timed("ten_1ms_kernels_ms", 10.0)
    timed("graph_15ms_ms", 15.0)
    # the stream-ordered pool grows by 8 MiB and gives it back at the sync
    assert int(r["pool_reserved"]) == 8 << 20 and int(r["pool_used"]) == 8 << 20
    assert r["pool_reserved_after_sync"] == "0"
    # a built graph: two 1 ms kernel nodes; its 3 MiB allocation node reserves 4 MiB of the
    # graph pool at launch, which stays reserved after the free until trimmed
    timed("built_graph_ms", 2.0)
    assert int(r["graph_mem_reserved"]) == 4 << 20 and int(r["graph_mem_used"]) == 3 << 20
    assert r["graph_mem_used_after_free"] == "0" and r["graph_mem_reserved_after_trim"] == "0"
    timed("event_after_1500_launches_ms", 1.0)
    # 256² + 128² + … + 1² floats = 349524 B, each level rounded to 512 B, total to 64 KiB
    assert int(r["mipmap_bytes"]) == 393216
    assert r["oom_string"] == "out of memory"
    # everything was freed and the process is gone
    assert all(g["memory_used"] == 0 and g["processes"] == [] for g in status["gpus"])


def test_config_describes_the_gpus(sim, programs):
    sim.write_config(THREE_GPUS)
    r = kv(sim.run([programs["basic"]]).stdout)
    assert r["device_count"] == "3"
    assert r["dev0_name"] == "Sim GPU Small" and int(r["dev0_total"]) == 2048 << 20
    assert r["dev1_cc"] == "8.6" and r["dev1_sms"] == "40"
    assert r["dev2_name"] == "Sim GPU Big" and r["dev2_bus"] == "00000000:AF:00.0"
    assert r["dev2_uuid"] == "GPU-00000000-0000-0000-0000-000000000003"
    assert int(r["after_ctx_total"]) - int(r["after_ctx_free"]) == 100 << 20


def test_get_proc_address_gives_the_drivers_variant(sim, programs):
    """Pins reference §2: version and per-thread flag select one exported variant."""
    p = sim.run([programs["procaddr"]])
    assert "FAIL" not in p.stdout, p.stdout
    assert "workload_ok=1" in p.stdout


def test_out_of_memory_when_the_device_is_full(sim, programs):
    sim.write_config(THREE_GPUS)
    # GPU 0 has 2048 MiB; a context takes 100 MiB, so 2000 MiB cannot fit.
    p = sim.run([programs["workload"], "--dev", "0", "--hold-mib", "2000", "--count", "0"], check=False)
    assert p.returncode == 1
    assert "CUDA_ERROR_OUT_OF_MEMORY" in p.stderr
    p = sim.run([programs["workload"], "--dev", "0", "--hold-mib", "2000", "--count", "0"], check=False)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in p.stderr, "the failed process released its context"
    p = sim.run([programs["workload"], "--dev", "0", "--hold-mib", "1940", "--count", "0"])
    assert "ready" in p.stdout


def test_malformed_config_fails_init_with_one_line(sim, programs):
    text = THREE_GPUS.replace("memory_mib = 8192", 'memory_mib = "lots"')
    line = text.splitlines().index('memory_mib = "lots"') + 1
    cfg = sim.write_config(text)
    p = sim.run([programs["basic"]], check=False)
    assert p.returncode == 1
    lines = [l for l in p.stderr.splitlines() if l.startswith("gpusim:")]
    assert len(lines) == 1, p.stderr
    assert re.match(rf"gpusim: config {re.escape(str(cfg))}: line {line}: ", lines[0]), lines[0]
    assert "cuInit(0) failed: CUDA_ERROR_SYSTEM_NOT_READY" in p.stderr


def test_corrupt_state_file_is_reported(sim, programs):
    sim.state.write_bytes(b"\xff" * (1 << 20))
    p = sim.run([programs["basic"]], check=False)
    assert p.returncode == 1
    assert f"gpusim: state file {sim.state} is corrupt" in p.stderr
    assert "CUDA_ERROR_SYSTEM_NOT_READY" in p.stderr
    p = sim.gpusim("status", check=False)
    assert p.returncode != 0 and "is corrupt" in p.stderr


def test_many_processes_create_the_state_at_once(sim, programs):
    """Pins GPUSIM_STATE: processes racing to create one state file all see the same GPUs."""
    assert not sim.state.exists()
    procs = [
        sim.popen([programs["workload"], "--dev", str(i % 2), "--hold-mib", "10", "--count", "0", "--wait"])
        for i in range(24)
    ]
    for p in procs:
        assert p.stdout.readline().startswith("ready"), p.stderr.read()
    st = sim.status()
    pids = {x["pid"] for g in st["gpus"] for x in g["processes"]}
    assert pids == {p.pid for p in procs}
    for g in st["gpus"]:
        assert g["memory_used"] == 12 * ((10 + 300 + 1) << 20)
    for p in procs:
        p.kill()
        p.wait()
    assert sum(g["memory_used"] for g in sim.status()["gpus"]) == 0
