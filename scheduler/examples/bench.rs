//! Filter + prioritize over a whole cluster, per pod: 1000 nodes × 8 GPUs (default) with
//! varied models, topologies and allocations, a few hundred random pods (shares, gpu-count
//! splits, whole GPUs, two-container pods). Node views are built once, as the extender's
//! node cache would; each pod's call parses its request, filters every node (reasons
//! included) and scores the nodes that passed (placing again, as a separate prioritize call
//! does). Target (issue 7): p99 ≤ 5 ms per call.
//!
//! Usage: cargo run --release -p vcuda-scheduler --example bench -- [nodes] [gpus] [pods]

use std::time::{Duration, Instant};

use vcuda_cluster::{
    Allocated, GpuInventory, GpuShare, Link, NodeInventory, PeerLink, Reservation, MEMORY_UNIT,
    SCHEMA,
};
use vcuda_scheduler::extender::Pod;
use vcuda_scheduler::placement::{filter, score, NodeView, Policy};
use vcuda_scheduler::request::{container, pod_request, DEFAULT_DOMAIN};

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const GIB: u64 = 1 << 30;

fn node(rng: &mut Rng, id: usize, gpus: u32) -> NodeView {
    let (model, cc, mem_gib, nvswitch) = match rng.below(10) {
        0..=3 => ("NVIDIA A100-SXM4-80GB", "8.0", 80, false),
        4..=6 => ("Tesla V100-SXM2-32GB", "7.0", 32, false),
        7..=8 => ("NVIDIA H100 80GB HBM3", "9.0", 80, true),
        _ => ("Tesla T4", "7.5", 16, false),
    };
    let mut inv = NodeInventory {
        schema: SCHEMA,
        gpus: Vec::new(),
        pods: Vec::new(),
        lease: None,
        modes: None,
    };
    for i in 0..gpus {
        let mem = mem_gib * GIB;
        let (core, used) = match rng.below(10) {
            0..=2 => (0, 0),
            3..=4 => (100, mem),
            _ => {
                let core = 10 + 10 * rng.below(9) as u32;
                (
                    core,
                    mem * u64::from(core) / 100 / MEMORY_UNIT * MEMORY_UNIT,
                )
            }
        };
        let links = (0..gpus)
            .filter(|&b| b != i)
            .map(|b| PeerLink {
                peer: b,
                link: if nvswitch || i / 2 == b / 2 {
                    Link::NvLink { lanes: 12 }
                } else if i / 4 == b / 4 {
                    Link::SameHostBridge
                } else {
                    Link::System
                },
            })
            .collect();
        inv.gpus.push(GpuInventory {
            index: i,
            uuid: format!("GPU-{id:08x}-{i:04x}-0000-0000-000000000000"),
            model: model.to_string(),
            compute_capability: cc.to_string(),
            memory_bytes: mem,
            numa_node: Some(i * 2 / gpus),
            links,
            healthy: rng.below(100) != 0,
            allocated: Allocated {
                core_percent: core,
                memory_bytes: used,
            },
            mode: None,
            slices_held: 0,
        });
    }
    // one node in ten has a bind in flight
    let mut res = Vec::new();
    if rng.below(10) == 0 {
        let g = &inv.gpus[rng.below(u64::from(gpus)) as usize];
        res.push(Reservation {
            namespace: "ns".into(),
            name: format!("p{id}"),
            uid: format!("u{id}"),
            gpus: vec![GpuShare {
                uuid: g.uuid.clone(),
                core_percent: 20,
                memory_bytes: 4 * GIB,
            }],
            created_unix_ms: 0,
        });
    }
    NodeView::new(&inv, &res)
}

