//! libvcuda.so: loaded into every CUDA process of a container (LD_PRELOAD or
//! `/etc/ld.so.preload`), it wraps the CUDA driver API and NVML to hold the container to its
//! device-memory quota and to show it a GPU the size of that quota.
//!
//! Code map (ARCHITECTURE.md has the invariants):
//! - [`hooks`] + the `hooks!` macro: each hook declared once — exported symbol, typed pointer
//!   to the real function, and the entry `dlsym` / `cuGetProcAddress` substitution uses.
//! - [`dlsym`]: the `dlsym` hook (a naked trampoline that tail-jumps to the real `dlsym`, so
//!   `RTLD_NEXT` keeps its caller) and the loading of the real libraries.
//! - [`state`]: the process-wide state (`Vcuda`, private fields behind methods that keep the
//!   books) and `vc()`/`cuda()`/`nvml()`, which every wrapper starts from; below the wrappers.
//! - [`init`]: making that state on the first CUDA/NVML call (fails closed), the library
//!   constructor, the background threads; the top: it names every module ([`LIFECYCLE`]).
//! - [`hook`]: what one hook is, and the real address → wrapper index; [`visible`]: which
//!   GPUs the driver shows; [`buckets`]: the limiter's per-process state.
//! - [`table`]: the lock-free pointer → size table of live allocations.
//! - [`limit`]: the compute limiter's launch hooks, token buckets and controller thread
//!   (its maths is the `vcuda-limiter` crate).
//! - [`quota`]: the memory quota's rules as safe operations over a `Driver` and the `Books`
//!   (unit- and property-tested against fakes); [`memory`]'s shells call them.
//! - [`memory`], [`context`], [`info`], [`nvml`], [`procaddr`]: the wrappers.
//! - [`register`]: each process introduces itself to the manager over the control socket,
//!   on a thread of its own, retrying with back-off.
//! - [`capi`]: `vcuda_*`, the library's own C API (`include/vcuda.h`, cbindgen).
//! - [`conv`]: the integer conversions at the C boundary (the crate denies clippy's cast
//!   lints; these are the only casts that may lose anything, each named).

#![allow(non_snake_case)]
#![deny(unsafe_op_in_unsafe_fn)]
// Values cross the C boundary on almost every line: no `as` may truncate, wrap or drop a
// sign silently (`conv` holds the conversions, each total and named).
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::cast_lossless
)]

