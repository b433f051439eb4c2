//! The node's GPUs as the decisions see them: the inventory found at start (in NVML index
//! order) and the health rule that turns XID events into healthy/unhealthy. Pure: NVML
//! itself is the daemon's (`vcuda_manager::gpus`), which fills these in.

use std::time::{Duration, Instant};

use crate::allocation::Gpu;
use crate::placement::Node;

/// Everything placement and Allocate need about the GPUs, in NVML index order.
#[derive(Debug, Clone)]
pub struct Inventory {
    pub gpus: Vec<Gpu>,
    pub node: Node,
    /// NUMA node of each GPU, if it has one (the kubelet's topology hint).
    pub numa: Vec<Option<i64>>,
    /// NVML model name of each GPU (empty when NVML cannot say).
    pub models: Vec<String>,
    /// CUDA compute capability of each GPU, `major.minor` (empty when NVML cannot say).
    pub compute: Vec<String>,
}

/// Health of each GPU: unhealthy from a fatal XID until `recover_after` has passed without
/// another and the GPU answers NVML again.
#[derive(Debug, Clone)]
pub struct Health {
    ignore: Vec<u64>,
    recover_after: Duration,
    last_fatal: Vec<Option<Instant>>,
}

impl Health {
    pub fn new(gpus: usize, ignore: Vec<u64>, recover_after: Duration) -> Health {
        Health {
            ignore,
            recover_after,
            last_fatal: vec![None; gpus],
        }
    }

    /// Record an XID on GPU `g`; returns whether it made the GPU unhealthy.
    pub fn xid(&mut self, g: usize, xid: Option<u64>, now: Instant) -> bool {
        if xid.is_some_and(|x| self.ignore.contains(&x)) || g >= self.last_fatal.len() {
            return false;
        }
        self.last_fatal[g] = Some(now);
        true
    }

    /// Health now; `answers(g)` says whether GPU g responds to NVML (asked only for GPUs
    /// that may recover).
    pub fn healthy(&mut self, now: Instant, answers: &dyn Fn(usize) -> bool) -> Vec<bool> {
        (0..self.last_fatal.len())
            .map(|g| match self.last_fatal[g] {
                None => true,
                Some(t) if now.duration_since(t) >= self.recover_after && answers(g) => {
                    self.last_fatal[g] = None;
                    true
                }
                Some(_) => false,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_recovers_after_quiet_time_if_it_answers() {
        let t0 = Instant::now();
        let mut h = Health::new(2, vec![13, 31], Duration::from_secs(10));
        assert!(!h.xid(0, Some(13), t0), "ignored XID");
        assert_eq!(h.healthy(t0, &|_| true), vec![true, true]);
        assert!(h.xid(1, Some(79), t0));
        assert_eq!(
            h.healthy(t0 + Duration::from_secs(5), &|_| true),
            vec![true, false]
        );
        assert_eq!(
            h.healthy(t0 + Duration::from_secs(11), &|_| false),
            vec![true, false],
            "does not answer NVML: stays unhealthy"
        );
        assert_eq!(
            h.healthy(t0 + Duration::from_secs(11), &|_| true),
            vec![true, true]
        );
        assert!(
            h.xid(1, None, t0),
            "an XID NVML could not decode counts as fatal"
        );
    }
}
