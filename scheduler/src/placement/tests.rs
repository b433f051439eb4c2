use proptest::prelude::*;
use vcuda_cluster::{Allocated, GpuInventory, NodeInventory, PeerLink, Reservation, MEMORY_UNIT};

use super::*;

const GIB: u64 = 1 << 30;

/// A GPU: compute capability, memory (GiB), core used (%), memory used (GiB).
fn gpu(index: u32, cc: &str, mem_gib: u64, core: u32, used_gib: u64) -> GpuInventory {
    GpuInventory {
        index,
        uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
        model: format!("Model cc{cc}"),
        compute_capability: cc.to_string(),
        memory_bytes: mem_gib * GIB,
        numa_node: Some(index / 4),
        links: Vec::new(),
        healthy: true,
        allocated: Allocated {
            core_percent: core,
            memory_bytes: used_gib * GIB,
        },
        mode: None,
        slices_held: 0,
    }
}

/// Pairs (0,1), (2,3), … are linked by NVLink; halves share a NUMA node.
fn with_links(mut gpus: Vec<GpuInventory>) -> NodeInventory {
    let n = gpus.len() as u32;
    for g in &mut gpus {
        let a = g.index;
        g.links = (0..n)
            .filter(|&b| b != a)
            .map(|b| PeerLink {
                peer: b,
                link: if a / 2 == b / 2 {
                    Link::NvLink { lanes: 12 }
                } else if a / 4 == b / 4 {
                    Link::SameNumaNode
                } else {
                    Link::System
                },
            })
            .collect();
    }
    NodeInventory {
        schema: SCHEMA,
        gpus,
        pods: vec![],
        lease: None,
        modes: None,
    }
}

fn view(gpus: Vec<GpuInventory>) -> NodeView {
    NodeView::new(&with_links(gpus), &[])
}

fn share(name: &str, gpus: u32, percent: u32, mem_gib: u64) -> ContainerNeed {
    ContainerNeed {
        name: name.into(),
        need: Need::Shares {
            gpus,
            percent,
            memory_bytes: mem_gib * GIB,
        },
    }
}

fn whole(name: &str, gpus: u32) -> ContainerNeed {
    ContainerNeed {
        name: name.into(),
        need: Need::Whole {
            gpus,
            memory_bytes: 0,
        },
    }
}

fn pod(containers: Vec<ContainerNeed>) -> PodRequest {
    PodRequest {
        containers,
        ..PodRequest::default()
    }
}

fn gpus_of(c: &Choice) -> Vec<Vec<usize>> {
    c.containers.iter().map(|p| p.gpus.clone()).collect()
}

#[test]
fn counts_are_not_enough_two_gpus_at_60_cannot_run_70() {
    // the example: 80 free units on the node, but no GPU has 70 %
    let v = view(vec![gpu(0, "8.0", 40, 60, 10), gpu(1, "8.0", 40, 60, 10)]);
    let e = filter(&v, &pod(vec![share("train", 1, 70, 4)]), &Policy::default()).unwrap_err();
    assert_eq!(
        e,
        "container train needs 70 % and 4.0 GiB on one GPU; no GPU has both: GPU 0 (GPU-00000000) 40 % and 30.0 GiB free, GPU 1 (GPU-00000001) 40 % and 30.0 GiB free"
    );
    assert!(filter(&v, &pod(vec![share("train", 1, 40, 4)]), &Policy::default()).is_ok());
    // memory is checked as well as core
    let e = filter(&v, &pod(vec![share("m", 1, 10, 31)]), &Policy::default()).unwrap_err();
    assert!(e.contains("needs 10 % and 31.0 GiB"), "{e}");
}

#[test]
fn binpack_fills_a_used_gpu_first_and_spread_the_emptiest() {
    let v = view(vec![
        gpu(0, "8.0", 40, 0, 0),
        gpu(1, "8.0", 40, 50, 10),
        gpu(2, "8.0", 40, 80, 10),
        gpu(3, "8.0", 40, 30, 10),
    ]);
    let p = pod(vec![share("c", 1, 30, 4)]);
    let bin = filter(&v, &p, &Policy::default()).unwrap();
    assert_eq!(
        gpus_of(&bin),
        vec![vec![1]],
        "tightest fit: 50 free beats 70 and 100; 20 is too few"
    );
    let spread = Policy {
        strategy: Packing::Spread,
        ..Policy::default()
    };
    assert_eq!(gpus_of(&filter(&v, &p, &spread).unwrap()), vec![vec![0]]);
}

