//! The process-wide driver: the shared simulator, this process's slot, and every object the
//! application created (contexts, modules, streams, allocations, …), keyed by handle id.
//!
//! Locks, in the order they may be taken: `Driver::inner` (this process's objects), then a
//! GPU's lock inside gpusim-core, then `Driver::watch` (a leaf). Nothing blocks — sleeping
//! for the device timeline — while holding `inner`.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

use gpusim_core::layout::MAX_GPUS;
use gpusim_core::{visible_devices, ProcHandle, State};
use parking_lot::Mutex;

use crate::errors::*;
use crate::ffi::{CUdevice, Handle, R};
use crate::va::Region;

/// A fast hasher for our own u64 ids (sequential, so a multiply spreads them well).
#[derive(Default)]
pub struct IdHasher(u64);
impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
pub type Map<T> = HashMap<u64, T, BuildHasherDefault<IdHasher>>;

/// `cuCtxSetLimit` values: stack, printf FIFO, malloc heap, sync depth, pending launches,
/// L2 fetch granularity, persisting L2.
pub const DEFAULT_LIMITS: [u64; 7] = [1024, 1 << 20, 8 << 20, 2, 2048, 64, 0];

pub struct Ctx {
    pub dev: usize,
    pub queue: usize,
    pub flags: u32,
    pub primary: bool,
    /// Device memory this context holds beyond allocations: its overhead, modules, limits.
    pub charged: u64,
    pub limits: [u64; 7],
    /// Sequence number of the last entry this context queued.
    pub last_seq: Option<u64>,
}

#[derive(Default, Clone, Copy)]
pub struct Primary {
    /// The context, while it is active (retained, not released or reset since).
    pub ctx: Option<u64>,
    /// Its handle, fixed the first time anyone asks for it: the same whether or not the
    /// context is active, as the real driver's primary context object outlives activations.
    pub handle: Option<u64>,
    pub refs: u32,
    pub flags: u32,
}

pub struct Module {
    pub ctx: u64,
    /// Kernel names the image declares; `None` for an image gpusim cannot read, where any
    /// name resolves.
    pub functions: Option<Vec<String>>,
    /// Global variables: name → (device address, size).
    pub globals: HashMap<String, (u64, u64)>,
    pub charged: u64,
    /// Functions handed out, by name (the driver returns the same handle each time).
    pub handles: HashMap<String, u64>,
    /// The library this module was loaded for, or 0.
    pub library: u64,
}

pub struct Func {
    /// Owning module, or 0 for a context-less library kernel.
    pub module: u64,
    /// For a library kernel (`CUkernel`), its library.
    pub library: u64,
    pub name: std::ffi::CString,
    /// Duration fixed by the name (cost model rule 1).
    pub fixed_ns: Option<u64>,
    /// Legacy launch state (`cuFuncSetBlockShape`, `cuParamSet*`).
    pub block_shape: [u32; 3],
    pub shared_bytes: u32,
    pub param_size: u32,
    pub max_dynamic_shared: i32,
}

pub struct Stream {
    pub ctx: u64,
    pub flags: u32,
    pub priority: i32,
    pub last_seq: Option<u64>,
    /// The graph being captured into, if this stream is capturing.
    pub capture: Option<u64>,
    pub capture_mode: u32,
}

#[derive(Clone, Copy)]
pub struct EventRec {
    pub dev: usize,
    pub queue: usize,
    /// Entry whose completion the event marks; `None` when nothing was pending.
    pub seq: Option<u64>,
    /// When it was recorded (monotonic ns).
    pub at: u64,
}

