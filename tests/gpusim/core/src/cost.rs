//! The kernel cost model: how long a launch keeps the simulated GPU busy.
//!
//! 1. A function whose name contains `_<N>ns`, `_<N>us` or `_<N>ms` (followed by the end of
//!    the name or by anything but a lowercase letter or digit, so the mangled
//!    `_Z9spin_50usPf` counts) runs for exactly that long per launch, whatever its grid.
//!    Tests use this to launch kernels of a known duration: `spin_1ms`, `work_50us`.
//! 2. Any other function runs in waves: a wave is as many blocks as the GPU holds at once
//!    (`sm_count × max(1, max_threads_per_sm / threads_per_block)`), and each wave costs
//!    `wave_ns` (config, default 5 µs). A 1-block kernel costs one wave.

/// Duration named in a function name, if any (the last such token wins).
pub fn duration_from_name(name: &str) -> Option<u64> {
    let b = name.as_bytes();
    let mut found = None;
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'_' {
            let mut j = i + 1;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            if j > i + 1 && j + 2 <= b.len() {
                let unit = &b[j..j + 2];
                let mult = match unit {
                    b"ns" => Some(1u64),
                    b"us" => Some(1_000),
                    b"ms" => Some(1_000_000),
                    _ => None,
                };
                let boundary = b
                    .get(j + 2)
                    .is_none_or(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit()));
                if let (Some(m), true) = (mult, boundary) {
                    if let Ok(n) = name[i + 1..j].parse::<u64>() {
                        found = Some(n.saturating_mul(m));
                    }
                }
            }
        }
        i += 1;
    }
    found
}

/// Device time of one launch.
pub fn kernel_duration_ns(
    name: &str,
    grid: [u32; 3],
    block: [u32; 3],
    sm_count: u32,
    max_threads_per_sm: u32,
    wave_ns: u64,
) -> u64 {
    if let Some(d) = duration_from_name(name) {
        return d;
    }
    let tpb = u64::from(block[0].max(1)) * u64::from(block[1].max(1)) * u64::from(block[2].max(1));
    let per_sm = (u64::from(max_threads_per_sm) / tpb).max(1);
    let concurrent = u64::from(sm_count.max(1)) * per_sm;
    let blocks = u64::from(grid[0].max(1)) * u64::from(grid[1].max(1)) * u64::from(grid[2].max(1));
    blocks.div_ceil(concurrent).saturating_mul(wave_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_give_durations() {
        assert_eq!(duration_from_name("spin_1ms"), Some(1_000_000));
        assert_eq!(duration_from_name("work_50us"), Some(50_000));
        assert_eq!(duration_from_name("k_20ms"), Some(20_000_000));
        assert_eq!(duration_from_name("_Z9spin_50usPf"), Some(50_000));
        assert_eq!(duration_from_name("tick_700ns"), Some(700));
        assert_eq!(duration_from_name("a_5ms_then_7us"), Some(7_000));
        assert_eq!(duration_from_name("vector_add"), None);
        assert_eq!(duration_from_name("run_10musical"), None);
        assert_eq!(duration_from_name("run_10usx"), None);
    }

    #[test]
    fn waves_scale_with_grid_and_sms() {
        // 108 SMs × (2048/256 = 8 blocks) = 864 blocks per wave
        assert_eq!(
            kernel_duration_ns("k", [864, 1, 1], [256, 1, 1], 108, 2048, 5000),
            5000
        );
        assert_eq!(
            kernel_duration_ns("k", [865, 1, 1], [256, 1, 1], 108, 2048, 5000),
            10_000
        );
        assert_eq!(
            kernel_duration_ns("k", [1, 1, 1], [1, 1, 1], 108, 2048, 5000),
            5000
        );
        // fewer SMs: more waves for the same grid
        assert_eq!(
            kernel_duration_ns("k", [864, 1, 1], [256, 1, 1], 54, 2048, 5000),
            10_000
        );
        assert_eq!(
            kernel_duration_ns("spin_3ms", [99999, 1, 1], [1024, 1, 1], 1, 32, 5000),
            3_000_000
        );
    }
}
