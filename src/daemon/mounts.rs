//! The mount table, read from /proc/self/mountinfo without touching the mounts themselves.
//!
//! A FUSE mount whose daemon is stopped or wedged blocks every call that reaches it (stat,
//! getxattr, even a path lookup that ends on it), so the commands that must answer about such
//! a mount find it here, identify it by mount ID and device (not by path, which a later mount
//! can take over), bound each call that has to reach it, and can abort its connection through
//! fusectl. The daemon (unmounting its own mount) and `stagefs unmount` share it.

use std::ffi::{CString, OsString};
use std::fs;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// One line of /proc/self/mountinfo: what identifies a mount and where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Unique while the mount exists; a new mount at the same path gets another.
    pub id: u64,
    /// The superblock's device; for FUSE its minor number names the fusectl connection.
    pub major: u32,
    pub minor: u32,
    pub fstype: String,
    pub path: PathBuf,
}

impl MountEntry {
    /// One line, as bytes: a mount point is any path, UTF-8 or not (anyone may mount a FUSE
    /// file system at a name of their choosing in a directory of theirs).
    fn parse(line: &[u8]) -> Option<MountEntry> {
        let mut fields = line.split(|&b| b == b' ');
        let text = |field: &[u8]| std::str::from_utf8(field).ok().map(str::to_owned);
        let id = text(fields.next()?)?.parse().ok()?;
        let device = text(fields.nth(1)?)?;
        let (major, minor) = device.split_once(':')?;
        let path = PathBuf::from(OsString::from_vec(unescape(fields.nth(1)?)));
        // Optional fields end at the "-" separator; the file system type follows it.
        let fstype =
            String::from_utf8_lossy(fields.skip_while(|f| *f != b"-").nth(1)?).into_owned();
        Some(MountEntry {
            id,
            major: major.parse().ok()?,
            minor: minor.parse().ok()?,
            fstype,
            path,
        })
    }
}

/// Every mount of this namespace, in mount order (a mount stacked on another comes later).
pub fn table() -> Vec<MountEntry> {
    fs::read("/proc/self/mountinfo")
        .unwrap_or_default()
        .split(|&b| b == b'\n')
        .filter_map(MountEntry::parse)
        .collect()
}

/// The mounts at `path` (resolved with [`resolve`]), the one on top last.
pub fn at(path: &Path) -> Vec<MountEntry> {
    let path = resolve(path);
    table().into_iter().filter(|m| m.path == path).collect()
}

/// True if `path` is itself a mount point (bind mounts included).
pub fn is_mount_point(path: &Path) -> bool {
    !at(path).is_empty()
}

impl MountEntry {
    /// Whether `other` is this same mount. IDs and anonymous device numbers are both reused
    /// as soon as they are freed, so both are compared; a file system that is still alive
    /// (a FUSE daemon whose session runs) keeps its device number to itself.
    pub fn same(&self, other: &MountEntry) -> bool {
        (self.id, self.major, self.minor) == (other.id, other.major, other.minor)
    }
}

/// Whether `mount` is still the one on top at `path`: only then may it be unmounted by path.
pub fn on_top(path: &Path, mount: &MountEntry) -> bool {
    at(path).last().is_some_and(|m| m.same(mount))
}

/// Whether `mount` is still in the table.
pub fn exists(mount: &MountEntry) -> bool {
    table().iter().any(|m| m.same(mount))
}

/// Absolute, symlink-resolved form of `path` that never asks anything of the last component's
/// file system: its parent is resolved and the name appended, so a wedged mount there is not
/// entered. A symbolic link there is followed by its text (readlink stops before a mount's
/// root answers anything).
pub fn resolve(path: &Path) -> PathBuf {
    resolve_links(path, MAX_LINKS)
}

/// As many links as the kernel follows in one path (ELOOP beyond).
const MAX_LINKS: u32 = 40;

fn resolve_links(path: &Path, hops: u32) -> PathBuf {
    let Ok(abs) = std::path::absolute(path) else {
        return path.to_path_buf();
    };
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => {
            let resolved = fs::canonicalize(parent)
                .map(|p| p.join(name))
                .unwrap_or(abs);
            match fs::read_link(&resolved) {
                Ok(target) if hops > 0 => {
                    let dir = resolved.parent().unwrap_or(Path::new("/"));
                    resolve_links(&dir.join(target), hops - 1)
                }
                _ => resolved,
            }
        }
        // "/" or a path ending in "..": nothing that can be a stuck FUSE root by itself.
        _ => fs::canonicalize(&abs).unwrap_or(abs),
    }
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// Runs `f` (a call that may block on a FUSE mount) on its own thread and waits at most
/// `limit` for it. None means it did not return in time: the thread stays blocked in the
/// kernel, so the caller should exit soon (a FUSE wait ends when the process is killed).
pub fn bounded<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("bounded-call".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .ok()?;
    rx.recv_timeout(limit).ok()
}

