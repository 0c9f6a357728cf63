//! The FUSE file system itself: a read-only view of a local directory whose LOOKUPs and OPENs
//! are answered only after the latency (through [`Delayer`]), and everything else at once;
//! while frozen, nothing that reads the remote is answered.
//!
//! Inode numbers come from a table keyed by the backing file's (device, inode), so a file keeps
//! its number for the life of the mount, whichever way the kernel reaches it, and the root is
//! FUSE's inode 1 whatever its backing number.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, Metadata};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};
use parking_lot::Mutex;

use super::delay::{DelayCounters, Delayer};

/// How long the kernel may keep attributes and entries: NFS's attribute cache keeps them for
/// seconds (acregmin 3 s), Lustre until its lock is revoked. One second keeps a reader's
/// repeated stat of a file free, while a file opened again a few seconds later (the next
/// epoch) costs its LOOKUP again, as on a shared file system whose other clients may change it.
const TTL: Duration = Duration::from_secs(1);

/// FUSE's root inode.
const ROOT: u64 = 1;

/// Backing paths by FUSE inode (index = inode − 1) and inodes by backing identity.
struct Inodes {
    paths: Vec<PathBuf>,
    by_backing: HashMap<(u64, u64), u64>,
}

impl Inodes {
    fn path(&self, ino: u64) -> Result<PathBuf, Errno> {
        let index = ino.checked_sub(1).ok_or(Errno::ESTALE)?;
        self.paths.get(index as usize).cloned().ok_or(Errno::ESTALE)
    }

    /// The inode of the file at `path` (whose metadata is `meta`), numbered on first sight.
    fn number(&mut self, path: PathBuf, meta: &Metadata) -> u64 {
        let next = self.paths.len() as u64 + 1;
        let ino = *self
            .by_backing
            .entry((meta.dev(), meta.ino()))
            .or_insert(next);
        if ino == next {
            self.paths.push(path);
        }
        ino
    }
}

pub(super) struct RemoteFs {
    inodes: Mutex<Inodes>,
    open_files: Mutex<HashMap<u64, Arc<File>>>,
    /// Each open directory's names, sorted, as listed at OPENDIR: an offset into them means
    /// the same entry on every READDIR of that handle, and a large directory is listed once.
    listings: Mutex<HashMap<u64, Arc<Vec<OsString>>>>,
    /// File and directory handles, from one sequence.
    next_handle: AtomicU64,
    delayer: Delayer,
    counters: Arc<DelayCounters>,
}

fn errno(e: io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

fn system_time(secs: i64, nanos: i64) -> SystemTime {
    let since_epoch = Duration::new(secs.unsigned_abs(), nanos as u32);
    if secs >= 0 {
        UNIX_EPOCH + since_epoch
    } else {
        UNIX_EPOCH - since_epoch
    }
}

fn file_attr(ino: u64, m: &Metadata) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: m.len(),
        blocks: m.blocks(),
        atime: system_time(m.atime(), m.atime_nsec()),
        mtime: system_time(m.mtime(), m.mtime_nsec()),
        ctime: system_time(m.ctime(), m.ctime_nsec()),
        crtime: system_time(m.ctime(), m.ctime_nsec()),
        kind: kind(m),
        perm: (m.mode() & 0o7777) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: m.rdev() as u32,
        blksize: m.blksize() as u32,
        flags: 0,
    }
}

fn kind(m: &Metadata) -> FileType {
    FileType::from_std(m.file_type()).unwrap_or(FileType::RegularFile)
}

/// Reads up to `size` bytes at `offset`, fewer only at the end of the file.
fn read_at(file: &File, offset: u64, size: u32) -> io::Result<Vec<u8>> {
    let mut buf = vec![0; size as usize];
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64)? {
            0 => break,
            n => filled += n,
        }
    }
    buf.truncate(filled);
    Ok(buf)
}

