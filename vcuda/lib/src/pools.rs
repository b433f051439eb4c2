//! Stream-ordered allocation, memory pools and graph memory as safe operations over two
//! traits, like `quota`'s: [`PoolDriver`] (what the pool path asks the driver: a pool's
//! reserved and used memory, a device's default pool, whether a stream is capturing, the
//! graph pool's reserved memory; the real one is `state::RealPools`, zero-sized, below every
//! wrapper because the slow path of `Vcuda::reserve` re-reads the pools) and [`PoolBooks`]
//! (the books of `quota::Books` plus the pool and graph-memory tables; `state::Vcuda`
//! implements it).
//!
//! The rule: a pool is counted at what it has reserved from the device, whatever of it its
//! allocations use. A stream-ordered allocation reserves, before the driver call, the
//! growth the pool may need ([`quota::pool_hold`]), then the pool's count is settled to the
//! driver's figure and the hold released; a free counts nothing (the memory stays in the
//! pool's cache); a trim or a synchronisation shrinks the pool, which the next settle (after
//! a trim, on the sweep, on a refused reservation) releases. Graph memory is the same rule
//! for each GPU's graph pool, read after launches once a graph memory node was made.

use std::collections::HashMap;

use vcuda_contract::config::MAX_GPUS;

use crate::quota::{pool_hold, Books, R};
use crate::table::{Kind, Rec};

/// What the pool path asks the driver. Pools and streams are the driver's handles as
/// integers.
pub(crate) trait PoolDriver {
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: what `pool` holds from the device.
    fn pool_reserved(&self, pool: usize) -> Option<u64>;
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`: what `pool`'s live allocations use of it.
    fn pool_used(&self, pool: usize) -> Option<u64>;
    /// `cuDeviceGetMemPool`: the pool `cuMemAllocAsync` takes from on CUDA ordinal `ordinal`.
    fn default_pool(&self, ordinal: i32) -> Option<usize>;
    /// `cuStreamIsCapturing`: whether `stream` is being captured into a graph.
    fn capturing(&self, stream: usize) -> bool;
    /// `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT` of CUDA ordinal `ordinal`.
    fn graph_reserved(&self, ordinal: i32) -> Option<u64>;
}

/// The books the pool path keeps beyond `quota::Books`.
pub(crate) trait PoolBooks: Books {
    /// Count `bytes` the driver already holds, without checking the quota.
    fn force_add(&self, dev: usize, bytes: u64);
    /// Act on the pool table (under the lock that keeps its settles in order).
    fn with_pools<T>(&self, f: impl FnOnce(&mut PoolTable) -> T) -> T;
    /// Act on the graph memory table.
    fn with_graph<T>(&self, f: impl FnOnce(&mut GraphMem) -> T) -> T;
    /// Run `f`, a stream-ordered allocation, serialised with this process's others; `f` is
    /// told whether no synchronisation can give a pool's cache back meanwhile (then the
    /// cache may be counted on).
    fn stream_ordered<T>(&self, f: impl FnOnce(bool) -> T) -> T;
    /// Run `f`, a call during which pools may give cached memory back (a trim).
    fn shrinking<T>(&self, f: impl FnOnce() -> T) -> T;
    /// How many GPUs the container is given.
    fn gpu_count(&self) -> usize;
    /// The CUDA ordinal of config GPU `dev`, if the driver shows it.
    fn shown_ordinal(&self, dev: usize) -> Option<i32>;
}

/// A counted figure moved from `before` to `now` on `dev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Change {
    pub dev: usize,
    pub before: u64,
    pub now: u64,
}

/// Count a [`Change`]: growth is memory the driver already holds (added unchecked),
/// shrinkage is released.
fn apply(b: &impl PoolBooks, c: Change) {
    if c.now > c.before {
        b.force_add(c.dev, c.now - c.before);
    } else if c.now < c.before {
        b.release(c.dev, c.before - c.now);
    }
}

/// The pools the library counts: pool → (GPU, bytes counted for it).
#[derive(Debug, Default)]
pub(crate) struct PoolTable {
    pools: HashMap<usize, (usize, u64)>,
}

impl PoolTable {
    /// `cuMemPoolCreate` made `pool` on `dev` (nothing counted for it yet).
    pub(crate) fn add(&mut self, pool: usize, dev: usize) {
        self.pools.insert(pool, (dev, 0));
    }

