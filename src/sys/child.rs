//! System calls made in a forked child process that is abandoned if it does not answer in
//! time. A FUSE daemon stopped just after it read a request (SIGSTOP arrives asynchronously)
//! leaves the call in an uninterruptible wait that no signal ends: made on a thread, it would
//! keep this whole process from exiting. Made in a child, the child is left behind, blocked
//! until the daemon resumes or its connection is aborted (`stagefs unmount`), and the caller
//! goes on.
//!
//! The child answers over a socket: a code (the value's length, or minus the errno), the
//! value, and maybe a descriptor. The calls a child makes allocate nothing and take no lock,
//! so they are safe after a fork in a process with other threads: [`super::mount_of`],
//! `openat`, `fchdir`, `umount2`, [`super::getxattr`], [`send_answer`] (which sends with
//! [`send_with_fds`], allocation-free).

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use super::mount::openat;
use super::process::poll_readable;
use super::socket::{recv_with_fds, send_with_fds};
use super::{check, getxattr};

/// The largest attribute value a child reads (statistics are a few KiB).
pub(super) const XATTR_MAX: usize = 64 * 1024;

/// Why a call made in a child process did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum ChildError {
    /// It did not return in time: a FUSE daemon that does not answer.
    #[error("did not answer within {0:?}")]
    NoAnswer(Duration),
    /// The mount on top where a held mount was is another one now, or none (see
    /// [`super::at_mount`]).
    #[error("is no longer the mount there")]
    Replaced,
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The first bytes of a child's answer: >= 0 for success (the length of what follows), < 0
/// for minus the errno, or [`REPLACED`].
type Code = i64;
const REPLACED: Code = Code::MIN;

/// getxattr(2) of `path`'s attribute `name` (following links), made by a child process and
/// waited for at most `limit`.
pub fn getxattr_in_child(path: &CStr, name: &CStr, limit: Duration) -> Result<Vec<u8>, ChildError> {
    // Everything the child touches is made before the fork: after it, only system calls.
    let mut value = vec![0u8; XATTR_MAX];
    // SAFETY: the child makes one getxattr into the buffer above and answers.
    let answered = unsafe {
        in_child(None, limit, |sock| {
            let len = getxattr(path, name, &mut value, true);
            answer(sock, len.map_err(ChildError::from), &value, None);
        })
    };
    answered.map(|(value, _)| value)
}

/// Opens `path` (links followed) with `flags` in a child process waited for at most `limit`.
pub fn open_in_child(
    path: &CStr,
    flags: libc::c_int,
    limit: Duration,
) -> Result<OwnedFd, ChildError> {
    // SAFETY: the child makes one openat on the path given and answers.
    let answered = unsafe {
        in_child(None, limit, |sock| match openat(None, path, flags) {
            Ok(fd) => answer(sock, Ok(0), &[], Some(fd.as_fd())),
            Err(e) => answer(sock, Err(e.into()), &[], None),
        })
    };
    match answered? {
        (_, Some(fd)) => Ok(fd),
        (_, None) => Err(io::Error::from_raw_os_error(libc::EIO).into()),
    }
}

/// Sends a child's outcome: `result` (the value's length, or why it failed), then `value`
/// and, with the first byte, `fd`. Allocates nothing.
pub(super) fn answer(
    sock: BorrowedFd<'_>,
    result: Result<usize, ChildError>,
    value: &[u8],
    fd: Option<BorrowedFd<'_>>,
) {
    let code: Code = match &result {
        Ok(len) => *len as Code,
        Err(ChildError::Replaced) => REPLACED,
        Err(ChildError::Io(e)) => -Code::from(e.raw_os_error().unwrap_or(libc::EIO)),
        Err(ChildError::NoAnswer(_)) => -Code::from(libc::ETIMEDOUT),
    };
    send_answer(sock, &code.to_ne_bytes(), fd);
    if let Ok(len) = result {
        send_answer(sock, &value[..len.min(value.len())], None);
    }
}

