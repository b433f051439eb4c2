//! The manager's node Lease (pure): which `coordination.k8s.io/v1` Lease proves this node's
//! vcuda-manager alive, what it looks like after each renewal, and when the next renewal is
//! due. The daemon's `lease` task reads and writes it; times come in as arguments.
//!
//! **Why.** vcuda-scheduler places pods from the node's `vcuda.io/gpus`, which says nothing
//! of whether the node is still there. The manager renews its Lease every
//! `leaseDurationSeconds / 4`; a scheduler that sees the Lease unchanged for longer than
//! `leaseDurationSeconds` (by its own clock: the timestamps are not compared with anything,
//! so clock skew does not matter) stops placing pods on the node, as Kubernetes' node
//! lifecycle controller does with the kubelet's Lease in `kube-node-lease`. The inventory
//! names the Lease ([`vcuda_cluster::LeaseRef`]), so the scheduler checks only nodes whose
//! manager keeps one.
//!
//! Invariants (unit-tested): the Lease is named `vcuda-manager-<node>` and labelled
//! [`LEASE_LABEL`]; every renewal moves `renewTime` and keeps `acquireTime` while the holder
//! (this start of the manager) is the same; a new holder takes the Lease over with a new
//! `acquireTime` and one more `leaseTransitions`; the `resourceVersion` of the read Lease is
//! carried, so a renewal is a compare-and-swap; renewals come every quarter of the duration
//! and, after a failure, sooner (never later).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::chrono::{DateTime, Utc};
use vcuda_cluster::LeaseRef;

/// The label every manager Lease carries; vcuda-scheduler lists Leases by it.
pub const LEASE_LABEL: (&str, &str) = ("app.kubernetes.io/name", "vcuda-manager");

/// The label naming the Lease's node (for `kubectl get leases -l vcuda.io/node=<node>`).
pub const NODE_LABEL: &str = "vcuda.io/node";

/// The Lease's namespace when neither `--lease-namespace` nor `$POD_NAMESPACE` says.
pub const DEFAULT_NAMESPACE: &str = "vcuda-system";

/// `--lease-duration`'s default, seconds (the kubelet's node Lease also lasts 40 s).
pub const DEFAULT_DURATION_SECONDS: u32 = 40;

/// The longest `--lease-duration` accepted, seconds (an hour: longer says nothing useful).
pub const MAX_DURATION_SECONDS: u32 = 3600;

/// The first retry after a failed renewal; doubled per failure, never beyond the interval.
pub const FIRST_RETRY: Duration = Duration::from_millis(100);

/// Which Lease this manager keeps and as whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Namespace and name of the Lease, and its duration (what the inventory publishes).
    pub lease: LeaseRef,
    /// The node's name.
    pub node: String,
    /// `spec.holderIdentity`: the node and this start's random instance id.
    pub identity: String,
}

impl Holder {
    /// The Lease of `node` in `namespace`, held by this start (`instance`: random per start).
    pub fn new(namespace: &str, node: &str, duration_seconds: u32, instance: u64) -> Holder {
        Holder {
            lease: LeaseRef {
                namespace: namespace.to_string(),
                name: lease_name(node),
                duration_seconds: duration_seconds.max(1),
            },
            node: node.to_string(),
            identity: format!("{node}/{instance:016x}"),
        }
    }

    /// How often the Lease is renewed: a quarter of its duration.
    pub fn interval(&self) -> Duration {
        Duration::from_secs(u64::from(self.lease.duration_seconds)) / 4
    }
}

/// The Lease's name for `node`.
pub fn lease_name(node: &str) -> String {
    format!("vcuda-manager-{node}")
}

/// A Unix time in microseconds as a `MicroTime` (serialized `2026-11-28T04:00:00.123456Z`);
/// out of chrono's range (not a real clock reading) it is the epoch.
pub fn micro_time(unix_micros: i64) -> MicroTime {
    MicroTime(DateTime::<Utc>::from_timestamp_micros(unix_micros).unwrap_or_default())
}

