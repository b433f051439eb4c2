//! vcuda-limiter: the maths of libvcuda's compute limiter. Pure: no clock, no I/O, no
//! atomics — libvcuda feeds it times and measurements and applies its answers.
//!
//! # The algorithm
//!
//! **What is controlled.** Admission of launches. Each process has a token bucket counted in
//! nanoseconds of *device* time. It earns tokens at `rate` (the share: ns of device time per
//! ns of wall time, in parts per million) and pays its estimated *cost per launch* for every
//! launch. A launch is admitted while the bucket is positive (it may go into debt by one
//! launch); otherwise the launching thread sleeps until the debt is repaid. The bucket holds
//! at most [`capacity`]: a few milliseconds of device time, so an idle process cannot bank a
//! burst. Admission bounds the work queued on the GPU, so device time follows admissions.
//!
//! **What is measured.** Only what real hardware offers: NVML's per-process utilization
//! samples (integer percent of one sample period, ~1/6 s) for this process's pid. A sample
//! says how much device time the process actually got in that period; the bucket says how
//! many tokens, hence launches, the process paid in the same period. [`Calibrator`]
//! estimates the cost per launch as `busy / launches` over the last second of samples (a
//! window, so work paid in one period and run in the next is counted once) and moves the
//! estimate towards it.
//!
//! **Why it settles and stays.** Paid tokens per second equal the rate whenever the process
//! is throttled. If the cost estimate is `k` times the true cost, the process gets
//! `rate / k` of the device; the next update multiplies the cost by `busy/paid = 1/k`, so
//! the loop has a single fixed point, at the share, and reaches it geometrically (each
//! update removes most of the error; updates are damped and clamped so one noisy sample
//! cannot swing it). Nothing integrates error over time, so there is no wind-up after idle
//! phases, and idle periods (no samples, nothing paid) leave the estimate alone.
//!
//! **Issue 12: a tenant gaming the estimate** (tiny kernels, then heavy ones), modelled here
//! and run by libvcuda. [`Calibrator::settle`] charges, as debt, the device time NVML
//! measured beyond what was paid; [`Markers`] bound the work a throttled process has queued
//! (whatever it costs; fewer windows while the oldest runs late, [`Markers::may_admit_at`])
//! and see a kernel-length switch as soon as the GPU reaches a marker. The simulation tests
//! show what they hold, and what one cost estimate per process cannot (ARCHITECTURE.md).
//! What no admission limiter can hold: launches queued at one price and run at a thousand
//! times it are known only once the GPU has run them, so the first windows after a switch
//! run unpaid (charged afterwards: the 10 s average holds, a 1 s window may not).
//!
//! **Elastic shares.** [`elastic_rate`] moves the rate between the guaranteed share and the
//! limit: up while the device has idle capacity and the process wants more, back down to
//! the share quickly once other processes use the device and it is saturated.

#![forbid(unsafe_code)]

pub mod samples;

use std::collections::VecDeque;

/// Rates are parts per million of the device.
pub const PPM: u64 = 1_000_000;

/// The bucket never holds more than this much wall time's worth of earnings, and never less
/// than one launch.
pub const CAPACITY_WINDOW_NS: u64 = 20_000_000;

/// Device time earned over `elapsed_ns` of wall time at `rate_ppm`.
pub fn earned(elapsed_ns: u64, rate_ppm: u64) -> i64 {
    ((u128::from(elapsed_ns) * u128::from(rate_ppm)) / u128::from(PPM)).min(i64::MAX as u128) as i64
}

/// Wall time needed to earn `deficit_ns` of device time at `rate_ppm` (at least 1 ns).
pub fn wait_ns(deficit_ns: i64, rate_ppm: u64) -> u64 {
    if deficit_ns <= 0 {
        return 0;
    }
    let rate = rate_ppm.max(1);
    ((u128::from(deficit_ns as u64) * u128::from(PPM)).div_ceil(u128::from(rate)))
        .min(u128::from(u64::MAX)) as u64
}

/// Most device time the bucket may hold: [`CAPACITY_WINDOW_NS`] of earnings, or one launch
/// if that is more.
pub fn capacity(cost_ns: u64, rate_ppm: u64) -> i64 {
    earned(CAPACITY_WINDOW_NS, rate_ppm)
        .max(cost_ns as i64)
        .max(1)
}

/// [`capacity`] for a limiter with [`Markers`]: no more than [`MARKER_LAUNCHES`] launches
/// either, so a throttled process takes the slow path, where markers bound its queue, at
/// least that often.
pub fn marker_capacity(cost_ns: u64, rate_ppm: u64) -> i64 {
    earned(CAPACITY_WINDOW_NS, rate_ppm)
        .min((cost_ns as i64).saturating_mul(MARKER_LAUNCHES as i64))
        .max(cost_ns as i64)
        .max(1)
}

/// Launches between two markers of a throttled process, at most. It bounds the burst a
/// kernel-length switch runs before the GPU reaches a marker: this many launches at the new
/// length, paid at the old (at 64, a 10 % tenant switching from 1 µs to 1 ms kernels ran
/// 64 ms unpaid at once, a 1 s window 5 pp over its share).
pub const MARKER_LAUNCHES: u64 = 48;
/// Markers that may be pending (recorded, not yet reached by the GPU) before the slow path
/// waits: with [`MARKER_LAUNCHES`], a throttled process has at most about
/// `MAX_PENDING_MARKERS × MARKER_LAUNCHES` launches queued, whatever they cost.
pub const MAX_PENDING_MARKERS: usize = 4;
/// How long the slow path naps while it waits for the GPU to reach a marker, ns: the first
/// nap and the longest, given `queued_ns`, the device time paid for behind the newest
/// pending marker (what the GPU runs once it gets there). The host must be back before the
/// GPU has run that, or the GPU idles: a window of 48 launches of 1 µs kernels is 48 µs of
/// work, which a fixed first nap of half a millisecond would leave the GPU idle for most of
/// the time. Longer naps only when the windows are long (few wake-ups).
pub fn marker_naps(queued_ns: f64) -> (u64, u64) {
    let q = if queued_ns.is_finite() {
        queued_ns.max(0.0)
    } else {
        0.0
    } as u64;
    let first = (q / 2).clamp(MIN_MARKER_NAP_NS, 500_000);
    let longest = q.clamp(2_000_000, 20_000_000);
    (first, longest)
}
/// The shortest nap worth taking (a sleep's own cost and granularity are tens of µs).
pub const MIN_MARKER_NAP_NS: u64 = 50_000;

/// Markers that may be pending whatever the GPU's pace ([`Markers::may_admit_at`]).
pub const PROMPT_PENDING: usize = 2;
/// A pending window is late once it has run this many times what it was paid for...
pub const LATE_FACTOR: f64 = 2.0;
/// ... plus this (ns): a sleep's granularity, so a host woken late does not count.
pub const LATE_SLACK_NS: f64 = 100_000.0;

/// A window between markers that ran this many times longer than it was paid for means the
/// kernels got longer (at least this much device time, so host gaps cannot fake it).
pub const SWITCH_FACTOR: f64 = 4.0;
pub const MIN_SWITCH_NS: f64 = 1_000_000.0;
/// Once a window proved a switch, the next [`FOLLOW_WINDOWS`] windows are judged against
/// this factor instead of [`SWITCH_FACTOR`]: the window that proved it held launches of
/// both lengths, so its average under-prices the new ones (1 µs kernels switching to 1 ms
/// priced at 0.27-0.68 ms), and a price 1.5x too low is below [`SWITCH_FACTOR`]'s reach.
/// NVML's 1 s samples then took 5 s to correct it, a 20 % tenant running 27-33 % for a
/// second (CI, 2026-11-27). Right after a proven switch a smaller gap is credible.
pub const FOLLOW_FACTOR: f64 = 1.25;
/// Windows judged against [`FOLLOW_FACTOR`] after a proven switch (each one that proves
/// another starts the count again).
pub const FOLLOW_WINDOWS: u8 = 8;

/// A marker: an event the slow path records in the launching stream, which the GPU reaches
/// once every launch before it has run.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Marker {
    /// Paid total (ns, debts left out) when it was recorded.
    paid_ns: f64,
    /// The cost per launch in force then (the launches after it paid that).
    cost_ns: f64,
    /// The previous marker was still pending when this one was recorded: everything between
    /// them was queued before the GPU got there, so the time between them is device time
    /// (no idle gap waiting for the host).
    backed: bool,
    /// Host clock when it was recorded, ns. Otherwise the GPU can have idled between two
    /// markers only while the host had not yet queued the launches between them, so at
    /// least the GPU's time between them less the host's was device time.
    host_ns: f64,
}

/// The markers of one GPU: the slow path's bound on queued work and its fast detector of
/// device time run unpaid (NVML takes up to a second to say so; a marker says it as soon as
/// the GPU reaches it).
#[derive(Debug, Clone)]
pub struct Markers {
    pending: VecDeque<Marker>,
    /// Paid total at the last marker the GPU reached.
    done: Option<Marker>,
    /// Host clock when the caller first saw `done` reached ([`Markers::seen`]); NaN: not
    /// yet. The GPU reached it at that time at the latest.
    done_seen_ns: f64,
    /// Windows still judged against [`FOLLOW_FACTOR`] (a switch was proved lately).
    follow: u8,
}

impl Default for Markers {
    fn default() -> Self {
        Markers {
            pending: VecDeque::new(),
            done: None,
            done_seen_ns: f64::NAN,
            follow: 0,
        }
    }
}

impl Markers {
    /// Whether the slow path may admit: fewer than [`MAX_PENDING_MARKERS`] pending.
    pub fn may_admit(&self) -> bool {
        self.pending.len() < MAX_PENDING_MARKERS
    }

