"""CUDA_VISIBLE_DEVICES: gpusim's libcuda reads it at cuInit, as the real driver does, and
numbers the GPUs it lists 0, 1, … in the order listed; NVML ignores it. Judged by a C
program built against the official cuda.h, by `gpusim status --json` and by pynvml."""

import json
import subprocess

import pytest

from gpusim_harness import HERE, LIB

C = HERE / "c"

# Three GPUs told apart by name, memory and bus id. UUIDs of GPUs 0 and 1 share the prefix
# "GPU-aaaa"; GPU 2's is the only one starting "GPU-b".
GPUS = [
    ("Sim GPU Zero", "GPU-aaaa1111-0000-4000-8000-000000000000", 2048, "00000000:3B:00.0"),
    ("Sim GPU One", "GPU-aaaa2222-0000-4000-8000-000000000001", 4096, "00000000:5E:00.0"),
    ("Sim GPU Two", "GPU-bbbb3333-0000-4000-8000-000000000002", 8192, "00000000:AF:00.0"),
]
CONFIG = "context_overhead_mib = 100\n" + "".join(
    f"""
[[gpu]]
name = "{name}"
uuid = "{uuid}"
memory_mib = {mib}
sm_count = 40
max_threads_per_sm = 2048
compute_capability = "8.6"
pci_bus_id = "{bus}"
"""
    for name, uuid, mib, bus in GPUS
)

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101


@pytest.fixture(scope="module")
def prog(cc, tmp_path_factory):
    out = tmp_path_factory.mktemp("bin")
    return cc(C / "cuda_visible.c", out / "cuda_visible", "-L", str(LIB), "-lcuda")


@pytest.fixture
def sim3(sim):
    sim.write_config(CONFIG)
    return sim


def kv(text):
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def see(sim, prog, visible, *args):
    """Run the program with CUDA_VISIBLE_DEVICES=`visible` (None: unset); its key=value lines."""
    if visible is None:
        sim.env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        sim.env["CUDA_VISIBLE_DEVICES"] = visible
    return kv(sim.run([prog, *args]).stdout)


def seen_gpus(r):
    """The config indices of the GPUs the program saw, by ordinal (identified by UUID)."""
    assert int(r["init"]) == CUDA_SUCCESS, r
    uuids = [g[1].lower() for g in GPUS]
    return [uuids.index(r[f"dev{i}_uuid"].lower()) for i in range(int(r["count"]))]


def test_unset_shows_every_gpu_in_config_order(sim3, prog):
    r = see(sim3, prog, None)
    assert seen_gpus(r) == [0, 1, 2]
    assert int(r["past_end"]) == CUDA_ERROR_INVALID_DEVICE


def test_indices_pick_and_renumber_gpus(sim3, prog):
    r = see(sim3, prog, "2,0")
    assert int(r["count"]) == 2
    assert int(r["past_end"]) == CUDA_ERROR_INVALID_DEVICE
    for ordinal, real in ((0, 2), (1, 0)):
        name, uuid, mib, bus = GPUS[real]
        assert r[f"dev{ordinal}_name"] == name
        assert r[f"dev{ordinal}_uuid"].lower() == uuid.lower()
        assert r[f"dev{ordinal}_bus"] == bus
        assert int(r[f"dev{ordinal}_total"]) == mib << 20
    # the ground truth still describes all three GPUs in config order
    assert [g["uuid"] for g in sim3.status()["gpus"]] == [g[1] for g in GPUS]


