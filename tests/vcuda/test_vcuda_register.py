"""libvcuda registers each process with the manager (vcuda/lib/src/register.rs), judged by a
scripted fake manager: a Unix socket server, written here, that decodes the library's frames
(vcuda/contract/src/control.rs: u32 LE length, u16 LE protocol version, then a postcard body)
and records every Hello it receives.

What must hold: a process sends one Hello naming the config's allocation and its own region
slot (index, generation, pid, start time — checked against the region file and /proc);
without a manager, or with one that never answers, the application runs exactly as fast as
without a socket configured and exits normally; a manager that starts after the process
still hears from it (retry with back-off); a refusal is logged once and not retried; every
process of a container, and a forked child, registers its own slot.

Waiting is on events (the fake manager's receipt of a Hello, a line on the process's
stderr) with timeouts. Proving that something does *not* happen (no second Hello) needs a
window: it is longer than the library's first retry delay (1 s), during which a retry would
certainly arrive.
"""

import pathlib
import queue
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time

import pytest

from vcuda_common import MAX_PROCS, REGION_HEADER, SLOT_ACTIVE, SLOT_SIZE, build, lay_out_region, region_slots

ALLOCATION = "alloc-e2e.7_x"
PROTOCOL_VERSION = 1
FIRST_RETRY = 1.0  # register.rs FIRST_RETRY
NO_RETRY_WINDOW = 3 * FIRST_RETRY  # a retry would arrive within FIRST_RETRY (+ one IO timeout)
HELLO_TIMEOUT = 15.0
# How much longer a run may take than the same run without a socket configured. Waiting for
# the registration thread (a 1 s back-off sleep, a 1 s read timeout) would cost ≥ 1 s.
SLACK = 0.75


# ---- the control protocol, as bytes (vcuda/contract/src/control.rs) ----------------------


