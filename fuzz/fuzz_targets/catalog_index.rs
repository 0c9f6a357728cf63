//! The catalog index format (`stagefs index`, `CACHE/stagefs/index.bin`): whatever the bytes,
//! loading never panics nor allocates more than the input can back, and what it accepts is a
//! tree lookups can rely on.
//!
//! Oracle: the catalog's own API. Every entry is found again by its name in its parent and by
//! its path from the root; directories hold their children in sorted order; links, and only
//! links, have targets; no attribute comes from the file (a mount asks SOURCE); and an accepted
//! index written back and read again lists exactly the same entries.
#![no_main]

use std::os::unix::ffi::OsStrExt;

use libfuzzer_sys::fuzz_target;
use stagefs::catalog::index::{Loaded, decode_from, save};
use stagefs::catalog::{Catalog, FileId, Kind, ROOT};

/// Every entry's parent, name, kind and link target, in id order.
fn listing(c: &Catalog) -> Vec<(FileId, Vec<u8>, Kind, Option<Vec<u8>>)> {
    (0..c.len() as FileId)
        .map(|id| {
            let e = c.entry(id).expect("an id below len");
            let target = c.link_target(id).map(|t| t.as_bytes().to_vec());
            (e.parent, c.name(id).as_bytes().to_vec(), e.kind, target)
        })
        .collect()
}

fn check(c: &Catalog) {
    for id in 0..c.len() as FileId {
        let e = c.entry(id).expect("an id below len");
        assert_eq!(c.attributes(id), None, "entry {id}: attributes from the file");
        assert_eq!(c.link_target(id).is_some(), e.kind == Kind::Symlink, "entry {id}");
        if id != ROOT {
            assert_eq!(c.lookup(e.parent, c.name(id)), Some(id), "entry {id} by name");
            assert_eq!(c.lookup_path(&c.relative_path(id)), Some(id), "entry {id} by path");
        }
        let kids: Vec<FileId> = c.children(id).collect();
        assert!(kids.windows(2).all(|w| c.name(w[0]) < c.name(w[1])), "dir {id}");
        assert!(kids.iter().all(|&k| c.entry(k).unwrap().parent == id), "dir {id}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(loaded) = decode_from(data, data.len() as u64) else {
        return;
    };
    let loaded: Loaded = loaded;
    let catalog = loaded.catalog();
    check(catalog);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("index.bin");
    save(catalog, &path).expect("an accepted index is written back");
    let bytes = std::fs::read(&path).expect("read back");
    let again = decode_from(&bytes[..], bytes.len() as u64).expect("written back, accepted");
    assert_eq!(listing(again.catalog()), listing(catalog));
});
