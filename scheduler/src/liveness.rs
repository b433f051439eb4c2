//! Node liveness (pure): which nodes are **lost** — dead, or cut off from the API server —
//! judged from their vcuda-manager's Lease, as Kubernetes' node lifecycle controller judges
//! the kubelet's: by this scheduler's own monotonic clock, never by the timestamps in the
//! Lease (so clock skew between machines cannot make a node look alive or dead).
//!
//! The I/O ([`crate::leases`]) lists the manager Leases every `--lease-poll` and hands each
//! one's change token (resourceVersion, renewTime, holder) to [`Tracker::observe`]. The
//! tracker records, per Lease, when (the scheduler's clock, ms) it last saw the token change;
//! a Lease seen for the first time counts as changed then (a full duration of grace). A node
//! whose inventory names a Lease ([`vcuda_cluster::LeaseRef`]) is lost when the last
//! successful poll came more than the Lease's `durationSeconds` after the last change: a
//! scheduler that cannot list Leases learns nothing and judges no node lost for it. A node
//! whose inventory names no Lease (an older manager) is not checked.
//!
//! Invariants (unit- and property-tested): a node is never lost before its duration has
//! elapsed since the last change observed; it is always lost once duration + one poll
//! interval has passed without a change while polls succeed; an observed change revives it
//! at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Deserialize;
use vcuda_cluster::{LeaseRef, INVENTORY_ANNOTATION};

/// The label selector the manager's Leases carry (vcuda-manager's `lease` module sets it).
pub const LEASE_SELECTOR: &str = "app.kubernetes.io/name=vcuda-manager";

/// A Lease by namespace and name.
type Key = (String, String);

fn key(lease: &LeaseRef) -> Key {
    (lease.namespace.clone(), lease.name.clone())
}

/// What the tracker knows of one Lease.
#[derive(Debug, Clone)]
struct Seen {
    /// The last change token listed (`None`: asked about, never listed).
    token: Option<String>,
    /// When the token last changed, or the Lease was first seen (ms, the scheduler's clock).
    changed_ms: u64,
}

/// Whether a node may be given pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Its inventory names no Lease (an older vcuda-manager): not checked.
    Unchecked,
    /// Its Lease changed within its duration (or is still in its first grace).
    Alive,
    /// Its Lease has not changed for `unchanged_ms` (> its duration).
    Lost {
        /// The Lease.
        lease: LeaseRef,
        /// How long since this scheduler saw it change, ms.
        unchanged_ms: u64,
    },
}

/// A node's liveness changed since the last [`Tracker::sweep`] (what the I/O logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The node became lost.
    Lost {
        node: String,
        lease: LeaseRef,
        unchanged_ms: u64,
    },
    /// A lost node's Lease changed again (or its inventory no longer names one).
    Back { node: String },
    /// A node whose inventory names no Lease, reported once.
    Unchecked { node: String },
}

/// Per Lease, when it last changed; per node, what was last reported.
#[derive(Debug, Clone, Default)]
pub struct Tracker {
    leases: HashMap<Key, Seen>,
    /// The last successful poll (ms).
    polled_ms: Option<u64>,
    /// Nodes reported lost (and not back since).
    lost: BTreeSet<String>,
    /// Nodes reported as unchecked.
    unchecked: BTreeSet<String>,
}

impl Tracker {
    /// Nothing seen yet.
    pub fn new() -> Tracker {
        Tracker::default()
    }

    /// A successful list at `now_ms`: each Lease's namespace, name and change token.
    /// Leases not listed keep their last change (a deleted Lease is a dead manager's).
    pub fn observe<I>(&mut self, now_ms: u64, leases: I)
    where
        I: IntoIterator<Item = (String, String, String)>,
    {
        for (namespace, name, token) in leases {
            match self.leases.get_mut(&(namespace.clone(), name.clone())) {
                Some(seen) if seen.token.as_deref() == Some(token.as_str()) => {}
                Some(seen) => {
                    seen.token = Some(token);
                    seen.changed_ms = now_ms;
                }
                None => {
                    self.leases.insert(
                        (namespace, name),
                        Seen {
                            token: Some(token),
                            changed_ms: now_ms,
                        },
                    );
                }
            }
        }
        self.polled_ms = Some(self.polled_ms.map_or(now_ms, |p| p.max(now_ms)));
    }

