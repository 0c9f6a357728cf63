//! What a file-system operation can fail with, and the errno each failure is answered with.
//!
//! One enum for the whole core, so the errno of every answer is decided here rather than at
//! each reply site: the FUSE adapter only turns [`FsError::errno`] into a reply, and the core's
//! tests can assert on the variant or on the errno a reader would see.

use crate::stager::OpenError;

use super::access::Refusal;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such entry")]
    NotFound,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    /// Not a regular file (opens), not a link (readlink), a malformed value (setxattr).
    #[error("invalid argument")]
    Invalid,
    /// Every modifying operation: the mount is read-only by contract.
    #[error("read-only file system")]
    ReadOnly,
    #[error("no such open handle")]
    BadHandle,
    #[error("I/O error")]
    Io,
    /// A file read through from SOURCE changed there while open.
    #[error("changed on SOURCE while open")]
    Stale,
    /// The caller's buffer is shorter than the attribute value.
    #[error("value larger than the buffer")]
    Range,
    #[error("no such attribute")]
    NoAttr,
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error(transparent)]
    Open(#[from] OpenError),
    /// SOURCE's own answer (extended attributes), passed on as it came.
    #[error("SOURCE answered errno {0}")]
    Source(i32),
}

impl FsError {
    /// The errno the caller gets.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::Invalid => libc::EINVAL,
            FsError::ReadOnly => libc::EROFS,
            FsError::BadHandle => libc::EBADF,
            FsError::Io => libc::EIO,
            FsError::Stale => libc::ESTALE,
            FsError::Range => libc::ERANGE,
            FsError::NoAttr => libc::ENODATA,
            FsError::Refused(r) => r.errno(),
            FsError::Open(e) => e.errno(),
            FsError::Source(errno) => *errno,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos_of_wrapped_errors_are_theirs() {
        assert_eq!(FsError::from(OpenError::Changed).errno(), libc::ESTALE);
        assert_eq!(FsError::from(OpenError::Gone).errno(), libc::ENOENT);
        assert_eq!(FsError::from(Refusal::Reentrant(1)).errno(), libc::EDEADLK);
        assert_eq!(FsError::Source(libc::E2BIG).errno(), libc::E2BIG);
        assert_eq!(FsError::NoAttr.errno(), libc::ENODATA);
    }
}
