//! Tests of the catalog index and of what a mount asks SOURCE: round trips, refusal of
//! corrupt, foreign and untrusted files, directories checked and listed again, calls counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::*;
use crate::catalog::{Attributes, Lister, Listing, Progress, ScanError, Walking, source_lister};

fn encode(catalog: &Catalog) -> Vec<u8> {
    let mut out = Vec::new();
    encode_to(catalog, &mut out).unwrap();
    out
}

fn decode(bytes: &[u8]) -> Result<Catalog, DecodeError> {
    decode_from(bytes, bytes.len() as u64).map(|loaded| loaded.catalog)
}

fn sample() -> (tempfile::TempDir, Catalog) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("src");
    for p in ["a/x.jpg", "a/y.jpg", "b/c/z.png", "top.txt"] {
        let f = root.join(p);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, p).unwrap();
    }
    std::os::unix::fs::symlink("a", root.join("link")).unwrap();
    let root = std::fs::canonicalize(root).unwrap();
    let catalog = Catalog::scan(&root, Walking::threads(2)).unwrap();
    (dir, catalog)
}

/// Every entry's path, kind and link target, in id order.
fn listing(catalog: &Catalog) -> Vec<(PathBuf, Kind, Option<OsString>)> {
    (0..catalog.len() as FileId)
        .map(|id| {
            let kind = catalog.entry(id).unwrap().kind;
            let target = catalog.link_target(id).map(|t| t.to_os_string());
            (catalog.relative_path(id), kind, target)
        })
        .collect()
}

/// SOURCE's calls a mount makes, counted: listings (each with one `fstat` of its
/// directory), `lstat`s and link reads.
#[derive(Default)]
struct Counts {
    lists: AtomicUsize,
    lstats: AtomicUsize,
    readlinks: AtomicUsize,
}

impl Counts {
    /// (listings, lstats, link reads) so far, and back to zero.
    fn take(&self) -> (usize, usize, usize) {
        let take = |n: &AtomicUsize| n.swap(0, Ordering::SeqCst);
        (take(&self.lists), take(&self.lstats), take(&self.readlinks))
    }
}

/// The real tree, its calls counted; `hide_kinds` makes every listed kind unknown, as on a
/// file system whose listings say `DT_UNKNOWN`.
struct Counting {
    real: Arc<dyn Lister>,
    counts: Arc<Counts>,
    hide_kinds: bool,
}

impl Lister for Counting {
    fn list(&self, dir: &Path, progress: &Progress) -> io::Result<Listing> {
        self.counts.lists.fetch_add(1, Ordering::SeqCst);
        let mut listing = self.real.list(dir, progress)?;
        if self.hide_kinds {
            listing.entries.iter_mut().for_each(|e| e.kind = None);
        }
        Ok(listing)
    }

    fn lstat(&self, path: &Path) -> io::Result<Attributes> {
        self.counts.lstats.fetch_add(1, Ordering::SeqCst);
        self.real.lstat(path)
    }

    fn readlink(&self, path: &Path) -> io::Result<OsString> {
        self.counts.readlinks.fetch_add(1, Ordering::SeqCst);
        self.real.readlink(path)
    }
}

fn counting(root: &Path, hide_kinds: bool) -> (Arc<dyn Lister>, Arc<Counts>) {
    let counts = Arc::new(Counts::default());
    let lister = Counting {
        real: source_lister(root).unwrap(),
        counts: counts.clone(),
        hide_kinds,
    };
    (Arc::new(lister), counts)
}

