//! The compute limiter's I/O half: the launch hooks, the per-GPU token buckets they pay
//! into, the first-launch probe, and the controller thread that feeds NVML samples to
//! `vcuda-limiter` (the maths) and applies its answers. ARCHITECTURE.md explains the
//! algorithm.
//!
//! **Hot path** (a launch under its share): one relaxed load of the launch's cost, one
//! relaxed `fetch_sub` on this process's bucket, done by [`bypass`] in the exported shell
//! itself, which then tail-calls the driver (`hooks!`'s `[bypass]` form). No lock, no system
//! call, no allocation, and nothing shared with other processes. A launch that finds the bucket empty takes the slow
//! path: act on the markers the GPU reached and record one (see "markers" below), refill
//! from the clock, and sleep (never spin) until the debt is repaid and three quarters of the
//! bucket is earned (few wake-ups: the CPU a throttled process costs); a launch
//! that slept adds the time it waited to the region's `throttled_ns` for its GPU (one
//! relaxed `fetch_add` on the container's shared line, only on this path).
//!
//! The buckets, probes and markers themselves (and the buckets' layout) are `buckets`',
//! held by the process state (`Vcuda::limiter`).

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use vcuda_contract::config::MAX_GPUS;
use vcuda_limiter as lim;

use crate::buckets::{
    destroy_events, mono_ns, wall_us, Bucket, MarkerSet, Probe, Reached, Stamp, CLASSES,
};
pub use crate::buckets::{GRAPH, KERNEL};
use crate::conv::{f64_to_i64, f64_to_u64, signed, u64_clamped, unsigned};
use crate::ffi::*;
use crate::log::{log, DEBUG, INFO, WARN};
use crate::state::{cuda, Vcuda};

hooks! {
    Cuda fn cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult => launch_kernel [bypass];
    Cuda fn cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult => launch_kernel_ptsz [bypass];
    Cuda fn cuLaunchKernelEx(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult => launch_ex [bypass];
    Cuda fn cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult => launch_ex_ptsz [bypass];
    Cuda fn cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void) -> CUresult => launch_coop [bypass];
    Cuda fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void) -> CUresult => launch_coop_ptsz [bypass];
    Cuda fn cuLaunchCooperativeKernelMultiDevice(list: *mut CUDA_LAUNCH_PARAMS, n: c_uint, flags: c_uint) -> CUresult => launch_coop_multi;
    Cuda fn cuLaunch(f: CUfunction) -> CUresult => launch_legacy;
    Cuda fn cuLaunchGrid(f: CUfunction, w: c_int, h: c_int) -> CUresult => launch_grid;
    Cuda fn cuLaunchGridAsync(f: CUfunction, w: c_int, h: c_int, stream: CUstream) -> CUresult => launch_grid_async;
}

const MISSING: CUresult = CUDA_ERROR_NOT_SUPPORTED;

/// Controller period.
const TICK: Duration = Duration::from_millis(50);
/// Longest single sleep of a throttled launch, so share changes reach sleepers quickly.
const MAX_SLEEP_NS: u64 = 20_000_000;
/// A process counts towards its container's split while it launched this recently.
const ACTIVE_NS: u64 = 1_000_000_000;
/// A probe whose end event has not completed after this long is abandoned.
const PROBE_TIMEOUT_NS: u64 = 5_000_000_000;
/// Longest a launch waits for the probe of an earlier one.
const PROBE_WAIT_NS: u64 = 200_000_000;

/// What the slow path asks the wrapper to do after the real launch.
pub enum Ticket {
    Go,
    /// Record the probe's end event on `stream` once the launch is queued.
    Probe {
        dev: usize,
        class: usize,
        stream: CUstream,
    },
}

/// Admit one launch of `class` on the current context's GPU: return at once while the
/// process is under its share, otherwise wait. `stream` is the launch's (with `ptsz`, the
/// per-thread default stream stands for NULL).
#[inline(always)]
pub fn admit(v: &Vcuda, class: usize, stream: CUstream, ptsz: bool) -> Ticket {
    let Some(dev) = v.current_dev() else {
        return Ticket::Go;
    };
    admit_on(v, dev, class, stream, ptsz, true)
}

#[inline(always)]
fn admit_on(
    v: &Vcuda,
    dev: usize,
    class: usize,
    stream: CUstream,
    ptsz: bool,
    probe: bool,
) -> Ticket {
    let Some(b) = v.limiter().gpus.get(dev) else {
        return Ticket::Go;
    };
    let cost = b.cost[class].load(Relaxed);
    if cost == 0 {
        return Ticket::Go;
    }
    if b.tokens.fetch_sub(signed(cost), Relaxed) > 0 {
        return Ticket::Go;
    }
    let stream = if ptsz && stream.is_null() {
        CU_STREAM_PER_THREAD
    } else {
        stream
    };
    slow(v, dev, class, cost, stream, probe)
}