    /// Whether the slow path may admit at host time `now_ns`, with `others` the fraction
    /// of the device other processes used lately: [`may_admit`](Self::may_admit), and
    /// beyond [`PROMPT_PENDING`] pending only while the GPU keeps to the price: the oldest
    /// pending window not running later than [`LATE_FACTOR`] times what it was paid for
    /// (more when others share the device) plus [`LATE_SLACK_NS`] after it was closed.
    ///
    /// A window running late is what a kernel-length switch looks like before any marker
    /// can prove it: launches priced at 1 µs running 1 ms. Four pending windows of 48 such
    /// launches queued 192 ms at once (a 10 % tenant's 1 s window 9-15 pp over); waiting
    /// for the late one holds the queue to two windows. A window on time (the price right)
    /// keeps all four, whose depth absorbs the host's late wake-ups (with one, a 90 %
    /// tenant of 50 µs kernels got 63 % on a busy two-core machine). Waiting costs the
    /// GPU nothing: it still has the window behind the late one.
    pub fn may_admit_at(&self, now_ns: f64, others: f64) -> bool {
        if self.pending.len() < PROMPT_PENDING {
            return true;
        }
        if !self.may_admit() {
            return false;
        }
        let (Some(oldest), Some(prev)) = (self.pending.front(), self.done.as_ref()) else {
            return true;
        };
        let paid = (oldest.paid_ns - prev.paid_ns).max(0.0);
        let allowed = LATE_FACTOR * paid / (1.0 - others.clamp(0.0, 0.9)) + LATE_SLACK_NS;
        // The GPU began the window once it was closed and the one before was done (by the
        // time that was seen at the latest).
        let began = oldest.host_ns.max(self.done_seen_ns);
        now_ns - began <= allowed
    }

    /// The caller looked at host time `now_ns`: the markers it found reached so far were
    /// reached by then (the newest one's time bounds when the next window began).
    pub fn seen(&mut self, now_ns: f64) {
        if self.done_seen_ns.is_nan() {
            self.done_seen_ns = now_ns;
        }
    }

    /// Markers recorded and not yet reached.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The paid total (debts left out) when the newest pending marker was recorded: what
    /// was paid since is queued behind it.
    pub fn newest_paid_ns(&self) -> Option<f64> {
        self.pending.back().map(|m| m.paid_ns)
    }

    /// A marker was recorded with the paid total `paid_ns` (debts left out) and `cost_ns`
    /// the estimate in force, at host time `host_ns`.
    pub fn recorded(&mut self, paid_ns: f64, cost_ns: f64, host_ns: f64) {
        let behind = !self.pending.is_empty();
        self.recorded_behind(paid_ns, cost_ns, host_ns, behind);
    }

    /// [`recorded`](Self::recorded), where the caller knows whether the GPU had not yet
    /// reached the previous marker when this one was recorded (`behind`): the books may
    /// still hold a marker pending that the GPU passed long ago (they learn it only when
    /// asked), and a window after an idle gap is not device time.
    pub fn recorded_behind(&mut self, paid_ns: f64, cost_ns: f64, host_ns: f64, behind: bool) {
        let backed = behind && !self.pending.is_empty();
        self.pending.push_back(Marker {
            paid_ns,
            cost_ns,
            backed,
            host_ns,
        });
    }

    /// Forget every marker (their context went away).
    pub fn clear(&mut self) {
        *self = Markers::default();
    }

    /// The oldest pending marker was reached, `elapsed_ns` of GPU time after the previous
    /// one (`None`: not measurable), with `others` the fraction of the device other
    /// processes used lately. The launches between two markers of one stream run between
    /// them, so the GPU's time between them bounds their device time from above, and from
    /// below by itself when the GPU was behind (every launch queued before it got there),
    /// else by itself less the host's time between the two records (the GPU can only have
    /// idled while the host had not queued them yet). Says:
    /// - [`Verdict::Underpaid`]: at least [`SWITCH_FACTOR`] times what was paid ran (more
    ///   when others share the device; [`FOLLOW_FACTOR`] in the [`FOLLOW_WINDOWS`] after
    ///   such a verdict), and at least [`MIN_SWITCH_NS`]: charge what ran unpaid at once
    ///   (an advance on what NVML will measure: [`Calibrator::settle`] refunds what it
    ///   does not confirm) and price a launch at least at the window's;
    /// - [`Verdict::Overpaid`]: at most a [`SWITCH_FACTOR`]th of what was paid (at least
    ///   [`MIN_SWITCH_NS`] of it) can have run: a launch costs at most the window's.
    pub fn reached(&mut self, elapsed_ns: Option<f64>, others: f64) -> Option<Verdict> {
        let m = self.pending.pop_front()?;
        let prev = self.done.replace(m);
        self.done_seen_ns = f64::NAN;
        let (prev, upper) = (prev?, elapsed_ns?.max(0.0));
        let lower = if m.backed {
            upper
        } else {
            upper - (m.host_ns - prev.host_ns).max(0.0)
        };
        // Nothing launched between them (the slow path closes a group and opens the next
        // one back to back): nothing to judge.
        let paid = m.paid_ns - prev.paid_ns;
        if paid <= 0.0 {
            return None;
        }
        let launches = (paid / prev.cost_ns.max(MIN_COST_NS)).max(1.0);
        let paid = paid.max(prev.cost_ns);
        let base = if self.follow > 0 {
            self.follow -= 1;
            FOLLOW_FACTOR
        } else {
            SWITCH_FACTOR
        };
        let factor = base / (1.0 - others.clamp(0.0, 0.9));
        if lower >= MIN_SWITCH_NS && lower >= factor * paid {
            self.follow = FOLLOW_WINDOWS;
            return Some(Verdict::Underpaid(Unpaid {
                per_launch_ns: (lower / launches).clamp(MIN_COST_NS, MAX_COST_NS),
                debt_ns: lower - paid,
            }));
        }
        if paid >= MIN_SWITCH_NS && upper * SWITCH_FACTOR <= paid {
            return Some(Verdict::Overpaid {
                per_launch_ns: (upper / launches).clamp(MIN_COST_NS, MAX_COST_NS),
            });
        }
        None
    }
}

/// What a window between two markers proved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// It ran far longer than paid.
    Underpaid(Unpaid),
    /// It ran far shorter than paid: a launch of it took at most this, ns.
    Overpaid { per_launch_ns: f64 },
}

/// What a window between markers that ran far longer than paid showed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Unpaid {
    /// Device time a launch of the window took, ns.
    pub per_launch_ns: f64,
    /// Device time that ran unpaid in it, ns.
    pub debt_ns: f64,
}

/// The bucket after a refill: `tokens` plus what `elapsed_ns` earned, capped. Returns the
/// new balance and how much was actually added.
pub fn refill(tokens: i64, elapsed_ns: u64, rate_ppm: u64, cap: i64) -> (i64, i64) {
    if tokens >= cap {
        return (tokens, 0);
    }
    let new = tokens.saturating_add(earned(elapsed_ns, rate_ppm)).min(cap);
    (new, new - tokens)
}

/// The starting guess of device time per launch: deliberately high, so a new process
/// starts below its share and calibration brings it up (the reverse would overshoot).
pub const INITIAL_COST_NS: f64 = 20_000_000.0;
/// Bounds of the cost estimate.
pub const MIN_COST_NS: f64 = 100.0;
pub const MAX_COST_NS: f64 = 10_000_000_000.0;

/// One NVML sample matched with what was paid in its period.
#[derive(Debug, Clone, Copy)]
struct Evidence {
    busy_ns: f64,
    /// Launches paid in the period: tokens paid over the cost estimate in force.
    launches: f64,
    span_ns: f64,
    /// The period began at or before the origin (or before the probe's lump was paid,
    /// `fill_until_us`), or the price was raised within it (`raised_at_us`): the queue
    /// filled in it, so some work paid in it had not run by its end, and it reads the cost
    /// low.
    filling: bool,
}

/// Learns the device time one launch costs from NVML samples.
///
/// It keeps the last [`WINDOW_SAMPLES`] samples, each as device time used and launches paid
/// (tokens paid over the estimate then in force), and estimates the cost as `busy /
/// launches` over them: an absolute estimate, so each new sample moves the cost towards it
/// without compounding earlier corrections. Work paid in one period runs partly in the next
/// (the queue drains after a burst): a window that holds both counts it once, on the right
/// side; an estimate from short batches cleared after each update saw that lag as
/// alternately too cheap and too dear, and since corrections multiply, `(1 - x)(1 + x) < 1`
/// dragged the cost down at every burst.
#[derive(Debug, Clone)]
pub struct Calibrator {
    cost_ns: f64,
    /// (wall µs, total paid ns) recorded at each controller tick.
    paid: VecDeque<(u64, u64)>,
    evidence: VecDeque<Evidence>,
    /// Samples added since the last update (an update needs a new one).
    fresh: usize,
    /// The ledger: device time NVML measured, and time paid, over every sampled period.
    busy_total_ns: f64,
    paid_total_ns: f64,
    /// (wall µs, total debt charged ns) recorded at each controller tick.
    debts: VecDeque<(u64, f64)>,
    /// End of the newest sampled period, wall µs.
    sampled_to_us: u64,
    /// The oldest entry of `paid` is the origin ([`Calibrator::record_origin`]): nothing was
    /// paid before it.
    origin: bool,
    /// Periods starting before this (wall µs) are the queue's filling ones: the origin, or
    /// later if launches admitted before their cost was known were paid as a lump
    /// ([`Calibrator::paid_unpriced_by`]).
    fill_until_us: u64,
    /// When the price was last raised by a direct measurement (wall µs;
    /// [`Calibrator::raised_at`]).
    raised_at_us: Option<u64>,
    /// (until sampled wall µs, cost): the estimate stays at least this until samples reach
    /// that time ([`Calibrator::raised_at`]).
    floor: Option<(u64, f64)>,
}

impl Default for Calibrator {
    fn default() -> Self {
        Calibrator::new(INITIAL_COST_NS)
    }
}

impl Calibrator {
    pub fn new(cost_ns: f64) -> Calibrator {
        Calibrator {
            cost_ns: cost_ns.clamp(MIN_COST_NS, MAX_COST_NS),
            paid: VecDeque::new(),
            evidence: VecDeque::new(),
            fresh: 0,
            busy_total_ns: 0.0,
            paid_total_ns: 0.0,
            debts: VecDeque::new(),
            sampled_to_us: 0,
            origin: false,
            fill_until_us: 0,
            raised_at_us: None,
            floor: None,
        }
    }

    /// Current estimate of device time per launch, ns.
    pub fn cost_ns(&self) -> f64 {
        self.cost_ns
    }

