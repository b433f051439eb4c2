//! Whole GPUs and slices on one node (issue 19, seed 002's mixed deployment); pure.
//!
//! A GPU is unlocked or locked to the mode of its first allocation until its last one in
//! that mode ends (the inventory's per-GPU `mode` and `slicesHeld`). What a GPU can give:
//! - a **whole-GPU** container (`nvidia.com/gpu: n`, [`Need::Exclusive`]): n GPUs, each
//!   healthy, unlocked and with nothing allocated or reserved on it;
//! - a **slice** container (`<domain>/sgpu: n`, [`Need::Slices`]): one slice on each of n
//!   *different* healthy GPUs, each unlocked and untouched (K slices free) or locked to slice
//!   mode with `slicesHeld < K` (K − held free);
//! - shares use only GPUs unlocked or locked to shared mode (in the shares search).
//!
//! A GPU the inventory calls unlocked but with something committed on it (a share a bind
//! reserved and the kubelet has not allocated yet, or a manager before modes) counts as
//! used by shared mode ([`in_use_by`]): it is about to be locked to it.
//!
//! A node must serve the mode ([`check_mode`]): without `modes` in its inventory it serves
//! shared mode only, and its names for the whole-GPU and slice resources must be the pod's.
//!
//! **Placement.** App containers run together: each takes its GPUs (distinct within the
//! container), a GPU giving at most as many slices as it has free (whole GPUs: one). The
//! search picks each container's GPUs in preference order (below) and, if that fails, the
//! GPUs with the most slices left, largest container first, which finds a placement whenever
//! one exists (the greedy of the Gale–Ryser theorem; property-tested against brute force).
//! Init containers each run alone. The GPUs chosen are a witness, not a decision: the kubelet
//! picks the devices, steered by vcuda-manager's GetPreferredAllocation, so nothing is
//! reserved or assigned for these containers ([`super::Choice::assignment`] leaves them out).
//!
//! **Preference and score** (seed 002's rules). Slices go to GPUs already locked to slice
//! mode with the fewest free slices first (凑整: fill a GPU before opening another), then to
//! the oldest (compute capability, then memory), then the lowest index; whole GPUs to the
//! newest. A node scores ([`score`], 0..=1000) for slices:
//! `400·age + 250·runs_slices + 200·gpu_fill + 150·node_fill` (binpack; spread takes
//! `1 − x` of the last three), where `age` is 1 − the chosen GPUs' [`rank`] (older is
//! higher), `runs_slices` half for a node already running slices and half for the share of
//! chosen GPUs already locked to slice mode, `gpu_fill` the chosen GPUs' held slices / K
//! after placing, `node_fill` the share of the node's healthy GPUs in use after placing;
//! and for whole GPUs `600·rank + 400·node_fill` (spread: `1 − node_fill`): the newest GPUs,
//! then the fuller node (keep empty nodes for the big jobs). Without
//! [`Policy::prefer_old_for_fractional`] `age` and `rank` are ½ for every node.

use std::cmp::Reverse;
use std::fmt::Write as _;

use vcuda_cluster::{GpuMode, INVENTORY_ANNOTATION};

use super::{describe_need, gib, short, Choice, GpuState, NodeView, Packing, Placed, Policy};
use crate::request::{ContainerNeed, Need, PodRequest};

/// A mode's name in messages: `whole`, `slice`, `shared` (as in the inventory and the
/// manager's `--modes`).
pub fn mode_name(m: GpuMode) -> &'static str {
    match m {
        GpuMode::Whole => "whole",
        GpuMode::Slice => "slice",
        GpuMode::Shared => "shared",
    }
}

/// The mode a GPU is used by: its lock; for an unlocked GPU, shared mode if anything is
/// committed on it (a reserved share, or a manager before modes), slice mode if slices are
/// held; `None` when it is free for any mode.
pub fn in_use_by(g: &GpuState) -> Option<GpuMode> {
    g.mode.or(if g.slices_held > 0 {
        Some(GpuMode::Slice)
    } else if g.core_used > 0 || g.memory_used > 0 {
        Some(GpuMode::Shared)
    } else {
        None
    })
}

/// Slices per GPU on the node (K); 0 without `modes`.
fn slices_per_gpu(view: &NodeView) -> u32 {
    view.modes.as_ref().map_or(0, |m| m.slices)
}

