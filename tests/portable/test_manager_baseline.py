"""vcuda-manager refuses to start with a libvcuda.so that old images cannot load (issue 13):
every container preloads the library it mounts (--library), so one that requires a newer
glibc than the baseline (--library-baseline, default 2.17) would make every process of every
pod given it fail to start. The manager checks it before it serves or registers anything.

Run against the release manager (target/release, scripts/build-gpusim), the host build of
the library (target/release/libvcuda.so, which needs this host's glibc: refused) and the
portable build (target/portable/libvcuda.so, scripts/build-portable: accepted). The refusal
is cross-checked against test_glibc_baseline.py's readelf reading of the same file.
"""

import os
import pathlib
import re
import select
import socket
import subprocess
import time

import pytest

from test_glibc_baseline import ALLOWED, BASELINE, glibc_version, needed, versions

ROOT = pathlib.Path(__file__).resolve().parents[2]
RELEASE = ROOT / "target" / "release"
MANAGER = pathlib.Path(os.environ.get("VCUDA_MANAGER_BIN", RELEASE / "vcuda-manager"))
HOST_LIB = RELEASE / "libvcuda.so"
PORTABLE_LIB = ROOT / "target" / "portable" / "libvcuda.so"
GPUSIM_LIB = ROOT / "target" / "gpusim" / "lib"


def require(path, how):
    if not path.exists():
        pytest.fail(f"{path} is missing: run {how} (scripts/test does)")


class Kubelet:
    """A kubelet.sock that only counts who dials it: a manager that registers connects."""

    def __init__(self, plugin_dir):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(plugin_dir / "kubelet.sock"))
        self.sock.listen(16)
        self.sock.setblocking(False)

    def dialled(self):
        """How many connections wait (the manager's, even if it has exited since)."""
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def close(self):
        self.sock.close()


