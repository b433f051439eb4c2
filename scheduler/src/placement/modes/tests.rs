use proptest::prelude::*;
use vcuda_cluster::{Allocated, GpuInventory, NodeInventory, NodeModes, Reservation, SCHEMA};

use super::super::{filter, score, score_fine, to_extender_score};
use super::*;

const GIB: u64 = 1 << 30;
const SGPU: &str = "tencent.com/sgpu";
const WHOLE: &str = "nvidia.com/gpu";

/// A GPU: compute capability, its lock and slices held, core % allocated.
fn gpu(index: u32, cc: &str, mode: Option<GpuMode>, held: u32, core: u32) -> GpuInventory {
    GpuInventory {
        index,
        uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
        model: format!("Model cc{cc}"),
        compute_capability: cc.to_string(),
        memory_bytes: 16 * GIB,
        numa_node: None,
        links: Vec::new(),
        healthy: true,
        allocated: Allocated {
            core_percent: core,
            memory_bytes: if core > 0 { GIB } else { 0 },
        },
        mode,
        slices_held: held,
    }
}

fn all_modes(k: u32) -> NodeModes {
    NodeModes {
        enabled: vec![GpuMode::Whole, GpuMode::Slice, GpuMode::Shared],
        slices: k,
        whole_resource: WHOLE.into(),
        slice_resource: SGPU.into(),
    }
}

fn node(gpus: Vec<GpuInventory>, modes: Option<NodeModes>) -> NodeView {
    NodeView::new(
        &NodeInventory {
            schema: SCHEMA,
            gpus,
            pods: vec![],
            lease: None,
            modes,
        },
        &[],
    )
}

fn c(name: &str, need: Need) -> ContainerNeed {
    ContainerNeed {
        name: name.into(),
        need,
    }
}

fn slices(n: &[u32]) -> PodRequest {
    PodRequest {
        containers: n
            .iter()
            .enumerate()
            .map(|(i, &gpus)| c(&format!("c{i}"), Need::Slices { gpus }))
            .collect(),
        init_containers: vec![],
        device_resource: Some(SGPU.into()),
    }
}

fn whole(n: &[u32]) -> PodRequest {
    PodRequest {
        containers: n
            .iter()
            .enumerate()
            .map(|(i, &gpus)| c(&format!("c{i}"), Need::Exclusive { gpus }))
            .collect(),
        init_containers: vec![],
        device_resource: Some(WHOLE.into()),
    }
}

fn share(percent: u32) -> PodRequest {
    PodRequest {
        containers: vec![c(
            "s",
            Need::Shares {
                gpus: 1,
                percent,
                memory_bytes: GIB,
            },
        )],
        ..PodRequest::default()
    }
}

fn gpus_of(ch: &Choice) -> Vec<Vec<usize>> {
    ch.containers.iter().map(|p| p.gpus.clone()).collect()
}

fn four(k: u32) -> NodeView {
    node(
        (0..4).map(|i| gpu(i, "7.5", None, 0, 0)).collect(),
        Some(all_modes(k)),
    )
}