/// How many slices GPU `g` has free for a new slice container.
pub fn free_slices(view: &NodeView, g: usize) -> u32 {
    let gpu = &view.gpus[g];
    if !gpu.healthy {
        return 0;
    }
    let k = slices_per_gpu(view);
    match in_use_by(gpu) {
        None => k,
        Some(GpuMode::Slice) => k.saturating_sub(gpu.slices_held),
        Some(_) => 0,
    }
}

/// Can a whole-GPU container have GPU `gpu`: healthy, unlocked, nothing on it.
pub fn whole_free(gpu: &GpuState) -> bool {
    gpu.healthy && in_use_by(gpu).is_none()
}

/// A GPU's generation on a 0..=1 scale: compute capability 6.0 (Pascal) or older is 0, 9.0
/// (Hopper) or newer 1 (steeper than the shares' scale, so one generation moves a score).
pub fn rank(gpu: &GpuState) -> f64 {
    let (a, b) = gpu.compute_capability;
    ((f64::from(a * 10 + b.min(9)) - 60.0) / 30.0).clamp(0.0, 1.0)
}

/// A whole-GPU pod passes a node without a vcuda inventory: vcuda-manager does not run
/// there, so another device plugin (NVIDIA's) serves the whole-GPU resource and
/// kube-scheduler's own resource check decides. Slices and shares need vcuda-manager.
pub fn foreign_node_passes(req: &PodRequest) -> bool {
    req.mode() == Some(GpuMode::Whole)
}

/// What the pod asks for, in words.
fn asked(req: &PodRequest, mode: GpuMode) -> String {
    match (mode, &req.device_resource) {
        (GpuMode::Shared, _) => "shares (vcuda-core, vcuda-memory)".to_string(),
        (GpuMode::Whole, r) => format!("whole GPUs ({})", r.as_deref().unwrap_or("whole")),
        (GpuMode::Slice, r) => format!("slices ({})", r.as_deref().unwrap_or("sgpu")),
    }
}

