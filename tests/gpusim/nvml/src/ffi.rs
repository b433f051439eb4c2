//! The only place that touches memory C hands us. Pointer parameters are typed with the
//! `#[repr(transparent)]` wrappers below (ABI-identical to the raw pointers nvml.h declares),
//! and their methods do the NULL checks (→ `NVML_ERROR_INVALID_ARGUMENT`), the size checks
//! (→ `NVML_ERROR_INSUFFICIENT_SIZE`) and the reads and writes. Everything else in the crate is
//! safe code. Also owns the device handle table: an `nvmlDevice_t` is a pointer into
//! [`DEVICES`], and validating one is a range check, never a dereference.

use std::ffi::{c_char, c_uint, CStr};

use gpusim_core::layout::MAX_GPUS;

use crate::types::*;

/// `T *` for one value the caller provides room for (an out or in/out parameter).
#[repr(transparent)]
pub struct Out<T>(*mut T);

impl<T> Clone for Out<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Out<T> {}

impl<T> Out<T> {
    /// A pointer to a Rust variable (for reusing the C-facing helpers internally).
    pub fn from_mut(v: &mut T) -> Out<T> {
        Out(v)
    }

    /// NULL (for tests of the argument checks).
    pub fn null() -> Out<T> {
        Out(std::ptr::null_mut())
    }

    pub fn is_null(self) -> bool {
        self.0.is_null()
    }
}

impl<T: Copy> Out<T> {
    /// Store `v` in the caller's variable.
    pub fn write(self, v: T) -> NvmlResult {
        if self.0.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-NULL; nvml.h's contract is that a non-NULL pointer parameter points to a
        // properly aligned, writable `T` for the duration of the call.
        unsafe { self.0.write(v) };
        Ok(())
    }

    /// The caller's value (for in/out parameters such as `*infoCount` or a struct's version).
    pub fn read(self) -> Result<T, nvmlReturn_t> {
        if self.0.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: as in `write`; in/out parameters are initialised by the caller.
        Ok(unsafe { self.0.read() })
    }
}

impl<T: Versioned> Out<T> {
    /// The `version` field the caller set, without reading the (output-only, possibly
    /// uninitialised) rest of the struct.
    pub fn read_version(self) -> Result<c_uint, nvmlReturn_t> {
        if self.0.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-NULL and valid per nvml.h's contract; `Versioned` guarantees the struct
        // starts with the caller-initialised `unsigned int version`.
        Ok(unsafe { self.0.cast::<c_uint>().read() })
    }
}

/// A `#[repr(C)]` struct whose first field is `unsigned int version`.
///
/// # Safety
/// Implement only for such structs.
pub unsafe trait Versioned {}

// SAFETY: `#[repr(C)]` with `version: c_uint` first (see types.rs).
unsafe impl Versioned for nvmlMemory_v2_t {}

/// `const T *` for a value the caller passes in. Only the generated stubs (unsupported.rs) take
/// one, and they never read it.
#[repr(transparent)]
pub struct In<T>(*const T);

impl<T> Clone for In<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for In<T> {}

impl<T> In<T> {
    pub fn is_null(self) -> bool {
        self.0.is_null()
    }
}

/// `T *` for an array whose length the caller gives in another parameter (or struct field).
#[repr(transparent)]
pub struct Buf<T>(*mut T);

impl<T> Clone for Buf<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Buf<T> {}

impl<T> Buf<T> {
    pub fn null() -> Buf<T> {
        Buf(std::ptr::null_mut())
    }

    /// A Rust array (for reusing the C-facing helpers internally and in tests).
    pub fn from_slice(v: &mut [T]) -> Buf<T> {
        Buf(v.as_mut_ptr())
    }
}

impl<T: Copy> Buf<T> {
    pub fn is_null(self) -> bool {
        self.0.is_null()
    }

