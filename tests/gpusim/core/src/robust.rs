//! A process-shared, robust pthread mutex living inside the shared state file. A process
//! killed while holding it does not wedge the others: the next locker gets `EOWNERDEAD`,
//! marks the mutex consistent and carries on (the simulator's state stays usable because
//! every critical section leaves it valid at each store).

use std::cell::UnsafeCell;

/// Room for a `pthread_mutex_t` (40 bytes on x86_64 and aarch64 glibc) with headroom.
#[repr(C, align(8))]
pub struct RawRobustMutex {
    inner: UnsafeCell<[u8; 64]>,
}

const _: () = assert!(std::mem::size_of::<libc::pthread_mutex_t>() <= 64);

/// Why a lock could not be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    #[error("the shared state's mutex is unrecoverable (a holder died and recovery failed); delete the state file")]
    NotRecoverable,
    #[error("pthread_mutex_lock failed with errno {0}")]
    Other(i32),
}

impl RawRobustMutex {
    fn ptr(&self) -> *mut libc::pthread_mutex_t {
        self.inner.get().cast()
    }

    /// Initialise in place. Only the creator of the state file calls this, before any other
    /// process can see the file (it holds the file's creation flock).
    ///
    /// # Safety
    /// No other thread or process may use the mutex concurrently.
    pub unsafe fn init(&self) {
        let mut attr = std::mem::MaybeUninit::<libc::pthread_mutexattr_t>::uninit();
        // SAFETY: attr is a valid out-pointer; the mutex memory is exclusively ours (caller
        // contract) and large enough for pthread_mutex_t (const assertion above).
        unsafe {
            libc::pthread_mutexattr_init(attr.as_mut_ptr());
            libc::pthread_mutexattr_setpshared(attr.as_mut_ptr(), libc::PTHREAD_PROCESS_SHARED);
            libc::pthread_mutexattr_setrobust(attr.as_mut_ptr(), libc::PTHREAD_MUTEX_ROBUST);
            libc::pthread_mutex_init(self.ptr(), attr.as_ptr());
            libc::pthread_mutexattr_destroy(attr.as_mut_ptr());
        }
    }

    /// Lock; returns whether a previous owner died holding it.
    pub fn lock(&self) -> Result<bool, LockError> {
        // SAFETY: the mutex was initialised by the file's creator before the magic number
        // was published, and lives as long as the mapping `self` borrows from.
        let rc = unsafe { libc::pthread_mutex_lock(self.ptr()) };
        match rc {
            0 => Ok(false),
            libc::EOWNERDEAD => {
                // SAFETY: we hold the mutex (EOWNERDEAD returns it locked).
                unsafe { libc::pthread_mutex_consistent(self.ptr()) };
                Ok(true)
            }
            libc::ENOTRECOVERABLE => Err(LockError::NotRecoverable),
            e => Err(LockError::Other(e)),
        }
    }

    /// Unlock a mutex this thread locked.
    pub fn unlock(&self) {
        // SAFETY: callers only unlock after a successful `lock` on this thread (guards).
        unsafe { libc::pthread_mutex_unlock(self.ptr()) };
    }
}
