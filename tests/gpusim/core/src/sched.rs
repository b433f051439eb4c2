//! The device timeline: one kernel at a time per GPU, contexts time-sliced round-robin.
//!
//! Model. Each context has a FIFO launch queue on its GPU. The GPU runs the head entry of
//! the current queue; the current queue keeps the GPU until it has no work or has used a
//! whole time slice while another queue has work, then the next queue with work (in slot
//! order, round-robin) gets a fresh slice. Kernels are preempted at slice ends, as compute
//! preemption does between contexts on Pascal and later. Time only passes in [`advance`],
//! which replays the timeline from `sim_time` up to "now"; every reader advances first, so
//! the result does not depend on who looks or when.
//!
//! Because a slice ends only when its queue runs dry or the slice is used up, only each
//! queue's *total* pending time matters for when work finishes: [`predict`] uses that to
//! compute exactly when an entry completes if nothing else arrives.
//!
//! This module is pure: no clock, no I/O, no locks. The caller holds the GPU lock.

use crate::layout::{Period, Queue, Sched, MAX_PROCS, MAX_QUEUES, NONE, PERIODS, QUEUE_CAP};

/// Scheduling parameters from the config.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    pub timeslice_ns: u64,
    pub period_ns: u64,
}

/// Where completed work is reported (per-process ground-truth counters).
pub trait Sink {
    fn busy(&mut self, slot: u32, ns: u64);
    fn completed(&mut self, slot: u32, kernels: u32);
}

/// A sink that ignores everything.
pub struct NoSink;
impl Sink for NoSink {
    fn busy(&mut self, _: u32, _: u64) {}
    fn completed(&mut self, _: u32, _: u32) {}
}

impl Sched {
    /// Reset to an idle GPU at time `now`.
    pub fn reset(&mut self, now: u64) {
        self.sim_time = now;
        self.cur = NONE;
        self.slice_used = 0;
        self.busy_total = 0;
        for p in self.periods.iter_mut() {
            p.k = u64::MAX;
            p.busy = 0;
            p.proc_busy = [0; MAX_PROCS];
            p.proc_pid = [0; MAX_PROCS];
        }
        for q in self.queues.iter_mut() {
            q.owner = NONE;
            q.owner_pid = 0;
            q.owner_generation = 0;
            q.head = 0;
            q.tail = 0;
            q.pending = 0;
        }
    }

    fn active(&self, q: usize) -> bool {
        let q = &self.queues[q];
        q.owner != NONE && q.head < q.tail
    }

    /// The next queue with work after `after` (round-robin, `after` itself last).
    fn next_active(&self, after: u32) -> Option<u32> {
        next_in(after, |i| self.active(i))
    }

    /// Simulate the GPU from `sim_time` up to `to`.
    pub fn advance(&mut self, to: u64, p: &Params, sink: &mut impl Sink) {
        while self.sim_time < to {
            let cur_ok = self.cur != NONE && self.active(self.cur as usize);
            if !cur_ok || self.slice_used >= p.timeslice_ns {
                match self.next_active(self.cur) {
                    None => {
                        self.cur = NONE;
                        self.slice_used = 0;
                        self.sim_time = to;
                        break;
                    }
                    Some(n) => {
                        self.cur = n;
                        self.slice_used = 0;
                    }
                }
            }
            let qi = self.cur as usize;
            let start = self.sim_time;
            let (owner, pid, run, done) = {
                let q = &mut self.queues[qi];
                let e = &mut q.entries[(q.head % QUEUE_CAP as u64) as usize];
                let run = e
                    .remaining
                    .min(p.timeslice_ns - self.slice_used)
                    .min(to - start);
                e.remaining -= run;
                q.pending -= run;
                let done = if e.remaining == 0 {
                    e.done_at = start + run;
                    q.head += 1;
                    Some(e.kernels)
                } else {
                    None
                };
                (q.owner, q.owner_pid, run, done)
            };
            if run > 0 {
                self.account(owner, pid, start, run, p.period_ns);
                sink.busy(owner, run);
            }
            self.sim_time += run;
            self.slice_used += run;
            if let Some(k) = done {
                sink.completed(owner, k);
            }
        }
    }

