//! The watchdog's rules (pure: no clock, no NVML). The library holds every process it runs
//! in to the container's quota and compute share; a process that bypasses it (a static
//! binary, raw ioctls, the library patched out of its memory) shows up only in what the
//! driver reports. So each control-loop round feeds what the driver reports here:
//! - memory ([`MemoryWatch`]): a container GPU whose driver-reported memory exceeds its
//!   quota two rounds in a row is in violation (the library releases right after the driver
//!   frees, so one sample may catch a free in flight);
//! - compute ([`ComputeWatch`]): a container GPU whose driver-reported utilization, averaged
//!   over a whole window, exceeds its limit by more than a margin is in violation.
//!
//! Why a window and a margin: the limiter is accurate to about ±2 pp over a second and lets
//! a bucket of 10 ms through at once, and NVML's samples are integers over ~1/6 s periods.
//! A 10 s window and a 10 pp margin (the defaults) never flag a container the library holds,
//! and catch a bypass within about one window.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::allocation::Allocation;
use crate::ids::AllocationId;

/// What the rules watch: one container GPU, an allocation's GPU `gpu` (the index among the
/// allocation's GPUs).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub alloc: AllocationId,
    pub gpu: usize,
}

impl Key {
    pub fn new(alloc: AllocationId, gpu: usize) -> Self {
        Key { alloc, gpu }
    }
}

/// A container GPU over its memory quota by the driver's account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Over {
    pub key: Key,
    /// Driver-reported bytes of the container's processes on the GPU.
    pub used: u64,
    pub quota: u64,
}

/// The memory quota the watchdog holds container `a` to on each of its GPUs: whole GPUs
/// have none beyond the GPU itself.
pub fn memory_quota(a: &Allocation) -> u64 {
    if a.percent >= 100 {
        u64::MAX
    } else {
        a.quota
    }
}

/// The compute limit (percent) the watchdog holds container `a` to on each of its GPUs:
/// its elastic limit, never below its share; `None` for whole GPUs (unthrottled).
pub fn compute_limit(a: &Allocation) -> Option<u32> {
    (a.percent < 100).then(|| a.core_limit.unwrap_or(a.percent).max(a.percent))
}

/// This round's container GPUs over their quota, from the driver-reported bytes per
/// container GPU and each one's quota (`None`: not watched).
pub fn violations(
    usage: &BTreeMap<Key, u64>,
    quota: &dyn Fn(&AllocationId, usize) -> Option<u64>,
) -> Vec<Over> {
    usage
        .iter()
        .filter_map(|(key, &used)| {
            let quota = quota(&key.alloc, key.gpu)?;
            (used > quota).then(|| Over {
                key: key.clone(),
                used,
                quota,
            })
        })
        .collect()
}

/// The memory rule: over the quota two rounds in a row.
#[derive(Debug, Default)]
pub struct MemoryWatch {
    over_before: BTreeSet<Key>,
}

impl MemoryWatch {
    /// One round's container GPUs over their quota ([`violations`]); returns those that
    /// were over the round before too: the violations. A round that did not see a
    /// container GPU over (freed, or the driver not asked) starts it afresh.
    pub fn observe(&mut self, over: Vec<Over>) -> Vec<Over> {
        let now: BTreeSet<Key> = over.iter().map(|o| o.key.clone()).collect();
        let confirmed = over
            .into_iter()
            .filter(|o| self.over_before.contains(&o.key))
            .collect();
        self.over_before = now;
        confirmed
    }
}

/// The rule's settings and the recent samples of every container GPU it watches.
#[derive(Debug)]
pub struct ComputeWatch {
    window_ms: u64,
    margin_percent: u32,
    samples: BTreeMap<Key, VecDeque<(u64, u32)>>,
}

impl ComputeWatch {
    pub fn new(window_ms: u64, margin_percent: u32) -> Self {
        ComputeWatch {
            window_ms: window_ms.max(1),
            margin_percent,
            samples: BTreeMap::new(),
        }
    }

