//! Modules, libraries and functions. Any image loads: PTX text (its `.entry` kernels and
//! `.global` variables are read), an ELF cubin (its FUNC and OBJECT symbols), a fatbin (its
//! entries walked: PTX and ELF entries read, a compressed one makes every name resolve), a
//! fatbin wrapper `__fatBinC_Wrapper_t` as cudart passes it (followed to its fatbin), or
//! anything else (then every function name resolves). A fatbin whose structure does not add
//! up fails with `CUDA_ERROR_INVALID_IMAGE`. Loading a module
//! costs `module_overhead_kib` of device memory in its context. See `gpusim_core::cost` for
//! how long a function runs.

use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void, CString};

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;

/// What an image declares.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Image {
    /// Kernel names; `None` when gpusim cannot read the image.
    pub functions: Option<Vec<String>>,
    /// Global variables and their sizes.
    pub globals: Vec<(String, u64)>,
}

pub struct Library {
    pub image: Image,
    /// Kernel handles by name.
    pub kernels: HashMap<String, u64>,
    /// This library's module in each context it was used in.
    pub modules: HashMap<u64, u64>,
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'))
        .unwrap_or(s.len());
    &s[..end]
}

/// Read kernels and globals from PTX text.
pub fn parse_ptx(text: &str) -> Image {
    let mut functions = Vec::new();
    let mut globals = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(i) = line.find(".entry") {
            let name = ident(line[i + 6..].trim_start());
            if !name.is_empty() {
                functions.push(name.to_string());
            }
        } else if line.contains(".global") && line.ends_with(';') && !line.contains('(') {
            let toks: Vec<&str> = line.trim_end_matches(';').split_whitespace().collect();
            let elem = toks.iter().find_map(|t| match *t {
                ".b8" | ".u8" | ".s8" => Some(1u64),
                ".b16" | ".u16" | ".s16" | ".f16" => Some(2),
                ".b32" | ".u32" | ".s32" | ".f32" => Some(4),
                ".b64" | ".u64" | ".s64" | ".f64" => Some(8),
                _ => None,
            });
            let Some(elem) = elem else { continue };
            let Some(last) = toks.last() else { continue };
            let decl = last.split('=').next().unwrap_or(last);
            let name = ident(decl);
            let count = decl
                .find('[')
                .and_then(|i| decl[i + 1..].split(']').next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(1);
            if !name.is_empty() {
                globals.push((name.to_string(), elem * count));
            }
        }
    }
    Image {
        functions: Some(functions),
        globals,
    }
}

fn rd<const N: usize>(b: &[u8], at: usize) -> Option<[u8; N]> {
    b.get(at..at.checked_add(N)?)?.try_into().ok()
}

/// Read FUNC and OBJECT symbols of a 64-bit little-endian ELF.
pub fn parse_elf(b: &[u8]) -> Option<Image> {
    if b.get(..4)? != b"\x7fELF" || *b.get(4)? != 2 {
        return None;
    }
    let shoff = u64::from_le_bytes(rd(b, 0x28)?) as usize;
    let shentsize = u16::from_le_bytes(rd(b, 0x3A)?) as usize;
    let shnum = u16::from_le_bytes(rd(b, 0x3C)?) as usize;
    let section = |i: usize| -> Option<(u32, usize, usize, u32)> {
        let at = shoff.checked_add(i.checked_mul(shentsize)?)?;
        Some((
            u32::from_le_bytes(rd(b, at.checked_add(4)?)?),
            u64::from_le_bytes(rd(b, at.checked_add(0x18)?)?) as usize,
            u64::from_le_bytes(rd(b, at.checked_add(0x20)?)?) as usize,
            u32::from_le_bytes(rd(b, at.checked_add(0x28)?)?),
        ))
    };
    let mut img = Image {
        functions: Some(Vec::new()),
        globals: Vec::new(),
    };
    for i in 0..shnum {
        let (kind, off, size, link) = section(i)?;
        if kind != 2 {
            continue; // SHT_SYMTAB
        }
        let (_, stroff, strsize, _) = section(link as usize)?;
        let strtab = b.get(stroff..stroff.checked_add(strsize)?)?;
        for k in 0..size / 24 {
            let s = off.checked_add(k * 24)?;
            let name_at = u32::from_le_bytes(rd(b, s)?) as usize;
            let info = *b.get(s.checked_add(4)?)?;
            let sym_size = u64::from_le_bytes(rd(b, s.checked_add(16)?)?);
            let name = strtab.get(name_at..)?.split(|&c| c == 0).next()?;
            let name = String::from_utf8_lossy(name).into_owned();
            match info & 0xf {
                2 if !name.is_empty() => img.functions.get_or_insert_with(Vec::new).push(name),
                1 if !name.is_empty() => img.globals.push((name, sym_size)),
                _ => {}
            }
        }
    }
    Some(img)
}

