//! Whether a pod fits on a node and how good the node is for it (pure: no clock, no I/O,
//! nothing of HTTP or the API server; the node's state comes in as a [`NodeView`]).
//!
//! - [`filter`] finds a placement for every container, or says in words what was missing.
//!   A share (core % and memory) goes on one GPU; `gpu-count: N` puts equal shares on N
//!   distinct GPUs; whole GPUs must have nothing allocated or reserved on them and be
//!   acceptably connected ([`TopologyRule`]). App containers are placed together, each init
//!   container alone (see [`crate::request`]). The search is exact (depth first over every
//!   option, in preference order) up to [`Policy::search_budget`] steps; beyond it the node
//!   is refused, never over-committed.
//! - [`score`] rates a feasible node 0..=10 (extender v1) from a finer 0..=1000
//!   ([`score_fine`]): binpack (default) fills a GPU, then a node, before starting the next;
//!   spread does the opposite. With [`Policy::prefer_old_for_fractional`] shares go to older
//!   GPUs (compute capability, then memory) and whole-GPU jobs to the newest.
//!
//! **Sharing modes** (issue 19, [`modes`]): a GPU is unlocked or locked to the mode of its
//! first allocation (the inventory's `mode`). Shares (and `vcuda-core` whole GPUs) use only
//! GPUs unlocked or locked to shared mode; whole-GPU (`nvidia.com/gpu`) and slice
//! (`<domain>/sgpu`) pods are placed and scored by [`modes`]. A node whose inventory has no
//! `modes` serves shared mode only.
//!
//! Within a node the preference for a share is, in order: a GPU already in use over an
//! untouched one (binpack only), the oldest GPU (if `prefer_old_for_fractional`), the
//! tightest fit (binpack) or the emptiest (spread), the lowest index. Whole GPUs: the best
//! connected set (sum of pairwise [`Link::score`]), then the newest (if
//! `prefer_old_for_fractional`), then the lowest indices.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use vcuda_cluster::{
    Assignment, GpuMode, GpuShare, Link, LinkClass, NodeInventory, NodeModes, Reservation,
    Reservations, CORES_PER_GPU, INVENTORY_ANNOTATION, RESERVATIONS_ANNOTATION, SCHEMA,
};

use crate::request::{ContainerNeed, Need, PodRequest};

/// How nodes and GPUs are preferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Packing {
    /// Fill a GPU, then a node, before starting the next (keeps whole GPUs and nodes free).
    #[default]
    Binpack,
    /// Put work where there is most room (less contention, more fragmentation).
    Spread,
}

/// Which sets of whole GPUs are acceptable. A set of at least `from_gpus` GPUs is accepted
/// only if every pair of them is linked at least as well as `min_link`; smaller sets always
/// are. The default (`min_link: System`) accepts any set: the best connected set is still
/// *preferred* within a node and scores higher across nodes ("prefer but allow").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopologyRule {
    /// The worst link allowed between two GPUs of one container.
    pub min_link: LinkClass,
    /// The rule applies to containers with at least this many whole GPUs.
    pub from_gpus: u32,
}

impl Default for TopologyRule {
    fn default() -> Self {
        TopologyRule {
            min_link: LinkClass::System,
            from_gpus: 3,
        }
    }
}

/// The scheduler's placement settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Binpack (default) or spread.
    pub strategy: Packing,
    /// Shares go to older / lower-compute GPUs, whole GPUs to the newest (default true).
    pub prefer_old_for_fractional: bool,
    /// Which whole-GPU sets are acceptable.
    pub topology: TopologyRule,
    /// Most search steps per node before it is refused (default 20 000; one container
    /// needs at most a handful).
    pub search_budget: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            strategy: Packing::Binpack,
            prefer_old_for_fractional: true,
            topology: TopologyRule::default(),
            search_budget: 20_000,
        }
    }
}

/// One GPU as placement sees it: totals and what is committed (allocated + reserved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    /// NVML index on the node.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Model name.
    pub model: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// Advertised healthy by the manager.
    pub healthy: bool,
    /// Core committed, percent (allocated + reserved; may exceed 100 if the inputs do).
    pub core_used: u32,
    /// Memory committed, bytes (allocated + reserved).
    pub memory_used: u64,
    /// The mode the GPU is locked to (`None`: unlocked, or a manager before modes).
    pub mode: Option<GpuMode>,
    /// Its slices held (slice mode).
    pub slices_held: u32,
}

