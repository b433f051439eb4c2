//! The extender's Prometheus metrics (prometheus-client): one registry, the handles the
//! handlers count with, and its OpenMetrics text. No I/O here: `server` and `bind` count,
//! `listen::serve_metrics` serves [`Metrics::encode`] on `--metrics-address` (plain HTTP,
//! apart from the extender's mutual-TLS port).
//!
//! Every metric, its labels and the `reason` kinds are listed in `scheduler/README.md`.
//! A `reason` is a short stable snake_case kind, never a message: the bind's from
//! [`crate::bind::BindError::kind`], filter's from the refusal's own kind.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// The extender's verbs (`verb` label).
pub const VERBS: [&str; 3] = ["filter", "prioritize", "bind"];

/// Upper bounds of the bind duration buckets, seconds: a bind is a few API calls (ms), up
/// to ten conflicting writes and a quota claim (seconds).
pub const BIND_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The content type of [`Metrics::encode`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerbLabels {
    verb: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// The registry and what is counted in it. Shared by the handlers (`Arc<Metrics>`); every
/// handle is atomic.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<VerbLabels, Counter>,
    binds: Counter,
    filter_refusals: Family<ReasonLabels, Counter>,
    bind_refusals: Family<ReasonLabels, Counter>,
    bind_duration: Histogram,
    nodes_lost: Gauge,
}

impl Metrics {
    /// Every metric registered; the request counters of each verb and the bind refusal
    /// counters of each of `bind_kinds` start at 0, so they exist before the first.
    pub fn new(bind_kinds: &[&'static str]) -> Metrics {
        let mut root = Registry::default();
        let r = root.sub_registry_with_prefix("vcuda_scheduler");
        let requests = Family::<VerbLabels, Counter>::default();
        r.register(
            "requests",
            "Extender requests received, by verb (malformed ones included)",
            requests.clone(),
        );
        let binds = Counter::default();
        r.register(
            "binds",
            "Pods bound: the reservation written and the Binding created",
            binds.clone(),
        );
        let filter_refusals = Family::<ReasonLabels, Counter>::default();
        r.register(
            "filter_refusals",
            "Nodes filter refused for a pod, by the kind of reason",
            filter_refusals.clone(),
        );
        let bind_refusals = Family::<ReasonLabels, Counter>::default();
        r.register(
            "bind_refusals",
            "Binds refused or failed, by the kind of error",
            bind_refusals.clone(),
        );
        let bind_duration = Histogram::new(BIND_BUCKETS);
        r.register_with_unit(
            "bind_duration",
            "Time a bind took, from its request to its answer (bound or refused)",
            Unit::Seconds,
            bind_duration.clone(),
        );
        let nodes_lost = Gauge::default();
        r.register(
            "nodes_lost",
            "Nodes whose vcuda-manager lease expired (the manager stopped renewing it)",
            nodes_lost.clone(),
        );
        for verb in VERBS {
            let _ = requests.get_or_create(&VerbLabels { verb });
        }
        for &reason in bind_kinds {
            let _ = bind_refusals.get_or_create(&ReasonLabels { reason });
        }
        Metrics {
            registry: root,
            requests,
            binds,
            filter_refusals,
            bind_refusals,
            bind_duration,
            nodes_lost,
        }
    }

    /// A request for `verb` (one of [`VERBS`]) arrived.
    pub fn request(&self, verb: &'static str) {
        self.requests.get_or_create(&VerbLabels { verb }).inc();
    }

    /// Filter refused a node for `reason` (a refusal's kind).
    pub fn filter_refused(&self, reason: &'static str) {
        self.filter_refusals
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// A bind ended after `seconds`: bound (`Ok`) or refused with the error's kind.
    pub fn bind_done(&self, seconds: f64, outcome: Result<(), &'static str>) {
        self.bind_duration.observe(seconds);
        match outcome {
            Ok(()) => {
                self.binds.inc();
            }
            Err(reason) => {
                self.bind_refusals
                    .get_or_create(&ReasonLabels { reason })
                    .inc();
            }
        }
    }

    /// How many nodes' vcuda-manager leases are expired now (`vcuda_scheduler_nodes_lost`).
    pub fn set_nodes_lost(&self, nodes: usize) {
        self.nodes_lost
            .set(i64::try_from(nodes).unwrap_or(i64::MAX));
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.push_str("# EOF\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn every_metric_is_named_labelled_and_counted() {
        let m = Metrics::new(&["no_fit", "api_read"]);
        let text = m.encode();
        // before anything happened: the verbs and bind kinds at 0, no filter reason yet
        for verb in VERBS {
            let s = format!("vcuda_scheduler_requests_total{{verb=\"{verb}\"}}");
            assert_eq!(value(&text, &s), Some(0.0), "{s} in\n{text}");
        }
        assert_eq!(
            value(
                &text,
                r#"vcuda_scheduler_bind_refusals_total{reason="api_read"}"#
            ),
            Some(0.0)
        );
        assert_eq!(value(&text, "vcuda_scheduler_binds_total"), Some(0.0));
        assert_eq!(value(&text, "vcuda_scheduler_nodes_lost"), Some(0.0));
        assert!(
            !text.contains("vcuda_scheduler_filter_refusals_total{"),
            "{text}"
        );

        m.request("filter");
        m.request("bind");
        m.request("bind");
        m.filter_refused("no_inventory");
        m.filter_refused("no_inventory");
        m.bind_done(0.003, Ok(()));
        m.bind_done(0.2, Err("no_fit"));
        m.set_nodes_lost(3);
        let text = m.encode();
        for (series, want) in [
            (r#"vcuda_scheduler_requests_total{verb="filter"}"#, 1.0),
            (r#"vcuda_scheduler_requests_total{verb="prioritize"}"#, 0.0),
            (r#"vcuda_scheduler_requests_total{verb="bind"}"#, 2.0),
            (
                r#"vcuda_scheduler_filter_refusals_total{reason="no_inventory"}"#,
                2.0,
            ),
            (
                r#"vcuda_scheduler_bind_refusals_total{reason="no_fit"}"#,
                1.0,
            ),
            (
                r#"vcuda_scheduler_bind_refusals_total{reason="api_read"}"#,
                0.0,
            ),
            ("vcuda_scheduler_binds_total", 1.0),
            ("vcuda_scheduler_bind_duration_seconds_count", 2.0),
            (
                r#"vcuda_scheduler_bind_duration_seconds_bucket{le="0.005"}"#,
                1.0,
            ),
            (
                r#"vcuda_scheduler_bind_duration_seconds_bucket{le="0.1"}"#,
                1.0,
            ),
            (
                r#"vcuda_scheduler_bind_duration_seconds_bucket{le="0.25"}"#,
                2.0,
            ),
            (
                r#"vcuda_scheduler_bind_duration_seconds_bucket{le="+Inf"}"#,
                2.0,
            ),
            ("vcuda_scheduler_nodes_lost", 3.0),
        ] {
            assert_eq!(value(&text, series), Some(want), "{series} in\n{text}");
        }
        assert!(text.contains("# UNIT vcuda_scheduler_bind_duration_seconds seconds"));
        assert!(text.ends_with("# EOF\n"), "{text}");
        m.set_nodes_lost(0);
        assert_eq!(value(&m.encode(), "vcuda_scheduler_nodes_lost"), Some(0.0));
    }
}