/// `__fatBinC_Wrapper_t`'s magic: what nvcc's host code registers and cudart hands to
/// `cuLibraryLoadData` (layout: i32 magic, i32 version 1 or 2, the fatbin, a filename or
/// prelinked fatbins).
pub const FATBIN_WRAPPER_MAGIC: u32 = 0x4662_43B1;
/// A fatbin container's magic.
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const ELF_MAGIC: u32 = u32::from_le_bytes(*b"\x7fELF");
/// A fatbin entry's header as far as gpusim reads it: u16 kind, u16 version, u32 header
/// size, u64 payload size (padded to 8), u32 compressed size, u32, u32 minor, u32 sm,
/// u32 ×2, u64 flags (at 40), u64, u64 uncompressed size.
const ENTRY_HEADER_MIN: usize = 64;
const ENTRY_PTX: u16 = 1;
const ENTRY_ELF: u16 = 2;
const FLAG_COMPRESSED_LZ4: u64 = 0x2000;
const FLAG_COMPRESSED_ZSTD: u64 = 0x8000;
/// The largest image gpusim copies (a sanity bound on lengths read from headers).
const MAX_IMAGE: usize = 1 << 30;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(rd(b, at)?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(rd(b, at)?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(rd(b, at)?))
}

/// The first four bytes at `p` as a little-endian magic number, or `None` when a NUL comes
/// first (then the image is text, and reading on could pass its end).
fn magic_at(p: *const u8) -> Option<u32> {
    let mut m = [0u8; 4];
    for (i, byte) in m.iter_mut().enumerate() {
        // SAFETY: `p` points to an image; bytes 0..i were not NUL, so byte i is still part
        // of it (a NUL-terminated text has its terminator ahead, a binary image is longer
        // than its 4-byte magic).
        *byte = unsafe { p.add(i).read() };
        if *byte == 0 {
            return None;
        }
    }
    Some(u32::from_le_bytes(m))
}

/// The header-declared length of the fatbin container at `p` (magic already checked).
fn fatbin_len(p: *const u8) -> Result<usize, CUresult> {
    // SAFETY: the fatbin magic at `p` promises its 16-byte container header.
    let h = unsafe { std::slice::from_raw_parts(p, 16) };
    let header = u16_at(h, 6).unwrap_or(0) as usize;
    let size = u64_at(h, 8).unwrap_or(u64::MAX);
    if u16_at(h, 4) != Some(1) || header < 16 {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    usize::try_from(size)
        .ok()
        .and_then(|s| s.checked_add(header))
        .filter(|&n| n <= MAX_IMAGE)
        .ok_or(CUDA_ERROR_INVALID_IMAGE)
}

/// Copy the image the caller passed without a length: an ELF, a fatbin, a fatbin wrapper
/// (followed to its fatbin), or NUL-terminated text (PTX), as the driver reads them.
fn image_from_ptr(p: *const c_void) -> Result<Vec<u8>, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut p = p.cast::<u8>();
    let len = match magic_at(p) {
        Some(FATBIN_WRAPPER_MAGIC) => {
            // SAFETY: the wrapper magic promises a `__fatBinC_Wrapper_t` (24 bytes, maybe
            // unaligned in a hand-built image, hence read_unaligned).
            let w = unsafe { p.cast::<crate::export::FatbinWrapper>().read_unaligned() };
            if !(1..=2).contains(&w.version) || w.data.is_null() {
                return Err(CUDA_ERROR_INVALID_IMAGE);
            }
            p = w.data.cast();
            if magic_at(p) != Some(FATBIN_MAGIC) {
                return Err(CUDA_ERROR_INVALID_IMAGE);
            }
            fatbin_len(p)?
        }
        Some(FATBIN_MAGIC) => fatbin_len(p)?,
        Some(ELF_MAGIC) => {
            // SAFETY: an ELF image starts with its 64-byte file header.
            let h = unsafe { std::slice::from_raw_parts(p, 64) };
            let shoff = u64_at(h, 0x28).unwrap_or(0) as usize;
            let shentsize = u16_at(h, 0x3A).unwrap_or(0) as usize;
            let shnum = u16_at(h, 0x3C).unwrap_or(0) as usize;
            shoff.saturating_add(shentsize * shnum).clamp(64, MAX_IMAGE)
        }
        // SAFETY: anything else is NUL-terminated text (PTX), as the driver reads it.
        _ => unsafe { std::ffi::CStr::from_ptr(p.cast()) }
            .to_bytes()
            .len(),
    };
    // SAFETY: `len` is the length the image's own header (or terminator) declares.
    Ok(unsafe { std::slice::from_raw_parts(p, len) }.to_vec())
}

/// Collects the kernels and globals of a fatbin's entries, each name once.
#[derive(Default)]
struct Names {
    functions: Vec<String>,
    globals: Vec<(String, u64)>,
    seen: std::collections::HashSet<(bool, String)>,
}

impl Names {
    fn add(&mut self, img: Image) {
        for f in img.functions.unwrap_or_default() {
            if self.seen.insert((true, f.clone())) {
                self.functions.push(f);
            }
        }
        for (g, size) in img.globals {
            if self.seen.insert((false, g.clone())) {
                self.globals.push((g, size));
            }
        }
    }
}

