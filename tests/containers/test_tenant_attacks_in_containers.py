"""The hostile tenant (tests/manager/test_tenant_attacks.py) as root in a real container
(issue 17, point 5).

There the "containers" are host processes and an attack on a mounted file is made on its
host path. Here the attacker is root in a container the Docker engine started from the
Allocate answer (tests/containers/runtime.py): its own pid, mount and network namespaces,
the engine's default capabilities and seccomp profile, and only what the answer mounts. The
attacks are the ones that go through what a container reaches (its mounts, the control
socket, its own region), made from inside with the image's tools (bash, coreutils,
python3). Each is judged as the host suite judges it: the manager alive and answering
Allocate (a new pod admitted within 1 s), the neighbour's share and processes untouched,
and gpusim's ground truth. (The attack scripts are the host suite's; they find the config,
the region and the socket as the library does, through the answer's VCUDA_CONFIG.)
"""

import os
import pathlib
import struct
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
for _d in ("tests/gpusim/e2e", "tests/vcuda", "tests/manager", "tests/containers"):
    if str(ROOT / _d) not in sys.path:
        sys.path.insert(0, str(ROOT / _d))

from gpusim_harness import cc, gpusim_built  # noqa: E402,F401  (fixtures)
from node_common import bins, wait_for  # noqa: E402,F401  (bins: a fixture)
from vcuda_common import region_header_field, region_slots  # noqa: E402
from test_real_containers import (  # noqa: E402,F401  (engine_ready, tools, node, engine: fixtures)
    FILL, MiB, engine, engine_ready, hold, node, peak, registrations, start_pod, tools,
)
import runtime  # noqa: E402
from test_tenant_attacks import LOCK_AND_REGISTER, SLOW_FLOOD, TRUNCATE_LOOP, admit_within  # noqa: E402

pytestmark = pytest.mark.skipif(bool(os.environ.get("VCUDA_NO_IMAGES")),
                                reason=f"real-container tests skipped: {os.environ.get('VCUDA_NO_IMAGES')}")

TOOLS = runtime.TOOLS_IN_CONTAINER
REGION = "/run/vcuda/region/region"
CONFIG = "/etc/vcuda/vcuda.toml"


def share_of(c):
    """The run-time share (ppm) the manager wrote into container `c`'s region, GPU 0."""
    return region_header_field(c.host_path(REGION), "core_override")[0]


def test_holding_the_regions_lock_through_the_mount_stalls_nobody(node, engine):
    """Attack: root in a container takes flock on its region through the mount (the same
    inode the manager holds open) and then registers, so the manager's registration check
    reads a region whose lock a tenant holds. Before issue 11 the manager blocked on that
    lock while holding the node's state lock: every Allocate on the node waited as long as
    the tenant liked. Now the registration is answered at once (refused: the script holds
    no slot), and the node admits a pod within 1 s while the lock is held."""
    a = start_pod(node, engine, "a", core=30, memory=16)
    attacker = a.popen("python3", "-c", LOCK_AND_REGISTER, 10)
    try:
        line = attacker.stdout.readline()
        assert line.startswith("answered=True"), line + attacker.stderr.read()
        assert float(line.split("after=")[1]) < 1.0, line
        # The lock is really held, on the host's inode, while the node goes on admitting.
        probe = a.sh(f"flock -n {REGION} true")
        assert probe.returncode != 0, "the attacker's flock was not held (the attack tested nothing)"
        admit_within(node, "b", core=20, memory=8)
        assert "registration refused" in node.log()
    finally:
        attacker.kill()
        attacker.wait()