pub struct Event {
    pub ctx: u64,
    pub flags: u32,
    pub rec: Option<EventRec>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AllocKind {
    Linear,
    Pitch,
    Managed,
    /// From the 32-bit `cuMemAlloc` (v1).
    Low,
    /// Stream-ordered, from pool `id`.
    Pool(u64),
    /// Made by a graph memory-allocation node of device `dev`'s graph pool.
    Graph,
    /// Backing store of an array or mipmapped array.
    Array,
}

#[derive(Clone, Copy, Debug)]
pub struct Alloc {
    pub size: u64,
    /// Bytes charged to the device for it (0 when a pool or graph pool holds the charge).
    pub charged: u64,
    pub dev: usize,
    pub ctx: u64,
    pub kind: AllocKind,
}

pub struct HostMem {
    pub size: u64,
    /// Registered by the application (not ours to free).
    pub registered: bool,
}

/// Everything this process created.
pub struct Inner {
    next_id: u64,
    pub ctxs: Map<Ctx>,
    pub primary: [Primary; MAX_GPUS],
    pub modules: Map<Module>,
    pub libraries: Map<crate::module::Library>,
    pub funcs: Map<Func>,
    pub streams: Map<Stream>,
    pub events: Map<Event>,
    /// Device allocations by base address.
    pub allocs: BTreeMap<u64, Alloc>,
    pub host: BTreeMap<u64, HostMem>,
    /// Per-device address space for allocations.
    pub regions: Vec<Option<Region>>,
    /// Low (< 2 GiB) space for the 32-bit entry points.
    pub low: Option<Region>,
    pub arrays: Map<crate::array::Array>,
    pub mipmaps: Map<crate::array::Mipmap>,
    pub vmm: crate::vmm::Vmm,
    pub pools: crate::pool::Pools,
    pub graphs: crate::graph::Graphs,
}

impl Inner {
    /// The handle of device `dev`'s (config index) primary context, active or not.
    pub fn primary_handle(&mut self, dev: usize) -> u64 {
        match self.primary[dev].handle {
            Some(id) => id,
            None => {
                let id = self.new_id();
                self.primary[dev].handle = Some(id);
                id
            }
        }
    }

    /// Whether `id` may be made current: a live context, or a primary context's handle while
    /// the context is inactive (cudart makes it current, then retains it). Calls that need
    /// the context itself find it missing until it is retained.
    pub fn is_context_handle(&self, id: u64) -> bool {
        self.ctxs.contains_key(&id) || self.primary.iter().any(|p| p.handle == Some(id))
    }

    fn new(num_gpus: usize) -> Inner {
        Inner {
            next_id: 0,
            ctxs: Map::default(),
            primary: [Primary::default(); MAX_GPUS],
            modules: Map::default(),
            libraries: Map::default(),
            funcs: Map::default(),
            streams: Map::default(),
            events: Map::default(),
            allocs: BTreeMap::new(),
            host: BTreeMap::new(),
            regions: (0..num_gpus).map(|_| None).collect(),
            low: None,
            arrays: Map::default(),
            mipmaps: Map::default(),
            vmm: Default::default(),
            pools: Default::default(),
            graphs: Default::default(),
        }
    }

    /// A fresh handle id. Ids are spread over a range no real pointer uses, are never 0, 1
    /// or 2 (NULL and the special stream handles), and are never reused.
    pub fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        0x5100_0000_0000 + (self.next_id << 4)
    }
}

pub struct Driver {
    pub st: State,
    pub proc: ProcHandle,
    /// The GPUs `CUDA_VISIBLE_DEVICES` lets this process see: entry `i` is the config index
    /// of the device the application calls ordinal `i`. Everything inside gpusim-cuda keys
    /// devices by config index; ordinals exist only at the API boundary
    /// ([`Driver::device`] in, [`Driver::ordinal`] out).
    pub visible: Vec<usize>,
    pub inner: Mutex<Inner>,
    /// (dev, queue, seq) of recorded events whose completion time must outlive the
    /// queue's ring → done_at (0 until harvested).
    pub watch: Mutex<HashMap<(usize, usize, u64), u64>>,
    pub watching: AtomicUsize,
    /// The lowest seq in `watch` not harvested yet (`u64::MAX`: none). A launch harvests
    /// the entry it overwrites, a thousand back from the tail; below every such seq it is
    /// watched by no event, and the launch skips the lock and lookup (seqs are per queue:
    /// a filter, never a skip of a watched entry). A real driver's launches do not
    /// slow down while events are outstanding: without this, libvcuda's markers (events
    /// kept recorded on a throttled stream) added ~30 ns to every launch here.
    pub watch_min: AtomicU64,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();
static FORKED: AtomicBool = AtomicBool::new(false);
static INIT: Mutex<()> = Mutex::new(());
static REPORTED: AtomicBool = AtomicBool::new(false);

/// The initialised driver, or `CUDA_ERROR_NOT_INITIALIZED` before `cuInit` and in a child
/// forked after it (the CUDA driver does not survive fork).
pub fn driver() -> Result<&'static Driver, CUresult> {
    if FORKED.load(Relaxed) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    DRIVER.get().ok_or(CUDA_ERROR_NOT_INITIALIZED)
}

