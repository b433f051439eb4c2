//! The control loop's rounds as a state machine (pure: the daemon reads the clock and the
//! driver, and passes what it read in; times are milliseconds on the daemon's monotonic
//! clock since the loop started).
//!
//! Once a period (~1/6 s, NVML's sampling period) a round runs these steps in order:
//! [`Step::LookUpUids`] (at most once a second, and only if the daemon has containers
//! whose pod UID it does not know), [`Step::Tend`], [`Step::WatchMemory`],
//! [`Step::Sample`], [`Step::Publish`], and every 10 s [`Step::Collect`]. The daemon
//! carries out each [`Action`] [`Rounds::step`] returns and answers with the [`Event`] that
//! says what it found; the watchdogs' verdicts come back as [`Action::Enforce`]. A slow
//! round is not made up for by a burst of quick ones: the next is due a period after the
//! last one was due, or at once if that has passed.

use std::collections::{BTreeMap, BTreeSet};

use crate::allocation::Allocation;
use crate::ids::AllocationId;
use crate::watchdog::{ComputeWatch, Key, MemoryWatch, Over};

/// An allocation is not collected before its container had time to start (seconds).
pub const GC_GRACE_SECS: u64 = 120;

/// How often the loop does what (ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cadence {
    /// One round per period.
    pub period_ms: u64,
    /// Allocations whose container left PodResources are looked for this often.
    pub gc_ms: u64,
    /// Pod UIDs still unknown are looked up in the kubelet's checkpoint at most this often.
    pub uid_lookup_ms: u64,
}

impl Default for Cadence {
    fn default() -> Self {
        Cadence {
            period_ms: 167,
            gc_ms: 10_000,
            uid_lookup_ms: 1_000,
        }
    }
}

/// One step of a round, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Read the kubelet's checkpoint for the pod UIDs of containers none of whose processes
    /// registered (how a bypassing process is found by its cgroup), if any is wanted.
    /// Answer [`Event::Done`], or [`Event::NothingWanted`] when no UID was wanted.
    LookUpUids,
    /// Every started allocation's region: reclaim, write its share, read it; then who is
    /// whose (registrations). Answer [`Event::Tended`].
    Tend,
    /// The driver-reported memory of each container's processes against its quota.
    /// Answer [`Event::MemoryRead`].
    WatchMemory,
    /// NVML's utilization samples per process. Answer [`Event::Sampled`].
    Sample,
    /// The view the query API and `/metrics` show. Answer [`Event::Done`].
    Publish,
    /// Remove allocations whose container left PodResources; compact the checkpoint.
    /// Answer [`Event::Done`].
    Collect,
}

/// Where the loop is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Between rounds: the next is due at `due_ms`.
    Asleep { due_ms: u64 },
    /// Round `n`, carrying out `step`.
    Round { n: u64, step: Step },
    /// Round `n`, acting on the watchdog's `verdicts`; `then` comes next.
    Enforcing {
        n: u64,
        verdicts: Vec<Verdict>,
        then: Step,
    },
}

/// What the daemon tells the loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// It woke (from [`Action::Sleep`]) at `now_ms`.
    Woke { now_ms: u64 },
    /// The step or enforcement asked for is done, at `now_ms`.
    Done { now_ms: u64 },
    /// [`Step::LookUpUids`]: no pod UID was wanted; nothing was read.
    NothingWanted,
    /// [`Step::Tend`] is done: these allocations are started (the watchdogs forget the
    /// others).
    Tended { started: Vec<AllocationId> },
    /// [`Step::WatchMemory`] is done: the container GPUs over their quota this round
    /// ([`crate::watchdog::violations`]).
    MemoryRead { over: Vec<Over> },
    /// [`Step::Sample`] is done at `now_ms`: the driver-reported utilization of every
    /// container GPU the compute watchdog watches.
    Sampled {
        now_ms: u64,
        utilization: Vec<Utilization>,
    },
}

/// One container GPU's driver-reported utilization this round, summed over its processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Utilization {
    pub key: Key,
    pub percent: u32,
    /// What it may use ([`crate::watchdog::compute_limit`]).
    pub limit_percent: u32,
}

/// A watchdog's verdict: the driver reports more than the container may have (a process
/// bypasses the library?).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Over its memory quota two rounds in a row.
    Memory(Over),
    /// Over its compute limit by more than the margin, on average over a whole window.
    Compute {
        key: Key,
        mean_percent: u32,
        limit_percent: u32,
    },
}

