//! The FUSE face of stagefs: translates kernel requests into catalog lookups and stager opens.
//!
//! Deliberately thin. Metadata comes from the immutable [`Catalog`] (hence long TTLs and the
//! kernel page cache kept across opens), file contents from whatever file the stager hands an
//! open (a cache file, handed to the kernel for passthrough when it can, or the source file),
//! statistics and control from [`xattr`]. Every modifying operation answers EROFS: the mount is
//! read-only by contract, but is not mounted `ro` because `setfattr user.stagefs.epoch` on the
//! root is how a job tells stagefs where it restarts.

mod xattr;

pub use xattr::parse_epoch;

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use dashmap::DashMap;
use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::catalog::{Catalog, Entry, FileId, Kind};
use crate::stager::{Opened, Stager};
use crate::stats::{Counters, Snapshot};

/// The dataset does not change while mounted, so the kernel may keep attributes and entries
/// (positive and negative) for as long as it likes; a day bounds it in case it ever does.
const TTL: Duration = Duration::from_secs(24 * 3600);

/// What the FUSE layer needs from the rest of the daemon.
pub struct MountedDataset {
    pub catalog: Arc<Catalog>,
    pub stager: Stager,
    pub counters: Arc<Counters>,
    pub sampler_name: String,
    pub started: Instant,
    /// Whether cached files may be handed to the kernel (`--no-passthrough` clears it).
    pub passthrough_wanted: bool,
}

struct Handle {
    file: File,
    /// Kept until release: the kernel reads the cache file directly while it lives.
    _backing: Option<BackingId>,
}

pub struct StageFs {
    data: Arc<MountedDataset>,
    handles: Arc<DashMap<u64, Handle>>,
    next_handle: Arc<AtomicU64>,
    /// Decided at init from the kernel's capabilities, turned off for good if the kernel
    /// refuses a backing file (e.g. not privileged).
    passthrough: Arc<AtomicBool>,
}