    /// Copy `items` to the start of the caller's array of `capacity` elements.
    pub fn write_all(self, items: &[T], capacity: usize) -> NvmlResult {
        if items.is_empty() {
            return Ok(());
        }
        if self.0.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if items.len() > capacity {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (i, item) in items.iter().enumerate() {
            // SAFETY: non-NULL, i < capacity, and nvml.h's contract is that the array holds
            // `capacity` properly aligned, writable elements.
            unsafe { self.0.add(i).write(*item) };
        }
        Ok(())
    }

    /// The first `n` elements of the caller's array (for in/out arrays such as field values).
    pub fn read_all(self, n: usize) -> Result<Vec<T>, nvmlReturn_t> {
        if n == 0 {
            return Ok(Vec::new());
        }
        if self.0.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: as in `write_all`, with the caller having initialised the `n` elements.
        Ok((0..n).map(|i| unsafe { self.0.add(i).read() }).collect())
    }
}

/// `char *` for a string result, with its `unsigned int length` passed separately.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct CharBuf(*mut c_char);

impl CharBuf {
    /// Write `s` NUL-terminated; `NVML_ERROR_INSUFFICIENT_SIZE` if `length` bytes cannot hold
    /// it (the buffer is left untouched then).
    pub fn write_str(self, length: c_uint, s: &str) -> NvmlResult {
        if self.0.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if s.len() + 1 > length as usize {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        self.copy(s.as_bytes());
        Ok(())
    }

    /// Write as much of `s` as fits in `length` bytes with the NUL (for APIs documented to
    /// crop, such as `nvmlSystemGetProcessName`).
    pub fn write_cropped(self, length: c_uint, s: &str) -> NvmlResult {
        if self.0.is_null() || length == 0 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let n = s.len().min(length as usize - 1);
        self.copy(&s.as_bytes()[..n]);
        Ok(())
    }

    /// Copy `bytes` and a NUL; the callers above checked NULL and room for `bytes.len() + 1`.
    fn copy(self, bytes: &[u8]) {
        // SAFETY: non-NULL and the caller's `length` (checked by both callers) covers
        // bytes.len() + 1 writable bytes, per nvml.h's contract for (char *, length) pairs.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.0.cast::<u8>(), bytes.len());
            self.0.add(bytes.len()).write(0);
        }
    }
}

/// `const char *` input string.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct CStrIn(*const c_char);

impl CStrIn {
    /// The string, copied; NULL or not UTF-8 is `NVML_ERROR_INVALID_ARGUMENT`.
    pub fn to_string(self) -> Result<String, nvmlReturn_t> {
        if self.0.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-NULL; nvml.h's contract is a NUL-terminated string valid for the call.
        let s = unsafe { CStr::from_ptr(self.0) };
        s.to_str()
            .map(str::to_owned)
            .map_err(|_| NVML_ERROR_INVALID_ARGUMENT)
    }
}

// ---- device handles -------------------------------------------------------------------------

/// The objects `nvmlDevice_t` handles point at; entry `i` is GPU `i`. Never written to.
pub static DEVICES: [nvmlDevice_st; MAX_GPUS] = device_table();

const fn device_table() -> [nvmlDevice_st; MAX_GPUS] {
    let mut t = [const { nvmlDevice_st { index: 0 } }; MAX_GPUS];
    let mut i = 0;
    while i < MAX_GPUS {
        t[i].index = i as u32;
        i += 1;
    }
    t
}

/// The handle of GPU `g` (< MAX_GPUS).
pub fn handle_of(g: usize) -> nvmlDevice_t {
    std::ptr::from_ref(&DEVICES[g]).cast_mut()
}

/// The GPU a handle names, if it points at an entry of [`DEVICES`] (by address only).
pub fn index_of(d: nvmlDevice_t) -> Option<usize> {
    let base = DEVICES.as_ptr() as usize;
    let off = (d as usize).checked_sub(base)?;
    let size = std::mem::size_of::<nvmlDevice_st>();
    (off % size == 0 && off / size < MAX_GPUS).then_some(off / size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_pointers_are_rejected() {
        for g in 0..MAX_GPUS {
            assert_eq!(index_of(handle_of(g)), Some(g));
        }
        assert_eq!(index_of(std::ptr::null_mut()), None);
        let bogus = (handle_of(0) as usize + 1) as nvmlDevice_t;
        assert_eq!(index_of(bogus), None);
        let past = (handle_of(MAX_GPUS - 1) as usize + std::mem::size_of::<nvmlDevice_st>())
            as nvmlDevice_t;
        assert_eq!(index_of(past), None);
        let mut local = nvmlDevice_st { index: 0 };
        assert_eq!(index_of(&mut local), None);
    }

    #[test]
    fn out_checks_null_and_writes() {
        let mut v: c_uint = 0;
        assert_eq!(Out(&mut v as *mut c_uint).write(5), Ok(()));
        assert_eq!(v, 5);
        assert_eq!(
            Out::<c_uint>(std::ptr::null_mut()).write(5),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
        assert_eq!(
            Out::<c_uint>(std::ptr::null_mut()).read(),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
    }

    #[test]
    fn char_buf_sizes() {
        let mut b = [0x7f as c_char; 8];
        let cb = CharBuf(b.as_mut_ptr());
        assert_eq!(cb.write_str(4, "abcd"), Err(NVML_ERROR_INSUFFICIENT_SIZE));
        assert_eq!(b[0], 0x7f, "untouched on error");
        assert_eq!(cb.write_str(5, "abcd"), Ok(()));
        assert_eq!(
            b[..5],
            [
                b'a' as c_char,
                b'b' as c_char,
                b'c' as c_char,
                b'd' as c_char,
                0
            ]
        );
        assert_eq!(cb.write_cropped(3, "xyz"), Ok(()));
        assert_eq!(b[..3], [b'x' as c_char, b'y' as c_char, 0]);
        assert_eq!(cb.write_cropped(0, "xyz"), Err(NVML_ERROR_INVALID_ARGUMENT));
        assert_eq!(
            CharBuf(std::ptr::null_mut()).write_str(9, "a"),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
    }

    #[test]
    fn buf_respects_capacity() {
        let mut a = [0u32; 3];
        let b = Buf(a.as_mut_ptr());
        assert_eq!(
            b.write_all(&[1, 2, 3, 4], 3),
            Err(NVML_ERROR_INSUFFICIENT_SIZE)
        );
        assert_eq!(b.write_all(&[1, 2], 3), Ok(()));
        assert_eq!(a, [1, 2, 0]);
        assert_eq!(Buf::<u32>(std::ptr::null_mut()).write_all(&[], 0), Ok(()));
        assert_eq!(
            Buf::<u32>(std::ptr::null_mut()).write_all(&[1], 1),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
    }
}
