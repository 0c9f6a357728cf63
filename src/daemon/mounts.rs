//! The mount table, read from /proc/self/mountinfo without touching the mounts themselves,
//! and a mount held by identity so it can be acted on without trusting a path twice.
//!
//! A FUSE mount whose daemon is stopped or wedged blocks every call that reaches it (stat,
//! getxattr, even a path lookup that ends on it), so the commands that must answer about such
//! a mount find it here, identify it by mount ID and device (not by path, which a later mount
//! can take over), bound each call that has to reach it, and can abort its connection through
//! fusectl. The daemon (unmounting its own mount) and `stagefs unmount` share it.
//!
//! [`HeldMount`] is how `stagefs unmount`, run as root on a path others may change, acts only
//! on the mount it identified: the mount a path leads to is found by the kernel's mount ID
//! (statx), held by a descriptor of its root and one of the directory it is mounted on, and
//! every later call (the daemon's answer, umount2) is made on it by name in that directory,
//! right after checking that the mount on top there is still the same one, in a child process
//! that is abandoned if it does not answer. Its daemon is the process the kernel shows holding
//! its FUSE connection, owned by the mount's owner: never a process that only claims to be.

use std::ffi::{CString, OsStr};
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use crate::sys::ChildError;
use crate::sys::{self, AtMount, MountOf};

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
    /// A FUSE mount's `user_id=`: the user who mounted it, whose daemon serves it.
    pub owner: Option<u32>,
}

