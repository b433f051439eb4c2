//! Reaching the real libraries, and the `dlsym` hook.
//!
//! Programs that `dlopen("libcuda.so.1")` and `dlsym` their entry points bypass LD_PRELOAD
//! interposition, so libvcuda exports `dlsym` itself. The export is a naked trampoline: it
//! asks [`decide`] whether the lookup is for a hooked CUDA/NVML symbol of the real libraries
//! and returns our wrapper if so; otherwise it *tail-jumps* to the real `dlsym` with the
//! caller's return address still on the stack, so `RTLD_NEXT` searches after the caller, not
//! after libvcuda, and every other lookup behaves exactly as without us.
//!
//! `decide` never allocates and takes no lock: `dlsym` can be called from anywhere,
//! including another interposer's `malloc`.

use std::cell::Cell;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

use crate::hooks;

thread_local! {
    /// Set while libvcuda itself looks symbols up, so our own dlsym hook stays out of it.
    static OWN_LOOKUP: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is inside [`with_own_lookup`] (or its thread-locals are gone).
pub fn in_own_lookup() -> bool {
    OWN_LOOKUP.try_with(|c| c.get()).unwrap_or(true)
}

/// Run `f` (libvcuda's own lookups: start-up) with our dlsym hook out of the way.
pub fn with_own_lookup<T>(f: impl FnOnce() -> T) -> T {
    let _ = OWN_LOOKUP.try_with(|c| c.set(true));
    let r = f();
    let _ = OWN_LOOKUP.try_with(|c| c.set(false));
    r
}

/// The real `dlsym`, found with `dlvsym` (never through ourselves). Read by the trampoline.
static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

fn find_real_dlsym() -> usize {
    let cached = REAL_DLSYM.load(Relaxed);
    if cached != 0 {
        return cached;
    }
    // glibc ≥ 2.34 has dlsym@@GLIBC_2.34; older ones only the architecture's base version.
    let versions: &[&[u8]] = &[
        b"GLIBC_2.34\0",
        b"GLIBC_2.2.5\0",
        b"GLIBC_2.17\0",
        b"GLIBC_2.0\0",
    ];
    for v in versions {
        // SAFETY: dlvsym with RTLD_NEXT and NUL-terminated names; it does not call dlsym.
        let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr().cast()) };
        if !p.is_null() {
            REAL_DLSYM.store(p as usize, Relaxed);
            return p as usize;
        }
    }
    // No dlsym at all cannot happen in a dynamically linked process; fail loudly rather than
    // jump to address 0.
    crate::log::line("vcuda: cannot find the real dlsym; aborting");
    std::process::abort();
}

/// Call the real `dlsym` (for libvcuda's own lookups).
///
/// # Safety
/// `handle` is a handle `dlopen` returned (and not closed), or a pseudo-handle.
pub unsafe fn real_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    let f = find_real_dlsym();
    // SAFETY: f is glibc's dlsym; the caller vouches for the handle, name is NUL-terminated.
    unsafe { std::mem::transmute::<usize, DlsymFn>(f)(handle, name.as_ptr()) }
}

/// The file name of the library `addr` lies in (without its directory), if any.
fn library_of(addr: *mut c_void) -> Option<&'static [u8]> {
    // SAFETY: Dl_info is plain data dladdr fills in.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader, which keeps it while
    // the library is loaded (a real driver library is never unloaded).
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes();
    Some(path.rsplit(|&b| b == b'/').next().unwrap_or(path))
}

/// The real libraries' usual file names (prefixes: `libcuda.so.1`, `libcuda.so.550.54`).
const DEFAULT_PREFIXES: [&[u8]; 2] = [b"libcuda.so", b"libnvidia-ml.so"];

/// The file names the config gives the real libraries (`cuda_library`, `nvml_library`),
/// set by the library constructor and at start ([`set_real_libraries`]). Read lock-free.
static CONFIGURED: OnceLock<[Box<[u8]>; 2]> = OnceLock::new();

/// Note the config's names for the real libraries: a lookup in a library of that name is a
/// lookup in the real driver, whatever it is called (before, only the usual names counted,
/// so a driver configured as, say, `libcuda-vendor.so.1` escaped the hook for `dlsym` on
/// its handle).
pub fn set_real_libraries(cuda: &str, nvml: &str) {
    let base = |s: &str| -> Box<[u8]> {
        let b = s.as_bytes();
        b.rsplit(|&c| c == b'/').next().unwrap_or(b).into()
    };
    let _ = CONFIGURED.set([base(cuda), base(nvml)]);
}

