"""The CUDA runtime (libcudart 12.9 from the nvidia-cuda-runtime-cu12 wheel) on gpusim: it
initialises through gpusim's export tables (the integrity check among them), then a C
program on the runtime API allocates, sets, copies and frees, bare and under libvcuda with
a quota."""

import pathlib

import pytest

from gpusim_harness import C_COMMON

PROBE = C_COMMON / "cudart_basic.c"


def cudart_lib_dir():
    import nvidia.cuda_runtime  # type: ignore

    for base in nvidia.cuda_runtime.__path__:
        lib = pathlib.Path(base) / "lib"
        if (lib / "libcudart.so.12").exists():
            return lib
    raise RuntimeError("libcudart.so.12 not found in the nvidia-cuda-runtime-cu12 wheel; run scripts/setup-test-deps")


@pytest.fixture(scope="module")
def probe(cc, tmp_path_factory):
    lib = cudart_lib_dir()
    out = tmp_path_factory.mktemp("cudart") / "cudart_basic"
    # Linked against the wheel's libcudart only; cudart dlopens libcuda.so.1 itself, and
    # finds gpusim's first on LD_LIBRARY_PATH.
    return cc(PROBE, out, f"-L{lib}", "-l:libcudart.so.12", f"-Wl,-rpath,{lib}")


def parse(stdout):
    """{call: [(rc, rest), ...]} from the probe's lines."""
    calls = {}
    for line in stdout.splitlines():
        head, rest = line[:22].strip(), line[22:].split(None, 2)
        calls.setdefault(head, []).append((int(rest[0]), rest[2] if len(rest) > 2 else ""))
    return calls


def test_runtime_initialises_and_runs_on_gpusim(sim, probe):
    p = sim.run([probe, "5000"])
    print(p.stdout)
    c = parse(p.stdout)
    assert c["cudaDriverGetVersion"] == [(0, "12090")]
    assert c["cudaGetDeviceCount"] == [(0, "2")], p.stdout
    rc, info = c["cudaMemGetInfo"][0]
    assert rc == 0 and info.endswith("total 40960 MiB"), info
    assert c["cudaMalloc(64 MiB)"][0][0] == 0
    assert c["cudaMemset"] == [(0, "")]
    assert c["cudaMemcpy DtoH"] == [(0, "memset bytes seen: yes"), (0, "roundtrip: yes")]
    assert c["cudaMemcpy HtoD"][0][0] == 0
    assert c["cudaDeviceSynchronize"][0][0] == 0
    assert c["cudaMalloc(big)"][0][0] == 0, "5000 MiB fits on a 40 GiB GPU"
    assert c["cudaFree(big)"][0][0] == 0
    # After cudaDeviceReset (primary context reset: the runtime's storage destructors run)
    # the runtime carries on with a fresh context.
    assert c["cudaDeviceReset"] == [(0, "")]
    assert c["cudaMalloc(64 MiB)"] == [(0, ""), (0, "after the reset")]
    assert [rc for rc, _ in c["cudaFree"]] == [0, 0]


def test_integrity_check_is_exact(sim, probe):
    """One bit off in the driver's answer and cudart refuses the driver."""
    sim.env["GPUSIM_FAULT_INTEGRITY"] = "1"
    p = sim.run([probe])
    c = parse(p.stdout)
    assert c["cudaGetDeviceCount"][0][0] == 103, p.stdout  # cudaErrorSoftwareValidityNotEstablished


def test_integrity_check_hashes_the_visible_devices(sim, probe):
    sim.env["CUDA_VISIBLE_DEVICES"] = "1"
    c = parse(sim.run([probe]).stdout)
    assert c["cudaGetDeviceCount"] == [(0, "1")]
    assert c["cudaFree"][0][0] == 0


def test_unknown_export_table_is_logged(sim, probe):
    """cudart first asks for a table no driver-side description names; gpusim refuses it
    (cudart carries on) and says so when its log is on."""
    sim.env["GPUSIM_LOG"] = "1"
    p = sim.run([probe])
    assert parse(p.stdout)["cudaGetDeviceCount"] == [(0, "2")]
    assert "gpusim: cuGetExportTable: unknown table {f8cff951-2146-8b4e-b9e2-fb469e7c0dd9}" in p.stderr, p.stderr
    del sim.env["GPUSIM_LOG"]
    quiet = sim.run([probe])
    assert "cuGetExportTable" not in quiet.stderr


def test_runtime_under_vcuda_sees_the_quota(sim, probe):
    box = sim.container(4096)
    p = box.run([probe, "5000"])
    print(p.stdout)
    c = parse(p.stdout)
    assert c["cudaGetDeviceCount"][0][0] == 0, p.stdout + p.stderr
    rc, info = c["cudaMemGetInfo"][0]
    assert rc == 0 and info.endswith("total 4096 MiB"), info
    assert c["cudaMemcpy DtoH"] == [(0, "memset bytes seen: yes"), (0, "roundtrip: yes")]
    assert c["cudaMalloc(big)"][0][0] == 2, "past the quota: cudaErrorMemoryAllocation"
    # The failure is not sticky: it is reported once, and the process carries on.
    assert c["cudaGetLastError"] == [(2, "")]
    assert c["cudaMalloc(64 MiB)"] == [(0, ""), (0, "after the failure"), (0, "after the reset")]
    assert [rc for rc, _ in c["cudaFree"]] == [0, 0, 0]