impl StageFs {
    pub fn new(data: Arc<MountedDataset>) -> StageFs {
        StageFs {
            data,
            handles: Arc::new(DashMap::new()),
            next_handle: Arc::new(AtomicU64::new(1)),
            passthrough: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Shared flag so stats can report whether passthrough is in use.
    pub fn passthrough_flag(&self) -> Arc<AtomicBool> {
        self.passthrough.clone()
    }

    fn id(ino: INodeNo) -> FileId {
        (ino.0.saturating_sub(1)).min(u32::MAX as u64) as FileId
    }

    fn ino(id: FileId) -> INodeNo {
        INodeNo(id as u64 + 1)
    }

    fn entry(&self, ino: INodeNo) -> Result<&Entry, Errno> {
        self.data.catalog.entry(Self::id(ino)).ok_or(Errno::ENOENT)
    }

    fn attr(&self, id: FileId, e: &Entry) -> FileAttr {
        let kind = match e.kind {
            Kind::Directory => FileType::Directory,
            Kind::File => FileType::RegularFile,
            Kind::Symlink => FileType::Symlink,
        };
        let mtime = e.mtime();
        FileAttr {
            ino: Self::ino(id),
            size: e.size,
            blocks: e.size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm: e.perm,
            nlink: if e.kind == Kind::Directory { 2 } else { 1 },
            uid: e.uid,
            gid: e.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    pub fn snapshot(data: &MountedDataset, passthrough: bool) -> Snapshot {
        Snapshot::take(
            &data.counters,
            data.stager.gauges(),
            data.sampler_name.clone(),
            passthrough,
            data.started,
        )
    }
}

impl Filesystem for StageFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let kernel_can = config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH);
        // SAFETY: geteuid has no preconditions.
        let privileged = unsafe { libc::geteuid() } == 0;
        let use_it = self.data.passthrough_wanted && kernel_can && privileged;
        if use_it
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(1).is_ok()
        {
            self.passthrough.store(true, Ordering::SeqCst);
        }
        let _ = config.set_max_background(64);
        log::info!(
            "cache hits served by {}",
            if self.passthrough.load(Ordering::SeqCst) {
                "FUSE passthrough (the kernel reads cache files directly)".to_string()
            } else {
                format!(
                    "pread in the daemon (passthrough: kernel {}, privileged {}, wanted {})",
                    kernel_can, privileged, self.data.passthrough_wanted
                )
            }
        );
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let catalog = &self.data.catalog;
        match catalog.lookup(Self::id(parent), name) {
            Some(id) => reply.entry(
                &TTL,
                &self.attr(id, catalog.entry(id).expect("child")),
                Generation(0),
            ),
            // A zero-inode entry tells the kernel to cache the negative lookup for TTL.
            None if self.entry(parent).is_ok_and(|e| e.kind == Kind::Directory) => {
                let mut attr = self.attr(Self::id(parent), self.entry(parent).expect("parent"));
                attr.ino = INodeNo(0);
                reply.entry(&TTL, &attr, Generation(0))
            }
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.entry(ino) {
            Ok(e) => reply.attr(&TTL, &self.attr(Self::id(ino), e)),
            Err(err) => reply.error(err),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.data.catalog.link_target(Self::id(ino)) {
            Some(t) => reply.data(t.as_bytes()),
            None => reply.error(Errno::EINVAL),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0 {
            return reply.error(Errno::EROFS);
        }
        let id = Self::id(ino);
        match self.entry(ino) {
            Ok(e) if e.kind == Kind::File => {}
            Ok(e) if e.kind == Kind::Directory => return reply.error(Errno::EISDIR),
            Ok(_) => return reply.error(Errno::EINVAL),
            Err(err) => return reply.error(err),
        }
        let handles = self.handles.clone();
        let next = self.next_handle.clone();
        let passthrough = self.passthrough.clone();
        self.data.stager.open(
            id,
            Box::new(move |result| match result {
                Ok(Opened { file, from_cache }) => {
                    let fh = next.fetch_add(1, Ordering::Relaxed);
                    let backing = if from_cache && passthrough.load(Ordering::Relaxed) {
                        match reply.open_backing(&file) {
                            Ok(b) => Some(b),
                            Err(e) => {
                                if passthrough.swap(false, Ordering::SeqCst) {
                                    log::warn!("kernel refused a passthrough backing file ({e}); serving cache hits with pread from now on");
                                }
                                None
                            }
                        }
                    } else {
                        None
                    };
                    // The kernel refuses FOPEN_KEEP_CACHE with passthrough (EIO on read): the
                    // backing file's own page cache serves repeated reads instead.
                    match &backing {
                        Some(b) => reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), b),
                        None => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
                    }
                    handles.insert(fh, Handle { file, _backing: backing });
                }
                Err(errno) => reply.error(Errno::from_i32(errno)),
            }),
        );
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(handle) = self.handles.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        let mut buf = vec![0u8; size as usize];
        let mut filled = 0;
        while filled < buf.len() {
            match handle
                .file
                .read_at(&mut buf[filled..], offset + filled as u64)
            {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!(
                        "read of {} failed: {e}",
                        self.data.catalog.relative_path(Self::id(_ino)).display()
                    );
                    return reply.error(Errno::EIO);
                }
            }
        }
        reply.data(&buf[..filled]);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.handles.remove(&fh.0);
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.entry(ino) {
            Ok(e) if e.kind == Kind::Directory => reply.opened(
                FileHandle(0),
                FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_CACHE_DIR,
            ),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(err) => reply.error(err),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let dir = Self::id(ino);
        let Ok(e) = self.entry(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let catalog = &self.data.catalog;
        let kids = catalog.children(dir);
        // Offsets: 1 = ".", 2 = "..", 3.. = children; the offset of an entry is where to resume after it.
        let dots = [(Self::ino(dir), "."), (Self::ino(e.parent), "..")];
        for (i, (ino, name)) in dots.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, i as u64 + 1, FileType::Directory, name) {
                return reply.ok();
            }
        }
        let skip = offset.saturating_sub(2) as usize;
        for (i, id) in kids.clone().enumerate().skip(skip) {
            let kind = self.attr(id, catalog.entry(id).expect("child")).kind;
            if reply.add(Self::ino(id), i as u64 + 3, kind, catalog.name(id)) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let dir = Self::id(ino);
        let Ok(e) = self.entry(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let catalog = &self.data.catalog;
        let dots = [(dir, "."), (e.parent, "..")];
        for (i, (id, name)) in dots.iter().enumerate().skip(offset as usize) {
            let attr = self.attr(*id, catalog.entry(*id).expect("dir"));
            if reply.add(
                Self::ino(*id),
                i as u64 + 1,
                name,
                &TTL,
                &attr,
                Generation(0),
            ) {
                return reply.ok();
            }
        }
        let skip = offset.saturating_sub(2) as usize;
        for (i, id) in catalog.children(dir).enumerate().skip(skip) {
            let attr = self.attr(id, catalog.entry(id).expect("child"));
            if reply.add(
                Self::ino(id),
                i as u64 + 3,
                catalog.name(id),
                &TTL,
                &attr,
                Generation(0),
            ) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let c = std::ffi::CString::new(self.data.catalog.root_path().as_os_str().as_bytes())
            .unwrap_or_default();
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid C string and out pointer.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return reply.error(Errno::EIO);
        }
        reply.statfs(
            st.f_blocks,
            st.f_bfree,
            st.f_bavail,
            st.f_files,
            st.f_ffree,
            st.f_bsize as u32,
            255,
            st.f_frsize as u32,
        );
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        match self.entry(ino) {
            Ok(_) if mask.contains(AccessFlags::W_OK) => reply.error(Errno::EROFS),
            Ok(_) => reply.ok(),
            Err(err) => reply.error(err),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        xattr::get(self, Self::id(ino), name, size, reply);
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        xattr::list(self, Self::id(ino), size, reply);
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        xattr::set(self, Self::id(ino), name, value, reply);
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    // Everything below would modify the dataset.

    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        reply.error(Errno::EROFS);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(Errno::EROFS);
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }
}