    /// Note the total paid so far (ns) at wall time `t_us`. Called every controller tick.
    pub fn record_paid(&mut self, t_us: u64, paid_total_ns: u64) {
        if self.paid.back().is_some_and(|&(t, _)| t >= t_us) {
            return;
        }
        self.paid.push_back((t_us, paid_total_ns));
        while self.paid.len() > 256 {
            self.paid.pop_front();
            self.origin = false;
        }
    }

    /// Note the total paid (ns) at wall time `t_us`, a moment before any of the process's
    /// work could be queued (its limiter was just made): paid at any earlier time counts as
    /// this. Without it, the first NVML period the ledger could match began after the first
    /// controller tick (50 ms after start), when launches were already queued: work paid
    /// before that period and run in it looked unpaid, a false debt of a whole queue (one
    /// 20 ms kernel at 90 %) charged and refunded over and over, each time idling the GPU.
    pub fn record_origin(&mut self, t_us: u64, paid_total_ns: u64) {
        self.paid.clear();
        self.paid.push_back((t_us, paid_total_ns));
        self.origin = true;
        self.fill_until_us = t_us;
    }

    /// The launches admitted before their cost was known (libvcuda's first-launch probe)
    /// were paid, in one lump, by wall time `t_us`: they ran before, so a period holding
    /// the lump reads the cost low like the origin's. Only the first call counts.
    pub fn paid_unpriced_by(&mut self, t_us: u64) {
        if self.origin && self.fill_until_us == self.paid.front().map_or(0, |&(t, _)| t) {
            self.fill_until_us = self.fill_until_us.max(t_us);
        }
    }

    /// The price was raised at wall time `t_us` by a direct measurement (marker windows
    /// proved longer kernels; [`Calibrator::set_cost`] follows): the queue, bounded in
    /// launches, then refilled with longer ones, so work paid in the period holding `t_us`
    /// was still queued at its end and reads the cost low, like the origin's period. With
    /// NVML's 1 s samples that period read a switch from 1 µs to 1 ms kernels as 0.72 ms,
    /// the estimate fell from the markers' 1 ms, and stayed low for the 6 s the period
    /// stayed in the window: a 20 % tenant ran 25-28 % in a second while the ledger
    /// charged the difference back (CI, 2026-11-27).
    ///
    /// And if the process was `alone` on the device (so the windows' GPU time was all
    /// its own), the raised price is a floor for [`RAISE_FLOOR_US`] of sampled time: at 1 s
    /// samples the queue's depth in device time keeps growing for a period or two after
    /// it (up to four windows of the longer kernels, 192 ms at 1 ms: as much as a 20 %
    /// tenant pays in a second), and those periods read it 0.6x too. Kernels that really
    /// got shorter are proved by marker windows (`Verdict::Overpaid`), whose
    /// [`Calibrator::set_cost`] lifts the floor. Beside others not yet measured a raise
    /// may be false (their kernels ran between the markers), and a floor held it: four
    /// tenants starting together on one GPU, the 10 % one got 2 % in its second second.
    pub fn raised_at(&mut self, t_us: u64, alone: bool) {
        self.raised_at_us = Some(t_us);
        self.floor = alone.then(|| (t_us.saturating_add(RAISE_FLOOR_US), self.cost_ns));
    }

    /// Total paid at wall time `t_us`, interpolated between ticks.
    fn paid_at(&self, t_us: u64) -> Option<f64> {
        let i = self.paid.iter().position(|&(t, _)| t >= t_us)?;
        let (t1, p1) = self.paid[i];
        if i == 0 {
            return (t1 == t_us || self.origin).then_some(p1 as f64);
        }
        let (t0, p0) = self.paid[i - 1];
        let f = (t_us - t0) as f64 / (t1 - t0) as f64;
        Some(p0 as f64 + f * (p1 as f64 - p0 as f64))
    }

    /// An NVML sample for this process: the period ending at wall time `end_us`, `period_us`
    /// long, in which it kept the device busy `util_pct` percent of the time. Returns whether
    /// it could be matched with payments.
    pub fn sample(&mut self, end_us: u64, period_us: u64, util_pct: u32) -> bool {
        // A period over before the origin was another process's (a pid used again).
        if self.origin && self.paid.front().is_some_and(|&(t, _)| end_us <= t) {
            return false;
        }
        let (Some(p0), Some(p1)) = (
            self.paid_at(end_us.saturating_sub(period_us)),
            self.paid_at(end_us),
        ) else {
            return false;
        };
        let paid = (p1 - p0).max(0.0);
        let busy = f64::from(util_pct.min(100)) / 100.0 * period_us as f64 * 1000.0;
        let start_us = end_us.saturating_sub(period_us);
        let filling = (self.origin && start_us <= self.fill_until_us)
            || self
                .raised_at_us
                .is_some_and(|r| start_us <= r && r < end_us);
        self.evidence.push_back(Evidence {
            busy_ns: busy,
            launches: paid / self.cost_ns,
            span_ns: period_us as f64 * 1000.0,
            filling,
        });
        while self.evidence.len() > WINDOW_SAMPLES {
            self.evidence.pop_front();
        }
        self.fresh += 1;
        self.busy_total_ns += busy;
        self.paid_total_ns += paid;
        self.sampled_to_us = self.sampled_to_us.max(end_us);
        true
    }

    /// Note the total debt charged so far (ns) at wall time `t_us`. Called every controller
    /// tick, with [`Calibrator::record_paid`].
    pub fn record_debt(&mut self, t_us: u64, debt_total_ns: f64) {
        if self.debts.back().is_some_and(|&(t, _)| t >= t_us) {
            return;
        }
        self.debts.push_back((t_us, debt_total_ns));
        while self.debts.len() > 256 {
            self.debts.pop_front();
        }
    }

    /// The settlement, each tick: NVML's measurement is the final word on what ran unpaid.
    /// `debt_ns` is every debt charged so far (by this or by [`Markers`], whose charges are
    /// advances made before NVML can see the work). Positive: charge that much more (NVML
    /// measured more unpaid time than has been charged). Negative: refund that much (debts
    /// charged before the newest sampled period ended exceed what NVML measured: an advance
    /// NVML does not confirm, e.g. a marker window of long kernels in a mix whose short
    /// ones overpaid). Nothing within [`MIN_DEBT_NS`] (rounding noise).
    ///
    /// A charge waits until the measured side leads by `slack_ns` too: the paid side is
    /// read at controller ticks and interpolated between them, while launches pay in steps
    /// of up to a bucket's capacity (a burst after a wait), so between ticks the measured
    /// side may lead by up to that much with nothing unpaid. Without it a 90 % tenant of
    /// 20 ms kernels was charged and refunded 5-20 ms every few samples, and each false
    /// charge left the GPU idle while it was repaid (a one-time offset: never more than
    /// `slack_ns` runs unpaid in all).
    ///
    /// Never charges more than was used: work paid but not yet run makes the measured side
    /// lag the paid side, never lead it. `paid_ns` given to [`Calibrator::record_paid`] must
    /// leave debts out.
    ///
    /// Nor banks overpayment: `slack_ns` is the bucket's capacity, and a throttled process
    /// has at most [`CREDIT_CAPACITIES`] of it paid and not yet run (a bucket's worth behind
    /// each pending marker, and the bucket); paid beyond what ran by more than that is
    /// overpayment (an estimate too high), forgiven, not kept as credit. Kept, a phase of
    /// tiny kernels priced as heavy ones banked seconds of credit, and the heavy phase after
    /// it ran unpaid against it: a 50 % tenant switching kernel lengths every 550 ms ran
    /// 1 s windows 21 pp over.
    pub fn settle(&mut self, debt_ns: f64, slack_ns: f64) -> i64 {
        let most_ahead = CREDIT_CAPACITIES * slack_ns;
        if self.paid_total_ns - self.busy_total_ns > most_ahead {
            self.paid_total_ns = self.busy_total_ns + most_ahead;
        }
        let target = (self.busy_total_ns - self.paid_total_ns).max(0.0);
        if target - debt_ns >= MIN_DEBT_NS.max(slack_ns) {
            return (target - debt_ns) as i64;
        }
        // What had been charged by the end of the newest sampled period.
        let before = self
            .debts
            .iter()
            .rev()
            .find(|&&(t, _)| t <= self.sampled_to_us)
            .map_or(0.0, |&(_, d)| d);
        if before - target >= MIN_DEBT_NS {
            return -((before - target) as i64);
        }
        0
    }

    /// Replace the estimate (with a direct measurement, e.g. the first launch timed with
    /// events) and forget older evidence.
    pub fn set_cost(&mut self, cost_ns: f64) {
        self.cost_ns = cost_ns.clamp(MIN_COST_NS, MAX_COST_NS);
        self.evidence.clear();
        self.fresh = 0;
        self.floor = None;
    }

    /// Move the cost towards what the window says, once per new sample and once there is
    /// enough evidence; returns the (possibly unchanged) cost.
    ///
    /// Enough means at least [`MIN_SAMPLES`] samples and [`MIN_LAUNCHES`] launches paid in
    /// the window (idle windows say nothing). Each step moves the cost by at most 4× either
    /// way, damped, and less when the window holds few launches.
    pub fn update(&mut self) -> f64 {
        if self.fresh == 0 {
            return self.cost_ns;
        }
        let sums = |all: bool| {
            let used = self.evidence.iter().filter(|e| all || !e.filling);
            used.fold((0usize, 0.0, 0.0, 0.0), |(n, b, l, s), e| {
                (n + 1, b + e.busy_ns, l + e.launches, s + e.span_ns)
            })
        };
        let (mut n, mut busy, mut launches, mut span) = sums(true);
        // The period the queue filled in can only say the cost is higher: work paid in it
        // and still queued at its end reads as cheaper launches. A 90 % tenant of 20 ms
        // kernels, probed right, was re-estimated 4-5 % low in its first second, ran that
        // much over, and the ledger's charge and refund of it swung its second second by
        // two kernels (CI failed at 94.2 %).
        if busy < launches * self.cost_ns && self.evidence.iter().any(|e| e.filling) {
            (n, busy, launches, span) = sums(false);
        }
        if n < MIN_SAMPLES || launches < MIN_LAUNCHES {
            return self.cost_ns;
        }
        // The step is bounded per NVML's usual period (1/6 s), not per sample: with 1 s
        // samples a ×4 clamp per sample took 5 s to learn a 1000× change, while the ledger
        // held the process in debt, and the queue it refilled at the old estimate on
        // repaying was the whole second again (issue 12's storm at 1 s samples).
        let steps = self
            .evidence
            .back()
            .map_or(1.0, |e| (e.span_ns / USUAL_PERIOD_NS).max(1.0));
        let (lo, hi) = (0.25f64.powf(steps), 4.0f64.powf(steps));
        self.fresh = 0;
        let mut ratio = (busy.max(0.0) / launches / self.cost_ns).clamp(lo, hi);
        // A device kept (nearly) fully busy by this process cannot show more: busy/launches
        // is then only a lower bound on the true cost, and work admitted too cheaply is
        // piling up. Correct hard.
        if span > 0.0 && busy >= 0.95 * span && ratio > 1.0 {
            ratio = (ratio * 2.0).min(hi);
        }
        // Damped, so one rounded sample cannot swing it, and more so when the window covers
        // few launches.
        let weight = (launches / FULL_EVIDENCE_LAUNCHES).min(1.0);
        self.cost_ns = (self.cost_ns * ratio.powf(0.8 * weight)).clamp(MIN_COST_NS, MAX_COST_NS);
        if let Some((until, floor)) = self.floor {
            if self.sampled_to_us < until {
                self.cost_ns = self.cost_ns.max(floor);
            } else {
                self.floor = None;
            }
        }
        self.cost_ns
    }
}