#[test]
fn the_seeds_worked_example_filters_as_the_capacities_say() {
    let p = Policy::default();
    // 4 GPUs, K = 2: sgpu: 2 takes two GPUs
    let ch = filter(&four(2), &slices(&[2]), &p).unwrap();
    assert_eq!(gpus_of(&ch), vec![vec![0, 1]]);
    // GPUs 0, 1 locked to slices (one held each), GPU 2 to shares: one whole GPU is left
    let v = node(
        vec![
            gpu(0, "7.5", Some(GpuMode::Slice), 1, 0),
            gpu(1, "7.5", Some(GpuMode::Slice), 1, 0),
            gpu(2, "7.5", Some(GpuMode::Shared), 0, 20),
            gpu(3, "7.5", None, 0, 0),
        ],
        Some(all_modes(2)),
    );
    assert_eq!(
        gpus_of(&filter(&v, &whole(&[1]), &p).unwrap()),
        vec![vec![3]]
    );
    let e = filter(&v, &whole(&[2]), &p).unwrap_err();
    assert!(e.contains("only 1 of them free, 2 needed"), "{e}");
    assert!(
        e.contains("GPU 0 (GPU-00000000) locked to slice mode"),
        "{e}"
    );
    assert!(
        e.contains("GPU 2 (GPU-00000002) locked to shared mode"),
        "{e}"
    );
    assert!(e.contains("GPU 3 (GPU-00000003) free"), "{e}");
    // 凑整: the next sgpu: 2 fills the half-held GPUs rather than opening GPU 3
    assert_eq!(
        gpus_of(&filter(&v, &slices(&[2]), &p).unwrap()),
        vec![vec![0, 1]]
    );
    // sgpu: 3 needs three GPUs with a free slice: 0, 1 and 3
    assert_eq!(
        gpus_of(&filter(&v, &slices(&[3]), &p).unwrap()),
        vec![vec![0, 1, 3]]
    );
    assert!(filter(&v, &slices(&[4]), &p).is_err());
    // shares never go onto the slice-locked GPUs: 90 % opens GPU 3, 80 % joins GPU 2
    assert_eq!(gpus_of(&filter(&v, &share(90), &p).unwrap()), vec![vec![3]]);
    assert_eq!(gpus_of(&filter(&v, &share(80), &p).unwrap()), vec![vec![2]]);
    let mut three = v.clone();
    three.gpus.pop();
    let e = filter(&three, &share(90), &p).unwrap_err();
    assert!(
        e.contains("GPU 0 (GPU-00000000) locked to slice mode"),
        "{e}"
    );
}

#[test]
fn both_free_slices_on_one_gpu_is_refused_with_that_reason() {
    let v = node(
        vec![
            gpu(0, "7.5", None, 0, 0),
            gpu(1, "7.5", Some(GpuMode::Whole), 0, 0),
        ],
        Some(all_modes(2)),
    );
    let e = filter(&v, &slices(&[2]), &Policy::default()).unwrap_err();
    assert_eq!(
        e,
        "container c0 needs 2 slices on 2 different GPUs; both free slices are on one GPU, and a container's slices must be on different GPUs: GPU 0 (GPU-00000000) unlocked, 2 of 2 slices free, GPU 1 (GPU-00000001) locked to whole mode"
    );
    // one slice fits
    assert!(filter(&v, &slices(&[1]), &Policy::default()).is_ok());
    // and two containers of one slice each may share the GPU
    assert_eq!(
        gpus_of(&filter(&v, &slices(&[1, 1]), &Policy::default()).unwrap()),
        vec![vec![0], vec![0]]
    );
}

#[test]
fn whole_gpus_need_unlocked_untouched_healthy_gpus() {
    let mut sick = gpu(3, "9.0", None, 0, 0);
    sick.healthy = false;
    let v = node(
        vec![
            gpu(0, "8.0", Some(GpuMode::Slice), 1, 0),
            gpu(1, "8.0", Some(GpuMode::Shared), 0, 10),
            gpu(2, "8.0", Some(GpuMode::Whole), 0, 0),
            sick,
        ],
        Some(all_modes(2)),
    );
    let e = filter(&v, &whole(&[1]), &Policy::default()).unwrap_err();
    assert!(
        e.starts_with("container c0 needs 1 whole GPU(s) of whole mode (unlocked, nothing on them); no GPU is free (every one is locked to a mode, in use or unhealthy): "),
        "{e}"
    );
    assert!(e.contains("GPU 3 (GPU-00000003) unhealthy"), "{e}");
}

#[test]
fn a_reserved_share_makes_an_unlocked_gpu_shared() {
    let inv = NodeInventory {
        schema: SCHEMA,
        gpus: vec![gpu(0, "7.5", None, 0, 0), gpu(1, "7.5", None, 0, 0)],
        pods: vec![],
        lease: None,
        modes: Some(all_modes(2)),
    };
    let r = Reservation {
        namespace: "ns".into(),
        name: "p".into(),
        uid: "u".into(),
        gpus: vec![vcuda_cluster::GpuShare {
            uuid: inv.gpus[0].uuid.clone(),
            core_percent: 30,
            memory_bytes: GIB,
        }],
        created_unix_ms: 0,
    };
    let v = NodeView::new(&inv, &[r]);
    let e = filter(&v, &whole(&[2]), &Policy::default()).unwrap_err();
    assert!(
        e.contains("GPU 0 (GPU-00000000) in use by shares (30 % and 1.0 GiB committed)"),
        "{e}"
    );
    assert!(filter(&v, &slices(&[2]), &Policy::default()).is_err());
    assert_eq!(
        gpus_of(&filter(&v, &slices(&[1]), &Policy::default()).unwrap()),
        vec![vec![1]]
    );
}

