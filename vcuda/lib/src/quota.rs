//! The device-memory quota as safe operations: reserve in the container's books *before*
//! the driver call (refusing with `CUDA_ERROR_OUT_OF_MEMORY` when the total would pass the
//! quota), roll back if the driver fails, release on free. Written against two traits, so
//! the rules are unit- and property-tested without a driver or a shared region:
//! - `Driver`: the driver's allocation calls. The real one is `memory::RealDriver`, a zero-sized
//!   type whose methods forward to the real library (no cost on the hot path).
//! - `Books`: what the container has counted: the shared region's per-GPU totals and this
//!   process's pointer table (`state::Vcuda` implements it).
//!
//! The `extern "C"` shells in `memory` only turn pointers into values and back; a call
//! whose arguments the library cannot count (a NULL out-pointer, a zero size) is a named
//! bypass there and goes to the driver unchanged, which reports its own error.

use std::collections::HashMap;
use std::ffi::c_uint;

use crate::ffi::{CUresult, CUDA_ERROR_INVALID_CONTEXT, CUDA_SUCCESS};
use crate::table::{Kind, Rec};

/// What an operation returns: a value, or the `CUresult` the application sees.
pub(crate) type R<T> = Result<T, CUresult>;

/// Allocations are counted rounded up to this: the driver's minimum alignment, so the count
/// is what the device holds. Coarser rounding by a real driver shows up as hidden memory.
pub const ALLOC_GRANULE: u64 = 512;

/// `bytes` as counted: rounded up to [`ALLOC_GRANULE`].
#[inline(always)]
pub(crate) fn counted(bytes: u64) -> u64 {
    bytes.div_ceil(ALLOC_GRANULE) * ALLOC_GRANULE
}

/// Which generation of an entry point: the original ones (`cuMemAlloc`, `cuMemFree`,
/// `cuMemAllocPitch`) take 32-bit device pointers and sizes, the `_v2` ones 64-bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Abi {
    V1,
    V2,
}

/// The driver's allocation calls, as values. Errors are the driver's own `CUresult`.
pub(crate) trait Driver {
    /// `cuMemAlloc(_v2)`: a new device pointer.
    fn alloc(&self, abi: Abi, bytes: u64) -> R<u64>;
    /// `cuMemAllocManaged`.
    fn alloc_managed(&self, bytes: u64, flags: c_uint) -> R<u64>;
    /// `cuMemAllocPitch(_v2)`: the pointer and the pitch the driver chose.
    fn alloc_pitch(&self, abi: Abi, width: u64, height: u64, elem: c_uint) -> R<(u64, u64)>;
    /// `cuMemFree(_v2)`.
    fn free(&self, abi: Abi, ptr: u64) -> R<()>;
    /// What the driver charges for `arr` on the device of CUDA ordinal `ordinal`
    /// (`cuArrayGetMemoryRequirements` / `cuMipmappedArrayGetMemoryRequirements`), if it
    /// says (a size of 0 says nothing).
    fn array_size(&self, kind: ArrayKind, arr: usize, ordinal: i32) -> Option<u64>;
    /// `cuArrayDestroy` / `cuMipmappedArrayDestroy`.
    fn array_destroy(&self, kind: ArrayKind, arr: usize) -> R<()>;
    /// Whether the driver still knows the allocation at `ptr` (`cuPointerGetAttribute` of
    /// its range size succeeds).
    fn is_live(&self, ptr: u64) -> bool;
}

/// An array (`cuArrayCreate(_v2)`, `cuArray3DCreate(_v2)`) or a mipmapped array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArrayKind {
    Array,
    Mipmapped,
}

/// What the container has counted, and this process's live allocations.
pub(crate) trait Books {
    /// The GPU (config index) of the calling thread's current context, if any.
    fn current_dev(&self) -> Option<usize>;
    /// Count `bytes` more on `dev` if the container's total stays within its quota.
    fn reserve(&self, dev: usize, bytes: u64) -> bool;
    /// Count `bytes` less on `dev`.
    fn release(&self, dev: usize, bytes: u64);
    /// The library refuses a call on `dev` for the quota: count the refusal (the manager
    /// exports it) and return `CUDA_ERROR_OUT_OF_MEMORY`.
    fn refuse_for_quota(&self, dev: usize) -> CUresult;
    /// Remember a live allocation.
    fn insert(&self, ptr: u64, rec: Rec);
    /// Forget a live allocation, returning what it counted.
    fn remove(&self, ptr: u64) -> Option<Rec>;
    /// The CUDA ordinal the driver shows config GPU `dev` as.
    fn ordinal_of(&self, dev: usize) -> i32;
}

/// Reserve `bytes` on the current context's GPU, run `call`, roll back if it fails.
/// `Ok(dev)` means the call succeeded with the reservation held. With no current context
/// nothing can be counted, so the driver's own verdict is returned (it refuses such a call;
/// `undo` releases what it made if it did not).
#[inline(always)]
pub(crate) fn reserved<T>(
    b: &impl Books,
    bytes: u64,
    call: impl FnOnce() -> R<T>,
    undo: impl FnOnce(T),
) -> R<(usize, T)> {
    let Some(dev) = b.current_dev() else {
        let made = call()?;
        undo(made);
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    };
    if !b.reserve(dev, bytes) {
        return Err(b.refuse_for_quota(dev));
    }
    match call() {
        Ok(made) => Ok((dev, made)),
        Err(e) => {
            b.release(dev, bytes);
            Err(e)
        }
    }
}

