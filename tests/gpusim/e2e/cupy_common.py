"""What the CuPy tests share (tests/gpusim/e2e/test_cupy.py bare on gpusim,
tests/vcuda/test_vcuda_cupy.py under libvcuda): the CuPy process they step through
allocations (cupy_shell.py) and the environment CuPy runs in.

CuPy comes from the cupy-cuda12x wheel (tests/requirements.txt). Its CUDA runtime is linked
into the wheel (cupy_backends/cuda/api/runtime*.so), so nothing but gpusim's libcuda.so.1 on
LD_LIBRARY_PATH is needed for it; NVRTC (libnvrtc.so.12) is found in site-packages
(nvidia/cuda_nvrtc/lib) by cuda-pathfinder. No system CUDA install is used or needed.
"""

import pathlib
import subprocess
import sys

from gpusim_harness import LineProcess

HERE = pathlib.Path(__file__).resolve().parent
SHELL = HERE / "cupy_shell.py"
MiB = 1 << 20


def check_installed():
    """CuPy and its NVRTC are installed by scripts/setup-test-deps; say so if they are not."""
    try:
        import cupy  # noqa: F401
        import nvidia.cuda_nvrtc  # type: ignore # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"CuPy or its NVRTC wheel is missing ({e}): run scripts/setup-test-deps") from e


def cupy_env(env):
    """Set up `env` (a Sim's or a Container's) for CuPy: kernels compiled by NVRTC in each
    process and kept in memory only (nothing in ~/.cupy), no CUDA_PATH from the caller."""
    env["CUPY_CACHE_IN_MEMORY"] = "1"
    env.pop("CUDA_PATH", None)
    env.pop("CUPY_CACHE_DIR", None)
    return env


class CupyShell(LineProcess):
    """A running cupy_shell.py: `do("alloc 4096")` sends one command and returns its reply as
    a dict of ints ({"rc": 0, "id": 3}); CuPy's OutOfMemoryError is {"rc": 2, "oom": 1}."""

    def __init__(self, env_owner, name="cupy"):
        super().__init__(env_owner, [sys.executable, SHELL], name)

    def ok(self, cmd):
        r = self.do(cmd)
        if r["rc"] != 0:
            raise AssertionError(f"{self.name}: {cmd!r} -> {r}\n{self.stop()}")
        return r

    def stop(self):
        """End the process (stdin closed) and return its stderr: what failed, and why."""
        try:
            self.p.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        return self.p.stderr.read()

    def close(self):
        """Quit and return the process's stderr."""
        if self.p.poll() is None:
            try:
                self.p.stdin.write("quit\n")
                self.p.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        err = self.p.stderr.read()
        assert self.p.returncode == 0, f"{self.name} exited {self.p.returncode}\n{err}"
        return err
