//! CUDA graphs: built node by node or captured from a stream. Launching an executable
//! graph queues its kernels' total device time as one entry. Graph memory nodes allocate
//! from a per-device graph pool: the address is fixed when the node is made, physical memory
//! is reserved (and charged) at the first launch that needs it, and stays reserved after the
//! allocation is freed until `cuDeviceGraphMemTrim`.

use std::collections::HashMap;
use std::ffi::{c_char, c_void};

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    Kernel {
        dur: u64,
    },
    MemAlloc {
        addr: u64,
        size: u64,
        dev: usize,
    },
    MemFree {
        addr: u64,
    },
    /// Empty, memset, memcpy, host, event nodes: no device time in this model.
    Other,
}

pub struct Node {
    pub graph: u64,
    pub kind: NodeKind,
}

#[derive(Default)]
pub struct Graph {
    pub nodes: Vec<u64>,
}

pub struct Exec {
    pub dur: u64,
    pub kernels: u32,
    pub allocs: Vec<(u64, u64, usize)>,
    pub frees: Vec<u64>,
}

/// A device's graph memory pool.
#[derive(Default, Clone, Copy)]
pub struct GraphPool {
    pub reserved: u64,
    pub used: u64,
    pub reserved_high: u64,
    pub used_high: u64,
}

#[derive(Default)]
pub struct Graphs {
    pub graphs: Map<Graph>,
    pub nodes: Map<Node>,
    pub execs: Map<Exec>,
    /// Capturing stream → graph.
    pub capture: HashMap<u64, u64>,
    pub pools: Vec<GraphPool>,
    /// Graph allocations by address → (device, size, live).
    pub blocks: HashMap<u64, (usize, u64, bool)>,
}

impl Graphs {
    pub fn create(&mut self, id: u64) {
        self.graphs.insert(id, Graph::default());
    }

    pub fn capture_end(&mut self, stream: u64, _graph: u64) {
        self.capture.remove(&stream);
    }

    fn pool(&mut self, dev: usize) -> &mut GraphPool {
        if self.pools.len() <= dev {
            self.pools.resize(dev + 1, GraphPool::default());
        }
        &mut self.pools[dev]
    }
}

/// The graph `stream` is capturing into, if any.
pub fn capturing(inner: &Inner, stream: CUstream) -> Option<u64> {
    if inner.graphs.capture.is_empty() {
        return None;
    }
    inner.graphs.capture.get(&stream.id()).copied()
}

fn add_node(inner: &mut Inner, graph: u64, kind: NodeKind) -> Result<u64, CUresult> {
    if !inner.graphs.graphs.contains_key(&graph) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let id = inner.new_id();
    inner.graphs.nodes.insert(id, Node { graph, kind });
    if let Some(g) = inner.graphs.graphs.get_mut(&graph) {
        g.nodes.push(id);
    }
    Ok(id)
}

pub fn capture_kernel(inner: &mut Inner, graph: u64, _f: u64, dur: u64) {
    let _ = add_node(inner, graph, NodeKind::Kernel { dur });
}

/// A memory-allocation node: reserve its fixed address now.
fn alloc_node(
    d: &Driver,
    inner: &mut Inner,
    graph: u64,
    dev: usize,
    size: u64,
) -> Result<(u64, u64), CUresult> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let span = round_up(size, crate::memory::ALIGN);
    let addr = crate::memory::region(d, inner, dev)?
        .extents
        .alloc(span, 2 << 20)
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    inner.graphs.blocks.insert(addr, (dev, size, false));
    let node = add_node(inner, graph, NodeKind::MemAlloc { addr, size, dev })?;
    Ok((node, addr))
}

pub fn capture_alloc(
    d: &Driver,
    inner: &mut Inner,
    graph: u64,
    ctx: u64,
    size: u64,
) -> Result<u64, CUresult> {
    let dev = inner.ctxs[&ctx].dev;
    alloc_node(d, inner, graph, dev, size).map(|(_, a)| a)
}

pub fn capture_free(inner: &mut Inner, graph: u64, addr: u64) -> R {
    add_node(inner, graph, NodeKind::MemFree { addr }).map(|_| ())
}

/// A live graph allocation was freed with cuMemFree / cuMemFreeAsync.
pub fn on_free(inner: &mut Inner, dev: usize, addr: u64) {
    if let Some(b) = inner.graphs.blocks.get_mut(&addr) {
        if b.2 {
            b.2 = false;
            let size = b.1;
            let p = inner.graphs.pool(dev);
            p.used = p.used.saturating_sub(size);
        }
    }
}