/// Does the node serve `mode` under the pod's resource name? The reason if not.
pub fn check_mode(view: &NodeView, req: &PodRequest, mode: GpuMode) -> Result<(), String> {
    let name = mode_name(mode);
    if !view.enabled(mode) {
        return Err(match &view.modes {
            None => format!(
                "the pod asks for {}, but the node's vcuda-manager serves shared mode only (its {INVENTORY_ANNOTATION} lists no modes: it predates modes or runs with --modes shared); enable {name} mode on the node (vcuda-manager --modes) or send the pod elsewhere",
                asked(req, mode)
            ),
            Some(m) => format!(
                "the pod asks for {}, but the node serves {} mode only; enable {name} mode on the node (vcuda-manager --modes) or send the pod elsewhere",
                asked(req, mode),
                m.enabled
                    .iter()
                    .map(|&m| mode_name(m))
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
        });
    }
    let (Some(m), Some(wanted)) = (&view.modes, &req.device_resource) else {
        return Ok(());
    };
    let (served, fix) = match mode {
        GpuMode::Whole => (
            &m.whole_resource,
            "vcuda-scheduler --whole-resource and vcuda-manager --whole-resource",
        ),
        GpuMode::Slice => (
            &m.slice_resource,
            "the same --domain for vcuda-scheduler and vcuda-manager",
        ),
        GpuMode::Shared => return Ok(()),
    };
    if served != wanted {
        return Err(format!(
            "the pod asks for {wanted}, but the node serves {name} mode as {served}; use one name ({fix})"
        ));
    }
    Ok(())
}

/// What each GPU can give a whole-GPU or slice container, for a reason.
fn describe(view: &NodeView, mode: GpuMode) -> String {
    let k = slices_per_gpu(view);
    let mut s = String::new();
    for (g, gpu) in view.gpus.iter().enumerate() {
        if !s.is_empty() {
            s.push_str(", ");
        }
        let _ = write!(s, "GPU {} ({}) ", gpu.index, short(&gpu.uuid));
        match (gpu.healthy, in_use_by(gpu)) {
            (false, _) => s.push_str("unhealthy"),
            (true, None) if mode == GpuMode::Slice => {
                let _ = write!(s, "unlocked, {k} of {k} slices free");
            }
            (true, None) => s.push_str("free"),
            (true, Some(GpuMode::Slice)) => {
                let _ = write!(
                    s,
                    "locked to slice mode, {} of {k} slices free",
                    free_slices(view, g)
                );
            }
            (true, Some(GpuMode::Shared)) if gpu.mode.is_none() => {
                let _ = write!(
                    s,
                    "in use by shares ({} % and {} committed)",
                    gpu.core_used,
                    gib(gpu.memory_used)
                );
            }
            (true, Some(m)) => {
                let _ = write!(s, "locked to {} mode", mode_name(m));
            }
        }
    }
    s
}

/// Why container `c` (whole GPUs or slices) cannot be placed on the node on its own.
pub(super) fn why_not(view: &NodeView, c: &ContainerNeed) -> String {
    let head = describe_need(c);
    match c.need {
        Need::Exclusive { gpus } => {
            let free = view.gpus.iter().filter(|g| whole_free(g)).count();
            let what = if free == 0 {
                "no GPU is free (every one is locked to a mode, in use or unhealthy)".to_string()
            } else {
                format!("only {free} of them free, {gpus} needed")
            };
            format!("{head}; {what}: {}", describe(view, GpuMode::Whole))
        }
        Need::Slices { gpus } => {
            let caps: Vec<u32> = (0..view.gpus.len()).map(|g| free_slices(view, g)).collect();
            let with = caps.iter().filter(|&&c| c > 0).count();
            let total: u32 = caps.iter().sum();
            let what = if total >= gpus && with == 1 && total == 2 {
                "both free slices are on one GPU, and a container's slices must be on different GPUs".to_string()
            } else if total >= gpus {
                format!("its {total} free slices are on {with} GPU(s), and a container's slices must be on different GPUs")
            } else {
                format!("only {with} GPU(s) have a free slice ({total} free slices in all)")
            };
            format!("{head}; {what}: {}", describe(view, GpuMode::Slice))
        }
        Need::Shares { .. } | Need::Whole { .. } => head,
    }
}

/// `n` GPUs with something left in `left`, in preference order (`prefer`) or most left
/// first; `None` when fewer than `n` have anything left.
fn pick(
    view: &NodeView,
    left: &[u32],
    n: u32,
    mode: GpuMode,
    policy: &Policy,
    prefer: bool,
) -> Option<Vec<usize>> {
    let mut c: Vec<usize> = (0..left.len()).filter(|&g| left[g] > 0).collect();
    if c.len() < n as usize {
        return None;
    }
    let old = policy.prefer_old_for_fractional;
    let generation = |g: usize| old.then(|| view.gpus[g].generation());
    match (prefer, mode) {
        (false, _) => c.sort_by_key(|&g| (Reverse(left[g]), g)),
        (true, GpuMode::Slice) => match policy.strategy {
            Packing::Binpack => c.sort_by_key(|&g| {
                (
                    in_use_by(&view.gpus[g]) != Some(GpuMode::Slice),
                    left[g],
                    generation(g),
                    g,
                )
            }),
            Packing::Spread => c.sort_by_key(|&g| (Reverse(left[g]), generation(g), g)),
        },
        (true, _) => c.sort_by_key(|&g| (Reverse(generation(g)), g)),
    }
    c.truncate(n as usize);
    c.sort_unstable();
    Some(c)
}

/// GPUs for every container of `needs` together, or `None`.
fn assign(
    view: &NodeView,
    caps: &[u32],
    needs: &[&ContainerNeed],
    mode: GpuMode,
    policy: &Policy,
    prefer: bool,
) -> Option<Vec<Vec<usize>>> {
    let mut left = caps.to_vec();
    let mut out = Vec::with_capacity(needs.len());
    for c in needs {
        let set = pick(view, &left, c.need.gpus(), mode, policy, prefer)?;
        for &g in &set {
            left[g] -= 1;
        }
        out.push(set);
    }
    Some(out)
}

/// What each GPU can give one container of `mode` (slices free; whole: 1 or 0).
pub fn capacities(view: &NodeView, mode: GpuMode) -> Vec<u32> {
    (0..view.gpus.len())
        .map(|g| match mode {
            GpuMode::Whole => u32::from(whole_free(&view.gpus[g])),
            _ => free_slices(view, g),
        })
        .collect()
}

/// Place a whole-GPU or slice pod (`req.mode()` is one of them; [`check_mode`] passed).
pub(super) fn filter(view: &NodeView, req: &PodRequest, policy: &Policy) -> Result<Choice, String> {
    let mode = req.mode().unwrap_or(GpuMode::Slice);
    let caps = capacities(view, mode);
    let placed = |c: &ContainerNeed, gpus: Vec<usize>| Placed {
        name: c.name.clone(),
        gpus,
        need: c.need,
    };
    let mut init_containers = Vec::new();
    for c in &req.init_containers {
        let Some(gpus) = pick(view, &caps, c.need.gpus(), mode, policy, true) else {
            return Err(format!("init {}", why_not(view, c)));
        };
        init_containers.push(placed(c, gpus));
    }
    let mut order: Vec<usize> = (0..req.containers.len()).collect();
    order.sort_by_key(|&i| Reverse(req.containers[i].need.gpus()));
    let needs: Vec<&ContainerNeed> = order.iter().map(|&i| &req.containers[i]).collect();
    let found = assign(view, &caps, &needs, mode, policy, true)
        .or_else(|| assign(view, &caps, &needs, mode, policy, false));
    let Some(sets) = found else {
        for c in &needs {
            if pick(view, &caps, c.need.gpus(), mode, policy, false).is_none() {
                return Err(why_not(view, c));
            }
        }
        let list: Vec<String> = needs.iter().map(|c| describe_need(c)).collect();
        return Err(format!(
            "each container fits alone but not all together ({}); GPUs: {}",
            list.join("; "),
            describe(view, mode)
        ));
    };
    let mut containers: Vec<Option<Placed>> = vec![None; req.containers.len()];
    for (&i, gpus) in order.iter().zip(sets) {
        containers[i] = Some(placed(&req.containers[i], gpus));
    }
    Ok(Choice {
        containers: containers.into_iter().flatten().collect(),
        init_containers,
    })
}

/// 0..=1000 for a whole-GPU or slice placement (see the module documentation).
pub(super) fn score(view: &NodeView, choice: &Choice, policy: &Policy) -> i64 {
    let Some(mode) = choice.containers.first().map(|p| p.need.mode()) else {
        return 500;
    };
    let n = view.gpus.len();
    let k = f64::from(slices_per_gpu(view).max(1));
    let before: Vec<Option<GpuMode>> = view.gpus.iter().map(in_use_by).collect();
    let mut held: Vec<u32> = view
        .gpus
        .iter()
        .map(|g| {
            if in_use_by(g) == Some(GpuMode::Slice) {
                g.slices_held
            } else {
                0
            }
        })
        .collect();
    let mut used: Vec<bool> = before.iter().map(Option::is_some).collect();
    let mut touched: Vec<usize> = Vec::new();
    for p in &choice.containers {
        for &g in &p.gpus {
            used[g] = true;
            held[g] += 1;
            touched.push(g);
        }
    }
    touched.sort_unstable();
    touched.dedup();
    if touched.is_empty() {
        return 500;
    }
    let avg = |f: &dyn Fn(usize) -> f64| {
        touched.iter().map(|&g| f(g)).sum::<f64>() / touched.len() as f64
    };
    let healthy: Vec<usize> = (0..n).filter(|&g| view.gpus[g].healthy).collect();
    let node_fill = if healthy.is_empty() {
        1.0
    } else {
        healthy.iter().filter(|&&g| used[g]).count() as f64 / healthy.len() as f64
    };
    let newest = if policy.prefer_old_for_fractional {
        avg(&|g| rank(&view.gpus[g]))
    } else {
        0.5
    };
    let spread = policy.strategy == Packing::Spread;
    let flip = |x: f64| if spread { 1.0 - x } else { x };
    let fine = match mode {
        GpuMode::Slice => {
            let runs_node = f64::from(u8::from(before.contains(&Some(GpuMode::Slice))));
            let on_locked = avg(&|g| f64::from(u8::from(before[g] == Some(GpuMode::Slice))));
            let runs = (runs_node + on_locked) / 2.0;
            let gpu_fill = avg(&|g| (f64::from(held[g]) / k).min(1.0));
            400.0 * (1.0 - newest)
                + 250.0 * flip(runs)
                + 200.0 * flip(gpu_fill)
                + 150.0 * flip(node_fill)
        }
        _ => 600.0 * newest + 400.0 * flip(node_fill),
    };
    (fine.round() as i64).clamp(0, 1000)
}

#[cfg(test)]
mod tests;
