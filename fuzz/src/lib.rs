//! Shared by the fuzz targets: a small source tree full of awkward entries (symlinks that loop,
//! leave the tree, come back in, dangle; a non-UTF-8 name), built once per fuzzing process.
//!
//! libFuzzer ends a run with `exit()`, so statics are never dropped; the tree's directory is
//! removed by an `atexit` hook instead, and nothing is left in TMPDIR.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;

/// Every file and directory of the tree, relative to its root (`d` = directory, `f` = file).
const ENTRIES: &[(&str, &[u8])] = &[
    ("d", b"a"),
    ("f", b"a/x.jpg"),
    ("f", b"a/y.png"),
    ("d", b"a/sub"),
    ("f", b"a/sub/z.jpg"),
    ("d", b"b"),
    ("f", b"b/w.txt"),
    ("d", b"c"),
    ("f", b"c/\xff\xfe.jpg"),
];

/// Symlinks (link, target); `@ROOT` stands for the tree's absolute root, `@NAME` for its name.
const LINKS: &[(&str, &str)] = &[
    ("l_file", "a/x.jpg"),
    ("l_dir", "a"),
    ("l_abs_in", "@ROOT/a/y.png"),
    ("l_abs_out", "/etc/passwd"),
    ("l_up", "../outside.txt"),
    ("l_up_in", "../@NAME/a/x.jpg"),
    ("l_loop1", "l_loop2"),
    ("l_loop2", "l_loop1"),
    ("l_self", "l_self"),
    ("l_dangling", "nope"),
    ("l_chain", "l_dir/sub/l_up2"),
    ("a/l_parent", ".."),
    ("a/sub/l_up2", "../../l_file"),
    ("b/l_escape", "../../.."),
    ("b/l_dir_loop", "../b"),
];

pub struct Tree {
    /// Canonical root of the source tree (`<tmp>/src`); `<tmp>/outside.txt` lies beside it.
    pub root: PathBuf,
}

static TREE_DIR: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_tree() {
    if let Some(dir) = TREE_DIR.get() {
        let _ = fs::remove_dir_all(dir);
    }
}

impl Tree {
    /// Builds the tree in a fresh temporary directory. Call once per process (from a
    /// `OnceLock`); a second call panics.
    pub fn build() -> Tree {
        let dir = tempfile::Builder::new()
            .prefix("stagefs-fuzz-")
            .tempdir()
            .expect("temp dir")
            .keep();
        TREE_DIR.set(dir.clone()).expect("one tree per process");
        // SAFETY: registering a plain extern "C" fn with no captured state.
        unsafe { libc::atexit(remove_tree) };
        let root = fs::canonicalize(&dir)
            .expect("canonical temp dir")
            .join("src");
        fs::write(root.with_file_name("outside.txt"), b"outside").expect("outside file");
        fs::create_dir(&root).expect("root");
        for (kind, rel) in ENTRIES {
            let path = root.join(OsStr::from_bytes(rel));
            match *kind {
                "d" => fs::create_dir(&path).expect("dir"),
                _ => fs::write(&path, rel).expect("file"),
            }
        }
        let name = root
            .file_name()
            .expect("root name")
            .to_str()
            .expect("utf-8");
        for (link, target) in LINKS {
            let target = target
                .replace("@ROOT", root.to_str().expect("utf-8 temp dir"))
                .replace("@NAME", name);
            symlink(target, root.join(link)).expect("symlink");
        }
        Tree { root }
    }
}

/// `path` with only its normal components: what a lookup that refuses `..` and ignores `.`
/// and repeated slashes should find.
pub fn normal_components(path: &Path) -> PathBuf {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect()
}

/// Whether `path` (relative) could be looked up at all: no `..`, not absolute.
pub fn stays_inside(path: &Path) -> bool {
    !path.components().any(|c| {
        matches!(
            c,
            Component::ParentDir | Component::RootDir | Component::Prefix(_)
        )
    })
}
