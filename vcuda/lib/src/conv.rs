//! Integer conversions at the C boundary, each total and named for what it does, so no `as`
//! in the library can silently truncate or wrap a value the C side gave or will read (the
//! crate denies clippy's cast lints; these are the only places that allow them, each with
//! its reason). All are `#[inline(always)]` and compile to at most a compare and a move.

#[cfg(not(target_pointer_width = "64"))]
compile_error!("libvcuda is built for 64-bit targets only (as is CUDA's driver)");

/// A size or count from the library's `u64` arithmetic into a C `size_t`: lossless on the
/// 64-bit targets the library is built for (checked above).
#[inline(always)]
pub fn usize_of(x: u64) -> usize {
    usize::try_from(x).unwrap_or(usize::MAX)
}

/// A `size_t` from C into the library's `u64` arithmetic: lossless (64-bit targets).
#[inline(always)]
pub fn u64_of(x: usize) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

/// A count or size for a C `unsigned int`: saturates at `u32::MAX` (what the 32-bit entry
/// points and NVML's counts can say).
#[inline(always)]
pub fn u32_sat(x: impl TryInto<u32>) -> u32 {
    x.try_into().unwrap_or(u32::MAX)
}

/// A count for a C `int`: saturates at `i32::MAX`.
#[inline(always)]
pub fn i32_sat(x: impl TryInto<i32>) -> i32 {
    x.try_into().unwrap_or(i32::MAX)
}

/// Nanoseconds (a launch's cost, a price) as a signed bucket balance: saturates at
/// `i64::MAX` (292 years; prices are at most `vcuda_limiter::MAX_COST_NS`, 10 s).
#[inline(always)]
pub fn signed(x: u64) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

/// A balance or an amount that is never negative as unsigned: a negative one is 0.
#[inline(always)]
pub fn unsigned(x: i64) -> u64 {
    u64::try_from(x).unwrap_or(0)
}

/// A clamped `i128` (a difference of two `u64` totals) as `u64`: below 0 is 0.
#[inline(always)]
pub fn u64_clamped(x: i128) -> u64 {
    u64::try_from(x.max(0)).unwrap_or(u64::MAX)
}

/// A float (an estimate in ns, a fraction in ppm) as `u64`: Rust's float-to-integer `as`
/// saturates by definition (negative and NaN to 0, beyond the range to `u64::MAX`), which
/// is exactly what is wanted.
#[inline(always)]
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
pub fn f64_to_u64(x: f64) -> u64 {
    x as u64
}

/// A float as `i64`, saturating (NaN to 0) by the language's definition of `as`.
#[inline(always)]
#[allow(clippy::cast_possible_truncation)]
pub fn f64_to_i64(x: f64) -> i64 {
    x as i64
}

/// The low 32 bits of a packed pair (e.g. a slot id's generation).
#[inline(always)]
#[allow(clippy::cast_possible_truncation)]
pub fn low32(x: u64) -> u32 {
    x as u32
}

/// A config index (below `vcuda_contract::config::MAX_GPUS`, 16) as the pointer table's GPU
/// byte.
#[inline(always)]
pub fn dev_u8(dev: usize) -> u8 {
    u8::try_from(dev).unwrap_or(u8::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_saturate_instead_of_wrapping() {
        assert_eq!(u32_sat(5_000_000_000u64), u32::MAX);
        assert_eq!(u32_sat(7usize), 7);
        assert_eq!(i32_sat(3_000_000_000u64), i32::MAX);
        assert_eq!(signed(u64::MAX), i64::MAX);
        assert_eq!(signed(20_000_000), 20_000_000);
        assert_eq!(unsigned(-5), 0);
        assert_eq!(u64_clamped(-1), 0);
        assert_eq!(u64_clamped(i128::from(u64::MAX) + 1), u64::MAX);
        assert_eq!(f64_to_u64(-1.0), 0);
        assert_eq!(f64_to_u64(f64::NAN), 0);
        assert_eq!(f64_to_u64(1e30), u64::MAX);
        assert_eq!(f64_to_i64(-2.5), -2);
        assert_eq!(low32(0x1234_5678_9abc_def0), 0x9abc_def0);
        assert_eq!(dev_u8(300), u8::MAX);
        assert_eq!(usize_of(1 << 40), 1 << 40);
    }
}