#[test]
fn shares_go_to_old_gpus_and_whole_jobs_to_new_ones() {
    let v = view(vec![
        gpu(0, "9.0", 40, 0, 0),
        gpu(1, "7.0", 40, 0, 0),
        gpu(2, "8.0", 40, 0, 0),
    ]);
    let p = Policy::default();
    assert_eq!(
        gpus_of(&filter(&v, &pod(vec![share("s", 1, 20, 2)]), &p).unwrap()),
        vec![vec![1]]
    );
    assert_eq!(
        gpus_of(&filter(&v, &pod(vec![whole("w", 1)]), &p).unwrap()),
        vec![vec![0]]
    );
    let off = Policy {
        prefer_old_for_fractional: false,
        ..p
    };
    assert_eq!(
        gpus_of(&filter(&v, &pod(vec![share("s", 1, 20, 2)]), &off).unwrap()),
        vec![vec![0]],
        "without the setting: lowest index"
    );
    // a used new GPU still beats starting an untouched old one (fill a GPU first)
    let v = view(vec![gpu(0, "9.0", 80, 50, 8), gpu(1, "7.0", 32, 0, 0)]);
    assert_eq!(
        gpus_of(&filter(&v, &pod(vec![share("s", 1, 20, 2)]), &p).unwrap()),
        vec![vec![0]]
    );
    // and across nodes, the old node scores higher for a share
    let old = view(vec![gpu(0, "7.0", 40, 0, 0)]);
    let new = view(vec![gpu(0, "9.0", 40, 0, 0)]);
    let s = pod(vec![share("s", 1, 20, 2)]);
    assert!(score_fine(&old, &s, &p) > score_fine(&new, &s, &p));
    let w = pod(vec![whole("w", 1)]);
    assert!(score_fine(&new, &w, &p) > score_fine(&old, &w, &p));
}

#[test]
fn whole_gpus_take_the_best_connected_free_set() {
    let v = view(vec![
        gpu(0, "8.0", 40, 0, 0),
        gpu(1, "8.0", 40, 10, 1),
        gpu(2, "8.0", 40, 0, 0),
        gpu(3, "8.0", 40, 0, 0),
        gpu(4, "8.0", 40, 0, 0),
        gpu(5, "8.0", 40, 0, 0),
        gpu(6, "8.0", 40, 0, 0),
        gpu(7, "8.0", 40, 0, 0),
    ]);
    let p = Policy::default();
    assert_eq!(
        gpus_of(&filter(&v, &pod(vec![whole("w", 2)]), &p).unwrap()),
        vec![vec![2, 3]]
    );
    assert_eq!(
        gpus_of(&filter(&v, &pod(vec![whole("w", 4)]), &p).unwrap()),
        vec![vec![4, 5, 6, 7]],
        "two NVLink pairs on one NUMA node"
    );
    let e = filter(&v, &pod(vec![whole("w", 8)]), &p).unwrap_err();
    assert!(
        e.contains("needs 8 whole GPU(s) (nothing else on them); 7 free"),
        "{e}"
    );
    // a strict rule: 3+ GPUs must all be on NVLink; no free triple is
    let strict = Policy {
        topology: TopologyRule {
            min_link: LinkClass::NvLink,
            from_gpus: 3,
        },
        ..p
    };
    let e = filter(&v, &pod(vec![whole("w", 3)]), &strict).unwrap_err();
    assert!(e.contains("no 3 of them are all linked by NvLink"), "{e}");
    assert!(
        filter(&v, &pod(vec![whole("w", 2)]), &strict).is_ok(),
        "2 GPUs: rule does not apply"
    );
    assert!(
        filter(&v, &pod(vec![whole("w", 3)]), &p).is_ok(),
        "default: allowed"
    );
    // memory asked with whole GPUs must fit in them
    let big = pod(vec![ContainerNeed {
        name: "w".into(),
        need: Need::Whole {
            gpus: 1,
            memory_bytes: 41 * GIB,
        },
    }]);
    let e = filter(&v, &big, &p).unwrap_err();
    assert!(
        e.contains("larger than any 1 free GPUs hold (40.0 GiB)"),
        "{e}"
    );
}

