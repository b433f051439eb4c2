use super::*;
use proptest::prelude::*;

fn rounds() -> Rounds {
    Rounds::new(Cadence::default(), ComputeWatch::new(10_000, 10))
}

fn alloc(id: &str, percent: u32, created: u64, cores: &[&str]) -> Allocation {
    Allocation {
        slice: false,
        id: id.into(),
        cores: cores.iter().map(|c| c.to_string()).collect(),
        gpus: vec!["GPU-1".into()],
        percent,
        memory: vec![],
        quota: 4 << 30,
        core_limit: None,
        owner: None,
        created,
    }
}

fn over(id: &str) -> Over {
    Over {
        key: Key::new(id.into(), 0),
        used: 5 << 30,
        quota: 4 << 30,
    }
}

/// The answer to `step` of a daemon that finds nothing.
fn quiet(step: Step, now_ms: u64) -> Event {
    match step {
        Step::LookUpUids | Step::Publish | Step::Collect => Event::Done { now_ms },
        Step::Tend => Event::Tended { started: vec![] },
        Step::WatchMemory => Event::MemoryRead { over: vec![] },
        Step::Sample => Event::Sampled {
            now_ms,
            utilization: vec![],
        },
    }
}

/// What a daemon whose every step takes `step_ms` and finds nothing does, from `now_ms`:
/// the steps it is asked for until the loop sleeps, and the time it then wakes.
fn quiet_round(r: &mut Rounds, now_ms: &mut u64, step_ms: u64) -> Vec<Step> {
    let Action::Sleep { until_ms } = r.action() else {
        panic!("not asleep: {:?}", r.state())
    };
    *now_ms = (*now_ms).max(until_ms);
    let mut action = r.step(Event::Woke { now_ms: *now_ms });
    let mut steps = Vec::new();
    while let Action::Do { step, .. } = action {
        steps.push(step);
        *now_ms += step_ms;
        action = r.step(quiet(step, *now_ms));
    }
    assert!(matches!(action, Action::Sleep { .. }), "{action:?}");
    steps
}

/// Times (ms) at which rounds woke that collected garbage, over `total_ms`.
fn collections(step_ms: u64, total_ms: u64) -> Vec<u64> {
    let mut r = rounds();
    let mut now = 0;
    let mut at = Vec::new();
    loop {
        let woke = match r.action() {
            Action::Sleep { until_ms } => until_ms.max(now),
            a => panic!("{a:?}"),
        };
        if woke >= total_ms {
            return at;
        }
        if quiet_round(&mut r, &mut now, step_ms).contains(&Step::Collect) {
            at.push(woke);
        }
    }
}

#[test]
fn a_round_runs_every_step_in_order() {
    let mut r = rounds();
    let mut now = 0;
    assert_eq!(
        r.action(),
        Action::Sleep { until_ms: 167 },
        "a period after start"
    );
    assert_eq!(
        quiet_round(&mut r, &mut now, 1),
        [
            Step::LookUpUids,
            Step::Tend,
            Step::WatchMemory,
            Step::Sample,
            Step::Publish
        ]
    );
    assert_eq!(r.round(), 1);
}

#[test]
fn rounds_keep_their_cadence_and_a_slow_one_is_not_made_up_for() {
    let mut r = rounds();
    let mut now = 0;
    quiet_round(&mut r, &mut now, 5);
    assert_eq!(
        r.action(),
        Action::Sleep { until_ms: 334 },
        "not 167 after it ended"
    );
    quiet_round(&mut r, &mut now, 200); // a round of 800 ms, ending at 1134
    assert_eq!(
        r.action(),
        Action::Sleep { until_ms: 1134 },
        "at once, not a burst of three quick ones"
    );
    quiet_round(&mut r, &mut now, 1);
    assert_eq!(r.action(), Action::Sleep { until_ms: 1301 });
}

#[test]
fn a_round_does_not_start_before_it_is_due() {
    let mut r = rounds();
    assert_eq!(
        r.step(Event::Woke { now_ms: 100 }),
        Action::Sleep { until_ms: 167 }
    );
    assert_eq!(r.round(), 0);
}

#[test]
fn garbage_is_collected_every_ten_seconds_and_not_before() {
    let at = collections(1, 60_000);
    assert_eq!(at.len(), 5, "{at:?}");
    assert!(at[0] >= 10_000 && at[0] < 10_000 + 167, "{at:?}");
    for w in at.windows(2) {
        assert!(
            w[1] - w[0] >= 10_000 && w[1] - w[0] < 10_000 + 167,
            "{at:?}"
        );
    }
}