def varint(n):
    """postcard's unsigned LEB128 varint."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def frame(body):
    payload = struct.pack("<H", PROTOCOL_VERSION) + body
    return struct.pack("<I", len(payload)) + payload


def welcome(host_pid):
    return frame(varint(0) + varint(host_pid))  # Reply::Welcome, tag 0


def refused(reason):
    r = reason.encode()
    return frame(varint(1) + varint(len(r)) + r)  # Reply::Refused, tag 1


class Body:
    """A postcard body being read; every read checks bounds."""

    def __init__(self, data):
        self.data = data
        self.at = 0

    def varint(self, bits):
        n = shift = 0
        while True:
            if self.at >= len(self.data):
                raise ValueError(f"truncated varint at byte {self.at}")
            b = self.data[self.at]
            self.at += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
            if shift > bits + 7:
                raise ValueError("overlong varint")
        if n >= 1 << bits:
            raise ValueError(f"varint {n} does not fit {bits} bits")
        return n

    def string(self):
        n = self.varint(32)
        s = self.data[self.at : self.at + n]
        if len(s) != n:
            raise ValueError("truncated string")
        self.at += n
        return s.decode()

    def end(self):
        if self.at != len(self.data):
            raise ValueError(f"{len(self.data) - self.at} trailing bytes")


def decode_hello(payload):
    """A Request payload (version + body) that must be a Hello; returns its fields."""
    (version,) = struct.unpack_from("<H", payload)
    if version != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {version}")
    b = Body(payload[2:])
    tag = b.varint(32)
    if tag != 0:
        raise ValueError(f"Request tag {tag}, not Hello (0)")
    h = {
        "allocation": b.string(),
        "slot": b.varint(32),
        "generation": b.varint(32),
        "pid": b.varint(32),
        "start_time": b.varint(64),
    }
    b.end()
    return h


def read_exact(conn, n):
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ValueError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


class FakeManager:
    """A scripted manager on a Unix socket. Each connection: read one frame, decode it as a
    Hello, record it, then per `mode` answer Welcome ("welcome"), Refused ("refuse"), or
    nothing, holding the connection open until closed ("silent")."""

    def __init__(self, path, mode="welcome", host_pid=4242, reason="refused by the test"):
        self.path = pathlib.Path(path)
        self.mode = mode
        self.host_pid = host_pid
        self.reason = reason
        self.hellos = queue.Queue()  # decoded Hellos, or ("error", text) for bad frames
        self._held = []
        self._stop = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        self.sock.listen(16)
        self.sock.settimeout(0.1)  # so the accept loop notices close()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(5)
            try:
                (length,) = struct.unpack("<I", read_exact(conn, 4))
                if not 2 <= length <= 16 * 1024:
                    raise ValueError(f"frame length {length}")
                hello = decode_hello(read_exact(conn, length))
            except (OSError, ValueError, UnicodeDecodeError) as e:
                self.hellos.put(("error", repr(e)))
                conn.close()
                continue
            self.hellos.put(hello)
            if self.mode == "silent":
                self._held.append(conn)
                continue
            try:
                conn.sendall(welcome(self.host_pid) if self.mode == "welcome" else refused(self.reason))
            except OSError:
                pass
            conn.close()

    def next_hello(self, timeout=HELLO_TIMEOUT):
        try:
            h = self.hellos.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the fake manager received no Hello within {timeout} s") from None
        if isinstance(h, tuple):
            raise AssertionError(f"the fake manager received a bad frame: {h[1]}")
        return h

    def assert_no_hello(self, within):
        try:
            h = self.hellos.get(timeout=within)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected further Hello: {h}")

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        for c in self._held:
            c.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- processes, configs, the region -------------------------------------------------------


class Traced:
    """A process of a container whose stderr is read as it arrives, so a test can wait for a
    log line; with a CUDA shell (c/vcuda_shell.c) as program, `ok(cmd)` runs a command."""

    def __init__(self, container, args):
        self.p = container.popen(args, stdin=subprocess.PIPE)
        self.pid = self.p.pid
        self.err = []
        self._lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.p.stderr:
            self.err.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_stderr(self, needle, timeout=HELLO_TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                line = None
                left = 0
            if line is None:
                raise AssertionError(
                    f"no stderr line containing {needle!r} "
                    f"({'timed out' if left <= 0 else 'process ended'}); stderr so far:\n{''.join(self.err)}"
                )
            if needle in line:
                return line

    def ok(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line.startswith("rc=0"), f"{cmd!r} -> {line!r}; stderr:\n{''.join(self.err)}"
        return line

    def finish(self):
        """Quit the shell, check it exited normally; returns its stderr."""
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
        except BrokenPipeError:
            pass
        rc = self.p.wait(timeout=30)
        self._reader.join(timeout=10)
        assert rc == 0, f"exit {rc}; stderr:\n{''.join(self.err)}"
        return "".join(self.err)


def container(sim, name="c0", socket_path=None, allocation=ALLOCATION, quota_mib=2048, log=None):
    """sim.container, with `socket` and `allocation` added to its config (top-level keys, so
    before the first [[gpu]] table)."""
    c = sim.container(quota_mib, name=name)
    keys = ""
    if socket_path is not None:
        keys += f'socket = "{socket_path}"\n'
    if allocation is not None:
        keys += f'allocation = "{allocation}"\n'
    head, sep, tail = c.config.read_text().partition("[[gpu]]")
    c.config.write_text(f"{head}{keys}\n{sep}{tail}")
    if allocation is not None:  # the manager lays out the region of an allocation it names
        lay_out_region(c.region, re.findall(r'^uuid = "([^"]+)"', tail, re.M))
    if log:
        c.env["VCUDA_LOG"] = log
    return c


def region_slot(region, index):
    """Slot `index` of the region as raw fields (vcuda/contract/src/region.rs `Slot`: state,
    pid, host_pid, generation as u32, then start_time as u64)."""
    assert 0 <= index < MAX_PROCS
    state, pid, host_pid, generation, start_time = struct.unpack_from(
        "<IIIIQ", region.read_bytes(), REGION_HEADER + index * SLOT_SIZE
    )
    return {"state": state, "pid": pid, "host_pid": host_pid, "generation": generation, "start_time": start_time}


def proc_start_time(pid):
    """Field 22 of /proc/<pid>/stat (clock ticks since boot)."""
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def check_hello(h, c, pid):
    """`h` is the Hello of process `pid`, naming the slot it holds in `c`'s region."""
    assert h["allocation"] == ALLOCATION
    assert h["pid"] == pid, h
    s = region_slot(c.region, h["slot"])
    assert s["state"] == SLOT_ACTIVE, s
    assert s["pid"] == pid, s
    assert s["generation"] == h["generation"], (s, h)
    assert s["start_time"] == h["start_time"], (s, h)
    assert h["start_time"] == proc_start_time(pid), h
    assert h["slot"] in [x["slot"] for x in region_slots(c.region) if x["pid"] == pid]


