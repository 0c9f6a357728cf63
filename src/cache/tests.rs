//! Tests of the cache directory: which directories are refused (untouched), planted links,
//! the manifest's round trip, and serving a reused copy only if its checksum matches.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;

use super::stage::SUM_XATTR;
use super::*;
use crate::catalog::{Attributes, Walking};
use crate::sys::euid;

/// Found by fuzz/cache_manifest: a SOURCE path that is not UTF-8 made `to_bytes` panic,
/// so mounting such a source killed the daemon at start.
#[test]
fn any_source_path_round_trips() {
    for raw in [&b"/data/set"[..], b"/data/caf\xe9", b"\xac", b"/x/\"q\"\n"] {
        let source = Path::new(OsStr::from_bytes(raw));
        let read = Manifest::parse(&Manifest::for_source(source).to_bytes()).unwrap();
        assert!(read.holds(source), "{source:?}");
        assert!(!read.holds(&source.join("x")));
    }
    // Format 1 as written before: a plain string.
    let old = br#"{"format": 1, "source": "/data/set"}"#;
    assert!(Manifest::parse(old).unwrap().holds(Path::new("/data/set")));
    for junk in [
        &b""[..],
        b"{",
        b"[]",
        br#"{"format": 1}"#,
        br#"{"format": -1, "source": "/"}"#,
    ] {
        assert_eq!(Manifest::parse(junk), None, "{junk:?}");
    }
}

#[test]
fn cache_files_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("cache");
    let _cache = CacheDir::open(&root, Path::new("/src")).unwrap();
    for (name, want) in [
        ("", 0o700),
        (OWN_DIR, 0o700),
        ("stagefs/data", 0o700),
        ("stagefs/lock", 0o600),
        ("stagefs/manifest.json", 0o600),
    ] {
        let mode = fs::metadata(root.join(name)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, want, "{name}: {mode:o}");
    }
    let entries: Vec<_> = fs::read_dir(&root).unwrap().flatten().collect();
    assert_eq!(entries.len(), 1, "everything in CACHE/{OWN_DIR}");
}

fn mode_of(path: &Path) -> u32 {
    fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// A directory that is not stagefs's is refused as it is: nothing in it deleted, its mode
/// unchanged, nothing created in it.
fn assert_refused(root: &Path, why: &str) -> CacheError {
    let mode = fs::symlink_metadata(root).map(|m| m.mode()).ok();
    let listing = |r: &Path| -> Vec<OsString> {
        let mut v: Vec<_> = fs::read_dir(r)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        v.sort();
        v
    };
    let before = listing(root);
    let err = match check_root(root) {
        Ok(()) => panic!("{why}: check_root accepted {}", root.display()),
        Err(e) => e,
    };
    let opened = CacheDir::open(root, Path::new("/src"));
    assert!(opened.is_err(), "{why}: CacheDir::open accepted it");
    assert_eq!(
        fs::symlink_metadata(root).map(|m| m.mode()).ok(),
        mode,
        "{why}"
    );
    assert_eq!(listing(root), before, "{why}");
    err
}

#[test]
fn a_directory_that_is_not_stagefs_is_refused_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    // The user's own files.
    let root = tmp.path().join("mine");
    fs::create_dir_all(root.join("data/ab")).unwrap();
    fs::create_dir(root.join("tmp")).unwrap();
    fs::write(root.join("data/ab/thesis.tex"), b"years of work").unwrap();
    let e = assert_refused(&root, "user's data/ and tmp/");
    assert!(matches!(e, CacheError::Foreign { .. }), "{e}");
    assert!(root.join("data/ab/thesis.tex").exists());
    // World-writable (sticky or not) and group-writable.
    for mode in [0o1777, 0o777, 0o770] {
        let root = tmp.path().join(format!("shared{mode:o}"));
        fs::create_dir(&root).unwrap();
        chmod(&root, mode);
        let e = assert_refused(&root, "writable by others");
        assert!(matches!(e, CacheError::Shared { .. }), "{e}");
        assert_eq!(mode_of(&root), mode);
    }
    // Someone else's (needs root to make, as the daemon runs).
    if euid() == 0 {
        let root = tmp.path().join("theirs");
        fs::create_dir(&root).unwrap();
        std::os::unix::fs::chown(&root, Some(65534), Some(65534)).unwrap();
        let e = assert_refused(&root, "owned by nobody");
        assert!(
            matches!(e, CacheError::NotOwned { owner: 65534, .. }),
            "{e}"
        );
    }
    // A link, even to a good directory, and a file.
    let good = tmp.path().join("good");
    fs::create_dir(&good).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&good, &link).unwrap();
    let e = assert_refused(&link, "symlink");
    assert!(matches!(e, CacheError::Symlink(_)), "{e}");
    assert_eq!(
        fs::read_dir(&good).unwrap().count(),
        0,
        "link target untouched"
    );
    let file = tmp.path().join("file");
    fs::write(&file, b"x").unwrap();
    let e = assert_refused(&file, "file");
    assert!(matches!(e, CacheError::NotADirectory(_)), "{e}");
    // An old stagefs layout, and a stagefs directory without a manifest.
    let old = tmp.path().join("old");
    fs::create_dir_all(old.join("data")).unwrap();
    fs::write(old.join(OLD_MANIFEST), b"{}").unwrap();
    let e = assert_refused(&old, "old layout");
    assert!(matches!(e, CacheError::OldLayout(_)), "{e}");
    let bare = tmp.path().join("bare");
    fs::create_dir_all(bare.join("stagefs/data")).unwrap();
    let e = assert_refused(&bare, "no manifest");
    assert!(matches!(e, CacheError::NoManifest(_)), "{e}");
}