/// `dirs` directories of `per_dir` files each under `root`, and a link.
fn tree(root: &Path, dirs: usize, per_dir: usize) {
    for d in 0..dirs {
        let dir = root.join(format!("d{d:03}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..per_dir {
            std::fs::write(dir.join(format!("f{f:03}.jpg")), b"x").unwrap();
        }
    }
    std::os::unix::fs::symlink("d000/f000.jpg", root.join("link.jpg")).unwrap();
}

#[test]
fn round_trip_keeps_every_entry_and_no_attribute() {
    let (dir, catalog) = sample();
    let path = dir.path().join("index.bin");
    save(&catalog, &path).unwrap();
    let loaded = load(&path, catalog.root_path()).unwrap();
    assert_eq!(listing(loaded.catalog()), listing(&catalog));
    assert_eq!(loaded.catalog().file_count(), catalog.file_count());
    // An index lists; what each node is is asked of SOURCE, not taken from the file.
    assert!((0..catalog.len() as FileId).all(|id| loaded.catalog().attributes(id).is_none()));
    let (refreshed, relisted) = loaded.refresh(Walking::threads(2)).unwrap();
    assert_eq!(relisted, 0);
    for id in 0..catalog.len() as FileId {
        let kind = refreshed.entry(id).unwrap().kind;
        // Directories were checked (their attributes are kept); files not asked about.
        assert_eq!(refreshed.attributes(id).is_some(), kind == Kind::Directory);
    }
}

/// Issue #29: a mount costs SOURCE one call per directory, not per file: a scan lists each
/// directory (one `fstat` of it with each listing) and stats no file; a mount from an index,
/// the cache's or a shared one, `lstat`s each directory and lists none unless it changed.
#[test]
fn a_mount_asks_source_once_per_directory_not_per_file() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("src");
    tree(&root, 20, 50);
    let dirs = 21; // the root too
    let (lister, counts) = counting(&root, false);
    let scanned = Catalog::scan_with(&root, lister.clone(), Walking::threads(4)).unwrap();
    assert_eq!(scanned.file_count(), 1000);
    // One link read for the one link: what the layout needs to follow it.
    assert_eq!(counts.take(), (dirs, 0, 1), "first mount");
    assert!(scanned.files().all(|f| scanned.attributes(f).is_none()));

    let path = tmp.path().join("index.bin");
    save(&scanned, &path).unwrap();
    for mount in ["remount", "fresh cache from a shared index"] {
        let loaded = load(&path, &root).unwrap();
        let (catalog, relisted) = loaded
            .refresh_with(lister.clone(), Walking::threads(4))
            .unwrap();
        assert_eq!((relisted, counts.take()), (0, (0, dirs, 0)), "{mount}");
        assert_eq!(listing(&catalog), listing(&scanned), "{mount}");
    }
}

#[test]
fn entries_a_listing_gives_no_kind_for_cost_one_lstat_each_and_keep_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("src");
    tree(&root, 3, 4);
    let known = Catalog::scan(&root, Walking::threads(2)).unwrap();
    let (lister, counts) = counting(&root, true);
    let unknown = Catalog::scan_with(&root, lister, Walking::threads(2)).unwrap();
    assert_eq!(listing(&unknown), listing(&known));
    // 3 directories and 13 files and links below the root, each `lstat`ed once.
    assert_eq!(counts.take(), (4, 16, 1));
    let file = unknown.lookup_path(Path::new("d001/f002.jpg")).unwrap();
    assert_eq!(unknown.size(file), Some(1), "what the lstat said is kept");
}

/// What a remount (or a node starting from a shared index) sees is SOURCE as it is now: a
/// directory changed since the index was written is listed again (and only it), whatever its
/// mtime says.
#[test]
fn directories_changed_since_the_index_are_listed_again() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("src");
    tree(&root, 4, 3);
    let path = tmp.path().join("index.bin");
    save(&Catalog::scan(&root, Walking::threads(2)).unwrap(), &path).unwrap();

    // Added the way rsync -a adds: the directory's mtime put back.
    let d1 = root.join("d001");
    let mtime = std::fs::metadata(&d1).unwrap().modified().unwrap();
    std::fs::write(d1.join("new.jpg"), b"new").unwrap();
    std::fs::File::open(&d1)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    // A directory swapped for a link to a look-alike, and a new directory.
    std::fs::rename(root.join("d002"), tmp.path().join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("elsewhere"), root.join("d002")).unwrap();
    std::fs::create_dir(root.join("d009")).unwrap();
    std::fs::write(root.join("d009/late.jpg"), b"late").unwrap();

    let (lister, counts) = counting(&root, false);
    let loaded = load(&path, &root).unwrap();
    let (catalog, relisted) = loaded.refresh_with(lister, Walking::threads(2)).unwrap();
    let now = Catalog::scan(&root, Walking::threads(2)).unwrap();
    assert_eq!(listing(&catalog), listing(&now));
    // The root, d001 and d002 changed (d002 is a link now); d009 is new. Listed: those
    // that changed and are still directories, and the new one; every directory of the index
    // `lstat`ed; the root's two links read again (it was listed again).
    assert_eq!(relisted, 3);
    assert_eq!(counts.take(), (3, 5, 2));
}