    fn account(&mut self, slot: u32, pid: u32, start: u64, len: u64, period: u64) {
        self.busy_total += len;
        let (mut t, end) = (start, start + len);
        while t < end {
            let k = t / period;
            let chunk = end.min((k + 1) * period) - t;
            let pr = &mut self.periods[(k % PERIODS as u64) as usize];
            if pr.k != k {
                pr.k = k;
                pr.busy = 0;
                pr.proc_busy = [0; MAX_PROCS];
                pr.proc_pid = [0; MAX_PROCS];
            }
            pr.busy += chunk;
            if (slot as usize) < MAX_PROCS {
                pr.proc_busy[slot as usize] =
                    pr.proc_busy[slot as usize].saturating_add(chunk as u32);
                pr.proc_pid[slot as usize] = pid;
            }
            t += chunk;
        }
    }

    /// When entry `seq` of queue `qi` completes if nothing else is launched, or `None` if it
    /// already has. Exact for round-robin slicing (see the module comment); after
    /// `max_steps` slices it returns the time reached so far, a lower bound.
    pub fn predict(&self, qi: usize, seq: u64, p: &Params) -> Option<u64> {
        let q = &self.queues[qi];
        if seq < q.head {
            return None;
        }
        let mut want: u64 = (q.head..=seq.min(q.tail.saturating_sub(1)))
            .map(|s| q.entries[(s % QUEUE_CAP as u64) as usize].remaining)
            .sum();
        if want == 0 {
            return Some(self.sim_time);
        }
        let mut rem = [0u64; MAX_QUEUES];
        for (i, r) in rem.iter_mut().enumerate() {
            if self.active(i) {
                *r = self.queues[i].pending;
            }
        }
        let (mut t, mut cur, mut used) = (self.sim_time, self.cur, self.slice_used);
        for _ in 0..200_000 {
            let cur_ok = cur != NONE && rem[cur as usize] > 0;
            if !cur_ok || used >= p.timeslice_ns {
                match next_in(cur, |i| rem[i] > 0) {
                    None => return Some(t),
                    Some(n) => {
                        cur = n;
                        used = 0;
                    }
                }
            }
            let c = cur as usize;
            let mut run = rem[c].min(p.timeslice_ns - used);
            if c == qi {
                run = run.min(want);
            }
            t += run;
            rem[c] -= run;
            used += run;
            if c == qi {
                want -= run;
                if want == 0 {
                    return Some(t);
                }
            }
        }
        Some(t)
    }

    /// The record of period `k`, if anything ran in it.
    pub fn period(&self, k: u64) -> Option<&Period> {
        let pr = &self.periods[(k % PERIODS as u64) as usize];
        (pr.k == k).then_some(pr)
    }

    /// Busy ns in period `k` (0 if idle or forgotten).
    pub fn period_busy(&self, k: u64) -> u64 {
        self.period(k).map_or(0, |p| p.busy)
    }

    /// Claim a free queue for `slot`; returns its index.
    pub fn claim_queue(&mut self, slot: u32, pid: u32, generation: u32) -> Option<usize> {
        let i = self.queues.iter().position(|q| q.owner == NONE)?;
        let q = &mut self.queues[i];
        q.owner = slot;
        q.owner_pid = pid;
        q.owner_generation = generation;
        // Sequence numbers keep counting from where the last owner stopped, so stale
        // entries never look like new ones.
        q.head = q.tail;
        q.pending = 0;
        Some(i)
    }

    /// Drop a queue and whatever it still had pending (a destroyed context's or dead
    /// process's work is discarded, as the driver does).
    pub fn release_queue(&mut self, qi: usize) {
        let q = &mut self.queues[qi];
        q.owner = NONE;
        q.head = q.tail;
        q.pending = 0;
        if self.cur == qi as u32 {
            self.cur = NONE;
            self.slice_used = 0;
        }
    }

