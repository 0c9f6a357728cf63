//! Which mount a path is on, asked of the kernel without asking the mount (statx mount IDs),
//! and what `stagefs unmount` and the daemon do at a mount held by identity: each call made
//! by name in the directory the mount is on, right after checking that the mount on top
//! there is still the one held, in a child process that is abandoned if it does not answer
//! ([`super::child`]).

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use super::child::{ChildError, XATTR_MAX, answer, in_child};
use super::{check, getxattr};

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
pub(super) fn openat(dir: Option<BorrowedFd<'_>>, name: &CStr, flags: i32) -> io::Result<OwnedFd> {
    let dir = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: a valid descriptor (or AT_FDCWD) and a NUL-terminated name.
    let fd = check(unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC) } as _)?;
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// fchdir(2): makes `dir` the working directory.
fn fchdir(dir: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a valid descriptor.
    check(unsafe { libc::fchdir(dir.as_raw_fd()) } as _).map(drop)
}

/// umount2(2) of `path` with `flags`.
fn umount2(path: &CStr, flags: i32) -> io::Result<()> {
    // SAFETY: a NUL-terminated path.
    check(unsafe { libc::umount2(path.as_ptr(), flags) } as _).map(drop)
}

/// Mounts the FUSE control file system (fusectl) at `target`, where the kernel lists FUSE
/// connections.
pub fn mount_fusectl(target: &CStr) -> io::Result<()> {
    // SAFETY: valid C strings; no mount data.
    let r = unsafe {
        libc::mount(
            c"none".as_ptr(),
            target.as_ptr(),
            c"fusectl".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    check(r as _).map(drop)
}

/// What a child does at a held mount ([`at_mount`]), after checking that the mount on top at
/// its name in the directory it is mounted on is still the one held.
#[derive(Clone, Copy)]
pub enum AtMount<'a> {
    /// Nothing more.
    Check,
    /// Opens the mount's root (O_PATH) and sends it.
    Pin,
    /// Reads attribute NAME of the mount's root.
    Getxattr(&'a CStr),
    /// umount2(2) with these flags.
    Unmount(libc::c_int),
}

/// Makes `what` at mount `held`, mounted at `name` in directory `dir`, in a child waited for
/// at most `limit`: the value read and the descriptor opened, if any.
pub fn at_mount(
    dir: BorrowedFd<'_>,
    name: &CStr,
    held: MountOf,
    what: AtMount<'_>,
    limit: Duration,
) -> Result<(Vec<u8>, Option<OwnedFd>), ChildError> {
    let mut value = match what {
        AtMount::Getxattr(_) => vec![0u8; XATTR_MAX],
        _ => Vec::new(),
    };
    let is_held = move |found: io::Result<MountOf>| match found {
        Ok(found) if found.is_root && found.same(&held) => Ok(()),
        Ok(_) => Err(ChildError::Replaced),
        Err(e) => Err(ChildError::Io(e)),
    };
    // SAFETY: the child makes only system calls (fchdir, statx, openat, getxattr, umount2,
    // sendmsg) on the names and buffers made above.
    unsafe {
        in_child(Some(dir), limit, |sock| {
            let on_top = fchdir(dir)
                .map_err(ChildError::from)
                .and_then(|()| is_held(mount_of(dir, name)));
            let (result, fd) = match (on_top, what) {
                (Err(e), _) => (Err(e), None),
                (Ok(()), AtMount::Check) => (Ok(0), None),
                (Ok(()), AtMount::Pin) => {
                    let flags = libc::O_PATH | libc::O_NOFOLLOW;
                    match openat(Some(dir), name, flags) {
                        // Opened after the check: what it opened must be the mount too.
                        Ok(fd) => match is_held(mount_of(fd.as_fd(), c"")) {
                            Ok(()) => (Ok(0), Some(fd)),
                            Err(e) => (Err(e), None),
                        },
                        Err(e) => (Err(e.into()), None),
                    }
                }
                (Ok(()), AtMount::Getxattr(attr)) => (
                    getxattr(name, attr, &mut value, false).map_err(Into::into),
                    None,
                ),
                (Ok(()), AtMount::Unmount(flags)) => {
                    let done = umount2(name, flags | libc::UMOUNT_NOFOLLOW);
                    (done.map(|()| 0).map_err(Into::into), None)
                }
            };
            answer(sock, result, &value, fd.as_ref().map(AsFd::as_fd));
        })
    }
}
