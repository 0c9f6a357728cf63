//! The core's behaviour without a mount: a real SOURCE directory, a real cache and stager, and
//! [`FakeReply`] in the kernel's place for opens.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::access::Caller;
use super::dataset::{Answer as Reply, Attr, DatasetFs, MountedDataset};
use super::error::FsError;
use super::opens::tests::{Answer, FakeBacking, FakeReply};
use super::xattr::Xattr;
use super::{STATE_XATTR, STATS_XATTR};
use crate::cache::CacheDir;
use crate::catalog::{Attributes, Catalog, Datasets, Kind, LayoutKind, LayoutSpec, ROOT, Walking};
use crate::order::{SamplerConfig, SamplerKind};
use crate::plan::{Plan, TrackerSettings};
use crate::stager::{LocalSource, Source, SourceRoot, Stager, StagerSettings};
use crate::stats::Counters;

type Core = DatasetFs<FakeBacking>;

const ROOT_INO: u64 = 1;
const FILES: &[(&str, &[u8])] = &[
    ("a/one.bin", b"the first file"),
    ("a/two.bin", b"second"),
    ("b/x.bin", b"x"),
    ("b/y.bin", b"yy"),
    ("b/z.bin", b"zzz"),
];

struct Fixture {
    _dir: tempfile::TempDir,
    src: PathBuf,
    fs: Arc<Core>,
}

/// SOURCE holds [`FILES`], a link `link` and a socket `sock`. `read_through_above` 0 serves
/// every miss from SOURCE; `wrap` may put a source of the test's own around the real one.
fn fixture_with(
    kind: SamplerKind,
    read_through_above: u64,
    wrap: impl FnOnce(LocalSource) -> Arc<dyn Source>,
) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    for (path, body) in FILES {
        let p = src.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    }
    std::os::unix::fs::symlink("a/one.bin", src.join("link")).unwrap();
    // Kept bound only long enough to leave the socket node behind.
    drop(std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap());
    let catalog = Arc::new(Catalog::scan(&src, Walking::threads(2)).unwrap());
    let spec = LayoutSpec {
        kind: LayoutKind::Tree,
        ..LayoutSpec::default()
    };
    let datasets = Arc::new(Datasets::new(catalog.clone(), spec));
    let layout = datasets.get(ROOT).unwrap();
    let plan =
        Arc::new(Plan::new(SamplerConfig::new(kind), vec![0], layout, catalog.len()).unwrap());
    let root = Arc::new(SourceRoot::open(&src).unwrap());
    let cache = CacheDir::open(&dir.path().join("cache"), &src).unwrap();
    let settings = StagerSettings {
        threads: 2,
        lookahead_files: u64::MAX,
        lookahead_bytes: u64::MAX,
        capacity: 1 << 20,
        read_through_above,
        retries: 1,
        open_timeout: Duration::from_secs(20),
        tracker: TrackerSettings::default(),
        eviction: crate::stager::EvictionKind::Belady,
    };
    let counters = Arc::new(Counters::default());
    let source = wrap(LocalSource::new(root.clone()));
    let stager = Stager::start(datasets, source, cache, plan, settings, counters.clone());
    let data = Arc::new(MountedDataset {
        catalog,
        stager,
        counters,
        started: Instant::now(),
        passthrough_wanted: true,
        source_root: root,
        control_address: Default::default(),
        ops: Default::default(),
    });
    Fixture {
        _dir: dir,
        src,
        fs: Arc::new(DatasetFs::new(data).unwrap()),
    }
}

fn fixture(read_through_above: u64) -> Fixture {
    fixture_with(SamplerKind::None, read_through_above, |s| Arc::new(s))
}

/// The daemon's own user: the permission gate lets it through without asking SOURCE.
fn me() -> Caller {
    Caller {
        uid: crate::sys::euid(),
        gid: 0,
        pid: std::process::id(),
    }
}