/// The kernel launches' fast path, run by their shells (`hooks!`'s `[bypass]`) before any
/// catch or frame of ours: `true` when this launch is admitted and paid for (or not
/// limited), and the shell tail-calls the real function. It never panics, never starts the
/// state and calls no driver function, so it decides only for a started, unforked process
/// that sees one GPU (two relaxed loads and a `fetch_sub`); `false` leaves the launch to the
/// wrapper, which admits it as usual. A launch that finds the bucket empty gives its debit
/// straight back (the bucket was empty before it, so no other launch can pass on the
/// refund) and the wrapper's slow path pays again and waits.
#[inline(always)]
pub fn bypass() -> bool {
    let Some(v) = crate::state::started_unforked() else {
        return false;
    };
    let Some(dev) = v.single_dev() else {
        return false;
    };
    let Some(b) = v.limiter().gpus.get(dev) else {
        return true;
    };
    let cost = signed(b.cost[KERNEL].load(Relaxed));
    if cost == 0 || b.tokens.fetch_sub(cost, Relaxed) > 0 {
        return true;
    }
    b.tokens.fetch_add(cost, Relaxed);
    false
}

/// Most the bucket holds at `rate` ([`lim::marker_capacity`]: few enough launches that the
/// slow path, where markers bound the queue, comes at least every
/// [`lim::MARKER_LAUNCHES`]).
fn capacity(b: &Bucket, rate: u64) -> i64 {
    lim::marker_capacity(b.cost[KERNEL].load(Relaxed), rate)
}

/// The kernel price was set (a probe, a marker window or the calibration may lower it):
/// what the bucket holds beyond its capacity at the new price is forfeited, as a refill
/// would never have added it, and leaves the refilled total (it was never paid). Kept, a
/// balance earned at the old price (up to a bucket's worth, and the refund of a waiting
/// launch's prepayment) admitted balance / new price launches on the fast path, with no
/// slow path and so no marker to bound them: 1.5 ms of balance at a 1 µs price is 1500
/// launches, a second and a half of 1 ms kernels for a tenant that switches right after
/// the price fell (the likeliest cause of the one 96 % second issue 12's bench saw in 372
/// runs; the adversary's `pounce` mode tries it on purpose). Returns what was forfeited,
/// ns.
fn forfeit_excess(b: &Bucket) -> i64 {
    let cap = capacity(b, b.rate.load(Relaxed));
    let mut cut = 0;
    let _ = b.tokens.fetch_update(Relaxed, Relaxed, |t| {
        cut = t.saturating_sub(cap);
        (t > cap).then_some(cap)
    });
    if cut > 0 {
        let _ = b
            .refilled
            .fetch_update(Relaxed, Relaxed, |r| Some(r.saturating_sub(unsigned(cut))));
    }
    cut.max(0)
}

/// Add what the clock earned since the last refill (one thread wins the CAS and adds).
fn refill(b: &Bucket, now: u64) {
    let last = b.last_refill.load(Relaxed);
    if last == 0 {
        // The first launch: the clock starts now; nothing was earned before.
        let _ = b.last_refill.compare_exchange(0, now, Relaxed, Relaxed);
        return;
    }
    if now <= last
        || b.last_refill
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_err()
    {
        return;
    }
    let rate = b.rate.load(Relaxed);
    let cap = capacity(b, rate);
    let mut added = 0;
    let _ = b.tokens.fetch_update(Relaxed, Relaxed, |t| {
        let (n, a) = lim::refill(t, now - last, rate, cap);
        added = a;
        (a > 0).then_some(n)
    });
    b.refilled.fetch_add(unsigned(added), Relaxed);
}