    /// The verdict on a node whose inventory names `lease`, at `now_ms`. A Lease never seen
    /// before starts its grace now.
    pub fn verdict(&mut self, lease: Option<&LeaseRef>, now_ms: u64) -> Verdict {
        let Some(lease) = lease else {
            return Verdict::Unchecked;
        };
        let seen = self.leases.entry(key(lease)).or_insert(Seen {
            token: None,
            changed_ms: now_ms,
        });
        let duration_ms = u64::from(lease.duration_seconds.max(1)) * 1000;
        match self.polled_ms {
            Some(p) if p > seen.changed_ms.saturating_add(duration_ms) => Verdict::Lost {
                lease: lease.clone(),
                unchanged_ms: now_ms.saturating_sub(seen.changed_ms),
            },
            _ => Verdict::Alive,
        }
    }

    /// The verdicts on every node listed (name, the Lease its inventory names), compared with
    /// the last sweep's: what changed. Nodes not listed are forgotten.
    pub fn sweep(&mut self, now_ms: u64, nodes: &[(String, Option<LeaseRef>)]) -> Vec<Change> {
        let mut out = Vec::new();
        let listed: BTreeSet<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
        self.lost.retain(|n| listed.contains(n.as_str()));
        self.unchecked.retain(|n| listed.contains(n.as_str()));
        for (node, lease) in nodes {
            match self.verdict(lease.as_ref(), now_ms) {
                Verdict::Lost {
                    lease,
                    unchanged_ms,
                } => {
                    if self.lost.insert(node.clone()) {
                        out.push(Change::Lost {
                            node: node.clone(),
                            lease,
                            unchanged_ms,
                        });
                    }
                }
                v => {
                    if self.lost.remove(node) {
                        out.push(Change::Back { node: node.clone() });
                    }
                    if v == Verdict::Unchecked && self.unchecked.insert(node.clone()) {
                        out.push(Change::Unchecked { node: node.clone() });
                    }
                    if v == Verdict::Alive {
                        self.unchecked.remove(node);
                    }
                }
            }
        }
        out
    }

    /// How many nodes the last sweep found lost.
    pub fn lost_nodes(&self) -> usize {
        self.lost.len()
    }
}

/// The Lease a node's inventory names (`None`: none, or no readable inventory).
pub fn lease_of(annotations: &BTreeMap<String, String>) -> Option<LeaseRef> {
    #[derive(Deserialize)]
    struct OnlyLease {
        #[serde(default)]
        lease: Option<LeaseRef>,
    }
    let text = annotations.get(INVENTORY_ANNOTATION)?;
    serde_json::from_str::<OnlyLease>(text).ok()?.lease
}