#[test]
fn corruption_of_any_byte_is_refused() {
    let (_dir, catalog) = sample();
    let bytes = encode(&catalog);
    for i in (0..bytes.len()).step_by(7) {
        let mut bad = bytes.clone();
        bad[i] ^= 0x40;
        assert!(decode(&bad).is_err(), "flipped byte {i} accepted");
    }
    for cut in [0, 10, bytes.len() / 2, bytes.len() - 1] {
        assert!(decode(&bytes[..cut]).is_err());
    }
}

#[test]
fn a_valid_checksum_does_not_make_a_bad_tree_acceptable() {
    let (_dir, mut catalog) = sample();
    // Break sortedness, then re-encode (valid checksum, invalid structure).
    let kids = catalog.children(ROOT);
    catalog
        .entries
        .swap(kids.start as usize, kids.start as usize + 1);
    assert!(matches!(
        decode(&encode(&catalog)),
        Err(DecodeError::Corrupt(_))
    ));
}

#[test]
fn other_versions_and_sources_are_refused() {
    let (dir, catalog) = sample();
    let path = dir.path().join("index.bin");
    let mut bytes = encode(&catalog);
    bytes[16] = 9;
    assert!(matches!(decode(&bytes), Err(DecodeError::Version(9))));
    save(&catalog, &path).unwrap();
    assert!(matches!(
        load(&path, Path::new("/elsewhere")),
        Err(IndexError::OtherSource { .. })
    ));
}

/// Whoever can write an index decides what a mount lists: one of another user, or that others
/// can write, is refused with one line saying so; so are a link and a FIFO (never waited on).
#[test]
fn an_index_others_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, catalog) = sample();
    let path = dir.path().join("index.bin");
    save(&catalog, &path).unwrap();
    let refused = |what: &str| {
        let e = load(&path, catalog.root_path()).err().expect(what);
        let text = e.to_string();
        assert_eq!(text.lines().count(), 1, "{what}: {text}");
        text
    };
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o620)).unwrap();
    assert!(refused("group-writable").contains("can be written by others (mode 620)"));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    load(&path, catalog.root_path()).unwrap();
    if crate::sys::euid() == 0 {
        std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
        assert!(refused("another user's").contains("belongs to uid 65534"));
    }
    std::fs::remove_file(&path).unwrap();
    save(&catalog, &dir.path().join("real.bin")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("real.bin"), &path).unwrap();
    refused("a link");
    std::fs::remove_file(&path).unwrap();
    crate::sys::mkfifo(&path, 0o600).unwrap();
    assert!(refused("a FIFO").contains("not a regular file"));
}

/// A SOURCE that never answers (a hung server) fails the scan, and the check of an index,
/// with one line naming what it waited for, instead of hanging the mount.
#[test]
fn a_hung_directory_fails_the_walk_naming_it() {
    struct Hung {
        real: Arc<dyn Lister>,
        release: Mutex<std::sync::mpsc::Receiver<()>>,
    }
    impl Lister for Hung {
        fn list(&self, dir: &Path, progress: &Progress) -> io::Result<Listing> {
            if dir == Path::new("b/c") {
                let _ = self.release.lock().recv();
            }
            self.real.list(dir, progress)
        }
        fn lstat(&self, path: &Path) -> io::Result<Attributes> {
            if path == Path::new("b/c") {
                let _ = self.release.lock().recv();
            }
            self.real.lstat(path)
        }
        fn readlink(&self, path: &Path) -> io::Result<OsString> {
            self.real.readlink(path)
        }
    }
    let (dir, catalog) = sample();
    let (_release, hang) = std::sync::mpsc::channel();
    let hung: Arc<dyn Lister> = Arc::new(Hung {
        real: source_lister(catalog.root_path()).unwrap(),
        release: Mutex::new(hang),
    });
    let walking = Walking {
        threads: 2,
        stall: std::time::Duration::from_millis(500),
    };
    let wanted = catalog.root_path().join("b/c");
    let said = |e: ScanError| {
        let text = e.to_string();
        assert!(matches!(e, ScanError::Stalled { .. }), "{text}");
        assert!(
            text.contains(&format!("reading {}", wanted.display())),
            "{text}"
        );
    };
    said(
        Catalog::scan_with(catalog.root_path(), hung.clone(), walking)
            .err()
            .unwrap(),
    );
    let path = dir.path().join("index.bin");
    save(&catalog, &path).unwrap();
    let loaded = load(&path, catalog.root_path()).unwrap();
    said(loaded.refresh_with(hung, walking).err().unwrap());
}
