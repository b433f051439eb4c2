//! Which GPU a container gets, and whether what the kubelet hands us is a valid request.
//! Pure: the kubelet's offer, the node's GPUs and the clock come in as arguments.
//!
//! - [`preferred`] answers GetPreferredAllocation: every resource of one container on the
//!   same GPU (the [`Pairing`] carries the first resource's GPU to the second's call), a
//!   share on the tightest GPU it fits (best fit, so large holes stay free), whole GPUs on
//!   the best-connected free set (NVLink, then PCIe switch, then NUMA node). It never fails:
//!   the answer is a hint and an error would fail the pod's admission.
//! - [`check_cores`] / [`check_memory`] validate what Allocate receives and say in words a
//!   user reads in `kubectl describe pod` what is wrong.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::ids::{DeviceId, Kind, CORES_PER_GPU, MEMORY_UNIT};

/// How two GPUs are connected (from NVML), best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// NVLink with this many lanes.
    NvLink(u32),
    /// Behind one PCIe switch.
    Switch,
    /// Several PCIe switches, no host bridge crossed.
    MultiSwitch,
    /// The same host bridge.
    HostBridge,
    /// The same NUMA node.
    Node,
    /// Across NUMA nodes.
    System,
}

impl Link {
    /// A score to maximise: any NVLink beats any PCIe path; more lanes beat fewer.
    pub fn score(self) -> u32 {
        match self {
            Link::NvLink(n) => 1000 + n,
            Link::Switch => 50,
            Link::MultiSwitch => 40,
            Link::HostBridge => 30,
            Link::Node => 20,
            Link::System => 0,
        }
    }
}

/// What placement needs to know about the node's GPUs.
#[derive(Debug, Clone)]
pub struct Node {
    /// UUIDs, in NVML index order.
    pub uuids: Vec<String>,
    /// Device memory per GPU, bytes.
    pub memory: Vec<u64>,
    /// `links[a][b]`: how GPU a reaches GPU b (the diagonal is unused).
    pub links: Vec<Vec<Link>>,
}

impl Node {
    pub fn index_of(&self, uuid: &str) -> Option<usize> {
        self.uuids.iter().position(|u| u == uuid)
    }
}

/// The GPU the last placed resource of a container went to, so the container's other
/// resource follows it. The kubelet admits one pod at a time and asks for a container's
/// resources back to back, so the next call for the *other* resource, soon after, is the
/// same container's.
#[derive(Debug, Clone, Default)]
pub struct Pairing {
    last: Option<(Kind, String, Duration)>,
}

/// A pairing older than this is stale (the other resource was not requested).
pub const PAIRING_TTL: Duration = Duration::from_secs(5);

impl Pairing {
    /// Remember that `kind` went to `uuid` at `now` (monotonic).
    pub fn placed(&mut self, kind: Kind, uuid: &str, now: Duration) {
        self.last = Some((kind, uuid.to_string(), now));
    }

    /// The GPU the container's other resource went to, if that was the last placement and
    /// recent; consumed by the call.
    pub fn take_hint(&mut self, kind: Kind, now: Duration) -> Option<String> {
        match self.last.take() {
            Some((k, uuid, at)) if k != kind && now.saturating_sub(at) <= PAIRING_TTL => Some(uuid),
            other => {
                self.last = other;
                None
            }
        }
    }
}

/// Available IDs per GPU (in `node` order), lowest index first.
fn by_gpu(node: &Node, available: &[DeviceId]) -> Vec<Vec<DeviceId>> {
    let mut out = vec![Vec::new(); node.uuids.len()];
    for id in available {
        if let Some(g) = node.index_of(&id.uuid) {
            out[g].push(id.clone());
        }
    }
    for v in &mut out {
        v.sort();
    }
    out
}