impl Fixture {
    fn ino(&self, path: &str) -> u64 {
        Path::new(path).iter().fold(ROOT_INO, |dir, name| {
            self.fs.lookup_now(dir, name).unwrap().expect("exists").ino
        })
    }

    fn open_as(&self, path: &str, flags: i32, refuse_backing: bool) -> Answer {
        open_with(&self.fs, self.ino(path), flags, me(), refuse_backing)
    }

    fn open(&self, path: &str) -> (u64, Option<u32>) {
        self.open_as(path, libc::O_RDONLY, false).expect("opened")
    }

    fn read_all(&self, path: &str, fh: u64) -> Vec<u8> {
        self.fs.read(self.ino(path), fh, 0, 1 << 16).unwrap()
    }

    fn state(&self, path: &str) -> Vec<u8> {
        match self
            .fs
            .getxattr_now(self.ino(path), OsStr::new(STATE_XATTR), 64, me())
        {
            Ok(Xattr::Data(v)) => v,
            other => panic!("{other:?}"),
        }
    }

    fn wait_cached(&self, path: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.state(path) != b"cached" {
            assert!(Instant::now() < deadline, "{path} never cached");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn passthrough(&self) -> bool {
        self.fs.passthrough_flag().load(Ordering::SeqCst)
    }
}

/// Opens `ino` through the core, waiting for the (possibly later, other-thread) answer.
fn open_with(fs: &Core, ino: u64, flags: i32, caller: Caller, refuse_backing: bool) -> Answer {
    let (tx, rx) = mpsc::channel();
    let reply = FakeReply {
        answer: tx,
        refuse_backing,
        next: Arc::new(AtomicU64::new(ino * 100)),
    };
    fs.open(ino, flags, caller, reply);
    rx.recv_timeout(Duration::from_secs(20))
        .expect("open answered")
}

/// The core's answers that may come later, from another thread, waited for.
fn answered<T: Send + 'static>(ask: impl FnOnce(Reply<T>)) -> Result<T, FsError> {
    let (tx, rx) = mpsc::channel();
    ask(Box::new(move |answer| tx.send(answer).unwrap()));
    rx.recv_timeout(Duration::from_secs(20)).expect("answered")
}

impl Core {
    fn lookup_now(&self, parent: u64, name: &OsStr) -> Result<Option<Attr>, FsError> {
        answered(|reply| self.lookup(parent, name, reply))
    }

    fn getattr_now(&self, ino: u64) -> Result<Attr, FsError> {
        answered(|reply| self.getattr(ino, reply))
    }

    fn getxattr_now(
        &self,
        ino: u64,
        name: &OsStr,
        size: u32,
        caller: Caller,
    ) -> Result<Xattr, FsError> {
        answered(|reply| self.getxattr(ino, name, size, caller, reply))
    }

    fn opendir_now(&self, ino: u64, caller: Caller) -> Result<(), FsError> {
        answered(|reply| self.opendir(ino, caller, reply))
    }