@pytest.mark.parametrize("visible,ordinal,real", [("2,0", 0, 2), ("2,0", 1, 0), (" 1 , 2 ", 1, 2)])
def test_a_context_on_an_ordinal_uses_the_gpu_it_names(sim3, prog, visible, ordinal, real):
    sim3.env["CUDA_VISIBLE_DEVICES"] = visible
    p = sim3.popen([prog, "--ctx", str(ordinal)], stdin=subprocess.PIPE)
    lines = {}
    while "ready" not in lines:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        k, _, v = line.strip().partition("=")
        lines[k] = v
    try:
        # every device ordinal the driver writes out is the visible one
        assert int(lines["ctx_dev"]) == ordinal
        assert int(lines["stream_dev"]) == ordinal
        assert int(lines["ptr_dev"]) == ordinal
        assert int(lines["ptrs_dev"]) == ordinal
        assert int(lines["vmm_past_end"]) == CUDA_ERROR_INVALID_DEVICE
        st = sim3.status()
        for g in st["gpus"]:
            mine = [q for q in g["processes"] if q["pid"] == p.pid]
            if g["index"] == real:
                # context overhead + cuMemAlloc 64 MiB + cuMemCreate 2 MiB, all on the real GPU
                assert len(mine) == 1, g
                assert mine[0]["memory"] == (100 + 64 + 2) << 20
                assert mine[0]["contexts"] == 1
                assert g["memory_used"] == (100 + 64 + 2) << 20
            else:
                assert mine == [] and g["memory_used"] == 0, g
    finally:
        out, err = p.communicate("\n", timeout=60)
    assert p.returncode == 0, err
    assert "done=1" in out
    assert all(g["memory_used"] == 0 for g in sim3.status()["gpus"])


def test_bus_id_of_a_hidden_gpu_is_an_invalid_device(sim3, prog):
    r = see(sim3, prog, "2,0", "--bus", GPUS[1][3])
    assert int(r["bus_rc"]) == CUDA_ERROR_INVALID_DEVICE
    r = see(sim3, prog, "2,0", "--bus", GPUS[0][3])
    assert int(r["bus_rc"]) == CUDA_SUCCESS and int(r["bus_dev"]) == 1
    r = see(sim3, prog, "2,0", "--bus", "0000:af:00.0")
    assert int(r["bus_rc"]) == CUDA_SUCCESS and int(r["bus_dev"]) == 0


@pytest.mark.parametrize(
    "visible,expected",
    [
        (GPUS[1][1], [1]),  # a full UUID
        (GPUS[1][1].upper().replace("GPU-", "gpu-"), [1]),  # case does not matter
        ("GPU-b", [2]),  # a unique prefix
        ("GPU-aaaa2", [1]),
        (f"GPU-bbbb3333, 0 ,{GPUS[1][1]}", [2, 0, 1]),  # mixed with indices
        ("0,GPU-aaaa,2", [0]),  # an ambiguous prefix is invalid: stop there
        ("2,GPU-c,1", [2]),  # so is an unknown UUID
        ("1,junk,2", [1]),  # parsing stops at the first invalid entry
        ("0,3,1", [0]),  # an index out of range is invalid
        ("1,1,2", [1]),  # so is a duplicate
        (f"2,{GPUS[2][1]}", [2]),  # also when named two ways
    ],
)
def test_entries(sim3, prog, visible, expected):
    assert seen_gpus(see(sim3, prog, visible)) == expected


@pytest.mark.parametrize("visible", ["", " ", "junk,0", "3", "GPU-aaaa", "GPU-", "-1"])
def test_no_visible_gpu_is_no_device(sim3, prog, visible):
    r = see(sim3, prog, visible)
    assert int(r["init"]) == CUDA_ERROR_NO_DEVICE
    # the driver did not initialise, and took no process slot
    assert int(r["count_rc"]) == CUDA_ERROR_NOT_INITIALIZED
    assert all(g["processes"] == [] for g in sim3.status()["gpus"])


def test_nvml_ignores_cuda_visible_devices(sim3, prog):
    sim3.env["CUDA_VISIBLE_DEVICES"] = "1"
    code = """
import json, pynvml as N
N.nvmlInit()
n = N.nvmlDeviceGetCount()
uuids = [N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
print(json.dumps([u.decode() if isinstance(u, bytes) else u for u in uuids]))
"""
    assert json.loads(sim3.python(code).stdout.strip().splitlines()[-1]) == [g[1] for g in GPUS]
    sim3.env["CUDA_VISIBLE_DEVICES"] = ""
    assert json.loads(sim3.python(code).stdout.strip().splitlines()[-1]) == [g[1] for g in GPUS]