/// How long a price raised by marker windows stays a floor for the calibration, in sampled
/// time (µs): the raise's NVML period and, at 1 s samples, the next ([`Calibrator::raised_at`]).
pub const RAISE_FLOOR_US: u64 = 2_000_000;

/// Bucket capacities a throttled process may have paid ahead of what ran: one behind each
/// marker that may be pending, and the bucket.
pub const CREDIT_CAPACITIES: f64 = MAX_PENDING_MARKERS as f64 + 1.0;

/// The ledger charges nothing smaller (NVML's integer percent rounds a sample by up to half a
/// percent of its period).
pub const MIN_DEBT_NS: f64 = 100_000.0;

/// NVML's usual per-process sample period (1/6 s), ns: the unit of the estimate's step bound.
pub const USUAL_PERIOD_NS: f64 = 166_667_000.0;

/// Samples the estimate is taken over (~1 s of NVML periods).
pub const WINDOW_SAMPLES: usize = 6;
/// Evidence an update needs: samples, and launches paid.
pub const MIN_SAMPLES: usize = 2;
pub const MIN_LAUNCHES: f64 = 3.0;
/// A window with this many launches moves the cost by the full (damped) step; fewer move it
/// proportionally less.
pub const FULL_EVIDENCE_LAUNCHES: f64 = 30.0;

/// Headroom an elastic process leaves on the device (fraction): it grows into idle capacity
/// only up to `1 - MARGIN`, so a neighbour starting work finds the device not saturated.
pub const MARGIN: f64 = 0.03;

/// The rate an elastic process should run at next, in ppm. Called once per NVML sample
/// period.
///
/// `share` is guaranteed, `limit` the most it may take. `others` is the fraction of the
/// device the other processes used in the last sample period (0..=1), `own` this process's,
/// `hungry` whether it was throttled since the last call.
///
/// - Contended (the device is saturated and others use it): give back three quarters of the
///   excess over the share per period, so the share is restored within 3 periods (0.5 s).
/// - Hungry: take what the others leave, less [`MARGIN`].
/// - Otherwise keep the rate.
pub fn elastic_rate(
    current: u64,
    share: u64,
    limit: u64,
    others: f64,
    own: f64,
    hungry: bool,
) -> u64 {
    if limit <= share {
        return share;
    }
    let current = current.clamp(share, limit);
    let others = others.clamp(0.0, 1.0);
    if others + own >= 1.0 - MARGIN / 2.0 && others > MARGIN / 2.0 {
        return share + (current - share) / 4;
    }
    if hungry {
        let room = ((1.0 - others - MARGIN).max(0.0) * PPM as f64) as u64;
        return room.clamp(share, limit);
    }
    current
}

