"""Real NVML clients against gpusim: nvitop, gpustat, and a C program built with the official
nvml.h. They must run to completion and show the GPUs the config describes."""

import json
import pathlib
import re
import sys

from gpusim_harness import LIB

HERE = pathlib.Path(__file__).resolve().parent

TWO_GPUS = """
[[gpu]]
name = "NVIDIA H100 80GB HBM3"
uuid = "GPU-aaaaaaaa-2222-3333-4444-000000000000"
memory_mib = 81920
sm_count = 132
max_threads_per_sm = 2048
compute_capability = "9.0"
pci_bus_id = "00000000:18:00.0"
power_limit_w = 700

[[gpu]]
name = "NVIDIA A100-PCIE-40GB"
uuid = "GPU-aaaaaaaa-2222-3333-4444-000000000001"
memory_mib = 40960
reserved_mib = 256
sm_count = 108
max_threads_per_sm = 2048
compute_capability = "8.0"
pci_bus_id = "00000000:3B:00.0"
power_limit_w = 250

[[link]]
gpus = [0, 1]
pcie = "node"
"""


def tool_env(sim):
    sim.env.update({"TERM": "xterm-256color", "COLUMNS": "120", "LINES": "50"})


def test_nvml_nvitop_once(sim):
    sim.write_config(TWO_GPUS)
    tool_env(sim)
    for flags in (["--ascii"], ["--colorful"]):
        p = sim.run([venv_bin("nvitop"), "-1", *flags])
        out = p.stdout
        assert "H100 80GB HBM3" in out, out
        assert "A100-PCIE-40GB" in out, out
        assert "80.00GiB" in out and "40.00GiB" in out, out
        assert "00000000:18:00.0" in out and "00000000:3B:00.0" in out, out
        assert "575.57.08" in out, out
        assert "No running processes found" in out, out
        # nvitop logs any NVML function it needs and cannot find
        assert "FunctionNotFound" not in p.stderr and "ERROR" not in p.stderr, p.stderr


def test_nvml_gpustat(sim):
    sim.write_config(TWO_GPUS)
    tool_env(sim)
    p = sim.run([venv_bin("gpustat"), "--json"])
    r = json.loads(p.stdout)
    assert r["driver_version"] == "575.57.08"
    gpus = r["gpus"]
    assert [g["index"] for g in gpus] == [0, 1]
    assert [g["name"] for g in gpus] == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-PCIE-40GB"]
    assert [g["uuid"] for g in gpus] == [s["uuid"] for s in sim.status()["gpus"]]
    assert [g["memory.total"] for g in gpus] == [81920, 40960]
    # gpustat reads memory info v2, which leaves the driver's reserve out of `used`
    assert [g["memory.used"] for g in gpus] == [0, 0]
    assert [g["utilization.gpu"] for g in gpus] == [0, 0]
    assert [g["enforced.power.limit"] for g in gpus] == [700, 250]
    assert all(g["processes"] == [] for g in gpus)

    plain = sim.run([venv_bin("gpustat"), "--no-color"]).stdout
    assert re.search(r"\[0\] NVIDIA H100 80GB HBM3 .* 0 / 81920 MB", plain), plain
    assert re.search(r"\[1\] NVIDIA A100-PCIE-40GB .* 0 / 40960 MB", plain), plain


def test_nvml_c_program(sim, cc, tmp_path):
    exe = cc(HERE / "c" / "nvml_basic.c", tmp_path / "nvml_basic", "-L", LIB, "-lnvidia-ml")
    sim.write_config(TWO_GPUS)
    out = sim.run([exe]).stdout
    lines = out.splitlines()
    assert lines[0] == "driver 575.57.08"
    assert lines[1] == "count 2"
    mib = 1 << 20
    assert lines[2] == (
        f"gpu 0 name=NVIDIA H100 80GB HBM3 total={81920 * mib} reserved=0 free={81920 * mib} used=0 "
        "version=0x2000028 processes=0 util=0/0"
    )
    assert lines[3] == (
        f"gpu 1 name=NVIDIA A100-PCIE-40GB total={40960 * mib} reserved={256 * mib} "
        f"free={(40960 - 256) * mib} used=0 version=0x2000028 processes=0 util=0/0"
    )
    assert lines[4] == "bad_version 25"  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert lines[5] == "after_shutdown 1"  # NVML_ERROR_UNINITIALIZED


def venv_bin(name):
    """A console script installed next to the Python running the tests (.venv/bin)."""
    return pathlib.Path(sys.executable).parent / name
