//! What one hook is (which real library, its name, our wrapper: made by `hooks!`), and the
//! index from a real function's address to our wrapper of it, which `cuGetProcAddress`
//! reads (`procaddr`). Below every wrapper module: `hooks` fills the index from them all.

use std::ffi::CStr;
use std::sync::OnceLock;

/// Which real library a hooked symbol comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lib {
    Cuda,
    Nvml,
}

/// One hooked symbol.
pub struct Hook {
    /// The symbol name, NUL-terminated.
    pub name: &'static str,
    pub lib: Lib,
    /// Our exported wrapper.
    pub wrapper: *const (),
}

// SAFETY: a Hook is immutable static data; the pointer is a function address.
unsafe impl Sync for Hook {}

/// A NUL-terminated literal as a CStr (the hooks! macro passes `concat!(name, "\0")`).
pub const fn cstr(s: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(s.as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("hook names are NUL-terminated"),
    }
}

/// Real function address → our wrapper, sorted by address (built at start-up).
static BY_REAL: OnceLock<Vec<(usize, usize)>> = OnceLock::new();

/// Keep the index (real address, wrapper address); set once, at start-up.
pub fn set_index(mut by_real: Vec<(usize, usize)>) {
    by_real.sort_unstable();
    let _ = BY_REAL.set(by_real);
}

/// Our wrapper for the real function at `addr`, if we wrap it.
pub fn wrapper_for_real(addr: usize) -> Option<usize> {
    let v = BY_REAL.get()?;
    v.binary_search_by_key(&addr, |e| e.0).ok().map(|i| v[i].1)
}
