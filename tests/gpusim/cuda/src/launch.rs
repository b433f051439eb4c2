//! Kernel launches, every entry point: each validates its arguments as the driver does,
//! computes the kernel's device time (`gpusim_core::cost`) and queues it on its context's
//! launch queue. A launch returns at once unless that queue is full; a launch on a capturing
//! stream becomes a graph node instead.

use std::ffi::{c_uint, c_void};

use gpusim_core::cost;

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;

pub struct Launch {
    pub f: CUfunction,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: u32,
    pub stream: CUstream,
    pub cooperative: bool,
}

/// Device time of one launch of `f` on `dev` (validates the shape).
pub fn duration(
    d: &Driver,
    inner: &Inner,
    f: u64,
    dev: usize,
    grid: [u32; 3],
    block: [u32; 3],
    cooperative: bool,
) -> Result<u64, CUresult> {
    if grid.contains(&0)
        || block.contains(&0)
        || grid[1] > 65535
        || grid[2] > 65535
        || block[2] > 64
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let tpb = u64::from(block[0]) * u64::from(block[1]) * u64::from(block[2]);
    if tpb > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let func = inner.funcs.get(&f).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let g = &d.st.config.gpu[dev];
    if cooperative {
        let resident = u64::from(g.sm_count) * (u64::from(g.max_threads_per_sm) / tpb).max(1);
        let blocks = u64::from(grid[0]) * u64::from(grid[1]) * u64::from(grid[2]);
        if blocks > resident {
            return Err(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
        }
    }
    Ok(func.fixed_ns.unwrap_or_else(|| {
        cost::kernel_duration_ns(
            &func.name.to_string_lossy(),
            grid,
            block,
            g.sm_count,
            g.max_threads_per_sm,
            d.st.config.wave_ns,
        )
    }))
}

pub fn launch(l: Launch) -> R {
    let d = driver()?;
    let (ctx, dur) = {
        let mut inner = d.inner.lock();
        let ctx = d.stream_ctx(&inner, l.stream)?;
        let f = crate::module::resolve_for_launch(d, &mut inner, l.f.id(), ctx)?;
        let dev = inner.ctxs[&ctx].dev;
        if l.shared > 166_912 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dur = duration(d, &inner, f, dev, l.grid, l.block, l.cooperative)?;
        if let Some(graph) = crate::graph::capturing(&inner, l.stream) {
            crate::graph::capture_kernel(&mut inner, graph, f, dur);
            return Ok(());
        }
        (ctx, dur)
    };
    // Enqueue outside the lock: it may wait for room in the queue.
    d.enqueue(ctx, l.stream, dur, 1)
}

fn check_params(params: *mut *mut c_void, extra: *mut *mut c_void) -> R {
    if !params.is_null() && !extra.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn launch_kernel(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    cooperative: bool,
) -> R {
    check_params(params, extra)?;
    launch(Launch {
        f,
        grid: [gx, gy, gz],
        block: [bx, by, bz],
        shared,
        stream,
        cooperative,
    })
}

fn launch_ex(
    config: In<CUlaunchConfig>,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> R {
    let c = config.get()?;
    check_params(params, extra)?;
    let attrs_in = In::from_raw(c.attrs);
    let attrs = attrs_in.slice(c.num_attrs as usize)?;
    let cooperative = attrs
        .iter()
        .any(|a| a.id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && a.value[..4] != [0; 4]);
    launch(Launch {
        f,
        grid: c.grid,
        block: c.block,
        shared: c.shared_mem_bytes,
        stream: c.stream,
        cooperative,
    })
}

fn legacy(f: CUfunction, w: i32, h: i32, stream: CUstream) -> R {
    let d = driver()?;
    if w <= 0 || h <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (block, shared) = {
        let inner = d.inner.lock();
        let func = inner.funcs.get(&f.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        (func.block_shape, func.shared_bytes)
    };
    launch(Launch {
        f,
        grid: [w as u32, h as u32, 1],
        block,
        shared,
        stream,
        cooperative: false,
    })
}

exports! {
    fn cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra, false)
    }
    fn cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra, false)
    }
    fn cuLaunchKernelEx(config: In<CUlaunchConfig>, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch_ex(config, f, params, extra)
    }
    fn cuLaunchKernelEx_ptsz(config: In<CUlaunchConfig>, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch_ex(config, f, params, extra)
    }
    fn cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void) {
        launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, std::ptr::null_mut(), true)
    }
    fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void) {
        launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, std::ptr::null_mut(), true)
    }
    fn cuLaunchCooperativeKernelMultiDevice(list: In<CudaLaunchParams>, n: c_uint, flags: c_uint) {
        if n == 0 || flags > 3 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for p in list.slice(n as usize)? {
            launch(Launch { f: p.function, grid: p.grid, block: p.block, shared: p.shared_mem_bytes, stream: p.stream, cooperative: true })?;
        }
        Ok(())
    }
    fn cuLaunch(f: CUfunction) {
        legacy(f, 1, 1, Handle::NULL)
    }
    fn cuLaunchGrid(f: CUfunction, w: i32, h: i32) {
        legacy(f, w, h, Handle::NULL)
    }
    fn cuLaunchGridAsync(f: CUfunction, w: i32, h: i32, stream: CUstream) {
        legacy(f, w, h, stream)
    }
}
