//! Streams, events and stream capture. A context's work runs in launch order on its queue
//! (one kernel at a time per GPU), so a stream is a view onto that queue: synchronising a
//! stream waits for the last entry it launched, and an event completes when the entry it
//! was recorded after does, with that entry's device completion time as its timestamp.
//! `cuStreamWaitEvent` therefore has nothing to wait for within a context; host callbacks
//! (`cuLaunchHostFunc`, `cuStreamAddCallback`) run on the calling thread once the stream's
//! earlier work is done.

use std::ffi::{c_uint, c_void};
use std::sync::atomic::Ordering::Relaxed;

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;

/// The last entry launched on `stream` (the context's last for the default streams) and
/// where it lives: (dev, queue, seq, ctx).
fn stream_tail(
    d: &Driver,
    inner: &Inner,
    stream: CUstream,
) -> Result<(usize, usize, Option<u64>, u64), CUresult> {
    let ctx = d.stream_ctx(inner, stream)?;
    let c = &inner.ctxs[&ctx];
    let seq = match inner.streams.get(&stream.id()) {
        Some(s) => s.last_seq,
        None => c.last_seq,
    };
    Ok((c.dev, c.queue, seq, ctx))
}

pub fn synchronize(d: &Driver, stream: CUstream) -> R {
    let (dev, queue, seq, _) = stream_tail(d, &d.inner.lock(), stream)?;
    d.wait(dev, queue, seq)?;
    crate::pool::release_on_sync(d, dev);
    Ok(())
}

fn query(stream: CUstream) -> R {
    let d = driver()?;
    let (dev, queue, seq, _) = stream_tail(d, &d.inner.lock(), stream)?;
    match seq {
        Some(s) if !d.sim(d.st.is_done(dev, queue, s))? => Err(CUDA_ERROR_NOT_READY),
        _ => Ok(()),
    }
}

fn create(out: Out<CUstream>, flags: c_uint, priority: i32) -> R {
    let d = driver()?;
    if out.is_null() || flags > 1 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    let ctx = d.current(&inner)?;
    let id = inner.new_id();
    inner.streams.insert(
        id,
        Stream {
            ctx,
            flags,
            priority: priority.clamp(-5, 0),
            last_seq: None,
            capture: None,
            capture_mode: 0,
        },
    );
    out.write(Handle::from_id(id))
}

fn destroy(stream: CUstream) -> R {
    let d = driver()?;
    let mut inner = d.inner.lock();
    let s = inner
        .streams
        .remove(&stream.id())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if let Some(g) = s.capture {
        inner.graphs.capture_end(stream.id(), g);
    }
    Ok(())
}