impl RemoteFs {
    pub fn new(
        backing: PathBuf,
        delayer: Delayer,
        counters: Arc<DelayCounters>,
    ) -> io::Result<RemoteFs> {
        let meta = fs::metadata(&backing)?;
        let mut inodes = Inodes {
            paths: Vec::new(),
            by_backing: HashMap::new(),
        };
        inodes.number(backing, &meta);
        Ok(RemoteFs {
            inodes: Mutex::new(inodes),
            open_files: Mutex::new(HashMap::new()),
            listings: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            delayer,
            counters,
        })
    }

    fn path(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        self.inodes.lock().path(ino.0)
    }

    /// The entry `name` in directory `parent`, numbered, with its attributes.
    fn entry(&self, parent: INodeNo, name: &OsStr) -> Result<FileAttr, Errno> {
        let path = self.path(parent)?.join(name);
        let meta = fs::symlink_metadata(&path).map_err(errno)?;
        let ino = self.inodes.lock().number(path, &meta);
        Ok(file_attr(ino, &meta))
    }

    fn new_handle(&self) -> u64 {
        self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    fn open_file(&self, ino: INodeNo, flags: OpenFlags) -> Result<FileHandle, Errno> {
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return Err(Errno::EROFS);
        }
        let file = File::open(self.path(ino)?).map_err(errno)?;
        let handle = self.new_handle();
        self.open_files.lock().insert(handle, Arc::new(file));
        Ok(FileHandle(handle))
    }

    /// The backing directory's file system figures.
    fn statfs_figures(&self) -> Result<libc::statvfs, Errno> {
        let root = self.path(INodeNo(ROOT))?;
        let root = File::open(root).map_err(errno)?;
        crate::sys::fstatvfs(root.as_fd()).map_err(errno)
    }

    fn open_listing(&self, dir: INodeNo) -> Result<FileHandle, Errno> {
        let mut names: Vec<OsString> = fs::read_dir(self.path(dir)?)
            .and_then(|entries| entries.map(|e| e.map(|e| e.file_name())).collect())
            .map_err(errno)?;
        names.sort();
        let handle = self.new_handle();
        self.listings.lock().insert(handle, Arc::new(names));
        Ok(FileHandle(handle))
    }
}

impl Filesystem for RemoteFs {
    /// Lookups in one directory may run in parallel, as on a network file system's client
    /// (without this flag the kernel sends them one at a time per directory).
    fn init(&mut self, _: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        Ok(())
    }

    /// A metadata-server round trip: answered after the latency, found or not.
    fn lookup(&self, _: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        let found = self.entry(parent, name);
        self.delayer.after_latency(move || match found {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        });
    }

    fn getattr(&self, _: &Request, ino: INodeNo, _: Option<FileHandle>, reply: ReplyAttr) {
        let attr = self
            .path(ino)
            .and_then(|path| fs::symlink_metadata(path).map_err(errno));
        self.delayer.now_or_held(move || match attr {
            Ok(meta) => reply.attr(&TTL, &file_attr(ino.0, &meta)),
            Err(e) => reply.error(e),
        });
    }

    fn readlink(&self, _: &Request, ino: INodeNo, reply: ReplyData) {
        let target = self
            .path(ino)
            .and_then(|path| fs::read_link(path).map_err(errno));
        self.delayer.now_or_held(move || match target {
            Ok(target) => reply.data(target.as_os_str().as_bytes()),
            Err(e) => reply.error(e),
        });
    }

    /// A metadata-server round trip: answered after the latency. No `FOPEN_KEEP_CACHE`: like
    /// NFS's close-to-open consistency, each open starts from the server's data.
    fn open(&self, _: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        self.counters.opens.fetch_add(1, Ordering::Relaxed);
        let opened = self.open_file(ino, flags);
        self.delayer.after_latency(move || match opened {
            Ok(handle) => reply.opened(handle, FopenFlags::empty()),
            Err(e) => reply.error(e),
        });
    }