#[test]
fn pod_uids_are_looked_up_at_most_once_a_second_and_only_when_wanted() {
    let mut r = rounds();
    let mut now = 0;
    let mut lookups = Vec::new();
    for _ in 0..30 {
        let Action::Sleep { until_ms } = r.action() else {
            panic!()
        };
        if quiet_round(&mut r, &mut now, 1).contains(&Step::LookUpUids) {
            lookups.push(until_ms);
        }
    }
    assert_eq!(lookups[0], 167, "in the first round");
    assert!(
        lookups.windows(2).all(|w| w[1] - w[0] >= 1_000),
        "{lookups:?}"
    );
    assert_eq!(lookups.len(), 5, "{lookups:?}");

    // None wanted: the next round asks again.
    let mut r = rounds();
    r.step(Event::Woke { now_ms: 167 });
    let a = r.step(Event::NothingWanted);
    assert_eq!(
        a,
        Action::Do {
            round: 1,
            step: Step::Tend
        }
    );
    let mut now = 167;
    finish_round(&mut r, &mut now, a);
    assert_eq!(
        r.step(Event::Woke { now_ms: 334 }),
        Action::Do {
            round: 2,
            step: Step::LookUpUids
        }
    );
}

/// Drive round `r` (asleep) to its memory watchdog and report `over`; returns the action.
fn to_memory(r: &mut Rounds, now_ms: &mut u64, started: &[&str], over: Vec<Over>) -> Action {
    let Action::Sleep { until_ms } = r.action() else {
        panic!("{:?}", r.state())
    };
    *now_ms = (*now_ms).max(until_ms);
    let mut a = r.step(Event::Woke { now_ms: *now_ms });
    if a == (Action::Do {
        round: r.round(),
        step: Step::LookUpUids,
    }) {
        a = r.step(Event::NothingWanted);
    }
    assert_eq!(
        a,
        Action::Do {
            round: r.round(),
            step: Step::Tend
        }
    );
    let started = started.iter().map(|&s| AllocationId::from(s)).collect();
    r.step(Event::Tended { started });
    r.step(Event::MemoryRead { over })
}

fn finish_round(r: &mut Rounds, now_ms: &mut u64, mut a: Action) {
    loop {
        a = match a {
            Action::Sleep { .. } => return,
            Action::Do { step, .. } => r.step(quiet(step, *now_ms)),
            Action::Enforce { .. } => r.step(Event::Done { now_ms: *now_ms }),
        }
    }
}

#[test]
fn memory_over_the_quota_is_acted_on_only_the_second_round_in_a_row() {
    let mut r = rounds();
    let mut now = 0;
    let a = to_memory(&mut r, &mut now, &["a1"], vec![over("a1")]);
    assert_eq!(
        a,
        Action::Do {
            round: 1,
            step: Step::Sample
        },
        "once: no verdict"
    );
    finish_round(&mut r, &mut now, a);
    let a = to_memory(&mut r, &mut now, &["a1"], vec![over("a1")]);
    assert_eq!(
        a,
        Action::Enforce {
            round: 2,
            verdicts: vec![Verdict::Memory(over("a1"))]
        }
    );
    assert_eq!(
        r.step(Event::Done { now_ms: now }),
        Action::Do {
            round: 2,
            step: Step::Sample
        },
        "acted on: the round goes on"
    );
    let a = r.action();
    finish_round(&mut r, &mut now, a);
    assert_eq!(
        r.memory_violations().get(&Key::new("a1".into(), 0)),
        Some(&1)
    );
    let a = to_memory(&mut r, &mut now, &["a1"], vec![]);
    finish_round(&mut r, &mut now, a);
    let a = to_memory(&mut r, &mut now, &["a1"], vec![over("a1")]);
    assert!(
        matches!(a, Action::Do { .. }),
        "freed in between: starts afresh"
    );
    finish_round(&mut r, &mut now, a);
    let a = to_memory(&mut r, &mut now, &[], vec![]);
    finish_round(&mut r, &mut now, a);
    assert!(
        r.memory_violations().is_empty(),
        "a gone allocation's count is forgotten"
    );
}