/// The largest attribute value [`bounded_getxattr`] reads (statistics are a few KiB).
const XATTR_MAX: usize = 64 * 1024;

/// getxattr(2) of `path`'s attribute `name`, made by a child process and waited for at most
/// `limit`; None if it did not answer in time. A process, not a thread: a daemon stopped just
/// after it read the request (SIGSTOP arrives asynchronously) leaves the call in an
/// uninterruptible wait that no signal ends, and a thread in it would keep this whole process
/// from exiting. The child is left behind, blocked until the daemon resumes or its connection
/// is aborted (`stagefs unmount`).
pub fn bounded_getxattr(path: &Path, name: &str, limit: Duration) -> Option<io::Result<Vec<u8>>> {
    let invalid = || Some(Err(io::Error::from_raw_os_error(libc::EINVAL)));
    let Ok(c_path) = crate::sys::c_path(path) else {
        return invalid();
    };
    let Ok(c_name) = CString::new(name) else {
        return invalid();
    };
    // Everything the child touches is made before the fork: after it, only system calls.
    let mut value = vec![0u8; XATTR_MAX];
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Some(Err(io::Error::last_os_error()));
    }
    // SAFETY: from here on the child only makes async-signal-safe calls on memory prepared
    // above (getxattr, write, _exit), so forking a multi-threaded process is sound.
    let child = unsafe { libc::fork() };
    if child == 0 {
        // SAFETY: system calls only (close_range, getxattr, write, _exit), on the C strings
        // and buffers made before the fork.
        unsafe {
            // Nothing inherited stays open but the answer's pipe: a child left blocked must not
            // hold the caller's stdout or stderr (a `stagefs stats | ...` pipeline would not end).
            let keep = fds[1] as libc::c_uint;
            if keep > 0 {
                libc::syscall(libc::SYS_close_range, 0 as libc::c_uint, keep - 1, 0);
            }
            libc::syscall(libc::SYS_close_range, keep + 1, libc::c_uint::MAX, 0);
            let len = libc::getxattr(
                c_path.as_ptr(),
                c_name.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            );
            let errno = if len < 0 {
                *libc::__errno_location()
            } else {
                0
            };
            let header = [len as i64, errno as i64];
            write_all_raw(
                fds[1],
                header.as_ptr().cast(),
                std::mem::size_of_val(&header),
            );
            if len > 0 {
                write_all_raw(fds[1], value.as_ptr(), len as usize);
            }
            libc::_exit(0);
        }
    }
    // SAFETY: both descriptors are ours; the parent only reads.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(write_end);
    if child < 0 {
        return Some(Err(io::Error::last_os_error()));
    }
    let mut answer = read_until(read_end, Instant::now() + limit)?;
    // It has written everything, so it is exiting: reap it.
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
    if answer.len() < 16 {
        return Some(Err(io::Error::from_raw_os_error(libc::EIO)));
    }
    let len = i64::from_ne_bytes(answer[..8].try_into().expect("8 bytes"));
    let errno = i64::from_ne_bytes(answer[8..16].try_into().expect("8 bytes"));
    if len < 0 {
        return Some(Err(io::Error::from_raw_os_error(errno as i32)));
    }
    Some(Ok(answer.split_off(16)))
}

/// Writes `len` bytes at `buf` to `fd`, using system calls only (for a forked child).
///
/// # Safety
/// `buf` must be valid for `len` bytes.
unsafe fn write_all_raw(fd: i32, mut buf: *const u8, mut len: usize) {
    while len > 0 {
        // SAFETY: the caller vouches for the buffer.
        let n = unsafe { libc::write(fd, buf.cast(), len) };
        if n <= 0 {
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        // SAFETY: n <= len bytes were written from the buffer.
        buf = unsafe { buf.add(n as usize) };
        len -= n as usize;
    }
}

/// Everything written to `pipe` until its writer closes it, or None at `deadline`.
fn read_until(pipe: OwnedFd, deadline: Instant) -> Option<Vec<u8>> {
    let mut file = fs::File::from(pipe);
    let mut answer = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut poll = libc::pollfd {
            fd: file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one pollfd we own.
        let ready = unsafe { libc::poll(&mut poll, 1, millis) };
        if ready == 0 {
            return None;
        }
        if ready < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return None;
        }
        match file.read(&mut chunk) {
            Ok(0) => return Some(answer),
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Some(answer),
        }
    }
}