#[cold]
#[inline(never)]
fn slow(v: &Vcuda, dev: usize, class: usize, cost: u64, stream: CUstream, probe: bool) -> Ticket {
    let b = &v.limiter().gpus[dev];
    // Work captured into a graph does not run now: refund it, never wait or probe in it.
    let mut capturing: u32 = 0;
    if ext!(MISSING, cuStreamIsCapturing(stream, &mut capturing)) == CUDA_SUCCESS && capturing != 0
    {
        b.tokens.fetch_add(signed(cost), Relaxed);
        return Ticket::Go;
    }
    if probe {
        if let Some(t) = start_probe(v, dev, class, cost, stream) {
            return t;
        }
    }
    b.waiting.fetch_add(signed(cost), Relaxed);
    let entered = mono_ns();
    let mut waited = false;
    // Markers the GPU reached are charged first (what ran unpaid is owed before this launch
    // is admitted), and while two are pending the launch waits for the oldest.
    let ctx = current_ctx();
    let mut slept = ctx.is_some_and(|ctx| pass_markers(v, dev, ctx, class, stream, entered));
    let mut cost = cost;
    let left = loop {
        let now = mono_ns();
        // Until the probe has timed a launch (briefly: one kernel), the others wait for it
        // and then pay its figure instead of the starting guess.
        if check_probes(v, dev) && now - entered < PROBE_WAIT_NS {
            slept = true;
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let cur = b.cost[class].load(Relaxed);
        if cur == 0 {
            break now; // exclusive now
        }
        if cur != cost {
            b.tokens.fetch_add(signed(cost) - signed(cur), Relaxed);
            b.waiting.fetch_add(signed(cur) - signed(cost), Relaxed);
            cost = cur;
            forfeit_excess(b);
        }
        refill(b, now);
        let bal = b.tokens.load(Relaxed) + signed(cost);
        if bal > 0 {
            break now;
        }
        if !waited {
            b.waits.fetch_add(1, Relaxed);
            waited = true;
        }
        // Sleep until three quarters of the bucket is earned, not just this launch: each
        // wake-up then admits many launches (what a throttled process burns is its
        // wake-ups, and each reads its markers), and a quarter is left to oversleep into
        // without losing earnings to the cap (a 90 % tenant keeps its queue fed).
        let rate = b.rate.load(Relaxed);
        let want = (1 - bal).max(capacity(b, rate) / 4 * 3);
        let ns = lim::wait_ns(want, rate).min(MAX_SLEEP_NS);
        slept = true;
        std::thread::sleep(Duration::from_nanos(ns));
    };
    // After a wait, a marker opens the launches admitted from now on, so the next window
    // times them and not the wait. Without one, the closing marker just recorded opens
    // them: a process under its share takes this path every `MARKER_LAUNCHES` launches
    // only to refill, and one event record less is half of what the markers cost it.
    if let (Some(ctx), true) = (ctx, slept) {
        open_marker(v, dev, ctx, class, stream);
    }
    b.waiting.fetch_sub(signed(cost), Relaxed);
    if slept {
        // The time actually slept (oversleeping included), from the readings the loop took
        // anyway: its first one and the one it left on. No extra clock read.
        v.add_throttled_ns(dev, left.saturating_sub(entered));
    }
    Ticket::Go
}

/// On the first throttled launch of a class on a GPU: record a start event before it and
/// ask the wrapper to record the end event after it.
fn start_probe(v: &Vcuda, dev: usize, class: usize, cost: u64, stream: CUstream) -> Option<Ticket> {
    let mut probes = v.limiter().probes.lock();
    let free = match probes[dev][class] {
        Probe::Idle => {
            probes[dev][class] = Probe::Armed { free: 1 };
            v.limiter().gpus[dev]
                .tokens
                .fetch_add(signed(cost), Relaxed);
            return Some(Ticket::Go);
        }
        Probe::Armed { free } => free,
        _ => return None,
    };
    let (mut start, mut end): (CUevent, CUevent) = (std::ptr::null_mut(), std::ptr::null_mut());
    let ok = ext!(MISSING, cuEventCreate(&mut start, CU_EVENT_DEFAULT)) == CUDA_SUCCESS
        && ext!(MISSING, cuEventCreate(&mut end, CU_EVENT_DEFAULT)) == CUDA_SUCCESS
        && ext!(MISSING, cuEventRecord(start, stream)) == CUDA_SUCCESS;
    if !ok {
        destroy_events(start, end);
        log!(
            DEBUG,
            "GPU {dev}: cannot time the first launch with events; calibrating from NVML alone"
        );
        // The arming launch pays the starting guess after all.
        charge(&v.limiter().gpus[dev], free, cost);
        probes[dev][class] = Probe::Done;
        return None;
    }
    probes[dev][class] = Probe::Pending {
        start: start as usize,
        end: end as usize,
        since: mono_ns(),
        free: free + 1,
    };
    // The probed launch is admitted now and charged what it measures once it has run.
    v.limiter().gpus[dev]
        .tokens
        .fetch_add(signed(cost), Relaxed);
    Some(Ticket::Probe { dev, class, stream })
}

/// Charge `n` launches admitted free at `cost` each.
fn charge(b: &Bucket, n: u32, cost: u64) {
    b.tokens
        .fetch_sub(i64::from(n).saturating_mul(signed(cost)), Relaxed);
}

/// After the real launch: record the probe's end event (or give the probe up if the launch
/// failed, to try again on a later launch).
#[inline(always)]
pub fn finish(v: &Vcuda, t: Ticket, rc: CUresult) -> CUresult {
    if let Ticket::Probe { dev, class, stream } = t {
        end_probe(v, dev, class, stream, rc);
    }
    rc
}

#[cold]
fn end_probe(v: &Vcuda, dev: usize, class: usize, stream: CUstream, rc: CUresult) {
    let mut probes = v.limiter().probes.lock();
    let Probe::Pending {
        start, end, free, ..
    } = probes[dev][class]
    else {
        return;
    };
    if rc == CUDA_SUCCESS && ext!(MISSING, cuEventRecord(end as CUevent, stream)) == CUDA_SUCCESS {
        return;
    }
    destroy_events(start as CUevent, end as CUevent);
    let b = &v.limiter().gpus[dev];
    probes[dev][class] = if rc == CUDA_SUCCESS {
        charge(b, free, b.cost[class].load(Relaxed));
        Probe::Done
    } else {
        // The launch failed: it ran nothing; probe the next one.
        Probe::Armed { free: free - 1 }
    };
}

/// Complete pending probes of `dev` whose end event has passed; returns whether one is
/// still pending.
fn check_probes(v: &Vcuda, dev: usize) -> bool {
    let mut probes = v.limiter().probes.lock();
    let mut pending = false;
    for class in 0..CLASSES {
        let Probe::Pending {
            start,
            end,
            since,
            free,
        } = probes[dev][class]
        else {
            continue;
        };
        let b = &v.limiter().gpus[dev];
        let rc = ext!(MISSING, cuEventQuery(end as CUevent));
        if rc == CUDA_ERROR_NOT_READY && mono_ns().saturating_sub(since) < PROBE_TIMEOUT_NS {
            pending = true;
            continue;
        }
        let mut ms: f32 = 0.0;
        if rc == CUDA_SUCCESS
            && ext!(
                MISSING,
                cuEventElapsedTime(&mut ms, start as CUevent, end as CUevent)
            ) == CUDA_SUCCESS
        {
            let ns = f64_to_u64((f64::from(ms) * 1e6).clamp(lim::MIN_COST_NS, lim::MAX_COST_NS));
            if b.cost[class].load(Relaxed) != 0 {
                b.cost[class].store(ns, Relaxed);
            }
            charge(b, free, ns);
            forfeit_excess(b);
            v.limiter().probed[dev][class].store(ns, Relaxed);
            log!(
                DEBUG,
                "GPU {dev}: first launch (class {class}) took {ns} ns of device time"
            );
        } else {
            log!(
                DEBUG,
                "GPU {dev}: the probe's events failed ({rc}); calibrating from NVML alone"
            );
            charge(b, free, b.cost[class].load(Relaxed));
        }
        destroy_events(start as CUevent, end as CUevent);
        probes[dev][class] = Probe::Done;
    }
    pending
}

/// A context is going away: pending probes' events go with it. Forget them (the next
/// throttled launch probes again).
pub fn forget_probes(v: &Vcuda) {
    let mut probes = v.limiter().probes.lock();
    for p in probes.iter_mut().flatten() {
        if let Probe::Pending { free, .. } = *p {
            *p = Probe::Armed { free };
        }
    }
}

// ---- markers -----------------------------------------------------------------------------

/// Longest a throttled launch waits for the GPU to reach the oldest pending marker before
/// giving that marker up: its stream may be waiting for the host (for this very thread, say,
/// to write what a `cuStreamWaitValue32` waits for), and a launch must never deadlock.
const MARKER_PATIENCE_NS: u64 = 500_000_000;

/// When a launch on `dev` finds the bucket empty: act on what the markers the GPU reached
/// proved (charge what ran unpaid, price a kernel launch at least or at most as their
/// windows say); while the maths say not to admit ([`lim::Markers::may_admit_at`]: as many
/// as [`lim::MAX_PENDING_MARKERS`] pending, or more than [`lim::PROMPT_PENDING`] and the
/// oldest running late), wait (napping, [`lim::marker_naps`]) for the oldest, giving it up
/// after [`MARKER_PATIENCE_NS`]; then record a marker in the launch's
/// stream that closes the launches admitted since the slow path last let one through
/// ([`open_marker`] opened them), so the window times them and not this path's sleeps.
/// Returns whether it slept.
fn pass_markers(
    v: &Vcuda,
    dev: usize,
    ctx: usize,
    class: usize,
    stream: CUstream,
    entered: u64,
) -> bool {
    let b = &v.limiter().gpus[dev];
    let others = b.others.load(Relaxed) as f64 / lim::PPM as f64;
    let mut nap = None;
    let mut slept = false;
    loop {
        let mut sets = v.limiter().markers.lock();
        let set = &mut sets[dev];
        let r = set.reap(others);
        act_on(v, dev, &r);
        let now = mono_ns();
        set.maths.seen(now as f64);
        // Naps (doubling, few wake-ups) sized by the work queued behind the newest marker:
        // back before the GPU runs out of it.
        let (first, longest) = lim::marker_naps(set.maths.newest_paid_ns().map_or(0.0, |p| {
            launches_paid(paid_total(b), b.debts.load(Relaxed)) as f64 - p
        }));
        let nap = nap.get_or_insert(first);
        *nap = (*nap).min(longest);
        let admit = set.maths.may_admit_at(now as f64, others);
        if !admit && now.saturating_sub(entered) >= MARKER_PATIENCE_NS {
            log!(
                DEBUG,
                "GPU {dev}: the GPU did not reach a marker in {} ms; giving it up",
                MARKER_PATIENCE_NS / 1_000_000
            );
            set.give_up_oldest();
        }
        if admit || set.maths.may_admit_at(now as f64, others) {
            record_in(b, set, ctx, stream, class, now, true);
            return slept;
        }
        drop(sets);
        std::thread::sleep(Duration::from_nanos(*nap));
        slept = true;
        *nap *= 2;
    }
}

/// When the slow path lets a launch through: a marker in its stream that opens the launches
/// it admits from now on.
/// (The window between the closing marker and this one holds no launch: whether the GPU
/// was behind is not asked.)
fn open_marker(v: &Vcuda, dev: usize, ctx: usize, class: usize, stream: CUstream) {
    let b = &v.limiter().gpus[dev];
    let mut sets = v.limiter().markers.lock();
    record_in(b, &mut sets[dev], ctx, stream, class, mono_ns(), false);
}

fn record_in(
    b: &Bucket,
    set: &mut MarkerSet,
    ctx: usize,
    stream: CUstream,
    class: usize,
    now: u64,
    ask: bool,
) {
    let paid = launches_paid(paid_total(b), b.debts.load(Relaxed)) as f64;
    let cost = b.cost[class].load(Relaxed) as f64;
    set.record(ctx, stream, class, Stamp { paid, cost, now }, ask);
}

/// The calling thread's current context, if any.
fn current_ctx() -> Option<usize> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    (ext!(MISSING, cuCtxGetCurrent(&mut ctx)) == CUDA_SUCCESS && !ctx.is_null())
        .then_some(ctx as usize)
}