#[test]
fn nodes_must_serve_the_mode_under_the_pods_name() {
    let p = Policy::default();
    // no modes: shared only (an older manager)
    let old = node(vec![gpu(0, "7.5", None, 0, 0)], None);
    let e = filter(&old, &whole(&[1]), &p).unwrap_err();
    assert!(
        e.contains("asks for whole GPUs (nvidia.com/gpu), but the node's vcuda-manager serves shared mode only"),
        "{e}"
    );
    assert!(filter(&old, &slices(&[1]), &p)
        .unwrap_err()
        .contains("slices (tencent.com/sgpu)"));
    assert!(filter(&old, &share(10), &p).is_ok());
    // modes without slices
    let mut m = all_modes(2);
    m.enabled = vec![GpuMode::Whole, GpuMode::Shared];
    let v = node(vec![gpu(0, "7.5", None, 0, 0)], Some(m.clone()));
    let e = filter(&v, &slices(&[1]), &p).unwrap_err();
    assert!(
        e.contains("the node serves whole and shared mode only; enable slice mode"),
        "{e}"
    );
    assert!(filter(&v, &whole(&[1]), &p).is_ok());
    // modes without shares
    m.enabled = vec![GpuMode::Whole];
    let v = node(vec![gpu(0, "7.5", None, 0, 0)], Some(m.clone()));
    assert!(filter(&v, &share(10), &p)
        .unwrap_err()
        .contains("enable shared mode"));
    // another name for whole GPUs
    m.enabled = vec![GpuMode::Whole];
    m.whole_resource = "example.com/gpu".into();
    let v = node(vec![gpu(0, "7.5", None, 0, 0)], Some(m));
    let e = filter(&v, &whole(&[1]), &p).unwrap_err();
    assert!(
        e.contains("asks for nvidia.com/gpu, but the node serves whole mode as example.com/gpu"),
        "{e}"
    );
}

#[test]
fn device_containers_get_no_reservation_nor_assignment() {
    let v = four(2);
    let mut req = slices(&[2]);
    req.init_containers = vec![c("init", Need::Slices { gpus: 1 })];
    let ch = filter(&v, &req, &Policy::default()).unwrap();
    assert!(ch.per_gpu(&v).is_empty());
    assert!(ch.assignment(&v).containers.is_empty());
    let ch = filter(&v, &whole(&[2]), &Policy::default()).unwrap();
    assert!(ch.per_gpu(&v).is_empty());
    assert!(ch.assignment(&v).containers.is_empty());
}

#[test]
fn a_whole_gpu_pod_alone_passes_nodes_without_vcuda() {
    assert!(foreign_node_passes(&whole(&[1])));
    assert!(!foreign_node_passes(&slices(&[1])));
    assert!(!foreign_node_passes(&share(10)));
    assert!(!foreign_node_passes(&PodRequest::default()));
}