    /// Append an entry; the caller checked there is room (`tail - head < depth`).
    pub fn push(&mut self, qi: usize, duration_ns: u64, kernels: u32) -> u64 {
        let q: &mut Queue = &mut self.queues[qi];
        let seq = q.tail;
        q.entries[(seq % QUEUE_CAP as u64) as usize] = crate::layout::Entry {
            remaining: duration_ns,
            done_at: 0,
            kernels,
            _pad: 0,
        };
        q.tail += 1;
        q.pending += duration_ns;
        seq
    }
}

fn next_in(after: u32, ok: impl Fn(usize) -> bool) -> Option<u32> {
    let start = if after == NONE {
        MAX_QUEUES - 1
    } else {
        after as usize
    };
    (1..=MAX_QUEUES)
        .map(|d| (start + d) % MAX_QUEUES)
        .find(|&i| ok(i))
        .map(|i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn new_sched(now: u64) -> Box<Sched> {
        // SAFETY: Sched is plain old data (integers and arrays of them); all-zero is a valid
        // value, and `reset` then sets the sentinels.
        let mut s: Box<Sched> = unsafe { Box::new_zeroed().assume_init() };
        s.reset(now);
        s
    }

    const P: Params = Params {
        timeslice_ns: 2_000_000,
        period_ns: 166_667_000,
    };

    #[derive(Default)]
    struct Rec {
        busy: [u64; 4],
        done: [u64; 4],
    }
    impl Sink for Rec {
        fn busy(&mut self, slot: u32, ns: u64) {
            self.busy[slot as usize] += ns;
        }
        fn completed(&mut self, slot: u32, k: u32) {
            self.done[slot as usize] += u64::from(k);
        }
    }

    #[test]
    fn single_queue_runs_back_to_back() {
        let mut s = new_sched(1000);
        let q = s.claim_queue(0, 42, 1).unwrap();
        let a = s.push(q, 500, 1);
        let b = s.push(q, 300, 1);
        assert_eq!(s.predict(q, a, &P), Some(1500));
        assert_eq!(s.predict(q, b, &P), Some(1800));
        let mut r = Rec::default();
        s.advance(1600, &P, &mut r);
        assert_eq!(s.queues[q].head, 1);
        assert_eq!(s.queues[q].entries[0].done_at, 1500);
        s.advance(5000, &P, &mut r);
        assert_eq!(s.queues[q].entries[1].done_at, 1800);
        assert_eq!(r.busy[0], 800);
        assert_eq!(r.done[0], 2);
        assert_eq!(s.busy_total, 800);
        assert_eq!(s.predict(q, b, &P), None);
    }

    #[test]
    fn two_saturating_contexts_alternate_slices() {
        let mut s = new_sched(0);
        let a = s.claim_queue(0, 1, 1).unwrap();
        let b = s.claim_queue(1, 2, 1).unwrap();
        for _ in 0..100 {
            s.push(a, 20_000_000, 1);
            s.push(b, 50_000, 1);
        }
        let mut r = Rec::default();
        s.advance(1_000_000_000, &P, &mut r);
        // b's queue holds only 5 ms of work; after it drains a runs alone.
        assert_eq!(r.busy[1], 5_000_000);
        assert_eq!(r.busy[0] + r.busy[1], 1_000_000_000);
        // a, b, a, b, a alternate 2 ms slices, then b needs 1 ms more: done at 11 ms.
        assert_eq!(s.queues[b].entries[99].done_at, 11_000_000);
    }

    #[test]
    fn idle_time_is_not_busy() {
        let mut s = new_sched(0);
        let q = s.claim_queue(0, 1, 1).unwrap();
        s.push(q, 1_000, 1);
        let mut r = Rec::default();
        s.advance(10_000, &P, &mut r);
        assert_eq!(s.sim_time, 10_000);
        s.push(q, 1_000, 1);
        s.advance(20_000, &P, &mut r);
        assert_eq!(r.busy[0], 2_000);
        assert_eq!(s.queues[q].entries[1].done_at, 11_000);
    }

    #[test]
    fn periods_split_busy_time_at_boundaries() {
        let p = Params {
            timeslice_ns: 1_000,
            period_ns: 100,
        };
        let mut s = new_sched(50);
        let q = s.claim_queue(3, 9, 1).unwrap();
        s.push(q, 120, 1);
        s.advance(1000, &p, &mut NoSink);
        assert_eq!(s.period_busy(0), 50);
        assert_eq!(s.period_busy(1), 70);
        assert_eq!(s.period(1).unwrap().proc_busy[3], 70);
        assert_eq!(s.period(1).unwrap().proc_pid[3], 9);
        assert_eq!(s.period_busy(2), 0);
    }

    #[test]
    fn released_queue_work_is_discarded() {
        let mut s = new_sched(0);
        let q = s.claim_queue(0, 1, 1).unwrap();
        s.push(q, 1_000_000, 1);
        s.advance(10, &P, &mut NoSink);
        s.release_queue(q);
        s.advance(100, &P, &mut NoSink);
        assert_eq!(s.busy_total, 10);
        let q2 = s.claim_queue(1, 2, 1).unwrap();
        assert_eq!(q2, q);
        assert_eq!(s.queues[q2].head, s.queues[q2].tail);
    }

    proptest! {
        /// With no new arrivals, predict() is exactly when advance() completes the entry,
        /// the GPU is never idle while work is pending, and busy time never exceeds wall time.
        #[test]
        fn predict_matches_advance(
            works in proptest::collection::vec(proptest::collection::vec(1u64..5_000_000, 1..20), 1..5),
            slice in 1_000u64..3_000_000,
            target_q in 0usize..5,
            step in 100_000u64..7_000_000,
        ) {
            let p = Params { timeslice_ns: slice, period_ns: 166_667_000 };
            let mut s = new_sched(7);
            let mut qs = vec![];
            for (i, w) in works.iter().enumerate() {
                let q = s.claim_queue(i as u32, i as u32 + 100, 1).unwrap();
                for &d in w { s.push(q, d, 1); }
                qs.push(q);
            }
            let total: u64 = works.iter().flatten().sum();
            let tq = qs[target_q % qs.len()];
            let tseq = s.queues[tq].tail - 1;
            let predicted = s.predict(tq, tseq, &p).unwrap();
            let mut now = 7;
            while s.queues[tq].head <= tseq {
                now += step;
                s.advance(now, &p, &mut NoSink);
                prop_assert!(s.busy_total <= now - 7);
            }
            prop_assert_eq!(s.queues[tq].entries[(tseq % QUEUE_CAP as u64) as usize].done_at, predicted);
            s.advance(now + total, &p, &mut NoSink);
            prop_assert_eq!(s.busy_total, total, "work conserving");
        }

        /// Saturating contexts share the GPU equally, to within one slice each.
        #[test]
        fn saturating_contexts_share_equally(n in 2usize..5, slice_us in 100u64..3000, kernel_us in 10u64..5000) {
            let p = Params { timeslice_ns: slice_us * 1000, period_ns: 166_667_000 };
            let mut s = new_sched(0);
            let mut r = Rec::default();
            let horizon = 1_000_000_000u64;
            let per_q = (horizon / (kernel_us * 1000) + 2).min(QUEUE_CAP as u64);
            for i in 0..n {
                let q = s.claim_queue(i as u32, i as u32, 1).unwrap();
                for _ in 0..per_q { s.push(q, kernel_us * 1000, 1); }
            }
            let run_to = (per_q * kernel_us * 1000).min(horizon);
            s.advance(run_to, &p, &mut r);
            let share = run_to / n as u64;
            for i in 0..n {
                let d = r.busy[i].abs_diff(share);
                prop_assert!(d <= 2 * slice_us * 1000, "queue {} got {} of {}", i, r.busy[i], run_to);
            }
        }
    }
}
