"""Shared fixtures for gpusim's end-to-end tests.

Every test gets its own state file (and, if it asks, its own config) in a temporary
directory, so tests never see each other's GPUs. Programs run with LD_LIBRARY_PATH pointing
at target/gpusim/lib, which `scripts/build-gpusim` fills.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
LIB = ROOT / "target" / "gpusim" / "lib"
BIN = ROOT / "target" / "gpusim" / "bin"
GPUSIM = BIN / "gpusim"
# The library as shipped: built for the glibc 2.17 baseline by scripts/build-portable (the
# manager refuses to mount anything else). VCUDA_LIB runs another build (e.g. a before/after).
VCUDA_LIB = pathlib.Path(os.environ.get("VCUDA_LIB", ROOT / "target" / "portable" / "libvcuda.so"))
HERE = pathlib.Path(__file__).resolve().parent
# The C programs' shared header (common.h) and gpusim's own programs.
C_COMMON = HERE / "c"


def cuda_include_dir():
    """cuda.h from the nvidia-cuda-runtime-cu12 wheel installed by scripts/setup-test-deps."""
    import nvidia.cuda_runtime  # type: ignore

    for base in nvidia.cuda_runtime.__path__:
        inc = pathlib.Path(base) / "include"
        if (inc / "cuda.h").exists():
            return inc
    raise RuntimeError("cuda.h not found in the nvidia-cuda-runtime-cu12 wheel; run scripts/setup-test-deps")


def cudart_lib_dir(major):
    """The CUDA runtime's library directory: libcudart.so.12 from nvidia-cuda-runtime-cu12
    (nvidia/cuda_runtime/lib), libcudart.so.13 from the 13.x wheel (nvidia/cu13/lib)."""
    import nvidia  # type: ignore

    sub, name = (("cuda_runtime", "lib"), "libcudart.so.12") if major == 12 else (("cu13", "lib"), "libcudart.so.13")
    for base in nvidia.__path__:
        lib = pathlib.Path(base).joinpath(*sub)
        if (lib / name).exists():
            return lib
    raise RuntimeError(f"{name} not found under nvidia/{'/'.join(sub)}; run scripts/setup-test-deps")


def nvml_include_dir():
    import nvidia.nvml_dev  # type: ignore

    for base in nvidia.nvml_dev.__path__:
        inc = pathlib.Path(base) / "include"
        if (inc / "nvml.h").exists():
            return inc
    raise RuntimeError("nvml.h not found in the nvidia-nvml-dev-cu12 wheel; run scripts/setup-test-deps")


@pytest.fixture(scope="session", autouse=True)
def gpusim_built():
    for f in (LIB / "libcuda.so.1", LIB / "libnvidia-ml.so.1", GPUSIM, VCUDA_LIB):
        if not f.exists():
            pytest.exit(f"{f} is missing: run scripts/build-gpusim and scripts/build-portable first (scripts/test does)", returncode=2)


class Sim:
    """One isolated simulated machine: a state file, an optional config, an environment."""

    def __init__(self, tmp: pathlib.Path):
        self.dir = tmp
        self.state = tmp / "gpusim.state"
        self.config = None
        self.env = dict(os.environ)
        self.env.update(
            {
                "LD_LIBRARY_PATH": f"{LIB}:{self.env.get('LD_LIBRARY_PATH', '')}".rstrip(":"),
                "GPUSIM_STATE": str(self.state),
                "PATH": f"{BIN}:{self.env.get('PATH', '')}",
            }
        )
        self.env.pop("GPUSIM_CONFIG", None)
        # gpusim's libcuda honours it; tests that want it set it themselves.
        self.env.pop("CUDA_VISIBLE_DEVICES", None)

    def configure_cuda(self, version: int) -> pathlib.Path:
        """gpusim as a driver of CUDA `version` (e.g. 13050): the documented way
        (tests/gpusim/README.md, "CUDA 13"), before any process creates the state."""
        return self.write_config(self.run([GPUSIM, "default-config", "--cuda-version", version]).stdout)

    def write_config(self, text: str) -> pathlib.Path:
        """Use `text` as the GPU description (before any process creates the state)."""
        self.config = self.dir / "gpusim.toml"
        self.config.write_text(text)
        self.env["GPUSIM_CONFIG"] = str(self.config)
        return self.config

    def run(self, args, check=True, timeout=120, **kw):
        p = subprocess.run(
            [str(a) for a in args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and p.returncode != 0:
            raise AssertionError(
                f"{args} exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
            )
        return p

    def popen(self, args, **kw):
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        return subprocess.Popen([str(a) for a in args], env=self.env, **kw)

    def python(self, code, *args, **kw):
        return self.run([sys.executable, "-c", code, *args], **kw)

    def container(self, quotas_mib, gpus=None, name="c0", core=100, preload=True, core_limit=None):
        """A vcuda container on these GPUs: writes its config (and names its region) and
        returns an environment running programs inside it (libvcuda preloaded).

        quotas_mib: one quota per GPU; gpus: their UUIDs (default: the first GPUs of the
        current gpusim config, in order)."""
        if isinstance(quotas_mib, int):
            quotas_mib = [quotas_mib]
        if gpus is None:
            gpus = [g["uuid"] for g in self.status()["gpus"]][: len(quotas_mib)]
        d = self.dir / name
        d.mkdir(exist_ok=True)
        lines = ["version = 1", f'region = "{d / "region"}"', ""]
        for uuid, q in zip(gpus, quotas_mib):
            lines += ["[[gpu]]", f'uuid = "{uuid}"', f"memory_mib = {q}", f"core = {core}"]
            lines += [f"core_limit = {core_limit}", ""] if core_limit else [""]
        (d / "vcuda.toml").write_text("\n".join(lines))
        env = dict(self.env)
        env["VCUDA_CONFIG"] = str(d / "vcuda.toml")
        if preload:
            env["LD_PRELOAD"] = str(VCUDA_LIB)
        return Container(self, d, env)

    def status(self):
        """`gpusim status --json`, parsed: the ground truth."""
        return json.loads(self.run([GPUSIM, "status", "--json"]).stdout)

    def gpusim(self, *args, **kw):
        return self.run([GPUSIM, *args], **kw)


class LineProcess:
    """A process driven one command per line (the C shells, the CuPy shell): `do(cmd)` writes
    the line and returns the one-line reply's `key=value` fields, as ints except the keys in
    `TEXT`."""

    TEXT = ()

    def __init__(self, env_owner, argv, name):
        self.name = name
        self.p = env_owner.popen(argv, stdin=subprocess.PIPE)
        self.pid = self.p.pid

    def do(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            self.p.wait(timeout=10)
            raise AssertionError(f"{self.name}: no reply to {cmd!r}; exit {self.p.returncode}\n{self.p.stderr.read()}")
        return {k: v if k in self.TEXT else int(v) for k, v in (f.split("=", 1) for f in line.split())}

    def rc(self, cmd):
        return self.do(cmd)["rc"]


class Container:
    """Programs run with a container's environment (see Sim.container)."""

    def __init__(self, sim, directory, env):
        self.sim = sim
        self.dir = directory
        self.env = env
        self.config = directory / "vcuda.toml"
        self.region = directory / "region"

    def run(self, args, check=True, timeout=120, **kw):
        p = subprocess.run([str(a) for a in args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"{args} exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
        return p

    def popen(self, args, **kw):
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        return subprocess.Popen([str(a) for a in args], env=self.env, **kw)

    def python(self, code, *args, **kw):
        return self.run([sys.executable, "-c", code, *args], **kw)


@pytest.fixture
def sim(tmp_path):
    return Sim(tmp_path)


@pytest.fixture(scope="session")
def cc():
    """Compile a C file against the official headers; returns a function(src, out, *extra)."""
    if shutil.which("gcc") is None:
        pytest.exit("gcc is required for the C tests", returncode=2)

    def build(src, out, *extra):
        cmd = [
            "gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-deprecated-declarations", "-O1", "-g",
            f"-I{cuda_include_dir()}", f"-I{nvml_include_dir()}", f"-I{C_COMMON}",
            str(src), "-o", str(out), *extra,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}\n{p.stderr}")
        return out

    return build
