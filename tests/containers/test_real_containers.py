"""Tenant guarantees in real containers (issue 11's proofs; issue 17's first slice).

Everywhere else in the suite a "container" is a host process with a fake /proc tree. Here
vcuda-manager serves kubelet-sim as usual, and each admitted pod's container is started by
the Docker engine from the Allocate answer kubelet-sim received (tests/containers/runtime.py:
mounts with their read-only flags, environment, the pod's cgroup under
`/kubepods/burstable/pod<UID>`), in its own pid, mount and network namespaces, with the
engine's default capabilities and seccomp profile. The tenant is root inside, as most GPU
images run. The manager reads the real /proc, so registration is checked against the
container's real cgroup. Ground truth is gpusim's (its state file is the simulated driver).

Images: `scripts/build-images` (scripts/test runs it). Where the images cannot be built
because debootstrap cannot reach the Debian mirror, scripts/test says so loudly and sets
VCUDA_NO_IMAGES; only then are these tests skipped. A missing engine or image otherwise
fails them.
"""

import os
import pathlib
import re
import shutil
import struct
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpusim" / "e2e"))
sys.path.insert(0, str(ROOT / "tests" / "vcuda"))
sys.path.insert(0, str(ROOT / "tests" / "manager"))
sys.path.insert(0, str(ROOT / "tests" / "containers"))

from gpusim_harness import Sim, cc, gpusim_built  # noqa: E402,F401  (fixtures)
from node_common import Node, bins, holding, wait_for  # noqa: E402,F401  (bins: a fixture)
from vcuda_common import HEADER_OFFSETS  # noqa: E402
import runtime  # noqa: E402

IMAGE = "vcuda/base:bookworm"
MiB = 1 << 20
FILL = f"{runtime.TOOLS_IN_CONTAINER}/fill"


def _unavailable():
    if os.environ.get("VCUDA_NO_IMAGES"):
        return f"real-container tests skipped: {os.environ['VCUDA_NO_IMAGES']}"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or "")


@pytest.fixture(scope="module")
def engine_ready():
    why = runtime.engine_unavailable()
    if why:
        pytest.fail(f"real containers need a Docker engine: {why}")
    if runtime.image_missing(IMAGE):
        pytest.fail(f"image {IMAGE} is missing: run scripts/build-images (scripts/test does)")


@pytest.fixture(scope="module")
def tools(bins, tmp_path_factory):
    """What the tests run inside containers, mounted read-only: the C workloads and the
    in-container vcuda-smi (the glibc-baseline build when there is one, as shipped)."""
    d = pathlib.Path(bins["fill"]).parent
    smi = ROOT / "target" / "portable" / "vcuda-smi"
    if not smi.exists():
        smi = ROOT / "target" / "release" / "vcuda-smi"
    shutil.copy2(smi, d / "vcuda-smi")
    return d


@pytest.fixture
def node(engine_ready, tmp_path):
    sim = Sim(tmp_path)
    n = Node(sim, tmp_path / "node", proc_root="/proc")
    n.start_kubelet().start_manager().wait_registered()
    yield n
    n.close()


def pynvml_file():
    import pynvml  # type: ignore

    return pathlib.Path(pynvml.__file__)


@pytest.fixture
def engine(node, tools):
    e = runtime.Engine(node.sim, image=IMAGE, tools=tools, mounts=[(pynvml_file(), "/opt/python/pynvml.py")])
    yield e
    e.close()


def start_pod(node, engine, pod, core, memory):
    # kubelet-sim plays the kubelet up to PreStartContainer; the engine then creates the
    # container, as the kubelet's runtime call does after PreStartContainer.
    admitted = node.admit(pod, core=core, memory=memory)
    assert admitted["admitted"] and admitted["containers"][0]["start"]["started"], admitted
    return engine.start(admitted, node.pod_uid(pod))


def registrations(node):
    return node.log().count("process registered")