/// Walk a fatbin container's entries: PTX entries give their `.entry` kernels and
/// `.global` variables, ELF entries their symbols. A compressed entry or one of a kind
/// gpusim does not read makes every name resolve (its names are unknown); a structure that
/// does not add up is `CUDA_ERROR_INVALID_IMAGE`.
pub fn parse_fatbin(b: &[u8]) -> Result<Image, CUresult> {
    const BAD: CUresult = CUDA_ERROR_INVALID_IMAGE;
    if u32_at(b, 0) != Some(FATBIN_MAGIC) || u16_at(b, 4) != Some(1) {
        return Err(BAD);
    }
    let header = u16_at(b, 6).ok_or(BAD)? as usize;
    let size = usize::try_from(u64_at(b, 8).ok_or(BAD)?).map_err(|_| BAD)?;
    let end = header.checked_add(size).ok_or(BAD)?;
    if header < 16 || end > b.len() {
        return Err(BAD);
    }
    let mut names = Names::default();
    let mut unreadable = false;
    let mut at = header;
    while at < end {
        let e = &b[at..end];
        let kind = u16_at(e, 0).ok_or(BAD)?;
        let head = u32_at(e, 4).ok_or(BAD)? as usize;
        let payload = u64_at(e, 8).ok_or(BAD)?;
        let flags = u64_at(e, 40).ok_or(BAD)?;
        if head < ENTRY_HEADER_MIN || head > e.len() {
            return Err(BAD);
        }
        let payload = usize::try_from(payload)
            .ok()
            .filter(|&n| n <= e.len() - head)
            .ok_or(BAD)?;
        let data = &e[head..head + payload];
        if flags & (FLAG_COMPRESSED_LZ4 | FLAG_COMPRESSED_ZSTD) != 0 {
            unreadable = true;
        } else if kind == ENTRY_PTX {
            let text = data.split(|&c| c == 0).next().unwrap_or_default();
            names.add(parse_ptx(&String::from_utf8_lossy(text)));
        } else if kind == ENTRY_ELF {
            names.add(parse_elf(data).ok_or(BAD)?);
        } else {
            unreadable = true;
        }
        at += head + payload;
    }
    Ok(Image {
        functions: (!unreadable).then_some(names.functions),
        globals: names.globals,
    })
}

/// Understand an image in memory.
pub fn parse_image(bytes: &[u8]) -> Result<Image, CUresult> {
    if let Some(img) = parse_elf(bytes) {
        return Ok(img);
    }
    match u32_at(bytes, 0) {
        Some(FATBIN_MAGIC) => return parse_fatbin(bytes),
        // A wrapper only points to its fatbin: it cannot stand in a file or a copy.
        Some(FATBIN_WRAPPER_MAGIC) => return Err(CUDA_ERROR_INVALID_IMAGE),
        _ => {}
    }
    Ok(match std::str::from_utf8(bytes) {
        Ok(text)
            if text.contains(".version") || text.contains(".entry") || text.contains(".target") =>
        {
            parse_ptx(text)
        }
        _ => Image::default(),
    })
}

/// Load `image` as a module of context `ctx`: charge its overhead, allocate its globals.
pub fn load(
    d: &Driver,
    inner: &mut Inner,
    ctx: u64,
    image: Image,
    library: u64,
) -> Result<u64, CUresult> {
    let charge = d.st.config.module_overhead();
    let dev = inner.ctxs.get(&ctx).ok_or(CUDA_ERROR_INVALID_CONTEXT)?.dev;
    d.charge(dev, charge)?;
    let mut globals = HashMap::new();
    for (name, size) in &image.globals {
        match crate::memory::alloc(d, inner, ctx, (*size).max(1), 0, AllocKind::Linear) {
            Ok(a) => {
                globals.insert(name.clone(), (a, *size));
            }
            Err(e) => {
                for (a, _) in globals.values() {
                    crate::memory::release(d, inner, *a);
                }
                d.uncharge(dev, charge);
                return Err(e);
            }
        }
    }
    if let Some(c) = inner.ctxs.get_mut(&ctx) {
        c.charged += charge;
    }
    let id = inner.new_id();
    inner.modules.insert(
        id,
        Module {
            ctx,
            functions: image.functions,
            globals,
            charged: charge,
            handles: HashMap::new(),
            library,
        },
    );
    Ok(id)
}

