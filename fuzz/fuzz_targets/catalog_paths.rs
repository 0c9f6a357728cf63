//! Path handling on a real tree: `Catalog::lookup_path` and `Catalog::resolve` on arbitrary
//! relative paths and an arbitrary symlink target (the link `a/fz`, rewritten each run).
//!
//! Oracle: the kernel. A lookup finds exactly the entry `lstat` finds when every parent is a
//! real directory, and nothing for `..` or absolute paths. A resolution, when it succeeds,
//! names a non-link entry of the catalog, which is the file the kernel reaches through the
//! same path (so it is inside SOURCE); it may refuse only what the kernel cannot resolve
//! without going above SOURCE (`openat2(RESOLVE_BENEATH)` fails).
#![no_main]

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use stagefs::catalog::{Catalog, FileId, Kind, Walking};
use stagefs_fuzz::{Tree, normal_components, stays_inside};

static TREE: OnceLock<Tree> = OnceLock::new();

/// Whether every proper prefix of `rel` is a real directory (no symlink on the way).
fn parents_are_directories(root: &Path, rel: &Path) -> bool {
    let mut cur = root.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    parts[..parts.len().saturating_sub(1)].iter().all(|c| {
        cur.push(c);
        cur.symlink_metadata().is_ok_and(|m| m.is_dir())
    })
}

fn check_resolve(catalog: &Catalog, root: &Path, id: FileId) {
    let path = catalog.source_path(id);
    let Some(target) = catalog.resolve(id) else {
        // Refusing is wrong only if the kernel follows the path without ever leaving SOURCE.
        if let Some(real) = resolve_beneath(root, &catalog.relative_path(id)) {
            panic!("{path:?} stays inside the source (to {real:?}) but the catalog refuses it");
        }
        return;
    };
    let entry = catalog.entry(target).expect("resolved id exists");
    assert_ne!(entry.kind, Kind::Symlink, "{path:?} resolved to a link");
    let ours = catalog.source_path(target);
    match fs::canonicalize(&path) {
        Ok(real) => assert_eq!(real, ours, "{path:?}: kernel and catalog disagree"),
        Err(e) => panic!("{path:?} resolved to {ours:?} but the kernel says {e}"),
    }
}

/// Where the kernel resolves `rel` under `root` when told never to go above `root` and not
/// to follow absolute links (`openat2` with `RESOLVE_BENEATH`), or None if it cannot.
fn resolve_beneath(root: &Path, rel: &Path) -> Option<PathBuf> {
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).expect("no NUL");
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let (root_c, rel_c) = (c(root), c(rel));
    // SAFETY: plain syscalls on valid C strings and a properly sized open_how.
    unsafe {
        let dir = libc::open(
            root_c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        assert!(dir >= 0, "open root");
        let mut how: libc::open_how = std::mem::zeroed();
        how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
        how.resolve = libc::RESOLVE_BENEATH;
        let fd = libc::syscall(
            libc::SYS_openat2,
            dir,
            rel_c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        ) as i32;
        libc::close(dir);
        if fd < 0 {
            return None;
        }
        let real = fs::read_link(format!("/proc/self/fd/{fd}")).ok();
        libc::close(fd);
        real
    }
}

fuzz_target!(|data: &[u8]| {
    let tree = TREE.get_or_init(Tree::build);
    let root = &tree.root;
    let (target, rel) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b""[..]),
    };
    let link = root.join("a/fz");
    let _ = fs::remove_file(&link);
    if !target.is_empty() {
        std::os::unix::fs::symlink(OsStr::from_bytes(target), &link).expect("symlink");
    }
    let catalog = Catalog::scan(root, Walking::threads(1)).expect("scan");

    let rel = Path::new(OsStr::from_bytes(rel));
    let found = catalog.lookup_path(rel);
    // What lstat should see: the path without `.`, repeated or trailing slashes (a trailing
    // slash would make the kernel follow a final symlink; the lookup never follows).
    let on_disk = root.join(normal_components(rel));
    if !stays_inside(rel) {
        assert_eq!(found, None, "{rel:?} leaves the root but was found");
    } else if let Some(id) = found {
        assert_eq!(catalog.relative_path(id), normal_components(rel));
        let meta = on_disk.symlink_metadata().expect("found entry exists");
        let kind = catalog.entry(id).expect("id").kind;
        assert_eq!(meta.is_dir(), kind == Kind::Directory, "{rel:?}");
        assert_eq!(
            meta.file_type().is_symlink(),
            kind == Kind::Symlink,
            "{rel:?}"
        );
        check_resolve(&catalog, root, id);
    } else if parents_are_directories(root, rel) && !rel.as_os_str().is_empty() {
        assert!(
            on_disk.symlink_metadata().is_err(),
            "{rel:?} exists but was not found"
        );
    }
    // Every link of the tree, the fuzzed one included.
    for id in 0..catalog.len() as FileId {
        if catalog.entry(id).expect("id").kind == Kind::Symlink {
            check_resolve(&catalog, root, id);
        }
    }
});
