"""The shared device timeline, memory across processes and process death, judged by
gpusim's ground truth (`gpusim status --json`) and by what NVML reports."""

import signal
import time

import pytest

from gpusim_harness import HERE, LIB

C = HERE / "c"

ONE_GPU = """
[[gpu]]
name = "Sim GPU"
uuid = "GPU-11111111-2222-3333-4444-555555555555"
memory_mib = 16384
sm_count = 80
max_threads_per_sm = 2048
compute_capability = "8.6"
pci_bus_id = "00000000:01:00.0"
"""


@pytest.fixture(scope="module")
def bins(cc, tmp_path_factory):
    out = tmp_path_factory.mktemp("bin")
    link = ["-L", str(LIB), "-lcuda"]
    return {
        "workload": cc(C / "cuda_workload.c", out / "cuda_workload", *link),
        "fork": cc(C / "cuda_fork.c", out / "cuda_fork", *link),
    }


def start(sim, bins, *args):
    """Start a workload and wait for its "ready" line (its memory is held by then)."""
    p = sim.popen([bins["workload"], *args])
    line = p.stdout.readline()
    assert line.startswith("ready pid="), line + p.stderr.read()
    return p


def results(p):
    """Read the workload's closing key=value lines (it stays alive if run with --wait)."""
    out = {}
    while "elapsed" not in out:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        k, v = line.strip().split("=", 1)
        out[k] = v
    return out


def proc(status, pid, gpu=0):
    return next((p for p in status["gpus"][gpu]["processes"] if p["pid"] == pid), None)


NVML_UTIL = """
import json, sys, time
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
samples = []
last = None
deadline = time.time() + float(sys.argv[1])
while time.time() < deadline:
    u = n.nvmlDeviceGetUtilizationRates(h).gpu
    samples.append(u)
    time.sleep(1 / 6)
procs = n.nvmlDeviceGetProcessUtilization(h, int((time.time() - 1) * 1e6))
print(json.dumps({"samples": samples, "procs": [[p.pid, p.smUtil] for p in procs]}))
"""


def test_nvml_utilization_matches_the_timeline(sim, bins):
    """A 2 ms kernel every ~5 ms: NVML's sampled utilization equals the ground truth
    busy fraction over the same window within 2 percentage points."""
    import json

    sim.write_config(ONE_GPU)
    w = start(sim, bins, "--kernel", "spin_2ms", "--gap-us", "3000", "--seconds", "4")
    time.sleep(0.5)  # let a full sample period pass with the workload running
    a = sim.status()
    nv = json.loads(sim.python(NVML_UTIL, "2.5").stdout)
    b = sim.status()
    truth = 100 * (b["gpus"][0]["busy_ns"] - a["gpus"][0]["busy_ns"]) / (b["time_ns"] - a["time_ns"])
    mean = sum(nv["samples"]) / len(nv["samples"])
    assert 25 < truth < 45, f"the workload ran a ~40% duty cycle, truth {truth:.1f}%"
    assert abs(mean - truth) <= 2, f"NVML mean {mean:.1f}% vs ground truth {truth:.1f}%: {nv['samples']}"
    assert all(0 <= s <= 100 for s in nv["samples"])
    # per-process samples name the workload's (host) pid with about the same share
    mine = [u for pid, u in nv["procs"] if pid == w.pid]
    assert mine and all(abs(u - truth) <= 8 for u in mine), (nv["procs"], truth)
    results(w)
    w.wait()


def test_two_processes_share_one_timeline(sim, bins):
    """Two processes each launching 1 s of kernels back to back on one GPU: one kernel at
    a time, so both take about 2 s, each is charged exactly its 1 s, and the GPU is never
    more than 100% busy."""
    sim.write_config(ONE_GPU)
    a = start(sim, bins, "--kernel", "spin_1ms", "--count", "1000", "--wait")
    b = start(sim, bins, "--kernel", "spin_1ms", "--count", "1000", "--wait")
    ra, rb = results(a), results(b)
    st = sim.status()
    pa, pb = proc(st, a.pid), proc(st, b.pid)
    assert pa["busy_ns"] == pb["busy_ns"] == 1_000_000_000
    assert pa["kernels"] == pb["kernels"] == 1000
    assert st["gpus"][0]["busy_ns"] == 2_000_000_000
    for r in (ra, rb):
        assert 1.7 < float(r["elapsed"]) < 2.6, r
    a.kill()
    b.kill()
    a.wait()
    b.wait()


def test_launch_returns_at_once_until_the_queue_is_full(sim, bins):
    sim.write_config(ONE_GPU)
    r = results(start(sim, bins, "--kernel", "spin_20ms", "--count", "50"))
    assert float(r["launched_in"]) < 0.3, r  # 1 s of work queued without waiting
    assert float(r["elapsed"]) >= 1.0
    sim2_cfg = "launch_queue_depth = 5\n" + ONE_GPU
    sim.state.unlink()
    sim.write_config(sim2_cfg)
    r = results(start(sim, bins, "--kernel", "spin_20ms", "--count", "50"))
    # only 5 may be pending, so launching waits for the 45 before the last five
    assert float(r["launched_in"]) >= 0.85, r