/// The rate a process runs at when its container's share is split among `active` processes
/// launching on the GPU (each gets an equal part; at least 1 ppm).
pub fn split(container_ppm: u64, active: u32) -> u64 {
    (container_ppm / u64::from(active.max(1))).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_arithmetic() {
        assert_eq!(earned(1_000_000_000, 300_000), 300_000_000);
        assert_eq!(wait_ns(300_000_000, 300_000), 1_000_000_000);
        assert_eq!(wait_ns(-5, 300_000), 0);
        assert_eq!(capacity(50_000, 500_000), 10_000_000);
        assert_eq!(
            marker_capacity(50_000, 500_000),
            50_000 * MARKER_LAUNCHES as i64,
            "MARKER_LAUNCHES launches"
        );
        assert_eq!(marker_capacity(5_000_000, 100_000), 5_000_000, "a launch");
        assert_eq!(capacity(30_000_000, 500_000), 30_000_000);
        assert_eq!(refill(0, 1_000_000, 500_000, 100), (100, 100));
        assert_eq!(refill(-1000, 1_000, 500_000, 100), (-500, 500));
        assert_eq!(refill(200, 1_000, 500_000, 100), (200, 0));
    }

    #[test]
    fn calibration_finds_the_true_cost() {
        let mut c = Calibrator::new(1_000_000.0);
        // tick every 50 ms; we pay 300 µs/ms of device time; truth: each "1 ms" token buys
        // 250 µs, i.e. the estimate is 4× too high (the step is clamped to 4×, damped).
        for i in 0..=40u64 {
            c.record_paid(i * 50_000, i * 15_000_000);
        }
        for k in 1..=6u64 {
            assert!(c.sample(k * 166_667, 166_667, 8));
        }
        let cost = c.update();
        assert!(
            cost < 1_000_000.0 * 0.4 && cost > 1_000_000.0 * 0.2,
            "{cost}"
        );
    }

    /// The step bound is per 1/6 s of evidence: one 1 s sample may move the estimate as far
    /// as six 1/6 s samples could, and a 1/6 s sample no further than before.
    #[test]
    fn a_long_sample_may_move_the_estimate_as_far_as_the_short_ones_it_spans() {
        // Paid 1 ms of device time per 50 ms at an estimate of 1 µs a launch (1000 launches
        // a tick) while the device was kept fully busy: a launch costs 50 µs, 50× the
        // estimate.
        let run = |period_us: u64, samples: u64| {
            let mut c = Calibrator::new(1_000.0);
            let ticks = (period_us * samples).div_ceil(50_000);
            for i in 0..=ticks {
                c.record_paid(i * 50_000, i * 1_000_000);
            }
            for k in 1..=samples {
                assert!(c.sample(k * period_us, period_us, 100));
            }
            c.update()
        };
        let short = run(166_667, 2);
        let long = run(1_000_000, 2);
        assert!(
            short <= 1_000.0 * 4.0,
            "a 1/6 s step stays within 4×: {short}"
        );
        assert!(
            long >= 1_000.0 * 20.0,
            "one update on 1 s samples learns most of a 50× change: {long}"
        );
    }

    #[test]
    fn idle_evidence_leaves_the_estimate() {
        let mut c = Calibrator::new(1_000_000.0);
        for i in 0..=10u64 {
            c.record_paid(i * 50_000, 0);
        }
        c.sample(166_667, 166_667, 0);
        assert_eq!(c.update(), 1_000_000.0);
    }

    #[test]
    fn bursts_with_a_draining_tail_keep_the_true_cost() {
        // The true cost is the estimate (1 ms). On-phases of 6 NVML periods at 25 %, the last
        // 8 ms paid in a period running in the next; then the tail drains in the first idle
        // period and 2 more idle periods follow. Batches cleared after each update once saw
        // every burst's start as too cheap and its end as too dear, and the cost fell ~3 %
        // a burst (a bursty tenant then got 30-40 % on a 25 % share in some seconds).
        let p = 166_667u64;
        let (pay, tail) = (p * 1000 / 4, 8_000_000u64);
        let mut c = Calibrator::new(1_000_000.0);
        let (mut t, mut total) = (0u64, 0u64);
        c.record_paid(t, total);
        let mut step = |c: &mut Calibrator, paid: u64, busy: u64| {
            for _ in 0..3 {
                c.update(); // the controller ticks between samples
            }
            t += p;
            total += paid;
            c.record_paid(t, total);
            c.sample(t, p, ((busy * 100 + p * 500) / (p * 1000)) as u32);
            c.update();
        };
        for _ in 0..30 {
            for k in 0..6 {
                let busy = if k == 0 { pay - tail } else { pay };
                step(&mut c, pay, busy);
            }
            step(&mut c, 0, tail);
            step(&mut c, 0, 0);
            step(&mut c, 0, 0);
            let cost = c.cost_ns();
            assert!((cost - 1e6).abs() < 0.1e6, "cost drifted to {cost:.0} ns");
        }
    }

    #[test]
    fn elastic_bursts_when_idle_and_gives_back() {
        let (s, l) = (300_000, 800_000);
        // Alone and hungry: straight to the limit.
        let r = elastic_rate(s, s, l, 0.0, 0.3, true);
        assert_eq!(r, l);
        // A neighbour at 20 %: take what it leaves, less the margin.
        assert_eq!(elastic_rate(l, s, l, 0.2, 0.6, true), 770_000);
        // The device saturates with a neighbour on it: back to the share in 3 periods.
        let mut r = l;
        let mut steps = 0;
        while r > s + 10_000 {
            r = elastic_rate(r, s, l, 0.5, 0.5, true);
            steps += 1;
        }
        assert!(steps <= 3, "gives back within 3 sample periods ({steps})");
        // Saturated by itself alone: nothing to give back.
        assert_eq!(elastic_rate(l, s, l, 0.0, 1.0, true), l);
        // Not hungry: keep.
        assert_eq!(elastic_rate(500_000, s, l, 0.1, 0.2, false), 500_000);
        // Hard: limit = share.
        assert_eq!(
            elastic_rate(500_000, 500_000, 500_000, 0.0, 0.1, true),
            500_000
        );
        assert_eq!(split(300_000, 3), 100_000);
        assert_eq!(split(300_000, 0), 300_000);
    }

    /// A closed-loop simulation: one process saturating a GPU with kernels of a fixed true
    /// duration (its queue holds up to 64), admitted by the bucket exactly as libvcuda
    /// admits them, observed only through rounded NVML samples. Returns the utilization
    /// achieved after the first second, and how far the worst 1 s window went over the share.
    pub(crate) fn simulate(share_ppm: u64, kernel_ns: u64, seconds: u64) -> (f64, f64) {
        simulate_from(share_ppm, kernel_ns, seconds, 1.0)
    }

    /// As [`simulate`], starting from a cost estimate `probe_err` times the truth.
    pub(crate) fn simulate_from(
        share_ppm: u64,
        kernel_ns: u64,
        seconds: u64,
        probe_err: f64,
    ) -> (f64, f64) {
        const SETTLE: u64 = 1_000_000_000;
        let sim = Sim {
            share_ppm,
            period_ns: 166_667_000,
            queue: 64,
            initial_cost_ns: kernel_ns as f64 * probe_err,
        };
        let cum = sim.run(seconds * 1_000_000_000, |_, _| kernel_ns);
        let share = share_ppm as f64 / 1e6;
        let settled: Vec<&(u64, u64)> = cum.iter().filter(|c| c.0 >= SETTLE).collect();
        let (t0, b0) = *settled[0];
        let (t1, b1) = cum[cum.len() - 1];
        let achieved = (b1 - b0) as f64 / (t1 - t0) as f64;
        let mut worst: f64 = 0.0;
        for w in settled.windows(7) {
            let (ta, ba) = *w[0];
            let (tb, bb) = *w[6];
            worst = worst.max((bb - ba) as f64 / (tb - ta) as f64 - share);
        }
        (achieved, worst)
    }

    /// One process saturating a GPU, admitted by the bucket exactly as libvcuda admits
    /// launches, observed only through rounded NVML samples of `period_ns`; each sample
    /// feeds the calibration and the ledger (whose debt is charged to the bucket at once),
    /// and the controller updates the estimate every 50 ms.
    pub struct Sim {
        pub share_ppm: u64,
        pub period_ns: u64,
        /// Launches the GPU queues before a launch blocks (gpusim: 1024).
        pub queue: usize,
        pub initial_cost_ns: f64,
    }

    impl Sim {
        /// Run for `end_ns`; `kernel(t, n)` is the true duration of launch `n` (0-based)
        /// issued at `t`. Returns (period end, cumulative busy) at every sample.
        pub fn run(&self, end: u64, kernel: impl Fn(u64, u64) -> u64) -> Vec<(u64, u64)> {
            const TICK: u64 = 50_000_000;
            let (share_ppm, period) = (self.share_ppm, self.period_ns);
            let mut cal = Calibrator::new(self.initial_cost_ns);
            cal.record_origin(0, 0); // the limiter was made before the first launch
            let mut charged = 0.0f64; // every debt charged
            let (mut tokens, mut paid, mut last_refill) = (0i64, 0u64, 0u64);
            let mut ends: VecDeque<u64> = VecDeque::new(); // queued kernels' end times
            let mut intervals: Vec<(u64, u64)> = Vec::new();
            let mut first = 0usize; // first interval that may still overlap a future period
            let (mut next_sample, mut next_tick) = (period, TICK);
            let mut cum: Vec<(u64, u64)> = vec![(0, 0)]; // (period end, cumulative busy)
            let (mut t, mut n) = (0u64, 0u64);
            let mut markers = Markers::default();
            let mut marker_at: VecDeque<u64> = VecDeque::new(); // when the GPU reaches each
            let mut last_reached: Option<u64> = None;
            let mut slow = false;
            let mut slept = false; // while on the slow path
            while t < end {
                while next_sample <= t {
                    let (a, b) = (next_sample - period, next_sample);
                    let mut busy = 0;
                    let mut i = first;
                    while i < intervals.len() && intervals[i].0 < b {
                        let (s, e) = intervals[i];
                        busy += e.min(b).saturating_sub(s.max(a));
                        i += 1;
                    }
                    while first < intervals.len() && intervals[first].1 <= b {
                        first += 1;
                    }
                    let pct = (busy as f64 / period as f64 * 100.0).round() as u32;
                    let pct = if busy > 0 { pct.max(1) } else { 0 };
                    cal.record_paid(b / 1000, paid);
                    cal.record_debt(b / 1000, charged);
                    cal.sample(b / 1000, period / 1000, pct);
                    let cap = marker_capacity(cal.cost_ns() as u64, share_ppm);
                    let mut d = cal.settle(charged, cap as f64);
                    if d < 0 {
                        // A refund fills the bucket no further than a refill may.
                        d = -(-d).min(cap.saturating_sub(tokens)).max(0);
                    }
                    charged += d as f64;
                    tokens -= d;
                    cum.push((b, cum.last().map_or(0, |c| c.1) + busy));
                    next_sample += period;
                }
                while next_tick <= t {
                    cal.record_paid(next_tick / 1000, paid);
                    cal.record_debt(next_tick / 1000, charged);
                    cal.update();
                    tokens = tokens.min(marker_capacity(cal.cost_ns() as u64, share_ppm));
                    next_tick += TICK;
                }
                while ends.front().is_some_and(|&e| e <= t) {
                    ends.pop_front();
                }
                let horizon = next_sample.min(next_tick).min(end);
                if ends.len() >= self.queue {
                    t = ends
                        .front()
                        .copied()
                        .unwrap_or(horizon)
                        .min(horizon)
                        .max(t + 1);
                    continue;
                }
                if tokens <= 0 && !slow {
                    // The slow path: markers the GPU reached, then a new one.
                    slow = true;
                    while marker_at.front().is_some_and(|&m| m <= t) {
                        let m = marker_at.pop_front().unwrap_or(t);
                        let elapsed = last_reached.map(|l| (m - l) as f64);
                        last_reached = Some(m);
                        match markers.reached(elapsed, 0.0) {
                            Some(Verdict::Underpaid(u)) => {
                                charged += u.debt_ns;
                                tokens -= u.debt_ns as i64;
                                if u.per_launch_ns > cal.cost_ns() {
                                    cal.set_cost(u.per_launch_ns);
                                    cal.raised_at(t / 1000, true);
                                }
                            }
                            Some(Verdict::Overpaid { per_launch_ns })
                                if per_launch_ns < cal.cost_ns() =>
                            {
                                cal.set_cost(per_launch_ns);
                            }
                            _ => {}
                        }
                    }
                    // A price that fell forfeits the balance beyond its capacity
                    // (libvcuda's `forfeit_excess`).
                    tokens = tokens.min(marker_capacity(cal.cost_ns() as u64, share_ppm));
                    markers.seen(t as f64);
                    if !markers.may_admit_at(t as f64, 0.0) {
                        slow = false;
                        slept = true;
                        t = marker_at
                            .front()
                            .copied()
                            .unwrap_or(t)
                            .min(horizon)
                            .max(t + 1);
                        continue;
                    }
                    let behind = marker_at.back().is_some_and(|&m| m > t);
                    markers.recorded_behind(paid as f64, cal.cost_ns(), t as f64, behind);
                    marker_at.push_back(ends.back().copied().unwrap_or(t).max(t));
                }
                let cost = cal.cost_ns() as i64;
                if tokens > 0 {
                    if slow && slept && markers.may_admit() {
                        // Leaving the slow path after a wait: a marker opens the launches
                        // it admits (without a wait, the closing marker opens them).
                        let behind = marker_at.back().is_some_and(|&m| m > t);
                        markers.recorded_behind(paid as f64, cal.cost_ns(), t as f64, behind);
                        marker_at.push_back(ends.back().copied().unwrap_or(t).max(t));
                    }
                    slow = false;
                    slept = false;
                    tokens -= cost;
                    paid += cost as u64;
                    let d = kernel(t, n);
                    n += 1;
                    let start = ends.back().copied().unwrap_or(t).max(t);
                    ends.push_back(start + d);
                    intervals.push((start, start + d));
                    continue;
                }
                tokens = refill(
                    tokens,
                    t - last_refill,
                    share_ppm,
                    marker_capacity(cost as u64, share_ppm),
                )
                .0;
                last_refill = t;
                if tokens > 0 {
                    continue;
                }
                slept |= slow;
                t = (t + wait_ns(1 - tokens, share_ppm)).min(horizon).max(t + 1);
            }
            cum
        }
    }

    /// Device time used between `a` and `b` (ns) from a run's cumulative samples, as a
    /// fraction of the GPU (the samples nearest inside).
    pub(crate) fn util(cum: &[(u64, u64)], a: u64, b: u64) -> f64 {
        let at = |t: u64| {
            cum.iter()
                .rev()
                .find(|c| c.0 <= t)
                .copied()
                .unwrap_or((0, 0))
        };
        let ((ta, ba), (tb, bb)) = (at(a), at(b));
        (bb - ba) as f64 / (tb - ta).max(1) as f64
    }

    #[test]
    fn closed_loop_holds_every_share_and_kernel_length() {
        for &share in &[50_000u64, 100_000, 250_000, 500_000, 750_000, 900_000] {
            for &k in &[50_000u64, 1_000_000, 20_000_000] {
                let (u, worst) = simulate(share, k, 11);
                let err = (u - share as f64 / 1e6) * 100.0;
                assert!(
                    err.abs() <= 2.0,
                    "share {share} kernel {k}: achieved {:.2}% ({err:+.2} pp)",
                    u * 100.0
                );
                assert!(
                    worst * 100.0 <= 5.0,
                    "share {share} kernel {k}: a 1 s window ran {:.2} pp over",
                    worst * 100.0
                );
            }
        }
    }

    /// The storm of issue 12: 20 000 launches of 1 µs (the estimate learns "a launch costs
    /// 1 µs"), then 1 ms kernels as fast as the queue takes them. Before the ledger, the
    /// estimate admitted a thousand times too much until calibration caught up: 28.7 % on
    /// a 20 % share over 10 s with NVML's 1/6 s samples, 62 % with 1 s samples (gpusim).
    /// With the ledger the device time used is charged as debt: over the 10 s from the
    /// first launch the process stays within its share + 2 pp.
    #[test]
    fn a_storm_of_tiny_launches_then_heavy_ones_is_repaid_within_ten_seconds() {
        for &period in &[166_667_000u64, 1_000_000_000] {
            for &share in &[100_000u64, 200_000, 500_000] {
                let sim = Sim {
                    share_ppm: share,
                    period_ns: period,
                    queue: 1024,
                    initial_cost_ns: 1_000.0,
                };
                let cum = sim.run(
                    12_000_000_000,
                    |_, n| if n < 20_000 { 1_000 } else { 1_000_000 },
                );
                let avg = util(&cum, 0, 10_000_000_000);
                let over = (avg - share as f64 / 1e6) * 100.0;
                assert!(
                    over <= 2.0,
                    "share {share} ppm, NVML period {period} ns: {:.1} % over 10 s ({over:+.1} pp)",
                    avg * 100.0
                );
                let step = period.min(500_000_000);
                let mut a = 1_000_000_000;
                while a + 1_000_000_000 <= 11_000_000_000 {
                    let w = (util(&cum, a, a + 1_000_000_000) - share as f64 / 1e6) * 100.0;
                    assert!(w <= 5.0, "share {share} ppm, NVML period {period} ns: the 1 s window at {} ms ran {w:+.1} pp over", a / 1_000_000);
                    a += step;
                }
            }
        }
    }

    thread_local! {
        static BURST: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((u64::MAX, 0)) };
    }

    /// Issue 12's launch patterns, simulated with the ledger and markers as libvcuda runs
    /// them: whatever the kernel mix and NVML's sample period, over the 10 s from the first
    /// launch a process stays within its share + 2 pp and no 1 s window after the first
    /// second runs more than 5 pp over, nor more than 3 pp under over 10 s; a steady load
    /// keeps its ±0.1 pp. Markers price each phase by what its own windows proved, so
    /// "bursts by count" (one estimate could not price both its kernels: raising it for the
    /// heavy ones starved the tiny ones) gets its share.
    #[test]
    fn no_launch_pattern_runs_above_the_share_or_starves() {
        type Kernel = Box<dyn Fn(u64, u64) -> u64>;
        let half_s = 500_000_000;
        // Phases of `phase` ns, tiny kernels first (up) or heavy first (down).
        let switch = |phase: u64, tiny_first: bool| -> Kernel {
            Box::new(move |t, _| {
                if (t / phase).is_multiple_of(2) == tiny_first {
                    1_000
                } else {
                    1_000_000
                }
            })
        };
        let patterns: Vec<(&str, Kernel)> = vec![
            (
                "storm",
                Box::new(|_, n| if n < 20_000 { 1_000 } else { 1_000_000 }),
            ),
            ("switch up", switch(half_s, true)),
            ("switch down", switch(half_s, false)),
            (
                "bursts",
                Box::new(|t, _| {
                    if t % 100_000_000 < 2_000_000 {
                        1_000
                    } else {
                        1_000_000
                    }
                }),
            ),
            (
                // every 100 ms: 2000 tiny launches, then heavy ones until the next burst
                "bursts by count",
                Box::new(|t, _| {
                    let c = BURST.with(|b| {
                        let (k, c) = b.get();
                        let c = if k == t / 100_000_000 { c } else { 0 };
                        b.set((t / 100_000_000, c + 1));
                        c
                    });
                    if c < 2_000 {
                        1_000
                    } else {
                        1_000_000
                    }
                }),
            ),
            // The same at another phase: with overpayment banked as credit, the 50 % tenant
            // ran a 1 s window 21 pp over.
            ("switch up (550 ms)", switch(550_000_000, true)),
            ("switch down (550 ms)", switch(550_000_000, false)),
            ("steady", Box::new(|_, _| 50_000)),
        ];
        for (name, kernel) in &patterns {
            for &period in &[166_667_000u64, 1_000_000_000] {
                for &share in &[100_000u64, 200_000, 500_000] {
                    let sim = Sim {
                        share_ppm: share,
                        period_ns: period,
                        queue: 1024,
                        // the first-launch probe measures the first kernel
                        initial_cost_ns: kernel(0, 0) as f64,
                    };
                    let cum = sim.run(11_000_000_000, kernel);
                    let target = share as f64 / 1e6;
                    let avg = (util(&cum, 0, 10_000_000_000) - target) * 100.0;
                    let what = format!(
                        "{name}, share {share} ppm, NVML period {} ms",
                        period / 1_000_000
                    );
                    assert!(avg <= 2.0, "{what}: {avg:+.2} pp over 10 s");
                    if *name == "steady" {
                        assert!(avg.abs() <= 0.1, "{what}: {avg:+.2} pp over 10 s");
                    }
                    let mut a = 1_000_000_000;
                    let mut worst = f64::MIN;
                    while a + 1_000_000_000 <= 11_000_000_000 {
                        let w = (util(&cum, a, a + 1_000_000_000) - target) * 100.0;
                        worst = worst.max(w);
                        a += period.min(half_s);
                    }
                    assert!(worst <= 5.0, "{what}: a 1 s window ran {worst:+.2} pp over");
                    // Nor starved: a phased workload is priced by each phase's kernels.
                    assert!(avg >= -3.0, "{what}: {avg:+.2} pp over 10 s, starved");
                }
            }
        }
    }

    #[test]
    fn beyond_two_pending_markers_the_slow_path_waits_for_a_window_running_late() {
        let mut m = Markers::default();
        // A window of 48 launches paid at 1 µs each, closed at t = 1 ms.
        m.recorded(0.0, 1_000.0, 0.0);
        m.reached(Some(0.0), 0.0);
        m.seen(0.0);
        m.recorded(48_000.0, 1_000.0, 1_000_000.0);
        assert!(m.may_admit_at(50_000_000.0, 0.0), "one pending: always");
        m.recorded(96_000.0, 1_000.0, 1_100_000.0);
        // Two pending: a third only while the oldest runs within 2 × 48 µs + 100 µs.
        assert!(m.may_admit_at(1_150_000.0, 0.0), "on time");
        assert!(
            !m.may_admit_at(1_250_000.0, 0.0),
            "late: 1 ms kernels priced at 1 µs"
        );
        // Others on the device slow it down: it is late later.
        assert!(m.may_admit_at(1_250_000.0, 0.5));
        // The window began only once the one before it was seen done.
        let mut m = Markers::default();
        m.recorded(0.0, 1_000.0, 0.0);
        m.recorded(48_000.0, 1_000.0, 1_000.0);
        m.reached(Some(0.0), 0.0);
        m.seen(5_000_000.0);
        m.recorded(96_000.0, 1_000.0, 2_000.0);
        m.recorded(144_000.0, 1_000.0, 3_000.0);
        assert!(m.may_admit_at(5_150_000.0, 0.0));
        assert!(!m.may_admit_at(5_300_000.0, 0.0));
        // Never more than MAX_PENDING_MARKERS.
        let mut m = Markers::default();
        for i in 0..MAX_PENDING_MARKERS {
            m.recorded(i as f64, 1.0, 0.0);
        }
        assert!(!m.may_admit_at(0.0, 0.0));
    }

    #[test]
    fn marker_naps_end_before_the_queued_work_does() {
        assert_eq!(
            marker_naps(48_000.0).0,
            MIN_MARKER_NAP_NS,
            "1 µs kernels: short naps"
        );
        assert_eq!(marker_naps(400_000.0).0, 200_000);
        assert_eq!(marker_naps(48_000_000.0), (500_000, 20_000_000));
        assert_eq!(marker_naps(f64::NAN), (MIN_MARKER_NAP_NS, 2_000_000));
        assert_eq!(marker_naps(-5.0).0, MIN_MARKER_NAP_NS);
    }

    #[test]
    fn a_window_between_markers_that_ran_far_longer_than_paid_is_charged_at_once() {
        let mut m = Markers::default();
        assert!(m.may_admit());
        // 16 launches paid at 1 µs each; the GPU took 16 ms between the markers.
        m.recorded(0.0, 1_000.0, 0.0);
        m.recorded(16_000.0, 1_000.0, 20_000.0);
        m.recorded(16_000.0, 1_000.0, 20_000.0);
        m.recorded(16_000.0, 1_000.0, 20_000.0);
        assert!(!m.may_admit(), "four pending: the slow path waits");
        assert_eq!(
            m.reached(None, 0.0),
            None,
            "the first reached marker only starts a window"
        );
        let debt = m
            .reached(Some(16_000_000.0), 0.0)
            .expect("1000x longer than paid");
        assert_eq!(
            debt,
            Verdict::Underpaid(Unpaid {
                per_launch_ns: 1_000_000.0,
                debt_ns: 16_000_000.0 - 16_000.0
            }),
            "what ran unpaid"
        );
        assert!(m.may_admit());
        // The two adjacent markers (the slow path closes a group and opens the next one):
        // nothing ran between them, nothing is proved.
        assert_eq!(m.reached(Some(1_000.0), 0.0), None);
        // Paid at what it costs: nothing to charge.
        m.reached(Some(0.0), 0.0);
        m.recorded(16_000_000.0 + 16_000.0, 1_000_000.0, 17_000_000.0);
        assert_eq!(m.reached(Some(17_000_000.0), 0.0), None);
    }

    #[test]
    fn a_window_the_gpu_may_have_idled_in_proves_nothing() {
        // The previous marker was already reached when this one was recorded: the time
        // between them may include the GPU waiting for the host (here the host took 49.5 of
        // the GPU's 50 ms to queue the launches between them).
        let mut m = Markers::default();
        m.recorded(0.0, 1_000.0, 0.0);
        m.reached(None, 0.0);
        m.recorded(16_000.0, 1_000.0, 49_500_000.0);
        assert_eq!(m.reached(Some(50_000_000.0), 0.0), None);
        // The host queued them in 1 ms, and the GPU took 50: 49 ms of device time at least.
        let mut m = Markers::default();
        m.recorded(0.0, 1_000.0, 0.0);
        m.reached(None, 0.0);
        m.recorded(16_000.0, 1_000.0, 1_000_000.0);
        let Some(Verdict::Underpaid(u)) = m.reached(Some(50_000_000.0), 0.0) else {
            panic!("a switch")
        };
        assert_eq!(u.debt_ns, 49_000_000.0 - 16_000.0);
        // Short windows neither (host gaps between tiny kernels), nor ones others shared.
        let mut m = Markers::default();
        m.recorded(0.0, 1_000.0, 0.0);
        m.recorded(16_000.0, 1_000.0, 0.0);
        m.recorded(32_000.0, 1_000.0, 0.0);
        m.reached(None, 0.0);
        assert_eq!(m.reached(Some(500_000.0), 0.0), None, "under MIN_SWITCH_NS");
        let mut m = Markers::default();
        m.recorded(0.0, 1_000_000.0, 0.0);
        m.recorded(16_000_000.0, 1_000_000.0, 0.0);
        m.reached(None, 0.0);
        // 5x longer, but three quarters of the device went to others: time-slicing.
        assert_eq!(m.reached(Some(80_000_000.0), 0.75), None);
        // Nothing was pending (not backed), and the host took 70 of the GPU's 80 ms.
        m.recorded(32_000_000.0, 1_000_000.0, 70_000_000.0);
        m.recorded(48_000_000.0, 1_000_000.0, 70_000_000.0);
        assert_eq!(m.reached(Some(80_000_000.0), 0.0), None);
        assert!(
            m.reached(Some(80_000_000.0), 0.0).is_some(),
            "alone, 5x is a switch"
        );
    }

    #[test]
    fn after_a_proven_switch_a_window_priced_too_low_by_half_is_charged_too() {
        // Every window is backed (the GPU behind): its GPU time is its device time.
        fn window(m: &mut Markers, paid_at: f64, cost: f64) {
            m.recorded(paid_at, cost, 0.0);
        }
        // 48 launches at 1 µs, of which 28 switched to 1 ms: 28 ms ran, 48 µs were paid.
        // (A marker's cost is what the launches after it paid: here the verdict's price.)
        let mut m = Markers::default();
        window(&mut m, 0.0, 1_000.0);
        window(&mut m, 48_000.0, 583_333.3);
        m.reached(None, 0.0);
        let Some(Verdict::Underpaid(u)) = m.reached(Some(28_000_000.0), 0.0) else {
            panic!("a 580x switch is proved")
        };
        // The window's average under-prices the new kernels: 583 µs, not 1 ms.
        assert!((u.per_launch_ns - 583_333.3).abs() < 1.0, "{u:?}");
        // The next window, 48 launches of 1 ms paid at 583 µs, ran 1.7x what it paid: below
        // SWITCH_FACTOR, but right after a switch it is charged and repriced.
        window(&mut m, 48_000.0 + 48.0 * u.per_launch_ns, 1_000_000.0);
        let Some(Verdict::Underpaid(next)) = m.reached(Some(48_000_000.0), 0.0) else {
            panic!("1.7x under the price right after a switch is charged")
        };
        assert!((next.per_launch_ns - 1_000_000.0).abs() < 1.0, "{next:?}");
        assert!((next.debt_ns - 20_000_000.0).abs() < 1.0, "{next:?}");

        // Without a switch before it, the same window proves nothing (a price that far off
        // is NVML's to correct: a marker's window is too short to tell it from noise).
        let mut m = Markers::default();
        window(&mut m, 0.0, 583_333.3);
        window(&mut m, 48.0 * 583_333.3, 583_333.3);
        m.reached(None, 0.0);
        assert_eq!(m.reached(Some(48_000_000.0), 0.0), None);

        // The closer look lasts FOLLOW_WINDOWS windows that prove nothing more.
        let mut m = Markers::default();
        window(&mut m, 0.0, 1_000.0);
        window(&mut m, 48_000.0, 1_000_000.0);
        m.reached(None, 0.0);
        assert!(m.reached(Some(28_000_000.0), 0.0).is_some());
        let mut paid = 48_000.0;
        for _ in 0..FOLLOW_WINDOWS {
            paid += 48_000_000.0;
            window(&mut m, paid, 1_000_000.0);
            assert_eq!(m.reached(Some(48_000_000.0), 0.0), None, "priced right");
        }
        paid += 48_000_000.0;
        window(&mut m, paid, 1_000_000.0);
        assert_eq!(
            m.reached(Some(72_000_000.0), 0.0),
            None,
            "1.5x, long after the switch"
        );
    }

    #[test]
    fn a_window_that_ran_far_shorter_than_paid_lowers_the_price() {
        // 1000 launches paid at 1 ms each (1 s); the GPU passed both markers 2 ms apart, so
        // they took 2 µs each at most, whatever the host did meanwhile.
        let mut m = Markers::default();
        m.recorded(0.0, 1_000_000.0, 0.0);
        m.recorded(1_000_000_000.0, 1_000_000.0, 900_000_000.0);
        m.reached(Some(0.0), 0.0);
        assert_eq!(
            m.reached(Some(2_000_000.0), 0.0),
            Some(Verdict::Overpaid {
                per_launch_ns: 2_000.0
            })
        );
        // Paid twice what ran: within the factor, nothing is proved.
        let mut m = Markers::default();
        m.recorded(0.0, 1_000_000.0, 0.0);
        m.recorded(1_000_000_000.0, 1_000_000.0, 900_000_000.0);
        m.reached(Some(0.0), 0.0);
        assert_eq!(m.reached(Some(500_000_000.0), 0.0), None);
        // Too little paid to matter (under MIN_SWITCH_NS): a window of one tiny launch.
        let mut m = Markers::default();
        m.recorded(0.0, 500_000.0, 0.0);
        m.recorded(500_000.0, 500_000.0, 10_000.0);
        m.reached(Some(0.0), 0.0);
        assert_eq!(m.reached(Some(1_000.0), 0.0), None);
    }

    #[test]
    fn a_marker_the_books_hold_pending_but_the_gpu_passed_starts_no_window() {
        // The first marker is still pending in the books (nobody asked the GPU), but the
        // GPU had reached it when the second was recorded: the time between them may be
        // the host sleeping.
        let mut m = Markers::default();
        m.recorded(0.0, 1_000.0, 0.0);
        m.recorded_behind(64_000.0, 1_000.0, 4_990_000.0, false);
        m.reached(None, 0.0);
        assert_eq!(m.reached(Some(5_000_000.0), 0.0), None);
        // Still behind it: device time, and a window 78x longer than paid.
        let mut m = Markers::default();
        m.recorded(0.0, 1_000.0, 0.0);
        m.recorded_behind(64_000.0, 1_000.0, 4_990_000.0, true);
        m.reached(None, 0.0);
        assert!(m.reached(Some(5_000_000.0), 0.0).is_some());
    }

    #[test]
    fn the_ledger_charges_device_time_that_ran_unpaid_once_and_refunds_what_nvml_denies() {
        let mut c = Calibrator::new(1_000.0);
        c.record_paid(0, 0);
        c.record_debt(0, 0.0);
        c.record_paid(166_667, 10_000); // paid 10 µs in the period...
        assert!(c.sample(166_667, 166_667, 60)); // ...which kept the device 60 % busy
        let owed = c.settle(0.0, 0.0);
        assert!(
            (owed as f64 - (0.6 * 166_667_000.0 - 10_000.0)).abs() < 1.0,
            "{owed}"
        );
        assert_eq!(c.settle(owed as f64, 0.0), 0, "charged once");
        assert_eq!(
            c.settle(0.0, owed as f64 + 1.0),
            0,
            "no charge within the slack (a bucket's capacity)"
        );
        // Work paid but still queued (measured later) is no debt, and no refund either of
        // what NVML did measure.
        c.record_debt(200_000, owed as f64);
        c.record_paid(333_334, 100_010_000);
        assert!(c.sample(333_334, 166_667, 0));
        c.record_debt(333_334, owed as f64);
        assert!(
            c.settle(owed as f64, 0.0) < 0,
            "now paid for: the advance comes back"
        );
        // An advance charged after the newest sample stays until NVML has seen its period.
        let mut c = Calibrator::new(1_000.0);
        c.record_paid(0, 0);
        c.record_debt(0, 0.0);
        c.record_paid(166_667, 0);
        assert!(c.sample(166_667, 166_667, 0));
        c.record_debt(200_000, 5_000_000.0); // a marker's debt, after that period
        assert_eq!(c.settle(5_000_000.0, 0.0), 0);
    }

    /// Work queued before the first controller tick is not debt once it runs: three 20 ms
    /// kernels paid at 10 ms run 10-70 ms; ticks come every 50 ms from 50 ms; NVML's
    /// periods end at 55 ms and 221.7 ms. Matched from the first tick alone, the period
    /// from 55 ms holds 15 ms of their running and none of their paying.
    #[test]
    fn work_queued_before_the_first_tick_is_not_charged_as_debt() {
        let run = |origin: bool| {
            let mut c = Calibrator::new(20_000_000.0);
            if origin {
                c.record_origin(0, 0);
            }
            let mut owed = 0;
            for tick in 1..=5 {
                c.record_paid(tick * 50_000, 60_000_000);
                c.record_debt(tick * 50_000, 0.0);
            }
            for (end, util) in [(55_000, 27), (221_667, 9)] {
                if c.sample(end, 166_667, util) {
                    // a bucket of 5 ms: the charge waits for that much, credit up to 25 ms
                    owed += c.settle(owed as f64, 5_000_000.0);
                }
            }
            owed
        };
        assert!(run(false) > 10_000_000, "without the origin: a false debt");
        assert_eq!(run(true), 0);
        // A period over before the origin belongs to an earlier process with the same pid.
        let mut c = Calibrator::new(1_000.0);
        c.record_origin(100_000, 0);
        c.record_paid(150_000, 0);
        assert!(!c.sample(90_000, 166_667, 50));
        assert!(c.sample(150_000, 166_667, 0));
    }
}
#[cfg(test)]
mod ledger_and_fill {
    use super::*;