impl MountEntry {
    /// Parses one line, kept as bytes: a mount point's name need not be UTF-8.
    fn parse(line: &[u8]) -> Option<MountEntry> {
        let mut fields = line.split(|&b| b == b' ');
        let text = |field: &[u8]| std::str::from_utf8(field).ok().map(str::to_string);
        let id = text(fields.next()?)?.parse().ok()?;
        let device = text(fields.nth(1)?)?;
        let (major, minor) = device.split_once(':')?;
        let path = PathBuf::from(OsStr::from_bytes(&unescape(fields.nth(1)?)));
        // Optional fields end at the "-" separator; type, source and options follow it.
        let mut after = fields.skip_while(|f| *f != b"-").skip(1);
        let fstype = String::from_utf8_lossy(&unescape(after.next()?)).into_owned();
        let options = after.nth(1).map(unescape).unwrap_or_default();
        let owner = options
            .split(|&b| b == b',')
            .find_map(|o| o.strip_prefix(b"user_id="))
            .and_then(|uid| std::str::from_utf8(uid).ok()?.parse().ok());
        Some(MountEntry {
            id,
            major: major.parse().ok()?,
            minor: minor.parse().ok()?,
            fstype,
            path,
            owner,
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
fn unescape(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'\\'
            && i + 3 < s.len()
            && s[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((s[i + 1] - b'0') * 64 + (s[i + 2] - b'0') * 8 + (s[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(s[i]);
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

/// getxattr(2) of `path`'s attribute `name` (following links), made by a child process and
/// waited for at most `limit` ([`sys::getxattr_in_child`]); None if it did not answer in time.
pub fn bounded_getxattr(path: &Path, name: &str, limit: Duration) -> Option<io::Result<Vec<u8>>> {
    let invalid = || Some(Err(io::Error::from_raw_os_error(libc::EINVAL)));
    let Ok(c_path) = sys::c_path(path) else {
        return invalid();
    };
    let Ok(c_name) = CString::new(name) else {
        return invalid();
    };
    match sys::getxattr_in_child(&c_path, &c_name, limit) {
        Ok(value) => Some(Ok(value)),
        Err(ChildError::NoAnswer(_)) => None,
        Err(ChildError::Io(e)) => Some(Err(e)),
        Err(ChildError::Replaced) => unreachable!("only a held mount's calls answer that"),
    }
}

/// Why [`HeldMount::find`] found no mount to hold.
#[derive(Debug, thiserror::Error)]
pub enum FindError {
    #[error("is not a mount point")]
    NotAMountPoint,
    #[error(
        "did not answer within {0:?} (a path through a FUSE mount whose daemon is stopped?): give the mount point itself"
    )]
    NoAnswer(Duration),
    #[error(
        "is mounted at {0}, which cannot be reached from there now (a directory above it was moved or replaced): try again"
    )]
    Unreachable(PathBuf),
    #[error("cannot tell which mount it is: {0}")]
    Io(io::Error),
}

/// A mount found from a path and held by identity (see the module's note).
pub struct HeldMount {
    /// Its line in the mount table, found by its ID.
    pub entry: MountEntry,
    of: MountOf,
    /// The directory it is mounted on, and its name there.
    dir: OwnedFd,
    name: CString,
    /// Its root, while held: the mount, and so its ID and device number, cannot pass to
    /// another mount meanwhile (a plain unmount finds it busy, so it is let go before one).
    root: Option<OwnedFd>,
}

impl HeldMount {
    /// Holds the mount `path` leads to (links followed, as for every command), which `path`
    /// must be the root of. Each lookup of a path is made in a child waited for at most
    /// `limit`: a path through a mount whose daemon is stopped must not hang this process.
    pub fn find(path: &Path, limit: Duration) -> Result<HeldMount, FindError> {
        let root = open_in_child(path, libc::O_PATH, limit)?;
        let of = sys::mount_of(root.as_fd(), c"").map_err(FindError::Io)?;
        if !of.is_root {
            return Err(FindError::NotAMountPoint);
        }
        let entry = (table().into_iter())
            .find(|m| m.id == of.id && (m.major, m.minor) == of.dev)
            .ok_or(FindError::NotAMountPoint)?;
        let (Some(parent), Some(name)) = (entry.path.parent(), entry.path.file_name()) else {
            return Err(FindError::NotAMountPoint); // the root of everything
        };
        let dir = open_in_child(parent, libc::O_PATH | libc::O_DIRECTORY, limit)?;
        let held = HeldMount {
            name: CString::new(name.as_bytes()).map_err(|_| FindError::NotAMountPoint)?,
            entry,
            of,
            dir,
            root: Some(root),
        };
        match held.at(AtMount::Check, limit) {
            Ok(_) => Ok(held),
            Err(ChildError::NoAnswer(limit)) => Err(FindError::NoAnswer(limit)),
            Err(ChildError::Replaced) => Err(FindError::Unreachable(held.entry.path)),
            Err(ChildError::Io(e)) => Err(FindError::Io(e)),
        }
    }

    /// Makes `what` at the mount in a child waited for at most `limit` ([`sys::at_mount`]).
    fn at(
        &self,
        what: AtMount<'_>,
        limit: Duration,
    ) -> Result<(Vec<u8>, Option<OwnedFd>), ChildError> {
        sys::at_mount(self.dir.as_fd(), &self.name, self.of, what, limit)
    }

    /// Attribute `name` of the mount's root, as its daemon answers it.
    pub fn getxattr(&self, name: &str, limit: Duration) -> Result<Vec<u8>, ChildError> {
        let name = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        self.at(AtMount::Getxattr(&name), limit)
            .map(|(value, _)| value)
    }

    /// umount2(2) of this mount with `flags`, only while it is the mount on top where it was.
    pub fn unmount(&self, flags: libc::c_int, limit: Duration) -> Result<(), ChildError> {
        self.at(AtMount::Unmount(flags), limit).map(drop)
    }

    /// Holds the mount's root again (see [`HeldMount::root`]).
    pub fn pin(&mut self, limit: Duration) -> Result<(), ChildError> {
        if self.root.is_none() {
            let (_, fd) = self.at(AtMount::Pin, limit)?;
            self.root = Some(fd.ok_or(io::Error::from_raw_os_error(libc::EIO))?);
        }
        Ok(())
    }

    /// Lets the mount's root go, so a plain unmount does not find the mount busy and, once
    /// unmounted, its file system can end.
    pub fn unpin(&mut self) {
        self.root = None;
    }

    /// Aborts the mount's FUSE connection ([`abort_connection`]), holding its root first so
    /// the connection number is surely still its own.
    pub fn abort_connection(&mut self, limit: Duration) -> Result<(), AbortError> {
        self.pin(limit).map_err(AbortError::Held)?;
        abort_connection(&self.entry)
    }

    /// The processes serving this mount's FUSE connection, as the kernel shows them: each
    /// holds a /dev/fuse descriptor whose fdinfo names the connection (Linux 6.16 and
    /// later: none before), and is owned by the mount's owner. Nothing a process can claim
    /// (its name, arguments, environment, or an attribute the mount answers) counts.
    /// Asked while the root is held, so the connection number is surely this mount's.
    pub fn servers(&self) -> Vec<Server> {
        let Some(owner) = self.entry.owner else {
            return Vec::new();
        };
        // fdinfo prints the kernel's dev_t: the major number above 20 bits of minor.
        let connection = (u64::from(self.entry.major) << 20) | u64::from(self.entry.minor);
        let line = format!("fuse_connection:\t{connection}");
        fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter_map(|pid| Server::verified(pid, owner, |dir| holds(dir, &line)))
            .collect()
    }
}

/// Opens `path` (links followed) with `flags` in a child waited for at most `limit`.
fn open_in_child(path: &Path, flags: libc::c_int, limit: Duration) -> Result<OwnedFd, FindError> {
    let c_path = sys::c_path(path).map_err(FindError::Io)?;
    match sys::open_in_child(&c_path, flags, limit) {
        Ok(fd) => Ok(fd),
        Err(ChildError::NoAnswer(limit)) => Err(FindError::NoAnswer(limit)),
        Err(ChildError::Io(e))
            if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) =>
        {
            Err(FindError::NotAMountPoint)
        }
        Err(ChildError::Io(e)) => Err(FindError::Io(e)),
        Err(ChildError::Replaced) => unreachable!("only a held mount's calls answer that"),
    }
}

/// Whether the process whose /proc directory is `proc_dir` holds a descriptor whose fdinfo
/// has `line`. fdinfo is the kernel's own account; reading it never waits on the process.
fn holds(proc_dir: &Path, line: &str) -> bool {
    let Ok(fds) = fs::read_dir(proc_dir.join("fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        let info = fs::read_to_string(proc_dir.join("fdinfo").join(fd.file_name()));
        info.is_ok_and(|info| info.lines().any(|l| l == line))
    })
}

/// A process held by a pidfd, so neither a signal nor a wait can reach another process that
/// got its pid after it exited.
pub struct Server {
    pub pid: i32,
    pidfd: OwnedFd,
}

impl Server {
    /// Process `pid` if it is owned by `owner` (real and effective uid) and `serves` its /proc
    /// directory; checked after its pidfd is taken and confirmed alive after, so what was
    /// checked is the process held.
    fn verified(pid: i32, owner: u32, serves: impl Fn(&Path) -> bool) -> Option<Server> {
        let pidfd = sys::pidfd_open(pid).ok()?;
        let dir = PathBuf::from(format!("/proc/{pid}"));
        let status = fs::read_to_string(dir.join("status")).ok()?;
        let uids = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
        let mut uids = uids.split_whitespace().map(str::parse::<u32>);
        let owned = uids.next()?.ok()? == owner && uids.next()?.ok()? == owner;
        (owned && serves(&dir) && sys::pidfd_signal(pidfd.as_fd(), 0).is_ok())
            .then_some(Server { pid, pidfd })
    }

    /// Process `pid`, which a mount owned by `owner` says serves it, if `owner` owns it: only
    /// to wait for, on kernels that do not show who serves a connection (see
    /// [`HeldMount::servers`]), never to signal.
    pub fn claimed(pid: i32, owner: Option<u32>) -> Option<Server> {
        Server::verified(pid, owner?, |_| true)
    }

    /// Whether it is stopped (state T: SIGSTOP, Ctrl-Z).
    pub fn stopped(&self) -> bool {
        let stat = fs::read(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        let state = sys::proc_stat_fields(&stat).and_then(|mut f| f.next());
        state == Some(b"T") && sys::pidfd_signal(self.pidfd.as_fd(), 0).is_ok()
    }

    /// Continues it (SIGCONT).
    pub fn resume(&self) -> io::Result<()> {
        sys::pidfd_signal(self.pidfd.as_fd(), libc::SIGCONT)
    }

    /// Waits until `deadline` for it to exit; whether it did. A zombie has exited: a reaper
    /// that does not reap (a container's init) must not make the caller wait.
    pub fn exited_by(&self, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        sys::poll_readable(self.pidfd.as_fd(), left).unwrap_or(false)
    }
}

/// Where the kernel lists FUSE connections (the fusectl file system).
const FUSECTL: &str = "/sys/fs/fuse/connections";

/// Why the fusectl abort failed.
#[derive(Debug, thiserror::Error)]
pub enum AbortError {
    #[error("cannot mount fusectl at {FUSECTL}: {0}")]
    MountFusectl(std::io::Error),
    #[error("cannot hold the mount: {0}")]
    Held(ChildError),
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
        sys::mount_fusectl(c"/sys/fs/fuse/connections").map_err(AbortError::MountFusectl)?;
    }
    let abort = format!("{FUSECTL}/{}/abort", mount.minor);
    fs::write(&abort, b"1").map_err(|source| AbortError::Write {
        path: abort,
        source,
    })
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
            b"812 30 0:97 / /tmp/a\\040b rw,nosuid,nodev,relatime shared:5 master:1 - fuse.stagefs /src rw,user_id=0,group_id=0",
        )
        .unwrap();
        assert_eq!((m.id, m.major, m.minor), (812, 0, 97));
        assert_eq!(m.path, std::path::Path::new("/tmp/a b"));
        assert_eq!((m.fstype.as_str(), m.owner), ("fuse.stagefs", Some(0)));
        assert_eq!(MountEntry::parse(b"junk"), None);
        // A mount point whose name is not UTF-8 is kept as it is (read as text, the whole
        // table came out empty).
        let m = MountEntry::parse(b"9 1 0:5 / /tmp/\xff rw - tmpfs none rw").unwrap();
        assert_eq!(m.path.as_os_str().as_encoded_bytes(), b"/tmp/\xff");
        assert_eq!((m.fstype.as_str(), m.owner), ("tmpfs", None));
    }
}
