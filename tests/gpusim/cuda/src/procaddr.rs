//! `cuGetProcAddress` / `cuGetProcAddress_v2` as the driver documents them: the base name,
//! CUDA version and flags select exactly one ABI variant ([`crate::procaddr_table`], generated
//! from the CUDA 12.9 and 13.x headers); an unknown or too-new symbol is `CUDA_SUCCESS` with a
//! NULL pointer and the reason in the status. Every variant of the table is exported, by hand or
//! as a generated `CUDA_ERROR_NOT_SUPPORTED` stub ([`crate::unsupported`]). Also the
//! error-string calls, which work before `cuInit`.

use std::ffi::{c_char, c_void, CString};
use std::sync::OnceLock;

use crate::errors::*;
use crate::ffi::*;
use crate::procaddr_table::{Variant, VARIANTS};

pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
pub const STATUS_SUCCESS: u32 = 0;
pub const STATUS_SYMBOL_NOT_FOUND: u32 = 1;
pub const STATUS_VERSION_NOT_SUFFICIENT: u32 = 2;

/// Which variant the driver hands out for `base` at `version`, or the status saying why
/// none. Pure: the table decides, nothing else.
pub fn select(
    table: &[Variant],
    base: &str,
    version: u32,
    per_thread: bool,
) -> Result<&'static str, u32>
where
{
    let all: Vec<&Variant> = table.iter().filter(|v| v.base == base).collect();
    if all.is_empty() {
        return Err(STATUS_SYMBOL_NOT_FOUND);
    }
    let normal = all
        .iter()
        .filter(|v| !v.per_thread && v.version <= version)
        .max_by_key(|v| v.version);
    let Some(normal) = normal else {
        return Err(STATUS_VERSION_NOT_SUFFICIENT);
    };
    if per_thread {
        // Only the per-thread form of exactly the ABI chosen above.
        let pt = all.iter().find(|v| {
            v.per_thread
                && v.version <= version
                && (v
                    .symbol
                    .strip_suffix("_ptsz")
                    .or_else(|| v.symbol.strip_suffix("_ptds"))
                    == Some(normal.symbol))
        });
        if let Some(pt) = pt {
            return Ok(leak(pt.symbol));
        }
    }
    Ok(leak(normal.symbol))
}

fn leak(s: &str) -> &'static str {
    // Symbols come from the static table, so this is a no-op lookup, not an allocation.
    VARIANTS
        .iter()
        .find(|v| v.symbol == s)
        .map_or("", |v| v.symbol)
}

/// The driver's CUDA version, for the "newer than the driver" check. cudart asks before
/// `cuInit`, so without a driver it is the configured version, as `cuDriverGetVersion`'s.
fn driver_version() -> i32 {
    match crate::driver::driver() {
        Ok(d) => d.st.config.cuda_version,
        Err(_) => crate::device::configured_cuda_version(),
    }
}

/// The address of the variant the table picks. gpusim exports every variant (an ABI it does not
/// implement, e.g. cuMemcpyBatchAsync_v2 at 13000, is a stub answering CUDA_ERROR_NOT_SUPPORTED);
/// a symbol missing from the export table would be "symbol not found" (CUDA_SUCCESS with a NULL
/// pointer), never an older ABI of the same base, whose signature the caller would get wrong.
fn resolve(name: &str, version: u32, per_thread: bool) -> Result<usize, u32> {
    select(VARIANTS, name, version, per_thread).and_then(|sym| {
        crate::symbols::table()
            .get(sym)
            .copied()
            .ok_or(STATUS_SYMBOL_NOT_FOUND)
    })
}

fn get_proc(
    symbol: CStrIn,
    pfn: Out<*mut c_void>,
    version: i32,
    flags: u64,
    status: Out<u32>,
) -> R {
    let name = symbol.get()?;
    if pfn.is_null() || flags & !3 != 0 || flags == 3 || version <= 0 || version > driver_version()
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    match resolve(name, version as u32, per_thread) {
        Ok(addr) => {
            pfn.write(addr as *mut c_void)?;
            status.write_opt(STATUS_SUCCESS);
        }
        Err(st) => {
            pfn.write(std::ptr::null_mut())?;
            status.write_opt(st);
        }
    }
    Ok(())
}

struct ErrStrings {
    codes: Vec<(CUresult, CString, CString)>,
}

fn strings() -> &'static ErrStrings {
    static S: OnceLock<ErrStrings> = OnceLock::new();
    S.get_or_init(|| ErrStrings {
        codes: ERRORS
            .iter()
            .map(|&(c, n, d)| {
                (
                    c,
                    CString::new(n).unwrap_or_default(),
                    CString::new(d).unwrap_or_default(),
                )
            })
            .collect(),
    })
}