    /// One round: at `now_ms`, container GPU `key`'s processes used `util` percent of the
    /// GPU (summed over its processes, as the driver reports), and may use `limit` percent.
    /// Returns the window's mean when it is a violation: samples span the whole window and
    /// their mean exceeds `limit + margin`. The window then starts afresh: a sustained
    /// excess is one violation per window, not one per round.
    pub fn observe(&mut self, key: Key, now_ms: u64, util: u32, limit: u32) -> Option<u32> {
        let q = self.samples.entry(key).or_default();
        q.push_back((now_ms, util));
        while q
            .front()
            .is_some_and(|&(t, _)| now_ms.saturating_sub(t) > self.window_ms)
        {
            q.pop_front();
        }
        let (first, _) = *q.front()?;
        // Not a whole window yet (a container just started, or the manager did).
        if now_ms.saturating_sub(first) + self.window_ms / 10 < self.window_ms {
            return None;
        }
        let mean = q.iter().map(|&(_, u)| u64::from(u)).sum::<u64>() / q.len() as u64;
        let mean = u32::try_from(mean).unwrap_or(u32::MAX);
        if mean <= limit.saturating_add(self.margin_percent) {
            return None;
        }
        q.clear();
        Some(mean)
    }

    /// Forget container GPUs no longer watched.
    pub fn retain(&mut self, keep: impl Fn(&Key) -> bool) {
        self.samples.retain(|k, _| keep(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> Key {
        Key::new("a1".into(), 0)
    }

    fn over(id: &str, used: u64) -> Over {
        Over {
            key: Key::new(id.into(), 0),
            used,
            quota: 4 << 30,
        }
    }

    #[test]
    fn usage_over_quota_is_a_violation() {
        let usage: BTreeMap<Key, u64> = [
            (Key::new("a1".into(), 0), 5 << 30),
            (Key::new("a2".into(), 0), 1 << 30),
            (Key::new("a3".into(), 0), 9 << 30),
        ]
        .into();
        let q = |id: &AllocationId, _| match id.as_str() {
            "a1" => Some(4 << 30),
            "a2" => Some(2 << 30),
            _ => None,
        };
        assert_eq!(violations(&usage, &q), vec![over("a1", 5 << 30)]);
    }

    #[test]
    fn a_whole_gpu_has_no_quota_and_no_compute_limit() {
        let mut a = Allocation {
            slice: false,
            id: "a1".into(),
            cores: vec![],
            gpus: vec!["GPU-1".into()],
            percent: 100,
            memory: vec![],
            quota: 1 << 30,
            core_limit: None,
            owner: None,
            created: 0,
        };
        assert_eq!((memory_quota(&a), compute_limit(&a)), (u64::MAX, None));
        a.percent = 30;
        assert_eq!((memory_quota(&a), compute_limit(&a)), (1 << 30, Some(30)));
        a.core_limit = Some(60);
        assert_eq!(compute_limit(&a), Some(60), "elastic: up to its limit");
        a.core_limit = Some(10);
        assert_eq!(compute_limit(&a), Some(30), "never below its share");
    }

    #[test]
    fn memory_over_the_quota_is_a_violation_only_the_second_round_in_a_row() {
        let mut w = MemoryWatch::default();
        assert_eq!(
            w.observe(vec![over("a1", 5 << 30)]),
            vec![],
            "once: a free in flight?"
        );
        assert_eq!(
            w.observe(vec![over("a1", 6 << 30), over("a2", 5 << 30)]),
            vec![over("a1", 6 << 30)],
            "twice: a1 is; a2 only once so far"
        );
        assert_eq!(
            w.observe(vec![over("a1", 6 << 30)]),
            vec![over("a1", 6 << 30)]
        );
        assert_eq!(w.observe(vec![]), vec![], "freed");
        assert_eq!(
            w.observe(vec![over("a1", 6 << 30)]),
            vec![],
            "starts afresh"
        );
    }

    #[test]
    fn a_bypass_is_flagged_once_a_whole_window_is_over_the_limit() {
        let mut w = ComputeWatch::new(10_000, 10);
        // 30 % share, a process running flat out: nothing before the window is full.
        let flagged: Vec<_> = (0..=60)
            .map(|i| w.observe(key(), i * 167, 100, 30))
            .collect();
        assert!(flagged[..54].iter().all(Option::is_none));
        assert_eq!(flagged[54], Some(100));
        assert!(
            flagged[55..].iter().all(Option::is_none),
            "a new window begins"
        );
    }

    #[test]
    fn within_the_margin_is_no_violation() {
        let mut w = ComputeWatch::new(10_000, 10);
        for i in 0..200 {
            // 30 % share, 39-40 % seen: within the 10 pp margin.
            assert_eq!(w.observe(key(), i * 167, 39 + (i % 2) as u32, 30), None);
        }
    }

    #[test]
    fn a_burst_shorter_than_the_window_is_no_violation() {
        let mut w = ComputeWatch::new(10_000, 10);
        for i in 0..200u64 {
            // 1 s at 100 % in every 10 s, 30 % otherwise: a mean of 37 %, under 30 + 10.
            let util = if i % 60 < 6 { 100 } else { 30 };
            assert_eq!(w.observe(key(), i * 167, util, 30), None, "round {i}");
        }
    }

    #[test]
    fn containers_and_gpus_are_watched_apart_and_forgotten() {
        let mut w = ComputeWatch::new(1_000, 0);
        let mut flagged = [0, 0];
        for t in 0..20 {
            flagged[0] += usize::from(
                w.observe(Key::new("a".into(), 0), t * 100, 90, 50)
                    .is_some(),
            );
            flagged[1] += usize::from(
                w.observe(Key::new("a".into(), 1), t * 100, 10, 50)
                    .is_some(),
            );
        }
        assert_eq!(flagged, [2, 0], "GPU 0 once per window, GPU 1 never");
        for t in 20..29 {
            w.observe(Key::new("a".into(), 0), t * 100, 90, 50);
        }
        w.retain(|k| k.gpu == 1);
        assert_eq!(
            w.observe(Key::new("a".into(), 0), 2_900, 90, 50),
            None,
            "forgotten: starts over"
        );
    }

    proptest! {
        /// Memory: a container GPU is a violation exactly when the round saw it over its
        /// quota and the round before did too, whatever the others do.
        #[test]
        fn memory_is_a_violation_exactly_when_over_two_rounds_in_a_row(
            rounds in proptest::collection::vec(proptest::collection::btree_set(0u8..4, 0..4), 1..40),
        ) {
            let mut w = MemoryWatch::default();
            let mut before = BTreeSet::new();
            for ids in rounds {
                let over: Vec<Over> = ids.iter().map(|i| over(&i.to_string(), 5 << 30)).collect();
                let flagged: BTreeSet<u8> = w
                    .observe(over)
                    .iter()
                    .map(|o| o.key.alloc.as_str().parse().unwrap())
                    .collect();
                let expected: BTreeSet<u8> = ids.intersection(&before).copied().collect();
                prop_assert_eq!(flagged, expected);
                before = ids;
            }
        }

        /// A container held to its limit (anything at or under it, in any order) is never
        /// flagged, whatever the margin.
        #[test]
        fn at_or_under_the_limit_is_never_a_violation(
            limit in 1u32..100,
            utils in proptest::collection::vec(0u32..=100, 1..300),
            margin in 0u32..20,
        ) {
            let mut w = ComputeWatch::new(5_000, margin);
            for (i, u) in utils.into_iter().enumerate() {
                prop_assert_eq!(w.observe(key(), i as u64 * 167, u.min(limit), limit), None);
            }
        }
    }
}
