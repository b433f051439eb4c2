//! gpusim's `libcuda.so.1`: the CUDA driver API over the simulated GPUs of gpusim-core.
//!
//! Every export is declared once with the [`exports!`] macro: a `#[no_mangle] extern "C"`
//! function with the exact `cuda.h` signature, a thin shell over a safe body returning
//! `Result<(), CUresult>`, run under [`ffi::guard`] so no panic reaches C. The same macro
//! lists the export for `cuGetProcAddress`, which resolves names through
//! [`procaddr_table`] (generated from `cudaTypedefs.h`) and [`symbols`]. Every other function
//! the CUDA 12.9 and 13.x `cuda.h` declare is a generated stub in [`unsupported`]
//! (`scripts/gen-cuda-stubs`): `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`, else
//! `CUDA_ERROR_NOT_SUPPORTED`.
//!
//! Invariants:
//! - Device memory is charged to the shared state before an allocation succeeds and given
//!   back on every free, context destruction and process exit, so `gpusim status` is exact.
//! - Device time is spent only on the shared timeline (gpusim-core); nothing here sleeps to
//!   simulate work, only to wait for it.
//! - This crate knows nothing of libvcuda and shares no code with it.

// Exported names follow the CUDA API, not Rust naming.
#![allow(non_snake_case)]
#![deny(unsafe_op_in_unsafe_fn)]

/// Declare driver entry points. Each `fn name(args) { body }` becomes
/// `#[no_mangle] pub unsafe extern "C" fn name(args) -> CUresult`, and the module gets a
/// `register` function listing its exports for `cuGetProcAddress`.
macro_rules! exports {
    ($( $(#[$m:meta])* fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {
        $(
            $(#[$m])*
            /// # Safety
            /// Called from C with arguments as `cuda.h` documents them.
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> $crate::errors::CUresult {
                $crate::ffi::guard(move || -> $crate::ffi::R { $body })
            }
        )*
        /// This module's exports, for the symbol table `cuGetProcAddress` searches.
        pub(crate) fn register(m: &mut Vec<(&'static str, usize)>) {
            $( m.push((stringify!($name), $name as *const () as usize)); )*
        }
    };
}

pub mod array;
pub mod context;
pub mod device;
pub mod driver;
pub mod errors;
pub mod export;
pub mod ffi;
pub mod graph;
pub mod integrity;
pub mod launch;
pub mod memory;
pub mod module;
pub mod pool;
pub mod procaddr;
pub mod procaddr_table;
pub mod stream;
pub mod symbols;
pub mod unsupported;
pub mod va;
pub mod vmm;