/// What the daemon is to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Sleep until `until_ms`, then answer [`Event::Woke`].
    Sleep { until_ms: u64 },
    /// Carry out `step` of round `round`.
    Do { round: u64, step: Step },
    /// Act on the watchdog's verdicts (log; kill if configured), then answer
    /// [`Event::Done`].
    Enforce { round: u64, verdicts: Vec<Verdict> },
}

/// The loop's state machine: the cadence, the watchdogs' rules, and their verdicts counted
/// per container GPU since start (the metrics).
#[derive(Debug)]
pub struct Rounds {
    cadence: Cadence,
    state: State,
    round: u64,
    /// When the current round was due, and when it woke.
    due_ms: u64,
    woke_ms: u64,
    last_uid_lookup_ms: Option<u64>,
    last_gc_ms: u64,
    memory: MemoryWatch,
    compute: ComputeWatch,
    memory_violations: BTreeMap<Key, u64>,
    compute_violations: BTreeMap<Key, u64>,
}

impl Rounds {
    /// A loop that starts at 0 ms: the first round is due a period later, pod UIDs are
    /// looked up in it, and the first collection is a whole `gc_ms` later.
    pub fn new(cadence: Cadence, compute: ComputeWatch) -> Self {
        Rounds {
            cadence,
            state: State::Asleep {
                due_ms: cadence.period_ms,
            },
            round: 0,
            due_ms: cadence.period_ms,
            woke_ms: 0,
            last_uid_lookup_ms: None,
            last_gc_ms: 0,
            memory: MemoryWatch::default(),
            compute,
            memory_violations: BTreeMap::new(),
            compute_violations: BTreeMap::new(),
        }
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    /// The current (or last) round's number, from 1.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// Memory verdicts per container GPU since start (started allocations only).
    pub fn memory_violations(&self) -> &BTreeMap<Key, u64> {
        &self.memory_violations
    }

    /// Compute verdicts per container GPU since start (started allocations only).
    pub fn compute_violations(&self) -> &BTreeMap<Key, u64> {
        &self.compute_violations
    }

    /// What the daemon is to do now.
    pub fn action(&self) -> Action {
        match &self.state {
            State::Asleep { due_ms } => Action::Sleep { until_ms: *due_ms },
            State::Round { n, step } => Action::Do {
                round: *n,
                step: *step,
            },
            State::Enforcing { n, verdicts, .. } => Action::Enforce {
                round: *n,
                verdicts: verdicts.clone(),
            },
        }
    }

    /// Take in what the daemon tells and say what it is to do next. An event that does not
    /// answer the current action (a round woken before it is due, a step answered out of
    /// turn) changes nothing: the same action is asked again.
    pub fn step(&mut self, event: Event) -> Action {
        let step = match &self.state {
            State::Round { step, .. } => Some(*step),
            _ => None,
        };
        match (&self.state, step, event) {
            (State::Asleep { due_ms }, _, Event::Woke { now_ms }) if now_ms >= *due_ms => {
                self.round += 1;
                self.woke_ms = now_ms;
                let uids_due = self
                    .last_uid_lookup_ms
                    .is_none_or(|t| now_ms.saturating_sub(t) >= self.cadence.uid_lookup_ms);
                self.go(if uids_due {
                    Step::LookUpUids
                } else {
                    Step::Tend
                });
            }
            (_, Some(Step::LookUpUids), Event::Done { .. }) => {
                self.last_uid_lookup_ms = Some(self.woke_ms);
                self.go(Step::Tend);
            }
            (_, Some(Step::LookUpUids), Event::NothingWanted) => self.go(Step::Tend),
            (_, Some(Step::Tend), Event::Tended { started }) => {
                self.forget_all_but(&started.into_iter().collect());
                self.go(Step::WatchMemory);
            }
            (_, Some(Step::WatchMemory), Event::MemoryRead { over }) => {
                let verdicts = self.memory_verdicts(over);
                self.enforce(verdicts, Step::Sample);
            }
            (
                _,
                Some(Step::Sample),
                Event::Sampled {
                    now_ms,
                    utilization,
                },
            ) => {
                let verdicts = self.compute_verdicts(now_ms, utilization);
                self.enforce(verdicts, Step::Publish);
            }
            (_, Some(Step::Publish), Event::Done { now_ms }) => {
                if now_ms.saturating_sub(self.last_gc_ms) >= self.cadence.gc_ms {
                    self.last_gc_ms = now_ms;
                    self.go(Step::Collect);
                } else {
                    self.sleep(now_ms);
                }
            }
            (_, Some(Step::Collect), Event::Done { now_ms }) => self.sleep(now_ms),
            (State::Enforcing { then, .. }, _, Event::Done { .. }) => self.go(*then),
            _ => {}
        }
        self.action()
    }

    fn go(&mut self, step: Step) {
        self.state = State::Round {
            n: self.round,
            step,
        };
    }

    /// Act on `verdicts` before `then`; with none, go on to `then`.
    fn enforce(&mut self, verdicts: Vec<Verdict>, then: Step) {
        self.state = if verdicts.is_empty() {
            State::Round {
                n: self.round,
                step: then,
            }
        } else {
            State::Enforcing {
                n: self.round,
                verdicts,
                then,
            }
        };
    }

    /// The round ended at `now_ms`: the next is due a period after this one was, or at once
    /// if that has passed.
    fn sleep(&mut self, now_ms: u64) {
        self.due_ms = (self.due_ms + self.cadence.period_ms).max(now_ms);
        self.state = State::Asleep {
            due_ms: self.due_ms,
        };
    }

    fn forget_all_but(&mut self, started: &BTreeSet<AllocationId>) {
        self.memory_violations
            .retain(|k, _| started.contains(&k.alloc));
        self.compute_violations
            .retain(|k, _| started.contains(&k.alloc));
        self.compute.retain(|k| started.contains(&k.alloc));
    }

    fn memory_verdicts(&mut self, over: Vec<Over>) -> Vec<Verdict> {
        let confirmed = self.memory.observe(over);
        for o in &confirmed {
            *self.memory_violations.entry(o.key.clone()).or_default() += 1;
        }
        confirmed.into_iter().map(Verdict::Memory).collect()
    }

    fn compute_verdicts(&mut self, now_ms: u64, utilization: Vec<Utilization>) -> Vec<Verdict> {
        let mut verdicts = Vec::new();
        for u in utilization {
            let Some(mean) =
                self.compute
                    .observe(u.key.clone(), now_ms, u.percent, u.limit_percent)
            else {
                continue;
            };
            *self.compute_violations.entry(u.key.clone()).or_default() += 1;
            verdicts.push(Verdict::Compute {
                key: u.key,
                mean_percent: mean,
                limit_percent: u.limit_percent,
            });
        }
        verdicts
    }
}

/// The share and limit (ppm) [`Step::Tend`] writes into allocation `a`'s region for each of
/// its GPUs: a whole GPU is unthrottled; a limit only above the share (0: none, hard share).
pub fn region_rates(a: &Allocation) -> (u64, u64) {
    let share = if a.percent >= 100 {
        1_000_000
    } else {
        u64::from(a.percent) * 10_000
    };
    let limit = a
        .core_limit
        .filter(|&l| l > a.percent)
        .map_or(0, |l| u64::from(l) * 10_000);
    (share, limit)
}

/// Which allocations [`Step::Collect`] removes at `now_unix_s`: those older than
/// [`GC_GRACE_SECS`] none of whose `vcuda-core` device IDs a container holds (`held`, per
/// PodResources).
pub fn collectable<'a>(
    allocations: impl IntoIterator<Item = &'a Allocation>,
    held: &dyn Fn(&str) -> bool,
    now_unix_s: u64,
) -> Vec<AllocationId> {
    allocations
        .into_iter()
        .filter(|a| {
            now_unix_s.saturating_sub(a.created) > GC_GRACE_SECS && !a.cores.iter().any(|c| held(c))
        })
        .map(|a| a.id.clone())
        .collect()
}

/// The allocations whose region could not be used, so that each episode is logged once:
/// when it begins and when it ends.
#[derive(Debug, Default)]
pub struct Faults(BTreeSet<AllocationId>);

impl Faults {
    /// Allocation `id`'s region failed; whether this begins an episode (log it).
    pub fn failed(&mut self, id: &AllocationId) -> bool {
        self.0.insert(id.clone())
    }

    /// Allocation `id`'s region read; whether this ends an episode (log it).
    pub fn read(&mut self, id: &AllocationId) -> bool {
        self.0.remove(id)
    }

    /// Forget allocations that are gone.
    pub fn retain(&mut self, keep: impl Fn(&AllocationId) -> bool) {
        self.0.retain(|id| keep(id));
    }
}

#[cfg(test)]
mod tests;