    /// The GPU of a known pool.
    pub(crate) fn dev_of(&self, pool: usize) -> Option<usize> {
        self.pools.get(&pool).map(|e| e.0)
    }

    /// `pool` (on `dev` unless known) holds `now`: the change from what was counted.
    pub(crate) fn settle(&mut self, pool: usize, dev: usize, now: u64) -> Change {
        let e = self.pools.entry(pool).or_insert((dev, 0));
        let before = std::mem::replace(&mut e.1, now);
        Change {
            dev: e.0,
            before,
            now,
        }
    }

    /// Forget `pool`, returning (GPU, bytes counted).
    fn remove(&mut self, pool: usize) -> Option<(usize, u64)> {
        self.pools.remove(&pool)
    }

    /// Every known pool and its GPU (a snapshot).
    fn known(&self) -> Vec<(usize, usize)> {
        self.pools.iter().map(|(&p, &(d, _))| (p, d)).collect()
    }
}

/// Each GPU's graph pool as last counted, and whether any graph memory node was made.
#[derive(Debug, Default)]
pub(crate) struct GraphMem {
    held: [u64; MAX_GPUS],
    seen: bool,
}

impl GraphMem {
    /// A graph memory node was made (from now on, launches read the graph pools).
    pub(crate) fn saw(&mut self) {
        self.seen = true;
    }

    /// Whether a graph memory node was made.
    pub(crate) fn seen(&self) -> bool {
        self.seen
    }

