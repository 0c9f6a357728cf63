//! `--list-file` contents: `list_paths` turns every line into a relative path that cannot
//! leave SOURCE (or names the first bad line), and looking those paths up in a real catalog
//! finds exactly the entries that exist there, never anything outside.
#![no_main]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use stagefs::catalog::{Catalog, Walking, list_paths};
use stagefs_fuzz::{Tree, normal_components, stays_inside};

static CATALOG: OnceLock<(Tree, Catalog)> = OnceLock::new();

/// The shape rule for one line (after a trailing `\r` is removed).
fn good_line(line: &[u8]) -> bool {
    !line.is_empty() && stays_inside(Path::new(OsStr::from_bytes(line)))
}

fuzz_target!(|data: &[u8]| {
    let (tree, catalog) = CATALOG.get_or_init(|| {
        let tree = Tree::build();
        let catalog = Catalog::scan(&tree.root, Walking::threads(1)).expect("scan");
        (tree, catalog)
    });
    let body = data.strip_suffix(b"\n").unwrap_or(data);
    let lines: Vec<&[u8]> = if body.is_empty() {
        Vec::new()
    } else {
        body.split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
            .collect()
    };
    match list_paths(data) {
        Ok(paths) => {
            assert_eq!(paths.len(), lines.len(), "one sample per line");
            for (path, line) in paths.iter().zip(&lines) {
                assert_eq!(path.as_os_str().as_bytes(), *line);
                assert!(good_line(line), "accepted {path:?}");
                if let Some(id) = catalog.lookup_path(path) {
                    assert_eq!(catalog.relative_path(id), normal_components(path));
                    let on_disk = tree.root.join(catalog.relative_path(id));
                    assert!(
                        on_disk.symlink_metadata().is_ok(),
                        "{on_disk:?} is not there"
                    );
                }
            }
        }
        Err((line, reason)) => {
            assert!(
                (1..=lines.len()).contains(&line),
                "line {line} of {}",
                lines.len()
            );
            assert!(!good_line(lines[line - 1]), "line {line} is fine: {reason}");
            assert!(
                lines[..line - 1].iter().all(|l| good_line(l)),
                "an earlier line is bad"
            );
            assert!(!reason.contains('\n'), "one-line message");
        }
    }
});
