//! The few raw Linux calls stagefs makes that std does not wrap, in one place, each behind a
//! safe function: opening directories and files *beneath* a directory descriptor without
//! following links (openat2), which both the stager's copies and the permission checks rely on;
//! and what commands need to act on a mount or a process by identity rather than by a name
//! that can change meanwhile: a path's mount (statx), processes held by pidfd, and system calls
//! made in a forked child that may be abandoned if a FUSE daemon never answers it.
//!
//! The calls a forked child makes ([`fork_child`]) allocate nothing and take no lock, so they
//! are safe there: [`mount_of`], [`openat`], [`fchdir`], [`umount2`], [`getxattr`],
//! [`send_answer`].

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// `struct open_how` of openat2(2) (libc's is non-exhaustive, so it cannot be built here).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// The process's effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The process's descriptor limits (RLIMIT_NOFILE), if they can be read.
fn descriptor_limits() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit)
}

/// How many descriptors the process may open (the soft limit; 1024, Linux's default, if it
/// cannot be read).
pub fn descriptor_limit() -> usize {
    descriptor_limits().map_or(1024, |l| usize::try_from(l.rlim_cur).unwrap_or(usize::MAX))
}

/// Raises the soft descriptor limit to the hard one, as far as the daemon needs: it keeps
/// cached copies open between opens (the default soft limit, often 1024, would keep few).
pub fn raise_descriptor_limit() {
    if let Some(mut limit) = descriptor_limits()
        && limit.rlim_cur < limit.rlim_max
    {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: setrlimit reads the struct we own; a refusal leaves the limit as it was.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    }
}

/// The fields of a `/proc/PID/stat` line after the command name (state first), which is in
/// parentheses and may itself hold spaces and parentheses.
pub fn proc_stat_fields(stat: &[u8]) -> Option<impl Iterator<Item = &[u8]>> {
    let after_name = &stat[stat.iter().rposition(|&b| b == b')')? + 1..];
    Some(after_name.split(|&b| b == b' ').filter(|f| !f.is_empty()))
}

/// `path` as a C string; a path with a NUL byte cannot name a file (EINVAL).
pub fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// An `O_PATH` descriptor of the directory `path`, refusing a symlink in its last component.
pub fn open_directory(path: &Path) -> io::Result<OwnedFd> {
    let c = c_path(path)?;
    // SAFETY: a valid NUL-terminated path; the result is checked below.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// openat2(2): opens `relative` from `dir` with open `flags` (O_CLOEXEC added) and `resolve`
/// (`libc::RESOLVE_*`) restrictions, which the kernel enforces on every component. An empty
/// path means `dir` itself. ENOSYS on kernels before 5.6.
pub fn openat2(
    dir: BorrowedFd<'_>,
    relative: &Path,
    flags: i32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let path = if relative.as_os_str().is_empty() {
        Path::new(".")
    } else {
        relative
    };
    let c = c_path(path)?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve,
    };
    // SAFETY: a valid directory fd, a NUL-terminated path and an open_how of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `-1` from a system call as the error errno holds; anything else as the value.
fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Which mount a path is on, as statx(2) tells it without asking the file system: no
/// attribute is requested, so even a FUSE mount whose daemon is stopped answers at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountOf {
    /// The mount's ID as /proc/self/mountinfo lists it; the kernel reuses it once freed.
    pub id: u64,
    /// The ID no other mount ever gets (Linux 6.8 and later; None before).
    pub unique_id: Option<u64>,
    /// The file system's device, (major, minor).
    pub dev: (u32, u32),
    /// Whether the path is the root of that mount.
    pub is_root: bool,
}

impl MountOf {
    /// Whether `other` is the same mount: by the unique ID where the kernel has one, else by
    /// ID and device together (both are reused, but not while the mount lives).
    pub fn same(&self, other: &MountOf) -> bool {
        self.dev == other.dev
            && match (self.unique_id, other.unique_id) {
                (Some(a), Some(b)) => a == b,
                _ => self.id == other.id,
            }
    }
}

/// The statx(2) answer for `mask` about `name` in `dir` (an empty name: `dir` itself), the
/// final link not followed and nothing refreshed from the file system.
fn statx(dir: BorrowedFd<'_>, name: &CStr, mask: u32) -> io::Result<libc::statx> {
    // SAFETY: statx is plain data, for which all zeroes is a valid value.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let flags = libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW | libc::AT_STATX_DONT_SYNC;
    // SAFETY: a valid descriptor, a NUL-terminated name and an out pointer we own.
    let ret = unsafe { libc::statx(dir.as_raw_fd(), name.as_ptr(), flags, mask, &mut st) };
    check(ret as libc::c_long).map(|_| st)
}

