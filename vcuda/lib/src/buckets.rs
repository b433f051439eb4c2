//! The compute limiter's per-process state, which the process state (`state::Vcuda`) holds
//! and `limit` acts on: one token [`Bucket`] per GPU, the first-launch [`Probe`]s, and each
//! GPU's [`MarkerSet`] (the one owner of its marker events). Below `state`: nothing here
//! knows the process state.
//!
//! **Bucket layout** ([`Bucket`], one per GPU, 128-byte aligned so GPUs do not share a
//! line). All fields are independent counters or settings, so every access is `Relaxed`:
//! nothing is published through them, and a stale read costs at most one launch's
//! admission at the old cost or rate, corrected on the next refill.
//! - `tokens`: device-ns balance, may go negative by what waiting launches already paid;
//! - `cost[class]`: device-ns charged per launch (kernel, graph); 0 = not throttled;
//! - `rate`: device-ns earned per wall-ns, ppm;
//! - `last_refill`: monotonic ns of the last refill (a CAS elects one refiller); 0 until
//!   the first throttled launch, so nothing is banked before it;
//! - `refilled`: total tokens ever added, so paid = refilled - tokens without a counter on
//!   the hot path;
//! - `waits`: launches that had to wait (the controller reads it as "hungry");
//! - `waiting`: what launches still waiting have been charged (not yet paid for work that
//!   can run, so the calibration leaves it out);
//! - `debts`: every debt charged to the bucket so far (the ledger's, less its refunds, and
//!   the markers'), so what launches paid = paid - debts;
//! - `others`: the fraction of the device other processes used in the newest NVML sample,
//!   ppm (the markers read it); `sampled`: there was such a sample (else `others` is 0
//!   for want of one);
//!   Launches admitted before their cost is known (arming and running the probe) are charged
//!   what the probe measures once it has.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;
use vcuda_contract::config::MAX_GPUS;
use vcuda_limiter as lim;

use crate::conv::{f64_to_u64, unsigned};
use crate::ffi::*;

const MISSING: CUresult = CUDA_ERROR_NOT_SUPPORTED;

/// Launch classes: kernels, and graphs (whose launches cost many kernels).
pub const KERNEL: usize = 0;
pub const GRAPH: usize = 1;
pub const CLASSES: usize = 2;

/// One GPU's token bucket (see the module docs for the layout and orderings).
#[repr(C, align(128))]
#[derive(Default)]
pub struct Bucket {
    pub tokens: AtomicI64,
    pub cost: [AtomicU64; CLASSES],
    pub rate: AtomicU64,
    pub last_refill: AtomicU64,
    pub refilled: AtomicU64,
    pub waits: AtomicU64,
    pub waiting: AtomicI64,
    pub debts: AtomicI64,
    pub others: AtomicU64,
    pub sampled: AtomicBool,
}

/// The first-launch probe of one GPU and class: device time of one launch, timed with
/// events around it.
#[derive(Clone, Copy, Default)]
pub enum Probe {
    /// Not tried yet (or abandoned because its context went away): the next throttled
    /// launch is admitted free and arms the probe.
    #[default]
    Idle,
    /// The launch after the arming one is probed: its start event then completes when the
    /// arming kernel ends, so the probe times the kernel, not the host's gap between calls
    /// (unless the kernels are shorter than that gap, when the gap is what they occupy).
    /// `free`: launches admitted so far without being charged.
    Armed { free: u32 },
    /// Events recorded around a launch at `since` (monotonic ns); `free` launches (this one
    /// included) wait to be charged its measurement.
    Pending {
        start: usize,
        end: usize,
        since: u64,
        free: u32,
    },
    /// Measured, or failed for good.
    Done,
}

/// The limiter state of a process.
pub struct Limiter {
    pub gpus: [Bucket; MAX_GPUS],
    /// Probe states; taken only on the slow path.
    pub probes: Mutex<[[Probe; CLASSES]; MAX_GPUS]>,
    /// A probe's (or a marker window's) measurement (ns) for the controller to take over,
    /// 0 = none.
    pub probed: [[AtomicU64; CLASSES]; MAX_GPUS],
    /// When marker windows last raised the kernel price (wall µs, 0 = not since the
    /// controller looked), and whether the process was then known to be alone on the GPU
    /// (NVML showed no other process's work): the calibration reads the NVML period
    /// holding the raise as a filling one, and holds an alone process's raised price as a
    /// floor ([`lim::Calibrator::raised_at`]).
    pub raised_us: [AtomicU64; MAX_GPUS],
    pub raised_alone: [AtomicBool; MAX_GPUS],
    /// Markers per GPU; taken only on the slow path, never held while sleeping.
    pub markers: Mutex<[MarkerSet; MAX_GPUS]>,
    /// When this limiter (or, in a forked child, its fresh start) was made, wall µs: before
    /// any launch, so nothing was paid or queued then (the ledger's origin).
    pub born_us: AtomicU64,
}

