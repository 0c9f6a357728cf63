//! The few raw Linux calls stagefs makes that std does not wrap, in one place, each behind a
//! safe function: opening directories and files *beneath* a directory descriptor without
//! following links (openat2), which both the stager's copies and the permission checks rely on.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

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

/// `path` as a C string; a path with a NUL byte cannot name a file (EINVAL).
/// The fields of a `/proc/PID/stat` line after the command name (state first), which is in
/// parentheses and may itself hold spaces and parentheses.
pub fn proc_stat_fields(stat: &[u8]) -> Option<impl Iterator<Item = &[u8]>> {
    let after_name = &stat[stat.iter().rposition(|&b| b == b')')? + 1..];
    Some(after_name.split(|&b| b == b' ').filter(|f| !f.is_empty()))
}

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
