//! The few raw Linux calls stagefs makes that std does not wrap, in one place, each behind a
//! safe function: opening directories and files *beneath* a directory descriptor without
//! following links (openat2), which the scan, the stager's copies and the permission checks
//! rely on, and listing and `lstat`ing entries relative to a directory descriptor.
//!
//! Paths relative to a descriptor may be longer than PATH_MAX (a tree deeper than 4096
//! bytes of names is legal, and reachable one directory at a time): such a path is opened in
//! pieces each short enough for one call, each piece beneath the directory the one before
//! opened, so the restrictions hold on every component as for a short path.
//!
//! Also what commands need to act on a mount or a process by identity rather than by a name
//! that can change meanwhile: a path's mount (statx), processes held by pidfd, and system
//! calls made in a forked child that may be abandoned if a FUSE daemon never answers it. The
//! calls a forked child makes ([`fork_child`]) allocate nothing and take no lock, so they are
//! safe there: [`mount_of`], [`openat`], [`fchdir`], [`umount2`], [`getxattr`],
//! [`send_answer`].

use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

/// The longest path one call takes, its terminating NUL included (Linux's PATH_MAX).
const PATH_MAX: usize = libc::PATH_MAX as usize;

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
/// path means `dir` itself; a path longer than PATH_MAX is opened piece by piece (see the
/// module note). ENOSYS on kernels before 5.6.
pub fn openat2(
    dir: BorrowedFd<'_>,
    relative: &Path,
    flags: i32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let pieces = path_pieces(relative);
    let (last, through) = pieces.split_last().expect("at least one piece");
    let mut held: Option<OwnedFd> = None;
    for piece in through {
        let at = held.as_ref().map_or(dir, |fd| fd.as_fd());
        held = Some(openat2_once(
            at,
            piece,
            libc::O_PATH | libc::O_DIRECTORY,
            resolve,
        )?);
    }
    openat2_once(
        held.as_ref().map_or(dir, |fd| fd.as_fd()),
        last,
        flags,
        resolve,
    )
}

/// `relative` cut between components into pieces each shorter than PATH_MAX (one piece, maybe
/// empty, for a short path).
fn path_pieces(relative: &Path) -> Vec<PathBuf> {
    let mut pieces = vec![PathBuf::new()];
    for component in relative.components() {
        let current = pieces.last().expect("never empty").as_os_str().len();
        if current > 0 && current + 1 + component.as_os_str().len() >= PATH_MAX {
            pieces.push(PathBuf::new());
        }
        pieces.last_mut().expect("never empty").push(component);
    }
    pieces
}

