//! A measurement for the hit path, not part of stagefs: what an open of a local file costs
//! through FUSE when the daemon does nothing but answer, with one OPEN round trip
//! (`passthrough`, the floor of stagefs's hit path) or with none at all (`no-open`).
//!
//! `no-open` answers the first OPEN with ENOSYS, after which the kernel sends no OPEN and no
//! RELEASE for the rest of the mount and keeps every file's page cache across opens; reads of
//! pages not cached come as READ requests by inode. That is the only way to a zero-round-trip
//! open on this kernel, and it is why stagefs does not take it: the daemon would no longer see
//! opens, so it could neither follow the reader nor check each caller on SOURCE.
//!
//! `tests/bench/open_bench.py --probe target/release/examples/open_cost` mounts both next to
//! stagefs and reports all of them in one run. Run as root (passthrough needs it):
//! `open_cost DIR MOUNTPOINT passthrough|no-open`, until SIGINT, SIGTERM or SIGHUP; it prints the
//! requests it received, by kind, when it ends.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{self, File, Metadata};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    BackingId, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr,
    ReplyData, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen, Request, SessionACL,
};
use parking_lot::Mutex;

/// The files do not change while measured: the kernel may cache entries and attributes.
const TTL: Duration = Duration::from_secs(3600);

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Passthrough,
    NoOpen,
}

/// Requests received, by kind: what each open cost.
#[derive(Default)]
struct Counts {
    lookup: AtomicU64,
    getattr: AtomicU64,
    open: AtomicU64,
    read: AtomicU64,
    release: AtomicU64,
    ioctl: AtomicU64,
}

/// A file's path and, once opened, the file and its passthrough registration: one each for
/// every open, as stagefs keeps its cached copies.
struct Node {
    path: PathBuf,
    file: Option<Arc<File>>,
    backing: Option<Arc<BackingId>>,
}

struct Probe {
    mode: Mode,
    nodes: Mutex<Vec<Node>>,
    numbers: Mutex<HashMap<PathBuf, u64>>,
    counts: Arc<Counts>,
}