#[test]
fn gpu_count_puts_equal_shares_on_distinct_gpus() {
    let v = view(vec![
        gpu(0, "8.0", 40, 50, 5),
        gpu(1, "8.0", 40, 70, 5),
        gpu(2, "8.0", 40, 0, 0),
    ]);
    let c = filter(&v, &pod(vec![share("c", 2, 30, 4)]), &Policy::default()).unwrap();
    assert_eq!(
        gpus_of(&c),
        vec![vec![0, 1]],
        "the two used GPUs, not the free one"
    );
    let a = c.assignment(&v);
    let shares = &a.containers["c"];
    assert_eq!(shares.len(), 2);
    assert!(shares
        .iter()
        .all(|s| s.core_percent == 30 && s.memory_bytes == 4 * GIB));
    let e = filter(&v, &pod(vec![share("c", 3, 40, 4)]), &Policy::default()).unwrap_err();
    assert!(
        e.contains("needs 40 % and 4.0 GiB on each of 3 GPUs; only 2 GPU(s) have both"),
        "{e}"
    );
}

#[test]
fn reservations_and_health_count() {
    let inv = with_links(vec![gpu(0, "8.0", 40, 0, 0), gpu(1, "8.0", 40, 0, 0)]);
    let mut inv2 = inv.clone();
    inv2.gpus[1].healthy = false;
    let res = vec![Reservation {
        namespace: "ns".into(),
        name: "p".into(),
        uid: "u".into(),
        gpus: vec![GpuShare {
            uuid: inv.gpus[0].uuid.clone(),
            core_percent: 60,
            memory_bytes: 8 * GIB,
        }],
        created_unix_ms: 0,
    }];
    let v = NodeView::new(&inv2, &res);
    assert_eq!((v.gpus[0].core_used, v.gpus[0].memory_used), (60, 8 * GIB));
    let e = filter(&v, &pod(vec![share("c", 1, 50, 1)]), &Policy::default()).unwrap_err();
    assert!(
        e.contains("GPU 0 (GPU-00000000) 40 % and 32.0 GiB free, GPU 1 (GPU-00000001) unhealthy"),
        "{e}"
    );
    let e = filter(&v, &pod(vec![whole("w", 1)]), &Policy::default()).unwrap_err();
    assert!(
        e.contains("0 free"),
        "reserved is not free, unhealthy is not free: {e}"
    );
}

#[test]
fn containers_are_placed_together_and_init_containers_alone() {
    let v = view(vec![gpu(0, "8.0", 40, 0, 0)]);
    let p = Policy::default();
    // 60 + 60 do not fit together on one GPU
    let e = filter(
        &v,
        &pod(vec![share("a", 1, 60, 4), share("b", 1, 60, 4)]),
        &p,
    )
    .unwrap_err();
    assert!(
        e.starts_with("each container fits alone but not all together (container a needs 60 %"),
        "{e}"
    );
    // an init container taking the whole GPU, then a share: fine (it runs first)
    let mut req = pod(vec![share("app", 1, 60, 4)]);
    req.init_containers = vec![whole("init", 1)];
    let c = filter(&v, &req, &p).unwrap();
    assert_eq!(c.init_containers[0].gpus, vec![0]);
    let held = c.per_gpu(&v);
    assert_eq!(held.len(), 1);
    assert_eq!(
        (held[0].core_percent, held[0].memory_bytes),
        (100, 40 * GIB),
        "max of init and app"
    );
    let a = c.assignment(&v);
    assert_eq!(a.containers.keys().collect::<Vec<_>>(), vec!["app", "init"]);
    // an init container that cannot fit is named
    req.init_containers = vec![whole("init", 2)];
    let e = filter(&v, &req, &p).unwrap_err();
    assert!(
        e.starts_with("init container init needs 2 whole GPU(s)"),
        "{e}"
    );
    // whole + share on a 2-GPU node: the harder one is placed first, regardless of order
    let v2 = view(vec![gpu(0, "8.0", 40, 0, 0), gpu(1, "8.0", 40, 0, 0)]);
    let c = filter(&v2, &pod(vec![share("s", 1, 10, 1), whole("w", 1)]), &p).unwrap();
    assert_eq!(c.containers[0].name, "s", "pod order kept");
    assert_ne!(c.containers[0].gpus, c.containers[1].gpus);
}

#[test]
fn nothing_requested_passes_and_no_gpus_is_a_reason() {
    let empty = view(vec![]);
    assert!(filter(&empty, &PodRequest::default(), &Policy::default()).is_ok());
    let e = filter(&empty, &pod(vec![share("c", 1, 1, 1)]), &Policy::default()).unwrap_err();
    assert!(e.contains("lists no GPUs"), "{e}");
}