    /// NVML's util for the period ending at `end_ns` (1/6 s) of kernels of `len` ns started
    /// every `every` ns from 0.
    fn util(end_ns: u64, len: u64, every: u64) -> u32 {
        let (a, b) = (end_ns.saturating_sub(166_667_000), end_ns);
        let busy: u64 = (0..=b / every)
            .map(|k| (k * every + len).min(b).saturating_sub((k * every).max(a)))
            .sum();
        (busy as f64 / 166_667_000.0 * 100.0).round() as u32
    }

    /// A 90 % tenant of 20 ms kernels, probed right: it pays each kernel as it launches it,
    /// one every 22.2 ms from its birth, so at any moment the kernel it just paid has not
    /// run. The period it started in reads that as cheaper launches; the estimate stays
    /// within 3 % of the probe through its first second (a window of a few periods of
    /// eight kernels each is off by part of one) where it dropped 4.5 %.
    #[test]
    fn the_period_the_queue_filled_in_does_not_lower_a_probed_cost() {
        let (len, every) = (20_000_000u64, 22_222_222u64);
        let paid_at = |t_ns: u64| (t_ns / every + 1) * len;
        let mut c = Calibrator::new(len as f64);
        c.record_origin(0, 0);
        let mut lowest = f64::MAX;
        let mut next_end = 100_000_000; // NVML's periods are not aligned with the birth
        for tick in 1..=24u64 {
            let t = tick * 50_000_000;
            c.record_paid(t / 1000, paid_at(t));
            while next_end <= t {
                assert!(c.sample(next_end / 1000, 166_667, util(next_end, len, every)));
                next_end += 166_667_000;
            }
            lowest = lowest.min(c.update());
        }
        assert!(
            lowest >= 0.97 * len as f64,
            "estimate fell to {lowest:.0} ns"
        );
    }