fn errno(e: std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

fn attr(ino: u64, m: &Metadata) -> FileAttr {
    let time = |s: i64| UNIX_EPOCH + Duration::from_secs(s.max(0) as u64);
    let ft = m.file_type();
    FileAttr {
        ino: INodeNo(ino),
        size: m.size(),
        blocks: m.blocks(),
        atime: time(m.atime()),
        mtime: time(m.mtime()),
        ctime: time(m.ctime()),
        crtime: SystemTime::UNIX_EPOCH,
        kind: if ft.is_dir() {
            FileType::Directory
        } else if ft.is_symlink() {
            FileType::Symlink
        } else if ft.is_fifo() {
            FileType::NamedPipe
        } else {
            FileType::RegularFile
        },
        perm: (m.mode() & 0o7777) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl Probe {
    fn new(root: PathBuf, mode: Mode) -> Probe {
        // Inode 1 is the root; index 0 is a placeholder so that an inode is its index.
        let placeholder = Node {
            path: PathBuf::new(),
            file: None,
            backing: None,
        };
        let root_node = Node {
            path: root,
            file: None,
            backing: None,
        };
        Probe {
            mode,
            nodes: Mutex::new(vec![placeholder, root_node]),
            numbers: Mutex::new(HashMap::new()),
            counts: Arc::new(Counts::default()),
        }
    }

    fn path(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        self.nodes
            .lock()
            .get(ino.0 as usize)
            .map(|n| n.path.clone())
            .ok_or(Errno::ENOENT)
    }

    fn number(&self, path: PathBuf) -> u64 {
        let mut numbers = self.numbers.lock();
        if let Some(&ino) = numbers.get(&path) {
            return ino;
        }
        let mut nodes = self.nodes.lock();
        let ino = nodes.len() as u64;
        nodes.push(Node {
            path: path.clone(),
            file: None,
            backing: None,
        });
        numbers.insert(path, ino);
        ino
    }

    /// The inode's file, opened at its first use and kept.
    fn file(&self, ino: INodeNo) -> Result<Arc<File>, Errno> {
        let path = self.path(ino)?;
        if let Some(file) = self.nodes.lock()[ino.0 as usize].file.clone() {
            return Ok(file);
        }
        let file = Arc::new(File::open(path).map_err(errno)?);
        Ok(self.nodes.lock()[ino.0 as usize]
            .file
            .get_or_insert(file)
            .clone())
    }
}

impl Filesystem for Probe {
    fn init(&mut self, _: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if self.mode == Mode::Passthrough {
            let offered = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            if !offered {
                return Err(std::io::Error::other(
                    "this kernel offers no FUSE passthrough",
                ));
            }
        }
        Ok(())
    }

    fn lookup(&self, _: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.counts.lookup.fetch_add(1, Ordering::Relaxed);
        let found = self.path(parent).and_then(|dir| {
            let path = dir.join(name);
            let meta = fs::symlink_metadata(&path).map_err(errno)?;
            Ok(attr(self.number(path), &meta))
        });
        match found {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _: &Request, ino: INodeNo, _: Option<FileHandle>, reply: ReplyAttr) {
        self.counts.getattr.fetch_add(1, Ordering::Relaxed);
        match self
            .path(ino)
            .and_then(|p| fs::symlink_metadata(p).map_err(errno))
        {
            Ok(meta) => reply.attr(&TTL, &attr(ino.0, &meta)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _: &Request, ino: INodeNo, _: OpenFlags, reply: ReplyOpen) {
        self.counts.open.fetch_add(1, Ordering::Relaxed);
        if self.mode == Mode::NoOpen {
            return reply.error(Errno::ENOSYS);
        }
        let backing = self.file(ino).and_then(|file| {
            if let Some(b) = self.nodes.lock()[ino.0 as usize].backing.clone() {
                return Ok(b);
            }
            let b = Arc::new(reply.open_backing(&*file).map_err(errno)?);
            Ok(self.nodes.lock()[ino.0 as usize]
                .backing
                .get_or_insert(b)
                .clone())
        });
        match backing {
            Ok(b) => reply.opened_passthrough(FileHandle(0), FopenFlags::empty(), &b),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _: &Request,
        ino: INodeNo,
        _: FileHandle,
        offset: u64,
        size: u32,
        _: OpenFlags,
        _: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.counts.read.fetch_add(1, Ordering::Relaxed);
        let data = self.file(ino).and_then(|file| {
            let mut buf = vec![0u8; size as usize];
            let mut filled = 0;
            loop {
                match file.read_at(&mut buf[filled..], offset + filled as u64) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(errno(e)),
                }
                if filled == buf.len() {
                    break;
                }
            }
            buf.truncate(filled);
            Ok(buf)
        });
        match data {
            Ok(bytes) => reply.data(&bytes),
            Err(e) => reply.error(e),
        }
    }

    fn release(
        &self,
        _: &Request,
        _: INodeNo,
        _: FileHandle,
        _: OpenFlags,
        _: Option<LockOwner>,
        _: bool,
        reply: ReplyEmpty,
    ) {
        self.counts.release.fetch_add(1, Ordering::Relaxed);
        reply.ok();
    }

    fn flush(&self, _: &Request, _: INodeNo, _: FileHandle, _: LockOwner, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS);
    }

    /// Python's isatty probe, as stagefs answers it.
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
        self.counts.ioctl.fetch_add(1, Ordering::Relaxed);
        reply.error(Errno::ENOTTY);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (dir, mountpoint, mode) = match &args[1..] {
        [dir, mnt, mode] => (dir, mnt, mode.as_str()),
        _ => return Err("usage: open_cost DIR MOUNTPOINT passthrough|no-open".into()),
    };
    let mode = match mode {
        "passthrough" => Mode::Passthrough,
        "no-open" => Mode::NoOpen,
        other => return Err(format!("unknown mode {other}: passthrough or no-open").into()),
    };
    let probe = Probe::new(fs::canonicalize(dir)?, mode);
    let counts = probe.counts.clone();
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(dir.clone()),
        MountOption::Subtype("open-cost".into()),
        MountOption::RO,
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
    ];
    config.acl = SessionACL::Owner;
    // As many threads as stagefs's default, so the two differ only in what they do per request.
    config.n_threads = Some(8);
    config.clone_fd = true;
    // Blocked before the FUSE threads start, so they inherit the mask and the signal waits
    // here instead of ending the process before the counts are printed.
    let signals = stagefs::sys::TerminationSignals::block();
    let session = fuser::spawn_mount(probe, Path::new(mountpoint), &config)?;
    signals.wait();
    drop(session);
    let c = &counts;
    println!(
        "requests: lookup {} getattr {} open {} read {} release {} ioctl {}",
        c.lookup.load(Ordering::Relaxed),
        c.getattr.load(Ordering::Relaxed),
        c.open.load(Ordering::Relaxed),
        c.read.load(Ordering::Relaxed),
        c.release.load(Ordering::Relaxed),
        c.ioctl.load(Ordering::Relaxed),
    );
    Ok(())
}