/// Bring a reservation of `est` to the driver's `actual` size. `false`: the extra did not
/// fit (the caller frees the object and reports out of memory; `est` is already released).
pub(crate) fn true_up(b: &impl Books, dev: usize, est: u64, actual: u64) -> bool {
    if actual > est {
        if !b.reserve(dev, actual - est) {
            b.release(dev, est);
            return false;
        }
    } else {
        b.release(dev, est - actual);
    }
    true
}

fn reserved_rec(size: u64, dev: usize) -> Rec {
    Rec {
        size,
        // config indices are below contract::MAX_GPUS (16), so this is lossless
        dev: crate::conv::dev_u8(dev),
        kind: Kind::Reserved,
    }
}

/// `cuMemAlloc(_v2)` of `bytes` (not 0: the shell's bypass).
#[inline(always)]
pub(crate) fn alloc(d: &impl Driver, b: &impl Books, abi: Abi, bytes: u64) -> R<u64> {
    let size = counted(bytes);
    let (dev, ptr) = reserved(
        b,
        size,
        || d.alloc(abi, bytes),
        |p| {
            let _ = d.free(abi, p);
        },
    )?;
    b.insert(ptr, reserved_rec(size, dev));
    Ok(ptr)
}

/// `cuMemAllocManaged`: managed memory may not be resident; the policy counts it against
/// the current GPU.
pub(crate) fn alloc_managed(d: &impl Driver, b: &impl Books, bytes: u64, flags: c_uint) -> R<u64> {
    let size = counted(bytes);
    let (dev, ptr) = reserved(
        b,
        size,
        || d.alloc_managed(bytes, flags),
        |p| {
            let _ = d.free(Abi::V2, p);
        },
    )?;
    b.insert(ptr, reserved_rec(size, dev));
    Ok(ptr)
}

/// `cuMemAllocPitch(_v2)` (width and height not 0): the pitch is the driver's choice, so
/// reserve the width rounded up to 512 bytes per row, then true up to `pitch × height`.
pub(crate) fn alloc_pitch(
    d: &impl Driver,
    b: &impl Books,
    abi: Abi,
    width: u64,
    height: u64,
    elem: c_uint,
) -> R<(u64, u64)> {
    let est = width
        .div_ceil(512)
        .saturating_mul(512)
        .saturating_mul(height);
    let (dev, (ptr, pitch)) = reserved(
        b,
        est,
        || d.alloc_pitch(abi, width, height, elem),
        |(p, _)| {
            let _ = d.free(abi, p);
        },
    )?;
    let actual = counted(pitch.saturating_mul(height));
    if !true_up(b, dev, est, actual) {
        let _ = d.free(abi, ptr);
        return Err(b.refuse_for_quota(dev));
    }
    b.insert(ptr, reserved_rec(actual, dev));
    Ok((ptr, pitch))
}

/// `cuMemFree(_v2)`: forget the pointer first (so the driver cannot hand the same address to
/// another thread before we have), free, then release what it reserved; put it back if the
/// driver refuses. A pointer the library does not know (a pool's, or not an allocation at
/// all) is the driver's to judge.
#[inline(always)]
pub(crate) fn free(d: &impl Driver, b: &impl Books, abi: Abi, ptr: u64) -> R<()> {
    free_with(b, ptr, || d.free(abi, ptr))
}

/// [`free`] with the driver call as `call` (the stream-ordered frees share the rule).
#[inline(always)]
pub(crate) fn free_with(b: &impl Books, ptr: u64, call: impl FnOnce() -> R<()>) -> R<()> {
    let rec = b.remove(ptr);
    let rc = call();
    match rec {
        Some(r) if rc.is_err() => b.insert(ptr, r),
        Some(r) if r.kind == Kind::Reserved => b.release(usize::from(r.dev), r.size),
        _ => {}
    }
    rc
}

/// After a context was destroyed or its primary context reset, the driver has freed what
/// that context held without a `cuMemFree` we saw: every allocation of `live` (a snapshot
/// of the books) the driver no longer knows is forgotten, and what it reserved released.
/// Allocations still alive (other contexts') stay counted. Returns the bytes released.
pub(crate) fn forget_freed(d: &impl Driver, b: &impl Books, live: &[(u64, Rec)]) -> u64 {
    let mut released = 0;
    for &(ptr, _) in live {
        if d.is_live(ptr) {
            continue;
        }
        // Removed first: a thread freeing the same pointer meanwhile releases it once.
        if let Some(r) = b.remove(ptr) {
            if r.kind == Kind::Reserved {
                b.release(usize::from(r.dev), r.size);
                released += r.size;
            }
        }
    }
    released
}