/// The mount `name` in `dir` is on (an empty name: `dir` itself). Needs Linux 5.8 (ENOSYS
/// before: the kernel does not say). The legacy ID comes with no attribute asked for: a FUSE
/// mount refuses any request from a user it does not serve (root, on a user's mount without
/// `allow_other`), and the kernel counts the unique ID as one.
pub fn mount_of(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<MountOf> {
    let legacy = statx(dir, name, 0)?;
    let says_root = legacy.stx_attributes_mask & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0;
    if legacy.stx_mask & libc::STATX_MNT_ID == 0 || !says_root {
        return Err(io::Error::from_raw_os_error(libc::ENOSYS));
    }
    let unique = statx(dir, name, libc::STATX_MNT_ID_UNIQUE).ok();
    Ok(MountOf {
        id: legacy.stx_mnt_id,
        unique_id: unique
            .filter(|u| u.stx_mask & libc::STATX_MNT_ID_UNIQUE != 0)
            .map(|u| u.stx_mnt_id),
        dev: (legacy.stx_dev_major, legacy.stx_dev_minor),
        is_root: legacy.stx_attributes & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0,
    })
}

/// openat(2) of `name` in `dir` (None: the working directory) with `flags` (O_CLOEXEC added).
pub fn openat(dir: Option<BorrowedFd<'_>>, name: &CStr, flags: i32) -> io::Result<OwnedFd> {
    let dir = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: a valid descriptor (or AT_FDCWD) and a NUL-terminated name.
    let fd = check(unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC) } as _)?;
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// syncfs(2): writes out the dirty data of the file system `fd` is on (only that one: a
/// global sync would wait on every other mount too, a hung network one included).
pub fn syncfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a valid descriptor.
    check(unsafe { libc::syncfs(fd.as_raw_fd()) } as _).map(drop)
}

/// fchdir(2): makes `dir` the working directory.
pub fn fchdir(dir: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a valid descriptor.
    check(unsafe { libc::fchdir(dir.as_raw_fd()) } as _).map(drop)
}

/// umount2(2) of `path` with `flags`.
pub fn umount2(path: &CStr, flags: i32) -> io::Result<()> {
    // SAFETY: a NUL-terminated path.
    check(unsafe { libc::umount2(path.as_ptr(), flags) } as _).map(drop)
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
pub unsafe fn fork_child(
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

/// Room for one SCM_RIGHTS control message carrying one descriptor (CMSG_SPACE(4) is 24 on
/// 64-bit Linux), aligned as cmsghdr requires.
#[repr(C, align(8))]
struct OneFdControl([u8; 32]);

/// Sends `bytes` and, with the first of them, descriptor `fd` over socket `sock`. Allocates
/// nothing (a forked child's answer).
pub fn send_answer(sock: BorrowedFd<'_>, mut bytes: &[u8], fd: Option<BorrowedFd<'_>>) {
    let mut control = OneFdControl([0; 32]);
    let mut fd = fd;
    while !bytes.is_empty() {
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        // SAFETY: msghdr is plain data, for which all zeroes is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd.take() {
            msg.msg_control = control.0.as_mut_ptr().cast();
            // SAFETY: CMSG_SPACE is arithmetic.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as usize;
            // SAFETY: the control buffer holds one cmsghdr and 4 bytes of data (see above).
            unsafe {
                let header = libc::CMSG_FIRSTHDR(&msg);
                (*header).cmsg_level = libc::SOL_SOCKET;
                (*header).cmsg_type = libc::SCM_RIGHTS;
                (*header).cmsg_len = libc::CMSG_LEN(4) as usize;
                libc::CMSG_DATA(header)
                    .cast::<RawFd>()
                    .write_unaligned(fd.as_raw_fd());
            }
        }
        // SAFETY: the message points at the buffers above, alive for the call.
        match check(unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) } as _) {
            Ok(n) => bytes = &bytes[n as usize..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// What a child sent with [`send_answer`] until it closed its end: its bytes and the
/// descriptor that came with them, or None if `deadline` passed first.
pub fn read_answer(sock: &OwnedFd, deadline: Instant) -> Option<(Vec<u8>, Option<OwnedFd>)> {
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
        let mut control = OneFdControl([0; 32]);
        let mut iov = libc::iovec {
            iov_base: chunk.as_mut_ptr().cast(),
            iov_len: chunk.len(),
        };
        // SAFETY: msghdr is plain data, for which all zeroes is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = control.0.len();
        // SAFETY: the message points at buffers we own, alive for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        match check(n as _) {
            Ok(0) => return Some((bytes, fd)),
            Ok(n) => bytes.extend_from_slice(&chunk[..n as usize]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Some((bytes, fd)),
        }
        // SAFETY: CMSG_FIRSTHDR reads the header fields recvmsg filled in.
        let header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        // SAFETY: a non-null header lies within the control buffer, as recvmsg wrote it.
        if !header.is_null() && unsafe { (*header).cmsg_type } == libc::SCM_RIGHTS {
            // SAFETY: an SCM_RIGHTS message carries a descriptor now ours (one was sent).
            let raw = unsafe { libc::CMSG_DATA(header).cast::<RawFd>().read_unaligned() };
            // SAFETY: the kernel installed it for this process; nothing else owns it.
            fd = Some(unsafe { OwnedFd::from_raw_fd(raw) });
        }
    }
}

/// Reaps child `pid`, which has exited or is about to (it closed its answer).
pub fn reap(pid: libc::pid_t) {
    // SAFETY: waiting for our own child; no status wanted.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
}

/// Waits at most `timeout` for `fd` to become readable (a pidfd: its process exited); whether
/// it did.
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut poll = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one pollfd we own.
    check(unsafe { libc::poll(&mut poll, 1, millis) } as _).map(|n| n > 0)
}

/// A descriptor of process `pid` (pidfd_open(2), Linux 5.3): it names that process even
/// after it exits and its pid goes to another.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open has no memory arguments.
    let fd = check(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Sends `signal` (0: none, only whether it still runs) to the process of `pidfd`.
pub fn pidfd_signal(pidfd: BorrowedFd<'_>, signal: i32) -> io::Result<()> {
    let no_info = std::ptr::null::<libc::siginfo_t>();
    // SAFETY: a pidfd, a signal number and no siginfo.
    check(unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            no_info,
            0,
        )
    })
    .map(drop)
}