/// Declare hooks. Each `Lib fn name(args) -> Ret => path::to::impl;` becomes
/// - `#[no_mangle] pub unsafe extern "C" fn name(args) -> Ret`, calling `impl(args)` under
///   [`ffi::catch`] (a panic returns 999, "unknown error", never unwinds into C);
/// - a field `Real::name` holding the real library's function of that name;
/// - an entry in this module's `HOOKS`, which `dlsym` and `cuGetProcAddress` substitute.
///
/// `=> impl [bypass];` (kernel launches): before anything else the shell asks
/// [`limit::bypass`] (which never panics, starts nothing and calls no driver function). A
/// launch admitted there tail-calls the real function with the caller's arguments untouched
/// (no frame, no catch: nothing of ours runs after it); any other goes to `impl(args)`
/// under the catch as above.
macro_rules! hooks {
    ($( $(#[$m:meta])* $lib:ident fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty => $imp:path $([$bypass:ident])?; )*) => {
        $(
            hook_shell!($(#[$m])* $name ($($arg: $ty),*) -> $ret => $imp $([$bypass])?);
        )*

        /// The real library's functions the hooks of this module wrap.
        #[allow(non_snake_case)]
        pub(crate) struct Real {
            $( pub $name: Option<unsafe extern "C" fn($($ty),*) -> $ret>, )*
        }

        pub(crate) static REAL: std::sync::OnceLock<Real> = std::sync::OnceLock::new();

        /// The real functions (loaded by `init` before any wrapper forwards a call).
        #[inline(always)]
        #[allow(dead_code)]
        pub(crate) fn real() -> &'static Real {
            REAL.get().expect("libvcuda: real functions used before start-up")
        }

        /// Look this module's wrapped functions up in the real libraries.
        #[allow(unused_variables)]
        pub(crate) fn load_real(lookup: &dyn Fn($crate::hook::Lib, &std::ffi::CStr) -> *mut std::ffi::c_void) {
            let _ = REAL.set(Real {
                $( $name: {
                    let p = lookup($crate::hook::Lib::$lib, $crate::hook::cstr(concat!(stringify!($name), "\0")));
                    if p.is_null() {
                        None
                    } else {
                        // SAFETY: the real library's symbol of this name has exactly this
                        // signature, the official header's (the ABI test checks ours).
                        Some(unsafe { std::mem::transmute::<*mut std::ffi::c_void, unsafe extern "C" fn($($ty),*) -> $ret>(p) })
                    }
                }, )*
            });
        }

        /// This module's hooks.
        pub(crate) static HOOKS: &[$crate::hook::Hook] = &[
            $( $crate::hook::Hook {
                name: concat!(stringify!($name), "\0"),
                lib: $crate::hook::Lib::$lib,
                wrapper: $name as *const (),
            }, )*
        ];
    };
}

/// One exported shell of `hooks!` (its own macro so the optional `[bypass]` repeats apart
/// from the arguments).
macro_rules! hook_shell {
    ($(#[$m:meta])* $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty => $imp:path) => {
        $(#[$m])*
        /// # Safety
        /// Called from C with arguments as the official header documents them.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // SAFETY: the caller upholds the C API contract for these arguments, which is
            // all the implementation relies on.
            $crate::ffi::catch(move || unsafe { $imp($($arg),*) })
        }
    };
    ($(#[$m:meta])* $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty => $imp:path [bypass]) => {
        $(#[$m])*
        /// # Safety
        /// Called from C with arguments as the official header documents them.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // Out of line and with the shell's own signature: whichever function is chosen
            // is tail-called with the arguments untouched, so the admitted path needs no
            // frame.
            #[cold]
            #[inline(never)]
            unsafe extern "C" fn wrapped($($arg: $ty),*) -> $ret {
                // SAFETY: as for every hook: the caller upholds the C API contract.
                $crate::ffi::catch(move || unsafe { $imp($($arg),*) })
            }
            let target = match REAL.get().and_then(|r| r.$name) {
                Some(f) if $crate::limit::bypass() => f,
                _ => wrapped,
            };
            // SAFETY: the caller's arguments, unchanged, to the real function of the same
            // signature (C: it cannot unwind, so no catch is needed) or to our wrapper.
            unsafe { target($($arg),*) }
        }
    };
}

/// Call the real function of a hook, or return `$missing` when the real library lacks it.
macro_rules! forward {
    ($missing:expr, $name:ident ( $($arg:expr),* $(,)? )) => {
        match real().$name {
            // SAFETY: forwarding the caller's arguments unchanged to the real function of the
            // same signature.
            Some(f) => unsafe { f($($arg),*) },
            None => $missing,
        }
    };
}

/// Declare real functions libvcuda calls for itself without wrapping them:
/// `Lib fn name(types) -> Ret;` becomes a field of `Ext`, loaded at start-up, and
/// `ext!(missing, name(args))` calls it (or yields `missing` if the library lacks it).
macro_rules! externs {
    ($( $lib:ident fn $name:ident ( $($ty:ty),* $(,)? ) -> $ret:ty; )*) => {
        #[allow(non_snake_case, dead_code)]
        pub(crate) struct Ext {
            $( pub $name: Option<unsafe extern "C" fn($($ty),*) -> $ret>, )*
        }

        pub(crate) static EXT: std::sync::OnceLock<Ext> = std::sync::OnceLock::new();

        #[inline(always)]
        pub(crate) fn ext() -> &'static Ext {
            EXT.get().expect("libvcuda: real functions used before start-up")
        }

        pub(crate) fn load_ext(lookup: &dyn Fn($crate::hook::Lib, &std::ffi::CStr) -> *mut std::ffi::c_void) {
            let _ = EXT.set(Ext {
                $( $name: {
                    let p = lookup($crate::hook::Lib::$lib, $crate::hook::cstr(concat!(stringify!($name), "\0")));
                    if p.is_null() {
                        None
                    } else {
                        // SAFETY: the real library's symbol of this name has this signature
                        // (the official header's).
                        Some(unsafe { std::mem::transmute::<*mut std::ffi::c_void, unsafe extern "C" fn($($ty),*) -> $ret>(p) })
                    }
                }, )*
            });
        }
    };
}

/// Call a real function declared with `externs!`.
macro_rules! ext {
    ($missing:expr, $name:ident ( $($arg:expr),* $(,)? )) => {
        match $crate::drv::ext().$name {
            // SAFETY: the arguments are valid for the real function as its header documents.
            Some(f) => unsafe { f($($arg),*) },
            None => $missing,
        }
    };
}

pub mod buckets;
pub mod capi;
pub mod context;
pub mod conv;
pub mod costs;
pub mod dlsym;
pub mod drv;
pub mod ffi;
pub mod hook;
pub mod hooks;
pub mod info;
pub mod init;
pub mod limit;
pub mod log;
pub mod memory;
pub mod nvml;
pub mod pools;
pub mod procaddr;
pub mod quota;
pub mod register;
pub mod state;
pub mod table;
pub mod visible;

/// How `state` makes the process state on the first CUDA/NVML call and renews it in a forked
/// child: `init`'s, which needs every module. Named here, at the root, so that `state`
/// (below every wrapper) names nothing above it.
pub(crate) static LIFECYCLE: state::Lifecycle = state::Lifecycle {
    start: init::start,
    after_fork: init::after_fork,
    measure_hidden: context::reconcile,
};