fn instantiate(graph: CUgraph) -> Result<u64, CUresult> {
    let d = driver()?;
    let mut inner = d.inner.lock();
    let g = inner
        .graphs
        .graphs
        .get(&graph.id())
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut e = Exec {
        dur: 0,
        kernels: 0,
        allocs: Vec::new(),
        frees: Vec::new(),
    };
    for n in &g.nodes {
        match inner.graphs.nodes.get(n).map(|n| n.kind) {
            Some(NodeKind::Kernel { dur }) => {
                e.dur += dur;
                e.kernels += 1;
            }
            Some(NodeKind::MemAlloc { addr, size, dev }) => e.allocs.push((addr, size, dev)),
            Some(NodeKind::MemFree { addr }) => e.frees.push(addr),
            _ => {}
        }
    }
    let id = inner.new_id();
    inner.graphs.execs.insert(id, e);
    Ok(id)
}

/// Make the graph's allocations live (reserving pool memory as needed) and apply its frees.
fn apply_memory(
    d: &Driver,
    inner: &mut Inner,
    ctx: u64,
    e_allocs: &[(u64, u64, usize)],
    e_frees: &[u64],
) -> R {
    for &(addr, size, dev) in e_allocs {
        let live = inner.graphs.blocks.get(&addr).is_some_and(|b| b.2);
        if live {
            continue;
        }
        let p = *inner.graphs.pool(dev);
        let need = p.used + size;
        if need > p.reserved {
            let grow = round_up(need - p.reserved, 2 << 20);
            d.charge(dev, grow)?;
            inner.graphs.pool(dev).reserved += grow;
        }
        let p = inner.graphs.pool(dev);
        p.used += size;
        p.used_high = p.used_high.max(p.used);
        p.reserved_high = p.reserved_high.max(p.reserved);
        if let Some(b) = inner.graphs.blocks.get_mut(&addr) {
            b.2 = true;
        }
        inner.allocs.insert(
            addr,
            Alloc {
                size,
                charged: 0,
                dev,
                ctx,
                kind: AllocKind::Graph,
            },
        );
    }
    for &addr in e_frees {
        if inner
            .allocs
            .get(&addr)
            .is_some_and(|a| a.kind == AllocKind::Graph)
        {
            crate::memory::release(d, inner, addr);
        }
    }
    Ok(())
}

fn launch(exec: CUgraphExec, stream: CUstream) -> R {
    let d = driver()?;
    let (ctx, dur, kernels) = {
        let mut inner = d.inner.lock();
        let ctx = d.stream_ctx(&inner, stream)?;
        let e = inner
            .graphs
            .execs
            .get(&exec.id())
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (dur, kernels, allocs, frees) = (e.dur, e.kernels, e.allocs.clone(), e.frees.clone());
        apply_memory(d, &mut inner, ctx, &allocs, &frees)?;
        (ctx, dur, kernels)
    };
    d.enqueue(ctx, stream, dur, kernels)
}

fn kernel_node_dur(
    d: &Driver,
    inner: &mut Inner,
    func: CUfunction,
    kern: CUkernel,
    grid: [u32; 3],
    block: [u32; 3],
) -> Result<u64, CUresult> {
    let f = if func.is_null() { kern } else { func };
    let ctx = d.current(inner)?;
    let resolved = crate::module::resolve_for_launch(d, inner, f.id(), ctx)?;
    let dev = inner.ctxs[&ctx].dev;
    crate::launch::duration(d, inner, resolved, dev, grid, block, false)
}

fn add_kernel(
    out: Out<CUgraphNode>,
    graph: CUgraph,
    func: CUfunction,
    kern: CUkernel,
    grid: [u32; 3],
    block: [u32; 3],
) -> R {
    let d = driver()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    let dur = kernel_node_dur(d, &mut inner, func, kern, grid, block)?;
    let n = add_node(&mut inner, graph.id(), NodeKind::Kernel { dur })?;
    out.write(Handle::from_id(n))
}

fn add_simple(out: Out<CUgraphNode>, graph: CUgraph, kind: NodeKind) -> R {
    let d = driver()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    let n = add_node(&mut inner, graph.id(), kind)?;
    out.write(Handle::from_id(n))
}

