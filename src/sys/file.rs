//! Calls on one file, or the file system a file is on, that std does not offer: extended
//! attributes (the cache's checksums, SOURCE's own attributes, a mount's statistics), a
//! copy's modification time, page-cache advice, file system figures, syncfs, FIFOs.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

use super::{c_path, check};

/// syncfs(2): writes out the dirty data of the file system `fd` is on (only that one: a
/// global sync would wait on every other mount too, a hung network one included).
pub fn syncfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a valid descriptor.
    check(unsafe { libc::syncfs(fd.as_raw_fd()) } as _).map(drop)
}

/// getxattr(2) of `path`'s attribute `name` into `buf` (lgetxattr: a final link not
/// followed, unless `follow`); the value's length.
pub fn getxattr(path: &CStr, name: &CStr, buf: &mut [u8], follow: bool) -> io::Result<usize> {
    let call = if follow {
        libc::getxattr
    } else {
        libc::lgetxattr
    };
    // SAFETY: NUL-terminated strings and a buffer of the length passed.
    let len = unsafe {
        call(
            path.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    check(len as _).map(|n| n as usize)
}

/// listxattr(2) of `path` (following links) into `buf`: the names' length.
pub fn listxattr(path: &CStr, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: a NUL-terminated path and a buffer of the length passed.
    let len = unsafe { libc::listxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    check(len as _).map(|n| n as usize)
}

/// fgetxattr(2): attribute `name` of open file `fd` into `buf`; the value's length.
pub fn fgetxattr(fd: BorrowedFd<'_>, name: &CStr, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: a valid descriptor, a NUL-terminated name and a buffer of the length passed.
    let len = unsafe {
        libc::fgetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    check(len as _).map(|n| n as usize)
}

/// fsetxattr(2): sets attribute `name` of open file `fd` to `value`.
pub fn fsetxattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: a valid descriptor, a NUL-terminated name and a value of the length passed.
    let rc = unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    check(rc as _).map(drop)
}

/// removexattr(2) of `path`'s attribute `name` (following links).
#[cfg(test)]
pub(crate) fn removexattr(path: &Path, name: &CStr) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: NUL-terminated strings.
    check(unsafe { libc::removexattr(c.as_ptr(), name.as_ptr()) } as _).map(drop)
}

/// Sets open file `fd`'s modification time, leaving its access time as it is.
pub fn set_mtime(fd: BorrowedFd<'_>, mtime: libc::timespec) -> io::Result<()> {
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        mtime,
    ];
    // SAFETY: a valid descriptor and a two-element timespec array as futimens requires.
    check(unsafe { libc::futimens(fd.as_raw_fd(), times.as_ptr()) } as _).map(drop)
}

/// Asks the kernel to drop open file `fd`'s clean cached pages (dirty ones stay).
pub fn drop_cached_pages(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a valid descriptor; offset 0 and length 0 mean the whole file.
    match unsafe { libc::posix_fadvise(fd.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) } {
        0 => Ok(()),
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

/// How many of open file `fd`'s `len` bytes are in the page cache, in pages (mincore over a
/// mapping of it).
#[cfg(test)]
pub(crate) fn resident_pages(fd: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut pages = vec![0u8; len.div_ceil(page)];
    // SAFETY: a read-only shared mapping of `len` bytes of a valid descriptor, unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the mapping above, of `len` bytes, and a vector of one byte per page of it.
    let rc = unsafe { libc::mincore(map, len, pages.as_mut_ptr()) };
    let result = check(rc as _);
    // SAFETY: the mapping above, no longer used.
    unsafe { libc::munmap(map, len) };
    result.map(|_| pages.iter().filter(|p| **p & 1 == 1).count())
}

/// access(2): whether the real user may access `path` as `mode` (`W_OK | X_OK`, ...).
pub fn access(path: &Path, mode: i32) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: a NUL-terminated path.
    check(unsafe { libc::access(c.as_ptr(), mode) } as _).map(drop)
}

/// statvfs(2): the figures of the file system holding `path`.
pub fn statvfs(path: &Path) -> io::Result<libc::statvfs> {
    let c = c_path(path)?;
    // SAFETY: statvfs is plain data, for which all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and an out pointer we own.
    check(unsafe { libc::statvfs(c.as_ptr(), &mut st) } as _).map(|_| st)
}

/// fstatvfs(2): the figures of the file system open file `fd` is on.
pub fn fstatvfs(fd: BorrowedFd<'_>) -> io::Result<libc::statvfs> {
    // SAFETY: statvfs is plain data, for which all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and an out pointer we own.
    check(unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut st) } as _).map(|_| st)
}

/// statfs(2) of the file system holding `path` (its type, which statvfs does not say).
pub fn statfs(path: &Path) -> io::Result<libc::statfs> {
    let c = c_path(path)?;
    // SAFETY: statfs is plain data, for which all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and an out pointer we own.
    check(unsafe { libc::statfs(c.as_ptr(), &mut st) } as _).map(|_| st)
}

/// mkfifo(3): makes a FIFO at `path` with permissions `mode`.
pub fn mkfifo(path: &Path, mode: libc::mode_t) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: a NUL-terminated path; mkfifo only creates the node.
    check(unsafe { libc::mkfifo(c.as_ptr(), mode) } as _).map(drop)
}

/// The device number of the file behind `fd` (an `O_PATH` descriptor will do).
pub fn device_of(fd: BorrowedFd<'_>) -> io::Result<libc::dev_t> {
    // SAFETY: stat is plain data, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and out pointer.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } as _)?;
    Ok(st.st_dev)
}

/// Sets the file status flags of `fd` (e.g. clears `O_NONBLOCK`).
pub fn set_status_flags(fd: BorrowedFd<'_>, flags: i32) -> io::Result<()> {
    // SAFETY: F_SETFL on a valid descriptor takes an int.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags) } as _).map(drop)
}

/// A new read-only open of the file `fd` is open on (through `/proc/self/fd`, which works for
/// an unlinked file too): its own offset and status flags, so whoever it is given to can
/// neither write the file nor change how the daemon's own descriptor reads it.
pub fn reopen_read_only(fd: BorrowedFd<'_>) -> io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}
