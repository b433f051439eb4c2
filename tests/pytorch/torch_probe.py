"""What PyTorch does on a (simulated) GPU, step by step; run by run_pytorch.py in the torch
venv, bare on gpusim or under libvcuda. It judges nothing: each step prints one line
`@@ {json}` with what it saw (torch's figures and gpusim's ground truth for this process),
and run_pytorch.py holds them against what a user expects.

`limit` below is the memory torch is told the device has (get_device_properties(0).
total_memory): the device's 40 GiB bare, the quota under libvcuda. Each memory step is
written in terms of it, so the same steps show gpusim's own limit bare and the quota under
libvcuda.

Usage: torch_probe.py --gpusim PATH --loop-seconds S
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
import traceback

import torch

MiB = 1 << 20
GRANULE = 2 * MiB  # the caching allocator rounds large blocks to 2 MiB


def emit(step, **fields):
    print("@@ " + json.dumps({"step": step, **fields}), flush=True)


def ground_truth(gpusim):
    """gpusim's charge for this process on the GPU where it has a context: (index, bytes)."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the ground truth, not the library's view
    out = subprocess.run([gpusim, "status", "--json"], env=env, capture_output=True, text=True, check=True).stdout
    for g in json.loads(out)["gpus"]:
        for p in g["processes"]:
            if p["pid"] == os.getpid():
                return g["index"], p["memory"]
    return None, 0


def stats():
    s = torch.cuda.memory_stats()
    return {
        "retries": s.get("num_alloc_retries", 0),
        "ooms": s.get("num_ooms", 0),
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
    }


def round_to(n, granule=GRANULE):
    return n // granule * granule


def step_init(_args):
    cudart = None
    for name in ("libcudart.so.13", "libcudart.so.12"):
        try:
            cudart = ctypes.CDLL(name)  # the one torch loaded (dlopen returns its handle)
            break
        except OSError:
            continue
    drv, rt = ctypes.c_int(0), ctypes.c_int(0)
    if cudart is not None:
        cudart.cudaDriverGetVersion(ctypes.byref(drv))
        cudart.cudaRuntimeGetVersion(ctypes.byref(rt))
    emit(
        "init",
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        is_available=torch.cuda.is_available(),
        device_count=torch.cuda.device_count(),
        cudart=cudart._name if cudart else None,
        driver_version=drv.value,
        runtime_version=rt.value,
    )


def step_properties(args):
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)  # the first call creates the context
    gpu, truth = ground_truth(args.gpusim)
    emit(
        "properties",
        name=p.name,
        total_memory=p.total_memory,
        capability=f"{p.major}.{p.minor}",
        sms=p.multi_processor_count,
        free=free,
        total=total,
        truth_gpu=gpu,
        truth=truth,
    )
    return p.total_memory


def step_fill(args, limit):
    """Allocate 256 MiB tensors until the allocator gives up."""
    chunk = 256 * MiB
    held, err = [], None
    while len(held) * chunk <= 2 * limit:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            err = f"{type(e).__module__}.{type(e).__qualname__}: {e}"
            break
    free, total = torch.cuda.mem_get_info()
    _, peak = ground_truth(args.gpusim)
    emit("fill", chunk=chunk, tensors=len(held), held=len(held) * chunk, error=err, free=free, total=total,
         truth=peak, **stats())
    del held
    torch.cuda.empty_cache()


