//! Opening directories and files *beneath* a directory descriptor without following links
//! (openat2), which the scan, the stager's copies and the permission checks rely on, and
//! listing, `lstat`ing and checking access to entries relative to a directory descriptor.
//!
//! Paths relative to a descriptor may be longer than PATH_MAX (a tree deeper than 4096
//! bytes of names is legal, and reachable one directory at a time): such a path is opened in
//! pieces each short enough for one call, each piece beneath the directory the one before
//! opened, so the restrictions hold on every component as for a short path.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};

use super::{PATH_MAX, c_path};

/// `struct open_how` of openat2(2) (libc's is non-exhaustive, so it cannot be built here).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
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

/// Reads the entries of directory `dir` (opened for reading), `.` and `..` left out: `each`
/// gets every name with its `d_type` (`DT_UNKNOWN` where the file system does not say), in the
/// order the file system gives them. Straight from getdents64: `readdir` would `fstat` the
/// directory first (fdopendir does), one request more per directory on a network file system.
pub fn read_entries(dir: BorrowedFd<'_>, mut each: impl FnMut(OsString, u8)) -> io::Result<()> {
    // From the start, whatever an earlier listing through this descriptor left.
    // SAFETY: lseek on a valid descriptor.
    if unsafe { libc::lseek(dir.as_raw_fd(), 0, libc::SEEK_SET) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; DIRENT_BUFFER];
    loop {
        // SAFETY: a valid descriptor and a buffer of the length passed, which the kernel fills
        // with whole `linux_dirent64` records.
        let n = unsafe {
            libc::syscall(
                libc::SYS_getdents64,
                dir.as_raw_fd(),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        match n {
            0 => return Ok(()),
            n if n < 0 => match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::Interrupted => continue,
                e => return Err(e),
            },
            n => parse_dirents(&buf[..n as usize], &mut each)?,
        }
    }
}

/// Bytes asked of getdents64 at a time: a few hundred entries per call.
const DIRENT_BUFFER: usize = 32 * 1024;

/// The `linux_dirent64` records in `records` (d_ino u64, d_off i64, d_reclen u16, d_type u8,
/// then the NUL-terminated name), each but `.` and `..` given to `each`.
fn parse_dirents(mut records: &[u8], each: &mut impl FnMut(OsString, u8)) -> io::Result<()> {
    const NAME_AT: usize = 19;
    let malformed = || io::Error::from_raw_os_error(libc::EIO);
    while !records.is_empty() {
        let len = records
            .get(16..18)
            .map(|b| u16::from_ne_bytes([b[0], b[1]]) as usize)
            .filter(|&len| len > NAME_AT && len <= records.len())
            .ok_or_else(malformed)?;
        let (record, rest) = records.split_at(len);
        let name = &record[NAME_AT..];
        let name = &name[..name.iter().position(|&b| b == 0).ok_or_else(malformed)?];
        if name != b"." && name != b".." {
            each(OsString::from_vec(name.to_vec()), record[18]);
        }
        records = rest;
    }
    Ok(())
}

/// `lstat` of `relative` beneath `dir`, reached as [`open_beneath`] reaches it: through no
/// symlink, not above `dir` (ELOOP, EXDEV); a link in the last component is described, not
/// followed.
pub fn lstat_beneath(dir: BorrowedFd<'_>, relative: &Path) -> io::Result<libc::stat> {
    let node = open_beneath(dir, relative, libc::O_PATH)?;
    lstat_at(node.as_fd(), OsStr::new(""))
}

/// The target of the symlink at `relative` beneath `dir`, reached as [`lstat_beneath`] does.
pub fn readlink_beneath(dir: BorrowedFd<'_>, relative: &Path) -> io::Result<OsString> {
    let link = open_beneath(dir, relative, libc::O_PATH)?;
    readlink_at(link.as_fd(), OsStr::new(""))
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

/// The target of symlink `name` in directory `dir` (an empty name: the link `dir` itself, opened
/// with `O_PATH`).
fn readlink_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OsString> {
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

    fn names(dir: BorrowedFd<'_>) -> Vec<OsString> {
        let mut names = Vec::new();
        read_entries(dir, |name, _| names.push(name)).unwrap();
        names
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
        assert_eq!(names(dir.unwrap().as_fd()), vec![OsString::from("f")]);
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

    /// A directory larger than one getdents64 buffer is read whole, each entry once; records
    /// that do not parse are an error, never a panic or an endless loop.
    #[test]
    fn a_large_directory_is_listed_whole_and_bad_records_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let count = 3000;
        for i in 0..count {
            std::fs::write(tmp.path().join(format!("{i:0>60}")), b"").unwrap();
        }
        let dir = open_beneath(
            open_directory(tmp.path()).unwrap().as_fd(),
            Path::new(""),
            libc::O_RDONLY | libc::O_DIRECTORY,
        )
        .unwrap();
        let mut listed = names(dir.as_fd());
        listed.sort();
        listed.dedup();
        assert_eq!(listed.len(), count);
        assert!(count * 80 > DIRENT_BUFFER, "more than one buffer");
        assert_eq!(
            names(dir.as_fd()).len(),
            count,
            "listed again from the start"
        );
        let mut record = vec![0u8; 24];
        record[16..18].copy_from_slice(&24u16.to_ne_bytes());
        record[19..22].copy_from_slice(b"abc");
        let mut got = Vec::new();
        parse_dirents(&record, &mut |n, _| got.push(n)).unwrap();
        assert_eq!(got, vec![OsString::from("abc")]);
        for bad in [&record[..10], &record[..20]] {
            assert!(parse_dirents(bad, &mut |_, _| ()).is_err());
        }
        record[19..24].copy_from_slice(b"abcde");
        assert!(parse_dirents(&record, &mut |_, _| ()).is_err(), "no NUL");
        record[16..18].copy_from_slice(&0u16.to_ne_bytes());
        assert!(
            parse_dirents(&record, &mut |_, _| ()).is_err(),
            "zero length"
        );
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
        let mut entries = Vec::new();
        read_entries(dir.as_fd(), |name, kind| entries.push((name, kind))).unwrap();
        entries.sort();
        assert_eq!(
            entries,
            vec![
                (OsString::from("a"), libc::DT_REG),
                (OsString::from("l"), libc::DT_LNK)
            ]
        );
        assert_eq!(lstat_at(dir.as_fd(), OsStr::new("a")).unwrap().st_size, 3);
        let root = open_directory(tmp.path()).unwrap();
        let link = lstat_beneath(root.as_fd(), Path::new("l")).unwrap();
        assert_eq!(link.st_mode & libc::S_IFMT, libc::S_IFLNK);
        assert_eq!(readlink_beneath(root.as_fd(), Path::new("l")).unwrap(), "a");
        let itself = lstat_at(dir.as_fd(), OsStr::new("")).unwrap();
        assert_eq!(itself.st_mode & libc::S_IFMT, libc::S_IFDIR);
    }
}