/// Whether a library file named `base` is one of the real libraries: a usual name, or the
/// config's.
fn is_real_library(base: &[u8], configured: Option<&[Box<[u8]>; 2]>) -> bool {
    DEFAULT_PREFIXES.iter().any(|p| base.starts_with(p))
        || configured.is_some_and(|c| c.iter().any(|n| !n.is_empty() && **n == *base))
}

/// What our `dlsym` returns instead of the real one: our wrapper for a hooked CUDA/NVML
/// symbol looked up in the real libraries (or globally), else 0 = "ask the real dlsym".
extern "C" fn decide(handle: *mut c_void, name: *const c_char) -> usize {
    find_real_dlsym();
    if name.is_null() || in_own_lookup() {
        return 0;
    }
    // SAFETY: dlsym's contract: name is a NUL-terminated string.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    let Some(hook) = hooks::by_name(bytes) else {
        return 0;
    };
    if handle.is_null() || handle == libc::RTLD_NEXT {
        // A global or next-object lookup of a hooked name would reach us or the real driver.
        return hook.wrapper as usize;
    }
    // A specific handle: substitute only if that handle resolves the name in the real
    // libraries (a handle to libcuda, or to a library that depends on it).
    // SAFETY: the application passed this handle to dlsym, which requires it to be valid;
    // name is NUL-terminated (above).
    let p = unsafe { real_dlsym(handle, CStr::from_ptr(name)) };
    if p.is_null() {
        return 0; // let the real dlsym report the failure through dlerror
    }
    if std::ptr::eq(p as *const (), hook.wrapper)
        || library_of(p).is_some_and(|b| is_real_library(b, CONFIGURED.get()))
    {
        hook.wrapper as usize
    } else {
        p as usize
    }
}

/// The exported `dlsym` (x86_64).
///
/// # Safety
/// Called as `dlsym(3)`.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // rdi = handle, rsi = symbol, [rsp] = the caller's return address. Keep the arguments,
    // call decide with the stack 16-byte aligned, then either return its answer or jump to
    // the real dlsym with the original arguments and return address.
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {decide}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "ret",
        "2:",
        "jmp qword ptr [rip + {real}]",
        decide = sym decide,
        real = sym REAL_DLSYM,
    )
}

/// The exported `dlsym` (aarch64).
///
/// # Safety
/// Called as `dlsym(3)`.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "stp x0, x1, [sp, #16]",
        "bl {decide}",
        "cbz x0, 2f",
        "ldp x29, x30, [sp], #32",
        "ret",
        "2:",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "br x16",
        decide = sym decide,
        real = sym REAL_DLSYM,
    )
}

/// `dlopen` a real library (RTLD_NOW | RTLD_LOCAL: its symbols stay out of the global scope
/// so they cannot shadow our exports).
pub fn open_library(name: &str) -> Result<*mut c_void, String> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| format!("library name {name:?} contains a NUL byte"))?;
    // SAFETY: dlopen with a NUL-terminated name.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a NUL-terminated message or NULL.
        let e = unsafe { libc::dlerror() };
        let msg = if e.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: as above.
            unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
        };
        return Err(msg);
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_real_libraries_are_the_usual_names_or_the_configs() {
        assert!(is_real_library(b"libcuda.so.1", None));
        assert!(is_real_library(b"libcuda.so.550.54.14", None));
        assert!(is_real_library(b"libnvidia-ml.so.1", None));
        assert!(!is_real_library(b"libcudart.so.12", None));
        assert!(!is_real_library(b"libcuda-vendor.so.1", None));
        let configured: [Box<[u8]>; 2] = [
            b"libcuda-vendor.so.1".as_slice().into(),
            b"".as_slice().into(),
        ];
        assert!(is_real_library(b"libcuda-vendor.so.1", Some(&configured)));
        assert!(!is_real_library(b"libcuda-vendor.so.2", Some(&configured)));
        assert!(
            !is_real_library(b"", Some(&configured)),
            "an empty name matches nothing"
        );
    }
}