    /// `dev`'s graph pool holds `now`: the change from the last reading.
    pub(crate) fn settle(&mut self, dev: usize, now: u64) -> Change {
        Change {
            dev,
            before: std::mem::replace(&mut self.held[dev], now),
            now,
        }
    }
}

/// Bring the count for `pool` (on `dev` unless known) to what the driver says it holds now
/// (read under the table's lock, so concurrent settles apply in the order they read).
pub(crate) fn settle_pool(d: &impl PoolDriver, b: &impl PoolBooks, pool: usize, dev: usize) {
    let change = b.with_pools(|t| Some(t.settle(pool, dev, d.pool_reserved(pool)?)));
    if let Some(c) = change {
        apply(b, c);
    }
}

/// Re-read every known pool (they shrink at synchronisations the application makes).
pub(crate) fn refresh_pools(d: &impl PoolDriver, b: &impl PoolBooks) {
    for (pool, dev) in b.with_pools(|t| t.known()) {
        settle_pool(d, b, pool, dev);
    }
}

/// `cuMemPoolDestroy(pool)` succeeded: release what was counted for it.
pub(crate) fn drop_pool(b: &impl PoolBooks, pool: usize) {
    if let Some((dev, bytes)) = b.with_pools(|t| t.remove(pool)) {
        b.release(dev, bytes);
    }
}

/// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` of `size` bytes (not 0: the shell's
/// bypass) on `stream`, from `pool` or the current device's default pool; `call` makes it
/// and returns the pointer. Captured into a graph, the memory appears when the graph runs
/// (graph memory); without a context or a pool nothing can be counted and the driver
/// decides. Otherwise the growth the pool may need is held before the call (refused if
/// that would pass the quota), the pool settled to the driver's figure after it, and the
/// hold released: the books then count the pool's reserved memory, not the allocation.
pub(crate) fn stream_alloc(
    d: &impl PoolDriver,
    b: &impl PoolBooks,
    size: u64,
    stream: usize,
    pool: Option<usize>,
    call: impl FnOnce() -> R<u64>,
) -> R<u64> {
    if d.capturing(stream) {
        b.with_graph(GraphMem::saw);
        return call();
    }
    let Some(dev) = b.current_dev() else {
        return call();
    };
    let Some(pool) = pool.or_else(|| d.default_pool(b.ordinal_of(dev))) else {
        return call();
    };
    let dev = b.with_pools(|t| t.dev_of(pool)).unwrap_or(dev);
    b.stream_ordered(|stable| {
        // What the pool cannot serve from memory it already holds, it grows by, in
        // granules. The cache counts only while no synchronisation can give it back; else
        // the growth is held as if the pool had nothing cached.
        let cached = if stable {
            d.pool_reserved(pool)
                .zip(d.pool_used(pool))
                .map_or(0, |(r, u)| r.saturating_sub(u))
        } else {
            0
        };
        let hold = pool_hold(size, cached);
        if !b.reserve(dev, hold) {
            return Err(b.refuse_for_quota(dev));
        }
        let made = call();
        if let Ok(ptr) = made {
            settle_pool(d, b, pool, dev);
            b.insert(
                ptr,
                Rec {
                    size,
                    dev: crate::conv::dev_u8(dev),
                    kind: Kind::Pool,
                },
            );
        }
        b.release(dev, hold);
        made
    })
}

/// `cuMemPoolTrimTo(pool, …)` by `call`: the pool may give memory back meanwhile; after it,
/// what it gave back is released.
pub(crate) fn trim(
    d: &impl PoolDriver,
    b: &impl PoolBooks,
    pool: usize,
    call: impl FnOnce() -> R<()>,
) -> R<()> {
    b.shrinking(call)?;
    if let Some(dev) = b.with_pools(|t| t.dev_of(pool)) {
        settle_pool(d, b, pool, dev);
    }
    Ok(())
}

/// Count the graph memory each GPU's graph pool holds now (visible only after launches;
/// nothing is read until a graph memory node was made).
pub(crate) fn refresh_graph_mem(d: &impl PoolDriver, b: &impl PoolBooks) {
    if !b.with_graph(|g| g.seen()) {
        return;
    }
    for dev in 0..b.gpu_count() {
        let Some(now) = b.shown_ordinal(dev).and_then(|o| d.graph_reserved(o)) else {
            continue;
        };
        let c = b.with_graph(|g| g.settle(dev, now));
        apply(b, c);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::collections::{BTreeMap, VecDeque};

    use super::*;
    use crate::ffi::{CUresult, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY};
    use crate::quota::fake::FakeBooks;
    use crate::quota::{counted, free_with, POOL_GRANULE};

    const MIB: u64 = 1 << 20;
    const G: u64 = POOL_GRANULE;

    /// One pool as the driver keeps it: what it reserved, and its live allocations.
    #[derive(Debug, Default, Clone)]
    struct ModelPool {
        reserved: u64,
        allocs: BTreeMap<u64, u64>,
    }

    impl ModelPool {
        fn used(&self) -> u64 {
            self.allocs.values().sum()
        }
    }

    /// A driver with pools that grow by whole granules and keep freed memory cached until
    /// trimmed; `calls` counts the allocations that reached it.
    struct FakePools {
        pools: RefCell<BTreeMap<usize, ModelPool>>,
        default: Option<usize>,
        capturing: Cell<bool>,
        fail: RefCell<VecDeque<CUresult>>,
        graph: RefCell<Vec<u64>>,
        calls: Cell<u32>,
        next: Cell<u64>,
    }

    impl FakePools {
        fn new() -> FakePools {
            FakePools {
                pools: RefCell::new(BTreeMap::new()),
                default: Some(1),
                capturing: Cell::new(false),
                fail: RefCell::new(VecDeque::new()),
                graph: RefCell::new(vec![0; 2]),
                calls: Cell::new(0),
                next: Cell::new(0x7e00_0000_0000),
            }
        }

        /// `cuMemAllocFromPoolAsync(size, pool)`.
        fn alloc(&self, pool: usize, size: u64) -> R<u64> {
            self.calls.set(self.calls.get() + 1);
            if let Some(e) = self.fail.borrow_mut().pop_front() {
                return Err(e);
            }
            let mut pools = self.pools.borrow_mut();
            let p = pools.entry(pool).or_default();
            let need = counted(size);
            let cached = p.reserved - p.used();
            if cached < need {
                p.reserved += (need - cached).div_ceil(G) * G;
            }
            let ptr = self.next.get();
            self.next.set(ptr + need + 0x1000);
            p.allocs.insert(ptr, need);
            Ok(ptr)
        }

        /// `cuMemFreeAsync(ptr)`: back to its pool's cache.
        fn free(&self, ptr: u64) -> R<()> {
            let mut pools = self.pools.borrow_mut();
            let p = pools.values_mut().find(|p| p.allocs.contains_key(&ptr));
            p.and_then(|p| p.allocs.remove(&ptr))
                .map(drop)
                .ok_or(CUDA_ERROR_INVALID_VALUE)
        }

        /// `cuMemPoolTrimTo(pool, keep)`: unused memory beyond `keep` goes back.
        fn trim(&self, pool: usize, keep: u64) -> R<()> {
            if let Some(p) = self.pools.borrow_mut().get_mut(&pool) {
                let floor = p.used().max(keep).div_ceil(G) * G;
                p.reserved = p.reserved.min(floor);
            }
            Ok(())
        }

        fn reserved(&self) -> u64 {
            self.pools.borrow().values().map(|p| p.reserved).sum()
        }
    }

    impl PoolDriver for FakePools {
        fn pool_reserved(&self, pool: usize) -> Option<u64> {
            Some(self.pools.borrow().get(&pool).map_or(0, |p| p.reserved))
        }
        fn pool_used(&self, pool: usize) -> Option<u64> {
            Some(self.pools.borrow().get(&pool).map_or(0, ModelPool::used))
        }
        fn default_pool(&self, _ordinal: i32) -> Option<usize> {
            self.default
        }
        fn capturing(&self, _stream: usize) -> bool {
            self.capturing.get()
        }
        fn graph_reserved(&self, ordinal: i32) -> Option<u64> {
            self.graph
                .borrow()
                .get(usize::try_from(ordinal).ok()?)
                .copied()
        }
    }

    /// `FakeBooks` with the pool and graph tables; `syncing` says a synchronisation runs
    /// (the cache cannot be counted on).
    struct Books2 {
        b: FakeBooks,
        pools: RefCell<PoolTable>,
        graph: RefCell<GraphMem>,
        syncing: Cell<bool>,
        in_alloc: Cell<bool>,
    }

    impl Books2 {
        fn new(limits: &[u64]) -> Books2 {
            Books2 {
                b: FakeBooks::new(limits),
                pools: RefCell::new(PoolTable::default()),
                graph: RefCell::new(GraphMem::default()),
                syncing: Cell::new(false),
                in_alloc: Cell::new(false),
            }
        }
        fn used(&self, dev: usize) -> u64 {
            self.b.used(dev)
        }
    }

    impl Books for Books2 {
        fn current_dev(&self) -> Option<usize> {
            self.b.current_dev()
        }
        fn reserve(&self, dev: usize, bytes: u64) -> bool {
            self.b.reserve(dev, bytes)
        }
        fn release(&self, dev: usize, bytes: u64) {
            self.b.release(dev, bytes)
        }
        fn refuse_for_quota(&self, dev: usize) -> CUresult {
            self.b.refuse_for_quota(dev)
        }
        fn insert(&self, ptr: u64, rec: Rec) {
            self.b.insert(ptr, rec)
        }
        fn remove(&self, ptr: u64) -> Option<Rec> {
            self.b.remove(ptr)
        }
        fn ordinal_of(&self, dev: usize) -> i32 {
            self.b.ordinal_of(dev)
        }
    }

    impl PoolBooks for Books2 {
        fn force_add(&self, dev: usize, bytes: u64) {
            self.b.used.borrow_mut()[dev] += bytes;
        }
        fn with_pools<T>(&self, f: impl FnOnce(&mut PoolTable) -> T) -> T {
            f(&mut self.pools.borrow_mut())
        }
        fn with_graph<T>(&self, f: impl FnOnce(&mut GraphMem) -> T) -> T {
            f(&mut self.graph.borrow_mut())
        }
        fn stream_ordered<T>(&self, f: impl FnOnce(bool) -> T) -> T {
            assert!(
                !self.in_alloc.replace(true),
                "stream-ordered allocations nest"
            );
            let r = f(!self.syncing.get());
            self.in_alloc.set(false);
            r
        }
        fn shrinking<T>(&self, f: impl FnOnce() -> T) -> T {
            assert!(!self.in_alloc.get(), "a trim ran inside an allocation");
            f()
        }
        fn gpu_count(&self) -> usize {
            self.b.limits.len()
        }
        fn shown_ordinal(&self, dev: usize) -> Option<i32> {
            (dev < self.b.limits.len()).then(|| crate::conv::i32_sat(dev))
        }
    }

    fn alloc(d: &FakePools, b: &Books2, size: u64, pool: Option<usize>) -> R<u64> {
        let p = pool.or(d.default).unwrap();
        stream_alloc(d, b, size, 0, pool, || d.alloc(p, size))
    }

    #[test]
    fn an_allocation_the_pools_cache_serves_reserves_nothing() {
        let (d, b) = (FakePools::new(), Books2::new(&[16 * MIB]));
        let p = alloc(&d, &b, MIB, None).unwrap();
        assert_eq!(
            b.used(0),
            G,
            "the pool grew by one granule, and that is counted"
        );
        free_with(&b, p, || d.free(p)).unwrap();
        assert_eq!(b.used(0), G, "freed memory stays in the pool's cache");
        // the cache serves it: nothing more is held, even with the quota all but full
        b.b.reserve(0, 16 * MIB - G);
        alloc(&d, &b, G, None).unwrap();
        assert_eq!((b.used(0), d.reserved()), (16 * MIB, G));
        assert_eq!(*b.b.refusals.borrow(), 0);
    }

    #[test]
    fn growth_is_reserved_in_whole_granules_and_refused_before_the_driver() {
        let (d, b) = (FakePools::new(), Books2::new(&[5 * MIB]));
        alloc(&d, &b, 3 * MIB, None).unwrap();
        assert_eq!(b.used(0), 2 * G, "3 MiB grows the pool by two granules");
        let calls = d.calls.get();
        // 1 MiB is cached; 2 MiB more needs one more granule: 6 MiB > 5 MiB
        assert_eq!(alloc(&d, &b, 2 * MIB, None), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(
            d.calls.get(),
            calls,
            "the refused call never reached the driver"
        );
        assert_eq!((b.used(0), *b.b.refusals.borrow()), (2 * G, 1));
        // what the cache holds still serves
        alloc(&d, &b, MIB, None).unwrap();
        assert_eq!(b.used(0), 2 * G);
    }

    #[test]
    fn during_a_synchronisation_the_cache_is_not_counted_on() {
        let (d, b) = (FakePools::new(), Books2::new(&[5 * MIB]));
        let p = alloc(&d, &b, 4 * MIB, None).unwrap();
        free_with(&b, p, || d.free(p)).unwrap();
        b.syncing.set(true);
        // the cache could serve it, but a synchronisation may give the cache back: the
        // growth is held as if nothing were cached (2 MiB more than the 4 counted)
        assert_eq!(alloc(&d, &b, MIB, None), Err(CUDA_ERROR_OUT_OF_MEMORY));
        b.syncing.set(false);
        alloc(&d, &b, MIB, None).unwrap();
        assert_eq!(b.used(0), 4 * MIB);
    }

    #[test]
    fn a_driver_failure_rolls_the_hold_back() {
        let (d, b) = (FakePools::new(), Books2::new(&[16 * MIB]));
        d.fail.borrow_mut().push_back(CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(alloc(&d, &b, MIB, None), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!((b.used(0), *b.b.refusals.borrow()), (0, 0));
        assert!(b.b.recs.borrow().is_empty() && b.pools.borrow().known().is_empty());
    }

    #[test]
    fn settling_after_a_trim_releases_exactly_what_the_pool_gave_back() {
        let (d, b) = (FakePools::new(), Books2::new(&[64 * MIB]));
        b.with_pools(|t| t.add(7, 0));
        let ps: Vec<u64> = (0..4)
            .map(|_| alloc(&d, &b, 3 * MIB, Some(7)).unwrap())
            .collect();
        assert_eq!(b.used(0), d.reserved());
        let before = b.used(0);
        for &p in &ps[..3] {
            free_with(&b, p, || d.free(p)).unwrap();
        }
        assert_eq!(b.used(0), before, "a free counts nothing");
        trim(&d, &b, 7, || d.trim(7, 0)).unwrap();
        assert_eq!(b.used(0), 4 * MIB, "the last allocation's granules stay");
        assert_eq!(b.used(0), d.reserved());
        // a pool the library was not told of is settled by its allocations, then destroyed
        drop_pool(&b, 7);
        assert_eq!(b.used(0), 0);
    }

    #[test]
    fn a_pool_shrunk_by_a_synchronisation_is_released_on_refresh() {
        let (d, b) = (FakePools::new(), Books2::new(&[64 * MIB]));
        let p = alloc(&d, &b, 10 * MIB, None).unwrap();
        free_with(&b, p, || d.free(p)).unwrap();
        d.trim(1, 0).unwrap(); // the driver's own release threshold, at a synchronisation
        assert_eq!(b.used(0), 10 * MIB);
        refresh_pools(&d, &b);
        assert_eq!(b.used(0), 0);
    }

    #[test]
    fn a_captured_allocation_is_graph_memory_and_uncounted() {
        let (d, b) = (FakePools::new(), Books2::new(&[16 * MIB]));
        d.capturing.set(true);
        alloc(&d, &b, MIB, None).unwrap();
        assert_eq!(b.used(0), 0);
        assert!(b.graph.borrow().seen());
        // the graph pool is counted when read after a launch, and released when it shrinks
        d.graph.borrow_mut()[0] = 4 * MIB;
        refresh_graph_mem(&d, &b);
        assert_eq!(b.used(0), 4 * MIB);
        d.graph.borrow_mut()[0] = MIB;
        refresh_graph_mem(&d, &b);
        assert_eq!(b.used(0), MIB);
    }

    #[test]
    fn graph_memory_is_not_read_before_a_graph_memory_node_is_made() {
        let (d, b) = (FakePools::new(), Books2::new(&[16 * MIB, 16 * MIB]));
        d.graph.borrow_mut()[1] = 8 * MIB;
        refresh_graph_mem(&d, &b);
        assert_eq!((b.used(0), b.used(1)), (0, 0));
        b.with_graph(GraphMem::saw);
        refresh_graph_mem(&d, &b);
        assert_eq!((b.used(0), b.used(1)), (0, 8 * MIB));
    }

    #[test]
    fn without_a_context_or_a_pool_the_driver_decides_and_nothing_is_counted() {
        let (mut d, mut b) = (FakePools::new(), Books2::new(&[16 * MIB]));
        b.b.dev = None;
        alloc(&d, &b, MIB, Some(1)).unwrap();
        b.b.dev = Some(0);
        d.default = None;
        stream_alloc(&d, &b, MIB, 0, None, || d.alloc(3, MIB)).unwrap();
        assert_eq!(b.used(0), 0);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Alloc(u64, usize, bool, bool),
            Free(usize),
            Trim(usize, u64),
            Refresh,
            Destroy(usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (1u64..5 * MIB, 0usize..3, any::<bool>(), prop::bool::weighted(0.1))
                    .prop_map(|(n, p, s, f)| Op::Alloc(n, p, s, f)),
                3 => (0usize..32).prop_map(Op::Free),
                1 => (0usize..3, 0u64..6 * MIB).prop_map(|(p, k)| Op::Trim(p, k)),
                1 => Just(Op::Refresh),
                1 => (1usize..3).prop_map(Op::Destroy),
            ]
        }

        proptest! {
            /// Over any sequence of stream-ordered allocations (cache stable or not, driver
            /// failures), frees, trims, refreshes and pool destroys against a model pool:
            /// the books never pass the quota and, once settled, count exactly the memory
            /// the pools hold.
            #[test]
            fn the_books_count_the_pools_reserved_memory_and_never_pass_the_quota(
                ops in proptest::collection::vec(op(), 1..60),
                limit in 1u64..24 * MIB,
            ) {
                let (d, b) = (FakePools::new(), Books2::new(&[limit]));
                b.with_pools(|t| { t.add(1, 0); t.add(2, 0) });
                let mut live: Vec<u64> = Vec::new();
                for op in ops {
                    match op {
                        Op::Alloc(n, p, stable, fail) => {
                            b.syncing.set(!stable);
                            if fail { d.fail.borrow_mut().push_back(CUDA_ERROR_OUT_OF_MEMORY) }
                            let r = alloc(&d, &b, n, (p > 0).then_some(p));
                            d.fail.borrow_mut().clear();
                            if let Ok(ptr) = r { live.push(ptr) }
                        }
                        Op::Free(i) if !live.is_empty() => {
                            let ptr = live.remove(i % live.len());
                            prop_assert!(free_with(&b, ptr, || d.free(ptr)).is_ok());
                        }
                        Op::Trim(p, keep) => { prop_assert!(trim(&d, &b, p, || d.trim(p, keep)).is_ok()) }
                        Op::Refresh => refresh_pools(&d, &b),
                        Op::Destroy(p) => {
                            // the driver frees a pool's memory with it (its allocations too)
                            let gone = d.pools.borrow_mut().remove(&p);
                            if let Some(m) = gone {
                                live.retain(|x| !m.allocs.contains_key(x));
                                for x in m.allocs.keys() { b.b.remove(*x); }
                            }
                            drop_pool(&b, p);
                            b.with_pools(|t| t.add(p, 0));
                        }
                        _ => {}
                    }
                    prop_assert!(b.used(0) <= limit, "counts {} of {limit}", b.used(0));
                    prop_assert_eq!(b.used(0), d.reserved());
                    let pools = d.pools.borrow();
                    let held: u64 = pools.values().map(ModelPool::used).sum();
                    prop_assert!(held <= b.used(0), "pools use {held}, the books count {}", b.used(0));
                }
            }

            /// A graph pool's count follows the driver's reading whatever it does.
            #[test]
            fn graph_memory_follows_the_graph_pools(readings in proptest::collection::vec((0usize..2, 0u64..1 << 34), 1..40)) {
                let (d, b) = (FakePools::new(), Books2::new(&[u64::MAX, u64::MAX]));
                b.with_graph(GraphMem::saw);
                for (dev, now) in readings {
                    d.graph.borrow_mut()[dev] = now;
                    refresh_graph_mem(&d, &b);
                    let g = d.graph.borrow();
                    prop_assert_eq!((b.used(0), b.used(1)), (g[0], g[1]));
                }
            }
        }
    }
}
