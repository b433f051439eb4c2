//! `CUDA_VISIBLE_DEVICES`, as the CUDA driver reads it at `cuInit` (NVML ignores it).
//!
//! The value is a comma-separated list. Each entry, whitespace around it ignored, is a
//! device index in the config's order or a GPU UUID (`GPU-…`, case-insensitive), which may
//! be shortened to any prefix of at least `GPU-` and one hex digit that names exactly one
//! GPU. The list is read up to its first invalid entry — an index out of range, a UUID
//! (prefix) that names no GPU or more than one, a GPU already listed, anything else — and
//! that entry and all after it are ignored.

use crate::config::GpuConfig;

/// The GPUs `spec` makes visible: config indices, in visible-ordinal order (entry `i` is
/// the GPU the application sees as device `i`). Empty when the first entry is invalid
/// (including `spec` empty), which the driver reports as `CUDA_ERROR_NO_DEVICE`.
pub fn visible_devices(spec: &str, gpus: &[GpuConfig]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for entry in spec.split(',') {
        match entry_gpu(entry.trim(), gpus) {
            Some(g) if !out.contains(&g) => out.push(g),
            _ => break,
        }
    }
    out
}

/// The GPU one entry names, if it names exactly one.
fn entry_gpu(entry: &str, gpus: &[GpuConfig]) -> Option<usize> {
    const PREFIX: &str = "GPU-";
    let is_uuid = entry
        .get(..PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(PREFIX));
    if is_uuid {
        if entry.len() == PREFIX.len() {
            return None;
        }
        let want = entry.to_ascii_lowercase();
        let mut hits = gpus
            .iter()
            .enumerate()
            .filter(|(_, g)| g.uuid.to_ascii_lowercase().starts_with(&want))
            .map(|(i, _)| i);
        let first = hits.next()?;
        return hits.next().is_none().then_some(first);
    }
    if entry.is_empty() || !entry.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    entry.parse::<usize>().ok().filter(|&i| i < gpus.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus() -> Vec<GpuConfig> {
        let base = crate::Config::default_config().gpu[0].clone();
        [
            "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401",
            "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402",
            "GPU-b0000000-0000-0000-0000-000000000003",
        ]
        .iter()
        .map(|u| GpuConfig {
            uuid: u.to_string(),
            ..base.clone()
        })
        .collect()
    }

    fn vis(spec: &str) -> Vec<usize> {
        visible_devices(spec, &gpus())
    }

    #[test]
    fn indices_in_the_order_given() {
        assert_eq!(vis("0,1,2"), [0, 1, 2]);
        assert_eq!(vis("2,0"), [2, 0]);
        assert_eq!(vis(" 1 ,\t2 "), [1, 2]);
        assert_eq!(vis("1"), [1]);
    }

    #[test]
    fn uuids_and_unique_prefixes() {
        assert_eq!(vis("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d402"), [1]);
        assert_eq!(vis("gpu-5A1C2E4F-0D3B-4C8A-9E61-7B2F10C3D402,0"), [1, 0]);
        assert_eq!(vis("GPU-b"), [2]);
        assert_eq!(vis("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401"), [0]);
        assert_eq!(vis("2,GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d40"), [2]);
    }

    #[test]
    fn ambiguous_or_unknown_uuid_is_invalid() {
        assert_eq!(vis("GPU-5a"), Vec::<usize>::new());
        assert_eq!(vis("GPU-"), Vec::<usize>::new());
        assert_eq!(vis("0,GPU-5a1c2e4f,2"), [0]);
        assert_eq!(vis("GPU-c"), Vec::<usize>::new());
        assert_eq!(vis("1,GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d4011"), [1]);
        assert_eq!(vis("MIG-5a1c2e4f"), Vec::<usize>::new());
    }

    #[test]
    fn parsing_stops_at_the_first_invalid_entry() {
        assert_eq!(vis("1,junk,2"), [1]);
        assert_eq!(vis("0,3,1"), [0]);
        assert_eq!(vis("2,-1,0"), [2]);
        assert_eq!(vis("1,,2"), [1]);
        assert_eq!(vis("0,1x"), [0]);
        assert_eq!(vis("+1"), Vec::<usize>::new());
        assert_eq!(vis("99999999999999999999999"), Vec::<usize>::new());
    }

    #[test]
    fn a_duplicate_is_invalid() {
        assert_eq!(vis("1,1,2"), [1]);
        assert_eq!(vis("0,GPU-b,2,1"), [0, 2]);
        assert_eq!(
            vis("2,GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401,0,1"),
            [2, 0]
        );
    }

    #[test]
    fn empty_hides_every_gpu() {
        assert_eq!(vis(""), Vec::<usize>::new());
        assert_eq!(vis("  "), Vec::<usize>::new());
        assert_eq!(vis(",0"), Vec::<usize>::new());
        assert_eq!(vis("junk,0"), Vec::<usize>::new());
        assert_eq!(visible_devices("0", &[]), Vec::<usize>::new());
    }
}