/// The Lease after a renewal at `now_micros` (Unix time) by `me`, from the one read
/// (`current`; `None`: there is none, create it). Carries `current`'s `resourceVersion`, so
/// the write fails with a conflict if someone wrote it meanwhile.
pub fn renewed(current: Option<&Lease>, me: &Holder, now_micros: i64) -> Lease {
    let now = micro_time(now_micros);
    let spec = current.and_then(|l| l.spec.as_ref());
    let same_holder = spec.and_then(|s| s.holder_identity.as_deref()) == Some(&me.identity);
    let had_holder = spec.is_some_and(|s| s.holder_identity.is_some());
    let transitions = spec.and_then(|s| s.lease_transitions).unwrap_or(0);
    let acquire_time = match spec.and_then(|s| s.acquire_time.clone()) {
        Some(t) if same_holder => t,
        _ => now.clone(),
    };
    let mut labels = current
        .and_then(|l| l.metadata.labels.clone())
        .unwrap_or_default();
    labels.insert(LEASE_LABEL.0.to_string(), LEASE_LABEL.1.to_string());
    labels.insert(NODE_LABEL.to_string(), label_value(&me.node));
    Lease {
        metadata: ObjectMeta {
            name: Some(me.lease.name.clone()),
            namespace: Some(me.lease.namespace.clone()),
            labels: Some(labels),
            resource_version: current.and_then(|l| l.metadata.resource_version.clone()),
            annotations: current.and_then(|l| l.metadata.annotations.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(me.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(me.lease.duration_seconds).unwrap_or(i32::MAX),
            ),
            acquire_time: Some(acquire_time),
            renew_time: Some(now),
            lease_transitions: Some(if had_holder && !same_holder {
                transitions.saturating_add(1)
            } else {
                transitions
            }),
            ..LeaseSpec::default()
        }),
    }
}

/// A node name as a label value (≤ 63 characters; a longer name is cut, the label is only a
/// convenience for `kubectl`).
fn label_value(node: &str) -> String {
    let cut: String = node.chars().take(63).collect();
    cut.trim_end_matches(['-', '.', '_']).to_string()
}

/// When the next renewal is due: every [`Holder::interval`] while renewals succeed; after
/// failures, sooner ([`FIRST_RETRY`], doubling), so that a short outage costs the node as
/// little of its duration as possible.
#[derive(Debug, Clone)]
pub struct Cadence {
    interval: Duration,
    failures: u32,
}

impl Cadence {
    /// For a Lease renewed every `interval`.
    pub fn new(interval: Duration) -> Cadence {
        Cadence {
            interval,
            failures: 0,
        }
    }

    /// After a renewal that succeeded (`ok`) or failed: how long to wait for the next.
    pub fn next(&mut self, ok: bool) -> Duration {
        if ok {
            self.failures = 0;
            return self.interval;
        }
        let backoff = FIRST_RETRY.saturating_mul(1u32 << self.failures.min(16));
        self.failures = self.failures.saturating_add(1);
        backoff.min(self.interval)
    }

    /// Failed renewals in a row.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_795_838_400_123_456; // 2026-11-28T04:00:00.123456Z

    fn me() -> Holder {
        Holder::new("vcuda-system", "gpu-node-1", 40, 0xabc)
    }

    #[test]
    fn the_lease_is_named_for_the_node_and_held_by_this_start() {
        let h = me();
        assert_eq!(h.lease.name, "vcuda-manager-gpu-node-1");
        assert_eq!(h.lease.namespace, "vcuda-system");
        assert_eq!(h.identity, "gpu-node-1/0000000000000abc");
        assert_ne!(
            Holder::new("vcuda-system", "gpu-node-1", 40, 1).identity,
            h.identity,
            "another start is another holder"
        );
        assert_eq!(h.interval(), Duration::from_secs(10));
        assert_eq!(
            Holder::new("ns", "n", 3, 0).interval(),
            Duration::from_millis(750)
        );
        assert_eq!(
            Holder::new("ns", "n", 0, 0).lease.duration_seconds,
            1,
            "a Lease lasts at least a second"
        );
    }