def test_memory_is_accounted_across_processes(sim, bins):
    sim.write_config(ONE_GPU)
    a = start(sim, bins, "--hold-mib", "1000", "--count", "0", "--wait")
    b = start(sim, bins, "--hold-mib", "500", "--count", "0", "--wait")
    st = sim.status()
    ctx = 300 + 1  # context overhead + one module
    assert proc(st, a.pid)["memory"] == (1000 + ctx) << 20
    assert proc(st, b.pid)["memory"] == (500 + ctx) << 20
    assert st["gpus"][0]["memory_used"] == (1500 + 2 * ctx) << 20
    seen = sim.python(
        "from cuda.bindings import driver as cu\n"
        "cu.cuInit(0); _, c = cu.cuCtxCreate(0, 0)\n"
        "_, free, total = cu.cuMemGetInfo(); print(total - free)\n"
    ).stdout
    assert int(seen) == (1500 + 3 * 300 + 2) << 20, "a third process sees the others' memory and its own context"
    nv = sim.python(
        "import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)\n"
        "print(n.nvmlDeviceGetMemoryInfo(h).used)\n"
        "print(sorted((p.pid, p.usedGpuMemory) for p in n.nvmlDeviceGetComputeRunningProcesses(h)))\n"
    ).stdout.splitlines()
    assert int(nv[0]) == (1500 + 2 * ctx) << 20
    assert nv[1] == str(sorted([(a.pid, (1000 + ctx) << 20), (b.pid, (500 + ctx) << 20)]))
    for p in (a, b):
        p.kill()
        p.wait()


def test_kill_9_releases_everything(sim, bins):
    sim.write_config(ONE_GPU)
    w = start(sim, bins, "--hold-mib", "4096", "--kernel", "spin_20ms", "--count", "200", "--wait")
    assert proc(sim.status(), w.pid)["memory"] >= 4096 << 20
    w.send_signal(signal.SIGKILL)
    w.wait()
    st = sim.status()
    assert st["gpus"][0]["memory_used"] == 0
    assert st["gpus"][0]["processes"] == []
    # its queued kernels were discarded with it: the GPU goes idle
    busy = st["gpus"][0]["busy_ns"]
    time.sleep(0.1)
    assert sim.status()["gpus"][0]["busy_ns"] == busy


def test_exit_without_freeing_releases_memory(sim, bins):
    sim.write_config(ONE_GPU)
    sim.run([bins["workload"], "--hold-mib", "512", "--count", "0"])
    st = sim.status()
    assert st["gpus"][0]["memory_used"] == 0 and st["gpus"][0]["processes"] == []


def test_fork_child_cannot_use_the_parents_driver(sim, bins):
    out = dict(l.split("=") for l in sim.run([bins["fork"]]).stdout.split())
    assert out["early_child_count"] == "2"  # forked before cuInit: its own driver
    assert out["parent_count"] == "2"
    assert out["late_child_init"] == "3" and out["late_child_count"] == "-3"  # NOT_INITIALIZED
    assert out["parent_after_count"] == "2"


ALLOC_AND_FREE = """
from cuda.bindings import driver as cu
OK = cu.CUresult.CUDA_SUCCESS
assert cu.cuInit(0)[0] == OK
err, ctx = cu.cuCtxCreate(0, 0)
assert err == OK
err, p = cu.cuMemAlloc(1 << 30)
assert err == OK
assert cu.cuMemFree(p)[0] == OK
assert cu.cuCtxDestroy(ctx)[0] == OK
"""


def test_memory_peak_is_the_high_water_mark(sim, bins):
    """`memory_peak` keeps the most memory a GPU had in use at once after it is freed;
    `gpusim reset-peak` restarts it at the current use, to measure one phase."""
    sim.write_config(ONE_GPU)
    gpu = lambda: sim.status()["gpus"][0]  # noqa: E731
    sim.python(ALLOC_AND_FREE)
    g = gpu()
    assert g["memory_used"] == 0
    assert g["memory_peak"] == (1024 + 300) << 20, "1 GiB + the 300 MiB context, at once"
    assert "peak 1324 MiB" in sim.gpusim("status").stdout
    w = start(sim, bins, "--hold-mib", "100", "--count", "0", "--wait")
    held = (100 + 300 + 1) << 20  # allocation + context + module
    g = gpu()
    assert g["memory_used"] == held and g["memory_peak"] == (1024 + 300) << 20
    sim.gpusim("reset-peak")
    assert gpu()["memory_peak"] == held, "reset brings the peak down to the current use"
    w.kill()
    w.wait()
    g = gpu()
    assert g["memory_used"] == 0 and g["memory_peak"] == held
    # by UUID or index; a GPU that does not exist is an error
    sim.gpusim("reset-peak", "GPU-11111111-2222-3333-4444-555555555555")
    assert gpu()["memory_peak"] == 0
    p = sim.gpusim("reset-peak", "1", check=False)
    assert p.returncode != 0 and "out of range" in p.stderr