/// GetPreferredAllocation for one container: `size` IDs of `kind` from `available`,
/// including `must_include`. `hint` is the GPU the container's other resource went to.
pub fn preferred(
    node: &Node,
    kind: Kind,
    available: &[DeviceId],
    must_include: &[DeviceId],
    size: usize,
    hint: Option<&str>,
) -> Vec<DeviceId> {
    let per = by_gpu(node, available);
    let mut chosen: Vec<DeviceId> = must_include.to_vec();
    let mut gpus: Vec<usize> = Vec::new();
    if kind == Kind::Core
        && size >= CORES_PER_GPU as usize
        && size.is_multiple_of(CORES_PER_GPU as usize)
    {
        gpus = whole_gpus(node, &per, size / CORES_PER_GPU as usize, hint);
    } else {
        let need = size.saturating_sub(chosen.len());
        let fits = |g: usize| per[g].len() >= need;
        let pinned = must_include
            .first()
            .and_then(|id| node.index_of(&id.uuid))
            .or_else(|| hint.and_then(|h| node.index_of(h)).filter(|&g| fits(g)));
        let best = pinned.or_else(|| {
            // Best fit: the fullest GPU that still fits.
            (0..per.len())
                .filter(|&g| fits(g))
                .min_by_key(|&g| (per[g].len(), g))
        });
        // Nothing fits: the GPU with most, and the kubelet fills the rest.
        let best = best.or_else(|| (0..per.len()).max_by_key(|&g| (per[g].len(), usize::MAX - g)));
        gpus.extend(best);
    }
    for g in gpus {
        for id in &per[g] {
            if chosen.len() >= size {
                break;
            }
            if !chosen.contains(id) {
                chosen.push(id.clone());
            }
        }
    }
    chosen.truncate(size.max(must_include.len()));
    chosen
}

/// `n` completely free GPUs, best connected (highest sum of pairwise link scores), the
/// hinted one included if free; ties go to lower indices.
fn whole_gpus(node: &Node, per: &[Vec<DeviceId>], n: usize, hint: Option<&str>) -> Vec<usize> {
    let free: Vec<usize> = (0..per.len())
        .filter(|&g| per[g].len() == CORES_PER_GPU as usize)
        .collect();
    if free.len() <= n {
        return free;
    }
    let hinted = hint
        .and_then(|h| node.index_of(h))
        .filter(|g| free.contains(g));
    let mut best: Option<(u64, Vec<usize>)> = None;
    combinations(&free, n, &mut Vec::new(), &mut |set| {
        if hinted.is_some_and(|h| !set.contains(&h)) {
            return;
        }
        let mut score = 0u64;
        for (i, &a) in set.iter().enumerate() {
            for &b in &set[i + 1..] {
                score += u64::from(node.links[a][b].score());
            }
        }
        if best.as_ref().is_none_or(|(s, _)| score > *s) {
            best = Some((score, set.to_vec()));
        }
    });
    best.map(|b| b.1).unwrap_or_default()
}

fn combinations(from: &[usize], k: usize, cur: &mut Vec<usize>, f: &mut dyn FnMut(&[usize])) {
    if cur.len() == k {
        f(cur);
        return;
    }
    for (i, &g) in from.iter().enumerate() {
        cur.push(g);
        combinations(&from[i + 1..], k, cur, f);
        cur.pop();
    }
}

/// What a container's `vcuda-core` devices mean.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cores {
    /// `percent` of one GPU.
    Share { uuid: String, percent: u32 },
    /// These GPUs whole, unthrottled.
    Whole { uuids: Vec<String> },
    /// `percent` of each of these GPUs (a `vcuda.io/gpu-count` split; PreStartContainer
    /// refuses it unless the pod asked for exactly this many GPUs).
    Split { uuids: Vec<String>, percent: u32 },
}

/// What the kubelet handed an Allocate cannot be served: the words a user reads in
/// `kubectl describe pod` (the kubelet shows the reason), each saying what to request instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("device {id} is not a vcuda-core device")]
    NotCore { id: String },
    #[error("vcuda-core: no devices were allocated")]
    NoCores,
    #[error(
        "vcuda-core {total} is neither a share of one GPU (1 to 99) nor whole GPUs (a multiple of 100); request e.g. {} or {}, or split it evenly over N GPUs with the pod annotation vcuda.io/gpu-count: \"N\" (which needs vcuda-manager's API server access)",
        total / CORES_PER_GPU * CORES_PER_GPU,
        (total / CORES_PER_GPU + 1) * CORES_PER_GPU
    )]
    CoresNotShareOrWhole { total: u32 },
    #[error(
        "vcuda-core {total} was split unevenly across {} GPUs by the kubelet ({}); a share must fit on one GPU (or be split evenly with vcuda.io/gpu-count): no GPU on this node has {total} % free",
        per_gpu.len(),
        per_gpu.iter().map(|(u, c)| format!("{c} on {u}")).collect::<Vec<_>>().join(", ")
    )]
    CoresUneven {
        total: u32,
        /// (GPU UUID, IDs on it), by UUID.
        per_gpu: Vec<(String, u32)>,
    },
    #[error("device {id} is not a vcuda-memory device")]
    NotMemory { id: String },
    #[error("vcuda-memory: no devices were allocated")]
    NoMemory,
    #[error(
        "vcuda-memory {total} ({} MiB) does not fit on one GPU: the largest GPU on this node has {largest} units ({} MiB) and shares cannot span GPUs unevenly",
        (total * MEMORY_UNIT) >> 20,
        (largest * MEMORY_UNIT) >> 20
    )]
    MemoryUneven {
        /// Units asked for (256 MiB each).
        total: u64,
        /// Units of the largest GPU.
        largest: u64,
    },
}