/// Charge what marker windows showed ran unpaid, and move the kernel price to what they
/// proved (the controller's calibration takes it over as a measurement).
fn act_on(v: &Vcuda, dev: usize, r: &Reached) {
    let b = &v.limiter().gpus[dev];
    if r.debt_ns > 0.0 {
        let d = f64_to_i64(r.debt_ns);
        b.tokens.fetch_sub(d, Relaxed);
        b.debts.fetch_add(d, Relaxed);
        log!(
            DEBUG,
            "GPU {dev}: a marker window ran {d} ns of device time unpaid; charged"
        );
    }
    let cur = b.cost[KERNEL].load(Relaxed);
    let new = if r.raise > cur as f64 {
        r.raise
    } else if r.lower > 0.0 && r.lower < cur as f64 {
        r.lower
    } else {
        return;
    };
    if cur == 0 {
        return; // exclusive
    }
    let new = f64_to_u64(new).max(f64_to_u64(lim::MIN_COST_NS));
    b.cost[KERNEL].store(new, Relaxed);
    let cut = forfeit_excess(b);
    v.limiter().probed[dev][KERNEL].store(new, Relaxed);
    if new > cur {
        // Alone: a window's GPU time was all this process's. Beside others not yet
        // measured (a process's first NVML sample comes after its first 1/6-1 s), their
        // kernels between two markers read as this one's: such a raise may be false, and
        // the calibration must stay free to undo it.
        let alone = b.sampled.load(Relaxed) && b.others.load(Relaxed) < lim::PPM / 20;
        v.limiter().raised_alone[dev].store(alone, Relaxed);
        v.limiter().raised_us[dev].store(wall_us(), Relaxed);
    }
    log!(
        DEBUG,
        "GPU {dev}: marker windows price a launch at {new} ns (was {cur}){}",
        if cut > 0 {
            format!("; {cut} ns of balance beyond the new capacity forfeited")
        } else {
            String::new()
        }
    );
}