def fill_registered(node, c, step, most, env=None, program=FILL):
    """Run `fill STEP MOST` (`program`) in container `c` until it says what it holds; keep
    it alive until the manager has registered it (a process that exits at once may be gone
    before the manager reads its cgroup), then let it exit. Returns its output."""
    n = registrations(node)
    p = c.popen(program, step, most, env=env)
    out = ""
    try:
        for line in p.stdout:
            out += line
            if "holds" in line or "failed" in line or "refused:" in line:
                break
        wait_for("the process's registration", lambda: registrations(node) > n)
    finally:
        p.stdin.close()
        rest, err = p.stdout.read(), p.stderr.read()
        p.wait(timeout=30)
    assert p.returncode == 0, f"fill exited {p.returncode}: {out}{rest}{err}"
    return out + rest


def hold(c, mib):
    """`fill MIB MIB` in container `c`, once it holds `mib` MiB (until its stdin closes)."""
    return holding(c.popen(FILL, mib, mib), mib)


def held_mib(out):
    m = re.search(r"holds (\d+) MiB", out)
    assert m, f"fill said: {out!r}"
    return int(m.group(1))


def peak(node, gpu=0):
    return node.sim.status()["gpus"][gpu]["memory_peak"]


def test_the_engine_applies_the_answer_and_read_only_mounts_refuse_a_root_tenant(node, engine):
    """Issue 11 rests on mounts being read-only where the Allocate answer says so: the
    config (or a tenant could raise its own quota), the preload file and the library (or it
    could unload enforcement for every process), the control socket's directory (or it could
    replace the node's socket). Root in the container, with the engine's default
    capabilities, can write none of them, nor remount them; the region, the one writable
    mount, is writable. The files are unchanged on the host afterwards."""
    c = start_pod(node, engine, "ro", core=30, memory=4)
    assert c.sh("id -u").stdout.strip() == "0", "the tenant should be root in its container"
    mounts = {m["Destination"]: m for m in c.inspect()["Mounts"]}
    for m in c.answer["mounts"]:
        got = mounts.get(m["container_path"])
        assert got is not None, f"the engine did not mount {m['container_path']}"
        assert got["Source"] == m["host_path"]
        assert got["RW"] == (not m.get("read_only", False)), f"{m['container_path']}: RW={got['RW']}, answer {m}"
    ro = sorted(m["container_path"] for m in c.answer["mounts"] if m.get("read_only"))
    assert ro == ["/etc/ld.so.preload", "/etc/vcuda", "/run/vcuda/sock", "/usr/local/vcuda/lib64/libvcuda.so"], ro
    before = {m["host_path"]: _digest(pathlib.Path(m["host_path"])) for m in c.answer["mounts"] if m.get("read_only")}
    attacks = {
        "raise the quota in the config": "sed -i 's/memory_mib = .*/memory_mib = 100000/' /etc/vcuda/vcuda.toml",
        "append to the config": "echo '# mine' >> /etc/vcuda/vcuda.toml",
        "plant a second config": "echo 'version = 1' > /etc/vcuda/other.toml",
        "empty the preload file": ": > /etc/ld.so.preload",
        "replace the library": "cp /bin/true /usr/local/vcuda/lib64/libvcuda.so",
        "remove the node's socket": "rm -f /run/vcuda/sock/manager.sock",
        "rename the node's socket": "mv /run/vcuda/sock/manager.sock /run/vcuda/sock/old",
        "plant a socket beside it": "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/run/vcuda/sock/x.sock\")'",
    }
    for what, script in attacks.items():
        r = c.sh(script)
        assert r.returncode != 0, f"{what}: succeeded ({script})"
        assert "Read-only file system" in r.stderr, f"{what}: refused for another reason: {r.stderr!r}"
    for target in ("/etc/vcuda", "/run/vcuda/sock"):
        r = c.sh(f"mount -o remount,rw,bind {target}")
        assert r.returncode != 0, f"root remounted {target} read-write"
    after = {p: _digest(pathlib.Path(p)) for p in before}
    assert after == before, "a read-only mount changed on the host"
    assert c.sh("test -S /run/vcuda/sock/manager.sock").returncode == 0
    r = c.sh("head -c 8 /run/vcuda/region/region | od -c | head -1; : >> /run/vcuda/region/region")
    assert r.returncode == 0, f"the region must be writable to the library: {r.stderr!r}"