impl GpuState {
    /// May shares (and `vcuda-core` whole GPUs) go here: unlocked or locked to shared mode.
    pub fn serves_shared(&self) -> bool {
        matches!(self.mode, None | Some(GpuMode::Shared))
    }

    fn generation(&self) -> (u32, u32, u64) {
        let (a, b) = self.compute_capability;
        (a, b, self.memory_bytes)
    }
}

/// A node's GPUs with its reservations applied: build once per change of the node's
/// annotations (the scheduler caches it), use for every pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeView {
    /// The GPUs, in inventory order.
    pub gpus: Vec<GpuState>,
    /// `links[a][b]`: how GPU a (position in `gpus`) reaches GPU b.
    pub links: Vec<Vec<Link>>,
    /// The sharing modes the node serves (`None`: shared mode only).
    pub modes: Option<NodeModes>,
}

impl NodeView {
    /// The view from the manager's inventory and the scheduler's reservations. Reserved
    /// amounts on GPUs the inventory does not list are ignored (the GPU is gone).
    pub fn new(inventory: &NodeInventory, reservations: &[Reservation]) -> NodeView {
        let mut gpus: Vec<GpuState> = inventory
            .gpus
            .iter()
            .map(|g| GpuState {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                compute_capability: g.compute_capability(),
                memory_bytes: g.memory_bytes,
                healthy: g.healthy,
                core_used: g.allocated.core_percent,
                memory_used: g.allocated.memory_bytes,
                mode: g.mode,
                slices_held: g.slices_held,
            })
            .collect();
        for r in reservations {
            for s in &r.gpus {
                if let Some(g) = gpus.iter_mut().find(|g| g.uuid == s.uuid) {
                    g.core_used = g.core_used.saturating_add(s.core_percent);
                    g.memory_used = g.memory_used.saturating_add(s.memory_bytes);
                }
            }
        }
        let links = inventory
            .gpus
            .iter()
            .map(|a| inventory.gpus.iter().map(|b| a.link_to(b.index)).collect())
            .collect();
        NodeView {
            gpus,
            links,
            modes: inventory.modes.clone(),
        }
    }

    /// Does the node serve `mode`? Without `modes` in its inventory: shared mode only.
    pub fn enabled(&self, mode: GpuMode) -> bool {
        match &self.modes {
            None => mode == GpuMode::Shared,
            Some(m) => m.enabled.contains(&mode),
        }
    }

    /// The view from a Node's annotations ([`INVENTORY_ANNOTATION`],
    /// [`RESERVATIONS_ANNOTATION`]), every reservation counted; the error is the reason the
    /// node is refused.
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> Result<NodeView, String> {
        NodeView::from_annotations_at(annotations, Expiry::NEVER)
    }

    /// As [`NodeView::from_annotations`], ignoring reservations that `expiry` says are stale.
    pub fn from_annotations_at(
        annotations: &BTreeMap<String, String>,
        expiry: Expiry,
    ) -> Result<NodeView, String> {
        let inv = annotations.get(INVENTORY_ANNOTATION).ok_or_else(|| {
            format!("node has no {INVENTORY_ANNOTATION} annotation: vcuda-manager is not running on it or is too old; start or upgrade it")
        })?;
        let inv: NodeInventory = serde_json::from_str(inv).map_err(|e| {
            format!("node annotation {INVENTORY_ANNOTATION} is not valid JSON for schema {SCHEMA}: {e}; upgrade vcuda-manager or vcuda-scheduler to the same release")
        })?;
        if inv.schema > SCHEMA {
            return Err(format!("node annotation {INVENTORY_ANNOTATION} has schema {}, newer than this scheduler's {SCHEMA}; upgrade vcuda-scheduler", inv.schema));
        }
        let res = match annotations.get(RESERVATIONS_ANNOTATION) {
            None => Reservations::default(),
            Some(r) => serde_json::from_str(r).map_err(|e| {
                format!("node annotation {RESERVATIONS_ANNOTATION} is not valid JSON: {e}; remove it (binds rewrite it)")
            })?,
        };
        let live: Vec<Reservation> = res.pods.into_iter().filter(|r| expiry.live(r)).collect();
        Ok(NodeView::new(&inv, &live))
    }
}

