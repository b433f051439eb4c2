//! Reading NVML's per-process samples: which periods they cover, and the periods NVML left
//! out. Pure: libvcuda asks NVML (`nvmlDeviceGetProcessUtilization` since
//! [`Sampler::since_us`], and `nvmlDeviceGetSamples` while [`Sampler::wants_period`]) and
//! hands the answers here; the periods come back through a callback to the [`Calibrator`]
//! (crate::Calibrator).

/// NVML's usual sample period, µs, until one is learned.
pub const DEFAULT_PERIOD_US: u64 = 166_667;
/// Gaps shorter than this between samples are not a period (two samples of one moment).
pub const MIN_PERIOD_US: u64 = 1_000;
/// Empty periods filled in between two samples, at most (NVML keeps a few seconds).
pub const MAX_FILLED: u64 = 64;
/// How far back to ask for the device's own samples when learning the period, µs.
pub const PERIOD_LOOKBACK_US: u64 = 5_000_000;

/// One sampled period of this process: it ended at `end_us` (NVML's timestamp), lasted
/// `len_us`, and the process kept the device busy `util_pct` percent of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub end_us: u64,
    pub len_us: u64,
    pub util_pct: u32,
}

/// The newest sampled moment: the device fraction other processes and this one used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Newest {
    pub others: f64,
    pub own: f64,
}

/// What has been read of one GPU's per-process samples.
#[derive(Debug, Clone, Default)]
pub struct Sampler {
    /// Newest sample timestamp seen, µs (0: none yet).
    last_seen_us: u64,
    /// Sample period, µs (0: not known yet).
    period_us: u64,
    /// `period_us` came from the device's own consecutive samples (exact), not from gaps
    /// between this process's samples (a multiple of the period when it idled between).
    period_exact: bool,
    /// Whether a sample with this process's pid was ever seen. Until then, samples without
    /// it prove nothing (the pid may be from another namespace), so none are used.
    pid_seen: bool,
}

impl Sampler {
    /// The timestamp to ask NVML for samples newer than.
    pub fn since_us(&self) -> u64 {
        self.last_seen_us
    }

    /// When the period is not known exactly and samples were seen: the timestamp to ask the
    /// device's own samples (`nvmlDeviceGetSamples`) from, to learn it.
    pub fn wants_period(&self) -> Option<u64> {
        (!self.period_exact && self.last_seen_us != 0)
            .then(|| self.last_seen_us.saturating_sub(PERIOD_LOOKBACK_US))
    }

    /// The device's own sample timestamps (any order): three or more give the period
    /// exactly, as the smallest gap between consecutive ones.
    pub fn device_samples(&mut self, timestamps: &mut [u64]) {
        timestamps.sort_unstable();
        let min = timestamps
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .filter(|&d| d >= MIN_PERIOD_US)
            .min();
        if let Some(p) = min.filter(|_| timestamps.len() >= 3) {
            self.period_us = p;
            self.period_exact = true;
        }
    }

    /// The period in use, µs.
    pub fn period_us(&self) -> u64 {
        if self.period_us == 0 {
            DEFAULT_PERIOD_US
        } else {
            self.period_us
        }
    }