#[test]
fn node_views_come_from_annotations_with_reasons() {
    let mut ann = BTreeMap::new();
    let e = NodeView::from_annotations(&ann).unwrap_err();
    assert!(
        e.contains("no vcuda.io/gpus annotation") && e.contains("vcuda-manager"),
        "{e}"
    );
    ann.insert(INVENTORY_ANNOTATION.to_string(), "{".to_string());
    assert!(NodeView::from_annotations(&ann)
        .unwrap_err()
        .contains("not valid JSON"));
    let inv = with_links(vec![gpu(0, "8.0", 40, 10, 1)]);
    ann.insert(
        INVENTORY_ANNOTATION.to_string(),
        serde_json::to_string(&inv).unwrap(),
    );
    let res = Reservations {
        schema: SCHEMA,
        pods: vec![Reservation {
            namespace: "a".into(),
            name: "b".into(),
            uid: "c".into(),
            gpus: vec![GpuShare {
                uuid: inv.gpus[0].uuid.clone(),
                core_percent: 5,
                memory_bytes: MEMORY_UNIT,
            }],
            created_unix_ms: 1,
        }],
    };
    ann.insert(
        RESERVATIONS_ANNOTATION.to_string(),
        serde_json::to_string(&res).unwrap(),
    );
    let v = NodeView::from_annotations(&ann).unwrap();
    assert_eq!(v.gpus[0].core_used, 15);
    // the reservation was made at 1 ms: with a TTL of 10 s it still counts at 10 000 ms
    // and is ignored from 10 001 ms on
    let at = |now_ms| {
        NodeView::from_annotations_at(
            &ann,
            Expiry {
                now_ms,
                ttl_ms: 10_000,
            },
        )
        .unwrap()
        .gpus[0]
            .core_used
    };
    assert_eq!((at(10_000), at(10_001), at(0)), (15, 10, 15));
    let mut newer = inv.clone();
    newer.schema = SCHEMA + 1;
    ann.insert(
        INVENTORY_ANNOTATION.to_string(),
        serde_json::to_string(&newer).unwrap(),
    );
    assert!(NodeView::from_annotations(&ann)
        .unwrap_err()
        .contains("upgrade vcuda-scheduler"));
}

#[test]
fn binpack_completing_a_gpu_beats_a_fuller_node_and_scores_map_to_0_10() {
    // A: GPU 0 has exactly 30 free → the share completes it. B is fuller overall, but the
    // share must start its empty GPU. Filling a GPU comes first.
    let a = view(vec![gpu(0, "8.0", 40, 70, 36), gpu(1, "8.0", 40, 0, 0)]);
    let b = view(vec![gpu(0, "8.0", 40, 80, 36), gpu(1, "8.0", 40, 0, 0)]);
    let s = pod(vec![share("s", 1, 30, 4)]);
    let p = Policy::default();
    assert!(score_fine(&a, &s, &p) > score_fine(&b, &s, &p));
    let spread = Policy {
        strategy: Packing::Spread,
        ..p
    };
    assert_eq!(gpus_of(&filter(&a, &s, &spread).unwrap()), vec![vec![1]]);
    assert!(
        score_fine(&a, &s, &spread) > score_fine(&b, &s, &spread),
        "spread: both start GPU 1, A is the emptier node"
    );
    assert_eq!(
        score(&view(vec![gpu(0, "8.0", 40, 90, 1)]), &s, &p),
        0,
        "does not fit"
    );
    assert_eq!(
        (
            to_extender_score(0),
            to_extender_score(49),
            to_extender_score(50)
        ),
        (0, 0, 1)
    );
    assert_eq!(
        (
            to_extender_score(1000),
            to_extender_score(2000),
            to_extender_score(-3)
        ),
        (10, 10, 0)
    );
}

// ---- properties -------------------------------------------------------------------------

fn arb_gpu(index: u32) -> impl Strategy<Value = GpuInventory> {
    (
        prop::sample::select(vec!["7.0", "8.0", "9.0"]),
        prop::sample::select(vec![16u64, 40]),
        prop::sample::select(vec![0u32, 0, 10, 30, 50, 70, 90, 100]),
        0u64..=16,
        prop::bool::weighted(0.9),
    )
        .prop_map(move |(cc, mem, core, used, healthy)| {
            let mut g = gpu(
                index,
                cc,
                mem,
                core,
                if core == 0 { 0 } else { used.min(mem) },
            );
            g.healthy = healthy;
            g
        })
}