/// Runs `body` in a forked child ([`fork_child`]: only `keep` stays open there) and waits at
/// most `limit` for its [`answer`]: the value and the descriptor it sent (see the module's
/// note).
///
/// # Safety
/// As for [`fork_child`]: `body` makes only async-signal-safe calls on memory prepared
/// before the call.
pub(super) unsafe fn in_child(
    keep: Option<BorrowedFd<'_>>,
    limit: Duration,
    body: impl FnOnce(BorrowedFd<'_>),
) -> Result<(Vec<u8>, Option<OwnedFd>), ChildError> {
    let deadline = Instant::now() + limit;
    // SAFETY: the caller vouches for `body`.
    let (child, sock) = unsafe { fork_child(keep, body) }?;
    let (mut bytes, fd) = read_answer(&sock, deadline).ok_or(ChildError::NoAnswer(limit))?;
    // It has written everything, so it is exiting: reap it.
    reap(child);
    if bytes.len() < size_of::<Code>() {
        return Err(io::Error::from_raw_os_error(libc::EIO).into());
    }
    let value = bytes.split_off(size_of::<Code>());
    match Code::from_ne_bytes(bytes.try_into().expect("a code's bytes")) {
        REPLACED => Err(ChildError::Replaced),
        errno if errno < 0 => Err(io::Error::from_raw_os_error((-errno) as i32).into()),
        _ => Ok((value, fd)),
    }
}

/// Closes every descriptor but the (at most two) in `keep`.
fn close_all_but(keep: &[RawFd]) {
    let mut from: libc::c_uint = 0;
    let mut sorted = [RawFd::MAX; 2];
    for (slot, fd) in sorted.iter_mut().zip(keep) {
        *slot = *fd;
    }
    sorted.sort_unstable();
    for fd in sorted.into_iter().filter(|&fd| fd != RawFd::MAX) {
        let fd = fd as libc::c_uint;
        if fd > from {
            // SAFETY: close_range has no memory arguments.
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0) };
        }
        from = fd + 1;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, libc::c_uint::MAX, 0) };
}

/// Forks a child that runs `body` with its end of a new socket and then exits. Every other
/// descriptor but `keep` is closed in the child first: a child left blocked must hold nothing
/// of its parent's (not the stdout a pipeline waits on, nor a mount). Returns the child's pid
/// and the parent's end, where the child's [`send_answer`] arrives ([`read_answer`]).
///
/// # Safety
/// The calling process may have other threads, some holding locks (the allocator's): `body`
/// must make only async-signal-safe calls (such as those listed in this module's note), on
/// memory prepared before the fork, and must not panic.
unsafe fn fork_child(
    keep: Option<BorrowedFd<'_>>,
    body: impl FnOnce(BorrowedFd<'_>),
) -> io::Result<(libc::pid_t, OwnedFd)> {
    let mut fds = [0; 2];
    let kind = libc::SOCK_STREAM | libc::SOCK_CLOEXEC;
    // SAFETY: socketpair writes two descriptors into the array we own.
    check(unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) } as _)?;
    // SAFETY: both are new descriptors nothing else owns.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the child runs only `body`, which the caller vouches for, and close_range/_exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let keep = keep.map_or(RawFd::MAX, |k| k.as_raw_fd());
        close_all_but(&[theirs.as_raw_fd(), keep]);
        body(theirs.as_fd());
        // SAFETY: ends the child without running the parent's destructors or atexit hooks.
        unsafe { libc::_exit(0) };
    }
    drop(theirs);
    check(pid as _)?;
    Ok((pid, ours))
}

/// Sends `bytes` and, with the first of them, descriptor `fd` over socket `sock`. Allocates
/// nothing (a forked child's answer).
fn send_answer(sock: BorrowedFd<'_>, mut bytes: &[u8], fd: Option<BorrowedFd<'_>>) {
    let mut fd = fd;
    while !bytes.is_empty() {
        let fds = fd.as_slice();
        match send_with_fds(sock, bytes, fds) {
            Ok(n) => {
                bytes = &bytes[n..];
                fd = None;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// What a child sent with [`send_answer`] until it closed its end: its bytes and the
/// descriptor that came with them, or None if `deadline` passed first.
fn read_answer(sock: &OwnedFd, deadline: Instant) -> Option<(Vec<u8>, Option<OwnedFd>)> {
    let (mut bytes, mut fd) = (Vec::new(), None);
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match poll_readable(
            sock.as_fd(),
            deadline.saturating_duration_since(Instant::now()),
        ) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Some((bytes, fd)),
        }
        match recv_with_fds(sock.as_fd(), &mut chunk, 1) {
            Ok((0, _)) => return Some((bytes, fd)),
            Ok((n, received)) => {
                bytes.extend_from_slice(&chunk[..n]);
                fd = fd.or(received.into_iter().next());
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Some((bytes, fd)),
        }
    }
}

/// Reaps child `pid`, which has exited or is about to (it closed its answer).
fn reap(pid: libc::pid_t) {
    // SAFETY: waiting for our own child; no status wanted.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
}