/// When reservations stop counting: one older than `ttl_ms` at `now_ms` (milliseconds since
/// the Unix epoch) is stale. A reservation the manager never retired (a pod deleted before
/// it started, a manager that is down) would otherwise block its GPUs forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    /// Now, milliseconds since the Unix epoch.
    pub now_ms: u64,
    /// Age from which a reservation is ignored.
    pub ttl_ms: u64,
}

impl Expiry {
    /// Every reservation counts.
    pub const NEVER: Expiry = Expiry {
        now_ms: 0,
        ttl_ms: u64::MAX,
    };

    /// Does `r` still count? A reservation stamped ahead of `now_ms` (another replica's
    /// clock) counts.
    pub fn live(&self, r: &Reservation) -> bool {
        self.now_ms.saturating_sub(r.created_unix_ms) < self.ttl_ms
    }
}

/// Where one container goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// The container's name.
    pub name: String,
    /// Positions in [`NodeView::gpus`], distinct.
    pub gpus: Vec<usize>,
    /// What it needs (per GPU amounts for shares).
    pub need: Need,
}

/// A feasible placement of a pod on a node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Choice {
    /// App containers, in pod order.
    pub containers: Vec<Placed>,
    /// Init containers, in pod order (each placed as if alone).
    pub init_containers: Vec<Placed>,
}

/// What container `p` takes on GPU position `g`: (core %, memory bytes).
fn take(view: &NodeView, p: &Placed, g: usize) -> (u32, u64) {
    match p.need {
        Need::Shares {
            percent,
            memory_bytes,
            ..
        } => (percent, memory_bytes),
        Need::Whole { .. } => (CORES_PER_GPU, view.gpus[g].memory_bytes),
        // the kubelet picks the devices; nothing is reserved or assigned
        Need::Exclusive { .. } | Need::Slices { .. } => (0, 0),
    }
}

impl Choice {
    /// The [`Assignment`] to record on the pod (shares only: whole-GPU and slice containers
    /// get their devices from the kubelet and are left out).
    pub fn assignment(&self, view: &NodeView) -> Assignment {
        let mut containers = BTreeMap::new();
        for p in self
            .containers
            .iter()
            .chain(&self.init_containers)
            .filter(|p| !p.need.is_device())
        {
            let shares = p
                .gpus
                .iter()
                .map(|&g| {
                    let (core_percent, memory_bytes) = take(view, p, g);
                    GpuShare {
                        uuid: view.gpus[g].uuid.clone(),
                        core_percent,
                        memory_bytes,
                    }
                })
                .collect();
            containers.insert(p.name.clone(), shares);
        }
        Assignment {
            schema: SCHEMA,
            containers,
            bound_unix_ms: None,
        }
    }

    /// What the pod holds per GPU at most (for its [`Reservation`]): per GPU, the larger of
    /// the app containers' sum and any one init container, for core and memory separately.
    pub fn per_gpu(&self, view: &NodeView) -> Vec<GpuShare> {
        let n = view.gpus.len();
        let mut app = vec![(0u32, 0u64); n];
        for p in &self.containers {
            for &g in &p.gpus {
                let (c, m) = take(view, p, g);
                app[g].0 += c;
                app[g].1 += m;
            }
        }
        for p in &self.init_containers {
            for &g in &p.gpus {
                let (c, m) = take(view, p, g);
                app[g].0 = app[g].0.max(c);
                app[g].1 = app[g].1.max(m);
            }
        }
        app.iter()
            .enumerate()
            .filter(|(_, &(c, m))| c > 0 || m > 0)
            .map(|(g, &(c, m))| GpuShare {
                uuid: view.gpus[g].uuid.clone(),
                core_percent: c,
                memory_bytes: m,
            })
            .collect()
    }
}

/// Mutable per-GPU commitments during the search.
#[derive(Clone)]
struct State {
    core: Vec<u32>,
    mem: Vec<u64>,
}

impl State {
    fn of(view: &NodeView) -> State {
        State {
            core: view.gpus.iter().map(|g| g.core_used).collect(),
            mem: view.gpus.iter().map(|g| g.memory_used).collect(),
        }
    }
    fn core_free(&self, g: usize) -> u32 {
        CORES_PER_GPU.saturating_sub(self.core[g])
    }
    fn mem_free(&self, view: &NodeView, g: usize) -> u64 {
        view.gpus[g].memory_bytes.saturating_sub(self.mem[g])
    }
    fn untouched(&self, g: usize) -> bool {
        self.core[g] == 0 && self.mem[g] == 0
    }
    fn apply(&mut self, view: &NodeView, p: &Placed, sign: bool) {
        for &g in &p.gpus {
            let (c, m) = take(view, p, g);
            if sign {
                self.core[g] += c;
                self.mem[g] += m;
            } else {
                self.core[g] -= c;
                self.mem[g] -= m;
            }
        }
    }
}