impl PlacementError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            PlacementError::NotCore { .. } => "not-core",
            PlacementError::NoCores => "no-cores",
            PlacementError::CoresNotShareOrWhole { .. } => "cores-not-share-or-whole",
            PlacementError::CoresUneven { .. } => "cores-uneven",
            PlacementError::NotMemory { .. } => "not-memory",
            PlacementError::NoMemory => "no-memory",
            PlacementError::MemoryUneven { .. } => "memory-uneven",
        }
    }
}

/// Validate the `vcuda-core` IDs of one Allocate: 1..99 on one GPU, or 100 on each of n GPUs.
pub fn check_cores(ids: &[DeviceId]) -> Result<Cores, PlacementError> {
    let mut per: BTreeMap<&str, u32> = BTreeMap::new();
    for id in ids {
        if id.kind != Kind::Core {
            return Err(PlacementError::NotCore { id: id.to_string() });
        }
        *per.entry(id.uuid.as_str()).or_default() += 1;
    }
    let total: u32 = per.values().sum();
    let whole = total > 0 && total.is_multiple_of(CORES_PER_GPU);
    if whole && per.values().all(|&c| c == CORES_PER_GPU) {
        return Ok(Cores::Whole {
            uuids: per.keys().map(|u| u.to_string()).collect(),
        });
    }
    if (1..CORES_PER_GPU).contains(&total) && per.len() == 1 {
        let (uuid, percent) = per.into_iter().next().expect("one GPU");
        return Ok(Cores::Share {
            uuid: uuid.to_string(),
            percent,
        });
    }
    let first = per.values().next().copied().unwrap_or(0);
    if per.len() > 1 && first < CORES_PER_GPU && per.values().all(|&c| c == first) {
        return Ok(Cores::Split {
            uuids: per.keys().map(|u| u.to_string()).collect(),
            percent: first,
        });
    }
    Err(if total == 0 {
        PlacementError::NoCores
    } else if !whole && total > CORES_PER_GPU {
        PlacementError::CoresNotShareOrWhole { total }
    } else {
        PlacementError::CoresUneven {
            total,
            per_gpu: per.iter().map(|(u, c)| (u.to_string(), *c)).collect(),
        }
    })
}

/// Where a container's `vcuda-memory` landed: one GPU, or an even split over several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlacement {
    /// The GPUs (sorted by UUID).
    pub gpus: Vec<String>,
    /// Bytes on each.
    pub per_gpu: u64,
}

/// Validate the `vcuda-memory` IDs of one Allocate: all on one GPU, or the same amount on
/// each of several (a `vcuda.io/gpu-count` split, checked against the pod at
/// PreStartContainer).
pub fn check_memory(node: &Node, ids: &[DeviceId]) -> Result<MemoryPlacement, PlacementError> {
    let mut per: BTreeMap<&str, u64> = BTreeMap::new();
    for id in ids {
        if id.kind != Kind::Memory {
            return Err(PlacementError::NotMemory { id: id.to_string() });
        }
        *per.entry(id.uuid.as_str()).or_default() += 1;
    }
    let total: u64 = per.values().sum();
    let first = per.values().next().copied().unwrap_or(0);
    if per.is_empty() {
        return Err(PlacementError::NoMemory);
    }
    if per.values().all(|&n| n == first) {
        return Ok(MemoryPlacement {
            gpus: per.keys().map(|u| u.to_string()).collect(),
            per_gpu: first * MEMORY_UNIT,
        });
    }
    let largest = node.memory.iter().copied().max().unwrap_or(0) / MEMORY_UNIT;
    Err(PlacementError::MemoryUneven { total, largest })
}