class Manager:
    """vcuda-manager on a scratch node (gpusim's NVML, no API server), its log on a pipe."""

    def __init__(self, tmp, library, *extra):
        require(MANAGER, "scripts/build-gpusim")
        require(GPUSIM_LIB / "libnvidia-ml.so.1", "scripts/build-gpusim")
        self.tmp = tmp
        self.plugin_dir = tmp / "device-plugins"
        self.plugin_dir.mkdir()
        self.kubelet = Kubelet(self.plugin_dir)
        env = dict(os.environ)
        # What the DaemonSet runs with: no backtrace under the one-line error.
        env.pop("RUST_BACKTRACE", None)
        env.pop("RUST_LIB_BACKTRACE", None)
        env.pop("GPUSIM_CONFIG", None)
        env.pop("KUBECONFIG", None)
        env["GPUSIM_STATE"] = str(tmp / "gpusim.state")
        env["LD_LIBRARY_PATH"] = f"{GPUSIM_LIB}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [MANAGER, "--device-plugin-dir", self.plugin_dir,
             "--pod-resources-socket", tmp / "pod-resources" / "kubelet.sock",
             "--state-dir", tmp / "state", "--run-dir", tmp / "run",
             "--nvml-library", GPUSIM_LIB / "libnvidia-ml.so.1",
             "--api", "off", "--metrics-address", "off", "--log", "info",
             "--library", library, *extra],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.lines, self.partial, self.next = [], b"", 0

    def line_with(self, needle, timeout=30):
        """Reads the log until a line after the last one found contains `needle`; returns
        it (fails if the manager exits first, or after `timeout` seconds)."""
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + timeout
        while True:
            for i in range(self.next, len(self.lines)):
                if needle in self.lines[i]:
                    self.next = i + 1
                    return self.lines[i]
            self.next = len(self.lines)
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {needle!r} in the manager's log within {timeout} s:\n" + "\n".join(self.lines))
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                pytest.fail(f"vcuda-manager exited ({self.proc.wait()}) before logging {needle!r}:\n" + "\n".join(self.lines))
            *done, self.partial = (self.partial + chunk).split(b"\n")
            self.lines += [d.decode(errors="replace") for d in done]

    def exit(self, timeout=10):
        """Waits for the manager to exit by itself: (status, seconds since start, stderr)."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vcuda-manager is still running {timeout} s after its start: it accepted the library")
        return self.proc.returncode, time.monotonic() - self.started, err.decode(errors="replace")

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.kubelet.close()


@pytest.fixture
def start(tmp_path):
    started = []

    def start(library, *extra):
        m = Manager(tmp_path, library, *extra)
        started.append(m)
        return m

    yield start
    for m in started:
        m.close()


def test_a_library_that_old_images_cannot_load_stops_the_manager_before_it_registers(start, tmp_path):
    require(HOST_LIB, "scripts/build-gpusim")
    m = start(HOST_LIB)
    status, seconds, err = m.exit()
    assert status != 0, err
    assert seconds < 5, f"took {seconds:.1f} s to refuse"
    # One line, naming the library, what it requires and the fix.
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    msg = lines[0]
    assert msg.startswith(f"Error: refusing to start: the library {HOST_LIB} (--library) cannot load in containers whose glibc is 2.17"), msg
    assert re.search(r"\bGLIBC_2\.3\d\b", msg), msg
    assert "Build it with scripts/build-portable and point --library at that build (target/portable/libvcuda.so)" in msg, msg
    # It names exactly what readelf finds beyond the baseline (test_glibc_baseline's rule).
    newer = {v for _, v in versions(HOST_LIB) if glibc_version(v) and glibc_version(v) > BASELINE}
    named = set(re.findall(r"GLIBC_[\d.]*\d", msg.split(" and needs ")[0].split("requires ", 1)[1]))
    assert named == newer, (named, newer)
    for obj in needed(HOST_LIB) - ALLOWED:
        assert obj in msg, (obj, msg)
    # Nothing served, dialled or written.
    assert m.kubelet.dialled() == 0
    assert [p.name for p in m.plugin_dir.iterdir()] == ["kubelet.sock"]
    assert not (tmp_path / "state").exists() and not (tmp_path / "run").exists()


def test_the_portable_build_gets_past_the_check(start):
    require(PORTABLE_LIB, "scripts/build-portable")
    m = start(PORTABLE_LIB)
    line = m.line_with("meets the glibc 2.17 baseline")
    found = re.search(rf"library {re.escape(str(PORTABLE_LIB))} meets the glibc 2\.17 baseline \(needs at most (GLIBC_\S+)\)", line)
    assert found, line
    assert glibc_version(found.group(1)) <= BASELINE, line
    # ... and goes on: NVML (gpusim's GPUs), then serving and registering.
    m.line_with("found GPUs")
    assert m.proc.poll() is None, m.lines


def test_off_lets_an_operator_accept_any_library_knowingly(start):
    require(HOST_LIB, "scripts/build-gpusim")
    m = start(HOST_LIB, "--library-baseline", "off")
    line = m.line_with("--library-baseline off")
    assert f"the library {HOST_LIB} is not checked against a glibc baseline" in line, line
    m.line_with("found GPUs")
    assert m.proc.poll() is None, m.lines


def test_a_newer_baseline_still_refuses_what_is_not_glibcs_own(start):
    """A baseline newer than any glibc covers the host build's symbol versions, not its
    libgcc_s.so.1, which images may lack whatever their glibc."""
    require(HOST_LIB, "scripts/build-gpusim")
    extra = needed(HOST_LIB) - ALLOWED
    if not extra:
        pytest.fail(f"{HOST_LIB} needs only glibc's objects: the test's premise (Rust's libgcc_s) is gone")
    status, _, err = start(HOST_LIB, "--library-baseline", "99.0").exit()
    assert status != 0, err
    assert "GLIBC_" not in err.split("(the baseline, --library-baseline)")[1], err
    assert all(obj in err for obj in extra), err