def step_retry(args, limit):
    """Three quarters of the limit cached in three blocks, then half of it in one: no cached
    block fits and the device (or quota) has no room left, so the caching allocator frees
    its cache (release_cached_blocks) and retries cudaMalloc, which now succeeds."""
    q = round_to(limit // 4)
    blocks = [torch.empty(q, dtype=torch.uint8, device="cuda") for _ in range(3)]
    del blocks
    before = stats()
    err = None
    try:
        big = torch.empty(2 * q, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        big, err = None, f"{type(e).__qualname__}: {e}"
    after = stats()
    _, truth = ground_truth(args.gpusim)
    emit("retry", cached=3 * q, request=2 * q, ok=big is not None, error=err, before=before, after=after, truth=truth)
    del big
    torch.cuda.empty_cache()


def step_oom(args, limit):
    """A quarter of the limit live, a quarter cached, then a request past the limit: the
    allocator frees the cached quarter, retries, and raises torch.OutOfMemoryError; the live
    tensor survives and the process allocates again."""
    q = round_to(limit // 4)
    live = torch.empty(q, dtype=torch.uint8, device="cuda")
    cached = torch.empty(q, dtype=torch.uint8, device="cuda")
    del cached
    before = stats()
    request = round_to(limit + limit // 4)
    raised, message = None, None
    try:
        torch.empty(request, dtype=torch.uint8, device="cuda")
    except Exception as e:  # noqa: BLE001  (which exception is what this step reports)
        raised, message = f"{type(e).__module__}.{type(e).__qualname__}", str(e)
    after = stats()
    _, truth = ground_truth(args.gpusim)
    again = None
    try:
        live.fill_(7)  # the tensor that was live through the error is still usable
        again = torch.empty(q, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        carries_on = True
    except Exception as e:  # noqa: BLE001
        carries_on = f"{type(e).__qualname__}: {e}"
    emit("oom", request=request, raised=raised, is_oom=raised == "torch.OutOfMemoryError", message=message,
         before=before, after=after, truth_after=truth, live_kept=after["allocated"] >= q, carries_on=carries_on)
    del live, again
    torch.cuda.empty_cache()


def step_empty_cache(args, limit):
    """Half the limit allocated and freed (cached), then torch.cuda.empty_cache()."""
    q = round_to(limit // 8)
    blocks = [torch.empty(q, dtype=torch.uint8, device="cuda") for _ in range(4)]
    del blocks
    cached = stats()
    free_cached, total = torch.cuda.mem_get_info()
    _, truth_cached = ground_truth(args.gpusim)
    torch.cuda.empty_cache()
    emptied = stats()
    free_emptied, _ = torch.cuda.mem_get_info()
    _, truth_emptied = ground_truth(args.gpusim)
    emit("empty_cache", freed=4 * q, cached=cached, emptied=emptied, free_cached=free_cached,
         free_emptied=free_emptied, total=total, truth_cached=truth_cached, truth_emptied=truth_emptied)


def attempt(step, fn):
    try:
        emit(step, ok=True, **fn())
    except Exception as e:  # noqa: BLE001  (a library that fails on gpusim is reported, exactly)
        emit(step, ok=False, error=f"{type(e).__module__}.{type(e).__qualname__}: {e}")


def step_libraries(_args):
    """Beyond the caching allocator: an elementwise op and a reduction (torch's own kernels),
    a matmul (cuBLAS / cuBLASLt), a convolution (cuDNN). gpusim computes nothing, so only
    whether each runs is reported, not its values."""

    def elementwise():
        x = torch.ones(1 << 20, device="cuda")
        y = (x * 2 + 1).relu_()
        s = y.sum()
        torch.cuda.synchronize()
        return {"shape": list(y.shape), "sum_dtype": str(s.dtype)}

    def matmul():
        a = torch.randn(512, 512, device="cuda")
        c = a @ a
        torch.cuda.synchronize()
        return {"shape": list(c.shape)}

    def matmul_half():
        a = torch.randn(512, 512, device="cuda", dtype=torch.float16)
        c = a @ a
        torch.cuda.synchronize()
        return {"shape": list(c.shape)}

    def conv():
        conv = torch.nn.Conv2d(3, 8, 3).cuda()
        y = conv(torch.randn(1, 3, 32, 32, device="cuda"))
        torch.cuda.synchronize()
        return {"shape": list(y.shape), "cudnn": torch.backends.cudnn.version()}

    attempt("elementwise", elementwise)
    attempt("matmul_cublas", matmul)
    attempt("matmul_cublas_fp16", matmul_half)
    attempt("conv_cudnn", conv)


def step_loop(args):
    """Tensor operations in place on a 256 MiB tensor (mul_, add_, relu_, sum: torch's
    elementwise and reduction kernels, about 200 µs each in gpusim's wave cost model; no
    copies, which gpusim performs on the host) for `loop_seconds`, synchronizing every 16
    iterations; run_pytorch.py measures this process's device time meanwhile."""
    x = torch.empty(64 << 20, device="cuda")
    torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.monotonic()
    emit("loop_start", t=t0)
    start_ev.record()
    iters = 0
    while time.monotonic() - t0 < args.loop_seconds:
        x.mul_(1.0001)
        x.add_(1.0)
        x.relu_()
        x.sum()
        iters += 1
        if iters % 16 == 0:
            torch.cuda.synchronize()
    end_ev.record()
    torch.cuda.synchronize()
    t1 = time.monotonic()
    emit("loop_end", t=t1, iterations=iters, ops_per_iteration=4, wall=t1 - t0,
         event_ms=start_ev.elapsed_time(end_ev))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpusim", required=True, help="gpusim's CLI (target/gpusim/bin/gpusim)")
    ap.add_argument("--loop-seconds", type=float, default=10.0)
    args = ap.parse_args()
    try:
        step_init(args)
        limit = step_properties(args)
    except Exception as e:  # noqa: BLE001  (nothing after this can run)
        emit("aborted", error=f"{type(e).__module__}.{type(e).__qualname__}: {e}",
             trace=traceback.format_exc())
        return 1
    # Each step on its own: one that fails is reported, exactly, and the next still runs.
    for name, fn in (("fill", step_fill), ("retry", step_retry), ("oom", step_oom),
                     ("empty_cache", step_empty_cache), ("libraries", lambda a, _l: step_libraries(a)),
                     ("loop", lambda a, _l: step_loop(a))):
        try:
            fn(args, limit)
        except Exception as e:  # noqa: BLE001
            emit(f"{name}_failed", error=f"{type(e).__module__}.{type(e).__qualname__}: {e}")
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