def _digest(p):
    import hashlib

    if p.is_dir():
        return sorted((q.name, hashlib.sha256(q.read_bytes()).hexdigest()) for q in p.iterdir() if q.is_file())
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_the_quota_holds_whatever_a_root_tenant_sets(node, engine):
    """Issue 11, point 7, in a real container: a 1 GiB container allocates until refused,
    as the manager set it up, with `VCUDA_CONFIG` pointing at a config of its own (100 GB),
    with `LD_PRELOAD` emptied (the read-only /etc/ld.so.preload loads the library all the
    same), and after zeroing its region header's slot count while a process holds memory.
    Judged by gpusim: the GPU's high-water mark never passes the quota. Each process
    registers with the manager, whose check reads the container's real cgroup."""
    c = start_pod(node, engine, "q", core=30, memory=4)  # 1 GiB
    quota = 1024 * MiB
    mine = "\n".join([
        "version = 1", 'region = "/tmp/region"', "",
        "[[gpu]]", f'uuid = "{node.sim.status()["gpus"][0]["uuid"]}"', "memory_mib = 100000", "core = 100", "",
    ])
    assert c.sh(f"cat > /tmp/mine.toml <<'EOF'\n{mine}\nEOF").returncode == 0
    for what, env in {
        "as set up": {},
        "VCUDA_CONFIG of its own": {"VCUDA_CONFIG": "/tmp/mine.toml"},
        "LD_PRELOAD emptied": {"LD_PRELOAD": ""},
    }.items():
        node.sim.gpusim("reset-peak")
        out = fill_registered(node, c, 64, 100000, env=env)
        got = held_mib(out)
        assert "refused" in out and got < 1024, f"{what}: held {got} MiB of a 1 GiB quota"
        assert peak(node) <= quota, f"{what}: gpusim's high-water mark {peak(node) / MiB:.0f} MiB > 1024 MiB"
    assert "not in the cgroup" not in node.log()

    node.sim.gpusim("reset-peak")
    holder = hold(c, 256)
    try:
        off, _ = HEADER_OFFSETS["slots_used"]
        zero = f"import os; fd = os.open('/run/vcuda/region/region', os.O_WRONLY); os.pwrite(fd, bytes(4), {off})"
        assert c.exec("python3", "-c", zero).returncode == 0
        raw = c.host_path("/run/vcuda/region/region").read_bytes()
        assert struct.unpack_from("<I", raw, off)[0] == 0, "the tenant's write did not land"
        # A second process allocates as much as it can: with the slot count zeroed it must
        # still count the holder, so it is refused before the GPU holds more than the quota
        # (before issue 11 it was given its whole request on top).
        r = c.exec(FILL, 64, 1024, stdin="")
        assert "refused" in r.stdout, f"a second process past a 256 MiB holder in 1 GiB: {r.stdout}"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert peak(node) <= quota, f"gpusim's high-water mark {peak(node) / MiB:.0f} MiB > 1024 MiB"