fn openat2_once(
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

/// Opens `relative` beneath `dir` with `flags` through no symlink at all, the last component
/// included: openat2 with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`
/// (the kernel refuses a link, a `..` above `dir` or a magic link on the way: ELOOP, EXDEV),
/// or on kernels without openat2 one component at a time with `O_NOFOLLOW`.
pub fn open_beneath(dir: BorrowedFd<'_>, relative: &Path, flags: i32) -> io::Result<OwnedFd> {
    let resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    match openat2(dir, relative, flags | libc::O_NOFOLLOW, resolve) {
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => open_walking(dir, relative, flags),
        other => other,
    }
}

/// What [`open_beneath`] does, for kernels before 5.6: each component opened with
/// `O_NOFOLLOW` relative to the previous one, so no symlink is followed anywhere.
fn open_walking(dir: BorrowedFd<'_>, relative: &Path, flags: i32) -> io::Result<OwnedFd> {
    let mut components = relative.components().peekable();
    let mut held: Option<OwnedFd> = None;
    loop {
        let name = match components.next() {
            Some(Component::Normal(name)) => name,
            None if held.is_none() => OsStr::new("."),
            // The catalog's paths have only plain names; anything else is not beneath.
            Some(_) | None => return Err(io::Error::from_raw_os_error(libc::EXDEV)),
        };
        let last = components.peek().is_none();
        let flags = libc::O_NOFOLLOW
            | libc::O_CLOEXEC
            | if last {
                flags
            } else {
                libc::O_PATH | libc::O_DIRECTORY
            };
        let at = held.as_ref().map_or(dir, |fd| fd.as_fd());
        let c = c_path(Path::new(name))?;
        // SAFETY: valid directory fd and NUL-terminated name.
        let fd = unsafe { libc::openat(at.as_raw_fd(), c.as_ptr(), flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nothing else owns.
        let next = unsafe { OwnedFd::from_raw_fd(fd) };
        if last {
            return Ok(next);
        }
        held = Some(next);
    }
}

/// The names in directory `dir` (opened for reading), without `.` and `..`.
pub fn list_names(dir: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    // SAFETY: dup of a descriptor we borrow; fdopendir below takes the copy.
    let copy = unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if copy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `copy` is a new descriptor; on success the stream owns it.
    let stream = unsafe { libc::fdopendir(copy) };
    if stream.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `copy` is still ours to close.
        unsafe { libc::close(copy) };
        return Err(e);
    }
    // From the start, whatever an earlier listing through another copy left.
    // SAFETY: a valid stream.
    unsafe { libc::rewinddir(stream) };
    let mut names = Vec::new();
    let result = loop {
        // SAFETY: errno is thread-local; readdir reports errors only through it.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: a valid stream, used by this thread alone.
        let entry = unsafe { libc::readdir64(stream) };
        if entry.is_null() {
            break match io::Error::last_os_error() {
                e if e.raw_os_error() == Some(0) => Ok(()),
                e => Err(e),
            };
        }
        // SAFETY: readdir returned an entry whose d_name is NUL-terminated, valid until the
        // next call on this stream.
        let name = unsafe { std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()) }.to_bytes();
        if name != b"." && name != b".." {
            names.push(OsString::from_vec(name.to_vec()));
        }
    };
    // SAFETY: the stream is ours; closing it closes `copy`.
    unsafe { libc::closedir(stream) };
    result.map(|()| names)
}

/// `lstat` of `name` in directory `dir` (a symlink is described, not followed); an empty
/// name is `dir` itself.
pub fn lstat_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<libc::stat> {
    let c = c_path(Path::new(name))?;
    // SAFETY: stat is plain data, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let flags = libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH;
    // SAFETY: a valid directory fd, a NUL-terminated name and an out pointer we own.
    if unsafe { libc::fstatat(dir.as_raw_fd(), c.as_ptr(), &mut st, flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// The target of symlink `name` in directory `dir`.
pub fn readlink_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OsString> {
    let c = c_path(Path::new(name))?;
    let mut buf = vec![0u8; PATH_MAX];
    // SAFETY: a valid directory fd, a NUL-terminated name and a buffer of the length given.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(OsString::from_vec(buf))
}

/// The credentials of a Unix socket's peer as the kernel recorded them when it connected
/// (SO_PEERCRED): (pid, uid, gid). Nothing the peer does later changes them.
pub fn peer_credentials(socket: BorrowedFd<'_>) -> io::Result<(u32, u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket fd and an out buffer of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid, cred.gid))
}

/// The supplementary groups of a Unix socket's peer when it connected (SO_PEERGROUPS),
/// sorted and without duplicates.
pub fn peer_groups(socket: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    // Linux allows 65536 groups; start small and grow to what the kernel asks for.
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = (groups.len() * 4) as libc::socklen_t;
        // SAFETY: a valid socket fd and an out buffer of `len` bytes.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let needed = len as usize / 4;
        match rc {
            0 => {
                groups.truncate(needed);
                groups.sort_unstable();
                groups.dedup();
                return Ok(groups);
            }
            _ if io::Error::last_os_error().raw_os_error() == Some(libc::ERANGE)
                && needed > groups.len() =>
            {
                groups.resize(needed, 0);
            }
            _ => return Err(io::Error::last_os_error()),
        }
    }
}

/// Whether the other end of a connected socket has closed it (both directions: a client
/// that only stopped sending still waits for its answer).
pub fn hung_up(socket: BorrowedFd<'_>) -> bool {
    let mut poll = libc::pollfd {
        fd: socket.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and a zero timeout: it only reports.
    let rc = unsafe { libc::poll(&mut poll, 1, 0) };
    rc > 0 && poll.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// The uid of the user named `name` in the password database, if there is one.
pub fn uid_of_user(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: passwd is plain data, for which all zeroes is a valid value.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found = std::ptr::null_mut();
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: a valid C string, an out struct, a buffer of the stated length for its strings
    // and an out pointer; all outlive the call.
    let rc = unsafe {
        libc::getpwnam_r(
            c.as_ptr(),
            &mut entry,
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        )
    };
    (rc == 0 && !found.is_null()).then_some(entry.pw_uid)
}

/// faccessat2(2) with the caller's effective (file-system) credentials: whether `name` in
/// `dir` (`dir` itself if empty) allows `mask` (`R_OK`, `X_OK`, ...). `flags` adds to
/// `AT_EACCESS`, e.g. `AT_SYMLINK_NOFOLLOW`.
pub fn faccessat2(dir: BorrowedFd<'_>, name: &Path, mask: i32, flags: i32) -> io::Result<()> {
    let c = c_path(name)?;
    let empty = if name.as_os_str().is_empty() {
        libc::AT_EMPTY_PATH
    } else {
        0
    };
    // SAFETY: a valid directory fd and a NUL-terminated name (empty only with AT_EMPTY_PATH).
    let r = unsafe {
        libc::syscall(
            libc::SYS_faccessat2,
            dir.as_raw_fd(),
            c.as_ptr(),
            mask,
            libc::AT_EACCESS | empty | flags,
        )
    };
    match r {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
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

/// The calling thread's id (what FUSE reports as the pid of a request from it).
pub fn gettid() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u32 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// Makes `depth` nested directories of 200-byte names under `root` (far past PATH_MAX in
    /// all), one step at a time through the previous one's descriptor, with a file `f` at the
    /// bottom; returns the bottom's path relative to `root`.
    fn deep_tree(root: &Path, depth: usize) -> PathBuf {
        let name = "d".repeat(200);
        let mut relative = PathBuf::new();
        let mut dir = open_directory(root).unwrap();
        for _ in 0..depth {
            let here = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
            std::fs::create_dir(here.join(&name)).unwrap();
            dir = open_directory(&here.join(&name)).unwrap();
            relative.push(&name);
        }
        let here = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
        std::fs::write(here.join("f"), b"deep").unwrap();
        relative
    }

    #[test]
    fn paths_longer_than_path_max_open_in_pieces() {
        let tmp = tempfile::tempdir().unwrap();
        let bottom = deep_tree(tmp.path(), 45);
        assert!(bottom.as_os_str().len() > 2 * PATH_MAX);
        let root = open_directory(tmp.path()).unwrap();
        let file = open_beneath(root.as_fd(), &bottom.join("f"), libc::O_RDONLY).unwrap();
        let mut content = String::new();
        io::Read::read_to_string(&mut std::fs::File::from(file), &mut content).unwrap();
        assert_eq!(content, "deep");
        let dir = open_beneath(root.as_fd(), &bottom, libc::O_RDONLY | libc::O_DIRECTORY);
        assert_eq!(
            list_names(dir.unwrap().as_fd()).unwrap(),
            vec![OsString::from("f")]
        );
        // Every piece is beneath the one before: a link on the way is still refused.
        let mut middle = bottom.clone();
        for _ in 0..10 {
            middle.pop();
        }
        let moved = tmp.path().join("moved");
        let parent = open_beneath(root.as_fd(), middle.parent().unwrap(), libc::O_PATH).unwrap();
        let at = PathBuf::from(format!("/proc/self/fd/{}", parent.as_raw_fd()));
        let name = middle.file_name().unwrap();
        std::fs::rename(at.join(name), &moved).unwrap();
        symlink(&moved, at.join(name)).unwrap();
        let err = open_beneath(root.as_fd(), &bottom.join("f"), libc::O_RDONLY).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ELOOP), "{err}");
    }

    #[test]
    fn the_walk_without_openat2_refuses_links_too() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("real")).unwrap();
        std::fs::write(tmp.path().join("real/x"), b"x").unwrap();
        symlink("real", tmp.path().join("link")).unwrap();
        symlink("x", tmp.path().join("real/y")).unwrap();
        let root = open_directory(tmp.path()).unwrap();
        assert!(open_walking(root.as_fd(), Path::new("real/x"), libc::O_RDONLY).is_ok());
        assert!(open_walking(root.as_fd(), Path::new(""), libc::O_RDONLY).is_ok());
        for rel in ["link/x", "real/y", "../x"] {
            let err = open_walking(root.as_fd(), Path::new(rel), libc::O_RDONLY).unwrap_err();
            assert!(
                matches!(
                    err.raw_os_error(),
                    Some(libc::ELOOP | libc::ENOTDIR | libc::EXDEV)
                ),
                "{rel}: {err}"
            );
        }
    }

    #[test]
    fn entries_are_listed_and_described_relative_to_their_directory() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("a"), b"abc").unwrap();
        symlink("a", tmp.path().join("l")).unwrap();
        let dir = open_beneath(
            open_directory(tmp.path()).unwrap().as_fd(),
            Path::new(""),
            libc::O_RDONLY | libc::O_DIRECTORY,
        )
        .unwrap();
        let mut names = list_names(dir.as_fd()).unwrap();
        names.sort();
        assert_eq!(names, vec![OsString::from("a"), OsString::from("l")]);
        assert_eq!(lstat_at(dir.as_fd(), OsStr::new("a")).unwrap().st_size, 3);
        let link = lstat_at(dir.as_fd(), OsStr::new("l")).unwrap();
        assert_eq!(link.st_mode & libc::S_IFMT, libc::S_IFLNK);
        assert_eq!(readlink_at(dir.as_fd(), OsStr::new("l")).unwrap(), "a");
        let itself = lstat_at(dir.as_fd(), OsStr::new("")).unwrap();
        assert_eq!(itself.st_mode & libc::S_IFMT, libc::S_IFDIR);
    }
}