/// An array (or mipmapped array) made by `create`: reserved at `est` (an upper estimate;
/// the driver rounds arrays coarsely), then trued up to what the driver says it charges, or
/// kept at `est` if it says nothing. An array whose true size does not fit the quota is
/// destroyed and refused. Returns (GPU, array, bytes counted).
pub(crate) fn array(
    d: &impl Driver,
    b: &impl Books,
    kind: ArrayKind,
    est: u64,
    create: impl FnOnce() -> R<usize>,
) -> R<(usize, usize, u64)> {
    let (dev, arr) = reserved(b, est, create, |a| {
        let _ = d.array_destroy(kind, a);
    })?;
    let actual = d
        .array_size(kind, arr, b.ordinal_of(dev))
        .filter(|&n| n > 0)
        .unwrap_or(est);
    if !true_up(b, dev, est, actual) {
        let _ = d.array_destroy(kind, arr);
        return Err(b.refuse_for_quota(dev));
    }
    Ok((dev, arr, actual))
}

/// Granularity pools grow by (CUDA's allocation granularity).
pub const POOL_GRANULE: u64 = 2 << 20;

/// What a stream-ordered allocation of `size` bytes from a pool holding `cached` bytes it
/// is not using must reserve before the call: the growth the pool may need, in whole
/// granules (0 if the cache serves it). `cached` is 0 unless no synchronisation can give
/// the cache back to the device meanwhile (`pools::PoolBooks::stream_ordered`).
#[inline(always)]
pub(crate) fn pool_hold(size: u64, cached: u64) -> u64 {
    counted(size)
        .saturating_sub(cached)
        .div_ceil(POOL_GRANULE)
        .saturating_mul(POOL_GRANULE)
}

/// A `CUresult` as an operation's result.
#[inline(always)]
pub(crate) fn check(rc: CUresult) -> R<()> {
    if rc == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(rc)
    }
}

/// An operation's result as the `CUresult` the application sees.
#[inline(always)]
pub(crate) fn code(r: R<()>) -> CUresult {
    match r {
        Ok(()) => CUDA_SUCCESS,
        Err(e) => e,
    }
}

/// One VMM allocation handle: its bytes and GPU, references (`cuMemCreate`'s and each
/// `cuMemRetainAllocationHandle`'s) and mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Vmm {
    bytes: u64,
    dev: usize,
    refs: u32,
    maps: u32,
}

/// The VMM handles' lifecycle, as the driver frees their memory: a handle's bytes are
/// counted from `cuMemCreate` until it is both released (every reference) and unmapped
/// everywhere. Each method returns the (GPU, bytes) the books release, at most once per
/// handle; handles the library did not count (host memory, made before it started) are
/// ignored.
#[derive(Debug, Default)]
pub(crate) struct VmmHandles {
    handles: HashMap<u64, Vmm>,
    /// Mapping address → (size, handle).
    mappings: HashMap<u64, (u64, u64)>,
}

impl VmmHandles {
    /// `cuMemCreate` made `handle` of `bytes` on `dev` (reserved before the call).
    pub(crate) fn created(&mut self, handle: u64, bytes: u64, dev: usize) {
        let e = Vmm {
            bytes,
            dev,
            refs: 1,
            maps: 0,
        };
        self.handles.insert(handle, e);
    }

    /// `cuMemRetainAllocationHandle` returned `handle`: one more reference.
    pub(crate) fn retained(&mut self, handle: u64) {
        if let Some(e) = self.handles.get_mut(&handle) {
            e.refs = e.refs.saturating_add(1);
        }
    }

    /// `cuMemRelease(handle)` succeeded.
    pub(crate) fn released(&mut self, handle: u64) -> Option<(usize, u64)> {
        let e = self.handles.get_mut(&handle)?;
        e.refs = e.refs.saturating_sub(1);
        self.settle(handle)
    }

    /// `cuMemMap(ptr, size, …, handle)` succeeded.
    pub(crate) fn mapped(&mut self, ptr: u64, size: u64, handle: u64) {
        if let Some(e) = self.handles.get_mut(&handle) {
            e.maps = e.maps.saturating_add(1);
            self.mappings.insert(ptr, (size, handle));
        }
    }

    /// `cuMemUnmap(ptr, size)` succeeded: every mapping starting in the range is gone.
    pub(crate) fn unmapped(&mut self, ptr: u64, size: u64) -> Vec<(usize, u64)> {
        let end = ptr.saturating_add(size);
        let gone: Vec<u64> = self
            .mappings
            .keys()
            .copied()
            .filter(|&k| k >= ptr && k < end)
            .collect();
        let mut freed = Vec::new();
        for k in gone {
            let Some((_, h)) = self.mappings.remove(&k) else {
                continue;
            };
            if let Some(e) = self.handles.get_mut(&h) {
                e.maps = e.maps.saturating_sub(1);
            }
            freed.extend(self.settle(h));
        }
        freed
    }