fn err_str(err: CUresult, out: Out<*const c_char>, name: bool) -> R {
    match strings().codes.iter().find(|(c, _, _)| *c == err) {
        Some((_, n, d)) => out.write(if name { n.as_ptr() } else { d.as_ptr() }),
        None => {
            out.write_opt(std::ptr::null());
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

exports! {
    fn cuGetProcAddress(symbol: CStrIn, pfn: Out<*mut c_void>, version: i32, flags: u64) {
        get_proc(symbol, pfn, version, flags, Out::null())
    }
    fn cuGetProcAddress_v2(symbol: CStrIn, pfn: Out<*mut c_void>, version: i32, flags: u64, status: Out<u32>) {
        get_proc(symbol, pfn, version, flags, status)
    }
    fn cuGetErrorString(err: CUresult, out: Out<*const c_char>) {
        err_str(err, out, false)
    }
    fn cuGetErrorName(err: CUresult, out: Out<*const c_char>) {
        err_str(err, out, true)
    }
    fn cuGetExportTable(table: Out<*const c_void>, id: In<CUuuid>) {
        // The driver-private tables the CUDA runtime needs (crate::export).
        crate::export::get_export_table(table, id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_and_stream_flags_pick_the_variant() {
        assert_eq!(
            select(VARIANTS, "cuMemAlloc", 2000, false),
            Ok("cuMemAlloc")
        );
        assert_eq!(
            select(VARIANTS, "cuMemAlloc", 3020, false),
            Ok("cuMemAlloc_v2")
        );
        assert_eq!(
            select(VARIANTS, "cuMemAlloc", 12090, true),
            Ok("cuMemAlloc_v2")
        );
        assert_eq!(
            select(VARIANTS, "cuLaunchKernel", 12000, false),
            Ok("cuLaunchKernel")
        );
        assert_eq!(
            select(VARIANTS, "cuLaunchKernel", 12000, true),
            Ok("cuLaunchKernel_ptsz")
        );
        assert_eq!(
            select(VARIANTS, "cuLaunchKernel", 6000, true),
            Ok("cuLaunchKernel")
        );
        assert_eq!(
            select(VARIANTS, "cuMemcpyHtoD", 12000, true),
            Ok("cuMemcpyHtoD_v2_ptds")
        );
        assert_eq!(
            select(VARIANTS, "cuCtxCreate", 12090, false),
            Ok("cuCtxCreate_v4")
        );
        assert_eq!(
            select(VARIANTS, "cuCtxCreate", 12000, false),
            Ok("cuCtxCreate_v3")
        );
        assert_eq!(
            select(VARIANTS, "cuLaunchKernelEx", 11000, false),
            Err(STATUS_VERSION_NOT_SUFFICIENT)
        );
        assert_eq!(
            select(VARIANTS, "cuNoSuchThing", 12000, false),
            Err(STATUS_SYMBOL_NOT_FOUND)
        );
        assert_eq!(
            select(VARIANTS, "cuGetProcAddress", 12000, false),
            Ok("cuGetProcAddress_v2")
        );
    }

    #[test]
    fn cuda13_abis_are_chosen_from_13000() {
        assert_eq!(
            select(VARIANTS, "cuCtxGetDevice", 12090, false),
            Ok("cuCtxGetDevice")
        );
        assert_eq!(
            select(VARIANTS, "cuCtxGetDevice", 13000, false),
            Ok("cuCtxGetDevice_v2")
        );
        assert_eq!(
            select(VARIANTS, "cuCtxSynchronize", 13050, true),
            Ok("cuCtxSynchronize_v2")
        );
        assert_eq!(
            select(VARIANTS, "cuMemGetMemPool", 12090, false),
            Err(STATUS_VERSION_NOT_SUFFICIENT)
        );
        for base in [
            "cuMemGetDefaultMemPool",
            "cuMemGetMemPool",
            "cuMemSetMemPool",
        ] {
            assert_eq!(select(VARIANTS, base, 13000, false), Ok(base));
        }
        assert_eq!(
            select(VARIANTS, "cuLaunchHostFunc", 13010, true),
            Ok("cuLaunchHostFunc_v2_ptsz")
        );
        assert_eq!(
            select(VARIANTS, "cuLaunchHostFunc", 13000, true),
            Ok("cuLaunchHostFunc_ptsz")
        );
        for sym in [
            "cuCtxGetDevice_v2",
            "cuCtxSynchronize_v2",
            "cuMemGetDefaultMemPool",
            "cuMemGetMemPool",
            "cuMemSetMemPool",
        ] {
            assert!(
                crate::symbols::table().contains_key(sym),
                "{sym} is exported"
            );
        }
    }

    /// Every variant of the table is a function gpusim exports (hand-written or a generated stub
    /// of crate::unsupported), so cuGetProcAddress never hands out NULL for a known variant.
    #[test]
    fn every_variant_is_exported() {
        let missing: Vec<&str> = VARIANTS
            .iter()
            .map(|v| v.symbol)
            .filter(|s| !crate::symbols::table().contains_key(s))
            .collect();
        assert!(missing.is_empty(), "not exported: {missing:?}");
        for v in VARIANTS {
            assert_eq!(
                resolve(v.base, v.version, v.per_thread),
                Ok(crate::symbols::table()[v.symbol]),
                "{v:?}"
            );
        }
    }

    /// A 13.x ABI gpusim only stubs is that stub (CUDA_ERROR_NOT_SUPPORTED when called), never
    /// its older ABI, whose signature the caller would get wrong.
    #[test]
    fn newer_abi_is_never_an_older_one() {
        let sym = |s: &str| crate::symbols::table()[s];
        assert_eq!(
            resolve("cuLaunchHostFunc", 13000, true),
            Ok(sym("cuLaunchHostFunc_ptsz"))
        );
        assert_eq!(
            select(VARIANTS, "cuLaunchHostFunc", 13010, false),
            Ok("cuLaunchHostFunc_v2")
        );
        assert_eq!(
            resolve("cuLaunchHostFunc", 13010, false),
            Ok(sym("cuLaunchHostFunc_v2"))
        );
        assert_ne!(sym("cuLaunchHostFunc_v2"), sym("cuLaunchHostFunc"));
        assert_eq!(
            resolve("cuGraphAddNode", 13030, false),
            Ok(sym("cuGraphAddNode_v2"))
        );
        assert_eq!(
            resolve("cuGraphAddNode", 13040, false),
            Ok(sym("cuGraphAddNode_v3"))
        );
        assert_eq!(
            resolve("cuMemGetMemPool", 13000, false),
            Ok(sym("cuMemGetMemPool"))
        );
    }
}