fn arb_node() -> impl Strategy<Value = NodeView> {
    (1usize..=4)
        .prop_flat_map(|n| (0..n as u32).map(arb_gpu).collect::<Vec<_>>())
        .prop_map(view)
}

fn arb_need() -> impl Strategy<Value = Need> {
    prop_oneof![
        (
            1u32..=2,
            prop::sample::select(vec![10u32, 20, 30, 50, 70, 90]),
            1u64..=12
        )
            .prop_map(|(gpus, percent, mem)| Need::Shares {
                gpus,
                percent,
                memory_bytes: mem * GIB,
            }),
        (1u32..=2, prop::sample::select(vec![0u64, 20, 48])).prop_map(|(gpus, mem)| Need::Whole {
            gpus,
            memory_bytes: mem * GIB,
        }),
    ]
}

fn arb_pod() -> impl Strategy<Value = PodRequest> {
    (
        prop::collection::vec(arb_need(), 1..=3),
        prop::option::weighted(0.3, arb_need()),
    )
        .prop_map(|(apps, init)| PodRequest {
            containers: apps
                .into_iter()
                .enumerate()
                .map(|(i, need)| ContainerNeed {
                    name: format!("c{i}"),
                    need,
                })
                .collect(),
            init_containers: init
                .into_iter()
                .map(|need| ContainerNeed {
                    name: "init".into(),
                    need,
                })
                .collect(),
            device_resource: None,
        })
}

fn arb_policy() -> impl Strategy<Value = Policy> {
    (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(spread, old, strict)| Policy {
        strategy: if spread {
            Packing::Spread
        } else {
            Packing::Binpack
        },
        prefer_old_for_fractional: old,
        topology: TopologyRule {
            min_link: if strict {
                LinkClass::NvLink
            } else {
                LinkClass::System
            },
            from_gpus: 2,
        },
        ..Policy::default()
    })
}

/// Independent check of one placed set of containers against the node: the rules written
/// out again, by hand.
fn check_placement(v: &NodeView, placed: &[Placed], policy: &Policy) -> Result<(), String> {
    let n = v.gpus.len();
    let mut core: Vec<u64> = v.gpus.iter().map(|g| u64::from(g.core_used)).collect();
    let mut mem: Vec<u64> = v.gpus.iter().map(|g| g.memory_used).collect();
    for p in placed {
        let mut s = p.gpus.clone();
        s.sort_unstable();
        s.dedup();
        if s.len() != p.gpus.len() || s.len() != p.need.gpus() as usize || s.iter().any(|&g| g >= n)
        {
            return Err(format!("{}: bad GPU set {:?}", p.name, p.gpus));
        }
        for &g in &s {
            if !v.gpus[g].healthy {
                return Err(format!("{}: unhealthy GPU {g}", p.name));
            }
        }
        match p.need {
            Need::Shares {
                percent,
                memory_bytes,
                ..
            } => {
                for &g in &s {
                    core[g] += u64::from(percent);
                    mem[g] += memory_bytes;
                }
            }
            Need::Whole { gpus, memory_bytes } => {
                let total: u64 = s.iter().map(|&g| v.gpus[g].memory_bytes).sum();
                if total < memory_bytes {
                    return Err(format!("{}: memory", p.name));
                }
                if gpus >= policy.topology.from_gpus {
                    for (i, &a) in s.iter().enumerate() {
                        for &b in &s[i + 1..] {
                            if v.links[a][b].class() < policy.topology.min_link {
                                return Err(format!("{}: topology", p.name));
                            }
                        }
                    }
                }
                for &g in &s {
                    if core[g] != 0 || mem[g] != 0 {
                        return Err(format!("{}: GPU {g} not free for a whole job", p.name));
                    }
                    core[g] = 100;
                    mem[g] = v.gpus[g].memory_bytes;
                }
            }
            Need::Exclusive { .. } | Need::Slices { .. } => {
                return Err(format!("{}: a device need in the shares search", p.name))
            }
        }
    }
    for g in 0..n {
        let touched = placed.iter().any(|p| p.gpus.contains(&g));
        if touched && (core[g] > 100 || mem[g] > v.gpus[g].memory_bytes) {
            return Err(format!(
                "GPU {g} over-committed: {} %, {} of {} bytes",
                core[g], mem[g], v.gpus[g].memory_bytes
            ));
        }
    }
    Ok(())
}

