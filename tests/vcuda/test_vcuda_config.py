"""A missing, garbled or wrong config, or an unusable region, fails closed (issue 3 §4): CUDA
init returns CUDA_ERROR_NOT_PERMITTED (800), every later call is refused too, no GPU memory
is touched, and exactly one stderr line, starting "vcuda:", names the file and the problem.
The application is never run unlimited by accident."""

import os
import subprocess

import pytest

from gpusim_harness import LIB, VCUDA_LIB
from vcuda_common import (
    CONTEXT,
    CUDA_ERROR_NOT_PERMITTED,
    MiB,
    Shell,
    build,
    gpu_status,
    region_slots,
)


@pytest.fixture(scope="module")
def shell_bin(cc, tmp_path_factory):
    return build(cc, tmp_path_factory.mktemp("bin"), "vcuda_shell")


def attempt(env_owner, shell_bin, env=None):
    """Run the shell through init, a context and an allocation; return (replies, stderr
    lines starting with "vcuda:", all of stderr)."""
    cmds = "init\nctx 0\nalloc 1048576\ninfo\nquit\n"
    p = subprocess.run([str(shell_bin)], input=cmds, capture_output=True, text=True, timeout=30,
                       env=env if env is not None else env_owner.env)
    replies = [int(l.split()[0].split("=")[1]) for l in p.stdout.splitlines()]
    lines = [l for l in p.stderr.splitlines() if l.startswith("vcuda:")]
    return replies, lines, p.stderr


def assert_refused(sim, replies, lines, stderr, *names):
    assert replies[:4] == [CUDA_ERROR_NOT_PERMITTED] * 4, replies
    assert len(lines) == 1, f"exactly one vcuda: line expected\n{stderr}"
    for n in names:
        assert str(n) in lines[0], (n, lines[0])
    assert gpu_status(sim)["memory_peak"] == 0, "no GPU memory was touched"


def test_missing_config(sim, shell_bin):
    c = sim.container(1024)
    c.env["VCUDA_CONFIG"] = str(c.dir / "nope.toml")
    replies, lines, err = attempt(c, shell_bin)
    assert_refused(sim, replies, lines, err, c.dir / "nope.toml", "cannot read")


@pytest.mark.parametrize(
    "text,line,what",
    [
        ("version = 1\nregion = [\n", 3, "garbled TOML"),
        ('version = 1\nregion = "/tmp/r"\n[[gpu]]\nuuid = "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401"\n'
         'memory_mib = "lots"\n', 5, "a quota that is not a number"),
        ('version = 1\nregion = "/tmp/r"\n[[gpu]]\nuuid = "GPU-nonsense"\nmemory_mib = 10\n', 3, "a malformed UUID"),
    ],
    ids=["garbled", "bad-type", "bad-uuid"],
)
def test_malformed_config(sim, shell_bin, text, line, what):
    c = sim.container(1024)
    c.config.write_text(text)
    replies, lines, err = attempt(c, shell_bin)
    assert_refused(sim, replies, lines, err, f"vcuda: config {c.config}: line ")
    assert lines[0].startswith(f"vcuda: config {c.config}: line {line}: "), (what, lines[0])


def test_gpu_missing_from_the_machine(sim, shell_bin):
    """A config naming a GPU UUID the machine does not have: the driver shows no GPU to the
    container (libvcuda sets CUDA_VISIBLE_DEVICES to that UUID, which names nothing), so
    there is no GPU access. The sane outcome: cuInit fails, nothing runs on any GPU, and one
    line starting "vcuda:" says which GPU of which config is missing."""
    missing = "GPU-deadbeef-0000-4000-8000-000000000000"
    c = sim.container(1024, gpus=[missing])
    replies, lines, err = attempt(c, shell_bin)
    assert replies[0] != 0 and replies[1] != 0 and replies[2] != 0, replies
    st = sim.status()
    assert all(g["processes"] == [] and g["memory_peak"] == 0 for g in st["gpus"])
    assert len(lines) == 1, f"exactly one vcuda: line expected, got:\n{err}"
    assert str(c.config) in lines[0] and missing.lower() in lines[0].lower(), lines[0]


def test_region_of_other_gpus_in_use_then_taken_over(sim, shell_bin):
    """A region file made for other GPUs: refused while a live process still counts in it,
    and simply taken over (re-initialised) once nobody uses it any more."""
    uuids = [g["uuid"] for g in sim.status()["gpus"]]
    a = sim.container(1024, gpus=[uuids[0]], name="a")
    b = sim.container(1024, gpus=[uuids[1]], name="b")
    b.config.write_text(b.config.read_text().replace(str(b.region), str(a.region)))
    holder = Shell(a, shell_bin, "holder").start()
    try:
        holder.ok(f"alloc {64 * MiB}")
        replies, lines, err = attempt(b, shell_bin)
        assert replies[:4] == [CUDA_ERROR_NOT_PERMITTED] * 4, replies
        assert len(lines) == 1, err
        assert str(a.region) in lines[0] and "live process" in lines[0], lines[0]
    finally:
        holder.close()
    # nobody uses it now: b takes it over and has its whole quota on GPU 1
    sh = Shell(b, shell_bin, "b").start()
    try:
        sh.ok(f"alloc {1024 * MiB - CONTEXT - MiB}")
        assert [s["pid"] for s in region_slots(a.region)] == [sh.pid]
        assert gpu_status(sim, 1)["memory_used"] == 1024 * MiB
    finally:
        sh.close()


def test_garbage_region_file(sim, shell_bin):
    c = sim.container(1024)
    c.region.write_bytes(b"not a region")
    replies, lines, err = attempt(c, shell_bin)
    assert_refused(sim, replies, lines, err, c.region)


@pytest.mark.skipif(os.path.exists("/etc/vcuda/vcuda.toml"), reason="this machine has a real /etc/vcuda/vcuda.toml")
def test_scrubbed_environment_falls_back_to_etc(sim, shell_bin):
    """env -i: VCUDA_CONFIG is gone, so the library reads /etc/vcuda/vcuda.toml (a test
    cannot write /etc; here it does not exist, and the refusal names it)."""
    env = {"LD_PRELOAD": str(VCUDA_LIB), "LD_LIBRARY_PATH": str(LIB), "GPUSIM_STATE": str(sim.state)}
    replies, lines, err = attempt(sim, shell_bin, env=env)
    assert_refused(sim, replies, lines, err, "/etc/vcuda/vcuda.toml")
    # without the library, the same scrubbed program would have run unlimited
    del env["LD_PRELOAD"]
    replies, _, _ = attempt(sim, shell_bin, env=env)
    assert replies[:3] == [0, 0, 0]


def test_a_process_that_never_uses_cuda_notices_nothing(sim, tmp_path):
    """Fail closed applies to GPU use only: a program without CUDA calls runs normally even
    when the config is missing, and prints nothing."""
    c = sim.container(1024)
    c.env["VCUDA_CONFIG"] = str(tmp_path / "nope.toml")
    p = c.run(["sh", "-c", "echo hello"])
    assert p.stdout == "hello\n" and p.stderr == ""