#[test]
fn slices_prefer_old_gpus_and_nodes_running_slices_whole_the_newest() {
    let p = Policy::default();
    let old = node(
        (0..2).map(|i| gpu(i, "7.0", None, 0, 0)).collect(),
        Some(all_modes(2)),
    );
    let new = node(
        (0..2).map(|i| gpu(i, "9.0", None, 0, 0)).collect(),
        Some(all_modes(2)),
    );
    assert!(score(&old, &slices(&[1]), &p) > score(&new, &slices(&[1]), &p));
    assert!(score(&new, &whole(&[1]), &p) > score(&old, &whole(&[1]), &p));
    // within a node: slices to the oldest GPU, whole GPUs to the newest
    let mixed = node(
        vec![gpu(0, "9.0", None, 0, 0), gpu(1, "7.0", None, 0, 0)],
        Some(all_modes(2)),
    );
    assert_eq!(
        gpus_of(&filter(&mixed, &slices(&[1]), &p).unwrap()),
        vec![vec![1]]
    );
    assert_eq!(
        gpus_of(&filter(&mixed, &whole(&[1]), &p).unwrap()),
        vec![vec![0]]
    );
    // same generation: the node already running slices wins (and the half-held GPU is
    // filled: 凑整)
    let runs = node(
        vec![
            gpu(0, "7.5", None, 0, 0),
            gpu(1, "7.5", Some(GpuMode::Slice), 1, 0),
        ],
        Some(all_modes(2)),
    );
    let fresh = node(
        (0..2).map(|i| gpu(i, "7.5", None, 0, 0)).collect(),
        Some(all_modes(2)),
    );
    assert_eq!(
        gpus_of(&filter(&runs, &slices(&[1]), &p).unwrap()),
        vec![vec![1]]
    );
    assert!(score(&runs, &slices(&[1]), &p) > score(&fresh, &slices(&[1]), &p));
    // with spread, the fresh node wins
    let spread = Policy {
        strategy: Packing::Spread,
        ..p
    };
    assert!(score(&runs, &slices(&[1]), &spread) < score(&fresh, &slices(&[1]), &spread));
    // whole GPUs: the fuller node first (binpack), same generation
    let busy = node(
        vec![
            gpu(0, "8.0", None, 0, 0),
            gpu(1, "8.0", Some(GpuMode::Shared), 0, 50),
        ],
        Some(all_modes(2)),
    );
    let idle = node(
        (0..2).map(|i| gpu(i, "8.0", None, 0, 0)).collect(),
        Some(all_modes(2)),
    );
    assert!(score(&busy, &whole(&[1]), &p) > score(&idle, &whole(&[1]), &p));
}

// ---- properties -------------------------------------------------------------------------

fn arb_gpu(index: u32, k: u32) -> impl Strategy<Value = GpuInventory> {
    (
        prop::sample::select(vec!["6.1", "7.5", "8.0", "9.0"]),
        0u8..6,
        1..=k,
        prop::bool::weighted(0.9),
    )
        .prop_map(move |(cc, state, held, healthy)| {
            let mut g = match state {
                0 | 1 => gpu(index, cc, None, 0, 0),
                2 => gpu(index, cc, Some(GpuMode::Whole), 0, 0),
                3 => gpu(index, cc, Some(GpuMode::Slice), held, 0),
                4 => gpu(index, cc, Some(GpuMode::Shared), 0, 30),
                // an unlocked GPU with a share on it (a manager before modes)
                _ => gpu(index, cc, None, 0, 30),
            };
            g.healthy = healthy;
            g
        })
}

fn arb_node() -> impl Strategy<Value = NodeView> {
    (1usize..=5, 2u32..=4)
        .prop_flat_map(|(n, k)| {
            (
                (0..n as u32).map(|i| arb_gpu(i, k)).collect::<Vec<_>>(),
                Just(k),
            )
        })
        .prop_map(|(gpus, k)| node(gpus, Some(all_modes(k))))
}

fn arb_req() -> impl Strategy<Value = PodRequest> {
    (
        any::<bool>(),
        prop::collection::vec(1u32..=4, 1..=3),
        prop::option::weighted(0.3, 1u32..=3),
    )
        .prop_map(|(is_slice, apps, init)| {
            let mut r = if is_slice {
                slices(&apps)
            } else {
                whole(&apps)
            };
            let need = |gpus| {
                if is_slice {
                    Need::Slices { gpus }
                } else {
                    Need::Exclusive { gpus }
                }
            };
            r.init_containers = init.into_iter().map(|n| c("init", need(n))).collect();
            r
        })
}

fn arb_policy() -> impl Strategy<Value = Policy> {
    (any::<bool>(), any::<bool>()).prop_map(|(spread, old)| Policy {
        strategy: if spread {
            Packing::Spread
        } else {
            Packing::Binpack
        },
        prefer_old_for_fractional: old,
        ..Policy::default()
    })
}