/// Contexts went away: the markers whose events went with them start over. `ctx`: that
/// context was destroyed; `ordinal`: that device's primary context was released or reset
/// (and is inactive now, so any context of the device may have been it: its markers start
/// over, leaking at most a few events of another context still alive).
pub fn forget_markers(v: &Vcuda, ctx: Option<CUcontext>, ordinal: Option<CUdevice>) {
    let dev = ordinal.and_then(|o| v.dev_of_ordinal(o));
    for (i, set) in v.limiter().markers.lock().iter_mut().enumerate() {
        if ctx.is_some_and(|c| c as usize == set.ctx) || dev == Some(i) {
            set.forget();
        }
    }
}

// ---- the wrappers ------------------------------------------------------------------------

/// Admit, launch with `launch`, finish. Refused processes get the refusal (fail closed).
#[inline(always)]
fn limited(
    class: usize,
    stream: CUstream,
    ptsz: bool,
    launch: impl FnOnce() -> CUresult,
) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let t = admit(v, class, stream, ptsz);
    finish(v, t, launch())
}

/// `cuGraphLaunch(_ptsz)` (the hooks live with graph memory in `memory`).
#[inline(always)]
pub fn graph_launch(stream: CUstream, ptsz: bool, launch: impl FnOnce() -> CUresult) -> CUresult {
    limited(GRAPH, stream, ptsz, launch)
}