/// Call `f` with every `k`-subset of `items` (lexicographic in positions); stop when it
/// returns false.
fn combinations(items: &[usize], k: usize, f: &mut dyn FnMut(&[usize]) -> bool) {
    fn go(
        items: &[usize],
        k: usize,
        cur: &mut Vec<usize>,
        f: &mut dyn FnMut(&[usize]) -> bool,
    ) -> bool {
        if cur.len() == k {
            return f(cur);
        }
        let left = k - cur.len();
        for i in 0..items.len() {
            if items.len() - i < left {
                break;
            }
            cur.push(items[i]);
            let go_on = go(&items[i + 1..], k, cur, f);
            cur.pop();
            if !go_on {
                return false;
            }
        }
        true
    }
    if k == 0 || k > items.len() {
        return;
    }
    go(items, k, &mut Vec::with_capacity(k), f);
}

fn topology_score(view: &NodeView, set: &[usize]) -> u64 {
    let mut s = 0u64;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            s += u64::from(view.links[a][b].score());
        }
    }
    s
}

fn worst_link(view: &NodeView, set: &[usize]) -> LinkClass {
    let mut worst = LinkClass::NvLink;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            worst = worst.min(view.links[a][b].class());
        }
    }
    worst
}

/// Every placement of `need` in `state`, most preferred first; only the first when
/// `first_only` (the last container of a search needs no alternatives).
fn options(
    view: &NodeView,
    state: &State,
    need: Need,
    policy: &Policy,
    first_only: bool,
) -> Vec<Vec<usize>> {
    let n = view.gpus.len();
    match need {
        Need::Shares {
            gpus,
            percent,
            memory_bytes,
        } => {
            let mut fit: Vec<usize> = (0..n)
                .filter(|&g| {
                    view.gpus[g].healthy
                        && view.gpus[g].serves_shared()
                        && state.core_free(g) >= percent
                        && state.mem_free(view, g) >= memory_bytes
                })
                .collect();
            let old = policy.prefer_old_for_fractional;
            match policy.strategy {
                Packing::Binpack => fit.sort_by_key(|&g| {
                    (
                        state.untouched(g),
                        old.then(|| view.gpus[g].generation()),
                        state.core_free(g),
                        state.mem_free(view, g),
                        g,
                    )
                }),
                Packing::Spread => fit.sort_by_key(|&g| {
                    (
                        old.then(|| view.gpus[g].generation()),
                        Reverse(state.core_free(g)),
                        Reverse(state.mem_free(view, g)),
                        g,
                    )
                }),
            }
            if gpus == 1 {
                // GPUs in the same state and generation are interchangeable: keep the first.
                let mut seen: Vec<(u32, u64, (u32, u32, u64))> = Vec::new();
                fit.retain(|&g| {
                    let sig = (state.core[g], state.mem[g], view.gpus[g].generation());
                    let new = !seen.contains(&sig);
                    if new {
                        seen.push(sig);
                    }
                    new
                });
                return fit.into_iter().map(|g| vec![g]).collect();
            }
            let mut out = Vec::new();
            combinations(&fit, gpus as usize, &mut |s| {
                let mut s = s.to_vec();
                s.sort_unstable();
                out.push(s);
                !first_only
            });
            out
        }
        Need::Whole { gpus, memory_bytes } => {
            let free: Vec<usize> = (0..n)
                .filter(|&g| {
                    view.gpus[g].healthy && view.gpus[g].serves_shared() && state.untouched(g)
                })
                .collect();
            let rule = policy.topology;
            let mut out: Vec<(u64, u64, Vec<usize>)> = Vec::new();
            let mut best: Option<(u64, u64)> = None;
            combinations(&free, gpus as usize, &mut |s| {
                let mem: u64 = s.iter().map(|&g| view.gpus[g].memory_bytes).sum();
                let topo_ok = gpus < rule.from_gpus || worst_link(view, s) >= rule.min_link;
                if mem >= memory_bytes && topo_ok {
                    let newness: u64 = if policy.prefer_old_for_fractional {
                        s.iter()
                            .map(|&g| {
                                let (a, b, m) = view.gpus[g].generation();
                                u64::from(a * 10 + b.min(9)) << 40 | (m >> 30).min((1 << 40) - 1)
                            })
                            .min()
                            .unwrap_or(0)
                    } else {
                        0
                    };
                    let key = (topology_score(view, s), newness);
                    if !first_only {
                        out.push((key.0, key.1, s.to_vec()));
                    } else if best.is_none_or(|b| key > b) {
                        // the first of equals wins, as in the stable sort below
                        best = Some(key);
                        out.clear();
                        out.push((key.0, key.1, s.to_vec()));
                    }
                }
                true
            });
            // stable: ties keep the lexicographic (lowest indices first) order
            out.sort_by_key(|(t, newness, _)| (Reverse(*t), Reverse(*newness)));
            out.into_iter().map(|(_, _, s)| s).collect()
        }
        // placed by `modes`, never by this search
        Need::Exclusive { .. } | Need::Slices { .. } => Vec::new(),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

fn short(uuid: &str) -> &str {
    uuid.get(..12).unwrap_or(uuid)
}

fn describe_need(c: &ContainerNeed) -> String {
    match c.need {
        Need::Shares {
            gpus: 1,
            percent,
            memory_bytes,
        } => format!(
            "container {} needs {percent} % and {} on one GPU",
            c.name,
            gib(memory_bytes)
        ),
        Need::Shares {
            gpus,
            percent,
            memory_bytes,
        } => format!(
            "container {} needs {percent} % and {} on each of {gpus} GPUs",
            c.name,
            gib(memory_bytes)
        ),
        Need::Whole { gpus, memory_bytes } if memory_bytes > 0 => format!(
            "container {} needs {gpus} whole GPU(s) with {} between them",
            c.name,
            gib(memory_bytes)
        ),
        Need::Whole { gpus, .. } => format!("container {} needs {gpus} whole GPU(s)", c.name),
        Need::Exclusive { gpus } => format!(
            "container {} needs {gpus} whole GPU(s) of whole mode (unlocked, nothing on them)",
            c.name
        ),
        Need::Slices { gpus: 1 } => format!("container {} needs 1 slice", c.name),
        Need::Slices { gpus } => format!(
            "container {} needs {gpus} slices on {gpus} different GPUs",
            c.name
        ),
    }
}

/// What each GPU has free, for a reason.
fn describe_gpus(view: &NodeView, state: &State) -> String {
    let mut s = String::new();
    for (g, gpu) in view.gpus.iter().enumerate() {
        if !s.is_empty() {
            s.push_str(", ");
        }
        let _ = write!(s, "GPU {} ({}) ", gpu.index, short(&gpu.uuid));
        if let Some(m) = gpu.mode.filter(|_| !gpu.serves_shared()) {
            let _ = write!(s, "locked to {} mode", modes::mode_name(m));
        } else if gpu.healthy {
            let _ = write!(
                s,
                "{} % and {} free",
                state.core_free(g),
                gib(state.mem_free(view, g))
            );
        } else {
            s.push_str("unhealthy");
        }
    }
    s
}

/// Why `c` cannot be placed in `state` on its own.
fn why_not(view: &NodeView, state: &State, c: &ContainerNeed, policy: &Policy) -> String {
    let head = describe_need(c);
    match c.need {
        Need::Shares {
            gpus,
            percent,
            memory_bytes,
        } => {
            let enough = (0..view.gpus.len())
                .filter(|&g| {
                    view.gpus[g].healthy
                        && view.gpus[g].serves_shared()
                        && state.core_free(g) >= percent
                        && state.mem_free(view, g) >= memory_bytes
                })
                .count();
            let what = if gpus == 1 {
                "no GPU has both".to_string()
            } else {
                format!("only {enough} GPU(s) have both")
            };
            format!("{head}; {what}: {}", describe_gpus(view, state))
        }
        Need::Whole { gpus, memory_bytes } => {
            let free: Vec<usize> = (0..view.gpus.len())
                .filter(|&g| {
                    view.gpus[g].healthy && view.gpus[g].serves_shared() && state.untouched(g)
                })
                .collect();
            if free.len() < gpus as usize {
                format!(
                    "{head} (nothing else on them); {} free: {}",
                    free.len(),
                    describe_gpus(view, state)
                )
            } else {
                let mut best_mem = 0;
                combinations(&free, gpus as usize, &mut |s| {
                    best_mem = best_mem.max(s.iter().map(|&g| view.gpus[g].memory_bytes).sum());
                    true
                });
                if best_mem < memory_bytes {
                    format!(
                        "{head}; its vcuda-memory is larger than any {gpus} free GPUs hold ({}); lower vcuda-memory",
                        gib(best_mem)
                    )
                } else {
                    format!(
                        "{head}; {} are free but no {gpus} of them are all linked by {:?} or better (setting topology min_link; relax it or use fewer GPUs)",
                        free.len(),
                        policy.topology.min_link
                    )
                }
            }
        }
        Need::Exclusive { .. } | Need::Slices { .. } => modes::why_not(view, c),
    }
}

/// Depth-first search: place `needs` in `state` (restored on return); the GPUs of each
/// go to `out`. `Err` when the budget ran out.
fn search(
    view: &NodeView,
    state: &mut State,
    needs: &[&ContainerNeed],
    policy: &Policy,
    steps: &mut u32,
    out: &mut Vec<Vec<usize>>,
) -> Result<bool, ()> {
    let Some((first, rest)) = needs.split_first() else {
        return Ok(true);
    };
    for gpus in options(view, state, first.need, policy, rest.is_empty()) {
        *steps += 1;
        if *steps > policy.search_budget {
            return Err(());
        }
        let p = Placed {
            name: String::new(),
            gpus,
            need: first.need,
        };
        state.apply(view, &p, true);
        out.push(p.gpus.clone());
        if search(view, state, rest, policy, steps, out)? {
            state.apply(view, &p, false);
            return Ok(true);
        }
        out.pop();
        state.apply(view, &p, false);
    }
    Ok(false)
}

/// Harder containers first: whole GPUs, then by GPUs spanned, then by core.
fn difficulty(c: &ContainerNeed) -> (u8, u32, u32, u64) {
    match c.need {
        Need::Whole { gpus, memory_bytes } => (0, u32::MAX - gpus, 0, u64::MAX - memory_bytes),
        Need::Shares {
            gpus,
            percent,
            memory_bytes,
        } => (
            1,
            u32::MAX - gpus,
            100 - percent.min(100),
            u64::MAX - memory_bytes,
        ),
        Need::Exclusive { gpus } | Need::Slices { gpus } => (2, u32::MAX - gpus, 0, 0),
    }
}

/// Find a placement of `req` on the node, or the reason there is none.
pub fn filter(node: &NodeView, req: &PodRequest, policy: &Policy) -> Result<Choice, String> {
    if req.is_empty() {
        return Ok(Choice {
            containers: Vec::new(),
            init_containers: Vec::new(),
        });
    }
    if node.gpus.is_empty() {
        return Err(format!(
            "node lists no GPUs in {INVENTORY_ANNOTATION}; it cannot run vcuda containers"
        ));
    }
    if let Some(mode) = req.mode() {
        modes::check_mode(node, req, mode)?;
        if mode != GpuMode::Shared {
            return modes::filter(node, req, policy);
        }
    }
    let base = State::of(node);
    let mut init_containers = Vec::new();
    for c in &req.init_containers {
        let opts = options(node, &base, c.need, policy, true);
        let Some(gpus) = opts.into_iter().next() else {
            return Err(format!("init {}", why_not(node, &base, c, policy)));
        };
        init_containers.push(Placed {
            name: c.name.clone(),
            gpus,
            need: c.need,
        });
    }
    let mut order: Vec<usize> = (0..req.containers.len()).collect();
    order.sort_by_key(|&i| difficulty(&req.containers[i]));
    let needs: Vec<&ContainerNeed> = order.iter().map(|&i| &req.containers[i]).collect();
    let mut state = base.clone();
    let mut steps = 0;
    let mut found = Vec::new();
    match search(node, &mut state, &needs, policy, &mut steps, &mut found) {
        Ok(true) => {
            let mut containers: Vec<Option<Placed>> = vec![None; req.containers.len()];
            for (&i, gpus) in order.iter().zip(found) {
                let c = &req.containers[i];
                containers[i] = Some(Placed {
                    name: c.name.clone(),
                    gpus,
                    need: c.need,
                });
            }
            Ok(Choice {
                containers: containers.into_iter().flatten().collect(),
                init_containers,
            })
        }
        Ok(false) => {
            for c in &needs {
                if options(node, &base, c.need, policy, true).is_empty() {
                    return Err(why_not(node, &base, c, policy));
                }
            }
            let list: Vec<String> = needs.iter().map(|c| describe_need(c)).collect();
            Err(format!(
                "each container fits alone but not all together ({}); GPUs: {}",
                list.join("; "),
                describe_gpus(node, &base)
            ))
        }
        Err(()) => Err(format!(
            "gave up after {} placement steps for {} containers; the pod is too complex to place exactly here: use fewer containers with GPUs or raise the search budget",
            policy.search_budget,
            req.containers.len()
        )),
    }
}

/// 0..=1000, higher is better for `choice` on `node`. Only the app containers count.
pub fn score_choice(node: &NodeView, choice: &Choice, policy: &Policy) -> i64 {
    if choice.containers.is_empty() {
        return 500;
    }
    if choice.containers.iter().any(|p| p.need.is_device()) {
        return modes::score(node, choice, policy);
    }
    let mut state = State::of(node);
    for p in &choice.containers {
        state.apply(node, p, true);
    }
    let fill = |g: usize| -> f64 {
        let core = f64::from(state.core[g].min(CORES_PER_GPU)) / f64::from(CORES_PER_GPU);
        let mem = if node.gpus[g].memory_bytes == 0 {
            1.0
        } else {
            (state.mem[g] as f64 / node.gpus[g].memory_bytes as f64).min(1.0)
        };
        (core + mem) / 2.0
    };
    let mut touched: Vec<usize> = choice
        .containers
        .iter()
        .flat_map(|p| p.gpus.iter().copied())
        .collect();
    touched.sort_unstable();
    touched.dedup();
    let gpu_fill = touched.iter().map(|&g| fill(g)).sum::<f64>() / touched.len() as f64;
    let healthy: Vec<usize> = (0..node.gpus.len())
        .filter(|&g| node.gpus[g].healthy)
        .collect();
    let node_fill = if healthy.is_empty() {
        1.0
    } else {
        healthy.iter().map(|&g| fill(g)).sum::<f64>() / healthy.len() as f64
    };
    // Secondary: topology for multi-GPU whole sets, age for the GPUs' generation.
    let newness = |g: usize| -> f64 {
        let (a, b) = node.gpus[g].compute_capability;
        ((f64::from(a * 10 + b.min(9)) - 50.0) / 50.0).clamp(0.0, 1.0)
    };
    let mut terms = Vec::new();
    for p in &choice.containers {
        let avg_new = p.gpus.iter().map(|&g| newness(g)).sum::<f64>() / p.gpus.len() as f64;
        match p.need {
            Need::Whole { gpus, .. } => {
                if gpus > 1 {
                    terms.push(
                        worst_link(node, &p.gpus) as u8 as f64 / LinkClass::NvLink as u8 as f64,
                    );
                }
                if policy.prefer_old_for_fractional {
                    terms.push(avg_new);
                }
            }
            Need::Shares { .. } => {
                if policy.prefer_old_for_fractional {
                    terms.push(1.0 - avg_new);
                }
            }
            Need::Exclusive { .. } | Need::Slices { .. } => {}
        }
    }
    let secondary = if terms.is_empty() {
        0.5
    } else {
        terms.iter().sum::<f64>() / terms.len() as f64
    };
    let fine = match policy.strategy {
        Packing::Binpack => 500.0 * gpu_fill + 350.0 * node_fill + 150.0 * secondary,
        Packing::Spread => 500.0 * (1.0 - gpu_fill) + 350.0 * (1.0 - node_fill) + 150.0 * secondary,
    };
    (fine.round() as i64).clamp(0, 1000)
}

/// The 0..=1000 score of `req` on `node`; `None` if it does not fit.
pub fn score_fine(node: &NodeView, req: &PodRequest, policy: &Policy) -> Option<i64> {
    filter(node, req, policy)
        .ok()
        .map(|c| score_choice(node, &c, policy))
}

/// Map a 0..=1000 score to the extender's 0..=10 (monotone, rounding to nearest).
pub fn to_extender_score(fine: i64) -> i64 {
    (fine.clamp(0, 1000) + 50) / 100
}

/// The extender score (0..=10) of `req` on `node`; 0 when it does not fit.
pub fn score(node: &NodeView, req: &PodRequest, policy: &Policy) -> i64 {
    score_fine(node, req, policy).map_or(0, to_extender_score)
}

pub mod modes;

pub use modes::foreign_node_passes;

#[cfg(test)]
mod tests;
