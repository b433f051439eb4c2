"""fork: a child has its own accounting (issue 3 §5). A child forked before CUDA is
initialised uses CUDA itself and is counted as a process of its own, in the region and by
gpusim; when it exits its memory comes back and the parent's stays counted. A child of a
process that already initialised CUDA cannot use the parent's CUDA state (as with the real
driver) and must not disturb the parent's accounting when it exits."""

import subprocess

import pytest

from vcuda_common import (
    CONTEXT,
    CUDA_ERROR_OUT_OF_MEMORY as OOM,
    MiB,
    build,
    gpu_status,
    proc_memory,
    region_slots,
)

QUOTA = 2048 * MiB


@pytest.fixture(scope="module")
def fork_bin(cc, tmp_path_factory):
    return build(cc, tmp_path_factory.mktemp("bin"), "vcuda_fork")


def kv(line):
    return {k: int(v) for k, v in (f.split("=", 1) for f in line.split()[1:])}


def start(c, fork_bin, mode, parent_mib, child_mib):
    p = c.popen([fork_bin, mode, parent_mib, child_mib], stdin=subprocess.PIPE)
    got = {}
    while len(got) < 2:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        got[line.split()[0]] = kv(line)
    return p, got["parent"], got["child"]


def send(p, cmd):
    p.stdin.write(cmd + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def test_child_forked_before_cuda_has_its_own_accounting(sim, fork_bin):
    c = sim.container(QUOTA // MiB)
    p, parent, child = start(c, fork_bin, "before", 200, 300)
    try:
        assert parent["alloc"] == 0 and child["alloc"] == 0, (parent, child)
        slots = {s["pid"]: s for s in region_slots(c.region)}
        assert slots[parent["pid"]]["api"] == [200 * MiB]
        assert slots[child["pid"]]["api"] == [300 * MiB]
        assert slots[parent["pid"]]["hidden"] == slots[child["pid"]]["hidden"] == [CONTEXT]
        assert proc_memory(sim, parent["pid"]) == CONTEXT + 200 * MiB
        assert proc_memory(sim, child["pid"]) == CONTEXT + 300 * MiB
        # together they hold 1100 MiB of the 2048: the parent can take exactly the rest
        rest = QUOTA - 2 * CONTEXT - 500 * MiB
        assert send(p, f"alloc {rest + 512}") == f"rc={OOM}"
        assert send(p, f"alloc {rest}") == "rc=0"
        assert gpu_status(sim)["memory_used"] == QUOTA
        assert send(p, "release-child") == "child_exit=0"
        sim.status()  # gpusim frees the exited child's memory (see test_vcuda_storm)
        assert proc_memory(sim, child["pid"]) is None
        # the child's context and allocation are back; the parent's own memory still counts
        assert send(p, f"alloc {CONTEXT + 300 * MiB}") == "rc=0"
        assert send(p, "alloc 512") == f"rc={OOM}"
        assert [s["pid"] for s in region_slots(c.region)] == [parent["pid"]]
        st = gpu_status(sim)
        assert st["memory_used"] == QUOTA and st["memory_peak"] <= QUOTA
    finally:
        p.stdin.close()
        p.wait(timeout=10)


def test_child_of_an_initialised_process_leaves_the_parent_counted(sim, fork_bin):
    c = sim.container(QUOTA // MiB)
    p, parent, child = start(c, fork_bin, "after", 200, 300)
    try:
        assert parent["alloc"] == 0
        # the child cannot use the parent's CUDA state: nothing it tried succeeded or was charged
        assert child["alloc"] != 0, child
        assert proc_memory(sim, child["pid"]) is None
        mine = [s for s in region_slots(c.region) if s["pid"] == child["pid"]]
        assert all(s["api"] == [0] for s in mine), mine
        assert send(p, "release-child") == "child_exit=0"
        # the parent still holds its context and 200 MiB, in the region and in gpusim
        slots = {s["pid"]: s for s in region_slots(c.region)}
        assert slots[parent["pid"]]["api"] == [200 * MiB]
        assert proc_memory(sim, parent["pid"]) == CONTEXT + 200 * MiB
        rest = QUOTA - CONTEXT - 200 * MiB
        assert send(p, f"alloc {rest + 512}") == f"rc={OOM}"
        assert send(p, f"alloc {rest}") == "rc=0"
        assert gpu_status(sim)["memory_peak"] <= QUOTA
    finally:
        p.stdin.close()
        p.wait(timeout=10)