extern "C" fn at_exit() {
    if let Some(d) = DRIVER.get() {
        if !FORKED.load(Relaxed) {
            d.st.unregister_process(d.proc);
        }
    }
}

extern "C" fn in_fork_child() {
    FORKED.store(true, Relaxed);
}

/// `cuInit`: open the simulator, read `CUDA_VISIBLE_DEVICES` and claim this process's slot.
/// A broken config or state file prints one line (naming the file and the problem) once,
/// and returns `CUDA_ERROR_SYSTEM_NOT_READY`; a `CUDA_VISIBLE_DEVICES` that hides every GPU
/// returns `CUDA_ERROR_NO_DEVICE`, as the driver does. A later `cuInit` tries again.
pub fn init(flags: u32) -> R {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if FORKED.load(Relaxed) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    if DRIVER.get().is_some() {
        return Ok(());
    }
    let _g = INIT.lock();
    if DRIVER.get().is_some() {
        return Ok(());
    }
    let st = match State::open_from_env() {
        Ok(st) => st,
        Err(e) => return Err(not_ready(e)),
    };
    let visible = match std::env::var_os("CUDA_VISIBLE_DEVICES") {
        None => (0..st.num_gpus()).collect(),
        Some(spec) => visible_devices(&spec.to_string_lossy(), &st.config.gpu),
    };
    if visible.is_empty() {
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    match st.register_process() {
        Ok(proc) => {
            let n = st.num_gpus();
            let _ = DRIVER.set(Driver {
                st,
                proc,
                visible,
                inner: Mutex::new(Inner::new(n)),
                watch: Mutex::new(HashMap::new()),
                watching: AtomicUsize::new(0),
                watch_min: AtomicU64::new(u64::MAX),
            });
            // SAFETY: registering plain extern "C" functions with no captured state.
            unsafe {
                libc::atexit(at_exit);
                libc::pthread_atfork(None, None, Some(in_fork_child));
            }
            Ok(())
        }
        Err(e) => Err(not_ready(e)),
    }
}

/// gpusim's diagnostic log: one line on stderr, `gpusim: <message>`, when `GPUSIM_LOG` is set
/// to anything but empty or `0`. For what a user needs to know when something the driver
/// does not implement is asked for (an unknown export table).
pub fn log(msg: std::fmt::Arguments) {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = *ON
        .get_or_init(|| std::env::var_os("GPUSIM_LOG").is_some_and(|v| !v.is_empty() && v != "0"));
    if on {
        eprintln!("gpusim: {msg}");
    }
}

/// Report why the simulator cannot start (once per process): `CUDA_ERROR_SYSTEM_NOT_READY`.
fn not_ready(e: gpusim_core::SimError) -> CUresult {
    if !REPORTED.swap(true, Relaxed) {
        eprintln!("{e}");
    }
    CUDA_ERROR_SYSTEM_NOT_READY
}

thread_local! {
    /// This thread's context stack; the top is the current context.
    static CTX_STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

// The stack is reached with `try_with`: a thread's destructors (the CUDA runtime's at
// process exit, CuPy's among them) may call the driver after the stack itself was
// destroyed. There the thread has no current context, and pushes are dropped, instead of a
// panic ("cannot access a Thread Local Storage value during or after destruction").
pub fn current_ctx_id() -> Option<u64> {
    CTX_STACK
        .try_with(|s| s.borrow().last().copied())
        .ok()
        .flatten()
}

pub fn set_current(ctx: Option<u64>) {
    let _ = CTX_STACK.try_with(|s| {
        let mut s = s.borrow_mut();
        match ctx {
            Some(c) => match s.last_mut() {
                Some(top) => *top = c,
                None => s.push(c),
            },
            None => {
                s.pop();
            }
        }
    });
}

pub fn push_current(ctx: u64) {
    let _ = CTX_STACK.try_with(|s| s.borrow_mut().push(ctx));
}

pub fn pop_current() -> Option<u64> {
    CTX_STACK.try_with(|s| s.borrow_mut().pop()).ok().flatten()
}

impl Driver {
    /// The current context's id, or `CUDA_ERROR_INVALID_CONTEXT`.
    pub fn current(&self, inner: &Inner) -> Result<u64, CUresult> {
        let id = current_ctx_id().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if inner.ctxs.contains_key(&id) {
            Ok(id)
        } else {
            Err(CUDA_ERROR_INVALID_CONTEXT)
        }
    }

    /// The context a stream handle belongs to: its own for a created stream, the current
    /// one for NULL / legacy / per-thread.
    pub fn stream_ctx(&self, inner: &Inner, stream: Handle) -> Result<u64, CUresult> {
        let id = stream.id();
        if id == 0 || id == crate::ffi::STREAM_LEGACY || id == crate::ffi::STREAM_PER_THREAD {
            return self.current(inner);
        }
        let s = inner.streams.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if !inner.ctxs.contains_key(&s.ctx) {
            return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
        }
        Ok(s.ctx)
    }

    /// The config index of the GPU the application calls ordinal `dev` (a visible
    /// ordinal, see [`Driver::visible`]); `CUDA_ERROR_INVALID_DEVICE` if there is none.
    pub fn device(&self, dev: CUdevice) -> Result<usize, CUresult> {
        usize::try_from(dev)
            .ok()
            .and_then(|i| self.visible.get(i).copied())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// The ordinal the application knows GPU `real` (a config index) by;
    /// `CUDA_ERROR_INVALID_DEVICE` if `CUDA_VISIBLE_DEVICES` hides it.
    pub fn ordinal(&self, real: usize) -> Result<CUdevice, CUresult> {
        self.visible
            .iter()
            .position(|&g| g == real)
            .map(|i| i as CUdevice)
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// Number of devices the application sees.
    pub fn device_count(&self) -> usize {
        self.visible.len()
    }

    /// Charge device memory to this process; `CUDA_ERROR_OUT_OF_MEMORY` when the GPU is full.
    pub fn charge(&self, dev: usize, bytes: u64) -> R {
        if bytes == 0 || self.st.charge(dev, &self.proc, bytes) {
            Ok(())
        } else {
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
    }

    pub fn uncharge(&self, dev: usize, bytes: u64) {
        if bytes > 0 {
            self.st.uncharge(dev, &self.proc, bytes);
        }
    }

    /// Map the simulator's failure onto a driver code (a lost state file is a lost device).
    pub fn sim<T>(&self, r: Result<T, gpusim_core::SimError>) -> Result<T, CUresult> {
        r.map_err(|e| {
            eprintln!("{e}");
            CUDA_ERROR_UNKNOWN
        })
    }

    /// Queue `duration` ns of device work on context `ctx`, blocking while its launch
    /// queue is full; records the entry on the stream and context. Does not hold `inner`
    /// while it waits.
    pub fn enqueue(&self, ctx: u64, stream: Handle, duration: u64, kernels: u32) -> R {
        let (dev, queue) = {
            let inner = self.inner.lock();
            let c = inner.ctxs.get(&ctx).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
            (c.dev, c.queue)
        };
        let seq = if self.watching.load(Relaxed) == 0 {
            self.st.launch(dev, queue, duration, kernels)
        } else {
            let min = self.watch_min.load(Relaxed);
            self.st
                .launch_harvest(dev, queue, duration, kernels, &mut |old, done| {
                    if old < min {
                        return;
                    }
                    let mut w = self.watch.lock();
                    if let Some(v) = w.get_mut(&(dev, queue, old)) {
                        *v = done;
                        self.watch_min.store(lowest_unharvested(&w), Relaxed);
                    }
                })
        };
        let seq = self.sim(seq)?;
        let mut inner = self.inner.lock();
        if let Some(c) = inner.ctxs.get_mut(&ctx) {
            c.last_seq = Some(c.last_seq.map_or(seq, |s| s.max(seq)));
        }
        let sid = stream.id();
        if let Some(s) = inner.streams.get_mut(&sid) {
            s.last_seq = Some(s.last_seq.map_or(seq, |x| x.max(seq)));
        }
        Ok(())
    }

    /// Block until entry `seq` of `(dev, queue)` has run.
    pub fn wait(&self, dev: usize, queue: usize, seq: Option<u64>) -> R {
        match seq {
            Some(s) => self.sim(self.st.wait(dev, queue, s)),
            None => Ok(()),
        }
    }
}

/// [`Driver::watch_min`] of a watch map: harvested entries hold their completion time (a
/// monotonic time, never 0).
pub fn lowest_unharvested(w: &HashMap<(usize, usize, u64), u64>) -> u64 {
    w.iter()
        .filter(|(_, &done)| done == 0)
        .map(|(&(_, _, seq), _)| seq)
        .min()
        .unwrap_or(u64::MAX)
}

/// Round up to a multiple of `a` (a power of two).
pub fn round_up(x: u64, a: u64) -> u64 {
    (x + a - 1) & !(a - 1)
}
