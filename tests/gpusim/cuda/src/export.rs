//! `cuGetExportTable`: the driver-private tables the CUDA runtime (libcudart) asks for by
//! UUID before it will run. Each is a static array of pointers with a stable address (the
//! integrity check hashes the addresses); slot 0 holds the table's size in bytes, except in
//! CONTEXT_LOCAL_STORAGE, which has no header. What each slot does, and which cudart needs,
//! is recorded in `../../../shared/reference/cuda-runtime.md` §2 and §6.
//!
//! Every function in a table runs its body under [`guard`] (or cannot fail), so no panic
//! reaches cudart. Slots cudart is not known to call return `CUDA_ERROR_NOT_SUPPORTED`
//! instead of being NULL, so a library that calls one fails cleanly.

use std::cell::UnsafeCell;
use std::collections::BTreeMap;
use std::ffi::c_void;

use parking_lot::Mutex;

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;
use crate::integrity::{self, Caller, DeviceInfo};

/// A table as cudart reads it: `N` pointer-sized slots.
#[repr(transparent)]
pub struct Table<const N: usize>([*const c_void; N]);

// SAFETY: a table is never written after initialisation and holds only code addresses and
// its size; sharing it between threads shares read-only data.
unsafe impl<const N: usize> Sync for Table<N> {}

impl<const N: usize> Table<N> {
    pub fn as_ptr(&self) -> *const c_void {
        self.0.as_ptr().cast()
    }
}

/// Slot 0 of a table with a header: its size in bytes.
const fn size_of_table(slots: usize) -> *const c_void {
    std::ptr::without_provenance(slots * std::mem::size_of::<*const c_void>())
}

/// A slot's function, as a table entry.
macro_rules! slot {
    ($f:expr) => {
        $f as *const c_void
    };
}

/// Table functions: `unsafe extern "C" fn name(args) -> CUresult` over a body returning
/// `Result<(), CUresult>`, run under [`guard`].
macro_rules! table_fns {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {
        $(
            /// # Safety
            /// Called by cudart through an export table, with the arguments the table's
            /// layout documents.
            unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                guard(move || -> R { $body })
            }
        )*
    };
}

/// Any slot gpusim does not implement.
extern "C" fn not_supported() -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

const NS: *const c_void = slot!(not_supported);

// ---- UUIDs, as the bytes the caller passes ----

pub const CUDART_INTERFACE_ID: [u8; 16] = [
    0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9,
];
pub const TOOLS_RUNTIME_CALLBACK_HOOKS_ID: [u8; 16] = [
    0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66,
];
pub const TOOLS_TLS_ID: [u8; 16] = [
    0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc,
];
pub const CONTEXT_LOCAL_STORAGE_ID: [u8; 16] = [
    0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93,
];
pub const CONTEXT_CHECKS_ID: [u8; 16] = [
    0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e,
];
pub const INTEGRITY_CHECK_ID: [u8; 16] = [
    0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2,
];
pub const CTX_CREATE_BYPASS_ID: [u8; 16] = [
    0x0c, 0xa5, 0x0b, 0x8c, 0x10, 0x04, 0x92, 0x9a, 0x89, 0xa7, 0xd0, 0xdf, 0x10, 0xe7, 0x72, 0x86,
];
pub const HEAP_ACCESS_ID: [u8; 16] = [
    0x19, 0x5b, 0xcb, 0xf4, 0xd6, 0x7d, 0x02, 0x4a, 0xac, 0xc5, 0x1d, 0x29, 0xce, 0xa6, 0x31, 0xae,
];
pub const DEVICE_EXTENDED_RT_ID: [u8; 16] = [
    0xb1, 0x05, 0x41, 0xe1, 0xf7, 0xc7, 0xc7, 0x4a, 0x9f, 0x64, 0xf2, 0x23, 0xbe, 0x99, 0xf1, 0xe2,
];
pub const HYBRID_CUDART_ID: [u8; 16] = [
    0xdd, 0x9e, 0x98, 0xa4, 0xf4, 0x10, 0x48, 0x44, 0x99, 0xb0, 0xe2, 0xae, 0xb7, 0xb4, 0x32, 0xb5,
];
/// CUEXP_CONTEXT (CU_ETID_ToolsContext): cudart 13.5 asks for it before it will run.
pub const CONTEXT_ID: [u8; 16] = [
    0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2,
];

// ---- CUDART_INTERFACE ----

