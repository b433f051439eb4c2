"""Helpers shared by the libvcuda tests (test_vcuda_*.py): the C programs they build, a
line-driven CUDA shell (c/vcuda_shell.c) to step a process through allocations, a reader for
the container's region file, and gpusim's memory accounting written out as arithmetic."""

import struct
import subprocess

import pathlib

from gpusim_harness import C_COMMON, LIB, LineProcess

# The library's test programs (they include gpusim_harness.C_COMMON's common.h).
C = pathlib.Path(__file__).resolve().parent / "c"
MiB = 1 << 20
KiB = 1 << 10

# gpusim's default machine (tests/gpusim/README.md "Configuration" and "Memory")
CONTEXT = 300 * MiB  # context_overhead_mib = 300
MODULE = 1 * MiB  # module_overhead_kib = 1024
ALLOC_GRANULE = 512  # cuMemAlloc(_v2), cuMemAllocManaged, cuMemAllocPitch_v2: rounded up to 512 B
ARRAY_GRANULE = 64 * KiB  # arrays and mipmapped arrays: rounded up to 64 KiB
VMM_GRANULE = 2 * MiB  # cuMemCreate sizes are multiples of it; pools grow in steps of it
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_PERMITTED = 800
CU_AD_FORMAT_UNSIGNED_INT8 = 0x01
CU_AD_FORMAT_UNSIGNED_INT16 = 0x02
CU_AD_FORMAT_FLOAT = 0x20


