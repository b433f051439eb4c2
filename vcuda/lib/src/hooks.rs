//! The registry of hooks: every module's `HOOKS` (made by `hooks!`), searched by name for
//! `dlsym`, loaded at start-up, and indexed by the real function's address for
//! `cuGetProcAddress` (`hook`). Above every wrapper module: it names them all.

use std::ffi::{c_void, CStr};

use crate::hook::{cstr, Hook, Lib};

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

/// Index every hook by its real function's address (`hook::wrapper_for_real`).
pub fn index_real(lookup: &dyn Fn(Lib, &CStr) -> *mut c_void) {
    crate::hook::set_index(
        all()
            .filter_map(|h| {
                let p = lookup(h.lib, cstr(h.name));
                (!p.is_null()).then_some((p as usize, h.wrapper as usize))
            })
            .collect(),
    );
}