def test_truncating_and_rewriting_the_region_through_the_mount_crashes_nothing(node, engine):
    """Attack: the region is the one writable mount; root in the container truncates it
    (`truncate -s 0` through the bind mount) while one of its processes holds memory, then
    fills it with garbage of the wrong size. Before issue 11 the truncation killed the
    manager (SIGBUS reading its mapping), at every restart too: no pod on the node could be
    admitted, and a region that did not validate could have counted as empty. Now the
    manager goes on serving, says what the container did, and counts the container's
    memory as its whole quota; the neighbour's share is untouched; a process started on the
    garbage is refused rather than let run unbooked (gpusim's high-water mark stays under
    the quota). (The tenant's own holder dies of SIGBUS: its library maps the region.)"""
    a = start_pod(node, engine, "a", core=30, memory=8)  # 2 GiB
    b = start_pod(node, engine, "b", core=40, memory=8)
    wait_for("b's share in its region", lambda: share_of(b) == 400_000)
    quota = 8 * 256 * MiB
    node.sim.gpusim("reset-peak")
    holder = hold(a, 256)
    try:
        series = dict(namespace="default", pod="a", container="main")
        wait_for("a's usage metric", lambda: node.metric("vcuda_container_memory_used_bytes", **series))
        r = a.sh(f"truncate -s 0 {REGION} && stat -c %s {REGION}")
        assert r.returncode == 0 and r.stdout.strip() == "0", r
        wait_for("the manager to notice (or die)",
                 lambda: "region is unusable" in node.log() or node.manager.poll() is not None, timeout=5)
        assert node.manager.poll() is None, f"the manager died: {node.manager.returncode}"
        admit_within(node, "c", core=10, memory=4)
        assert node.metric("vcuda_container_memory_used_bytes", **series) == quota
        r = a.sh(f"head -c 65536 /dev/urandom > {REGION}")
        assert r.returncode == 0, r.stderr
        late = a.exec(FILL, 64, 100000, stdin="")
        assert late.returncode != 0 and "holds" not in late.stdout, f"a process ran on a garbage region: {late.stdout}"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert peak(node) <= quota, f"gpusim's high-water mark {peak(node) / MiB:.0f} MiB > 2048 MiB"
    assert node.manager.poll() is None, "the manager died"
    assert node.metric("vcuda_container_memory_used_bytes", **series) == quota
    admit_within(node, "d", core=10, memory=4)
    assert share_of(b) == 400_000, "the neighbour's share changed"


# What root in a container tries against the mounts that carry enforcement, and how the
# kernel refuses it: a bind-mount point cannot be unlinked, renamed or replaced (EBUSY),
# and without CAP_SYS_ADMIN nothing can be unmounted or mounted over it.
MOUNT_ATTACKS = {
    "unlink the region": (f"rm -f {REGION}", "Device or resource busy"),
    "rename the region away": (f"mv {REGION} {REGION}.old", "Device or resource busy"),
    "replace the region by a link": (f"ln -sfn /tmp/mine {REGION}", "Device or resource busy"),
    "unmount the region": (f"umount {REGION}", "must be superuser"),
    "rename the socket directory away": ("mv /run/vcuda/sock /run/vcuda/sock.old", "Device or resource busy"),
    "rename the config directory away": ("mv /etc/vcuda /etc/vcuda.old", "Device or resource busy"),
    "mount a config of its own over it": ("mkdir -p /tmp/cfg && mount --bind /tmp/cfg /etc/vcuda", "permission denied"),
    "remove the preload file": ("rm -f /etc/ld.so.preload", "Device or resource busy"),
    "unmount the library": ("umount /usr/local/vcuda/lib64/libvcuda.so", "must be superuser"),
}

# What the kernel does not refuse: the region's contents (truncated and regrown: every slot
# zeroed) and the mount points' parent directory (renamed away, a region of the tenant's
# own put at the configured path). Each: (the reset, what stops the tenant). An empty or
# zeroed region is one the manager never made (it lays out every region before the
# container starts), so the library refuses it; a copy of the region taken while it held
# nothing is well formed, and only the manager's watchdog, which reads the driver, sees
# the container past its quota.
SNAPSHOT = "/tmp/region.snap"
RESETS = {
    "truncate and regrow the region": (f"truncate -s 0 {REGION} && truncate -s 20480 {REGION}", "library"),
    "rename /run/vcuda away and plant an empty region":
        ("mv /run/vcuda /run/vcuda.old && mkdir -p /run/vcuda/region && : > /run/vcuda/region/region", "library"),
    "rename /run/vcuda away and plant a copy taken while it held nothing":
        (f"mv /run/vcuda /run/vcuda.old && mkdir -p /run/vcuda/region && cp {SNAPSHOT} /run/vcuda/region/region",
         "watchdog"),
}


def container_mib(node, c):
    """What the driver says container `c`'s processes hold (MiB), by host pid."""
    mine = set(c.host_pids())
    return sum(p["memory"] for g in node.sim.status()["gpus"] for p in g["processes"] if p["pid"] in mine) / MiB


