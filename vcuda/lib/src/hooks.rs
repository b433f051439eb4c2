//! The registry of hooks: every module's `HOOKS` (made by `hooks!`), searched by name for
//! `dlsym` and by the real function's address for `cuGetProcAddress`.

use std::ffi::{c_void, CStr};
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

/// Every module's hooks.
pub fn all() -> impl Iterator<Item = &'static Hook> {
    [
        crate::memory::HOOKS,
        crate::limit::HOOKS,
        crate::context::HOOKS,
        crate::info::HOOKS,
        crate::nvml::HOOKS,
        crate::procaddr::HOOKS,
    ]
    .into_iter()
    .flatten()
}

/// The hook for `name` (bytes without the NUL). Allocation-free: `dlsym` may call this at any
/// moment, even from inside `malloc`.
pub fn by_name(name: &[u8]) -> Option<&'static Hook> {
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return None;
    }
    all().find(|h| &h.name.as_bytes()[..h.name.len() - 1] == name)
}

/// Load every module's real functions through `lookup`.
pub fn load_all(lookup: &dyn Fn(Lib, &CStr) -> *mut c_void) {
    crate::drv::load_ext(lookup);
    crate::memory::load_real(lookup);
    crate::limit::load_real(lookup);
    crate::context::load_real(lookup);
    crate::info::load_real(lookup);
    crate::nvml::load_real(lookup);
    crate::procaddr::load_real(lookup);
}

/// Real function address → our wrapper, sorted by address (built at start-up).
static BY_REAL: OnceLock<Vec<(usize, usize)>> = OnceLock::new();

pub fn index_real(lookup: &dyn Fn(Lib, &CStr) -> *mut c_void) {
    let mut v: Vec<(usize, usize)> = all()
        .filter_map(|h| {
            let p = lookup(h.lib, cstr(h.name));
            (!p.is_null()).then_some((p as usize, h.wrapper as usize))
        })
        .collect();
    v.sort_unstable();
    let _ = BY_REAL.set(v);
}

/// Our wrapper for the real function at `addr`, if we wrap it.
pub fn wrapper_for_real(addr: usize) -> Option<usize> {
    let v = BY_REAL.get()?;
    v.binary_search_by_key(&addr, |e| e.0).ok().map(|i| v[i].1)
}