#[allow(clippy::too_many_arguments)]
unsafe fn launch_kernel(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    limited(KERNEL, stream, false, || {
        forward!(
            MISSING,
            cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
        )
    })
}

#[allow(clippy::too_many_arguments)]
unsafe fn launch_kernel_ptsz(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    limited(KERNEL, stream, true, || {
        forward!(
            MISSING,
            cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
        )
    })
}

/// The stream a `CUlaunchConfig` names (NULL for a NULL config: the driver rejects it).
unsafe fn config_stream(config: *const CUlaunchConfig) -> CUstream {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a non-NULL config points to a CUlaunchConfig (the caller's contract).
    unsafe { (*config).hStream }
}

unsafe fn launch_ex(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's config, as passed.
    let stream = unsafe { config_stream(config) };
    limited(KERNEL, stream, false, || {
        forward!(MISSING, cuLaunchKernelEx(config, f, params, extra))
    })
}

unsafe fn launch_ex_ptsz(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's config, as passed.
    let stream = unsafe { config_stream(config) };
    limited(KERNEL, stream, true, || {
        forward!(MISSING, cuLaunchKernelEx_ptsz(config, f, params, extra))
    })
}

#[allow(clippy::too_many_arguments)]
unsafe fn launch_coop(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    limited(KERNEL, stream, false, || {
        forward!(
            MISSING,
            cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params)
        )
    })
}

#[allow(clippy::too_many_arguments)]
unsafe fn launch_coop_ptsz(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    limited(KERNEL, stream, true, || {
        forward!(
            MISSING,
            cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params)
        )
    })
}

/// One launch per listed device, each paid on its stream's GPU (the current GPU when the
/// driver cannot say). The first entry may be probed.
unsafe fn launch_coop_multi(list: *mut CUDA_LAUNCH_PARAMS, n: c_uint, flags: c_uint) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let mut ticket = Ticket::Go;
    if !list.is_null() {
        for i in 0..n as usize {
            // SAFETY: list holds n entries (the caller's contract).
            let stream = unsafe { (*list.add(i)).hStream };
            let mut ord: CUdevice = -1;
            let dev = if ext!(MISSING, cuStreamGetDevice(stream, &mut ord)) == CUDA_SUCCESS {
                v.dev_of_ordinal(ord)
            } else {
                v.current_dev()
            };
            if let Some(dev) = dev {
                let t = admit_on(v, dev, KERNEL, stream, false, i == 0);
                if i == 0 {
                    ticket = t;
                }
            }
        }
    }
    finish(
        v,
        ticket,
        forward!(
            MISSING,
            cuLaunchCooperativeKernelMultiDevice(list, n, flags)
        ),
    )
}

unsafe fn launch_legacy(f: CUfunction) -> CUresult {
    limited(KERNEL, std::ptr::null_mut(), false, || {
        forward!(MISSING, cuLaunch(f))
    })
}

unsafe fn launch_grid(f: CUfunction, w: c_int, h: c_int) -> CUresult {
    limited(KERNEL, std::ptr::null_mut(), false, || {
        forward!(MISSING, cuLaunchGrid(f, w, h))
    })
}

unsafe fn launch_grid_async(f: CUfunction, w: c_int, h: c_int, stream: CUstream) -> CUresult {
    limited(KERNEL, stream, false, || {
        forward!(MISSING, cuLaunchGridAsync(f, w, h, stream))
    })
}

// ---- the controller ----------------------------------------------------------------------

/// What the controller keeps per GPU between ticks.
struct GpuCtl {
    cal: lim::Calibrator,
    /// Graph launch cost, ns.
    graph_cost: f64,
    last_paid: u64,
    last_waits: u64,
    /// What has been read of NVML's per-process samples (period, newest, pid seen).
    sampler: lim::samples::Sampler,
    elastic_rate: u64,
    exclusive: bool,
    /// Whether the ledger's origin is settled: given ([`Limiter::born_us`]), or none
    /// because the process began exclusive.
    origin: bool,
    /// Whether the first-launch probe's lump charge was noted to the calibration.
    probe_paid: bool,
}

impl GpuCtl {
    fn new() -> GpuCtl {
        GpuCtl {
            cal: lim::Calibrator::default(),
            graph_cost: lim::INITIAL_COST_NS,
            last_paid: 0,
            last_waits: 0,
            sampler: lim::samples::Sampler::default(),
            elastic_rate: 0,
            exclusive: false,
            origin: false,
            probe_paid: false,
        }
    }
}

/// Start the controller thread (also in a forked child).
pub fn start_controller() {
    let spawned = std::thread::Builder::new()
        .name("vcuda-limit".into())
        .stack_size(256 * 1024)
        .spawn(|| {
            let mut ctl: Vec<GpuCtl> = (0..MAX_GPUS).map(|_| GpuCtl::new()).collect();
            let mut buf = vec![nvmlProcessUtilizationSample_t::default(); 256];
            loop {
                std::thread::sleep(TICK);
                if crate::state::stopping() {
                    return;
                }
                let Ok(v) = cuda() else { return };
                for (dev, c) in ctl.iter_mut().enumerate().take(v.gpu_count()) {
                    tick(v, dev, c, &mut buf);
                }
            }
        });
    if let Err(e) = spawned {
        log!(WARN, "cannot start the limiter thread ({e}): launches are held to the configured share with an uncalibrated cost");
    }
}