impl Limiter {
    /// Buckets for the container's GPUs: throttled at the configured share unless exclusive.
    pub fn new(cores: &[u32]) -> Limiter {
        let l = Limiter {
            gpus: Default::default(),
            probes: Mutex::new([[Probe::Idle; CLASSES]; MAX_GPUS]),
            probed: Default::default(),
            raised_us: Default::default(),
            raised_alone: Default::default(),
            markers: Mutex::new(Default::default()),
            born_us: AtomicU64::new(wall_us()),
        };
        for (dev, &core) in cores.iter().enumerate().take(MAX_GPUS) {
            let b = &l.gpus[dev];
            let share = u64::from(core) * (lim::PPM / 100);
            b.rate.store(share.min(lim::PPM), Relaxed);
            if share < lim::PPM {
                for c in &b.cost {
                    c.store(f64_to_u64(lim::INITIAL_COST_NS), Relaxed);
                }
            }
        }
        l
    }

    /// In a forked child: a fresh start (the parent's events and figures are not ours).
    pub fn reset_after_fork(&self) {
        for b in &self.gpus {
            b.tokens.store(0, Relaxed);
            b.last_refill.store(0, Relaxed);
            b.refilled.store(0, Relaxed);
            b.waits.store(0, Relaxed);
            b.waiting.store(0, Relaxed);
            b.debts.store(0, Relaxed);
        }
        self.born_us.store(wall_us(), Relaxed);
        *self.probes.lock() = [[Probe::Idle; CLASSES]; MAX_GPUS];
        // The parent's events are not the child's to use or destroy.
        for m in self.markers.lock().iter_mut() {
            m.forget();
        }
    }
}

/// Monotonic clock, ns (vDSO: no system call).
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    unsigned(ts.tv_sec) * 1_000_000_000 + unsigned(ts.tv_nsec)
}

/// Wall clock, µs (NVML stamps its samples with it).
pub fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

pub fn destroy_events(a: CUevent, b: CUevent) {
    for e in [a, b] {
        if !e.is_null() {
            ext!(MISSING, cuEventDestroy_v2(e));
        }
    }
}

/// A marker's event and where it was recorded.
#[derive(Clone, Copy)]
struct Mark {
    event: usize,
    stream: usize,
    /// The launch class of the slow path that recorded it.
    class: usize,
}

/// After another stream was seen on the slow path, windows prove nothing for this long: a
/// window holds its own stream's launches and whatever other streams ran meanwhile, which
/// may have been paid before it.
const MIXED_STREAMS_NS: u64 = 1_000_000_000;

/// When a marker was recorded: the paid total (debts left out), the price in force, and
/// the host clock (monotonic ns).
#[derive(Clone, Copy)]
pub struct Stamp {
    pub paid: f64,
    pub cost: f64,
    pub now: u64,
}

/// What reaching markers showed: device time that ran unpaid, to charge now, and what a
/// kernel launch costs at least (`raise`) or at most (`lower`) by windows of kernel
/// launches (0: nothing shown).
#[derive(Default)]
pub struct Reached {
    pub debt_ns: f64,
    pub raise: f64,
    pub lower: f64,
}

/// The markers of one GPU: the maths ([`lim::Markers`]) and their events, which belong to
/// one context. Owned by [`Limiter::markers`]; every event it created is destroyed by it
/// (`clear`) or went with its context (`forget`).
#[derive(Default)]
pub struct MarkerSet {
    pub maths: lim::Markers,
    /// The pending markers' events, oldest first (the maths' pending, one for one).
    pending: std::collections::VecDeque<Mark>,
    /// The newest marker the GPU reached: the next window is timed from it.
    done: Option<Mark>,
    /// Events to record again (recording an event again is allowed).
    spare: Vec<usize>,
    /// The context the events belong to (0: none yet).
    pub ctx: usize,
    /// Until when (monotonic ns) windows prove nothing ([`MIXED_STREAMS_NS`]).
    mixed_until: u64,
}