fn pod(rng: &mut Rng) -> Pod {
    const CORE: &str = "tencent.com/vcuda-core";
    const MEM: &str = "tencent.com/vcuda-memory";
    let mut p = Pod::default();
    p.metadata.name = "bench".into();
    let share = |rng: &mut Rng, name: &str| {
        let core = (5 + 5 * rng.below(19)).to_string();
        let mem = (4 + rng.below(60)).to_string();
        container(name, &[(CORE, &core), (MEM, &mem)])
    };
    match rng.below(20) {
        0..=9 => p.spec.containers.push(share(rng, "main")),
        10..=12 => {
            let n = 2 + rng.below(3);
            let core = (n * (10 + 10 * rng.below(8))).to_string();
            let mem = (n * (4 + rng.below(28))).to_string();
            p.metadata
                .annotations
                .insert(vcuda_cluster::GPU_COUNT_ANNOTATION.into(), n.to_string());
            p.spec
                .containers
                .push(container("main", &[(CORE, &core), (MEM, &mem)]));
        }
        13..=17 => {
            let n = [1, 1, 2, 4, 8][rng.below(5) as usize];
            p.spec
                .containers
                .push(container("main", &[(CORE, &(n * 100).to_string())]));
        }
        _ => {
            p.spec.containers.push(share(rng, "main"));
            p.spec.containers.push(share(rng, "sidecar"));
        }
    }
    p
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse().unwrap_or_else(|_| {
                panic!("argument {a:?} is not a number; usage: bench [nodes] [gpus] [pods]")
            })
        })
        .collect();
    let nodes = args.first().copied().unwrap_or(1000);
    let gpus = args.get(1).copied().unwrap_or(8) as u32;
    let pods = args.get(2).copied().unwrap_or(300);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let cluster: Vec<NodeView> = (0..nodes).map(|i| node(&mut rng, i, gpus)).collect();
    let policy = Policy::default();
    let reqs: Vec<Pod> = (0..pods).map(|_| pod(&mut rng)).collect();

    let mut filter_t = Vec::new();
    let mut prio_t = Vec::new();
    let mut total_t = Vec::new();
    let mut passed_total = 0usize;
    let mut checksum = 0i64;
    for (round, p) in reqs.iter().enumerate() {
        let t0 = Instant::now();
        let req = pod_request(p, DEFAULT_DOMAIN).expect("bench pods are valid");
        let mut passed = Vec::with_capacity(nodes);
        let mut reasons = 0usize;
        for (i, n) in cluster.iter().enumerate() {
            match filter(n, &req, &policy) {
                Ok(_) => passed.push(i),
                Err(r) => reasons += r.len(),
            }
        }
        let t1 = Instant::now();
        for &i in &passed {
            checksum += score(&cluster[i], &req, &policy);
        }
        let t2 = Instant::now();
        checksum += reasons as i64;
        if round >= 10 {
            // the first calls warm caches; they are not counted
            filter_t.push(t1 - t0);
            prio_t.push(t2 - t1);
            total_t.push(t2 - t0);
            passed_total += passed.len();
        }
    }
    let counted = filter_t.len();
    println!(
        "vcuda-scheduler bench: {nodes} nodes × {gpus} GPUs, {counted} pods (after 10 warm-up), mean {:.0} feasible nodes per pod (checksum {checksum})",
        passed_total as f64 / counted.max(1) as f64
    );
    println!("| per call over all nodes | p50 | p99 | max |");
    println!("|---|---|---|---|");
    for (name, v) in [
        ("filter", &mut filter_t),
        ("prioritize", &mut prio_t),
        ("filter + prioritize", &mut total_t),
    ] {
        v.sort();
        println!(
            "| {name} | {} | {} | {} |",
            ms(pct(v, 0.5)),
            ms(pct(v, 0.99)),
            ms(pct(v, 1.0))
        );
    }
    let p99 = pct(&total_t, 0.99);
    let met = p99 <= Duration::from_millis(5);
    println!(
        "target: filter + prioritize p99 ≤ 5 ms: {} ({})",
        if met { "met" } else { "NOT met" },
        ms(p99)
    );
}