fn tick(v: &Vcuda, dev: usize, c: &mut GpuCtl, buf: &mut [nvmlProcessUtilizationSample_t]) {
    let b = &v.limiter().gpus[dev];
    let now = mono_ns();
    let (share, limit) = v.container_share(dev);

    // Activity: publish when this process last launched, count the container's launchers.
    let paid = paid_total(b);
    if paid != c.last_paid {
        v.note_launched(dev, now);
    }
    let active = crate::conv::u32_sat(v.launchers(dev, now, ACTIVE_NS).max(1));

    // Exclusive: no throttling at all.
    if share >= lim::PPM {
        // Work run while exclusive was never paid: the ledger has no origin then, and
        // starts from its first tick.
        c.origin = true;
        if !c.exclusive {
            c.exclusive = true;
            for k in &b.cost {
                k.store(0, Relaxed);
            }
            log!(INFO, "GPU {dev}: exclusive, launches are not throttled");
        }
        c.last_paid = paid;
        return;
    }
    if c.exclusive {
        c.exclusive = false;
        b.tokens.store(0, Relaxed);
        log!(INFO, "GPU {dev}: shared again, launches are throttled");
    }

    // A probe's measurement replaces the estimate; graphs keep their own base cost and are
    // rescaled with the kernel cost.
    let kp = v.limiter().probed[dev][KERNEL].swap(0, Relaxed);
    if kp != 0 {
        c.cal.set_cost(kp as f64);
    }
    let raised = v.limiter().raised_us[dev].swap(0, Relaxed);
    if raised != 0 {
        c.cal
            .raised_at(raised, v.limiter().raised_alone[dev].load(Relaxed));
    }
    let gp = v.limiter().probed[dev][GRAPH].swap(0, Relaxed);
    if gp != 0 {
        c.graph_cost = gp as f64;
    }
    // The calibration and the ledger count what launches paid, debts left out.
    // The ledger (issue 12): NVML's measured device time minus what launches paid is owed,
    // whatever the estimate said a launch cost; `debts` holds every debt charged so far.
    let t_us = wall_us();
    let debts = b.debts.load(Relaxed);
    if !c.origin {
        // Paid 0 then (the counters start at 0), and the first tick came later (skipped if
        // the process began exclusive: see above).
        c.cal.record_origin(v.limiter().born_us.load(Relaxed), 0);
        c.origin = true;
    }
    if kp != 0 && !c.probe_paid {
        // The probe charged the launches admitted before it measured (`check_probes`).
        c.probe_paid = true;
        c.cal.paid_unpriced_by(t_us);
    }
    c.cal.record_paid(t_us, launches_paid(paid, debts));
    c.cal.record_debt(t_us, debts as f64);

    // NVML: this process's samples feed the calibration; everyone's, the elastic share.
    let (share_p, limit_p) = (lim::split(share, active), lim::split(limit, active));
    let newest = if paid > 0 {
        read_samples(v, dev, c, buf)
    } else {
        None
    };
    let old = c.cal.cost_ns();
    let new = c.cal.update();
    if (new / old - 1.0).abs() > 0.01 {
        log!(
            DEBUG,
            "GPU {dev}: launch cost estimate {old:.0} -> {new:.0} ns"
        );
    }
    if new != old {
        c.graph_cost = (c.graph_cost * new / old).clamp(lim::MIN_COST_NS, lim::MAX_COST_NS);
    }
    b.cost[KERNEL].store(f64_to_u64(new), Relaxed);
    b.cost[GRAPH].store(f64_to_u64(c.graph_cost), Relaxed);
    forfeit_excess(b);

    // The rate: the share, or for an elastic container something between share and limit.
    let waits = b.waits.load(Relaxed);
    if let Some((others, _)) = newest {
        b.others.store(
            f64_to_u64(others.clamp(0.0, 1.0) * lim::PPM as f64),
            Relaxed,
        );
        b.sampled.store(true, Relaxed);
    }
    let rate = if limit_p > share_p {
        if let Some((others, own)) = newest {
            c.elastic_rate = lim::elastic_rate(
                c.elastic_rate,
                share_p,
                limit_p,
                others,
                own,
                waits != c.last_waits,
            );
            c.last_waits = waits;
        }
        c.elastic_rate.clamp(share_p, limit_p)
    } else {
        share_p
    };
    b.rate.store(rate, Relaxed);
    c.last_paid = paid;
}