    fn settle(&mut self, handle: u64) -> Option<(usize, u64)> {
        let e = *self.handles.get(&handle)?;
        (e.refs == 0 && e.maps == 0).then(|| {
            self.handles.remove(&handle);
            (e.dev, e.bytes)
        })
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A recording driver and in-memory books, for the operations' tests.

    use std::cell::RefCell;
    use std::collections::{BTreeMap, VecDeque};

    use super::*;
    use crate::ffi::CUDA_ERROR_OUT_OF_MEMORY;

    /// One call the operations made.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Call {
        Alloc(Abi, u64),
        Managed(u64),
        Pitch(Abi, u64, u64),
        Free(Abi, u64),
        Array(u64),
        Destroy(ArrayKind, usize),
    }

    /// A driver whose device holds `capacity` bytes; `fail` queues errors for the next
    /// allocation calls; `pitch` is the row alignment it picks.
    pub struct FakeDriver {
        pub calls: RefCell<Vec<Call>>,
        pub live: RefCell<BTreeMap<u64, u64>>,
        pub fail: RefCell<VecDeque<CUresult>>,
        pub refuse_free: RefCell<bool>,
        pub pitch: u64,
        /// What the driver rounds an array's size to (0: it does not say).
        pub array_granule: u64,
        next: RefCell<u64>,
    }

    impl FakeDriver {
        pub fn new() -> FakeDriver {
            FakeDriver {
                calls: RefCell::new(Vec::new()),
                live: RefCell::new(BTreeMap::new()),
                fail: RefCell::new(VecDeque::new()),
                refuse_free: RefCell::new(false),
                pitch: 512,
                array_granule: 2 << 20,
                next: RefCell::new(0x7f00_0000_0000),
            }
        }

        /// `cuArrayCreate` of an array of `bytes`: a new handle.
        pub fn create_array(&self, bytes: u64) -> R<usize> {
            self.calls.borrow_mut().push(Call::Array(bytes));
            self.make(bytes).map(crate::conv::usize_of)
        }

        fn make(&self, bytes: u64) -> R<u64> {
            if let Some(e) = self.fail.borrow_mut().pop_front() {
                return Err(e);
            }
            let mut next = self.next.borrow_mut();
            let p = *next;
            *next += counted(bytes.max(1)) + 0x1000;
            self.live.borrow_mut().insert(p, bytes);
            Ok(p)
        }
    }

    impl Driver for FakeDriver {
        fn alloc(&self, abi: Abi, bytes: u64) -> R<u64> {
            self.calls.borrow_mut().push(Call::Alloc(abi, bytes));
            self.make(bytes)
        }
        fn alloc_managed(&self, bytes: u64, _flags: c_uint) -> R<u64> {
            self.calls.borrow_mut().push(Call::Managed(bytes));
            self.make(bytes)
        }
        fn alloc_pitch(&self, abi: Abi, width: u64, height: u64, _elem: c_uint) -> R<(u64, u64)> {
            self.calls
                .borrow_mut()
                .push(Call::Pitch(abi, width, height));
            let pitch = width.div_ceil(self.pitch) * self.pitch;
            Ok((self.make(pitch * height)?, pitch))
        }
        fn array_size(&self, _kind: ArrayKind, arr: usize, _ordinal: i32) -> Option<u64> {
            let held = *self.live.borrow().get(&(arr as u64))?;
            (self.array_granule > 0).then(|| held.div_ceil(self.array_granule) * self.array_granule)
        }
        fn array_destroy(&self, kind: ArrayKind, arr: usize) -> R<()> {
            self.calls.borrow_mut().push(Call::Destroy(kind, arr));
            match self.live.borrow_mut().remove(&(arr as u64)) {
                Some(_) => Ok(()),
                None => Err(crate::ffi::CUDA_ERROR_INVALID_VALUE),
            }
        }
        fn is_live(&self, ptr: u64) -> bool {
            self.live.borrow().contains_key(&ptr)
        }
        fn free(&self, abi: Abi, ptr: u64) -> R<()> {
            self.calls.borrow_mut().push(Call::Free(abi, ptr));
            if *self.refuse_free.borrow() {
                return Err(crate::ffi::CUDA_ERROR_INVALID_VALUE);
            }
            match self.live.borrow_mut().remove(&ptr) {
                Some(_) => Ok(()),
                None => Err(crate::ffi::CUDA_ERROR_INVALID_VALUE),
            }
        }
    }

    /// Books of one container on `limits.len()` GPUs, the calling thread's context on
    /// `dev` (None: no context).
    pub struct FakeBooks {
        pub limits: Vec<u64>,
        pub used: RefCell<Vec<u64>>,
        pub recs: RefCell<BTreeMap<u64, Rec>>,
        pub refusals: RefCell<u64>,
        pub dev: Option<usize>,
    }

    impl FakeBooks {
        pub fn new(limits: &[u64]) -> FakeBooks {
            FakeBooks {
                limits: limits.to_vec(),
                used: RefCell::new(vec![0; limits.len()]),
                recs: RefCell::new(BTreeMap::new()),
                refusals: RefCell::new(0),
                dev: Some(0),
            }
        }

        pub fn used(&self, dev: usize) -> u64 {
            self.used.borrow()[dev]
        }
    }