def test_a_root_tenant_cannot_see_or_signal_its_neighbour(node, engine):
    """Two pods: the attacker, root in its container, finds no trace of the neighbour's
    processes in its /proc, cannot signal the neighbour's process by its host pid (which it
    could learn from a log or a region before issue 11), and its vcuda-smi shows its own
    container only."""
    victim = start_pod(node, engine, "victim", core=40, memory=8)
    attacker = start_pod(node, engine, "attacker", core=30, memory=4)
    held = hold(victim, 256)
    try:
        victim_host_pids = victim.host_pids()
        assert victim_host_pids, "no process of the victim found on the host"
        seen = attacker.sh("ps -eo comm=").stdout.split()
        assert "fill" not in seen, f"the attacker sees the victim's fill: {seen}"
        for pid in victim_host_pids:
            r = attacker.sh(f"kill -9 {pid}")
            assert r.returncode != 0 and "No such process" in r.stderr, (pid, r.stderr)
        assert held.poll() is None, "the victim's process died"
        view = attacker.exec(f"{runtime.TOOLS_IN_CONTAINER}/vcuda-smi", "--json")
        assert view.returncode == 0, view.stderr
        import json

        v = json.loads(view.stdout)
        pods = {ct.get("pod") or ct.get("pod_name") for ct in _containers(v)}
        assert "victim" not in str(v), f"the attacker's vcuda-smi shows the victim: {pods}"
        assert any("attacker" in str(p) for p in pods), f"vcuda-smi in a container shows its own container: {v}"
    finally:
        held.stdin.close()
        held.wait(timeout=30)


def test_the_selftest_in_a_container_refuses_and_lifts_nothing(node, engine):
    """vcuda-smi is mounted into every container; its `selftest` writes a config of its own
    (quota and share of its choosing) for a workload it preloads. In a container, where the
    manager's config is mounted, it refuses to run (exit 2, saying why) rather than appear
    to test anything: the library there obeys the mounted config only. Asked for 100 GiB,
    the container's GPU never holds more than its 1 GiB."""
    c = start_pod(node, engine, "selftest", core=30, memory=4)  # 1 GiB
    node.sim.gpusim("reset-peak")
    r = c.exec(f"{runtime.TOOLS_IN_CONTAINER}/vcuda-smi", "selftest", "--json", "--quota", "100GiB",
               "--lib", "/usr/local/vcuda/lib64/libvcuda.so")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "container" in r.stderr, r.stderr
    assert peak(node) <= 1024 * MiB, f"gpusim's high-water mark {peak(node) / MiB:.0f} MiB > 1024 MiB"


def _containers(view):
    out = []
    for g in view.get("gpus", []):
        out += g.get("containers", [])
    out += view.get("containers", [])
    return out




def test_the_driver_names_a_containers_process_by_its_host_pid(node, engine):
    """The real driver reports host pids, also for processes in a container's pid namespace
    (issue 17, point 3), and gpusim now does too (`gpusim pid-service`): the node's view
    (`gpusim status`, what vcuda-manager's NVML sees) names the process holding memory by its
    host pid. Inside the container, NVML goes through libvcuda, which keeps only the
    container's processes and names them by their container pid, translating the driver's
    host pid through the host pid the manager wrote into the process's slot: here that
    translation meets a real pid namespace."""
    c = start_pod(node, engine, "pids", core=30, memory=4)
    held = hold(c, 128)
    try:
        inside = c.sh("pgrep -x fill").stdout.split()
        assert len(inside) == 1, inside
        host = c.host_pid_of(int(inside[0]))
        assert host != int(inside[0]), "the container should have its own pid namespace"
        node_view = {p["pid"] for g in node.sim.status()["gpus"] for p in g["processes"]}
        assert host in node_view and int(inside[0]) not in node_view, (host, inside, node_view)
        probe = ("import sys; sys.path.insert(0, '/opt/python'); import pynvml; pynvml.nvmlInit(); "
                 "h = pynvml.nvmlDeviceGetHandleByIndex(0); "
                 "print(' '.join(str(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)))")
        r = c.exec("python3", "-c", probe)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [inside[0]], f"NVML in the container lists {r.stdout!r}; fill is {inside[0]} there, {host} on the host"
    finally:
        held.stdin.close()
        held.wait(timeout=30)