/// GetPreferredAllocation when the scheduler (or the container's other resource) has
/// decided the GPUs: `want` is `(GPU UUID, how many IDs on it)`. `None` when that cannot be
/// honoured exactly (too few available there, a `must_include` elsewhere, sizes disagree):
/// the caller then chooses by itself, and PreStartContainer judges the result.
pub fn preferred_on(
    kind: Kind,
    available: &[DeviceId],
    must_include: &[DeviceId],
    size: usize,
    want: &[(String, usize)],
) -> Option<Vec<DeviceId>> {
    if want.iter().map(|w| w.1).sum::<usize>() != size {
        return None;
    }
    let mut chosen = Vec::with_capacity(size);
    for (uuid, n) in want {
        let mut here: Vec<&DeviceId> = must_include
            .iter()
            .filter(|d| &d.uuid == uuid && d.kind == kind)
            .collect();
        let mut rest: Vec<&DeviceId> = available
            .iter()
            .filter(|d| &d.uuid == uuid && d.kind == kind && !here.contains(d))
            .collect();
        rest.sort();
        here.extend(rest);
        if here.len() < *n {
            return None;
        }
        chosen.extend(here.into_iter().take(*n).cloned());
    }
    must_include
        .iter()
        .all(|m| chosen.contains(m))
        .then_some(chosen)
}