fn add_alloc(out: Out<CUgraphNode>, graph: CUgraph, params: &mut CudaMemAllocNodeParams) -> R {
    let d = driver()?;
    if out.is_null() || params.pool_props.location.kind != CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = d.device(params.pool_props.location.id)?;
    let mut inner = d.inner.lock();
    let (n, addr) = alloc_node(d, &mut inner, graph.id(), dev, params.bytesize as u64)?;
    params.dptr = addr;
    out.write(Handle::from_id(n))
}

fn add_generic(out: Out<CUgraphNode>, graph: CUgraph, params: Out<CUgraphNodeParams>) -> R {
    let p = params.get_mut()?;
    match p.kind {
        CU_GRAPH_NODE_TYPE_KERNEL => {
            // SAFETY: for kernel nodes the union holds CUDA_KERNEL_NODE_PARAMS_v3, whose
            // layout is CudaKernelNodeParams (72 bytes ≤ the 232-byte union).
            let k = unsafe { &*(p.union.as_ptr() as *const CudaKernelNodeParams) };
            add_kernel(out, graph, k.func, k.kern, k.grid, k.block)
        }
        CU_GRAPH_NODE_TYPE_MEM_ALLOC => {
            // SAFETY: for allocation nodes the union holds CUDA_MEM_ALLOC_NODE_PARAMS_v2,
            // laid out as CudaMemAllocNodeParams (120 bytes); dptr is an output.
            let a = unsafe { &mut *(p.union.as_mut_ptr() as *mut CudaMemAllocNodeParams) };
            add_alloc(out, graph, a)
        }
        CU_GRAPH_NODE_TYPE_MEM_FREE => {
            add_simple(out, graph, NodeKind::MemFree { addr: p.union[0] })
        }
        _ => add_simple(out, graph, NodeKind::Other),
    }
}

fn instantiate_with_log(out: Out<CUgraphExec>, graph: CUgraph, error_node: Out<CUgraphNode>) -> R {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    error_node.write_opt(Handle::NULL);
    out.write(Handle::from_id(instantiate(graph)?))
}

fn instantiate_with_params(
    out: Out<CUgraphExec>,
    graph: CUgraph,
    params: Out<CudaGraphInstantiateParams>,
) -> R {
    let p = params.get_mut()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let id = instantiate(graph)?;
    p.result_out = 0;
    p.error_node_out = Handle::NULL;
    out.write(Handle::from_id(id))
}

fn upload(exec: CUgraphExec, stream: CUstream) -> R {
    let d = driver()?;
    let inner = d.inner.lock();
    d.stream_ctx(&inner, stream)?;
    inner
        .graphs
        .execs
        .get(&exec.id())
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    Ok(())
}

