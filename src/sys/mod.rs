//! The raw Linux calls stagefs makes that std does not wrap, in one place, each behind a safe
//! function whose `unsafe` block says why it is sound (`SAFETY:`): the rest of the crate calls
//! these, not libc. Grouped by concern:
//!
//! - [`beneath`]: opening, listing and describing files *beneath* a directory descriptor
//!   without following links (openat2, or a walk one component at a time), which the scan,
//!   the stager's copies and the permission checks rely on.
//! - [`file`]: calls on one file or its file system: extended attributes, times, page-cache
//!   advice, file system figures, FIFOs.
//! - [`mount`]: which mount a path is on (statx mount IDs), umount2, and the calls made at a
//!   held mount in a child process.
//! - [`child`]: system calls made in a forked child that may be abandoned if a FUSE daemon
//!   never answers it.
//! - [`process`]: processes held by pidfd, signals, detaching a daemon, descriptor limits.
//! - [`credentials`]: the process's and a FUSE thread's user and groups.
//! - [`socket`]: what the kernel says about a Unix socket's peer, and descriptors sent over one.
//!
//! The functions are re-exported here, so callers name them `sys::open_beneath` whatever file
//! holds them.

mod beneath;
mod child;
mod credentials;
mod file;
mod mount;
mod process;
mod socket;

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub use beneath::{
    faccessat2, lstat_at, lstat_beneath, open_beneath, open_directory, openat2, read_entries,
    readlink_beneath,
};
pub use child::{ChildError, getxattr_in_child, open_in_child};
pub use credentials::{
    euid, fsgid, fsuid, set_fsgid, set_fsuid, set_thread_groups, thread_groups, uid_of_user,
};
pub use file::{
    access, device_of, drop_cached_pages, fgetxattr, fsetxattr, fstatvfs, getxattr, listxattr,
    mkfifo, reopen_read_only, set_mtime, set_status_flags, statfs, statvfs, syncfs,
};
#[cfg(test)]
pub(crate) use file::{removexattr, resident_pages};
pub use mount::{AtMount, MountOf, at_mount, mount_fusectl, mount_of};
pub use process::{
    TerminationSignals, descriptor_limit, detach_keeping, inherited_fd, pidfd_open, pidfd_signal,
    poll_readable, proc_stat_fields, raise_descriptor_limit, restore_default_sigpipe,
    set_mmap_threshold, thread_id,
};
pub use socket::{
    MAX_FDS_PER_MESSAGE, hung_up, peer_credentials, peer_groups, recv_with_fds, send_with_fds,
};

/// The longest path one call takes, its terminating NUL included (Linux's PATH_MAX).
const PATH_MAX: usize = libc::PATH_MAX as usize;

/// `path` as a C string; a path with a NUL byte cannot name a file (EINVAL).
pub fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// `-1` from a system call as the error errno holds; anything else as the value.
fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}
