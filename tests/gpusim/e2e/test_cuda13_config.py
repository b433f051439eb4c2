"""The documented CUDA 13 config (tests/gpusim/README.md, "CUDA 13"):
`gpusim default-config --cuda-version 13050` is the built-in machine as a CUDA 13.5 driver,
and every version a program can ask for agrees with it: cuDriverGetVersion, NVML's CUDA
driver version (v1 and v2), NVML's driver version (a CUDA 13 branch, R580 or later) and NVML
version ("13.<driver>", NVML API 13). The CUDA 13.5 runtime runs on it."""

import json
import pathlib
import re
import textwrap

import pytest

from gpusim_harness import C_COMMON, GPUSIM, cudart_lib_dir

VERSIONS = textwrap.dedent(
    """
    import ctypes, json, pynvml as N
    cuda = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int(0)
    assert cuda.cuInit(0) == 0
    assert cuda.cuDriverGetVersion(ctypes.byref(v)) == 0
    N.nvmlInit()
    print(json.dumps(dict(
        cu_driver=v.value,
        nvml_cuda=N.nvmlSystemGetCudaDriverVersion(),
        nvml_cuda_v2=N.nvmlSystemGetCudaDriverVersion_v2(),
        driver=N.nvmlSystemGetDriverVersion(),
        nvml=N.nvmlSystemGetNVMLVersion(),
    )))
    """
)


def versions(sim):
    return json.loads(sim.python(VERSIONS).stdout.strip().splitlines()[-1])


def default_config(sim, *args):
    return sim.run([GPUSIM, "default-config", *args]).stdout


def test_cuda_version_flag_changes_only_the_versions(sim):
    base = default_config(sim)
    v13 = default_config(sim, "--cuda-version", "13050")
    assert default_config(sim, "--cuda-version", "12090") == base
    assert "\ncuda_version = 13050\n" in v13
    changed = [(a, b) for a, b in zip(base.splitlines(), v13.splitlines()) if a != b]
    assert len(base.splitlines()) == len(v13.splitlines())
    assert [a.split("=")[0].strip() for a, _ in changed] == ["cuda_version", "# driver_version"], changed
    assert '# driver_version = "580.65.06"' in v13


@pytest.mark.parametrize("bad", ["13055", "999", "thirteen"])
def test_cuda_version_flag_rejects_what_is_no_version(sim, bad):
    p = sim.run([GPUSIM, "default-config", "--cuda-version", bad], check=False)
    assert p.returncode != 0 and p.stdout == ""
    msg = p.stderr.strip()
    assert "--cuda-version" in msg, msg
    if bad != "thirteen":
        assert "1000*major + 10*minor" in msg and "13050 for CUDA 13.5" in msg, msg


def test_versions_agree_on_the_cuda13_config(sim):
    sim.write_config(default_config(sim, "--cuda-version", "13050"))
    v = versions(sim)
    assert v["cu_driver"] == v["nvml_cuda"] == v["nvml_cuda_v2"] == 13050
    # a CUDA 13 driver is branch 580 or later (NVIDIA's minor-version compatibility table)
    assert v["driver"] == "580.65.06"
    assert int(v["driver"].split(".")[0]) >= 580
    # NVML's version is its API major (13 with a CUDA 13 driver) and the driver version
    assert v["nvml"] == "13.580.65.06"


def test_versions_agree_on_the_default_config(sim):
    v = versions(sim)
    assert v["cu_driver"] == v["nvml_cuda"] == v["nvml_cuda_v2"] == 12090
    assert v["driver"] == "575.57.08" and v["nvml"] == "12.575.57.08"
    assert 525 <= int(v["driver"].split(".")[0]) < 580


def test_explicit_driver_version_is_kept(sim):
    text = default_config(sim, "--cuda-version", "13010")
    sim.write_config('driver_version = "590.44.01"\n' + text)
    v = versions(sim)
    assert (v["cu_driver"], v["driver"], v["nvml"]) == (13010, "590.44.01", "13.590.44.01")


def test_cuda13_runtime_runs_on_the_documented_config(sim, cc, tmp_path):
    """What the README tells a user to do, done: the CUDA 13.5 runtime initialises, allocates,
    copies and frees. With the default (12.9) config it refuses the driver instead
    (cudaErrorInsufficientDriver, 35)."""
    lib = cudart_lib_dir(13)
    probe = cc(C_COMMON / "cudart_basic.c", tmp_path / "cudart_basic13", f"-L{lib}", "-l:libcudart.so.13",
               f"-Wl,-rpath,{lib}")
    refused = sim.run([probe, "64"]).stdout
    assert re.search(r"^cudaGetDeviceCount\s+35\b", refused, re.M), refused
    sim.state.unlink(missing_ok=True)  # the state remembers its config: start a new machine
    sim.write_config(default_config(sim, "--cuda-version", "13050"))
    out = sim.run([probe, "64"]).stdout
    print(out)
    assert re.search(r"^cudaDriverGetVersion\s+0\s+\S+\s+13050$", out, re.M), out
    assert re.search(r"^cudaGetDeviceCount\s+0\s+\S+\s+2$", out, re.M), out
    assert re.search(r"^cudaMemcpy DtoH\s+0\s+\S+\s+roundtrip: yes$", out, re.M), out
    assert re.search(r"^cudaMalloc\(big\)\s+0\b", out, re.M), out