#[test]
fn parents_others_could_change_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let open_parent = tmp.path().join("open");
    fs::create_dir(&open_parent).unwrap();
    chmod(&open_parent, 0o777);
    let root = open_parent.join("sub/cache");
    let e = check_root(&root).unwrap_err();
    assert!(matches!(e, CacheError::UnsafeParent { .. }), "{e}");
    assert!(CacheDir::open(&root, Path::new("/src")).is_err());
    assert!(!open_parent.join("sub").exists(), "nothing created");
    // Through a link from a safe place: the real parent counts.
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&open_parent, &link).unwrap();
    assert!(check_root(&link.join("cache")).is_err());
    // Sticky, as /tmp: others cannot replace what is ours.
    chmod(&open_parent, 0o1777);
    check_root(&root).unwrap();
    drop(CacheDir::open(&root, Path::new("/src")).unwrap());
    if euid() == 0 {
        let theirs = tmp.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
        let e = check_root(&theirs.join("cache")).unwrap_err();
        assert!(
            matches!(e, CacheError::UnsafeParent { owner: 65534, .. }),
            "{e}"
        );
    }
}

#[test]
fn an_empty_or_stagefs_directory_is_accepted_and_keeps_its_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("empty");
    fs::create_dir(&root).unwrap();
    chmod(&root, 0o755);
    drop(CacheDir::open(&root, Path::new("/src")).unwrap());
    assert_eq!(
        mode_of(&root),
        0o755,
        "not chmod'ed: stagefs did not create it"
    );
    // Its own directory, left empty by a stagefs that stopped at once.
    fs::remove_dir_all(root.join(OWN_DIR)).unwrap();
    fs::create_dir(root.join(OWN_DIR)).unwrap();
    drop(CacheDir::open(&root, Path::new("/src")).unwrap());
    check_root(&root).unwrap();
}

#[test]
fn planted_links_are_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("cache");
    drop(CacheDir::open(&root, Path::new("/src")).unwrap());
    let victim = tmp.path().join("victim");
    fs::write(&victim, b"precious").unwrap();
    let own = root.join(OWN_DIR);
    fs::remove_file(own.join(LOCK)).unwrap();
    std::os::unix::fs::symlink(&victim, own.join(LOCK)).unwrap();
    assert!(
        CacheDir::open(&root, Path::new("/src")).is_err(),
        "lock link"
    );
    fs::remove_file(own.join(LOCK)).unwrap();
    fs::remove_file(own.join(MANIFEST)).unwrap();
    std::os::unix::fs::symlink(&victim, own.join(MANIFEST)).unwrap();
    assert!(Manifest::read(&own).is_none(), "manifest link");
    assert_eq!(fs::read(&victim).unwrap(), b"precious");
}

/// A one-file source and its catalog, for staging.
fn source_with(content: &[u8]) -> (tempfile::TempDir, Catalog, FileId) {
    let tmp = tempfile::tempdir().unwrap();
    fs::create_dir(tmp.path().join("src")).unwrap();
    fs::write(tmp.path().join("src/f"), content).unwrap();
    let catalog = Catalog::scan(&tmp.path().join("src"), Walking::threads(1)).unwrap();
    let id = catalog.files().next().unwrap();
    (tmp, catalog, id)
}

/// The source file of `id` as it is now.
fn version(catalog: &Catalog, id: FileId) -> Attributes {
    Attributes::of_metadata(&fs::symlink_metadata(catalog.source_path(id)).unwrap())
}