/// Brute force: does any assignment of GPU subsets to the containers pass `check_placement`?
fn brute_force(v: &NodeView, needs: &[ContainerNeed], policy: &Policy) -> bool {
    let n = v.gpus.len();
    let subsets: Vec<Vec<usize>> = (1u32..(1 << n))
        .map(|m| (0..n).filter(|&g| m & (1 << g) != 0).collect())
        .collect();
    fn go(
        v: &NodeView,
        needs: &[ContainerNeed],
        subsets: &[Vec<usize>],
        acc: &mut Vec<Placed>,
        policy: &Policy,
    ) -> bool {
        if acc.len() == needs.len() {
            return check_placement(v, acc, policy).is_ok();
        }
        let c = &needs[acc.len()];
        for s in subsets.iter().filter(|s| s.len() == c.need.gpus() as usize) {
            acc.push(Placed {
                name: c.name.clone(),
                gpus: s.clone(),
                need: c.need,
            });
            if go(v, needs, subsets, acc, policy) {
                return true;
            }
            acc.pop();
        }
        false
    }
    go(v, needs, &subsets, &mut Vec::new(), policy)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_passing_choice_never_over_commits(v in arb_node(), req in arb_pod(), policy in arb_policy()) {
        if let Ok(c) = filter(&v, &req, &policy) {
            prop_assert_eq!(c.containers.len(), req.containers.len());
            prop_assert!(check_placement(&v, &c.containers, &policy).is_ok(), "{:?}", check_placement(&v, &c.containers, &policy));
            for p in &c.init_containers {
                prop_assert!(check_placement(&v, std::slice::from_ref(p), &policy).is_ok());
            }
        }
    }

    #[test]
    fn filter_passes_iff_brute_force_finds_a_placement(v in arb_node(), req in arb_pod(), policy in arb_policy()) {
        let exists = brute_force(&v, &req.containers, &policy)
            && req.init_containers.iter().all(|c| brute_force(&v, std::slice::from_ref(c), &policy));
        let got = filter(&v, &req, &policy);
        prop_assert_eq!(got.is_ok(), exists, "{:?}", got);
        if let Err(reason) = got {
            prop_assert!(reason.contains("container"), "the reason names a container: {}", reason);
        }
    }

    #[test]
    fn scores_are_in_range(v in arb_node(), req in arb_pod(), policy in arb_policy()) {
        let s = score(&v, &req, &policy);
        prop_assert!((MIN_SCORE..=MAX_SCORE).contains(&s));
        if let Some(f) = score_fine(&v, &req, &policy) {
            prop_assert!((0..=1000).contains(&f));
            prop_assert_eq!(s, to_extender_score(f));
        }
    }

    #[test]
    fn binpack_prefers_the_fuller_node_spread_the_emptier(
        v in arb_node(),
        req in arb_pod(),
        extra in prop::collection::vec((0u32..=40, 0u64..=8), 4),
        old in any::<bool>(),
    ) {
        // B = A with more allocated; where the pod lands on the same GPUs in both, binpack
        // rates B at least as high and spread at most as high.
        let mut fuller = v.clone();
        for (g, (c, m)) in fuller.gpus.iter_mut().zip(&extra) {
            g.core_used += c;
            g.memory_used += m * GIB;
        }
        for strategy in [Packing::Binpack, Packing::Spread] {
            let p = Policy { strategy, prefer_old_for_fractional: old, ..Policy::default() };
            if let (Ok(ca), Ok(cb)) = (filter(&v, &req, &p), filter(&fuller, &req, &p)) {
                if gpus_of(&ca) == gpus_of(&cb) {
                    let (sa, sb) = (score_choice(&v, &ca, &p), score_choice(&fuller, &cb, &p));
                    match strategy {
                        Packing::Binpack => prop_assert!(sb >= sa, "binpack {} < {}", sb, sa),
                        Packing::Spread => prop_assert!(sb <= sa, "spread {} > {}", sb, sa),
                    }
                }
            }
        }
    }
}

const MIN_SCORE: i64 = crate::extender::MIN_EXTENDER_PRIORITY;
const MAX_SCORE: i64 = crate::extender::MAX_EXTENDER_PRIORITY;
