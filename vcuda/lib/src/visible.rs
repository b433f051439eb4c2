//! Which GPUs the driver shows: the `CUDA_VISIBLE_DEVICES` value made from the config and
//! whatever the application asked for (set by the library constructor and again before
//! `cuInit`), and [`Visible`], the lock-free CUDA ordinal → config index map a launch of a
//! multi-GPU process reads.

use std::sync::atomic::{
    AtomicU8, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};

use vcuda_contract::config::{format_uuid, ContainerConfig, MAX_GPUS};

use crate::ffi::CUdevice;
use crate::log::{log, DEBUG};

/// CUDA ordinal → config index, as the driver showed it after `cuInit`: a launch of a
/// multi-GPU process looks its GPU up here, so reads take no lock. Written once per
/// successful `cuInit` (the same answer each time); `len` is published last.
#[derive(Default)]
pub struct Visible {
    /// Ordinals the driver shows, plus one; 0 = not yet known (ordinals follow the config).
    len_plus_one: AtomicUsize,
    /// Config index of each ordinal below that.
    map: [AtomicU8; MAX_GPUS],
}

/// A published view of [`Visible`].
struct VisibleView<'a> {
    len: usize,
    map: &'a [AtomicU8; MAX_GPUS],
}

impl Visible {
    #[inline]
    fn get(&self) -> Option<VisibleView<'_>> {
        match self.len_plus_one.load(Acquire) {
            0 => None,
            n => Some(VisibleView {
                len: (n - 1).min(MAX_GPUS),
                map: &self.map,
            }),
        }
    }

    /// The CUDA ordinal of config GPU `dev`, if the driver shows it (before `cuInit` was
    /// verified, ordinals follow the config).
    pub fn ordinal_of(&self, dev: usize) -> Option<CUdevice> {
        match self.get() {
            None => CUdevice::try_from(dev).ok(),
            Some(vis) => (0..vis.len)
                .find(|&o| usize::from(vis.map[o].load(Relaxed)) == dev)
                .and_then(|o| CUdevice::try_from(o).ok()),
        }
    }

    /// Config index of CUDA ordinal `ord`, of a container with `gpus` GPUs.
    #[inline]
    pub fn dev_of(&self, ord: usize, gpus: usize) -> Option<usize> {
        match self.get() {
            // Before cuInit was verified: ordinals follow the config.
            None => (ord < gpus).then_some(ord),
            Some(vis) => (ord < vis.len).then(|| usize::from(vis.map[ord].load(Relaxed))),
        }
    }

    /// Record which config GPU each ordinal is (after a successful `cuInit`).
    pub fn set(&self, vis: &[usize]) {
        for (slot, &d) in self.map.iter().zip(vis) {
            slot.store(u8::try_from(d).unwrap_or(u8::MAX), Relaxed);
        }
        self.len_plus_one
            .store(vis.len().min(MAX_GPUS) + 1, Release);
    }
}