#[test]
fn compute_over_the_limit_is_acted_on_once_a_window() {
    let mut r = rounds();
    let mut now = 0;
    let key = Key::new("a1".into(), 0);
    let mut verdicts = Vec::new();
    for _ in 0..130 {
        let a = to_memory(&mut r, &mut now, &["a1"], vec![]);
        assert_eq!(
            a,
            Action::Do {
                round: r.round(),
                step: Step::Sample
            }
        );
        let a = r.step(Event::Sampled {
            now_ms: now,
            utilization: vec![Utilization {
                key: key.clone(),
                percent: 100,
                limit_percent: 30,
            }],
        });
        if let Action::Enforce { verdicts: v, .. } = &a {
            verdicts.push((now, v.clone()));
        }
        finish_round(&mut r, &mut now, a);
    }
    assert_eq!(verdicts.len(), 2, "{verdicts:?}");
    assert!(
        verdicts[0].0 >= 9_000 && verdicts[0].0 <= 10_400,
        "{verdicts:?}"
    );
    assert_eq!(
        verdicts[0].1,
        vec![Verdict::Compute {
            key: key.clone(),
            mean_percent: 100,
            limit_percent: 30
        }]
    );
    assert_eq!(r.compute_violations().get(&key), Some(&2));
}

#[test]
fn an_answer_out_of_turn_changes_nothing() {
    let mut r = rounds();
    r.step(Event::Woke { now_ms: 167 });
    let asked = r.action();
    for e in [
        Event::Tended { started: vec![] },
        Event::MemoryRead {
            over: vec![over("a1")],
        },
        Event::Woke { now_ms: 500 },
    ] {
        assert_eq!(r.step(e), asked);
    }
    assert_eq!(r.round(), 1);
}

#[test]
fn shares_written_into_regions_follow_the_allocation() {
    let mut a = alloc("a1", 30, 0, &[]);
    assert_eq!(region_rates(&a), (300_000, 0), "hard share");
    a.core_limit = Some(60);
    assert_eq!(
        region_rates(&a),
        (300_000, 600_000),
        "elastic up to the limit"
    );
    a.core_limit = Some(20);
    assert_eq!(
        region_rates(&a),
        (300_000, 0),
        "a limit under the share is none"
    );
    a.percent = 100;
    assert_eq!(region_rates(&a), (1_000_000, 0), "a whole GPU");
}

#[test]
fn an_allocation_is_collected_once_its_container_is_gone_after_two_minutes() {
    let allocs = [
        alloc("held", 30, 0, &["c2"]),
        alloc("gone", 30, 0, &["c3"]),
        alloc("new-and-gone", 30, 1_000, &["c4"]),
        alloc("new-and-held", 30, 1_000, &["c5", "c2"]),
    ];
    let held = |c: &str| c == "c2";
    assert_eq!(
        collectable(&allocs, &held, 1_100),
        vec![AllocationId::from("gone")]
    );
    assert_eq!(
        collectable(&allocs, &held, 1_121),
        vec![
            AllocationId::from("gone"),
            AllocationId::from("new-and-gone")
        ]
    );
}

#[test]
fn an_unusable_region_is_reported_once_until_it_reads_again() {
    let mut f = Faults::default();
    let a1 = AllocationId::from("a1");
    assert!(f.failed(&a1), "reported");
    assert!(!f.failed(&a1), "not again next round");
    assert!(f.read(&a1), "readable again: reported");
    assert!(!f.read(&a1));
    assert!(f.failed(&a1), "a new episode");
    f.retain(|id| id != &a1);
    assert!(f.failed(&a1), "forgotten when the allocation went");
}

proptest! {
    /// Whatever the rounds cost, rounds start no sooner than a period apart, and garbage
    /// is collected no sooner than 10 s apart and at the latest in the first round due
    /// after that.
    #[test]
    fn cadence_holds_whatever_the_rounds_cost(costs in proptest::collection::vec(0u64..400, 1..400)) {
        let mut r = rounds();
        let mut now = 0;
        let (mut last_round, mut last_gc) = (0u64, 0u64);
        for (i, cost) in costs.into_iter().enumerate() {
            let Action::Sleep { until_ms } = r.action() else { panic!() };
            let woke = until_ms.max(now);
            prop_assert!(i == 0 || woke >= last_round + 167);
            last_round = woke;
            let steps = quiet_round(&mut r, &mut now, cost / 5);
            let round_end = now;
            if steps.contains(&Step::Collect) {
                prop_assert!(round_end - (cost / 5) - last_gc >= 10_000);
                last_gc = round_end - cost / 5;
            } else {
                prop_assert!(round_end < last_gc + 10_000);
            }
        }
    }
}
