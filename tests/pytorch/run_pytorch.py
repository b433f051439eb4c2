"""PyTorch on gpusim, bare and under libvcuda (issue 16 §4); run by scripts/test-pytorch.

Runs tests/pytorch/torch_probe.py in the torch venv twice, each time on a fresh gpusim
machine (two A100-40GB, configured as a CUDA 13.5 driver): bare, then in a vcuda container
with a 4 GiB quota and a 30 % share. Holds what the probe saw, and the probe's device time
from gpusim's ground truth, against what a user expects, and prints one report: every
check, PASS/FAIL with its figures, INFO for what is reported but not expected of gpusim
(cuBLAS, cuDNN), and what does not work on gpusim, named exactly. Exit status 1 if an
expected check failed, 2 if a prerequisite is missing.

Runs under the test venv (.venv: the gpusim harness and limit_common are shared with the
pytest suites). Not a pytest module (no test_ prefix), so `scripts/test` never collects it.
"""

import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parent
for d in (TESTS / "gpusim" / "e2e", TESTS / "vcuda"):
    sys.path.insert(0, str(d))

import gpusim_harness  # noqa: E402
import limit_common  # noqa: E402
from gpusim_harness import VCUDA_LIB, Sim  # noqa: E402
from limit_common import Load, Machine  # noqa: E402

MiB = 1 << 20
QUOTA_MIB = 4096
SHARE = 30  # %
ACCURACY = 0.02  # the limiter's stated accuracy (tests/vcuda/test_vcuda_limit.py): ± 2 pp
BARE_SATURATED = 0.8  # bare, the loop keeps the GPU busy: at least this much of it
# gpusim as a CUDA 13.5 driver: torch 2.15's runtime is 13.2 (gpusim must report at least
# that, or cudart says cudaErrorInsufficientDriver), and the newest CUDA library in its venv
# (nvjitlink) is 13.5; a node's driver is at least as new as its toolkit.
CUDA_VERSION = 13050
DEVICE_MIB = 40960  # gpusim's default A100-SXM4-40GB

# What fails on gpusim, by the message it fails with: what it is, exactly. Found with
# GPUSIM_LOG=1, LD_DEBUG=symbols, and a gpusim that logged every failing entry point.
DIAGNOSES = [
    (re.compile(r"unknown table \{f8cff951"),
     "cudart asks for the export table {{f8cff951-...}} first and does without it (harmless; "
     "tests/gpusim/README.md \"The CUDA runtime\")"),
    (re.compile(r"Can't find (cu\w+)"),
     "gpusim does not export {0}: torch's c10::cuda::DriverAPI::get() resolves its required "
     "driver entry points (cudaGetDriverEntryPointByVersion at 12000; cuStreamWriteValue32 is "
     "the _v2 ABI) and asserts on a missing one; the caching allocator calls it when an "
     "allocation fails, so every out-of-memory surfaces as RuntimeError instead of "
     "torch.OutOfMemoryError (allocations that fit work)"),
    (re.compile(r"Failed to initialize internal constants"),
     "cuBLASLt (cublasLtCtxInit) writes its device constants with cudaMemcpyToSymbol: cudart asks "
     "gpusim for the global `cublas::internal::deviceConstants` (cuLibraryGetGlobal), and gpusim "
     "answers CUDA_ERROR_NOT_FOUND because every entry of libcublasLt's fatbins is ZSTD-compressed "
     "(flag 0x8000) and gpusim reads no names from compressed entries; cublasCreate returns "
     "CUBLAS_STATUS_ALLOC_FAILED"),
    (re.compile(r"Driver API initialization failed"),
     "cuBLASLt dlsym()s 79 driver entry points from libcuda.so.1 and stops if any is missing; "
     "gpusim does not export cuKernelGetLibrary, cuLinkCreate_v2, cuLinkAddData_v2, "
     "cuLinkComplete, cuLinkDestroy, cuStreamWaitValue32, cuStreamBatchMemOp, "
     "cuGraphKernelNodeGetParams, cuGraphExecKernelNodeSetParams, cuGraphNodeGetType"),
    (re.compile(r"CUBLAS_STATUS_ARCH_MISMATCH"),
     "cuBLASLt reads cuCtxGetLimit(CU_LIMIT_CIG_ENABLED = 8) at its first GEMM; gpusim refuses "
     "the limit (CUDA_ERROR_UNSUPPORTED_LIMIT, 215)"),
    (re.compile(r"Failed to query heuristics"),
     "cuBLASLt finds no GEMM algorithm for the device (cublasLt*MatmulAlgoGetHeuristic, every "
     "dtype); no gpusim entry point fails on the way (each was traced), so the cause is in what "
     "gpusim reports, not in a missing call: not identified"),
]