    /// Kernels switch from 1 µs to 1 ms; marker windows prove it and raise the price to
    /// 1 ms at 1.8 s. With NVML's 1 s samples, the period holding the raise was paid 190 ms
    /// (the tenant's 20 % share plus a queue refilled with long kernels) and ran 60 ms of
    /// them: it reads the cost at a third. Noted as the raise's period, it cannot lower it.
    #[test]
    fn the_period_a_price_was_raised_in_does_not_lower_it() {
        let run = |note: bool| {
            let mut c = Calibrator::new(1_000.0);
            c.record_origin(0, 0);
            c.record_paid(1_000_000, 20_000_000);
            c.set_cost(1_000_000.0);
            if note {
                c.raised_at(1_800_000, true);
            }
            let mut lowest = f64::MAX;
            // Paid by the end of each second: the raise's second 190 ms, then 200 ms each.
            let mut paid = 20_000_000 + 190_000_000;
            for (end_s, util) in [(2u64, 6u32), (3, 20), (4, 20), (5, 20), (6, 20)] {
                c.record_paid(end_s * 1_000_000, paid);
                assert!(c.sample(end_s * 1_000_000, 1_000_000, util));
                lowest = lowest.min(c.update());
                paid += 200_000_000;
            }
            lowest
        };
        let lowest = run(true);
        assert!(lowest >= 0.97e6, "estimate fell to {lowest:.0} ns");
        // Read as evidence like any other, it drags the estimate down for seconds.
        let unnoted = run(false);
        assert!(unnoted < 0.8e6, "{unnoted:.0} ns");
    }