    impl Books for FakeBooks {
        fn current_dev(&self) -> Option<usize> {
            self.dev
        }
        fn reserve(&self, dev: usize, bytes: u64) -> bool {
            let mut used = self.used.borrow_mut();
            match used[dev].checked_add(bytes) {
                Some(n) if n <= self.limits[dev] => {
                    used[dev] = n;
                    true
                }
                _ => false,
            }
        }
        fn release(&self, dev: usize, bytes: u64) {
            let mut used = self.used.borrow_mut();
            assert!(
                used[dev] >= bytes,
                "released {bytes} on GPU {dev}, more than counted"
            );
            used[dev] -= bytes;
        }
        fn refuse_for_quota(&self, _dev: usize) -> CUresult {
            *self.refusals.borrow_mut() += 1;
            CUDA_ERROR_OUT_OF_MEMORY
        }
        fn insert(&self, ptr: u64, rec: Rec) {
            self.recs.borrow_mut().insert(ptr, rec);
        }
        fn remove(&self, ptr: u64) -> Option<Rec> {
            self.recs.borrow_mut().remove(&ptr)
        }
        fn ordinal_of(&self, dev: usize) -> i32 {
            crate::conv::i32_sat(dev)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::*;
    use super::*;
    use crate::ffi::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY};

    const MIB: u64 = 1 << 20;

    #[test]
    fn an_allocation_counts_its_rounded_size_until_it_is_freed() {
        let (d, b) = (FakeDriver::new(), FakeBooks::new(&[4 * MIB]));
        let p = alloc(&d, &b, Abi::V2, 1000).unwrap();
        assert_eq!(b.used(0), 1024, "1000 bytes count as two 512-byte granules");
        assert_eq!(b.recs.borrow()[&p].size, 1024);
        free(&d, &b, Abi::V2, p).unwrap();
        assert_eq!(b.used(0), 0);
        assert!(d.live.borrow().is_empty() && b.recs.borrow().is_empty());
    }

    #[test]
    fn over_the_quota_the_driver_is_never_asked_and_the_refusal_is_counted() {
        let (d, b) = (FakeDriver::new(), FakeBooks::new(&[4 * MIB]));
        alloc(&d, &b, Abi::V2, 3 * MIB).unwrap();
        assert_eq!(
            alloc(&d, &b, Abi::V2, 2 * MIB),
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        );
        assert_eq!(
            d.calls.borrow().len(),
            1,
            "the refused call never reached the driver"
        );
        assert_eq!((*b.refusals.borrow(), b.used(0)), (1, 3 * MIB));
        // what is left still fits
        alloc(&d, &b, Abi::V1, MIB).unwrap();
        assert_eq!(b.used(0), 4 * MIB);
    }