fn stream_of(inner: &Inner, stream: CUstream) -> Result<&Stream, CUresult> {
    inner
        .streams
        .get(&stream.id())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

/// Recompute which completion times must be kept for recorded events.
fn rewatch(d: &Driver, inner: &Inner) {
    let mut w = d.watch.lock();
    let wanted: Vec<(usize, usize, u64)> = inner
        .events
        .values()
        .filter_map(|e| e.rec.and_then(|r| r.seq.map(|s| (r.dev, r.queue, s))))
        .collect();
    w.retain(|k, _| wanted.contains(k));
    for k in wanted {
        w.entry(k).or_insert(0);
    }
    d.watching.store(w.len(), Relaxed);
    d.watch_min.store(lowest_unharvested(&w), Relaxed);
}

fn record(event: CUevent, stream: CUstream) -> R {
    let d = driver()?;
    let mut inner = d.inner.lock();
    let (dev, queue, seq, ctx) = stream_tail(d, &inner, stream)?;
    let e = inner
        .events
        .get(&event.id())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if e.ctx != ctx {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if crate::graph::capturing(&inner, stream).is_some() {
        // An event recorded during capture marks a point in the graph, not in time.
        return Ok(());
    }
    let rec = EventRec {
        dev,
        queue,
        seq,
        at: gpusim_core::now_ns(),
    };
    if let Some(e) = inner.events.get_mut(&event.id()) {
        e.rec = Some(rec);
    }
    rewatch(d, &inner);
    Ok(())
}

/// When the event's work completed (device time, monotonic ns), or `None` if not yet.
fn event_time(d: &Driver, rec: &EventRec) -> Result<Option<u64>, CUresult> {
    let Some(seq) = rec.seq else {
        return Ok(Some(rec.at));
    };
    if let Some(t) = d.sim(d.st.done_at(rec.dev, rec.queue, seq))? {
        return Ok(Some(t.max(rec.at)));
    }
    if !d.sim(d.st.is_done(rec.dev, rec.queue, seq))? {
        return Ok(None);
    }
    // Done, and its ring record overwritten since: the harvested time.
    let t = d
        .watch
        .lock()
        .get(&(rec.dev, rec.queue, seq))
        .copied()
        .unwrap_or(rec.at);
    Ok(Some(t.max(rec.at)))
}

fn event_rec(d: &Driver, event: CUevent) -> Result<Option<EventRec>, CUresult> {
    let inner = d.inner.lock();
    Ok(inner
        .events
        .get(&event.id())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?
        .rec)
}

fn elapsed(ms: Out<f32>, start: CUevent, end: CUevent) -> R {
    let d = driver()?;
    if ms.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let flags = |e: CUevent| {
        d.inner
            .lock()
            .events
            .get(&e.id())
            .map(|e| e.flags)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    };
    if flags(start)? & 2 != 0 || flags(end)? & 2 != 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let (Some(a), Some(b)) = (event_rec(d, start)?, event_rec(d, end)?) else {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    };
    let (Some(ta), Some(tb)) = (event_time(d, &a)?, event_time(d, &b)?) else {
        return Err(CUDA_ERROR_NOT_READY);
    };
    ms.write((tb as f64 - ta as f64) as f32 / 1e6)
}

fn host_callback(stream: CUstream, run: impl FnOnce()) -> R {
    let d = driver()?;
    synchronize(d, stream)?;
    run();
    Ok(())
}

fn begin_capture(stream: CUstream, mode: u32) -> R {
    let d = driver()?;
    if mode > 2 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    if stream.id() <= STREAM_PER_THREAD {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    let s = stream_of(&inner, stream)?;
    if s.capture.is_some() {
        return Err(CUDA_ERROR_ILLEGAL_STATE);
    }
    let g = inner.new_id();
    inner.graphs.create(g);
    inner.graphs.capture.insert(stream.id(), g);
    if let Some(s) = inner.streams.get_mut(&stream.id()) {
        s.capture = Some(g);
        s.capture_mode = mode;
    }
    Ok(())
}

fn end_capture(stream: CUstream, graph: Out<CUgraph>) -> R {
    let d = driver()?;
    let mut inner = d.inner.lock();
    let s = stream_of(&inner, stream)?;
    let g = s.capture.ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    inner.graphs.capture_end(stream.id(), g);
    if let Some(s) = inner.streams.get_mut(&stream.id()) {
        s.capture = None;
    }
    graph.write(Handle::from_id(g))
}

fn is_capturing(stream: CUstream, status: Out<u32>) -> R {
    let d = driver()?;
    let inner = d.inner.lock();
    if stream.id() <= STREAM_PER_THREAD {
        d.current(&inner)?;
        return status.write(0);
    }
    let s = stream_of(&inner, stream)?;
    status.write(u32::from(s.capture.is_some()))
}

fn capture_info(
    stream: CUstream,
    status: Out<u32>,
    id: Out<u64>,
    graph: Out<CUgraph>,
    deps: Out<*const c_void>,
    edges: Out<*const c_void>,
    ndeps: Out<usize>,
) -> R {
    let d = driver()?;
    let inner = d.inner.lock();
    let cap = if stream.id() <= STREAM_PER_THREAD {
        None
    } else {
        stream_of(&inner, stream)?.capture
    };
    status.write(u32::from(cap.is_some()))?;
    id.write_opt(cap.unwrap_or(0));
    graph.write_opt(cap.map_or(Handle::NULL, Handle::from_id));
    deps.write_opt(std::ptr::null());
    edges.write_opt(std::ptr::null());
    ndeps.write_opt(0);
    Ok(())
}

fn wait_event(stream: CUstream, event: CUevent) -> R {
    let d = driver()?;
    let inner = d.inner.lock();
    d.stream_ctx(&inner, stream)?;
    inner
        .events
        .get(&event.id())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    Ok(())
}

/// A property of a stream (default streams have the defaults).
fn stream_prop<T>(
    stream: CUstream,
    out: Out<T>,
    get: impl FnOnce(&Inner, u64, Option<&Stream>) -> T,
) -> R {
    let d = driver()?;
    let inner = d.inner.lock();
    let ctx = d.stream_ctx(&inner, stream)?;
    out.write(get(&inner, ctx, inner.streams.get(&stream.id())))
}

type HostFn = Option<unsafe extern "C" fn(*mut c_void)>;
type StreamCallback = Option<unsafe extern "C" fn(CUstream, CUresult, *mut c_void)>;

fn launch_host_func(stream: CUstream, f: HostFn, data: *mut c_void) -> R {
    let f = f.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // SAFETY: the application's callback, called with its own user data as documented.
    host_callback(stream, || unsafe { f(data) })
}

exports! {
    fn cuStreamCreate(out: Out<CUstream>, flags: c_uint) {
        create(out, flags, 0)
    }
    fn cuStreamCreateWithPriority(out: Out<CUstream>, flags: c_uint, priority: i32) {
        create(out, flags, priority)
    }
    fn cuStreamDestroy(stream: CUstream) {
        destroy(stream)
    }
    fn cuStreamDestroy_v2(stream: CUstream) {
        destroy(stream)
    }
    fn cuStreamSynchronize(stream: CUstream) {
        synchronize(driver()?, stream)
    }
    fn cuStreamSynchronize_ptsz(stream: CUstream) {
        synchronize(driver()?, stream)
    }
    fn cuStreamQuery(stream: CUstream) {
        query(stream)
    }
    fn cuStreamQuery_ptsz(stream: CUstream) {
        query(stream)
    }
    fn cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: c_uint) {
        let _ = flags;
        wait_event(stream, event)
    }
    fn cuStreamWaitEvent_ptsz(stream: CUstream, event: CUevent, flags: c_uint) {
        let _ = flags;
        wait_event(stream, event)
    }
    fn cuStreamGetPriority(stream: CUstream, priority: Out<i32>) {
        stream_prop(stream, priority, |_, _, s| s.map_or(0, |s| s.priority))
    }
    fn cuStreamGetPriority_ptsz(stream: CUstream, priority: Out<i32>) {
        stream_prop(stream, priority, |_, _, s| s.map_or(0, |s| s.priority))
    }
    fn cuStreamGetFlags(stream: CUstream, flags: Out<c_uint>) {
        stream_prop(stream, flags, |_, _, s| s.map_or(0, |s| s.flags))
    }
    fn cuStreamGetFlags_ptsz(stream: CUstream, flags: Out<c_uint>) {
        stream_prop(stream, flags, |_, _, s| s.map_or(0, |s| s.flags))
    }
    fn cuStreamGetCtx(stream: CUstream, ctx: Out<CUcontext>) {
        stream_prop(stream, ctx, |_, c, _| Handle::from_id(c))
    }
    fn cuStreamGetCtx_ptsz(stream: CUstream, ctx: Out<CUcontext>) {
        stream_prop(stream, ctx, |_, c, _| Handle::from_id(c))
    }
    fn cuStreamGetId(stream: CUstream, id: Out<u64>) {
        stream_prop(stream, id, |_, _, _| stream.id())
    }
    fn cuStreamGetId_ptsz(stream: CUstream, id: Out<u64>) {
        stream_prop(stream, id, |_, _, _| stream.id())
    }
    fn cuStreamGetDevice(stream: CUstream, dev: Out<CUdevice>) {
        let d = driver()?;
        let real = {
            let inner = d.inner.lock();
            let ctx = d.stream_ctx(&inner, stream)?;
            inner.ctxs[&ctx].dev
        };
        dev.write(d.ordinal(real)?)
    }
    fn cuStreamAttachMemAsync(stream: CUstream, p: CUdeviceptr, len: usize, flags: c_uint) {
        let _ = (p, len, flags);
        let d = driver()?;
        d.stream_ctx(&d.inner.lock(), stream)?;
        Ok(())
    }
    fn cuLaunchHostFunc(stream: CUstream, f: HostFn, data: *mut c_void) {
        launch_host_func(stream, f, data)
    }
    fn cuLaunchHostFunc_ptsz(stream: CUstream, f: HostFn, data: *mut c_void) {
        launch_host_func(stream, f, data)
    }
    fn cuStreamAddCallback(stream: CUstream, cb: StreamCallback, data: *mut c_void, flags: c_uint) {
        let cb = cb.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the application's callback with its stream, a status and its user data.
        host_callback(stream, || unsafe { cb(stream, CUDA_SUCCESS, data) })
    }
    fn cuStreamAddCallback_ptsz(stream: CUstream, cb: StreamCallback, data: *mut c_void, flags: c_uint) {
        let cb = cb.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: as above.
        host_callback(stream, || unsafe { cb(stream, CUDA_SUCCESS, data) })
    }
    fn cuStreamBeginCapture(stream: CUstream) {
        begin_capture(stream, 0)
    }
    fn cuStreamBeginCapture_ptsz(stream: CUstream) {
        begin_capture(stream, 0)
    }
    fn cuStreamBeginCapture_v2(stream: CUstream, mode: u32) {
        begin_capture(stream, mode)
    }
    fn cuStreamBeginCapture_v2_ptsz(stream: CUstream, mode: u32) {
        begin_capture(stream, mode)
    }
    fn cuStreamEndCapture(stream: CUstream, graph: Out<CUgraph>) {
        end_capture(stream, graph)
    }
    fn cuStreamEndCapture_ptsz(stream: CUstream, graph: Out<CUgraph>) {
        end_capture(stream, graph)
    }
    fn cuStreamIsCapturing(stream: CUstream, status: Out<u32>) {
        is_capturing(stream, status)
    }
    fn cuStreamIsCapturing_ptsz(stream: CUstream, status: Out<u32>) {
        is_capturing(stream, status)
    }
    fn cuStreamGetCaptureInfo(stream: CUstream, status: Out<u32>, id: Out<u64>) {
        capture_info(stream, status, id, Out::null(), Out::null(), Out::null(), Out::null())
    }
    fn cuStreamGetCaptureInfo_ptsz(stream: CUstream, status: Out<u32>, id: Out<u64>) {
        capture_info(stream, status, id, Out::null(), Out::null(), Out::null(), Out::null())
    }
    fn cuStreamGetCaptureInfo_v2(stream: CUstream, status: Out<u32>, id: Out<u64>, graph: Out<CUgraph>, deps: Out<*const c_void>, ndeps: Out<usize>) {
        capture_info(stream, status, id, graph, deps, Out::null(), ndeps)
    }
    fn cuStreamGetCaptureInfo_v2_ptsz(stream: CUstream, status: Out<u32>, id: Out<u64>, graph: Out<CUgraph>, deps: Out<*const c_void>, ndeps: Out<usize>) {
        capture_info(stream, status, id, graph, deps, Out::null(), ndeps)
    }
    fn cuStreamGetCaptureInfo_v3(stream: CUstream, status: Out<u32>, id: Out<u64>, graph: Out<CUgraph>, deps: Out<*const c_void>, edges: Out<*const c_void>, ndeps: Out<usize>) {
        capture_info(stream, status, id, graph, deps, edges, ndeps)
    }
    fn cuStreamGetCaptureInfo_v3_ptsz(stream: CUstream, status: Out<u32>, id: Out<u64>, graph: Out<CUgraph>, deps: Out<*const c_void>, edges: Out<*const c_void>, ndeps: Out<usize>) {
        capture_info(stream, status, id, graph, deps, edges, ndeps)
    }
    fn cuThreadExchangeStreamCaptureMode(mode: Out<u32>) {
        driver()?;
        let m = mode.get_mut()?;
        if *m > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
    fn cuEventCreate(out: Out<CUevent>, flags: c_uint) {
        let d = driver()?;
        if out.is_null() || flags & !0x7 != 0 || (flags & 4 != 0 && flags & 2 == 0) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        let ctx = d.current(&inner)?;
        let id = inner.new_id();
        inner.events.insert(id, Event { ctx, flags, rec: None });
        out.write(Handle::from_id(id))
    }
    fn cuEventDestroy(event: CUevent) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        inner.events.remove(&event.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        rewatch(d, &inner);
        Ok(())
    }
    fn cuEventDestroy_v2(event: CUevent) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        inner.events.remove(&event.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        rewatch(d, &inner);
        Ok(())
    }
    fn cuEventRecord(event: CUevent, stream: CUstream) {
        record(event, stream)
    }
    fn cuEventRecord_ptsz(event: CUevent, stream: CUstream) {
        record(event, stream)
    }
    fn cuEventRecordWithFlags(event: CUevent, stream: CUstream, flags: c_uint) {
        if flags > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        record(event, stream)
    }
    fn cuEventRecordWithFlags_ptsz(event: CUevent, stream: CUstream, flags: c_uint) {
        if flags > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        record(event, stream)
    }
    fn cuEventQuery(event: CUevent) {
        let d = driver()?;
        match event_rec(d, event)? {
            Some(r) if event_time(d, &r)?.is_none() => Err(CUDA_ERROR_NOT_READY),
            _ => Ok(()),
        }
    }
    fn cuEventSynchronize(event: CUevent) {
        let d = driver()?;
        if let Some(r) = event_rec(d, event)? {
            d.wait(r.dev, r.queue, r.seq)?;
            crate::pool::release_on_sync(d, r.dev);
        }
        Ok(())
    }
    fn cuEventElapsedTime(ms: Out<f32>, start: CUevent, end: CUevent) {
        elapsed(ms, start, end)
    }
    fn cuEventElapsedTime_v2(ms: Out<f32>, start: CUevent, end: CUevent) {
        elapsed(ms, start, end)
    }
}