/// Why a lost node gets no pod: the node, the Lease, how long it has not changed, and what
/// to check.
pub fn refusal(node: &str, lease: &LeaseRef, unchanged_ms: u64) -> String {
    let ns = &lease.namespace;
    // Tenths of a second, rounded up: just over the duration never reads as equal to it.
    let tenths = unchanged_ms.div_ceil(100);
    format!(
        "node {node} is lost: its vcuda-manager has not renewed Lease {lease} for {}.{} s (longer than its {} s), so the node is down or cut off from the API server; no pod is placed there until the Lease changes again. Check `kubectl get node {node}`, `kubectl -n {ns} get lease {}` and `kubectl -n {ns} get pods -o wide --field-selector spec.nodeName={node}`",
        tenths / 10,
        tenths % 10,
        lease.duration_seconds,
        lease.name,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lease(duration_seconds: u32) -> LeaseRef {
        LeaseRef {
            namespace: "vcuda-system".into(),
            name: "vcuda-manager-n1".into(),
            duration_seconds,
        }
    }

    fn listed(token: &str) -> Vec<(String, String, String)> {
        vec![(
            "vcuda-system".into(),
            "vcuda-manager-n1".into(),
            token.into(),
        )]
    }

    #[test]
    fn a_lease_that_stops_changing_loses_its_node_and_a_change_brings_it_back() {
        let l = lease(3);
        let mut t = Tracker::new();
        t.observe(1_000, listed("rv1"));
        assert_eq!(
            t.verdict(Some(&l), 1_000),
            Verdict::Alive,
            "first seen: grace"
        );
        t.observe(3_500, listed("rv2"));
        t.observe(6_500, listed("rv2"));
        assert_eq!(
            t.verdict(Some(&l), 6_500),
            Verdict::Alive,
            "exactly the duration"
        );
        t.observe(6_600, listed("rv2"));
        assert_eq!(
            t.verdict(Some(&l), 6_700),
            Verdict::Lost {
                lease: l.clone(),
                unchanged_ms: 3_200
            }
        );
        t.observe(6_800, listed("rv3"));
        assert_eq!(
            t.verdict(Some(&l), 6_800),
            Verdict::Alive,
            "revived at once"
        );
    }

    #[test]
    fn nothing_is_judged_on_polls_that_failed() {
        let l = lease(3);
        let mut t = Tracker::new();
        t.observe(0, listed("rv1"));
        // No successful poll since: the clock runs, but there is no evidence.
        assert_eq!(t.verdict(Some(&l), 60_000), Verdict::Alive);
        t.observe(60_000, listed("rv1"));
        assert!(matches!(t.verdict(Some(&l), 60_000), Verdict::Lost { .. }));
    }

    #[test]
    fn a_lease_never_listed_gets_a_grace_from_when_it_was_first_asked_about() {
        let l = lease(2);
        let mut t = Tracker::new();
        t.observe(0, vec![]);
        t.observe(10_000, vec![]);
        assert_eq!(t.verdict(Some(&l), 10_000), Verdict::Alive, "new node");
        t.observe(11_000, vec![]);
        assert_eq!(t.verdict(Some(&l), 11_000), Verdict::Alive);
        t.observe(12_001, vec![]);
        assert!(
            matches!(t.verdict(Some(&l), 12_001), Verdict::Lost { .. }),
            "no Lease was ever made"
        );
        assert_eq!(t.verdict(None, 99_000), Verdict::Unchecked);
    }

    #[test]
    fn a_sweep_reports_each_transition_once() {
        let l = lease(1);
        let nodes = vec![
            ("n1".to_string(), Some(l.clone())),
            ("old".to_string(), None),
        ];
        let mut t = Tracker::new();
        t.observe(0, listed("a"));
        assert_eq!(
            t.sweep(0, &nodes),
            vec![Change::Unchecked { node: "old".into() }]
        );
        assert_eq!(t.sweep(500, &nodes), vec![], "reported once");
        t.observe(1_500, listed("a"));
        assert_eq!(
            t.sweep(1_500, &nodes),
            vec![Change::Lost {
                node: "n1".into(),
                lease: l.clone(),
                unchanged_ms: 1_500
            }]
        );
        assert_eq!(t.lost_nodes(), 1);
        t.observe(2_000, listed("a"));
        assert_eq!(t.sweep(2_000, &nodes), vec![], "still lost: reported once");
        t.observe(2_500, listed("b"));
        assert_eq!(
            t.sweep(2_500, &nodes),
            vec![Change::Back { node: "n1".into() }]
        );
        assert_eq!(t.lost_nodes(), 0);
        // A lost node that leaves the cluster is forgotten.
        t.observe(9_000, listed("b"));
        assert_eq!(t.sweep(9_000, &nodes).len(), 1);
        assert_eq!(t.sweep(9_000, &nodes[1..]), vec![]);
        assert_eq!(t.lost_nodes(), 0);
    }

    #[test]
    fn the_inventory_names_the_lease_or_not() {
        let mut ann = BTreeMap::new();
        assert_eq!(lease_of(&ann), None);
        ann.insert(
            INVENTORY_ANNOTATION.to_string(),
            r#"{"schema":1,"gpus":[]}"#.to_string(),
        );
        assert_eq!(lease_of(&ann), None, "an older manager's inventory");
        ann.insert(
            INVENTORY_ANNOTATION.to_string(),
            r#"{"schema":1,"gpus":[],"lease":{"namespace":"vcuda-system","name":"vcuda-manager-n1","durationSeconds":3}}"#.to_string(),
        );
        assert_eq!(lease_of(&ann), Some(lease(3)));
    }

    #[test]
    fn the_refusal_names_the_node_the_lease_the_time_and_what_to_check() {
        assert!(refusal("n1", &lease(3), 3_001).contains("for 3.1 s"));
        let r = refusal("n1", &lease(40), 41_250);
        for part in [
            "node n1 is lost",
            "vcuda-system/vcuda-manager-n1",
            "for 41.3 s",
            "40 s",
            "kubectl -n vcuda-system get pods -o wide --field-selector spec.nodeName=n1",
            "kubectl -n vcuda-system get lease vcuda-manager-n1",
        ] {
            assert!(r.contains(part), "{part:?} not in {r}");
        }
    }

    /// A run of polls: each after a gap of at most `poll_ms`, the Lease changed or not.
    fn runs() -> impl Strategy<Value = (u32, u64, Vec<(u64, bool)>)> {
        (1u32..=5, 10u64..=2_000).prop_flat_map(|(d, poll)| {
            (
                Just(d),
                Just(poll),
                prop::collection::vec((1..=poll, prop::bool::weighted(0.3)), 1..120),
            )
        })
    }

    proptest! {
        /// Never lost before the duration has elapsed since the last change observed; always
        /// lost after duration + one poll without change (polls succeeding); a change
        /// always revives.
        #[test]
        fn lost_exactly_when_the_lease_stood_still_too_long((d, poll, steps) in runs()) {
            let l = lease(d);
            let d_ms = u64::from(d) * 1000;
            let mut t = Tracker::new();
            let mut now = 0u64;
            let mut version = 0u32;
            t.observe(now, listed("v0"));
            let mut changed = now;
            for (gap, change) in steps {
                now += gap;
                if change {
                    version += 1;
                    changed = now;
                }
                t.observe(now, listed(&format!("v{version}")));
                // Asked at the poll and a little later (before the next poll).
                for later in [0, gap / 2] {
                    let at = now + later;
                    let v = t.verdict(Some(&l), at);
                    let lost = matches!(v, Verdict::Lost { .. });
                    if lost {
                        prop_assert!(at - changed > d_ms, "lost {} ms after a change (duration {d_ms})", at - changed);
                    }
                    if at - changed > d_ms + poll {
                        prop_assert!(lost, "alive {} ms after the last change (duration {d_ms}, poll {poll})", at - changed);
                    }
                    if change {
                        prop_assert_eq!(v, Verdict::Alive, "a change revives");
                    }
                    if let Verdict::Lost { unchanged_ms, .. } = t.verdict(Some(&l), at) {
                        prop_assert_eq!(unchanged_ms, at - changed);
                    }
                }
            }
        }

        /// Whatever the verdicts, a sweep reports a node lost once per episode and back once.
        #[test]
        fn sweeps_alternate_lost_and_back((d, _poll, steps) in runs()) {
            let nodes = vec![("n1".to_string(), Some(lease(d)))];
            let mut t = Tracker::new();
            let (mut now, mut version) = (0u64, 0u32);
            let mut lost = false;
            for (gap, change) in steps {
                now += gap * 3;
                version += u32::from(change);
                t.observe(now, listed(&format!("v{version}")));
                for c in t.sweep(now, &nodes) {
                    match c {
                        Change::Lost { .. } => { prop_assert!(!lost); lost = true; }
                        Change::Back { .. } => { prop_assert!(lost); lost = false; }
                        Change::Unchecked { .. } => prop_assert!(false, "the node has a lease"),
                    }
                }
                prop_assert_eq!(t.lost_nodes(), usize::from(lost));
            }
        }
    }
}