/// `n` distinct GPUs with at least `per_gpu` available IDs each, for a `vcuda.io/gpu-count`
/// split chosen without the scheduler: GPUs in `prefer` first (where the container's other
/// resource went), then the fullest that fit (best fit), lower index on ties.
pub fn split_gpus(
    node: &Node,
    available: &[DeviceId],
    n: usize,
    per_gpu: usize,
    prefer: &[String],
) -> Option<Vec<(String, usize)>> {
    let per = by_gpu(node, available);
    let mut fit: Vec<usize> = (0..per.len())
        .filter(|&g| per[g].len() >= per_gpu)
        .collect();
    fit.sort_by_key(|&g| (!prefer.contains(&node.uuids[g]), per[g].len(), g));
    (fit.len() >= n).then(|| {
        fit[..n]
            .iter()
            .map(|&g| (node.uuids[g].clone(), per_gpu))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::all_ids;

    fn node(n: usize) -> Node {
        let uuids: Vec<String> = (0..n)
            .map(|i| format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"))
            .collect();
        // pairs (0,1), (2,3), ... have NVLink; halves share a NUMA node
        let link = |a: usize, b: usize| {
            if a / 2 == b / 2 {
                Link::NvLink(12)
            } else if a / (n / 2).max(1) == b / (n / 2).max(1) {
                Link::Node
            } else {
                Link::System
            }
        };
        let links = (0..n)
            .map(|a| (0..n).map(|b| link(a, b)).collect())
            .collect();
        Node {
            uuids,
            memory: vec![40 << 30; n],
            links,
        }
    }

    fn avail(node: &Node, kind: Kind, used: &[usize]) -> Vec<DeviceId> {
        // `used[g]` devices of GPU g are taken (the lowest ones).
        let mut out = Vec::new();
        for (g, u) in node.uuids.iter().enumerate() {
            out.extend(all_ids(u, kind, node.memory[g]).into_iter().skip(used[g]));
        }
        out
    }

    fn gpus_of(ids: &[DeviceId]) -> Vec<String> {
        let mut g: Vec<String> = ids.iter().map(|i| i.uuid.clone()).collect();
        g.dedup();
        g
    }

    #[test]
    fn a_share_goes_to_the_tightest_gpu_it_fits() {
        let n = node(4);
        let a = avail(&n, Kind::Core, &[90, 50, 20, 0]);
        let p = preferred(&n, Kind::Core, &a, &[], 30, None);
        assert_eq!(p.len(), 30);
        assert_eq!(
            gpus_of(&p),
            vec![n.uuids[1].clone()],
            "50 free beats 80 and 100; 10 is too few"
        );
        let p = preferred(&n, Kind::Core, &a, &[], 5, None);
        assert_eq!(gpus_of(&p), vec![n.uuids[0].clone()]);
    }

    #[test]
    fn the_second_resource_follows_the_first() {
        let n = node(4);
        let mut pairing = Pairing::default();
        let t0 = Duration::from_secs(100);
        let cores = preferred(
            &n,
            Kind::Core,
            &avail(&n, Kind::Core, &[0, 0, 60, 0]),
            &[],
            30,
            None,
        );
        assert_eq!(gpus_of(&cores), vec![n.uuids[2].clone()]);
        pairing.placed(Kind::Core, &n.uuids[2], t0);
        // memory would best-fit elsewhere, but follows the cores
        let hint = pairing.take_hint(Kind::Memory, t0 + Duration::from_millis(3));
        let mem = preferred(
            &n,
            Kind::Memory,
            &avail(&n, Kind::Memory, &[150, 0, 0, 0]),
            &[],
            8,
            hint.as_deref(),
        );
        assert_eq!(gpus_of(&mem), vec![n.uuids[2].clone()]);
        assert!(pairing.take_hint(Kind::Memory, t0).is_none(), "consumed");
        pairing.placed(Kind::Core, &n.uuids[1], t0);
        assert!(
            pairing.take_hint(Kind::Core, t0).is_none(),
            "same kind: another container"
        );
        assert!(
            pairing
                .take_hint(Kind::Memory, t0 + PAIRING_TTL * 2)
                .is_none(),
            "stale"
        );
    }

    #[test]
    fn whole_gpus_go_where_the_topology_is_best() {
        let n = node(8);
        let a = avail(&n, Kind::Core, &[0, 10, 0, 0, 0, 0, 0, 0]);
        let p = preferred(&n, Kind::Core, &a, &[], 200, None);
        assert_eq!(p.len(), 200);
        assert_eq!(
            gpus_of(&p),
            vec![n.uuids[2].clone(), n.uuids[3].clone()],
            "an NVLink pair, not GPU 1 (busy)"
        );
        let p = preferred(&n, Kind::Core, &a, &[], 400, None);
        let g = gpus_of(&p);
        assert_eq!(
            g,
            vec![
                n.uuids[4].clone(),
                n.uuids[5].clone(),
                n.uuids[6].clone(),
                n.uuids[7].clone()
            ],
            "two NVLink pairs on one NUMA node"
        );
    }

    #[test]
    fn the_answer_never_fails_and_keeps_must_include() {
        let n = node(2);
        let a = avail(&n, Kind::Core, &[95, 97]);
        let p = preferred(&n, Kind::Core, &a, &[], 40, None);
        assert_eq!(
            p.len(),
            5,
            "best effort: the GPU with most; the kubelet fills the rest"
        );
        let must = vec![a[0].clone()];
        let p = preferred(&n, Kind::Core, &a, &must, 3, None);
        assert_eq!(p[0], a[0]);
        assert_eq!(p.len(), 3);
        assert!(preferred(&n, Kind::Core, &[], &[], 10, None).is_empty());
    }

    #[test]
    fn core_requests_are_validated_in_words() {
        let n = node(2);
        let ids = |g: usize, k: u32| {
            all_ids(&n.uuids[g], Kind::Core, 0)
                .into_iter()
                .take(k as usize)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            check_cores(&ids(0, 30)),
            Ok(Cores::Share {
                uuid: n.uuids[0].clone(),
                percent: 30
            })
        );
        let both: Vec<DeviceId> = ids(0, 100).into_iter().chain(ids(1, 100)).collect();
        assert_eq!(
            check_cores(&both),
            Ok(Cores::Whole {
                uuids: n.uuids.clone()
            })
        );
        let odd: Vec<DeviceId> = ids(0, 100).into_iter().chain(ids(1, 50)).collect();
        let e = check_cores(&odd).unwrap_err();
        assert_eq!(e, PlacementError::CoresNotShareOrWhole { total: 150 });
        let e = e.to_string();
        assert!(
            e.contains("150") && e.contains("multiple of 100") && e.contains("e.g. 100 or 200"),
            "{e}"
        );
        let split: Vec<DeviceId> = ids(0, 20).into_iter().chain(ids(1, 20)).collect();
        assert_eq!(
            check_cores(&split),
            Ok(Cores::Split {
                uuids: n.uuids.clone(),
                percent: 20
            }),
            "an even split is for PreStartContainer to judge against vcuda.io/gpu-count"
        );
        let uneven: Vec<DeviceId> = ids(0, 20).into_iter().chain(ids(1, 30)).collect();
        let e = check_cores(&uneven).unwrap_err();
        assert!(
            matches!(&e, PlacementError::CoresUneven { total: 50, per_gpu } if per_gpu.len() == 2),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(e.contains("one GPU") && e.contains("unevenly"), "{e}");
        assert_eq!(check_cores(&[]), Err(PlacementError::NoCores));
        let mem = all_ids(&n.uuids[0], Kind::Memory, n.memory[0]);
        assert!(matches!(
            check_cores(&mem[..1]),
            Err(PlacementError::NotCore { .. })
        ));
    }

    #[test]
    fn memory_must_fit_one_gpu() {
        let n = node(2);
        let m0 = all_ids(&n.uuids[0], Kind::Memory, n.memory[0]);
        let m = check_memory(&n, &m0[..16]).unwrap();
        assert_eq!(m.gpus, vec![n.uuids[0].clone()]);
        assert_eq!(m.per_gpu, 4 << 30);
        let m1 = all_ids(&n.uuids[1], Kind::Memory, n.memory[1]);
        let big: Vec<DeviceId> = m0.iter().chain(m1[..10].iter()).cloned().collect();
        let e = check_memory(&n, &big).unwrap_err();
        assert_eq!(
            e,
            PlacementError::MemoryUneven {
                total: 170,
                largest: 160
            }
        );
        let e = e.to_string();
        assert!(e.contains("170") && e.contains("40960 MiB"), "{e}");
        let even: Vec<DeviceId> = m0[..8].iter().chain(m1[..8].iter()).cloned().collect();
        let m = check_memory(&n, &even).unwrap();
        assert_eq!((m.gpus.len(), m.per_gpu), (2, 2 << 30));
    }

    #[test]
    fn decided_gpus_are_honoured_exactly_or_not_at_all() {
        let n = node(2);
        let a = avail(&n, Kind::Core, &[70, 0]);
        let want = vec![(n.uuids[1].clone(), 30)];
        let p = preferred_on(Kind::Core, &a, &[], 30, &want).unwrap();
        assert_eq!(gpus_of(&p), vec![n.uuids[1].clone()]);
        assert_eq!(p.len(), 30);
        // Only 30 left on GPU 0: 40 cannot be honoured there.
        let want0 = vec![(n.uuids[0].clone(), 40)];
        assert_eq!(preferred_on(Kind::Core, &a, &[], 40, &want0), None);
        // A split: 25 on each.
        let both = vec![(n.uuids[0].clone(), 25), (n.uuids[1].clone(), 25)];
        let p = preferred_on(Kind::Core, &a, &[], 50, &both).unwrap();
        assert_eq!(gpus_of(&p).len(), 2);
        // Sizes that disagree, or a must-include elsewhere, are not honoured.
        assert_eq!(preferred_on(Kind::Core, &a, &[], 31, &want), None);
        let m = vec![a.iter().find(|d| d.uuid == n.uuids[0]).unwrap().clone()];
        assert_eq!(preferred_on(Kind::Core, &a, &m, 30, &want), None);
    }

    #[test]
    fn splits_without_the_scheduler_pick_fitting_gpus_preferring_the_other_resource() {
        let n = node(3);
        let a = avail(&n, Kind::Core, &[50, 0, 80]);
        // 30 each on two GPUs: GPU 2 has only 20 left; best fit is GPU 0 (50) then GPU 1.
        let s = split_gpus(&n, &a, 2, 30, &[]).unwrap();
        assert_eq!(s, vec![(n.uuids[0].clone(), 30), (n.uuids[1].clone(), 30)]);
        let s = split_gpus(&n, &a, 2, 20, &[n.uuids[1].clone(), n.uuids[2].clone()]).unwrap();
        assert_eq!(s, vec![(n.uuids[2].clone(), 20), (n.uuids[1].clone(), 20)]);
        assert_eq!(split_gpus(&n, &a, 3, 30, &[]), None);
    }

    proptest::proptest! {
        #[test]
        fn preferred_answers_are_sound(used in proptest::collection::vec(0usize..=100, 4), size in 1usize..=400, hint in proptest::option::of(0usize..4)) {
            let n = node(4);
            let a = avail(&n, Kind::Core, &used);
            let h = hint.map(|g| n.uuids[g].clone());
            let p = preferred(&n, Kind::Core, &a, &[], size, h.as_deref());
            proptest::prop_assert!(p.len() <= size);
            let mut seen = std::collections::HashSet::new();
            for id in &p {
                proptest::prop_assert!(a.contains(id), "{} was not offered", id);
                proptest::prop_assert!(seen.insert(id.clone()), "{} twice", id);
            }
            // A share that fits some GPU lands whole on one GPU.
            if size < 100 && used.iter().any(|&u| 100 - u >= size) {
                proptest::prop_assert_eq!(p.len(), size);
                proptest::prop_assert_eq!(gpus_of(&p).len(), 1);
            }
        }
    }
}