/// Which config GPUs a `CUDA_VISIBLE_DEVICES` value selects, in its order. Entries are
/// indices into the container's GPUs or (prefixes of) their UUIDs; as CUDA does, the list
/// stops at the first invalid or repeated entry.
pub fn compose_visible(app: Option<&str>, assigned: &[[u8; 16]]) -> Vec<usize> {
    let Some(spec) = app else {
        return (0..assigned.len()).collect();
    };
    let names: Vec<String> = assigned
        .iter()
        .map(|u| format_uuid(u).to_ascii_lowercase())
        .collect();
    let mut out = Vec::new();
    for entry in spec.split(',') {
        let e = entry.trim();
        let pick = if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) {
            e.parse::<usize>().ok().filter(|&i| i < assigned.len())
        } else if e.len() > 4 && e[..4].eq_ignore_ascii_case("GPU-") {
            let lower = e.to_ascii_lowercase();
            let hits: Vec<usize> = names
                .iter()
                .enumerate()
                .filter(|(_, n)| n.starts_with(&lower))
                .map(|(i, _)| i)
                .collect();
            (hits.len() == 1).then(|| hits[0])
        } else {
            None
        };
        match pick {
            Some(i) if !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    out
}

/// The `CUDA_VISIBLE_DEVICES` value that shows the driver exactly `sel` of `assigned`.
pub fn visible_value(sel: &[usize], assigned: &[[u8; 16]]) -> String {
    sel.iter()
        .map(|&i| format_uuid(&assigned[i]))
        .collect::<Vec<_>>()
        .join(",")
}

/// Make the driver show only the container's GPUs. Called from the library constructor
/// (before `main`, while the process has one thread) and again before the real `cuInit`,
/// in case the application changed `CUDA_VISIBLE_DEVICES` in between.
pub fn restrict_visible_devices(cfg: &ContainerConfig) {
    let assigned = cfg.uuids();
    let current = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let want = visible_value(&compose_visible(current.as_deref(), &assigned), &assigned);
    if current.as_deref() != Some(want.as_str()) {
        log!(DEBUG, "CUDA_VISIBLE_DEVICES {:?} -> {:?}", current, want);
        // SAFETY: set_var is unsound only while other threads read the environment; this runs
        // in the constructor (one thread) or just before cuInit (see the README's caveat).
        unsafe { std::env::set_var("CUDA_VISIBLE_DEVICES", &want) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ordinal_map_is_unknown_until_set_and_then_what_the_driver_showed() {
        let v = Visible::default();
        assert!(
            v.get().is_none(),
            "before cuInit: ordinals follow the config"
        );
        // The driver shows config GPUs 2 and 0 (CUDA_VISIBLE_DEVICES=2,0).
        v.set(&[2, 0]);
        let view = v.get().expect("set");
        assert_eq!(view.len, 2);
        let map: Vec<u8> = (0..view.len).map(|o| view.map[o].load(Relaxed)).collect();
        assert_eq!(map, [2, 0]);
        // Set again after another cuInit with fewer GPUs: the shorter view wins.
        v.set(&[1]);
        assert_eq!(v.get().map(|w| w.len), Some(1));
        // No driver can show more GPUs than the table holds.
        v.set(&(0..MAX_GPUS + 3).collect::<Vec<_>>());
        assert_eq!(v.get().map(|w| w.len), Some(MAX_GPUS));
    }

    fn uuids() -> Vec<[u8; 16]> {
        vec![[0xaa; 16], [0xab; 16], [0x10; 16]]
    }

    #[test]
    fn visible_devices_compose_with_the_applications_choice() {
        let a = uuids();
        assert_eq!(compose_visible(None, &a), vec![0, 1, 2]);
        assert_eq!(compose_visible(Some("2,0"), &a), vec![2, 0]);
        assert_eq!(compose_visible(Some(" 1 "), &a), vec![1]);
        assert_eq!(
            compose_visible(Some("1,7,0"), &a),
            vec![1],
            "stops at an index the container lacks"
        );
        assert_eq!(
            compose_visible(Some("0,0,1"), &a),
            vec![0],
            "stops at a repeat"
        );
        assert_eq!(compose_visible(Some(""), &a), Vec::<usize>::new());
        assert_eq!(
            compose_visible(Some("GPU-10101010"), &a),
            vec![2],
            "UUID prefix"
        );
        assert_eq!(
            compose_visible(Some("GPU-a"), &a),
            Vec::<usize>::new(),
            "ambiguous prefix"
        );
        assert_eq!(compose_visible(Some("MIG-1,0"), &a), Vec::<usize>::new());
        let full = format_uuid(&a[1]).to_uppercase().replace("GPU", "gpu");
        assert_eq!(compose_visible(Some(&full), &a), vec![1]);
        // our own value composes to itself, so children and re-checks are idempotent
        let v = visible_value(&[2, 0], &a);
        assert_eq!(compose_visible(Some(&v), &a), vec![2, 0]);
    }
}
