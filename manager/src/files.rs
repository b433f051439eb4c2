//! The manager's own files (the checkpoint, the preload file, containers' configs and
//! directories): replaced atomically, made and removed with errors that name the path. Below
//! [`crate::core`] and [`crate::journal`], which both write through it.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// A file or directory of the manager's own could not be written, made or removed. The
/// state and run directories are the manager's: the fix is on the host (space, permissions,
/// a read-only mount).
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot write {}: {source}; check that its directory is writable and its file system has space", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create {}: {source}; check --state-dir / --run-dir and their permissions", path.display())]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot remove {}: {source}", path.display())]
    Remove {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl FileError {
    /// A short stable name for counting errors by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            FileError::Write { .. } => "write",
            FileError::CreateDir { .. } => "create-dir",
            FileError::Remove { .. } => "remove",
        }
    }

    /// The path it is about.
    pub fn path(&self) -> &Path {
        match self {
            FileError::Write { path, .. }
            | FileError::CreateDir { path, .. }
            | FileError::Remove { path, .. } => path,
        }
    }
}

/// Write a file so that readers see the old or the new content, never a mix, and a crash of
/// the writer leaves one of the two: a temporary file in the same directory, renamed. Not
/// synced to disk (see [`crate::journal`]).
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FileError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&tmp, path)
    })();
    res.map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        FileError::Write {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// `mkdir -p`.
pub fn create_dir(path: &Path) -> Result<(), FileError> {
    std::fs::create_dir_all(path).map_err(|source| FileError::CreateDir {
        path: path.to_path_buf(),
        source,
    })
}

/// `rm -r`; a directory already gone is fine.
pub fn remove_dir(path: &Path) -> Result<(), FileError> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(FileError::Remove {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Run `f` in a forked child whose files may not grow past `limit` bytes (a full
    /// disk, as the kernel reports it: a short write, then EFBIG); returns its exit code.
    pub(crate) fn with_file_limit(limit: u64, f: impl FnOnce() -> bool) -> i32 {
        // SAFETY: the child only sets a limit, runs `f` (file I/O) and _exits.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let lim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: libc::RLIM_INFINITY,
            };
            // SAFETY: plain system calls in the child; SIGXFSZ would kill it otherwise.
            unsafe {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
            }
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(false);
            // SAFETY: end the child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        libc::WEXITSTATUS(status)
    }

    #[test]
    fn a_write_into_a_missing_directory_names_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("gone").join("f");
        let e = write_atomic(&p, b"x", 0o600).unwrap_err();
        assert!(
            matches!(&e, FileError::Write { path, .. } if path == &p),
            "{e:?}"
        );
        assert_eq!(e.kind(), "write");
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
        assert!(!d.path().join("gone").exists(), "nothing left behind");
    }

    #[test]
    fn a_replaced_file_has_its_new_content_and_mode() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        write_atomic(&p, b"old", 0o600).unwrap();
        write_atomic(&p, b"new", 0o644).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o644
        );
        remove_dir(&d.path().join("never-there")).unwrap();
    }
}