    #[test]
    fn a_driver_failure_rolls_the_reservation_back_and_is_passed_on_uncounted() {
        let (d, b) = (FakeDriver::new(), FakeBooks::new(&[4 * MIB]));
        d.fail.borrow_mut().push_back(CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(alloc(&d, &b, Abi::V2, MIB), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(b.used(0), 0);
        assert_eq!(
            *b.refusals.borrow(),
            0,
            "the driver's own out-of-memory is not a quota refusal"
        );
    }

    #[test]
    fn without_a_context_nothing_is_counted_and_nothing_is_kept() {
        let (d, mut b) = (FakeDriver::new(), FakeBooks::new(&[4 * MIB]));
        b.dev = None;
        assert_eq!(alloc(&d, &b, Abi::V2, MIB), Err(CUDA_ERROR_INVALID_CONTEXT));
        assert!(
            d.live.borrow().is_empty(),
            "what the driver made anyway was freed"
        );
        d.fail.borrow_mut().push_back(CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(alloc(&d, &b, Abi::V2, MIB), Err(CUDA_ERROR_INVALID_CONTEXT));
        assert_eq!(b.used(0), 0);
    }

    #[test]
    fn a_pitched_allocation_is_trued_up_to_the_drivers_pitch() {
        let (mut d, b) = (FakeDriver::new(), FakeBooks::new(&[4 * MIB]));
        d.pitch = 4096;
        let (p, pitch) = alloc_pitch(&d, &b, Abi::V2, 1000, 100, 4).unwrap();
        assert_eq!(pitch, 4096);
        assert_eq!(
            b.used(0),
            4096 * 100,
            "what the driver holds, not the 512-byte estimate"
        );
        free(&d, &b, Abi::V2, p).unwrap();
        assert_eq!(b.used(0), 0);
    }

    #[test]
    fn a_pitch_that_does_not_fit_frees_the_allocation_and_refuses() {
        let (mut d, b) = (FakeDriver::new(), FakeBooks::new(&[MIB]));
        d.pitch = 8192;
        // estimate 512 × 200 = 100 KiB fits, the driver's 8 KiB pitch × 200 = 1.6 MiB does not
        assert_eq!(
            alloc_pitch(&d, &b, Abi::V1, 500, 200, 4),
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        );
        assert_eq!(b.used(0), 0);
        assert!(
            d.live.borrow().is_empty(),
            "the over-quota allocation went back to the driver"
        );
        assert_eq!(*b.refusals.borrow(), 1);
    }

    #[test]
    fn a_teardown_releases_what_the_driver_freed_and_keeps_what_lives_on() {
        let (d, b) = (FakeDriver::new(), FakeBooks::new(&[8 * MIB, 8 * MIB]));
        let gone = alloc(&d, &b, Abi::V2, MIB).unwrap();
        let kept = alloc(&d, &b, Abi::V2, 2 * MIB).unwrap();
        let mut b1 = b;
        b1.dev = Some(1);
        let other = alloc(&d, &b1, Abi::V2, 3 * MIB).unwrap();
        let b = b1;
        // a pointer the books know but did not reserve (a pool's) is forgotten, not released
        b.insert(
            0x5000,
            Rec {
                size: MIB,
                dev: 0,
                kind: Kind::Pool,
            },
        );
        // the teardown freed `gone` and the pool pointer behind the library's back
        d.live.borrow_mut().remove(&gone);
        let live: Vec<(u64, Rec)> = b.recs.borrow().iter().map(|(p, r)| (*p, *r)).collect();
        assert_eq!(forget_freed(&d, &b, &live), MIB);
        assert_eq!((b.used(0), b.used(1)), (2 * MIB, 3 * MIB));
        let left: Vec<u64> = b.recs.borrow().keys().copied().collect();
        assert_eq!(left, {
            let mut v = vec![kept, other];
            v.sort_unstable();
            v
        });
        // a second pass (another teardown) finds nothing more to release
        assert_eq!(forget_freed(&d, &b, &live), 0);
        free(&d, &b, Abi::V2, kept).unwrap();
        assert_eq!(b.used(0), 0);
    }

    #[test]
    fn a_free_the_driver_refuses_keeps_the_allocation_counted() {
        let (d, b) = (FakeDriver::new(), FakeBooks::new(&[4 * MIB]));
        let p = alloc(&d, &b, Abi::V2, MIB).unwrap();
        *d.refuse_free.borrow_mut() = true;
        assert_eq!(free(&d, &b, Abi::V2, p), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!((b.used(0), b.recs.borrow().contains_key(&p)), (MIB, true));
        *d.refuse_free.borrow_mut() = false;
        free(&d, &b, Abi::V2, p).unwrap();
        assert_eq!(b.used(0), 0);
    }

    #[test]
    fn freeing_an_unknown_pointer_releases_nothing_and_reports_the_drivers_verdict() {
        let (d, b) = (FakeDriver::new(), FakeBooks::new(&[4 * MIB]));
        let p = alloc(&d, &b, Abi::V2, MIB).unwrap();
        assert_eq!(
            free(&d, &b, Abi::V2, 0xdead_0000),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        free(&d, &b, Abi::V2, p).unwrap();
        assert_eq!(
            free(&d, &b, Abi::V2, p),
            Err(CUDA_ERROR_INVALID_VALUE),
            "a double free"
        );
        assert_eq!(b.used(0), 0, "the second free released nothing");
    }

    #[test]
    fn each_gpu_has_its_own_quota() {
        let (d, mut b) = (FakeDriver::new(), FakeBooks::new(&[MIB, 2 * MIB]));
        b.dev = Some(1);
        alloc(&d, &b, Abi::V2, 2 * MIB).unwrap();
        b.dev = Some(0);
        assert_eq!(
            alloc(&d, &b, Abi::V2, 2 * MIB),
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        );
        let p = alloc_managed(&d, &b, MIB, 1).unwrap();
        assert_eq!(
            (b.used(0), b.used(1), b.recs.borrow()[&p].dev),
            (MIB, 2 * MIB, 0)
        );
    }

    #[test]
    fn an_array_is_reserved_at_its_estimate_then_counted_as_the_driver_charges_it() {
        let (d, b) = (FakeDriver::new(), FakeBooks::new(&[16 * MIB]));
        // 3 MiB raw, estimated at 4 MiB; the driver rounds to 2 MiB: 4 MiB
        let (dev, arr, n) = array(&d, &b, ArrayKind::Array, 4 * MIB, || {
            d.create_array(3 * MIB)
        })
        .unwrap();
        assert_eq!((dev, n, b.used(0)), (0, 4 * MIB, 4 * MIB));
        // 1 MiB raw, estimated generously at 3 MiB: trued down to the driver's 2 MiB
        let (_, _, n) = array(&d, &b, ArrayKind::Mipmapped, 3 * MIB, || {
            d.create_array(MIB)
        })
        .unwrap();
        assert_eq!((n, b.used(0)), (2 * MIB, 6 * MIB));
        let live = d.live.borrow().len();
        assert_eq!(live, 2);
        let _ = arr;
    }

    #[test]
    fn an_array_the_estimate_fit_but_the_driver_charges_more_for_is_destroyed_and_refused() {
        let (mut d, b) = (FakeDriver::new(), FakeBooks::new(&[5 * MIB]));
        d.array_granule = 4 << 20;
        let r = array(&d, &b, ArrayKind::Array, 4 * MIB, || {
            d.create_array(4 * MIB + 1)
        });
        assert_eq!(r, Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(
            (b.used(0), d.live.borrow().len(), *b.refusals.borrow()),
            (0, 0, 1)
        );
        assert!(matches!(
            d.calls.borrow().last(),
            Some(Call::Destroy(ArrayKind::Array, _))
        ));
    }

    #[test]
    fn a_driver_that_does_not_say_an_arrays_size_leaves_the_estimate_counted() {
        let (mut d, b) = (FakeDriver::new(), FakeBooks::new(&[16 * MIB]));
        d.array_granule = 0;
        let (_, _, n) = array(&d, &b, ArrayKind::Array, 4 * MIB, || {
            d.create_array(3 * MIB)
        })
        .unwrap();
        assert_eq!((n, b.used(0)), (4 * MIB, 4 * MIB));
        // over the quota: the driver is never asked
        assert_eq!(
            array(&d, &b, ArrayKind::Array, 16 * MIB, || d.create_array(MIB)),
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        );
        assert_eq!(d.calls.borrow().len(), 1);
    }

    #[test]
    fn a_vmm_handle_is_counted_until_released_and_unmapped_everywhere() {
        let mut h = VmmHandles::default();
        h.created(7, 4 * MIB, 1);
        h.mapped(0x1000_0000, 2 * MIB, 7);
        h.mapped(0x2000_0000, 2 * MIB, 7);
        assert_eq!(h.released(7), None, "still mapped twice");
        assert_eq!(
            h.unmapped(0x1000_0000, 2 * MIB),
            vec![],
            "still mapped once"
        );
        assert_eq!(h.unmapped(0x2000_0000, 2 * MIB), vec![(1, 4 * MIB)]);
        assert_eq!(h.released(7), None, "released once, and only once");
        assert_eq!(h.unmapped(0x2000_0000, 2 * MIB), vec![]);
    }

    #[test]
    fn a_retained_vmm_handle_needs_a_release_per_reference() {
        let mut h = VmmHandles::default();
        h.created(7, MIB, 0);
        h.retained(7);
        assert_eq!(h.released(7), None);
        assert_eq!(h.released(7), Some((0, MIB)));
        // handles the library never counted are ignored
        h.retained(8);
        h.mapped(0x3000, MIB, 8);
        assert_eq!((h.released(8), h.unmapped(0x3000, MIB)), (None, vec![]));
    }

    #[test]
    fn one_unmap_over_several_mappings_frees_each_handle_it_ends() {
        let mut h = VmmHandles::default();
        h.created(1, MIB, 0);
        h.created(2, 2 * MIB, 0);
        h.mapped(0x1000_0000, MIB, 1);
        h.mapped(0x1010_0000, 2 * MIB, 2);
        assert_eq!((h.released(1), h.released(2)), (None, None));
        let mut freed = h.unmapped(0x1000_0000, 3 * MIB);
        freed.sort();
        assert_eq!(freed, vec![(0, MIB), (0, 2 * MIB)]);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;
        use std::collections::BTreeMap;

        #[derive(Debug, Clone)]
        enum Op {
            Alloc(u64, bool),
            Pitch(u64, u64, bool),
            Managed(u64),
            Free(usize),
            RefusedFree(usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (1u64..3 * MIB, any::<bool>()).prop_map(|(n, f)| Op::Alloc(n, f)),
                (1u64..8192, 1u64..300, any::<bool>()).prop_map(|(w, h, f)| Op::Pitch(w, h, f)),
                (1u64..MIB).prop_map(Op::Managed),
                (0usize..16).prop_map(Op::Free),
                (0usize..16).prop_map(Op::RefusedFree),
            ]
        }

        #[derive(Debug, Clone)]
        enum VmmOp {
            Create(u64),
            Retain(u64),
            Release(u64),
            Map(u64, u64),
            Unmap(u64),
        }

        fn vmm_op() -> impl Strategy<Value = VmmOp> {
            prop_oneof![
                (0u64..4).prop_map(VmmOp::Create),
                (0u64..4).prop_map(VmmOp::Retain),
                (0u64..4).prop_map(VmmOp::Release),
                (0u64..4, 0u64..6).prop_map(|(h, a)| VmmOp::Map(h, a)),
                (0u64..6).prop_map(VmmOp::Unmap),
            ]
        }

        proptest! {
            /// A pool allocation holds enough for the growth its cache cannot serve, never
            /// a whole granule more, and in whole granules.
            #[test]
            fn a_pool_allocation_holds_the_growth_in_whole_granules(size in 1u64..1 << 40, cached in 0u64..1 << 40) {
                let hold = pool_hold(size, cached);
                let short = counted(size).saturating_sub(cached);
                prop_assert_eq!(hold % POOL_GRANULE, 0);
                prop_assert!(hold >= short, "holds {hold}, the pool may grow by {short}");
                prop_assert!(hold < short + POOL_GRANULE);
                prop_assert_eq!(hold == 0, cached >= counted(size));
            }

            /// Whatever the sequence of allocations, driver failures and frees: the books
            /// never pass the quota, count exactly what is live (rounded), and the driver
            /// holds exactly the allocations the books know.
            #[test]
            fn the_books_match_the_driver_and_never_pass_the_quota(
                ops in proptest::collection::vec(op(), 1..60),
                limit in 1u64..8 * MIB,
                pitch_align in prop_oneof![Just(512u64), Just(4096), Just(65536)],
            ) {
                let (mut d, b) = (FakeDriver::new(), FakeBooks::new(&[limit]));
                d.pitch = pitch_align;
                let d = d;
                let mut live: Vec<u64> = Vec::new();
                for op in ops {
                    let fail = |f: bool| if f { d.fail.borrow_mut().push_back(CUDA_ERROR_OUT_OF_MEMORY) };
                    match op {
                        Op::Alloc(n, f) => { fail(f); if let Ok(p) = alloc(&d, &b, Abi::V2, n) { live.push(p) } }
                        Op::Pitch(w, h, f) => { fail(f); if let Ok((p, _)) = alloc_pitch(&d, &b, Abi::V2, w, h, 4) { live.push(p) } }
                        Op::Managed(n) => { if let Ok(p) = alloc_managed(&d, &b, n, 1) { live.push(p) } }
                        Op::Free(i) if !live.is_empty() => { let p = live.remove(i % live.len()); prop_assert!(free(&d, &b, Abi::V2, p).is_ok()) }
                        Op::RefusedFree(i) if !live.is_empty() => {
                            *d.refuse_free.borrow_mut() = true;
                            prop_assert!(free(&d, &b, Abi::V2, live[i % live.len()]).is_err());
                            *d.refuse_free.borrow_mut() = false;
                        }
                        _ => {}
                    }
                    d.fail.borrow_mut().clear();
                    let recs = b.recs.borrow();
                    prop_assert!(b.used(0) <= limit);
                    prop_assert_eq!(b.used(0), recs.values().map(|r| r.size).sum::<u64>());
                    prop_assert_eq!(recs.keys().copied().collect::<Vec<_>>(), d.live.borrow().keys().copied().collect::<Vec<_>>());
                    for (p, r) in recs.iter() {
                        prop_assert!(r.size >= d.live.borrow()[p], "counted at least what the driver holds");
                    }
                }
            }

            /// Against a model of the driver (a handle's memory is freed when its last
            /// reference is released and its last mapping unmapped), the books release
            /// every counted handle exactly once, when the driver frees it.
            #[test]
            fn vmm_memory_is_released_exactly_when_the_driver_frees_it(ops in proptest::collection::vec(vmm_op(), 1..80)) {
                let mut h = VmmHandles::default();
                // the driver's model: handle -> (refs, mapped at), and which handles exist
                let mut model: BTreeMap<u64, (u32, Vec<u64>)> = BTreeMap::new();
                let mut at: BTreeMap<u64, u64> = BTreeMap::new(); // address -> handle
                let mut counted: BTreeMap<u64, u64> = BTreeMap::new(); // handle -> bytes held
                let mut next = 100u64;
                let mut ids: BTreeMap<u64, u64> = BTreeMap::new(); // op index -> live handle
                for op in ops {
                    let mut freed = Vec::new();
                    match op {
                        VmmOp::Create(i) => {
                            next += 1;
                            h.created(next, next * 4096, 0);
                            model.insert(next, (1, Vec::new()));
                            counted.insert(next, next * 4096);
                            ids.insert(i, next);
                        }
                        VmmOp::Retain(i) => if let Some(&id) = ids.get(&i) {
                            if let Some(m) = model.get_mut(&id) { if m.0 > 0 { m.0 += 1; h.retained(id) } }
                        },
                        VmmOp::Release(i) => if let Some(&id) = ids.get(&i) {
                            if let Some(m) = model.get_mut(&id) {
                                if m.0 > 0 { m.0 -= 1; freed.extend(h.released(id)) }
                            }
                        },
                        VmmOp::Map(i, a) => if let Some(&id) = ids.get(&i) {
                            let addr = 0x1000_0000 * (a + 1);
                            if model.get(&id).is_some_and(|m| m.0 > 0) && !at.contains_key(&addr) {
                                h.mapped(addr, 4096, id);
                                at.insert(addr, id);
                                model.get_mut(&id).unwrap().1.push(addr);
                            }
                        },
                        VmmOp::Unmap(a) => {
                            let addr = 0x1000_0000 * (a + 1);
                            if let Some(id) = at.remove(&addr) {
                                model.get_mut(&id).unwrap().1.retain(|&x| x != addr);
                                freed.extend(h.unmapped(addr, 4096));
                            }
                        }
                    }
                    let gone: Vec<u64> = model.iter().filter(|(_, m)| m.0 == 0 && m.1.is_empty()).map(|(&k, _)| k).collect();
                    for (_, bytes) in &freed {
                        let id = bytes / 4096;
                        prop_assert!(gone.contains(&id), "released handle {id} the driver still holds");
                        prop_assert!(counted.remove(&id).is_some(), "released handle {id} twice");
                    }
                    for id in gone {
                        model.remove(&id);
                        prop_assert!(!counted.contains_key(&id), "handle {id} freed by the driver but still counted");
                    }
                }
            }
        }
    }
}