fn graph_mem_attr(dev: CUdevice, attr: u32, value: *mut c_void, set: bool) -> R {
    let d = driver()?;
    let dev = d.device(dev)?;
    if value.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    let p = inner.graphs.pool(dev);
    let v = value as *mut u64;
    // SAFETY: the attribute value is a cuuint64_t per cuda.h.
    unsafe {
        if set {
            match attr {
                1 if *v == 0 => p.used_high = p.used,
                3 if *v == 0 => p.reserved_high = p.reserved,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        } else {
            *v = match attr {
                0 => p.used,
                1 => p.used_high,
                2 => p.reserved,
                3 => p.reserved_high,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            };
        }
    }
    Ok(())
}

exports! {
    fn cuGraphCreate(out: Out<CUgraph>, flags: u32) {
        let d = driver()?;
        if out.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        let id = inner.new_id();
        inner.graphs.create(id);
        out.write(Handle::from_id(id))
    }
    fn cuGraphDestroy(graph: CUgraph) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let g = inner.graphs.graphs.remove(&graph.id()).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        for n in g.nodes {
            inner.graphs.nodes.remove(&n);
        }
        Ok(())
    }
    fn cuGraphGetNodes(graph: CUgraph, nodes: *mut CUgraphNode, count: Out<usize>) {
        let d = driver()?;
        let inner = d.inner.lock();
        let g = inner.graphs.graphs.get(&graph.id()).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let want = count.get_mut()?;
        if !nodes.is_null() {
            for (i, n) in g.nodes.iter().take(*want).enumerate() {
                // SAFETY: the caller's array holds *want CUgraphNode slots.
                unsafe { *nodes.add(i) = Handle::from_id(*n) };
            }
            *want = (*want).min(g.nodes.len());
        } else {
            *want = g.nodes.len();
        }
        Ok(())
    }
    fn cuGraphAddKernelNode(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, n: usize, params: In<CudaKernelNodeParamsV1>) {
        deps.slice(n)?;
        let p = params.get()?;
        add_kernel(out, graph, p.func, Handle::NULL, p.grid, p.block)
    }
    fn cuGraphAddKernelNode_v2(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, n: usize, params: In<CudaKernelNodeParams>) {
        deps.slice(n)?;
        let p = params.get()?;
        add_kernel(out, graph, p.func, p.kern, p.grid, p.block)
    }
    fn cuGraphAddEmptyNode(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, n: usize) {
        deps.slice(n)?;
        add_simple(out, graph, NodeKind::Other)
    }
    fn cuGraphAddMemsetNode(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, n: usize, params: *const c_void, ctx: CUcontext) {
        let _ = ctx;
        deps.slice(n)?;
        if params.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        add_simple(out, graph, NodeKind::Other)
    }
    fn cuGraphAddMemcpyNode(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, n: usize, params: *const c_void, ctx: CUcontext) {
        let _ = ctx;
        deps.slice(n)?;
        if params.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        add_simple(out, graph, NodeKind::Other)
    }
    fn cuGraphAddMemAllocNode(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, n: usize, params: Out<CudaMemAllocNodeParams>) {
        deps.slice(n)?;
        add_alloc(out, graph, params.get_mut()?)
    }
    fn cuGraphAddMemFreeNode(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, n: usize, dptr: CUdeviceptr) {
        deps.slice(n)?;
        add_simple(out, graph, NodeKind::MemFree { addr: dptr })
    }
    fn cuGraphAddNode(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, n: usize, params: Out<CUgraphNodeParams>) {
        deps.slice(n)?;
        add_generic(out, graph, params)
    }
    fn cuGraphAddNode_v2(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, edges: *const c_void, n: usize, params: Out<CUgraphNodeParams>) {
        let _ = edges;
        deps.slice(n)?;
        add_generic(out, graph, params)
    }
    // CUDA 13.4's ABI of cuGraphAddNode: the _v2 signature.
    fn cuGraphAddNode_v3(out: Out<CUgraphNode>, graph: CUgraph, deps: In<CUgraphNode>, edges: *const c_void, n: usize, params: Out<CUgraphNodeParams>) {
        let _ = edges;
        deps.slice(n)?;
        add_generic(out, graph, params)
    }
    fn cuGraphInstantiateWithFlags(out: Out<CUgraphExec>, graph: CUgraph, flags: u64) {
        if out.is_null() || flags & !0xf != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out.write(Handle::from_id(instantiate(graph)?))
    }
    fn cuGraphInstantiate(out: Out<CUgraphExec>, graph: CUgraph, error_node: Out<CUgraphNode>, log: *mut c_char, log_size: usize) {
        let _ = (log, log_size);
        instantiate_with_log(out, graph, error_node)
    }
    fn cuGraphInstantiate_v2(out: Out<CUgraphExec>, graph: CUgraph, error_node: Out<CUgraphNode>, log: *mut c_char, log_size: usize) {
        let _ = (log, log_size);
        instantiate_with_log(out, graph, error_node)
    }
    fn cuGraphInstantiateWithParams(out: Out<CUgraphExec>, graph: CUgraph, params: Out<CudaGraphInstantiateParams>) {
        instantiate_with_params(out, graph, params)
    }
    fn cuGraphInstantiateWithParams_ptsz(out: Out<CUgraphExec>, graph: CUgraph, params: Out<CudaGraphInstantiateParams>) {
        instantiate_with_params(out, graph, params)
    }
    fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) {
        launch(exec, stream)
    }
    fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) {
        launch(exec, stream)
    }
    fn cuGraphUpload(exec: CUgraphExec, stream: CUstream) {
        upload(exec, stream)
    }
    fn cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) {
        upload(exec, stream)
    }
    fn cuGraphExecDestroy(exec: CUgraphExec) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        inner.graphs.execs.remove(&exec.id()).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(())
    }
    fn cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: u32, value: *mut c_void) {
        graph_mem_attr(dev, attr, value, false)
    }
    fn cuDeviceSetGraphMemAttribute(dev: CUdevice, attr: u32, value: *mut c_void) {
        graph_mem_attr(dev, attr, value, true)
    }
    fn cuDeviceGraphMemTrim(dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let mut inner = d.inner.lock();
        let p = inner.graphs.pool(dev);
        let keep = round_up(p.used, 2 << 20);
        if p.reserved > keep {
            d.uncharge(dev, p.reserved - keep);
            p.reserved = keep;
        }
        Ok(())
    }
}