fn stage(cache: &CacheDir, catalog: &Catalog, id: FileId) {
    let path = catalog.source_path(id);
    cache
        .stage(
            File::open(&path).unwrap(),
            &version(catalog, id),
            catalog,
            id,
            &AtomicBool::new(false),
        )
        .unwrap();
}

#[test]
fn a_stopped_copy_leaves_nothing_behind() {
    let (tmp, catalog, id) = source_with(b"the dataset's bytes");
    let root = tmp.path().join("cache");
    let cache = CacheDir::open(&root, catalog.root_path()).unwrap();
    let src = File::open(catalog.source_path(id)).unwrap();
    let v = version(&catalog, id);
    let result = cache.stage(src, &v, &catalog, id, &AtomicBool::new(true));
    assert!(matches!(result, Err(CopyError::Stopped)), "{result:?}");
    assert!(cache.open_cached(&catalog, id).is_err(), "no copy");
    let left: Vec<_> = fs::read_dir(root.join("stagefs/tmp")).unwrap().collect();
    assert!(left.is_empty(), "no temporary copy: {left:?}");
}

/// A file that grows while copied (here: before the copy, by far) is read only up to its
/// catalogued size and one byte more: a writer appending to it cannot fill the cache.
#[test]
fn a_grown_file_is_read_no_further_than_its_catalogued_size() {
    let (tmp, catalog, id) = source_with(b"the dataset's bytes");
    let root = tmp.path().join("cache");
    let cache = CacheDir::open(&root, catalog.root_path()).unwrap();
    let path = catalog.source_path(id);
    let v = version(&catalog, id);
    let mut grow = fs::OpenOptions::new().append(true).open(&path).unwrap();
    grow.write_all(&vec![7u8; 8 << 20]).unwrap();
    let src = File::open(&path).unwrap();
    // Shares the file offset with `src`: how far the copy read.
    let mut offset = src.try_clone().unwrap();
    let result = cache.stage(src, &v, &catalog, id, &AtomicBool::new(false));
    assert!(
        matches!(result, Err(CopyError::SourceChanged(_))),
        "{result:?}"
    );
    use std::io::Seek;
    let read = offset.stream_position().unwrap();
    assert!(read <= 19 + 1, "read {read} bytes of a 19-byte file");
    assert!(cache.open_cached(&catalog, id).is_err(), "no copy");
    let left: Vec<_> = fs::read_dir(root.join("stagefs/tmp")).unwrap().collect();
    assert!(left.is_empty(), "no temporary copy: {left:?}");
}

#[test]
fn a_reused_copy_is_served_only_if_its_bytes_match_the_checksum() {
    let (tmp, catalog, id) = source_with(b"the dataset's bytes");
    let root = tmp.path().join("cache");
    let cache = CacheDir::open(&root, catalog.root_path()).unwrap();
    stage(&cache, &catalog, id);
    let v = version(&catalog, id);
    let mut served = String::new();
    let copy = cache.open_verified(&catalog, id, &v).unwrap();
    copy.file().read_to_string(&mut served).unwrap();
    assert_eq!(served, "the dataset's bytes", "from the start of the file");
    assert_eq!(cache.reuse(&catalog), vec![(id, 19)]);

    // Changed in place, size and mtime kept: the size and mtime check cannot see it.
    let path = cache.path_for(&catalog, id);
    let mut w = OpenOptions::new().write(true).open(&path).unwrap();
    w.write_all(b"THE").unwrap();
    w.set_modified(v.mtime()).unwrap();
    let e = cache.open_verified(&catalog, id, &v).unwrap_err();
    assert!(matches!(e, CacheError::Corrupt(_)), "{e}");

    // No checksum at all (planted, or staged where attributes are not supported).
    stage(&cache, &catalog, id);
    cache.open_verified(&catalog, id, &v).unwrap();
    crate::sys::removexattr(&path, SUM_XATTR).unwrap();
    let e = cache.open_verified(&catalog, id, &v).unwrap_err();
    assert!(matches!(e, CacheError::NoChecksum(_)), "{e}");

    // Not through a link, whatever it points to. (The copy kept open from the last open is
    // the genuine one, still served; let go of it so that only the name is left.)
    fs::remove_file(&path).unwrap();
    cache.open_copies.forget(id);
    std::os::unix::fs::symlink(catalog.source_path(id), &path).unwrap();
    assert!(cache.open_verified(&catalog, id, &v).is_err());
    assert!(cache.open_cached(&catalog, id).is_err());
    assert_eq!(cache.reuse(&catalog), vec![], "a link is not a cached file");
}