class Ground(Machine):
    """limit_common.Machine's ground-truth sampler and utilization windows, on a Sim this
    script configured itself (Machine writes its own config, which has no cuda_version)."""

    def __init__(self, sim):  # deliberately not Machine.__init__
        self.sim = sim
        self.uuids = [g["uuid"] for g in sim.status()["gpus"]]
        self.program = None
        self.samples = []
        self.errors = []
        self._stop = threading.Event()
        self._thread = None


def fresh_sim(root):
    root.mkdir(parents=True, exist_ok=True)
    sim = Sim(root)
    text = sim.run([gpusim_harness.GPUSIM, "default-config"]).stdout
    if "cuda_version = 12090" not in text:
        raise SystemExit("run_pytorch: gpusim's default config no longer says cuda_version = 12090; update fresh_sim")
    sim.write_config(text.replace("cuda_version = 12090", f"cuda_version = {CUDA_VERSION}"))
    return sim


def run_probe(env, python, loop_seconds, ground):
    """Run the probe while sampling the ground truth; returns ({step: fields}, everything
    else it printed (stderr, and stdout lines that are not steps: cuBLASLt logs there), exit
    status, pid)."""
    env = dict(env)
    env["GPUSIM_LOG"] = "1"  # gpusim names the tables it is asked for and does not have
    env["CUBLASLT_LOG_LEVEL"] = "1"  # cuBLASLt names its errors (on stdout)
    env["PYTHONUNBUFFERED"] = "1"
    p = subprocess.Popen(
        [python, str(HERE / "torch_probe.py"), "--gpusim", str(gpusim_harness.GPUSIM),
         "--loop-seconds", str(loop_seconds)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    err = []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    reader.start()
    steps, other = {}, []
    ground.sample(0.2)
    try:
        for line in p.stdout:
            if line.startswith("@@ "):
                d = json.loads(line[3:])
                steps[d.pop("step")] = d
            else:
                other.append(line)
        p.wait(timeout=900)
    finally:
        ground.stop()
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=10)
    return steps, "".join(other + err), p.returncode, p.pid


class Report:
    def __init__(self):
        self.rows = []  # (mode, check, verdict, figures)
        self.gaps = {}  # what does not work on gpusim: message -> modes

    def add(self, mode, check, ok, figures):
        verdict = {True: "PASS", False: "FAIL", None: "INFO"}[ok]
        self.rows.append((mode, check, verdict, figures))
        print(f"  {verdict:4}  {check:<38} {figures}", flush=True)

    def gap(self, mode, message):
        self.gaps.setdefault(message, []).append(mode)

    def failed(self):
        return [r for r in self.rows if r[2] == "FAIL"]


def mib(n):
    return f"{n / MiB:,.0f} MiB"


def first_line(s, n=300):
    return (s or "").strip().split("\n")[0][:n]


class Judge:
    """One run's checks. `vcuda`: under the quota and share."""

    def __init__(self, report, mode, steps, vcuda):
        self.report, self.mode, self.steps, self.vcuda = report, mode, steps, vcuda
        self.limit = (QUOTA_MIB if vcuda else DEVICE_MIB) * MiB
        self.what = "the quota" if vcuda else "the device"

    def add(self, check, ok, figures):
        self.report.add(self.mode, check, ok, figures)

    def step(self, name, check):
        """The step's figures, or None after reporting it FAIL (it failed or never ran)."""
        if name in self.steps:
            return self.steps[name]
        failed = self.steps.get(f"{name}_failed")
        if failed:
            self.add(check, False, f"raised {first_line(failed['error'], 400)}")
            self.report.gap(self.mode, failed["error"])
        else:
            self.add(check, False, "did not run (the probe stopped before it)")
        return None

    def run(self, util, windows):
        i = self.step("init", "torch initialises")
        if not i:
            return
        self.add("torch.cuda.is_available()", i["is_available"] is True,
                 f"{i['is_available']} (torch {i['torch']}, CUDA {i['torch_cuda']}, {i['cudart']}: "
                 f"runtime {i['runtime_version']}, driver {i['driver_version']})")
        want = 1 if self.vcuda else 2
        self.add("torch.cuda.device_count()", i["device_count"] == want,
                 f"{i['device_count']} (want {want}: " + ("the container's GPU)" if self.vcuda else "gpusim's two A100s)"))
        p = self.step("properties", "get_device_properties(0)")
        if not p:
            return
        self.add("get_device_properties(0)", p["total_memory"] == self.limit,
                 f"{p['name']}, cc {p['capability']}, {p['sms']} SMs, total_memory {mib(p['total_memory'])} "
                 f"(want {mib(self.limit)})")
        self.add("torch.cuda.mem_get_info()", p["total"] == self.limit and 0 <= p["free"] <= p["total"],
                 f"free {mib(p['free'])} total {mib(p['total'])} right after the context is made; gpusim "
                 f"charges the process {mib(p['truth'])} for it, mem_get_info counts {mib(p['total'] - p['free'])}")
        self.fill(p["truth"])
        self.retry()
        self.oom()
        self.empty_cache()
        self.libraries()
        self.loop(util, windows)

    def fill(self, overhead):
        f = self.step("fill", f"allocate up to {self.what}")
        if not f:
            return
        # up to the limit: within what the context costs (the ground truth before) and a chunk
        ok = f["error"] is not None and f["held"] >= self.limit - overhead - f["chunk"] and f["truth"] <= self.limit
        self.add(f"allocate up to {self.what}", ok,
                 f"{f['tensors']} x {mib(f['chunk'])} = {mib(f['held'])} held, then torch.OutOfMemoryError; "
                 f"gpusim charges the process {mib(f['truth'])} (limit {mib(self.limit)})")
        self.add("  its message", None, first_line(f["error"]))

    def retry(self):
        r = self.step("retry", "cache freed, cudaMalloc retried")
        if not r:
            return
        b, a = r["before"], r["after"]
        ok = (r["ok"] and a["retries"] - b["retries"] == 1 and a["ooms"] == b["ooms"]
              and a["reserved"] == r["request"])
        self.add("cache freed, cudaMalloc retried", ok,
                 f"{mib(r['cached'])} cached in 3 blocks, {mib(r['request'])} asked: "
                 f"{'allocated' if r['ok'] else 'FAILED ' + first_line(r['error'])}; num_alloc_retries "
                 f"{b['retries']} -> {a['retries']}, num_ooms {b['ooms']} -> {a['ooms']}, reserved "
                 f"{mib(b['reserved'])} -> {mib(a['reserved'])}")

    def oom(self):
        o = self.step("oom", f"torch.OutOfMemoryError past {self.what}")
        if not o:
            return
        b, a = o["before"], o["after"]
        retried = a["retries"] - b["retries"] == 1 and a["ooms"] - b["ooms"] == 1
        ok = o["is_oom"] and retried and a["reserved"] == a["allocated"] == b["allocated"]
        self.add(f"torch.OutOfMemoryError past {self.what}", ok,
                 f"torch.empty({mib(o['request'])}) raised {o['raised']} after the allocator freed its "
                 f"cache and retried: num_alloc_retries {b['retries']} -> {a['retries']}, num_ooms "
                 f"{b['ooms']} -> {a['ooms']}, reserved {mib(b['reserved'])} -> {mib(a['reserved'])} "
                 f"(the live {mib(a['allocated'])})")
        self.add("  its message", None, first_line(o["message"]))
        self.add("  the process carries on", o["carries_on"] is True and o["live_kept"],
                 "the tensor live through the error is still counted and usable (fill_), and a new "
                 "allocation after the error succeeds"
                 if o["carries_on"] is True else str(o["carries_on"]))

    def empty_cache(self):
        e = self.step("empty_cache", "torch.cuda.empty_cache()")
        if not e:
            return
        c, z = e["cached"], e["emptied"]
        returned = e["truth_cached"] - e["truth_emptied"]
        ok = (c["reserved"] == e["freed"] and z["reserved"] == 0 and returned == e["freed"]
              and e["free_emptied"] - e["free_cached"] == e["freed"])
        self.add("torch.cuda.empty_cache()", ok,
                 f"{mib(e['freed'])} freed into the cache, then empty_cache(): reserved {mib(c['reserved'])} "
                 f"-> {mib(z['reserved'])}, mem_get_info free {mib(e['free_cached'])} -> "
                 f"{mib(e['free_emptied'])} of {mib(e['total'])}, gpusim's charge {mib(e['truth_cached'])} "
                 f"-> {mib(e['truth_emptied'])}")

    def libraries(self):
        for step, label in (("elementwise", "elementwise + reduction kernels"),
                            ("matmul_cublas", "matmul fp32 (cuBLAS)"),
                            ("matmul_cublas_fp16", "matmul fp16 (cuBLAS)"),
                            ("conv_cudnn", "conv2d (cuDNN)")):
            s = self.steps.get(step)
            if s is None:
                if step == "elementwise":
                    self.step("libraries", label)
                continue
            # torch's own kernels must run; the NVIDIA libraries are reported (INFO), and
            # named under "what does not work on gpusim" when they do not run
            ok = s["ok"] if step == "elementwise" else (True if s["ok"] else None)
            if s["ok"]:
                figures = "runs" + (f" (cuDNN {s['cudnn']})" if s.get("cudnn") else "")
            else:
                figures = f"does not run: {first_line(s['error'], 200)}"
                self.report.gap(self.mode, s["error"])
            self.add(label, ok, figures)

    def loop(self, util, windows):
        label = f"tensor-op loop at the {SHARE} % share" if self.vcuda else "tensor-op loop, bare"
        le = self.step("loop_end", label)
        if not le:
            return
        if util is None:
            self.add(label, False, "no ground-truth samples of the probe during the loop")
            return
        figures = (f"{util:.1%} of the GPU over {le['wall'] - 1.2:.1f} s by gpusim's busy time (1 s windows "
                   f"{min(windows):.1%} to {max(windows):.1%}); {le['iterations'] * le['ops_per_iteration']} ops")
        if self.vcuda:
            self.add(label, abs(util - SHARE / 100) <= ACCURACY, figures + f"; want {SHARE} % ± 2 pp")
        else:
            self.add(label, util >= BARE_SATURATED, figures + f"; want >= {BARE_SATURATED:.0%} (saturated)")


def diagnose(message):
    for pattern, text in DIAGNOSES:
        m = pattern.search(message)
        if m:
            return text.format(*m.groups())
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the torch venv's python")
    ap.add_argument("--loop-seconds", type=float, default=10.0)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (state files, configs)")
    ap.add_argument("--gpusim", type=pathlib.Path,
                    help="another gpusim build: a directory with lib/ and bin/ laid out as target/gpusim")
    args = ap.parse_args()
    if args.gpusim:
        d = args.gpusim.resolve()
        gpusim_harness.LIB, gpusim_harness.BIN = d / "lib", d / "bin"
        gpusim_harness.GPUSIM = limit_common.GPUSIM = d / "bin" / "gpusim"
    lib, gpusim = gpusim_harness.LIB, gpusim_harness.GPUSIM
    for f in (lib / "libcuda.so.1", lib / "libnvidia-ml.so.1", gpusim, VCUDA_LIB):
        if not f.exists():
            print(f"run_pytorch: {f} is missing: run scripts/build-gpusim and scripts/build-portable", file=sys.stderr)
            return 2
    work = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-pytorch-"))
    report = Report()
    logs = {}
    print(f"gpusim {lib} (cuda_version = {CUDA_VERSION}), libvcuda {VCUDA_LIB}")
    for mode, vcuda in (("bare", False), ("vcuda", True)):
        sim = fresh_sim(work / mode)
        if vcuda:
            env = sim.container(QUOTA_MIB, core=SHARE).env
            title = f"under libvcuda: quota {QUOTA_MIB} MiB, share {SHARE} %"
        else:
            env = sim.env
            title = "bare on gpusim: two A100-SXM4-40GB"
        print(f"\n== {mode}: {title}", flush=True)
        ground = Ground(sim)
        started = time.monotonic()
        steps, stderr, rc, pid = run_probe(env, args.python, args.loop_seconds, ground)
        util = windows = None
        if "loop_start" in steps and "loop_end" in steps:
            t0, t1 = steps["loop_start"]["t"], steps["loop_end"]["t"]
            load = Load(ground, 0, None, pid, t0)
            try:
                util = load.util(1.0, t1 - t0 - 0.2)
                windows = ground.windows(load, 1.0, t1 - t0 - 0.2)
            except AssertionError as e:
                report.add(mode, "device time", False, str(e))
        Judge(report, mode, steps, vcuda).run(util, windows)
        if "aborted" in steps:
            report.add(mode, "probe aborted", False, first_line(steps["aborted"]["error"], 500))
            report.gap(mode, steps["aborted"]["error"])
        if rc != 0 or "done" not in steps:
            report.add(mode, "probe exit", False, f"exit status {rc}; its stderr ends:\n{stderr[-2000:]}")
        logs[mode] = sorted({ln for ln in stderr.splitlines() if ln.startswith("gpusim:") or "][Error][" in ln})
        print(f"  ({time.monotonic() - started:.0f} s)")

    print("\n== what does not work on gpusim (what the probe saw raised, then why)")
    raised = {}
    for message, modes in report.gaps.items():
        raised.setdefault(first_line(message, 300), set()).update(modes)
    for text, modes in raised.items():
        print(f"  raised ({', '.join(sorted(modes))}): {text}")
    if not raised:
        print("  nothing the probe uses")
    why = {}
    stamp = re.compile(r"^\[[^]]*\]")  # cuBLASLt's time stamp
    for mode, lines in logs.items():
        for ln in [*lines, *(m for m, modes in report.gaps.items() if mode in modes)]:
            text = diagnose(ln)
            if text is None and ln in lines:
                text = f"logged, not diagnosed: {stamp.sub('', ln)[:300]}"
            if text:
                why.setdefault(text, set()).add(mode)
    for text, modes in why.items():
        print(f"  - ({', '.join(sorted(modes))}) {text}")
    failed = report.failed()
    passed = sum(r[2] == "PASS" for r in report.rows)
    print(f"\n== {passed} passed, {len(failed)} failed, {sum(r[2] == 'INFO' for r in report.rows)} info")
    for mode, check, _, figures in failed:
        print(f"  FAIL {mode}: {check.strip()}: {first_line(figures)}")
    if args.keep:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