    /// The process's samples newer than [`since_us`](Self::since_us) as (timestamp µs, pid,
    /// SM util %), sorted by timestamp, `pid` this process's: passes each period they show
    /// to `period` (oldest first; periods NVML kept no sample of, between two samples, as
    /// idle ones), and returns the newest moment's utilizations.
    ///
    /// NVML keeps no sample of a period in which no process ran. Between two samples such
    /// periods certainly had none of this process's work: they are evidence too (work paid
    /// in one of them and run in the next would otherwise look free).
    pub fn read(
        &mut self,
        samples: impl IntoIterator<Item = (u64, u32, u32)>,
        pid: u32,
        mut period: impl FnMut(Period),
    ) -> Option<Newest> {
        let mut prev = self.last_seen_us;
        let mut newest = None;
        let mut it = samples.into_iter().peekable();
        while let Some((ts, p, util)) = it.next() {
            let (mut own, mut others) = (0u32, 0u32);
            let mut add = |p: u32, util: u32| {
                if p == pid {
                    self.pid_seen = true;
                    own = own.saturating_add(util);
                } else {
                    others = others.saturating_add(util);
                }
            };
            add(p, util);
            while let Some(&(t, p, util)) = it.peek() {
                if t != ts {
                    break;
                }
                add(p, util);
                it.next();
            }
            if prev != 0 && ts > prev {
                let d = ts - prev;
                if !self.period_exact
                    && d >= MIN_PERIOD_US
                    && (self.period_us == 0 || d < self.period_us)
                {
                    self.period_us = d;
                }
                let p = self.period_us;
                if self.pid_seen && p != 0 && d > p + p / 2 {
                    let missing = (d + p / 2) / p - 1;
                    for j in 1..=missing.min(MAX_FILLED) {
                        period(Period {
                            end_us: prev + j * p,
                            len_us: p,
                            util_pct: 0,
                        });
                    }
                }
            }
            prev = prev.max(ts);
            if self.pid_seen {
                period(Period {
                    end_us: ts,
                    len_us: self.period_us(),
                    util_pct: own,
                });
                newest = Some(Newest {
                    others: f64::from(others) / 100.0,
                    own: f64::from(own) / 100.0,
                });
            }
        }
        self.last_seen_us = prev;
        newest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PID: u32 = 42;

    fn read(s: &mut Sampler, samples: &[(u64, u32, u32)]) -> (Vec<Period>, Option<Newest>) {
        let mut out = Vec::new();
        let newest = s.read(samples.iter().copied(), PID, |p| out.push(p));
        (out, newest)
    }

    fn p(end_us: u64, len_us: u64, util_pct: u32) -> Period {
        Period {
            end_us,
            len_us,
            util_pct,
        }
    }

    #[test]
    fn samples_of_a_moment_add_up_and_the_newest_splits_own_from_others() {
        let mut s = Sampler::default();
        let (periods, newest) = read(
            &mut s,
            &[(1_000_000, PID, 20), (1_000_000, 7, 30), (1_000_000, 8, 10)],
        );
        assert_eq!(periods, [p(1_000_000, DEFAULT_PERIOD_US, 20)]);
        assert_eq!(
            newest,
            Some(Newest {
                others: 0.4,
                own: 0.2
            })
        );
        assert_eq!(s.since_us(), 1_000_000, "the next read asks for newer ones");
    }

    #[test]
    fn nothing_counts_until_the_process_is_seen() {
        // Another namespace's pid: samples without ours prove nothing (we may be in none).
        let mut s = Sampler::default();
        let (periods, newest) = read(&mut s, &[(1_000_000, 7, 50), (1_166_667, 7, 50)]);
        assert!(periods.is_empty());
        assert_eq!(newest, None);
        assert_eq!(s.since_us(), 1_166_667, "but they are not read again");
        let (periods, _) = read(&mut s, &[(1_333_334, PID, 10)]);
        assert_eq!(periods, [p(1_333_334, 166_667, 10)]);
    }

    #[test]
    fn the_period_is_the_smallest_gap_until_the_device_says_it_exactly() {
        let mut s = Sampler::default();
        read(&mut s, &[(1_000_000, PID, 10), (1_500_000, PID, 10)]);
        assert_eq!(
            s.period_us(),
            500_000,
            "a process that idled sees multiples"
        );
        read(&mut s, &[(1_666_667, PID, 10)]);
        assert_eq!(s.period_us(), 166_667);
        assert_eq!(
            s.wants_period(),
            Some(0),
            "not exact: ask the device (5 s back)"
        );
        // The device's own samples, unordered; a gap below 1 ms is two of one moment.
        s.device_samples(&mut [3_000_000, 2_000_000, 1_000_000, 999_500]);
        assert_eq!(s.period_us(), 1_000_000);
        let mut s = Sampler::default();
        read(&mut s, &[(6_000_000, PID, 10)]);
        assert_eq!(s.wants_period(), Some(1_000_000));
        s.device_samples(&mut [3_000_000, 2_000_000, 1_000_000]);
        assert_eq!(s.period_us(), 1_000_000);
        assert_eq!(s.wants_period(), None, "exact: no more asking");
        // Exact stays: a longer gap between the process's samples does not change it.
        read(&mut s, &[(9_000_000, PID, 10)]);
        assert_eq!(s.period_us(), 1_000_000);
        // Two device samples prove nothing.
        let mut s = Sampler::default();
        s.device_samples(&mut [1_000_000, 2_000_000]);
        assert_eq!(s.period_us(), DEFAULT_PERIOD_US);
    }

    #[test]
    fn periods_nvml_kept_no_sample_of_are_idle_evidence() {
        let mut s = Sampler::default();
        s.device_samples(&mut [0, 100_000, 200_000]);
        read(&mut s, &[(1_000_000, PID, 50)]);
        // Next sample 4 periods later: the three between had no work of any process.
        let (periods, _) = read(&mut s, &[(1_400_000, PID, 20)]);
        assert_eq!(
            periods,
            [
                p(1_100_000, 100_000, 0),
                p(1_200_000, 100_000, 0),
                p(1_300_000, 100_000, 0),
                p(1_400_000, 100_000, 20)
            ]
        );
        // A gap within half a period of one is a late sample, not a missing one.
        let (periods, _) = read(&mut s, &[(1_549_000, PID, 20)]);
        assert_eq!(periods, [p(1_549_000, 100_000, 20)]);
        // At most MAX_FILLED are filled (NVML's buffer is a few seconds; a longer gap is a
        // process that was away).
        let (periods, _) = read(&mut s, &[(1_549_000 + 1_000 * 100_000, PID, 20)]);
        assert_eq!(periods.len() as u64, MAX_FILLED + 1);
    }

    #[test]
    fn an_old_sample_moves_nothing_back() {
        let mut s = Sampler::default();
        read(&mut s, &[(2_000_000, PID, 10)]);
        let (periods, _) = read(&mut s, &[(1_000_000, PID, 10)]);
        assert_eq!(periods.len(), 1, "read, but no gap is filled backwards");
        assert_eq!(s.since_us(), 2_000_000);
    }

    proptest! {
        /// Whatever NVML returns, periods come out in time order, never before what was
        /// already read, and at most MAX_FILLED + 1 per sample.
        #[test]
        fn periods_are_ordered_and_bounded(mut ts in proptest::collection::vec(1u64..100_000_000, 1..40),
                                           utils in proptest::collection::vec(0u32..=100, 40),
                                           ours in proptest::collection::vec(any::<bool>(), 40)) {
            ts.sort_unstable();
            let samples: Vec<_> = ts.iter().zip(&utils).zip(&ours)
                .map(|((&t, &u), &o)| (t, if o { PID } else { 7 }, u)).collect();
            let mut s = Sampler::default();
            let (periods, _) = read(&mut s, &samples);
            prop_assert!(periods.windows(2).all(|w| w[0].end_us <= w[1].end_us));
            prop_assert!(periods.len() as u64 <= samples.len() as u64 * (MAX_FILLED + 1));
            prop_assert_eq!(s.since_us(), *ts.last().unwrap());
            prop_assert!(periods.iter().all(|p| p.len_us >= MIN_PERIOD_US || p.len_us == DEFAULT_PERIOD_US));
        }
    }
}