@pytest.mark.parametrize("reset", list(RESETS), ids=["truncate-regrow", "shadow-empty", "shadow-copy"])
def test_mounts_cannot_be_replaced_and_reset_books_grant_nothing(node, engine, reset):
    """Attack, first: root in the container unlinks, renames, replaces, unmounts or mounts
    over the mounts that carry enforcement (the region, the control socket's directory, the
    config, the preload file, the library), to point the library at books or limits of its
    own. The kernel refuses each (EBUSY on a mount point; no CAP_SYS_ADMIN for mount and
    umount), and the files are unchanged on the host.

    Then what the kernel allows: resetting the books (`reset`) while a process holds 1.5 GiB
    of a 2 GiB quota, so that a new process finds no holder and is granted a whole quota
    again (before the library refused regions it did not lay out: the container reached
    3864 MiB). What must hold: an empty or zeroed region is refused by the library (the
    new process gets nothing); a well-formed copy is caught by the threat model's backstop,
    the manager's watchdog, which compares the driver's per-process memory with the quota
    and, with --watchdog-kill, kills the container's processes, so the GPU is back under the
    quota within seconds. Either way the neighbour's process lives on."""
    script, stopped_by = RESETS[reset]
    node.stop_manager()
    node.start_manager("--watchdog-kill").wait_registered()
    victim_pod = start_pod(node, engine, "victim", core=30, memory=8)
    a = start_pod(node, engine, "a", core=30, memory=8)  # 2 GiB
    quota_mib = 2048
    host_files = [a.host_path(p) for p in (REGION, CONFIG, "/etc/ld.so.preload")]
    before = {p: p.read_bytes() for p in host_files[1:]}
    for what, (attack, why) in MOUNT_ATTACKS.items():
        r = a.sh(attack)
        assert r.returncode != 0, f"{what}: succeeded ({attack})"
        assert why in r.stderr, f"{what}: refused for another reason: {r.stderr!r}"
    assert {p: p.read_bytes() for p in host_files[1:]} == before
    assert a.sh(f"test -f {REGION} && test -S /run/vcuda/sock/manager.sock").returncode == 0
    assert a.sh(f"cp {REGION} {SNAPSHOT}").returncode == 0  # the books while nothing is held

    victim = hold(victim_pod, 512)
    holder = hold(a, 1536)
    late = None
    try:
        r = a.sh(script)
        assert r.returncode == 0, f"{reset}: {r.stderr}"
        others = container_mib(node, victim_pod)  # the neighbour shares the GPU
        node.sim.gpusim("reset-peak")
        late = a.popen(FILL, 64, 100000)
        out = ""
        for line in late.stdout:
            out += line
            if "holds" in line or "failed" in line or "refused" in line:
                break
        gained = peak(node) / MiB - others
        print(f"{reset}: a new process: {out.strip().splitlines()[-1] if out.strip() else out!r}; "
              f"the container's high-water mark {gained:.0f} MiB")
        if stopped_by == "library":
            assert "holds" not in out, f"{reset}: a new process was granted memory on reset books: {out!r}"
            assert gained <= quota_mib, f"{reset}: the container reached {gained:.0f} MiB of {quota_mib}"
        else:
            assert gained > quota_mib, "the copied books were not trusted: this case no longer needs the watchdog"
            wait_for("the watchdog's kill", lambda: "watchdog: killed" in node.log(), timeout=5)
            assert "more memory than the quota" in node.log()
        wait_for("the container to be back under its quota", lambda: container_mib(node, a) <= quota_mib, timeout=5)
        assert victim.poll() is None, "the neighbour's process was killed"
        admit_within(node, "c", core=10, memory=4)
    finally:
        for p in (victim, holder, late):
            if p is not None and p.poll() is None:
                p.stdin.close()
                p.wait(timeout=30)


# The attacker's write: its own slot's host_pid field (region.rs Slot: 4096 + slot × 256 + 8).
FORGE_HOST_PID = r"""
import os, struct, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
os.pwrite(fd, struct.pack("<I", int(sys.argv[3])), 4096 + int(sys.argv[2]) * 256 + 8)
"""