/// What launches paid of `paid` (a bucket's [`paid_total`]), the ledger's debts left out.
fn launches_paid(paid: u64, charged: i64) -> u64 {
    u64_clamped(i128::from(paid) - i128::from(charged))
}

/// The ledger's settlement after a sample: charge the bucket what NVML measured running
/// unpaid beyond what was charged, or refund a charge NVML did not confirm
/// (`Calibrator::settle`).
fn settle(b: &Bucket, cal: &mut lim::Calibrator, dev: usize) {
    let cap = capacity(b, b.rate.load(Relaxed));
    let mut d = cal.settle(b.debts.load(Relaxed) as f64, cap as f64);
    if d < 0 {
        // A refund fills the bucket no further than a refill may: refunded time is still
        // time this process may use only at its rate (an unbounded refund admitted a
        // second of work at once, queued past every marker). What does not fit is not
        // refunded, and stays charged.
        let mut applied = 0;
        let _ = b.tokens.fetch_update(Relaxed, Relaxed, |t| {
            applied = (-d).min(cap.saturating_sub(t)).max(0);
            (applied > 0).then_some(t + applied)
        });
        d = -applied;
    } else if d > 0 {
        b.tokens.fetch_sub(d, Relaxed);
    }
    if d != 0 {
        let all = b.debts.fetch_add(d, Relaxed) + d;
        log!(
            DEBUG,
            "GPU {dev}: ledger {} {} ns of device time (charged in all {all} ns)",
            if d > 0 { "charges" } else { "refunds" },
            d.unsigned_abs(),
        );
    }
}

/// Device time this process has paid for on a bucket, ns: what was added, less what is
/// left, less what waiting launches were charged (debts charged by the ledger included).
fn paid_total(b: &Bucket) -> u64 {
    let p = i128::from(b.refilled.load(Relaxed))
        - i128::from(b.tokens.load(Relaxed))
        - i128::from(b.waiting.load(Relaxed));
    u64_clamped(p)
}

/// The sample period from the device's utilization samples, which NVML keeps for every
/// period, busy or not: consecutive timestamps are exactly one period apart. A process's
/// own samples exist only for periods it ran in, so the gaps between them can be multiples
/// of it, and a sparse tenant's samples were read as covering several periods (its cost
/// estimate drifted up: 5 % with 20 ms kernels got 3.4 %).
/// Asks for the samples since `since_us` (5 s: 30 samples at 1/6 s, 5 at 1 s, within the
/// buffer); [`lim::samples::Sampler::device_samples`] decides.
fn learn_period(handle: usize, c: &mut GpuCtl, since_us: u64) {
    let mut buf = [nvmlSample_t::default(); 64];
    let mut n = crate::conv::u32_sat(buf.len());
    let mut kind: u32 = 0;
    let rc = ext!(
        NVML_ERROR_FUNCTION_NOT_FOUND,
        nvmlDeviceGetSamples(
            handle as nvmlDevice_t,
            NVML_GPU_UTILIZATION_SAMPLES,
            since_us,
            &mut kind,
            &mut n,
            buf.as_mut_ptr()
        )
    );
    if rc != NVML_SUCCESS {
        return;
    }
    let mut ts = [0u64; 64];
    let n = (n as usize).min(buf.len());
    for (t, s) in ts.iter_mut().zip(&buf[..n]) {
        *t = s.timeStamp;
    }
    c.sampler.device_samples(&mut ts[..n]);
}

/// Read NVML samples newer than the last seen; feed this process's periods (and the idle
/// ones NVML kept no sample of) to the calibrator, settling the ledger after each.
/// Returns (others, own) utilization of the newest complete period, if there is one.
fn read_samples(
    v: &Vcuda,
    dev: usize,
    c: &mut GpuCtl,
    buf: &mut [nvmlProcessUtilizationSample_t],
) -> Option<(f64, f64)> {
    let handle = v.nvml_handle(dev)?;
    let mut n = crate::conv::u32_sat(buf.len());
    let rc = ext!(
        NVML_ERROR_FUNCTION_NOT_FOUND,
        nvmlDeviceGetProcessUtilization(
            handle as nvmlDevice_t,
            buf.as_mut_ptr(),
            &mut n,
            c.sampler.since_us()
        )
    );
    if rc != NVML_SUCCESS {
        return None;
    }
    if let Some(since) = c.sampler.wants_period() {
        learn_period(handle, c, since);
    }
    let len = (n as usize).min(buf.len());
    let samples = &mut buf[..len];
    samples.sort_unstable_by_key(|s| s.timeStamp);
    let pid = v.driver_pid();
    let b = &v.limiter().gpus[dev];
    let GpuCtl { sampler, cal, .. } = c;
    let newest = sampler.read(
        samples.iter().map(|s| (s.timeStamp, s.pid, s.smUtil)),
        pid,
        |p| {
            if cal.sample(p.end_us, p.len_us, p.util_pct) {
                settle(b, cal, dev);
            }
        },
    );
    newest.map(|n| (n.others, n.own))
}