def timed_run(c, program, *args):
    t = time.monotonic()
    p = c.run([program, *args], timeout=60)
    return time.monotonic() - t, p


@pytest.fixture(scope="module")
def shell_bin(cc, tmp_path_factory):
    return build(cc, tmp_path_factory.mktemp("bin"), "vcuda_shell")


@pytest.fixture(scope="module")
def workload_bin(cc, tmp_path_factory):
    return build(cc, tmp_path_factory.mktemp("bin"), "cuda_workload")


@pytest.fixture(scope="module")
def fork_bin(cc, tmp_path_factory):
    return build(cc, tmp_path_factory.mktemp("bin"), "vcuda_fork")


@pytest.fixture
def sockdir():
    """A short directory for sockets (a Unix socket path is at most 107 bytes; pytest's
    tmp_path can be longer)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="vreg-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# A 2 s workload that syncs after every 1 ms kernel: its duration is set by the program, so
# two runs differ only by what libvcuda adds. 2 s also spans the first retry (at 1 s).
WORKLOAD = ("--seconds", "2", "--gap-us", "0")


# ---- the tests ----------------------------------------------------------------------------


def test_a_process_registers_once_with_its_slot(sim, shell_bin, sockdir):
    with FakeManager(sockdir / "m.sock") as m:
        c = container(sim, socket_path=m.path, log="debug")
        sh = Traced(c, [shell_bin])
        sh.ok("init")
        h = m.next_hello()
        check_hello(h, c, sh.pid)
        sh.wait_stderr(f"host pid {m.host_pid}")  # the Welcome was read (and logged)
        m.assert_no_hello(within=NO_RETRY_WINDOW)
        sh.ok("ctx 0")
        sh.finish()


def test_no_socket_or_no_allocation_means_no_registration(sim, shell_bin, sockdir):
    with FakeManager(sockdir / "m.sock") as m:
        for name, kw in (("nosock", {"socket_path": None}), ("noalloc", {"socket_path": m.path, "allocation": None})):
            c = container(sim, name=name, **kw)
            sh = Traced(c, [shell_bin])
            sh.ok("init")
            sh.ok("ctx 0")
            sh.finish()
        m.assert_no_hello(within=NO_RETRY_WINDOW)


def test_an_absent_manager_does_not_delay_the_application(sim, workload_bin, sockdir):
    base = container(sim, name="plain", socket_path=None)
    absent = container(sim, name="absent", socket_path=sockdir / "nobody.sock", log="debug")
    t_base, _ = timed_run(base, workload_bin, *WORKLOAD)
    t_absent, p = timed_run(absent, workload_bin, *WORKLOAD)
    assert "kernels=" in p.stdout
    # the library did try, and retried, during the run
    assert p.stderr.count("cannot reach the manager") >= 2, p.stderr
    assert t_absent < t_base + SLACK, f"{t_absent:.2f} s with an absent manager vs {t_base:.2f} s without a socket"


def test_a_manager_that_starts_late_still_hears_from_the_process(sim, shell_bin, sockdir):
    path = sockdir / "late.sock"
    c = container(sim, socket_path=path, log="debug")
    sh = Traced(c, [shell_bin])
    sh.ok("init")
    sh.wait_stderr("cannot reach the manager")  # the first attempt found no manager
    with FakeManager(path) as m:
        h = m.next_hello()
        check_hello(h, c, sh.pid)
        sh.wait_stderr("registered with the manager")
        m.assert_no_hello(within=NO_RETRY_WINDOW)
    sh.ok("ctx 0")
    sh.finish()


def test_a_refusal_is_logged_once_and_not_retried(sim, shell_bin, sockdir):
    reason = "allocation alloc-e2e.7_x is not on this node"
    with FakeManager(sockdir / "m.sock", mode="refuse", reason=reason) as m:
        c = container(sim, socket_path=m.path, log="warn")
        sh = Traced(c, [shell_bin])
        sh.ok("init")
        check_hello(m.next_hello(), c, sh.pid)
        line = sh.wait_stderr("refused")
        assert reason in line, line
        m.assert_no_hello(within=NO_RETRY_WINDOW)
        sh.ok("ctx 0")  # CUDA carries on regardless
        err = sh.finish()
    assert err.count(reason) == 1, err


def test_a_manager_that_never_answers_does_not_hang_the_application(sim, workload_bin, sockdir):
    base = container(sim, name="plain", socket_path=None)
    t_base, _ = timed_run(base, workload_bin, *WORKLOAD)
    with FakeManager(sockdir / "m.sock", mode="silent") as m:
        c = container(sim, socket_path=m.path)
        t_silent, p = timed_run(c, workload_bin, *WORKLOAD)
        assert "kernels=" in p.stdout
        # the Hello arrived during the run, and the manager held the connection unanswered
        h = m.next_hello(timeout=0.1)
        assert h["pid"] > 0 and h["allocation"] == ALLOCATION
    assert t_silent < t_base + SLACK, f"{t_silent:.2f} s with a silent manager vs {t_base:.2f} s without a socket"


def test_two_processes_register_distinct_slots(sim, shell_bin, sockdir):
    with FakeManager(sockdir / "m.sock") as m:
        c = container(sim, socket_path=m.path)
        a, b = Traced(c, [shell_bin]), Traced(c, [shell_bin])
        a.ok("init")
        b.ok("init")
        hellos = {h["pid"]: h for h in (m.next_hello(), m.next_hello())}
        assert set(hellos) == {a.pid, b.pid}
        check_hello(hellos[a.pid], c, a.pid)
        check_hello(hellos[b.pid], c, b.pid)
        assert hellos[a.pid]["slot"] != hellos[b.pid]["slot"]
        m.assert_no_hello(within=NO_RETRY_WINDOW)
        a.finish()
        b.finish()


def test_a_forked_child_registers_its_own_slot(sim, fork_bin, sockdir):
    """vcuda_fork "after": the parent initialises CUDA, then forks; the child's first CUDA
    call claims a slot of its own (init::after_fork), which it registers."""
    with FakeManager(sockdir / "m.sock") as m:
        c = container(sim, socket_path=m.path)
        p = c.popen([fork_bin, "after", "100", "100"], stdin=subprocess.PIPE)
        pids = {}
        while len(pids) < 2:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            who = line.split()[0]
            pids[who] = int(line.split()[1].split("=")[1])
        hellos = {h["pid"]: h for h in (m.next_hello(), m.next_hello())}
        assert set(hellos) == {pids["parent"], pids["child"]}
        check_hello(hellos[pids["parent"]], c, pids["parent"])
        check_hello(hellos[pids["child"]], c, pids["child"])
        assert hellos[pids["parent"]]["slot"] != hellos[pids["child"]]["slot"]
        p.stdin.write("release-child\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "child_exit=0"
        p.stdin.write("quit\n")
        p.stdin.close()
        assert p.wait(timeout=30) == 0, p.stderr.read()
        m.assert_no_hello(within=0)