/// A copy is of one version of its source file, which its name does not say: rewritten since
/// (same size, mtime put back), the source is another version, and the copy is not served.
#[test]
fn a_reused_copy_of_another_version_of_its_file_is_not_served() {
    let (tmp, catalog, id) = source_with(b"the dataset's bytes");
    let cache = CacheDir::open(&tmp.path().join("cache"), catalog.root_path()).unwrap();
    stage(&cache, &catalog, id);
    let before = version(&catalog, id);
    let path = catalog.source_path(id);
    fs::write(&path, b"THE DATASET'S BYTES").unwrap();
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(before.mtime())
        .unwrap();
    let now = version(&catalog, id);
    assert_eq!((now.size, now.mtime()), (before.size, before.mtime()));
    let e = cache.open_verified(&catalog, id, &now).unwrap_err();
    assert!(matches!(e, CacheError::OtherVersion(_)), "{e}");
    cache.open_verified(&catalog, id, &before).unwrap();
}

#[test]
fn open_empties_a_cache_of_another_non_utf8_source() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (
        tmp.path().join(OsStr::from_bytes(b"src\xe9")),
        tmp.path().join(OsStr::from_bytes(b"src\xe8")),
    );
    let root = tmp.path().join("cache");
    let cache = CacheDir::open(&root, &a).unwrap();
    let kept = cache.data.join("00/f");
    fs::write(&kept, b"x").unwrap();
    drop(cache);
    drop(CacheDir::open(&root, &a).unwrap());
    assert!(kept.exists(), "same source: files kept");
    drop(CacheDir::open(&root, &b).unwrap());
    assert!(!kept.exists(), "another source: emptied");
}

#[test]
fn a_copy_is_opened_once_and_let_go_when_removed() {
    let (tmp, catalog, id) = source_with(b"kept open");
    let cache = CacheDir::open(&tmp.path().join("cache"), catalog.root_path()).unwrap();
    stage(&cache, &catalog, id);
    let first = cache.open_cached(&catalog, id).unwrap();
    let again = cache.open_cached(&catalog, id).unwrap();
    assert!(
        Arc::ptr_eq(&first, &again),
        "the second open shares the first"
    );
    assert_eq!(cache.open_copies.len(), 1);

    cache.remove(&catalog, id);
    assert_eq!(cache.open_copies.len(), 0, "its space must come back");
    assert_eq!(first.file().metadata().unwrap().nlink(), 0);
    let gone = cache.open_cached(&catalog, id).unwrap_err();
    assert_eq!(gone.kind(), io::ErrorKind::NotFound);

    // Staged again over a kept copy: the new copy is served, not the kept one.
    stage(&cache, &catalog, id);
    let kept = cache.open_cached(&catalog, id).unwrap();
    stage(&cache, &catalog, id);
    let restaged = cache.open_cached(&catalog, id).unwrap();
    assert!(!Arc::ptr_eq(&kept, &restaged));
    assert_eq!(restaged.file().metadata().unwrap().nlink(), 1);
    assert_eq!(cache.open_copies.len(), 1);
}

#[test]
fn a_copy_removed_while_being_opened_is_not_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("copy");
    fs::write(&path, b"x").unwrap();
    let opened = File::open(&path).unwrap();
    // The removal unlinked and forgot it between this open and its keeping.
    fs::remove_file(&path).unwrap();
    let copies = OpenCopies::with_capacity(8);
    copies.keep(3, OpenCopy::new(opened));
    assert_eq!(copies.len(), 0);
    assert!(copies.get(3).is_none());
}

#[test]
fn a_full_table_keeps_no_more_and_keeps_what_it_has() {
    let dir = tempfile::tempdir().unwrap();
    let copies = OpenCopies::with_capacity(2);
    let mut kept = Vec::new();
    for id in 0..4 {
        let path = dir.path().join(id.to_string());
        fs::write(&path, b"x").unwrap();
        kept.push(copies.keep(id, OpenCopy::new(File::open(&path).unwrap())));
    }
    assert_eq!(copies.len(), 2);
    assert!(Arc::ptr_eq(&copies.get(0).unwrap(), &kept[0]));
    assert!(Arc::ptr_eq(&copies.get(1).unwrap(), &kept[1]));
    assert!(copies.get(2).is_none() && copies.get(3).is_none());
    copies.forget(0);
    copies.keep(3, OpenCopy::new(File::open(dir.path().join("3")).unwrap()));
    assert!(
        copies.get(3).is_some(),
        "room made by a removal is used again"
    );
}
