//! Tests of the layouts against torchvision's golden listing, and of --list-file checks.

use super::*;
use crate::catalog::Walking;
use std::fs;

fn tree() -> LayoutSpec {
    LayoutSpec {
        kind: LayoutKind::Tree,
        ..LayoutSpec::default()
    }
}

/// Builds the golden tricky tree from tests/data/golden/imagefolder/tree.txt.
pub(crate) fn golden_tree(dir: &Path) {
    let spec = fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/golden/imagefolder/tree.txt"
    ))
    .unwrap();
    for line in spec
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let (kind, rest) = line.split_at(2);
        match kind.trim() {
            "f" => {
                let p = dir.join(rest);
                fs::create_dir_all(p.parent().unwrap()).unwrap();
                fs::write(&p, rest).unwrap();
            }
            "d" => fs::create_dir_all(dir.join(rest)).unwrap(),
            "l" => {
                let (link, target) = rest.split_once(" -> ").unwrap();
                let p = dir.join(link);
                fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::os::unix::fs::symlink(target, p).unwrap();
            }
            other => panic!("bad tree.txt line kind {other}"),
        }
    }
}

#[test]
fn image_folder_matches_torchvision_golden() {
    let tmp = tempfile::tempdir().unwrap();
    golden_tree(tmp.path());
    let expected: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/golden/imagefolder/expected.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let catalog = Catalog::scan(tmp.path(), Walking::threads(2)).unwrap();
    let exts: Vec<String> = DEFAULT_EXTENSIONS.iter().map(|s| s.to_string()).collect();
    let spec = LayoutSpec {
        extensions: exts,
        ..LayoutSpec::default()
    };
    let layout = Layout::build(&catalog, ROOT, &spec).unwrap();
    let classes: Vec<&str> = expected["classes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(layout.classes(), classes.as_slice());
    let samples = expected["samples"].as_array().unwrap();
    assert_eq!(layout.len(), samples.len());
    for s in samples {
        let index = s["index"].as_u64().unwrap() as u32;
        let path = s["path"].as_str().unwrap();
        // The sample's own path resolves to the file the layout names.
        let want = catalog
            .resolve(catalog.lookup_path(Path::new(path)).unwrap())
            .unwrap();
        assert_eq!(layout.file_of(index), Some(want), "index {index} ({path})");
        // Each golden file's content is its real path: the file we would stage is right.
        let real = fs::read_to_string(catalog.source_path(want)).unwrap();
        assert_eq!(Path::new(&real), catalog.relative_path(want), "{path}");
    }
}

#[test]
fn tree_sorts_by_path_bytes_not_walk_order() {
    let tmp = tempfile::tempdir().unwrap();
    for p in ["a/x/b.jpg", "a/x-y/a.jpeg", "a/x/z/q.webp", "b.txt"] {
        let f = tmp.path().join(p);
        fs::create_dir_all(f.parent().unwrap()).unwrap();
        fs::write(f, p).unwrap();
    }
    let catalog = Catalog::scan(tmp.path(), Walking::threads(2)).unwrap();
    let layout = Layout::build(&catalog, ROOT, &tree()).unwrap();
    let paths: Vec<PathBuf> = (0..layout.len() as u32)
        .map(|i| catalog.relative_path(layout.file_of(i).unwrap()))
        .collect();
    let want: Vec<PathBuf> = ["a/x-y/a.jpeg", "a/x/b.jpg", "a/x/z/q.webp", "b.txt"]
        .iter()
        .map(PathBuf::from)
        .collect();
    assert_eq!(paths, want);
}

/// What `stagefs mount` checks before it starts the daemon.
#[test]
fn list_file_checked_before_the_scan() {
    let tmp = tempfile::tempdir().unwrap();
    let list = tmp.path().join("list.txt");
    for (text, want) in [
        (&b""[..], "names no file"),
        (b"\n", "names no file"),
        (b"a.jpg\n../b.jpg\n", "line 2: '../b.jpg' contains '..'"),
        (b"a.jpg\r\n\r\n", "line 2: empty line"),
    ] {
        fs::write(&list, text).unwrap();
        let msg = check_list_file(&list).unwrap_err().to_string();
        assert!(
            msg.starts_with("--list-file ") && msg.contains(want),
            "{msg}"
        );
    }
    fs::write(&list, b"not/yet/known.jpg\n").unwrap();
    assert!(
        check_list_file(&list).is_ok(),
        "existence is checked after the scan"
    );
    let msg = check_list_file(&tmp.path().join("nope"))
        .unwrap_err()
        .to_string();
    assert!(msg.starts_with("cannot read --list-file "), "{msg}");
}

#[test]
fn list_file_errors_name_the_line() {
    let tmp = tempfile::tempdir().unwrap();
    fs::create_dir_all(tmp.path().join("d")).unwrap();
    fs::write(tmp.path().join("d/a.jpg"), b"x").unwrap();
    let catalog = Catalog::scan(tmp.path(), Walking::threads(1)).unwrap();
    assert_eq!(
        parse_list(&catalog, ROOT, b"d/a.jpg\nd/a.jpg\n")
            .unwrap()
            .len(),
        2
    );
    for (text, line, needle) in [
        (&b"d/a.jpg\n../etc/passwd\n"[..], 2, ".."),
        (b"/etc/passwd\n", 1, "absolute"),
        (b"d/a.jpg\n\nd/a.jpg\n", 2, "empty"),
        (b"d/missing.jpg\n", 1, "does not exist"),
        (b"d\n", 1, "not a regular file"),
    ] {
        let (got_line, reason) = parse_list(&catalog, ROOT, text).unwrap_err();
        assert_eq!(got_line, line, "{reason}");
        assert!(reason.contains(needle), "{reason}");
    }
}

/// A dataset root with train/ and val/: each split is a dataset of its own, numbered as
/// `ImageFolder(root/train)` numbers it, and the root as a whole is another.
#[test]
fn any_directory_can_be_a_dataset_root() {
    let tmp = tempfile::tempdir().unwrap();
    for p in [
        "train/b/2.jpg",
        "train/a/1.jpg",
        "train/a/0.jpg",
        "val/a/9.jpg",
        "notes.txt",
    ] {
        let f = tmp.path().join(p);
        fs::create_dir_all(f.parent().unwrap()).unwrap();
        fs::write(f, p).unwrap();
    }
    let catalog = std::sync::Arc::new(Catalog::scan(tmp.path(), Walking::threads(1)).unwrap());
    let datasets = Datasets::new(catalog.clone(), LayoutSpec::default());
    let paths = |layout: &Layout| -> Vec<PathBuf> {
        (0..layout.len() as u32)
            .map(|i| catalog.relative_path(layout.file_of(i).unwrap()))
            .collect()
    };
    let train = datasets.at(Path::new("train")).unwrap();
    assert_eq!(train.classes(), ["a", "b"]);
    let want: Vec<PathBuf> = ["train/a/0.jpg", "train/a/1.jpg", "train/b/2.jpg"]
        .iter()
        .map(PathBuf::from)
        .collect();
    assert_eq!(paths(&train), want);
    assert_eq!(dataset_name(&catalog, train.root()), "train");
    let val = datasets.at(Path::new("val")).unwrap();
    assert!(val.contains(catalog.lookup_path(Path::new("val/a/9.jpg")).unwrap()));
    assert!(!val.contains(train.file_of(0).unwrap()));
    let whole = datasets.at(Path::new(".")).unwrap();
    assert_eq!(
        (whole.classes(), whole.len()),
        (&["train".to_string(), "val".into()][..], 4)
    );
    // Built once, then kept.
    assert!(std::sync::Arc::ptr_eq(
        &train,
        &datasets.at(Path::new("train")).unwrap()
    ));
    let err = datasets.at(Path::new("test")).err().unwrap().to_string();
    assert!(err.contains("--dataset test"), "{err}");
    let err = datasets.at(Path::new("val/a")).err().unwrap().to_string();
    assert!(err.contains("no samples in the source's val/a"), "{err}");
}