    #[test]
    fn a_new_lease_has_the_upstream_fields_and_micro_times() {
        let l = renewed(None, &me(), T0);
        let json = serde_json::to_value(&l).unwrap();
        assert_eq!(json["apiVersion"], "coordination.k8s.io/v1");
        assert_eq!(json["kind"], "Lease");
        assert_eq!(json["metadata"]["name"], "vcuda-manager-gpu-node-1");
        assert_eq!(json["metadata"]["namespace"], "vcuda-system");
        assert_eq!(
            json["metadata"]["labels"]["app.kubernetes.io/name"],
            "vcuda-manager"
        );
        assert_eq!(json["metadata"]["labels"]["vcuda.io/node"], "gpu-node-1");
        assert!(json["metadata"].get("resourceVersion").is_none(), "{json}");
        let spec = &json["spec"];
        assert_eq!(spec["holderIdentity"], "gpu-node-1/0000000000000abc");
        assert_eq!(spec["leaseDurationSeconds"], 40);
        assert_eq!(spec["renewTime"], "2026-11-28T04:00:00.123456Z");
        assert_eq!(spec["acquireTime"], "2026-11-28T04:00:00.123456Z");
        assert_eq!(spec["leaseTransitions"], 0);
    }

    #[test]
    fn a_renewal_moves_renew_time_only_and_carries_the_resource_version() {
        let mut first = renewed(None, &me(), T0);
        first.metadata.resource_version = Some("17".into());
        let next = renewed(Some(&first), &me(), T0 + 10_000_000);
        let (a, b) = (first.spec.clone().unwrap(), next.spec.clone().unwrap());
        assert_eq!(next.metadata.resource_version.as_deref(), Some("17"));
        assert_eq!(b.acquire_time, a.acquire_time);
        assert_ne!(b.renew_time, a.renew_time);
        assert_eq!(
            serde_json::to_value(&b.renew_time).unwrap(),
            "2026-11-28T04:00:10.123456Z"
        );
        assert_eq!(b.lease_transitions, Some(0));
        assert_eq!(b.holder_identity, a.holder_identity);
    }

    #[test]
    fn a_new_start_takes_the_lease_over() {
        let mut old = renewed(None, &Holder::new("vcuda-system", "gpu-node-1", 40, 1), T0);
        old.metadata.resource_version = Some("5".into());
        old.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("team".into(), "ml".into());
        let l = renewed(Some(&old), &me(), T0 + 60_000_000);
        let s = l.spec.unwrap();
        assert_eq!(
            s.holder_identity.as_deref(),
            Some("gpu-node-1/0000000000000abc")
        );
        assert_eq!(s.acquire_time, s.renew_time, "acquired now");
        assert_eq!(s.lease_transitions, Some(1));
        assert_eq!(l.metadata.resource_version.as_deref(), Some("5"));
        let labels = l.metadata.labels.unwrap();
        assert_eq!(
            labels.get("team").map(String::as_str),
            Some("ml"),
            "others' labels kept"
        );
        assert_eq!(
            labels.get(LEASE_LABEL.0).map(String::as_str),
            Some(LEASE_LABEL.1)
        );
    }

    #[test]
    fn renewals_come_every_quarter_and_sooner_after_failures() {
        let mut c = Cadence::new(Duration::from_secs(10));
        assert_eq!(c.next(true), Duration::from_secs(10));
        let waits: Vec<_> = (0..10).map(|_| c.next(false)).collect();
        assert_eq!(waits[0], FIRST_RETRY);
        assert_eq!(waits[1], FIRST_RETRY * 2);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert!(
            waits.iter().all(|w| *w <= Duration::from_secs(10)),
            "{waits:?}"
        );
        assert_eq!(*waits.last().unwrap(), Duration::from_secs(10), "capped");
        assert_eq!(c.failures(), 10);
        assert_eq!(c.next(true), Duration::from_secs(10));
        assert_eq!(c.failures(), 0, "a success resets the back-off");
        let mut short = Cadence::new(Duration::from_millis(250));
        for _ in 0..40 {
            assert!(short.next(false) <= Duration::from_millis(250));
        }
    }

    #[test]
    fn long_node_names_still_make_a_label() {
        let node = format!("{}-x", "a".repeat(62));
        let l = renewed(None, &Holder::new("ns", &node, 40, 0), T0);
        let v = l.metadata.labels.unwrap()[NODE_LABEL].clone();
        assert!(v.len() <= 63 && !v.ends_with('-'), "{v}");
        assert_eq!(micro_time(i64::MAX), MicroTime(DateTime::<Utc>::default()));
    }
}