def test_a_neighbours_host_pid_forged_into_the_region_gets_nobody_killed(node, engine):
    """Attack: root in container a learns a neighbour's host pid (here: given it, as a log
    or an old region could have leaked it) and writes it into its own slot's host_pid,
    which the region leaves writable. Before issue 11 the control loop took host pids from
    the region: the neighbour's 2 GiB were counted against a's 1 GiB quota, and with
    --watchdog-kill the watchdog SIGKILLed the neighbour's process, in another container.
    Now who a process is comes from the kernel at registration: the neighbour lives on,
    and a is not flagged."""
    node.stop_manager()
    node.start_manager("--watchdog-kill").wait_registered()
    b = start_pod(node, engine, "b", core=30, memory=16)  # 4 GiB: the victim
    a = start_pod(node, engine, "a", core=30, memory=4)  # 1 GiB: the attacker
    before = registrations(node)
    victim = hold(b, 2048)
    attacker = hold(a, 64)
    try:
        wait_for("both to register", lambda: registrations(node) >= before + 2)
        (victim_pid,) = b.sh("pgrep -x fill").stdout.split()
        victim_host = b.host_pid_of(int(victim_pid))
        (mine,) = a.sh("pgrep -x fill").stdout.split()
        (slot,) = [s["slot"] for s in region_slots(a.host_path(REGION)) if s["pid"] == int(mine)]
        r = a.exec("python3", "-c", FORGE_HOST_PID, REGION, slot, victim_host)
        assert r.returncode == 0, r.stderr
        raw = a.host_path(REGION).read_bytes()
        assert struct.unpack_from("<I", raw, 4096 + slot * 256 + 8)[0] == victim_host, "the forged pid did not land"
        # The watchdog acts on two rounds in a row over the quota (~1/6 s each): watch
        # for well past that.
        end = time.monotonic() + 2
        while time.monotonic() < end:
            assert victim.poll() is None, "the neighbour's process was killed"
            time.sleep(0.05)
        assert b.sh(f"kill -0 {victim_pid}").returncode == 0
        assert not node.metric("vcuda_watchdog_violations_total", pod="a")
        assert "watchdog: killed" not in node.log()
    finally:
        for p in (victim, attacker):
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=30)


def test_three_containers_attacking_at_once_stop_no_one(node, engine):
    """Three root tenants at once, each from its own container: one floods the control
    socket with 300 slow connections (a byte a second; before issue 11 they held all 256 of
    the manager's connection permits, so no other container could register or ask
    vcuda-smi anything), one truncates and restores its region in a loop through the mount
    (before: the manager's SIGBUS), one holds its region's flock (before: the node's state
    lock held with it). Meanwhile a bystander's process registers and its vcuda-smi answers
    within 3 s, the node admits pods within 1 s each (and within 3x the slowest admission
    before the attack, or 0.25 s), the manager stays up, and the bystander's share is
    untouched."""
    bystander = start_pod(node, engine, "bystander", core=40, memory=8)
    wait_for("the bystander's share", lambda: share_of(bystander) == 400_000)
    before = []
    for i in range(5):
        t0 = time.monotonic()
        admit_within(node, f"before-{i}", core=1, memory=1)
        before.append(time.monotonic() - t0)
    flooder, truncater, locker = (start_pod(node, engine, p, core=5, memory=2) for p in ("fl", "tr", "lk"))
    attacks = [flooder.popen("python3", "-c", SLOW_FLOOD, 300, 30),
               truncater.popen("python3", "-c", TRUNCATE_LOOP, 30),
               locker.popen("python3", "-c", LOCK_AND_REGISTER, 30)]
    try:
        flood, trunc, lock = attacks
        connected = flood.stdout.readline()
        assert connected.startswith("connected="), connected + flood.stderr.read()
        assert trunc.stdout.readline().strip() == "started", trunc.stderr.read()
        assert lock.stdout.readline().startswith("answered=True"), lock.stderr.read()
        n = registrations(node)
        holder = hold(bystander, 64)
        try:
            wait_for("the bystander's process to register", lambda: registrations(node) > n, timeout=3)
            smi = f"{TOOLS}/vcuda-smi"
            wait_for("vcuda-smi in the bystander to answer", lambda: bystander.exec(smi, "--json").returncode == 0, timeout=3)
        finally:
            holder.stdin.close()
            holder.wait(timeout=30)
        during, end = [], time.monotonic() + 2
        while time.monotonic() < end or len(during) < 10:
            t0 = time.monotonic()
            admit_within(node, f"during-{len(during)}", core=1, memory=1)
            during.append(time.monotonic() - t0)
            time.sleep(0.15)
        print(f"{connected.strip()}; admissions: {len(during)} during the attack, slowest {max(during) * 1e3:.1f} ms "
              f"(before it: {max(before) * 1e3:.1f} ms)")
        assert max(during) <= max(3 * max(before), 0.25), f"admissions took {during}, before the attack {before}"
        assert all(p.poll() is None for p in attacks), "an attack ended early (it tested nothing)"
        assert node.manager.poll() is None, "the manager died"
        assert share_of(bystander) == 400_000, "the bystander's share changed"
    finally:
        for p in attacks:
            p.kill()
            p.wait()