/// The GPUs a container of `mode` may use, written out again by hand from the inventory.
fn eligible(v: &NodeView, g: usize, mode: GpuMode) -> u32 {
    let gpu = &v.gpus[g];
    let k = v.modes.as_ref().unwrap().slices;
    let untouched = gpu.core_used == 0 && gpu.memory_used == 0 && gpu.slices_held == 0;
    if !gpu.healthy {
        return 0;
    }
    match (mode, gpu.mode) {
        (GpuMode::Whole, None) if untouched => 1,
        (GpuMode::Slice, None) if untouched => k,
        (GpuMode::Slice, Some(GpuMode::Slice)) => k.saturating_sub(gpu.slices_held),
        _ => 0,
    }
}

/// Brute force: can every container of `needs` get its distinct GPUs, no GPU giving more
/// than it has?
fn brute_force(v: &NodeView, needs: &[ContainerNeed], mode: GpuMode) -> bool {
    let n = v.gpus.len();
    let caps: Vec<u32> = (0..n).map(|g| eligible(v, g, mode)).collect();
    fn go(caps: &mut [u32], needs: &[ContainerNeed], n: usize) -> bool {
        let Some((first, rest)) = needs.split_first() else {
            return true;
        };
        for m in 1u32..(1 << n) {
            if m.count_ones() != first.need.gpus() {
                continue;
            }
            let set: Vec<usize> = (0..n).filter(|&g| m & (1 << g) != 0).collect();
            if set.iter().any(|&g| caps[g] == 0) {
                continue;
            }
            for &g in &set {
                caps[g] -= 1;
            }
            let ok = go(caps, rest, n);
            for &g in &set {
                caps[g] += 1;
            }
            if ok {
                return true;
            }
        }
        false
    }
    go(&mut caps.clone(), needs, n)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn never_admits_sgpu_n_onto_fewer_than_n_eligible_gpus(v in arb_node(), n in 1u32..=5, policy in arb_policy()) {
        let eligible_gpus = (0..v.gpus.len()).filter(|&g| eligible(&v, g, GpuMode::Slice) > 0).count();
        let got = filter(&v, &slices(&[n]), &policy);
        prop_assert_eq!(got.is_ok(), eligible_gpus >= n as usize, "{:?}", got);
    }

    #[test]
    fn filter_passes_iff_brute_force_finds_a_placement(v in arb_node(), req in arb_req(), policy in arb_policy()) {
        let mode = req.mode().unwrap();
        let exists = brute_force(&v, &req.containers, mode)
            && req.init_containers.iter().all(|c| brute_force(&v, std::slice::from_ref(c), mode));
        let got = filter(&v, &req, &policy);
        prop_assert_eq!(got.is_ok(), exists, "{:?}", got);
        match got {
            Ok(ch) => {
                // the witness: distinct GPUs per container, no GPU over its capacity
                let mut left: Vec<u32> = (0..v.gpus.len()).map(|g| eligible(&v, g, mode)).collect();
                for p in &ch.containers {
                    let mut s = p.gpus.clone();
                    s.dedup();
                    prop_assert_eq!(s.len(), p.need.gpus() as usize);
                    for &g in &s {
                        prop_assert!(left[g] > 0, "GPU {} over its capacity", g);
                        left[g] -= 1;
                    }
                }
            }
            Err(reason) => prop_assert!(reason.contains("container"), "{}", reason),
        }
    }

    #[test]
    fn device_scores_are_in_range(v in arb_node(), req in arb_req(), policy in arb_policy()) {
        let s = score(&v, &req, &policy);
        prop_assert!((0..=10).contains(&s));
        if let Some(f) = score_fine(&v, &req, &policy) {
            prop_assert!((0..=1000).contains(&f));
            prop_assert_eq!(s, to_extender_score(f));
        }
    }

    #[test]
    fn shares_never_use_a_gpu_locked_to_another_mode(v in arb_node(), percent in 1u32..=99, policy in arb_policy()) {
        if let Ok(ch) = filter(&v, &share(percent), &policy) {
            for &g in &ch.containers[0].gpus {
                prop_assert!(matches!(v.gpus[g].mode, None | Some(GpuMode::Shared)));
            }
        }
    }
}