    fn access_now(&self, ino: u64, mask: i32, caller: Caller) -> Result<(), FsError> {
        answered(|reply| self.access(ino, mask, caller, reply))
    }
}

#[test]
fn lookup_and_getattr_come_from_the_catalog() {
    let f = fixture(u64::MAX);
    let a = f.fs.lookup_now(ROOT_INO, OsStr::new("a")).unwrap().unwrap();
    assert_eq!((a.kind, a.nlink), (Kind::Directory, 2));
    let one =
        f.fs.lookup_now(a.ino, OsStr::new("one.bin"))
            .unwrap()
            .unwrap();
    assert_eq!((one.kind, one.size, one.nlink), (Kind::File, 14, 1));
    let meta = std::fs::metadata(f.src.join("a/one.bin")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(one.perm as u32, meta.mode() & 0o7777);
    assert_eq!((one.uid, one.gid), (meta.uid(), meta.gid()));
    assert_eq!(one.mtime, meta.modified().unwrap());
    assert_eq!(f.fs.getattr_now(one.ino).unwrap(), one);
    assert_eq!(f.fs.getattr_now(ROOT_INO).unwrap().kind, Kind::Directory);
    let link = f.ino("link");
    assert_eq!(f.fs.getattr_now(link).unwrap().kind, Kind::Symlink);
    assert_eq!(f.fs.readlink(link).unwrap(), "a/one.bin");
    assert_eq!(f.fs.readlink(one.ino).unwrap_err().errno(), libc::EINVAL);
}

#[test]
fn missing_names_are_negative_in_directories_and_enoent_elsewhere() {
    let f = fixture(u64::MAX);
    assert_eq!(f.fs.lookup_now(ROOT_INO, OsStr::new("nope")).unwrap(), None);
    let one = f.ino("a/one.bin");
    let err = |r: Result<Option<_>, FsError>| r.unwrap_err().errno();
    assert_eq!(err(f.fs.lookup_now(one, OsStr::new("x"))), libc::ENOENT);
    assert_eq!(err(f.fs.lookup_now(1 << 40, OsStr::new("x"))), libc::ENOENT);
    for ino in [1 << 40, 0xffff] {
        assert_eq!(f.fs.getattr_now(ino).unwrap_err().errno(), libc::ENOENT);
    }
}

#[test]
fn opens_refused_by_kind_and_flags() {
    let f = fixture(u64::MAX);
    assert_eq!(f.open_as("a", libc::O_RDONLY, false), Err(libc::EISDIR));
    assert_eq!(f.open_as("link", libc::O_RDONLY, false), Err(libc::EINVAL));
    assert_eq!(f.open_as("sock", libc::O_RDONLY, false), Err(libc::EINVAL));
    for flags in [libc::O_WRONLY, libc::O_RDWR, libc::O_RDONLY | libc::O_TRUNC] {
        assert_eq!(f.open_as("a/one.bin", flags, false), Err(libc::EROFS));
    }
    assert_eq!(
        open_with(&f.fs, 1 << 40, libc::O_RDONLY, me(), false),
        Err(libc::ENOENT)
    );
    assert_eq!(f.state("a/one.bin"), b"remote", "no refused open staged it");
}

#[test]
fn open_read_release_from_source_then_from_cache() {
    let f = fixture(0);
    let ino = f.ino("b/z.bin");
    assert_eq!(f.state("b/z.bin"), b"remote");
    let (fh, backing) = f.open("b/z.bin");
    assert_eq!(backing, None);
    assert_eq!(f.read_all("b/z.bin", fh), b"zzz");
    assert_eq!(f.fs.read(ino, fh, 1, 1).unwrap(), b"z");
    assert_eq!(f.fs.read(ino, fh, 10, 4).unwrap(), b"", "past the end");
    f.fs.release(ino, fh);
    assert_eq!(f.fs.read(ino, fh, 0, 4).unwrap_err().errno(), libc::EBADF);
    f.wait_cached("b/z.bin");
    let (fh2, _) = f.open("b/z.bin");
    assert_ne!(fh, fh2);
    assert_eq!(f.read_all("b/z.bin", fh2), b"zzz");
    f.fs.release(ino, fh2);
    f.fs.release(ino, fh2);
}

#[test]
fn an_open_that_waits_for_its_copy_is_served_from_the_cache() {
    let f = fixture(u64::MAX);
    f.fs.init_passthrough(true, true, || true);
    let (fh, backing) = f.open("a/two.bin");
    assert!(backing.is_some(), "answered with the cached copy");
    assert_eq!(f.read_all("a/two.bin", fh), b"second");
    assert_eq!(f.state("a/two.bin"), b"cached");
}

#[test]
fn passthrough_is_decided_at_init() {
    let f = fixture(u64::MAX);
    f.fs.init_passthrough(false, true, || panic!("kernel cannot"));
    assert!(!f.passthrough());
    f.fs.init_passthrough(true, false, || panic!("unprivileged"));
    assert!(!f.passthrough());
    f.fs.init_passthrough(true, true, || false);
    assert!(!f.passthrough(), "the kernel refused the capability");
    f.fs.init_passthrough(true, true, || true);
    assert!(f.passthrough());
}

#[test]
fn a_plain_open_blocks_passthrough_and_later_opens_share_the_backing() {
    let f = fixture(0);
    f.fs.init_passthrough(true, true, || true);
    let ino = f.ino("a/one.bin");
    let (plain, backing) = f.open("a/one.bin");
    assert_eq!(backing, None, "read through from SOURCE");
    f.wait_cached("a/one.bin");
    let (blocked, backing) = f.open("a/one.bin");
    assert_eq!(backing, None, "the inode is open without passthrough");
    f.fs.release(ino, plain);
    f.fs.release(ino, blocked);
    let (first, backing) = f.open("a/one.bin");
    let backing = backing.expect("passthrough once nothing else is open");
    // A registration that would fail is never tried: the inode's backing is reused.
    let (second, again) = f.open_as("a/one.bin", libc::O_RDONLY, true).unwrap();
    assert_eq!(again, Some(backing));
    assert!(f.passthrough());
    // The daemon still reads passthrough handles correctly (e.g. for the kernel's fallback).
    assert_eq!(f.read_all("a/one.bin", second), b"the first file");
    f.fs.release(ino, first);
    f.fs.release(ino, second);
}

#[test]
fn a_refused_backing_turns_passthrough_off() {
    let f = fixture(u64::MAX);
    f.fs.init_passthrough(true, true, || true);
    let (fh, backing) = f.open_as("b/x.bin", libc::O_RDONLY, true).unwrap();
    assert_eq!(backing, None);
    assert!(!f.passthrough());
    assert_eq!(f.read_all("b/x.bin", fh), b"x");
    assert_eq!(f.open("b/y.bin").1, None, "not offered to the kernel again");
}

#[test]
fn a_file_changed_on_source_while_open_reads_estale() {
    let f = fixture(0);
    let ino = f.ino("a/two.bin");
    let (fh, _) = f.open("a/two.bin");
    assert_eq!(f.read_all("a/two.bin", fh), b"second");
    std::fs::OpenOptions::new()
        .append(true)
        .open(f.src.join("a/two.bin"))
        .and_then(|mut file| std::io::Write::write_all(&mut file, b" and more"))
        .unwrap();
    assert_eq!(f.fs.read(ino, fh, 0, 6).unwrap_err().errno(), libc::ESTALE);
}

#[test]
fn readdir_offsets_resume_exactly() {
    let f = fixture(u64::MAX);
    let b = f.ino("b");
    let all: Vec<(u64, String, u64)> =
        f.fs.readdir(b, 0)
            .unwrap()
            .map(|e| (e.next, e.name.to_str().unwrap().to_string(), e.ino))
            .collect();
    let names: Vec<&str> = all.iter().map(|(_, n, _)| n.as_str()).collect();
    assert_eq!(names, [".", "..", "x.bin", "y.bin", "z.bin"]);
    assert_eq!((all[0].2, all[1].2), (b, ROOT_INO));
    assert_eq!(all[2].2, f.ino("b/x.bin"));
    // Every entry's offset, given back, lists exactly what followed it.
    for (i, (next, _, _)) in all.iter().enumerate() {
        let rest: Vec<u64> = f.fs.readdir(b, *next).unwrap().map(|e| e.next).collect();
        let expected: Vec<u64> = all[i + 1..].iter().map(|(n, _, _)| *n).collect();
        assert_eq!(rest, expected);
    }
    assert_eq!(f.fs.readdir(b, 99).unwrap().count(), 0);
    let file = f.ino("b/x.bin");
    assert_eq!(f.fs.readdir(file, 0).err().unwrap().errno(), libc::ENOTDIR);
    assert_eq!(
        f.fs.opendir_now(file, me()).unwrap_err().errno(),
        libc::ENOTDIR
    );
    f.fs.opendir_now(b, me()).unwrap();
    let root_names = f.fs.readdir(ROOT_INO, 2).unwrap().count();
    assert_eq!(root_names, 4, "a, b, link, sock");
}

#[test]
fn access_and_statfs() {
    let f = fixture(u64::MAX);
    let one = f.ino("a/one.bin");
    f.fs.access_now(one, libc::R_OK, me()).unwrap();
    assert_eq!(
        f.fs.access_now(one, libc::R_OK | libc::W_OK, me())
            .unwrap_err()
            .errno(),
        libc::EROFS
    );
    assert_eq!(
        f.fs.access_now(1 << 40, libc::W_OK, me())
            .unwrap_err()
            .errno(),
        libc::ENOENT
    );
    let st = f.fs.statfs().unwrap();
    assert!(st.blocks > 0 && st.bsize > 0);
    assert_eq!(st.namelen, 255);
}

fn stats_probe(fs: &Core, caller: Caller) -> u32 {
    match fs.getxattr_now(ROOT_INO, OsStr::new(STATS_XATTR), 0, caller) {
        Ok(Xattr::Size(n)) => n,
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_xattr_probe_then_read_sees_one_value_per_mount() {
    let f = fixture(u64::MAX);
    let stats = OsStr::new(STATS_XATTR);
    let size = stats_probe(&f.fs, me());
    // The value grows between the probe and the read.
    Counters::add(&f.fs.data.counters.hits, 1_000_000_000_000);
    let Ok(Xattr::Data(value)) = f.fs.getxattr_now(ROOT_INO, stats, size, me()) else {
        panic!("the probed value is given");
    };
    assert_eq!(value.len(), size as usize);
    let json: serde_json::Value = serde_json::from_slice(&value).unwrap();
    assert_eq!(json["hits"], 0, "as of the probe");
    // Once only, and only to the thread that probed: anyone else, and a second read, gets
    // the value as it is now, or ERANGE if it no longer fits. (Whether it fits depends on
    // the floats in it, whose printed length varies.)
    let now_or_erange = |r: Result<Xattr, FsError>, hits: u64| match r {
        Ok(Xattr::Data(v)) => {
            let json: serde_json::Value = serde_json::from_slice(&v).unwrap();
            assert_eq!(json["hits"], hits, "not the probed value");
        }
        Err(e) => assert_eq!(e.errno(), libc::ERANGE),
        Ok(other) => panic!("{other:?}"),
    };
    now_or_erange(
        f.fs.getxattr_now(ROOT_INO, stats, size, me()),
        1_000_000_000_000,
    );
    let other = Caller { pid: 1, ..me() };
    let size = stats_probe(&f.fs, me());
    Counters::add(&f.fs.data.counters.hits, 1_000_000_000_000);
    now_or_erange(
        f.fs.getxattr_now(ROOT_INO, stats, size, other),
        2_000_000_000_000,
    );
    // Another mount's core (same dataset) does not share this one's probes.
    let size = stats_probe(&f.fs, me());
    Counters::add(&f.fs.data.counters.hits, 8_000_000_000_000);
    let other_mount: Core = DatasetFs::new(f.fs.data.clone()).unwrap();
    now_or_erange(
        other_mount.getxattr_now(ROOT_INO, stats, size, me()),
        10_000_000_000_000,
    );
    // A fresh value that fits is always preferred.
    let big = stats_probe(&f.fs, me()) + 100;
    let Ok(Xattr::Data(fresh)) = f.fs.getxattr_now(ROOT_INO, stats, big, me()) else {
        panic!();
    };
    let json: serde_json::Value = serde_json::from_slice(&fresh).unwrap();
    assert_eq!(json["hits"], 10_000_000_000_000u64);
}

#[test]
fn xattrs_of_ours_answer_by_name() {
    let f = fixture(u64::MAX);
    let get = |ino, name: &str| f.fs.getxattr_now(ino, OsStr::new(name), 256, me());
    assert_eq!(f.state("a"), b"0/2 cached");
    let (fh, _) = f.open("a/one.bin");
    f.fs.release(f.ino("a/one.bin"), fh);
    assert_eq!(f.state("a/one.bin"), b"cached");
    assert_eq!(f.state("a"), b"1/2 cached");
    assert_eq!(f.state(""), b"1/5 cached");
    assert_eq!(
        get(ROOT_INO, super::PID_XATTR).unwrap(),
        Xattr::Data(std::process::id().to_string().into_bytes())
    );
    assert_eq!(
        get(ROOT_INO, "user.stagefs.sampler").unwrap(),
        Xattr::Data(b"none".to_vec())
    );
    let nodata = |r: Result<Xattr, FsError>| r.unwrap_err().errno();
    assert_eq!(nodata(get(ROOT_INO, "user.stagefs.nothing")), libc::ENODATA);
    assert_eq!(nodata(get(f.ino("a"), STATS_XATTR)), libc::ENODATA);
    assert_eq!(nodata(get(f.ino("link"), STATE_XATTR)), libc::ENODATA);
    assert_eq!(nodata(get(1 << 40, STATE_XATTR)), libc::ENOENT);
    assert_eq!(
        f.fs.getxattr_now(f.ino("a/one.bin"), OsStr::new(STATE_XATTR), 2, me())
            .unwrap_err()
            .errno(),
        libc::ERANGE
    );
}

/// A SOURCE whose open of `trigger` (on a copy thread) re-enters the file system, as a
/// SOURCE path leading into the mount would: the opens it makes are answered into `seen`.
struct ReentrantSource {
    real: LocalSource,
    trigger: PathBuf,
    fs: OnceLock<Weak<Core>>,
    targets: OnceLock<Vec<u64>>,
    seen: parking_lot::Mutex<Option<mpsc::Sender<Vec<Answer>>>>,
}

impl Source for ReentrantSource {
    fn open(&self, path: &Path) -> std::io::Result<std::fs::File> {
        if path == self.trigger
            && let Some(tx) = self.seen.lock().take()
            && let Some(fs) = self.fs.get().and_then(Weak::upgrade)
        {
            let tid = crate::sys::thread_id();
            let caller = Caller { pid: tid, ..me() };
            let answers = self.targets.get().unwrap().iter();
            let answers = answers.map(|&ino| open_with(&fs, ino, libc::O_RDONLY, caller, false));
            let _ = tx.send(answers.collect());
        }
        self.real.open(path)
    }

    fn lstat(&self, path: &Path) -> std::io::Result<Attributes> {
        self.real.lstat(path)
    }
}

#[test]
fn copy_threads_are_refused_files_not_cached() {
    let source = OnceLock::new();
    let f = fixture_with(SamplerKind::None, u64::MAX, |real| {
        let s = Arc::new(ReentrantSource {
            real,
            trigger: PathBuf::from("b/x.bin"),
            fs: OnceLock::new(),
            targets: OnceLock::new(),
            seen: parking_lot::Mutex::new(None),
        });
        let _ = source.set(s.clone());
        s
    });
    let source = source.get().unwrap();
    let (tx, rx) = mpsc::channel();
    *source.seen.lock() = Some(tx);
    let _ = source.fs.set(Arc::downgrade(&f.fs));
    let (fh, _) = f.open("a/one.bin");
    f.fs.release(f.ino("a/one.bin"), fh);
    let _ = source
        .targets
        .set(vec![f.ino("a/one.bin"), f.ino("b/y.bin")]);
    // Opening x makes a copy thread open the cached one (allowed) and y (not cached).
    let (fh, _) = f.open("b/x.bin");
    let answers = rx.recv_timeout(Duration::from_secs(20)).unwrap();
    assert!(answers[0].is_ok(), "{answers:?}");
    assert_eq!(answers[1], Err(libc::EDEADLK));
    assert_eq!(f.read_all("b/x.bin", fh), b"x");
}
