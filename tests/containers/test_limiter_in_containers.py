"""libvcuda's compute limiter in a real container's pid namespace (issue 17, point 5).

The limiter calibrates itself against NVML's per-process utilization samples, which the
driver (and gpusim, through `gpusim pid-service`) keys by host pid, while a process in a
container knows only its container pid: it finds its samples under the host pid the manager
wrote into its slot at registration. Get that wrong and the limiter calibrates against
nothing (or a stranger's samples) and misses its share. Here tenants run c/vcuda_load.c in
real containers admitted by the manager (tests/containers/runtime.py), and what each got is
judged by gpusim's ground truth keyed by host pid, with the host suite's tolerances
(tests/vcuda/test_vcuda_limit.py: ±2 pp over 10 s, bounded 1 s windows).
"""

import os
import pathlib
import sys
import time
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
for _d in ("tests/gpusim/e2e", "tests/vcuda", "tests/manager", "tests/containers"):
    if str(ROOT / _d) not in sys.path:
        sys.path.insert(0, str(ROOT / _d))

from gpusim_harness import cc, gpusim_built  # noqa: E402,F401  (fixtures)
from limit_common import Load, Machine  # noqa: E402
from node_common import Node, bins  # noqa: E402,F401  (bins: a fixture)
from test_real_containers import engine, engine_ready, start_pod, tools  # noqa: E402,F401  (fixtures)
from test_vcuda_limit import check_tenant  # noqa: E402
import runtime  # noqa: E402

pytestmark = pytest.mark.skipif(bool(os.environ.get("VCUDA_NO_IMAGES")),
                                reason=f"real-container tests skipped: {os.environ.get('VCUDA_NO_IMAGES')}")

LOAD = f"{runtime.TOOLS_IN_CONTAINER}/vcuda_load"  # limit_common.build_load, in `tools`


@pytest.fixture
def machine(tmp_path, bins):
    """One simulated A100 with a sampler of gpusim's ground truth (limit_common)."""
    m = Machine(tmp_path / "gpus", 1, bins["load"])
    yield m
    m.stop()


@pytest.fixture
def node(engine_ready, machine, tmp_path):
    """The node on `machine`'s GPUs; the manager reads the real /proc (real containers).
    (Overrides test_real_containers' node, which `engine` then uses.)"""
    n = Node(machine.sim, tmp_path / "node", proc_root="/proc")
    n.start_kubelet().start_manager().wait_registered()
    yield n
    n.close()


def gpu_index(node, c):
    """gpusim's index of container `c`'s (first) GPU, from the config mounted into it."""
    uuid = tomllib.loads(c.host_path("/etc/vcuda/vcuda.toml").read_text())["gpu"][0]["uuid"]
    (index,) = [g["index"] for g in node.sim.status()["gpus"] if g["uuid"] == uuid]
    return index


def start_load(machine, node, c, seconds, kernel="spin_1ms"):
    """Start vcuda_load in container `c`; returns a limit_common.Load keyed by the host pid
    (what gpusim's ground truth names it by) and the pid the process has in its container."""
    p = c.popen(LOAD, "--kernel", kernel, "--seconds", seconds)
    line = p.stdout.readline()
    if not line.startswith("ready pid="):
        p.kill()
        raise AssertionError(f"vcuda_load did not start in {c.name}: {line!r} {p.stderr.read()}")
    t0 = time.monotonic()
    inside = int(line.split("=")[1])
    host = c.host_pid_of(inside)
    listed = {q["pid"] for g in node.sim.status()["gpus"] for q in g["processes"]}
    assert host in listed, f"gpusim does not list vcuda_load (pid {inside} in {c.name}) by its host pid {host}: {sorted(listed)}"
    return Load(machine, gpu_index(node, c), p, host, t0), inside


def run_tenants(machine, node, engine, shares, seconds, kernel="spin_1ms"):
    """Admit one pod per share (1 GiB each), start a saturating load in each container at
    once, and wait for them all; returns [(share, Load, pid in the container)]."""
    cs = [(s, start_pod(node, engine, f"t{s}-{i}", core=s, memory=4)) for i, s in enumerate(shares)]
    machine.sample(0.1)
    started = [(s, *start_load(machine, node, c, seconds, kernel)) for s, c in cs]
    for _, ld, _ in started:
        ld.wait(timeout=seconds + 60)
    machine.stop()
    return started


def test_tenants_in_containers_get_their_share(machine, node, engine):
    """Two pods on one GPU, 30 % and 70 %, each a container running a saturating loop of
    1 ms kernels for 11 s: each gets its share within ±2 pp over 10 s, and no 1 s window
    goes further over it than the host suite allows, by gpusim's account of its host pid.
    The processes' pids inside their containers are not their host pids, so a limiter
    that looked for its samples under its own pid would find none (or a stranger's)."""
    seconds = 11
    started = run_tenants(machine, node, engine, [30, 70], seconds)
    for share, ld, inside in started:
        assert ld.pid != inside, "the container should have its own pid namespace"
        got = ld.util(1.0, seconds - 0.2)
        worst = max(machine.windows(ld, 1.0, seconds - 0.2))
        print(f"share {share}%: {got:.2%} over 10 s, worst 1 s window {worst:.2%} (pid {inside} in its container, {ld.pid} on the host)")
        check_tenant(ld, share / 100, "spin_1ms", seconds, f"container at {share}%")


# The attacker: rewrites its region's run-time share of GPU 0 (ppm, the field the manager
# writes every control-loop round) to 100 %, every millisecond, for `seconds`.
RAISE_SHARE = r"""
import os, struct, sys, time
fd = os.open("/run/vcuda/region/region", os.O_WRONLY)
end = time.monotonic() + float(sys.argv[2])
print("started", flush=True)
while time.monotonic() < end:
    os.pwrite(fd, struct.pack("<Q", 1_000_000), int(sys.argv[1]))
    time.sleep(0.001)
"""


def test_a_share_raised_in_the_region_buys_nothing(machine, node, engine):
    """Attack: the manager writes each container's run-time share into its region, which
    the container can write; root in a 30 % container overwrites it with 100 % every
    millisecond (the manager restores it every ~1/6 s) while a saturating load runs. What
    it could gain: the whole GPU (before the library capped run-time values at the read-only
    config's, it got 100 % until the compute watchdog killed it). What must hold: the load
    stays at its share, ±2 pp, and the manager has nothing to flag."""
    from vcuda_common import HEADER_OFFSETS

    c = start_pod(node, engine, "greedy", core=30, memory=4)
    seconds = 8
    attacker = c.popen("python3", "-c", RAISE_SHARE, HEADER_OFFSETS["core_override"][0], seconds + 2)
    try:
        assert attacker.stdout.readline().strip() == "started", attacker.stderr.read()
        machine.sample(0.1)
        ld, _ = start_load(machine, node, c, seconds)
        ld.proc.communicate(timeout=seconds + 60)
        machine.stop()
    finally:
        attacker.kill()
        attacker.wait()
    got = ld.util(1.0, min(seconds - 0.2, max(t for t, *_ in machine.samples) - ld.t0))
    print(f"share raised to 100 % in the region: the load got {got:.2%}")
    assert ld.proc.returncode == 0, f"the load exited {ld.proc.returncode}"
    assert got <= 0.30 + 0.02, f"a 30 % container that wrote 100 % into its region got {got:.2%}"
    assert "more compute than the limit" not in node.log()