impl MarkerSet {
    /// Take every marker the GPU reached, oldest first, from the pending ones.
    pub fn reap(&mut self, others: f64) -> Reached {
        let mut r = Reached::default();
        while let Some(&m) = self.pending.front() {
            match ext!(MISSING, cuEventQuery(m.event as CUevent)) {
                CUDA_SUCCESS => self.reached(m, others, &mut r),
                CUDA_ERROR_NOT_READY => break,
                _ => self.give_up_oldest(),
            }
        }
        r
    }

    /// The oldest pending marker `m` was reached.
    fn reached(&mut self, m: Mark, others: f64, r: &mut Reached) {
        self.pending.pop_front();
        // Only a window between two markers of one stream is device time in order.
        let elapsed = self.done.filter(|d| d.stream == m.stream).and_then(|d| {
            let mut ms: f32 = 0.0;
            (ext!(
                MISSING,
                cuEventElapsedTime(&mut ms, d.event as CUevent, m.event as CUevent)
            ) == CUDA_SUCCESS)
                .then_some(f64::from(ms) * 1e6)
        });
        let kernels = m.class == KERNEL && self.done.is_some_and(|d| d.class == KERNEL);
        let verdict = self.maths.reached(elapsed, others);
        // With several streams, a window also holds other streams' work paid before it.
        if mono_ns() < self.mixed_until {
            return self.passed(m);
        }
        match verdict {
            Some(lim::Verdict::Underpaid(u)) => {
                r.debt_ns += u.debt_ns;
                if kernels {
                    r.raise = r.raise.max(u.per_launch_ns);
                }
            }
            Some(lim::Verdict::Overpaid { per_launch_ns }) if kernels => {
                r.lower = per_launch_ns;
            }
            _ => {}
        }
        self.passed(m);
    }

    /// `m` is the newest marker reached.
    fn passed(&mut self, m: Mark) {
        if let Some(d) = self.done.replace(m) {
            self.spare.push(d.event);
        }
    }

    /// The oldest pending marker is not coming (its stream waits, or its event failed):
    /// forget it; the next window is not timed.
    pub fn give_up_oldest(&mut self) {
        if let Some(m) = self.pending.pop_front() {
            self.maths.reached(None, 0.0);
            destroy_events(m.event as CUevent, std::ptr::null_mut());
            if let Some(d) = self.done.take() {
                self.spare.push(d.event);
            }
        }
    }

    /// Record a marker on `stream` in the current context `ctx`, stamped `at`; `ask`:
    /// whether to ask if the GPU is still behind the previous marker.
    pub(crate) fn record(
        &mut self,
        ctx: usize,
        stream: CUstream,
        class: usize,
        at: Stamp,
        ask: bool,
    ) {
        let Stamp { paid, cost, now } = at;
        if ctx != self.ctx {
            // Another context: its events cannot be recorded here. Start over in this one.
            self.clear();
            self.ctx = ctx;
        }
        let event = match self.spare.pop() {
            Some(e) => e as CUevent,
            None => {
                let mut e: CUevent = std::ptr::null_mut();
                if ext!(MISSING, cuEventCreate(&mut e, CU_EVENT_DEFAULT)) != CUDA_SUCCESS {
                    return;
                }
                e
            }
        };
        if ext!(MISSING, cuEventRecord(event, stream)) != CUDA_SUCCESS {
            destroy_events(event, std::ptr::null_mut());
            return;
        }
        // Asked after recording: if the GPU has not reached the previous marker yet, all
        // of the time between the two will be queued work, not the GPU waiting for us.
        let behind = self.pending.back().is_some_and(|p| {
            ask && p.stream == stream as usize
                && ext!(MISSING, cuEventQuery(p.event as CUevent)) == CUDA_ERROR_NOT_READY
        });
        let last = self.pending.back().or(self.done.as_ref());
        if last.is_some_and(|l| l.stream != stream as usize) {
            self.mixed_until = now + MIXED_STREAMS_NS;
        }
        self.maths.recorded_behind(paid, cost, now as f64, behind);
        self.pending.push_back(Mark {
            event: event as usize,
            stream: stream as usize,
            class,
        });
    }

    /// Destroy every event (their context is alive) and start over.
    pub fn clear(&mut self) {
        let events = self.pending.iter().chain(self.done.iter()).map(|m| m.event);
        for e in events.chain(self.spare.iter().copied()) {
            destroy_events(e as CUevent, std::ptr::null_mut());
        }
        self.forget();
    }

    /// Start over without touching the events (they went with their context, or belong to
    /// a parent process).
    pub fn forget(&mut self) {
        *self = MarkerSet::default();
    }
}