    /// At 1 s samples the queue keeps deepening for a period after the raise's (its
    /// windows now hold 1 ms kernels): that period reads the cost low too. The raised
    /// price holds as a floor for RAISE_FLOOR_US of sampled time; a direct measurement
    /// (an Overpaid window, `set_cost`) lifts it.
    #[test]
    fn a_raised_price_is_a_floor_for_two_seconds_of_samples() {
        let mut c = Calibrator::new(1_000.0);
        c.record_origin(0, 0);
        c.record_paid(1_000_000, 20_000_000);
        c.set_cost(1_000_000.0);
        c.raised_at(1_800_000, true);
        let mut paid = 20_000_000;
        // Half-second periods: the raise's paid 95 ms and ran 30; the next ones paid 100 ms
        // and ran 70 (still filling), which alone would lower the estimate by a quarter.
        for (end_ms, util, pay) in [
            (2_000u64, 6u32, 95_000_000u64),
            (2_500, 14, 100_000_000),
            (3_000, 14, 100_000_000),
            (3_500, 14, 100_000_000),
        ] {
            paid += pay;
            c.record_paid(end_ms * 1_000, paid);
            assert!(c.sample(end_ms * 1_000, 500_000, util));
            assert_eq!(
                c.update(),
                1_000_000.0,
                "held at the raised price at {end_ms} ms"
            );
        }
        // Past the floor (samples to 3.8 s), evidence moves it again.
        paid += 100_000_000;
        c.record_paid(4_000_000, paid);
        c.sample(4_000_000, 500_000, 14);
        assert!(c.update() < 0.9e6);
        // Raised beside others not yet measured: no floor (the raise may be their work).
        let mut c = Calibrator::new(1_000.0);
        c.record_origin(0, 0);
        c.record_paid(1_000_000, 20_000_000);
        c.set_cost(1_000_000.0);
        c.raised_at(1_800_000, false);
        let mut paid = 20_000_000;
        for (end_ms, util, pay) in [
            (2_000u64, 6u32, 95_000_000u64),
            (2_500, 14, 100_000_000),
            (3_000, 14, 100_000_000),
        ] {
            paid += pay;
            c.record_paid(end_ms * 1_000, paid);
            c.sample(end_ms * 1_000, 500_000, util);
            c.update();
        }
        assert!(c.cost_ns() < 0.9e6, "{}", c.cost_ns());
        // A window proving shorter kernels sets the price at once, floor or not.
        let mut c = Calibrator::new(1_000_000.0);
        c.raised_at(1_800_000, true);
        c.set_cost(10_000.0);
        assert_eq!(c.cost_ns(), 10_000.0);
        c.record_origin(0, 0);
        for end_s in 1..=5u64 {
            c.record_paid(end_s * 1_000_000, end_s * 100_000_000);
            c.sample(end_s * 1_000_000, 1_000_000, 5);
            c.update();
        }
        assert!(c.cost_ns() < 10_000.0, "no floor left: {}", c.cost_ns());
    }

    /// The same tenant's first launches admitted free while the probe timed them, and
    /// charged in one lump when it had (55 ms, after the first tick; the controller notes
    /// it at the next, 100 ms): the period after the origin's holds the lump and none of
    /// their running, so it reads the cost low too.
    #[test]
    fn the_probes_lump_charge_does_not_lower_the_cost() {
        let (len, every) = (20_000_000u64, 22_222_222u64);
        let paid_at = |t_ns: u64| {
            if t_ns < 55_000_000 {
                0
            } else {
                (t_ns / every + 1) * len
            }
        };
        let run = |noted: bool| {
            let mut c = Calibrator::new(len as f64);
            c.record_origin(0, 0);
            let mut lowest = f64::MAX;
            let mut next_end = 30_000_000;
            for tick in 1..=24u64 {
                let t = tick * 50_000_000;
                c.record_paid(t / 1000, paid_at(t));
                if tick == 2 && noted {
                    c.paid_unpriced_by(t / 1000);
                }
                while next_end <= t {
                    assert!(c.sample(next_end / 1000, 166_667, util(next_end, len, every)));
                    next_end += 166_667_000;
                }
                lowest = lowest.min(c.update());
            }
            lowest / len as f64
        };
        assert!(run(false) < 0.97, "the lump reads low: {}", run(false));
        assert!(run(true) >= 0.97, "estimate fell to {}", run(true));
    }

    /// Paid far beyond what ran (tiny kernels priced as heavy ones) is forgiven past a few
    /// buckets, so heavy kernels run unpaid afterwards are charged, not set against it.
    #[test]
    fn overpayment_is_not_banked_as_credit() {
        let cap = 2_000_000.0;
        let mut c = Calibrator::new(1_000_000.0);
        c.record_origin(0, 0);
        let mut owed = 0i64;
        // 1 s: 100 ms paid, 10 ms ran; then 1 s: 50 ms ran, nothing paid.
        for k in 1..=12u64 {
            let t_us = k * 166_667;
            let paid = 100_000_000 * k.min(6) / 6;
            c.record_paid(t_us, paid);
            c.record_debt(t_us, owed as f64);
            let pct = if k <= 6 { 1 } else { 5 }; // ~1.7 ms, then ~8.3 ms, of 166.7
            assert!(c.sample(t_us, 166_667, pct));
            owed += c.settle(owed as f64, cap);
        }
        // 50 ms ran unpaid less at most 5 buckets (10 ms) of earlier overpayment.
        assert!(owed >= 38_000_000, "charged {owed} ns");
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn refill_stays_within_capacity(tokens in -1_000_000_000i64..1_000_000_000, elapsed in 0u64..10_000_000_000, rate in 1u64..=PPM, cost in 100u64..100_000_000) {
            let cap = capacity(cost, rate);
            let (new, added) = refill(tokens, elapsed, rate, cap);
            prop_assert!(added >= 0);
            prop_assert_eq!(new, tokens + added);
            prop_assert!(new <= cap.max(tokens));
            prop_assert!(added <= earned(elapsed, rate));
        }

        #[test]
        fn waiting_earns_the_deficit(deficit in 1i64..10_000_000_000, rate in 1u64..=PPM) {
            let w = wait_ns(deficit, rate);
            prop_assert!(earned(w, rate) >= deficit);
            prop_assert!(w == 0 || earned(w - 1, rate) <= deficit);
        }

        #[test]
        fn elastic_rate_stays_between_share_and_limit(cur in 0u64..=PPM, share in 1u64..=PPM, extra in 0u64..=PPM, others in 0.0f64..1.0, own in 0.0f64..1.0, hungry: bool) {
            let limit = (share + extra).min(PPM);
            let r = elastic_rate(cur, share, limit, others, own, hungry);
            prop_assert!(r >= share && r <= limit.max(share));
        }

        #[test]
        fn calibration_moves_towards_the_evidence(cost in 1_000f64..1e8, truth in 0.3f64..3.0) {
            // Paid at a steady rate; the device saw `truth` times what was paid.
            let mut c = Calibrator::new(cost);
            for i in 0..=40u64 {
                c.record_paid(i * 50_000, i * 25_000_000);
            }
            for k in 1..=6u64 {
                let busy = (truth * 0.5 * 100.0).min(100.0).round() as u32;
                prop_assert!(c.sample(k * 166_667, 166_667, busy));
            }
            let new = c.update();
            if truth > 1.05 { prop_assert!(new > cost); }
            if truth < 0.95 { prop_assert!(new < cost); }
            prop_assert!(new / cost <= 4.0 && new / cost >= 0.25);
        }
    }
}