    fn read(
        &self,
        _: &Request,
        _: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _: OpenFlags,
        _: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let file = self.open_files.lock().get(&fh.0).cloned();
        self.delayer
            .now_or_held(move || match file.map(|f| read_at(&f, offset, size)) {
                Some(Ok(bytes)) => reply.data(&bytes),
                Some(Err(e)) => reply.error(errno(e)),
                None => reply.error(Errno::EBADF),
            });
    }

    fn release(
        &self,
        _: &Request,
        _: INodeNo,
        fh: FileHandle,
        _: OpenFlags,
        _: Option<LockOwner>,
        _: bool,
        reply: ReplyEmpty,
    ) {
        self.open_files.lock().remove(&fh.0);
        reply.ok();
    }

    /// Nothing is buffered; ENOSYS makes the kernel stop sending flushes (fuser's default
    /// answers the same, with a warning).
    fn flush(&self, _: &Request, _: INodeNo, _: FileHandle, _: LockOwner, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS);
    }

    fn opendir(&self, _: &Request, ino: INodeNo, _: OpenFlags, reply: ReplyOpen) {
        let listing = self.open_listing(ino);
        self.delayer.now_or_held(move || match listing {
            Ok(handle) => reply.opened(handle, FopenFlags::empty()),
            Err(e) => reply.error(e),
        });
    }

    /// Lists no `.` and `..`: the kernel resolves those names without asking (only `ls -a`
    /// misses them).
    fn readdir(
        &self,
        _: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(names) = self.listings.lock().get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        // A name gone since OPENDIR is left out, as a local readdir would.
        let entries: Vec<_> = names
            .iter()
            .enumerate()
            .skip(offset as usize)
            .filter_map(|(i, name)| Some((i as u64 + 1, self.entry(ino, name).ok()?, name.clone())))
            .collect();
        self.delayer.now_or_held(move || {
            for (next, attr, name) in entries {
                if reply.add(attr.ino, next, attr.kind, name) {
                    break;
                }
            }
            reply.ok();
        });
    }

    fn releasedir(&self, _: &Request, _: INodeNo, fh: FileHandle, _: OpenFlags, reply: ReplyEmpty) {
        self.listings.lock().remove(&fh.0);
        reply.ok();
    }

    fn statfs(&self, _: &Request, _: INodeNo, reply: ReplyStatfs) {
        let figures = self.statfs_figures();
        self.delayer.now_or_held(move || match figures {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(e),
        });
    }

    /// No extended attributes; ENOSYS makes the kernel stop asking.
    fn getxattr(&self, _: &Request, _: INodeNo, _: &OsStr, _: u32, reply: ReplyXattr) {
        self.delayer.now_or_held(move || reply.error(Errno::ENOSYS));
    }

    fn listxattr(&self, _: &Request, _: INodeNo, _: u32, reply: ReplyXattr) {
        self.delayer.now_or_held(move || reply.error(Errno::ENOSYS));
    }
    /// Python's `open()` asks whether the file is a terminal; a regular file says no.
    fn ioctl(
        &self,
        _: &Request,
        _: INodeNo,
        _: FileHandle,
        _: IoctlFlags,
        _: u32,
        _: &[u8],
        _: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_keeps_its_number_and_the_root_is_one() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a");
        fs::write(&file, b"x").unwrap();
        let root_meta = fs::metadata(dir.path()).unwrap();
        let meta = fs::metadata(&file).unwrap();
        let mut inodes = Inodes {
            paths: Vec::new(),
            by_backing: HashMap::new(),
        };
        assert_eq!(inodes.number(dir.path().to_path_buf(), &root_meta), ROOT);
        let first = inodes.number(file.clone(), &meta);
        assert_eq!(inodes.number(file.clone(), &meta), first);
        assert_eq!(inodes.path(first).unwrap(), file);
        assert_eq!(inodes.path(0), Err(Errno::ESTALE));
        assert_eq!(inodes.path(first + 1), Err(Errno::ESTALE));
    }
}
