//! Tests of the catalog index: round trips, and refusal of corrupt, foreign and stale files.

use super::*;

fn encode(catalog: &Catalog) -> Vec<u8> {
    let mut out = Vec::new();
    encode_to(catalog, &mut out).unwrap();
    out
}

fn decode(bytes: &[u8]) -> Result<Catalog, DecodeError> {
    decode_from(bytes, bytes.len() as u64)
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
    let catalog = Catalog::scan(&root, 2).unwrap();
    (dir, catalog)
}

#[test]
fn round_trip_keeps_every_entry() {
    let (dir, catalog) = sample();
    let path = dir.path().join("index.bin");
    save(&catalog, &path).unwrap();
    let loaded = load(&path, catalog.root_path()).unwrap();
    assert_eq!(loaded.len(), catalog.len());
    for id in 0..catalog.len() as FileId {
        assert_eq!(loaded.relative_path(id), catalog.relative_path(id));
        // Braces copy the packed fields out before assert_eq! borrows them.
        assert_eq!({ loaded.entry(id).unwrap().size }, {
            catalog.entry(id).unwrap().size
        });
        assert_eq!(loaded.link_target(id), catalog.link_target(id));
    }
    assert_eq!(loaded.file_count(), catalog.file_count());
    check_fresh(&loaded, &path, 2).unwrap();
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
fn other_versions_and_sources_and_changes_are_refused() {
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
    // A file added to a directory changes its mtime: the index is stale.
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(catalog.root_path().join("b/new.jpg"), b"new").unwrap();
    let loaded = load(&path, catalog.root_path()).unwrap();
    let err = check_fresh(&loaded, &path, 2).unwrap_err();
    assert!(err.to_string().contains("/b"), "{err}");
}