fn unload(d: &Driver, inner: &mut Inner, id: u64) -> R {
    let m = inner.modules.remove(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    for (a, _) in m.globals.values() {
        crate::memory::release(d, inner, *a);
    }
    inner.funcs.retain(|_, f| f.module != id);
    if let Some(c) = inner.ctxs.get_mut(&m.ctx) {
        c.charged -= m.charged;
        d.uncharge(c.dev, m.charged);
    }
    Ok(())
}

fn new_func(inner: &mut Inner, module: u64, library: u64, name: &str) -> u64 {
    let id = inner.new_id();
    inner.funcs.insert(
        id,
        Func {
            module,
            library,
            name: CString::new(name).unwrap_or_default(),
            fixed_ns: gpusim_core::cost::duration_from_name(name),
            block_shape: [1, 1, 1],
            shared_bytes: 0,
            param_size: 0,
            max_dynamic_shared: 48 * 1024,
        },
    );
    id
}

fn get_function(inner: &mut Inner, module: u64, name: &str) -> Result<u64, CUresult> {
    let m = inner
        .modules
        .get(&module)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if let Some(&f) = m.handles.get(name) {
        return Ok(f);
    }
    if m.functions
        .as_ref()
        .is_some_and(|fs| !fs.iter().any(|f| f == name))
    {
        return Err(CUDA_ERROR_NOT_FOUND);
    }
    let f = new_func(inner, module, 0, name);
    if let Some(m) = inner.modules.get_mut(&module) {
        m.handles.insert(name.to_string(), f);
    }
    Ok(f)
}

/// The module library `lib` has in context `ctx`, loading it there on first use.
pub fn library_module(d: &Driver, inner: &mut Inner, lib: u64, ctx: u64) -> Result<u64, CUresult> {
    let l = inner.libraries.get(&lib).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if let Some(&m) = l.modules.get(&ctx) {
        if inner.modules.contains_key(&m) {
            return Ok(m);
        }
    }
    let image = Image {
        functions: l.image.functions.clone(),
        globals: l.image.globals.clone(),
    };
    let m = load(d, inner, ctx, image, lib)?;
    if let Some(l) = inner.libraries.get_mut(&lib) {
        l.modules.insert(ctx, m);
    }
    Ok(m)
}

/// The context function a launch of `f` runs in `ctx`: `f` itself, or for a library
/// kernel its function in that context's module.
pub fn resolve_for_launch(
    d: &Driver,
    inner: &mut Inner,
    f: u64,
    ctx: u64,
) -> Result<u64, CUresult> {
    let func = inner.funcs.get(&f).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if func.library == 0 {
        let m = inner
            .modules
            .get(&func.module)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if m.ctx != ctx {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        return Ok(f);
    }
    let (lib, name) = (func.library, func.name.to_string_lossy().into_owned());
    let m = library_module(d, inner, lib, ctx)?;
    get_function(inner, m, &name)
}

fn read_file(path: &str) -> Result<Vec<u8>, CUresult> {
    std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)
}

fn module_load(out: Out<CUmodule>, bytes: Vec<u8>) -> R {
    let d = driver()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    let ctx = d.current(&inner)?;
    let image = parse_image(&bytes)?;
    let id = load(d, &mut inner, ctx, image, 0)?;
    out.write(Handle::from_id(id))
}

/// Load the image at `p` (as `cuModuleLoadData`) into the current context: the CUDA
/// runtime's cubin→module entry points ([`crate::export`]).
pub fn load_image_ptr(out: Out<CUmodule>, p: *const c_void) -> R {
    module_load(out, image_from_ptr(p)?)
}

fn library_load(out: Out<CUlibrary>, bytes: Vec<u8>) -> R {
    let d = driver()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let image = parse_image(&bytes)?;
    let mut inner = d.inner.lock();
    let id = inner.new_id();
    inner.libraries.insert(
        id,
        Library {
            image,
            kernels: HashMap::new(),
            modules: HashMap::new(),
        },
    );
    // Loaded eagerly into the current context, if there is one.
    if let Ok(ctx) = d.current(&inner) {
        if let Err(e) = library_module(d, &mut inner, id, ctx) {
            inner.libraries.remove(&id);
            return Err(e);
        }
    }
    out.write(Handle::from_id(id))
}

fn func_dev(d: &Driver, inner: &Inner, f: u64) -> Result<usize, CUresult> {
    let func = inner.funcs.get(&f).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    match inner
        .modules
        .get(&func.module)
        .and_then(|m| inner.ctxs.get(&m.ctx))
    {
        Some(c) => Ok(c.dev),
        None => {
            let ctx = d.current(inner)?;
            Ok(inner.ctxs[&ctx].dev)
        }
    }
}

fn occupancy(d: &Driver, f: CUfunction, block: i32) -> Result<(i32, usize), CUresult> {
    let inner = d.inner.lock();
    let dev = func_dev(d, &inner, f.id())?;
    if block <= 0 || block > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let g = &d.st.config.gpu[dev];
    Ok((
        (g.max_threads_per_sm as i32 / block).clamp(0, 32),
        g.sm_count as usize,
    ))
}

fn potential_block(
    d: &Driver,
    min_grid: Out<i32>,
    block: Out<i32>,
    f: CUfunction,
    limit: i32,
) -> R {
    let inner = d.inner.lock();
    let dev = func_dev(d, &inner, f.id())?;
    let g = &d.st.config.gpu[dev];
    let b = if limit > 0 { limit.min(1024) } else { 1024 };
    let per_sm = (g.max_threads_per_sm as i32 / b).max(1);
    min_grid.write(per_sm * g.sm_count as i32)?;
    block.write(b)
}

fn func_mut(inner: &mut Inner, f: CUfunction) -> Result<&mut Func, CUresult> {
    inner
        .funcs
        .get_mut(&f.id())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

exports! {
    fn cuModuleLoad(module: Out<CUmodule>, fname: CStrIn) {
        let bytes = read_file(fname.get()?)?;
        module_load(module, bytes)
    }
    fn cuModuleLoadData(module: Out<CUmodule>, image: *const c_void) {
        module_load(module, image_from_ptr(image)?)
    }
    fn cuModuleLoadDataEx(module: Out<CUmodule>, image: *const c_void, num_options: c_uint, options: *mut u32, values: *mut *mut c_void) {
        let _ = (num_options, options, values);
        module_load(module, image_from_ptr(image)?)
    }
    fn cuModuleLoadFatBinary(module: Out<CUmodule>, fat: *const c_void) {
        module_load(module, image_from_ptr(fat)?)
    }
    fn cuModuleUnload(module: CUmodule) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        unload(d, &mut inner, module.id())
    }
    fn cuModuleGetFunction(func: Out<CUfunction>, module: CUmodule, name: CStrIn) {
        let d = driver()?;
        let name = name.get()?;
        if func.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        let f = get_function(&mut inner, module.id(), name)?;
        func.write(Handle::from_id(f))
    }
    fn cuModuleGetGlobal_v2(dptr: Out<CUdeviceptr>, bytes: Out<usize>, module: CUmodule, name: CStrIn) {
        let d = driver()?;
        let name = name.get()?;
        let inner = d.inner.lock();
        let m = inner.modules.get(&module.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let &(a, s) = m.globals.get(name).ok_or(CUDA_ERROR_NOT_FOUND)?;
        dptr.write_opt(a);
        bytes.write_opt(s as usize);
        Ok(())
    }
    fn cuModuleGetLoadingMode(mode: Out<u32>) {
        driver()?;
        let eager = std::env::var("CUDA_MODULE_LOADING").is_ok_and(|v| v.eq_ignore_ascii_case("EAGER"));
        mode.write(if eager { 1 } else { 2 })
    }
    fn cuModuleGetFunctionCount(count: Out<c_uint>, module: CUmodule) {
        let d = driver()?;
        let inner = d.inner.lock();
        let m = inner.modules.get(&module.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        count.write(m.functions.as_ref().map_or(0, |f| f.len()) as c_uint)
    }
    fn cuLibraryLoadData(lib: Out<CUlibrary>, code: *const c_void, jit_options: *mut u32, jit_values: *mut *mut c_void, num_jit: c_uint, lib_options: *mut u32, lib_values: *mut *mut c_void, num_lib: c_uint) {
        let _ = (jit_options, jit_values, num_jit, lib_options, lib_values, num_lib);
        library_load(lib, image_from_ptr(code)?)
    }
    fn cuLibraryLoadFromFile(lib: Out<CUlibrary>, fname: CStrIn, jit_options: *mut u32, jit_values: *mut *mut c_void, num_jit: c_uint, lib_options: *mut u32, lib_values: *mut *mut c_void, num_lib: c_uint) {
        let _ = (jit_options, jit_values, num_jit, lib_options, lib_values, num_lib);
        let bytes = read_file(fname.get()?)?;
        library_load(lib, bytes)
    }
    fn cuLibraryUnload(lib: CUlibrary) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let l = inner.libraries.remove(&lib.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        for m in l.modules.values() {
            let _ = unload(d, &mut inner, *m);
        }
        inner.funcs.retain(|_, f| f.library != lib.id());
        Ok(())
    }
    fn cuLibraryGetKernel(kernel: Out<CUkernel>, lib: CUlibrary, name: CStrIn) {
        let d = driver()?;
        let name = name.get()?;
        let mut inner = d.inner.lock();
        let l = inner.libraries.get(&lib.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(&k) = l.kernels.get(name) {
            return kernel.write(Handle::from_id(k));
        }
        if l.image.functions.as_ref().is_some_and(|fs| !fs.iter().any(|f| f == name)) {
            return Err(CUDA_ERROR_NOT_FOUND);
        }
        let k = new_func(&mut inner, 0, lib.id(), name);
        if let Some(l) = inner.libraries.get_mut(&lib.id()) {
            l.kernels.insert(name.to_string(), k);
        }
        kernel.write(Handle::from_id(k))
    }
    fn cuLibraryGetModule(module: Out<CUmodule>, lib: CUlibrary) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let ctx = d.current(&inner)?;
        let m = library_module(d, &mut inner, lib.id(), ctx)?;
        module.write(Handle::from_id(m))
    }
    fn cuLibraryGetGlobal(dptr: Out<CUdeviceptr>, bytes: Out<usize>, lib: CUlibrary, name: CStrIn) {
        let d = driver()?;
        let name = name.get()?;
        let mut inner = d.inner.lock();
        let ctx = d.current(&inner)?;
        let m = library_module(d, &mut inner, lib.id(), ctx)?;
        let &(a, s) = inner.modules[&m].globals.get(name).ok_or(CUDA_ERROR_NOT_FOUND)?;
        dptr.write_opt(a);
        bytes.write_opt(s as usize);
        Ok(())
    }
    fn cuLibraryGetKernelCount(count: Out<c_uint>, lib: CUlibrary) {
        let d = driver()?;
        let inner = d.inner.lock();
        let l = inner.libraries.get(&lib.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        count.write(l.image.functions.as_ref().map_or(0, |f| f.len()) as c_uint)
    }
    fn cuKernelGetFunction(func: Out<CUfunction>, kernel: CUkernel) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let ctx = d.current(&inner)?;
        if inner.funcs.get(&kernel.id()).is_none_or(|f| f.library == 0) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let f = resolve_for_launch(d, &mut inner, kernel.id(), ctx)?;
        func.write(Handle::from_id(f))
    }
    fn cuKernelGetName(name: Out<*const c_char>, kernel: CUkernel) {
        let d = driver()?;
        let inner = d.inner.lock();
        let f = inner.funcs.get(&kernel.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        // The CString lives as long as the kernel handle, as the driver's string does.
        name.write(f.name.as_ptr())
    }
    fn cuKernelGetAttribute(value: Out<i32>, attr: u32, kernel: CUkernel, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let inner = d.inner.lock();
        let f = inner.funcs.get(&kernel.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        value.write(func_attribute(d, dev, f, attr)?)
    }
    fn cuKernelSetAttribute(attr: u32, value: i32, kernel: CUkernel, dev: CUdevice) {
        let d = driver()?;
        d.device(dev)?;
        let mut inner = d.inner.lock();
        set_func_attribute(func_mut(&mut inner, kernel)?, attr, value)
    }
    fn cuFuncGetAttribute(value: Out<i32>, attr: u32, f: CUfunction) {
        let d = driver()?;
        let inner = d.inner.lock();
        let dev = func_dev(d, &inner, f.id())?;
        let func = &inner.funcs[&f.id()];
        value.write(func_attribute(d, dev, func, attr)?)
    }
    fn cuFuncSetAttribute(f: CUfunction, attr: u32, value: i32) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        set_func_attribute(func_mut(&mut inner, f)?, attr, value)
    }
    fn cuFuncSetCacheConfig(f: CUfunction, config: u32) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        func_mut(&mut inner, f)?;
        if config > 3 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
    fn cuFuncSetSharedMemConfig(f: CUfunction, config: u32) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        func_mut(&mut inner, f)?;
        if config > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
    fn cuFuncGetName(name: Out<*const c_char>, f: CUfunction) {
        let d = driver()?;
        let inner = d.inner.lock();
        let func = inner.funcs.get(&f.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        name.write(func.name.as_ptr())
    }
    fn cuFuncGetModule(module: Out<CUmodule>, f: CUfunction) {
        let d = driver()?;
        let inner = d.inner.lock();
        let func = inner.funcs.get(&f.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        module.write(Handle::from_id(func.module))
    }
    fn cuFuncIsLoaded(state: Out<u32>, f: CUfunction) {
        let d = driver()?;
        let inner = d.inner.lock();
        inner.funcs.get(&f.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        state.write(1)
    }
    fn cuFuncLoad(f: CUfunction) {
        let d = driver()?;
        let inner = d.inner.lock();
        inner.funcs.get(&f.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok(())
    }
    fn cuFuncSetBlockShape(f: CUfunction, x: i32, y: i32, z: i32) {
        let d = driver()?;
        if x <= 0 || y <= 0 || z <= 0 || x * y * z > 1024 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        func_mut(&mut inner, f)?.block_shape = [x as u32, y as u32, z as u32];
        Ok(())
    }
    fn cuFuncSetSharedSize(f: CUfunction, bytes: c_uint) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        func_mut(&mut inner, f)?.shared_bytes = bytes;
        Ok(())
    }
    fn cuParamSetSize(f: CUfunction, bytes: c_uint) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        func_mut(&mut inner, f)?.param_size = bytes;
        Ok(())
    }
    fn cuParamSeti(f: CUfunction, offset: i32, value: c_uint) {
        let _ = (offset, value);
        let d = driver()?;
        let mut inner = d.inner.lock();
        func_mut(&mut inner, f)?;
        Ok(())
    }
    fn cuParamSetf(f: CUfunction, offset: i32, value: f32) {
        let _ = (offset, value);
        let d = driver()?;
        let mut inner = d.inner.lock();
        func_mut(&mut inner, f)?;
        Ok(())
    }
    fn cuParamSetv(f: CUfunction, offset: i32, ptr: *mut c_void, bytes: c_uint) {
        let _ = (offset, bytes);
        let d = driver()?;
        if ptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        func_mut(&mut inner, f)?;
        Ok(())
    }
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(blocks: Out<i32>, f: CUfunction, block: i32, dyn_smem: usize) {
        let _ = dyn_smem;
        let d = driver()?;
        blocks.write(occupancy(d, f, block)?.0)
    }
    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(blocks: Out<i32>, f: CUfunction, block: i32, dyn_smem: usize, flags: c_uint) {
        let _ = (dyn_smem, flags);
        let d = driver()?;
        blocks.write(occupancy(d, f, block)?.0)
    }
    fn cuOccupancyMaxPotentialBlockSize(min_grid: Out<i32>, block: Out<i32>, f: CUfunction, cb: *mut c_void, dyn_smem: usize, limit: i32) {
        let _ = (cb, dyn_smem);
        potential_block(driver()?, min_grid, block, f, limit)
    }
    fn cuOccupancyMaxPotentialBlockSizeWithFlags(min_grid: Out<i32>, block: Out<i32>, f: CUfunction, cb: *mut c_void, dyn_smem: usize, limit: i32, flags: c_uint) {
        let _ = (cb, dyn_smem, flags);
        potential_block(driver()?, min_grid, block, f, limit)
    }
    fn cuOccupancyAvailableDynamicSMemPerBlock(smem: Out<usize>, f: CUfunction, blocks: i32, block: i32) {
        let _ = (blocks, block);
        let d = driver()?;
        let inner = d.inner.lock();
        inner.funcs.get(&f.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        smem.write(48 * 1024)
    }
}

fn func_attribute(d: &Driver, dev: usize, f: &Func, attr: u32) -> Result<i32, CUresult> {
    let (major, minor) = d.st.config.gpu[dev].cc();
    Ok(match attr {
        0 => 1024,
        1..=3 => 0,
        4 => 32,
        5 | 6 => major * 10 + minor,
        7 => 0,
        8 => f.max_dynamic_shared,
        9 => -1,
        10..=15 => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

fn set_func_attribute(f: &mut Func, attr: u32, value: i32) -> R {
    match attr {
        8 if (0..=166_912).contains(&value) => {
            f.max_dynamic_shared = value;
            Ok(())
        }
        9 if (-1..=100).contains(&value) => Ok(()),
        10..=15 => Ok(()),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = r#"
.version 8.0
.target sm_80
.address_size 64
.global .align 4 .b8 table[64];
.global .f32 scale;
.visible .entry spin_1ms(
    .param .u64 p
)
{ ret; }
.visible .entry vector_add(.param .u64 a) { ret; }
"#;

    #[test]
    fn ptx_entries_and_globals() {
        let img = parse_image(PTX.as_bytes()).unwrap();
        assert_eq!(
            img.functions,
            Some(vec!["spin_1ms".to_string(), "vector_add".to_string()])
        );
        assert_eq!(
            img.globals,
            vec![("table".to_string(), 64), ("scale".to_string(), 4)]
        );
    }

    #[test]
    fn unknown_images_resolve_any_name() {
        assert_eq!(parse_image(b"\x01\x02binary blob").unwrap().functions, None);
    }

    /// A fatbin entry: 64-byte header (kind, header size, padded payload size, compressed
    /// size, flags), then the payload padded to 8.
    fn entry(kind: u16, flags: u64, payload: &[u8]) -> Vec<u8> {
        let padded = payload.len().div_ceil(8) * 8;
        let mut e = vec![0u8; 64];
        e[0..2].copy_from_slice(&kind.to_le_bytes());
        e[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
        e[4..8].copy_from_slice(&64u32.to_le_bytes());
        e[8..16].copy_from_slice(&(padded as u64).to_le_bytes());
        e[16..20].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        e[28..32].copy_from_slice(&80u32.to_le_bytes());
        e[40..48].copy_from_slice(&flags.to_le_bytes());
        e.extend_from_slice(payload);
        e.resize(64 + padded, 0);
        e
    }

    fn fatbin(entries: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = entries.concat();
        let mut f = FATBIN_MAGIC.to_le_bytes().to_vec();
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&16u16.to_le_bytes());
        f.extend_from_slice(&(body.len() as u64).to_le_bytes());
        f.extend_from_slice(&body);
        f
    }

    /// A 64-bit ELF with a symbol table: FUNC `elf_kernel_5ms`, OBJECT `counter` (8 bytes).
    fn elf() -> Vec<u8> {
        let strtab = b"\0elf_kernel_5ms\0counter\0";
        let mut symtab = vec![0u8; 24]; // the null symbol
        for (name, info, size) in [(1u32, 0x12u8, 0u64), (16, 0x11, 8)] {
            let mut s = vec![0u8; 24];
            s[0..4].copy_from_slice(&name.to_le_bytes());
            s[4] = info;
            s[16..24].copy_from_slice(&size.to_le_bytes());
            symtab.extend(s);
        }
        let (sym_at, str_at) = (64usize, 64 + symtab.len());
        let shoff = str_at + strtab.len();
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        b[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        b[0x3C..0x3E].copy_from_slice(&3u16.to_le_bytes());
        b.extend_from_slice(&symtab);
        b.extend_from_slice(strtab);
        b.extend(vec![0u8; 64]); // section 0: null
        for (kind, off, size, link) in [
            (2u32, sym_at, symtab.len(), 2u32),
            (3, str_at, strtab.len(), 0),
        ] {
            let mut sh = vec![0u8; 64];
            sh[4..8].copy_from_slice(&kind.to_le_bytes());
            sh[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            sh[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            sh[0x28..0x2C].copy_from_slice(&link.to_le_bytes());
            b.extend(sh);
        }
        b
    }

    fn names(img: &Image) -> Option<Vec<&str>> {
        img.functions
            .as_ref()
            .map(|f| f.iter().map(String::as_str).collect())
    }

    #[test]
    fn fatbin_ptx_entry_is_read() {
        let img = parse_image(&fatbin(&[entry(1, 0, PTX.as_bytes())])).unwrap();
        assert_eq!(names(&img), Some(vec!["spin_1ms", "vector_add"]));
        assert_eq!(img.globals.len(), 2);
    }

    #[test]
    fn fatbin_elf_entry_is_read_and_names_are_not_repeated() {
        let ptx = ".version 8.0\n.visible .entry elf_kernel_5ms()\n{ ret; }\n";
        let img = parse_image(&fatbin(&[
            entry(1, 0, ptx.as_bytes()),
            entry(2, 0, &elf()),
            entry(2, 0, &elf()),
        ]))
        .unwrap();
        assert_eq!(names(&img), Some(vec!["elf_kernel_5ms"]));
        assert_eq!(img.globals, vec![("counter".to_string(), 8)]);
    }

    #[test]
    fn compressed_or_unknown_entries_make_every_name_resolve() {
        for flags in [FLAG_COMPRESSED_LZ4, FLAG_COMPRESSED_ZSTD] {
            let img = parse_image(&fatbin(&[
                entry(1, 0, PTX.as_bytes()),
                entry(2, flags, b"\x28\xb5\x2f\xfdjunk"),
            ]))
            .unwrap();
            assert_eq!(img.functions, None, "flags {flags:#x}");
            assert_eq!(img.globals.len(), 2, "globals of readable entries stay");
        }
        assert_eq!(
            parse_image(&fatbin(&[entry(0x40, 0, b"??")]))
                .unwrap()
                .functions,
            None
        );
        assert_eq!(parse_image(&fatbin(&[])).unwrap().functions, Some(vec![]));
    }

    #[test]
    fn malformed_fatbins_are_invalid_images() {
        let good = fatbin(&[entry(1, 0, PTX.as_bytes()), entry(2, 0, &elf())]);
        // Every truncation (the container size then overruns the bytes there are).
        for n in 4..good.len() {
            assert_eq!(
                parse_image(&good[..n]),
                Err(CUDA_ERROR_INVALID_IMAGE),
                "cut at {n}"
            );
        }
        let patched = |at: usize, v: &[u8]| {
            let mut b = good.clone();
            b[at..at + v.len()].copy_from_slice(v);
            b
        };
        let bad = [
            patched(4, &2u16.to_le_bytes()),              // container version
            patched(6, &8u16.to_le_bytes()),              // container header too small
            patched(8, &u64::MAX.to_le_bytes()),          // container size
            patched(16 + 4, &8u32.to_le_bytes()),         // entry header too small
            patched(16 + 4, &u32::MAX.to_le_bytes()),     // entry header too large
            patched(16 + 8, &(1u64 << 40).to_le_bytes()), // payload past the container
            patched(16 + 8, &8u64.to_le_bytes()),         // next entry lands in the PTX
            patched(16 + 64 + PTX.len().div_ceil(8) * 8 + 64, b"GARB"), // ELF entry not an ELF
        ];
        for (i, b) in bad.iter().enumerate() {
            assert_eq!(parse_image(b), Err(CUDA_ERROR_INVALID_IMAGE), "case {i}");
        }
        // Garbage after a valid magic.
        let mut garbage = FATBIN_MAGIC.to_le_bytes().to_vec();
        garbage.extend((0..200u32).map(|i| (i * 37 % 251) as u8));
        assert_eq!(parse_image(&garbage), Err(CUDA_ERROR_INVALID_IMAGE));
        // A wrapper cannot be read from a copy (it only points to its fatbin).
        assert_eq!(
            parse_image(&FATBIN_WRAPPER_MAGIC.to_le_bytes()),
            Err(CUDA_ERROR_INVALID_IMAGE)
        );
    }

    #[test]
    fn pointer_images_follow_the_wrapper() {
        let fb = fatbin(&[entry(1, 0, PTX.as_bytes())]);
        for version in [1, 2] {
            let w = crate::export::FatbinWrapper {
                magic: FATBIN_WRAPPER_MAGIC,
                version,
                data: fb.as_ptr().cast(),
                filename_or_fatbins: std::ptr::null(),
            };
            let bytes = image_from_ptr((&w as *const crate::export::FatbinWrapper).cast()).unwrap();
            assert_eq!(bytes, fb);
            assert_eq!(
                names(&parse_image(&bytes).unwrap()),
                Some(vec!["spin_1ms", "vector_add"])
            );
        }
        let wrap = |version: u32, data: *const c_void| crate::export::FatbinWrapper {
            magic: FATBIN_WRAPPER_MAGIC,
            version,
            data,
            filename_or_fatbins: std::ptr::null(),
        };
        let text = b"not a fatbin\0";
        for w in [
            wrap(3, fb.as_ptr().cast()),
            wrap(1, std::ptr::null()),
            wrap(2, text.as_ptr().cast()),
        ] {
            let p = (&w as *const crate::export::FatbinWrapper).cast();
            assert_eq!(image_from_ptr(p), Err(CUDA_ERROR_INVALID_IMAGE));
        }
        // A bare fatbin, an ELF and short text by pointer; a bad container header fails.
        assert_eq!(image_from_ptr(fb.as_ptr().cast()).unwrap(), fb);
        let e = elf();
        assert_eq!(image_from_ptr(e.as_ptr().cast()).unwrap(), e);
        assert_eq!(image_from_ptr(c"ab".as_ptr().cast()).unwrap(), b"ab");
        let mut big = fb.clone();
        big[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert_eq!(
            image_from_ptr(big.as_ptr().cast()),
            Err(CUDA_ERROR_INVALID_IMAGE)
        );
    }
}