/// `__fatBinC_Wrapper_t`, what nvcc's host code registers and cudart hands over.
#[repr(C)]
pub struct FatbinWrapper {
    pub magic: u32,
    pub version: u32,
    pub data: *const c_void,
    pub filename_or_fatbins: *const c_void,
}

pub use crate::module::FATBIN_WRAPPER_MAGIC;

/// Load the fatbin a wrapper points to as a module of the current context.
fn load_wrapper(out: Out<CUmodule>, wrapper: In<FatbinWrapper>) -> R {
    let w = wrapper.get()?;
    if w.magic != FATBIN_WRAPPER_MAGIC || !(1..=2).contains(&w.version) {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    crate::module::load_image_ptr(out, w.data)
}

table_fns! {
    fn get_module_from_cubin(out: Out<CUmodule>, wrapper: In<FatbinWrapper>) {
        load_wrapper(out, wrapper)
    }
    fn primary_context(pctx: Out<CUcontext>, dev: CUdevice) {
        // The handle of the device's primary context, neither retained nor activated:
        // cudart asks for every device's at initialisation and retains (cuDevicePrimaryCtxRetain)
        // only the devices it uses, as a process shows on only those GPUs with a real driver.
        // The current context is left alone.
        let d = driver()?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = d.device(dev)?;
        let id = d.inner.lock().primary_handle(dev);
        pctx.write(Handle::from_id(id))
    }
    fn get_module_from_cubin_ext1(out: Out<CUmodule>, wrapper: In<FatbinWrapper>, arg3: *mut c_void, arg4: *mut c_void, arg5: u32) {
        let _ = arg5;
        if !arg3.is_null() || !arg4.is_null() {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        load_wrapper(out, wrapper)
    }
    fn cudart_fn7(arg: usize) {
        let _ = arg;
        Ok(())
    }
    fn get_module_from_cubin_ext2(fatbin: *const c_void, out: Out<CUmodule>, arg3: *mut c_void, arg4: *mut c_void, arg5: u32) {
        let _ = arg5;
        if !arg3.is_null() || !arg4.is_null() {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        crate::module::load_image_ptr(out, fatbin)
    }
    fn load_compilers() {
        Ok(())
    }
}

pub static CUDART_INTERFACE: Table<13> = Table([
    size_of_table(13),
    slot!(get_module_from_cubin),
    slot!(primary_context),
    NS,
    NS,
    NS,
    slot!(get_module_from_cubin_ext1),
    slot!(cudart_fn7),
    slot!(get_module_from_cubin_ext2),
    NS,
    NS,
    NS,
    slot!(load_compilers),
]);

// ---- TOOLS_RUNTIME_CALLBACK_HOOKS ----

/// A zeroed buffer the driver lends the runtime for good (it may write to it).
struct Lent<const N: usize>(UnsafeCell<[u32; N]>);

// SAFETY: Rust code never reads or writes the buffer; only its address is handed out, and
// what the C side does with it is between the runtime's threads.
unsafe impl<const N: usize> Sync for Lent<N> {}

static HOOKS_BUF1: Lent<1024> = Lent(UnsafeCell::new([0; 1024]));
static HOOKS_BUF2: Lent<14> = Lent(UnsafeCell::new([0; 14]));

fn lend<const N: usize>(buf: &'static Lent<N>, ptr: Out<*mut c_void>, len: Out<usize>) {
    ptr.write_opt(buf.0.get().cast());
    len.write_opt(N);
}

extern "C" fn hooks_buffer1(ptr: Out<*mut c_void>, len: Out<usize>) {
    lend(&HOOKS_BUF1, ptr, len);
}

extern "C" fn hooks_buffer2(ptr: Out<*mut c_void>, len: Out<usize>) {
    lend(&HOOKS_BUF2, ptr, len);
}

pub static TOOLS_RUNTIME_CALLBACK_HOOKS: Table<7> = Table([
    size_of_table(7),
    NS,
    slot!(hooks_buffer1),
    NS,
    NS,
    NS,
    slot!(hooks_buffer2),
]);

// ---- TOOLS_TLS: cudart reads only the header ----

pub static TOOLS_TLS: Table<4> = Table([size_of_table(4), NS, NS, NS]);

// ---- CONTEXT_LOCAL_STORAGE_INTERFACE_V0301 (no header) ----

/// `clsContextDestroyCallback(ctx, key, value)`: cudart's, run when the context goes away.
pub type ClsDtor = unsafe extern "C" fn(CUcontext, *mut c_void, *mut c_void);

struct ClsEntry {
    value: usize,
    dtor: Option<ClsDtor>,
}

/// Context-local storage: (context id, key) → value. Taken only while holding
/// `Driver::inner` (a leaf lock after it), so an entry and its context come and go together.
static CLS: Mutex<BTreeMap<(u64, usize), ClsEntry>> = Mutex::new(BTreeMap::new());

/// The destructor calls owed for a context that is gone (destroyed, or a primary context
/// reset). Run them with [`ClsDtors::run`] once no lock is held: cudart's callbacks may call
/// back into the driver.
#[must_use]
pub struct ClsDtors(Vec<(u64, usize, usize, ClsDtor)>);

impl ClsDtors {
    pub fn run(self) {
        for (ctx, key, value, dtor) in self.0 {
            // SAFETY: cudart registered `dtor` with this signature through `cls_put`, for
            // exactly this context, key and value.
            unsafe {
                dtor(
                    Handle::from_id(ctx),
                    key as *mut c_void,
                    value as *mut c_void,
                )
            };
        }
    }
}

/// Remove context `ctx`'s storage (the caller holds `Driver::inner` and is destroying it).
pub fn cls_drain(ctx: u64) -> ClsDtors {
    let mut cls = CLS.lock();
    let keys: Vec<(u64, usize)> = cls
        .range((ctx, 0)..=(ctx, usize::MAX))
        .map(|(k, _)| *k)
        .collect();
    let mut owed = Vec::new();
    for k in keys {
        if let Some(ClsEntry {
            value,
            dtor: Some(f),
        }) = cls.remove(&k)
        {
            owed.push((ctx, k.1, value, f));
        }
    }
    ClsDtors(owed)
}

table_fns! {
    fn cls_put(ctx: CUcontext, key: *mut c_void, value: *mut c_void, dtor: Option<ClsDtor>) {
        let d = driver()?;
        let inner = d.inner.lock();
        let id = crate::context::ctx_or_current(d, &inner, ctx)?;
        CLS.lock().insert((id, key as usize), ClsEntry { value: value as usize, dtor });
        Ok(())
    }
    fn cls_delete(ctx: CUcontext, key: *mut c_void) {
        let d = driver()?;
        let inner = d.inner.lock();
        let id = crate::context::ctx_or_current(d, &inner, ctx)?;
        CLS.lock().remove(&(id, key as usize));
        Ok(())
    }
    fn cls_get(value: Out<*mut c_void>, ctx: CUcontext, key: *mut c_void) {
        let d = driver()?;
        let inner = d.inner.lock();
        let id = crate::context::ctx_or_current(d, &inner, ctx)?;
        let v = CLS.lock().get(&(id, key as usize)).map(|e| e.value).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        value.write(v as *mut c_void)
    }
}

pub static CONTEXT_LOCAL_STORAGE: Table<3> =
    Table([slot!(cls_put), slot!(cls_delete), slot!(cls_get)]);

// ---- CONTEXT_CHECKS ----

table_fns! {
    fn context_check(ctx: CUcontext, out1: Out<u32>, out2: *mut *const c_void) {
        let _ = (ctx, out2);
        out1.write_opt(0);
        Ok(())
    }
}

extern "C" fn check_fn3() -> u32 {
    0
}

pub static CONTEXT_CHECKS: Table<4> =
    Table([size_of_table(4), NS, slot!(context_check), slot!(check_fn3)]);

// ---- INTEGRITY_CHECK ----

/// What the check hashes about this process and its devices, as cudart sees them.
fn integrity_inputs(
    version: u32,
    unix_seconds: u64,
) -> Result<(Caller, Vec<DeviceInfo>), CUresult> {
    let d = driver()?;
    // SAFETY: pthread_self has no preconditions.
    let thread = unsafe { libc::pthread_self() } as u32;
    let caller = Caller {
        driver_version: d.st.config.cuda_version as u32,
        version,
        pid: std::process::id(),
        thread,
        cudart_table: CUDART_INTERFACE.as_ptr() as u64,
        integrity_table: INTEGRITY_CHECK.as_ptr() as u64,
        fn_address: INTEGRITY_CHECK.0[1] as u64,
        unix_seconds,
    };
    // The devices cudart counts: the visible ones, in ordinal order.
    let devices = d
        .visible
        .iter()
        .map(|&g| {
            let gpu = &d.st.config.gpu[g];
            let (dom, bus, dev, _) = gpu.pci_parts();
            DeviceInfo {
                uuid: gpu.uuid_bytes(),
                pci_domain: dom as i32,
                pci_bus: bus as i32,
                pci_device: dev as i32,
            }
        })
        .collect();
    Ok((caller, devices))
}

/// Fault injection for tests: `GPUSIM_FAULT_INTEGRITY=1` flips one bit of every answer, as
/// a driver cudart does not trust would give (cudart then fails with
/// `cudaErrorSoftwareValidityNotEstablished`).
fn fault_integrity() -> bool {
    std::env::var_os("GPUSIM_FAULT_INTEGRITY").is_some_and(|v| v == "1")
}

table_fns! {
    fn integrity_check(version: u32, unix_seconds: u64, out: Out<[u64; 2]>) {
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (caller, devices) = integrity_inputs(version, unix_seconds)?;
        let mut answer = integrity::answer(caller, &devices);
        if fault_integrity() {
            answer[0] ^= 1;
        }
        out.write(answer)
    }
}

pub static INTEGRITY_CHECK: Table<3> = Table([size_of_table(3), slot!(integrity_check), NS]);

// ---- Tables cudart does not ask for; other NVIDIA libraries reportedly do ----

pub static CTX_CREATE_BYPASS: Table<2> = Table([size_of_table(2), NS]);
pub static HEAP_ACCESS: Table<3> = Table([size_of_table(3), NS, NS]);
pub static DEVICE_EXTENDED_RT: Table<26> = Table({
    let mut t = [NS; 26];
    t[0] = size_of_table(26);
    t
});
/// Windows-only in the real driver; its slot count is not known, three is a guess.
pub static HYBRID_CUDART: Table<3> = Table([size_of_table(3), NS, NS]);

// ---- CONTEXT (CUEXP_CONTEXT / CU_ETID_ToolsContext): 95 slots, as driver 595.99 serves it ----
//
// Without it cudart 13.5's cudaGetDeviceCount fails with cudaErrorInvalidValue. cudart 13.5
// reads only the header: in the runtime probes (basic, fatbin launch, LAZY and EAGER) no
// slot is called. Public sources name byte offset 0x18 (slot 3) cuexpContext_getDevice and
// 0x20 (slot 4) cuexpContext_getContextNumber; their signatures are not established, so
// every slot stays a trap that logs the call, for whoever first sees one used.

/// A slot gpusim does not implement: logs its index and first arguments under
/// `GPUSIM_LOG`, and returns `CUDA_ERROR_NOT_SUPPORTED`. Callers pass up to four
/// integer/pointer arguments; reading registers a caller left unset is harmless.
extern "C" fn context_trap<const I: usize>(a0: usize, a1: usize, a2: usize, a3: usize) -> CUresult {
    guard(|| {
        crate::driver::log(format_args!(
            "CUEXP_CONTEXT[{I}] (offset {:#x}) called ({a0:#x}, {a1:#x}, {a2:#x}, {a3:#x}): CUDA_ERROR_NOT_SUPPORTED",
            I * 8
        ));
        Err(CUDA_ERROR_NOT_SUPPORTED)
    })
}

macro_rules! context_table {
    ($($i:literal),*) => {
        Table([size_of_table(95), $(slot!(context_trap::<$i>)),*])
    };
}

pub static CONTEXT: Table<95> = context_table!(
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
    27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50,
    51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74,
    75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94
);

/// The table with UUID `id` (bytes as passed).
pub fn lookup(id: &[u8; 16]) -> Option<*const c_void> {
    Some(match *id {
        CUDART_INTERFACE_ID => CUDART_INTERFACE.as_ptr(),
        TOOLS_RUNTIME_CALLBACK_HOOKS_ID => TOOLS_RUNTIME_CALLBACK_HOOKS.as_ptr(),
        TOOLS_TLS_ID => TOOLS_TLS.as_ptr(),
        CONTEXT_LOCAL_STORAGE_ID => CONTEXT_LOCAL_STORAGE.as_ptr(),
        CONTEXT_CHECKS_ID => CONTEXT_CHECKS.as_ptr(),
        INTEGRITY_CHECK_ID => INTEGRITY_CHECK.as_ptr(),
        CTX_CREATE_BYPASS_ID => CTX_CREATE_BYPASS.as_ptr(),
        HEAP_ACCESS_ID => HEAP_ACCESS.as_ptr(),
        DEVICE_EXTENDED_RT_ID => DEVICE_EXTENDED_RT.as_ptr(),
        HYBRID_CUDART_ID => HYBRID_CUDART.as_ptr(),
        CONTEXT_ID => CONTEXT.as_ptr(),
        _ => return None,
    })
}

/// A UUID as cudart's bytes, grouped 4-2-2-2-6.
pub fn uuid_text(b: &[u8; 16]) -> String {
    let h = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "{}-{}-{}-{}-{}",
        h(0..4),
        h(4..6),
        h(6..8),
        h(8..10),
        h(10..16)
    )
}

/// The body of `cuGetExportTable`.
pub fn get_export_table(table: Out<*const c_void>, id: In<CUuuid>) -> R {
    let id = id.get()?;
    if table.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match lookup(&id.bytes) {
        Some(t) => table.write(t),
        None => {
            crate::driver::log(format_args!(
                "cuGetExportTable: unknown table {{{}}}: CUDA_ERROR_INVALID_VALUE",
                uuid_text(&id.bytes)
            ));
            table.write(std::ptr::null())?;
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot_at(t: *const c_void, i: usize) -> usize {
        // SAFETY: t is one of our static tables and i is within it (checked by the callers).
        unsafe { *t.cast::<usize>().add(i) }
    }

    #[test]
    fn headers_give_the_size_and_no_slot_is_null() {
        for (id, n, header) in [
            (CUDART_INTERFACE_ID, 13, true),
            (TOOLS_RUNTIME_CALLBACK_HOOKS_ID, 7, true),
            (TOOLS_TLS_ID, 4, true),
            (CONTEXT_LOCAL_STORAGE_ID, 3, false),
            (CONTEXT_CHECKS_ID, 4, true),
            (INTEGRITY_CHECK_ID, 3, true),
            (CTX_CREATE_BYPASS_ID, 2, true),
            (HEAP_ACCESS_ID, 3, true),
            (DEVICE_EXTENDED_RT_ID, 26, true),
            (HYBRID_CUDART_ID, 3, true),
            (CONTEXT_ID, 95, true),
        ] {
            let t = lookup(&id).expect("known table");
            if header {
                assert_eq!(slot_at(t, 0), 8 * n, "{}", uuid_text(&id));
            }
            for i in usize::from(header)..n {
                assert_ne!(slot_at(t, i), 0, "{} slot {i}", uuid_text(&id));
            }
        }
    }

    #[test]
    fn unknown_tables_are_refused() {
        let optional = [
            0xf8, 0xcf, 0xf9, 0x51, 0x21, 0x46, 0x8b, 0x4e, 0xb9, 0xe2, 0xfb, 0x46, 0x9e, 0x7c,
            0x0d, 0xd9,
        ];
        assert!(lookup(&optional).is_none());
        assert_eq!(uuid_text(&optional), "f8cff951-2146-8b4e-b9e2-fb469e7c0dd9");
    }

    #[test]
    fn context_slots_refuse_cleanly() {
        type Trap = extern "C" fn(usize, usize, usize, usize) -> CUresult;
        let t = lookup(&CONTEXT_ID).expect("known table");
        assert_eq!(
            uuid_text(&CONTEXT_ID),
            "21318c60-9714-3248-8ca6-41ff7324c8f2"
        );
        for i in [1, 3, 4, 94] {
            // SAFETY: every CONTEXT slot past the header holds a `context_trap`, of this
            // signature.
            let f: Trap = unsafe { std::mem::transmute(slot_at(t, i)) };
            assert_eq!(f(0, 0, 0, 0), CUDA_ERROR_NOT_SUPPORTED, "slot {i}");
        }
    }

    #[test]
    fn hooks_lend_zeroed_buffers() {
        type Lend = extern "C" fn(*mut *mut c_void, *mut usize);
        let t = lookup(&TOOLS_RUNTIME_CALLBACK_HOOKS_ID).expect("known table");
        for (slot, len) in [(2, 1024), (6, 14)] {
            // SAFETY: slots 2 and 6 hold `hooks_buffer*`, whose Out parameters are
            // transparent pointers: this is the signature cudart calls them with.
            let f: Lend = unsafe { std::mem::transmute(slot_at(t, slot)) };
            let (mut p, mut n): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
            f(&mut p, &mut n);
            assert_eq!(n, len);
            assert!(!p.is_null());
            // SAFETY: p points at the n-u32 static buffer just lent.
            let buf = unsafe { std::slice::from_raw_parts(p.cast::<u32>(), n) };
            assert!(buf.iter().all(|&w| w == 0));
        }
    }
}