/// Where the kernel lists FUSE connections (the fusectl file system).
const FUSECTL: &str = "/sys/fs/fuse/connections";

/// Why the fusectl abort failed.
#[derive(Debug, thiserror::Error)]
pub enum AbortError {
    #[error("cannot mount fusectl at {FUSECTL}: {0}")]
    MountFusectl(std::io::Error),
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

/// Aborts the FUSE connection of `mount`: every request waiting on its daemon fails with
/// ENOTCONN at once and the daemon's device is closed, so the mount can be removed. Mounts
/// fusectl first if nobody has.
pub fn abort_connection(mount: &MountEntry) -> Result<(), AbortError> {
    if !table().iter().any(|m| m.fstype == "fusectl") {
        let (src, target, fstype) = (c"none", c"/sys/fs/fuse/connections", c"fusectl");
        // SAFETY: valid C strings; no mount data.
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(AbortError::MountFusectl(std::io::Error::last_os_error()));
        }
    }
    let abort = format!("{FUSECTL}/{}/abort", mount.minor);
    fs::write(&abort, b"1").map_err(|source| AbortError::Write {
        path: abort,
        source,
    })
}

/// Calls umount2(2) on `path`.
pub fn umount(path: &Path, flags: libc::c_int) -> std::io::Result<()> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: valid C string.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// FUSE's setuid unmount helper: what may unmount a FUSE mount without root.
pub const FUSERMOUNT: &str = "fusermount3";

/// Why an unmount helper did not unmount.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    #[error("{0} not found")]
    NotFound(String),
    /// Its stderr (or why it could not run), on one line.
    #[error("{0}")]
    Failed(String),
}

/// Runs an unmount helper found in PATH (`umount`, [`FUSERMOUNT`]) with `flags` on `path`.
pub fn run_helper(tool: &str, flags: &[&str], path: &Path) -> Result<(), HelperError> {
    let exe = which::which(tool).map_err(|_| HelperError::NotFound(tool.to_string()))?;
    match Command::new(exe).args(flags).arg(path).output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => {
            let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
            Err(HelperError::Failed(stderr))
        }
        Err(e) => Err(HelperError::Failed(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::{MountEntry, resolve};

    #[test]
    fn a_link_as_the_last_component_resolves_to_its_target() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink("m", tmp.path().join("link")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("link"), tmp.path().join("link2")).unwrap();
        let real = std::fs::canonicalize(&dir).unwrap();
        assert_eq!(resolve(&tmp.path().join("link")), real);
        assert_eq!(resolve(&tmp.path().join("link2")), real);
        std::os::unix::fs::symlink("loop", tmp.path().join("loop")).unwrap();
        let looping = resolve(&tmp.path().join("loop"));
        assert!(looping.ends_with("loop"), "ends: {}", looping.display());
    }

    #[test]
    fn parses_mountinfo_lines() {
        let m = MountEntry::parse(
            b"812 30 0:97 / /tmp/a\\040b rw,nosuid,nodev,relatime shared:5 master:1 - fuse.stagefs /src rw,user_id=0",
        )
        .unwrap();
        assert_eq!((m.id, m.major, m.minor), (812, 0, 97));
        assert_eq!(m.path, std::path::Path::new("/tmp/a b"));
        assert_eq!(m.fstype, "fuse.stagefs");
        assert_eq!(MountEntry::parse(b"junk"), None);
    }

    /// Found when another user's mount at a Latin-1 name made the whole table unreadable as
    /// UTF-8: every mount then failed with "the mount is not in /proc/self/mountinfo".
    #[test]
    fn a_mount_point_that_is_not_utf8_hides_no_other_mount() {
        use std::os::unix::ffi::OsStrExt;
        let m =
            MountEntry::parse(b"46 27 0:41 / /tmp/caf\xe9 rw,relatime - tmpfs none rw").unwrap();
        assert_eq!(m.path.as_os_str().as_bytes(), b"/tmp/caf\xe9");
        let table = super::table();
        assert!(
            table.iter().any(|m| m.path == std::path::Path::new("/")),
            "{table:?}"
        );
    }
}