def round_up(n, granule):
    return -(-n // granule) * granule


def build(cc, out, name, *extra, link_cuda=True):
    """Compile program `name`: the library's (c/) or gpusim's own (gpusim_harness.C_COMMON,
    e.g. cuda_workload.c), into directory `out`."""
    args = ["-L", str(LIB), "-lcuda"] if link_cuda else []
    src = C / f"{name}.c"
    if not src.exists():
        src = C_COMMON / f"{name}.c"
    return cc(src, out / name, *args, *extra)


class Shell(LineProcess):
    """A running c/vcuda_shell.c: `do("alloc 4096")` sends one command and returns its reply
    as a dict of ints ({"rc": 0, "id": 3, ...}; `lib=` names a file and `fn=` a symbol)."""

    TEXT = ("lib", "fn")

    def __init__(self, env_owner, program, name="shell", prefix=()):
        super().__init__(env_owner, [*prefix, program], name)

    def ok(self, cmd):
        r = self.do(cmd)
        assert r["rc"] == CUDA_SUCCESS, f"{self.name}: {cmd!r} -> {r}"
        return r

    def start(self, module=True):
        """cuInit, a context on device 0, and (by default) one module: 301 MiB on gpusim."""
        self.ok("init")
        self.ok("ctx 0")
        if module:
            self.ok("module")
        return self

    def close(self):
        if self.p.poll() is None:
            try:
                self.do("quit")
            except (AssertionError, BrokenPipeError):
                pass
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.p.stderr.read()

    def kill(self):
        self.p.kill()
        self.p.wait()


# ---- the region file (vcuda/contract/src/region.rs, layout version 4) ----------------------

REGION_HEADER = 4096
SLOT_SIZE = 256
MAX_PROCS = 64
MAX_GPUS = 8
SLOT_ACTIVE = 1
REGION_MAGIC = b"VCUDARGN"
REGION_VERSION = 4

# RegionHeader's fields in declaration order, as struct formats ("8Q": one u64 per GPU). It is
# #[repr(C)] and every field is naturally aligned with no padding between (the Rust test
# `layout_is_stable` pins the offsets this yields), so an offset is the sum of the sizes before.
_HEADER_FIELDS = [
    ("magic", "Q"),
    ("version", "I"),
    ("num_gpus", "I"),
    ("size", "Q"),
    ("uuids", f"{16 * MAX_GPUS}s"),
    ("slots_used", "I"),
    ("_pad", "I"),
    ("ctx_cost", f"{MAX_GPUS}Q"),
    ("module_cost", f"{MAX_GPUS}Q"),
    ("core_override", f"{MAX_GPUS}Q"),
    ("core_limit_override", f"{MAX_GPUS}Q"),
    ("throttled_ns", f"{MAX_GPUS}Q"),
    ("oom_refusals", f"{MAX_GPUS}Q"),
    ("accounting_errors", f"{MAX_GPUS}Q"),  # appended in space layout 4 left zero
]


def _header_offsets():
    out, off = {}, 0
    for name, fmt in _HEADER_FIELDS:
        align = 1 if fmt.endswith("s") else struct.calcsize("<" + fmt[-1])
        assert off % align == 0, f"region header field {name} would be padded"
        out[name] = (off, fmt)
        off += struct.calcsize("<" + fmt)
    return out


HEADER_OFFSETS = _header_offsets()  # name -> (byte offset, struct format)


def lay_out_region(path, uuids):
    """Lay out an empty region for the GPUs `uuids` ("GPU-…") at `path`, as vcuda-manager
    does before a container starts (vcuda/contract/src/region_file.rs,
    `RegionFile::create_or_open`). A test that plays the manager with a config naming an
    allocation must: the library refuses to lay out such a region itself (an empty one was
    reset from inside the container)."""
    data = bytearray(REGION_HEADER + MAX_PROCS * SLOT_SIZE)
    struct.pack_into("<IIQ", data, 8, REGION_VERSION, len(uuids), len(data))
    at = HEADER_OFFSETS["uuids"][0]
    for i, u in enumerate(uuids):
        data[at + 16 * i:at + 16 * (i + 1)] = bytes.fromhex(u.removeprefix("GPU-").replace("-", ""))
    data[:8] = REGION_MAGIC
    path.write_bytes(bytes(data))
    path.chmod(0o666)


def region_header_field(path, name):
    """One region header field, per GPU for the per-GPU arrays (only the container's GPUs).
    Checks the magic and the layout version first, so a layout change fails loudly here."""
    data = path.read_bytes()
    assert data[:8] == REGION_MAGIC, f"{path}: not a vcuda region"
    version, num_gpus = struct.unpack_from("<II", data, 8)
    assert version == REGION_VERSION, f"{path}: layout version {version}, these tests read {REGION_VERSION}"
    off, fmt = HEADER_OFFSETS[name]
    values = struct.unpack_from("<" + fmt, data, off)
    return list(values[:num_gpus]) if fmt == f"{MAX_GPUS}Q" else values[0]


def region_counters(path):
    """The container's statistics counters, per GPU: {"throttled_ns": [...], "oom_refusals": [...]}."""
    return {name: region_header_field(path, name) for name in ("throttled_ns", "oom_refusals")}


def region_slots(path):
    """The region's active process slots: [{"pid", "api": [bytes per GPU], "hidden": [...]}]."""
    data = path.read_bytes()
    num_gpus = struct.unpack_from("<I", data, 12)[0]
    out = []
    for i in range(MAX_PROCS):
        off = REGION_HEADER + i * SLOT_SIZE
        state, pid = struct.unpack_from("<II", data, off)
        if state != SLOT_ACTIVE:
            continue
        # api: bytes in the low 48 bits, a change count in the high 16 (region.rs API_BYTES)
        api = [a & ((1 << 48) - 1) for a in struct.unpack_from(f"<{MAX_GPUS}Q", data, off + 24)[:num_gpus]]
        hidden = struct.unpack_from(f"<{MAX_GPUS}Q", data, off + 24 + 8 * MAX_GPUS)[:num_gpus]
        out.append({"slot": i, "pid": pid, "api": list(api), "hidden": list(hidden)})
    return out


def region_used(path, gpu=0):
    """What the region says the container holds on `gpu` (all processes)."""
    return sum(s["api"][gpu] + s["hidden"][gpu] for s in region_slots(path))


def gpu_status(sim, gpu=0):
    return sim.status()["gpus"][gpu]


def proc_memory(sim, pid, gpu=0):
    """gpusim's charge for one process on `gpu` (None if it has no context there)."""
    for p in gpu_status(sim, gpu)["processes"]:
        if p["pid"] == pid:
            return p["memory"]
    return None
