//! The cache directory is stagefs's alone, through the real binary: a directory that is not
//! stagefs's (the user's files, shared, someone else's) is refused as it is, nothing deleted or
//! chmod'ed; a link planted where stagefs writes is not followed; a cached copy changed in
//! place is not served after a remount, while an intact cache is still reused.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::{TestMount, stagefs, walk_files, write_tree};

/// A small source tree: (relative path, content), sizes differing.
fn files() -> Vec<(String, Vec<u8>)> {
    (0..6)
        .map(|i| {
            let rel = format!("{}/{}.jpg", ["a", "b"][i % 2], i / 2);
            (
                rel,
                format!("sample {i} ").repeat(500 + i * 37).into_bytes(),
            )
        })
        .collect()
}

fn source(work: &Path) -> PathBuf {
    let src = work.join("src");
    let all = files();
    let tree: Vec<(&str, Vec<u8>)> = all.iter().map(|(r, c)| (r.as_str(), c.clone())).collect();
    write_tree(&src, &tree);
    src
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

/// Every file under `dir` with its content, for "untouched" checks.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut all: Vec<_> = walk_files(dir)
        .into_iter()
        .map(|f| {
            let content = fs::read(&f).unwrap();
            (f, content)
        })
        .collect();
    all.sort();
    all
}

/// Mounting with `work/cache` as it is now must fail with a message containing `why`, leave
/// every file and the directory's mode as they were, and create nothing in it.
fn assert_refused(work: &Path, why: &str) {
    let cache = work.join("cache");
    let (before, mode_before) = (snapshot(&cache), mode(&cache));
    let entries_before = fs::read_dir(&cache).unwrap().count();
    let err = match TestMount::try_new(&source(work), work, &[]) {
        Ok(m) => {
            m.unmount();
            panic!("mounted with a cache that is not stagefs's ({why})");
        }
        Err(e) => e,
    };
    assert!(err.contains(why), "message {err:?} does not say {why:?}");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert_eq!(snapshot(&cache), before, "files changed");
    assert_eq!(mode(&cache), mode_before, "mode changed");
    assert_eq!(
        fs::read_dir(&cache).unwrap().count(),
        entries_before,
        "created something"
    );
}

#[test]
fn a_directory_with_the_users_own_data_and_tmp_is_refused_untouched() {
    let work = tempfile::tempdir().unwrap();
    let cache = work.path().join("cache");
    write_tree(
        &cache,
        &[
            ("data/results.csv", b"1,2,3\n".to_vec()),
            ("tmp/draft.txt", b"keep me".to_vec()),
        ],
    );
    fs::set_permissions(&cache, fs::Permissions::from_mode(0o755)).unwrap();
    assert_refused(work.path(), "not stagefs's");
    assert_eq!(fs::read(cache.join("tmp/draft.txt")).unwrap(), b"keep me");
}

#[test]
fn a_world_writable_directory_is_refused_and_keeps_its_mode() {
    for m in [0o1777, 0o770] {
        let work = tempfile::tempdir().unwrap();
        let cache = work.path().join("cache");
        fs::create_dir(&cache).unwrap();
        fs::set_permissions(&cache, fs::Permissions::from_mode(m)).unwrap();
        assert_refused(work.path(), "can be written by others");
        assert_eq!(mode(&cache), m);
    }
}

#[test]
fn a_directory_owned_by_someone_else_is_refused() {
    let work = tempfile::tempdir().unwrap();
    let cache = work.path().join("cache");
    fs::create_dir(&cache).unwrap();
    std::os::unix::fs::chown(&cache, Some(65534), Some(65534)).unwrap();
    assert_refused(work.path(), "belongs to uid 65534");
    // Files planted there would otherwise be served as the dataset.
    assert_eq!(fs::metadata(&cache).unwrap().uid(), 65534);
}

#[test]
fn a_planted_log_link_is_not_followed() {
    let work = tempfile::tempdir().unwrap();
    let src = source(work.path());
    // A valid cache, made by a first mount.
    TestMount::new(&src, work.path(), &[]).unmount();
    let victim = work.path().join("victim");
    fs::write(&victim, b"root's file\n").unwrap();
    let cache = work.path().join("cache");
    let log = cache.join("stagefs/stagefs.log");
    let _ = fs::remove_file(&log);
    std::os::unix::fs::symlink(&victim, &log).unwrap();
    let mnt = work.path().join("mnt");
    // The default log, in the cache.
    let out = stagefs(&[
        "mount",
        src.to_str().unwrap(),
        mnt.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mounted through a planted log link");
    assert!(err.contains("symbolic link"), "{err}");
    // An explicit --log-file that is a link.
    fs::remove_file(&log).unwrap();
    let explicit = work.path().join("stagefs.log");
    fs::remove_file(&explicit).unwrap();
    std::os::unix::fs::symlink(&victim, &explicit).unwrap();
    let err = TestMount::try_new(&src, work.path(), &[]).map(TestMount::unmount);
    assert!(err.is_err_and(|e| e.contains("symbolic link")));
    assert_eq!(
        fs::read(&victim).unwrap(),
        b"root's file\n",
        "the link was followed"
    );
}

/// The cached copy with this content (every file's content differs).
fn cached_copy(cache: &Path, content: &[u8]) -> PathBuf {
    walk_files(cache)
        .into_iter()
        .find(|f| fs::read(f).unwrap() == content)
        .expect("a cached copy")
}

#[test]
fn a_cached_copy_changed_in_place_is_staged_again_after_a_remount() {
    let work = tempfile::tempdir().unwrap();
    let src = source(work.path());
    let all = files();
    let m = TestMount::new(&src, work.path(), &["--sampler", "none"]);
    for (rel, content) in &all {
        assert_eq!(&fs::read(m.mnt.join(rel)).unwrap(), content);
    }
    assert_eq!(
        m.wait_stat("cached_files", all.len() as u64),
        all.len() as u64
    );
    m.unmount();

    // Same size, mtime restored: invisible to a size and mtime check.
    let (rel, content) = &all[2];
    let copy = cached_copy(&work.path().join("cache"), content);
    let mtime = fs::metadata(&copy).unwrap().modified().unwrap();
    let mut tampered = content.clone();
    tampered[..8].copy_from_slice(b"TAMPERED");
    fs::write(&copy, &tampered).unwrap();
    fs::File::options()
        .write(true)
        .open(&copy)
        .unwrap()
        .set_modified(mtime)
        .unwrap();

    let m = TestMount::new(&src, work.path(), &["--sampler", "none"]);
    assert_eq!(m.stat("reused_files"), all.len() as u64);
    for (rel, content) in &all {
        assert!(
            &fs::read(m.mnt.join(rel)).unwrap() == content,
            "{rel}: not SOURCE's bytes"
        );
    }
    assert_eq!(m.stat("staged_files"), 1, "only {rel} staged again");
    assert_eq!(m.stat("hits"), all.len() as u64 - 1);
    assert_eq!(&fs::read(cached_copy(&m.cache, content)).unwrap(), content);
    m.unmount();
}

#[test]
fn an_intact_cache_is_still_reused() {
    let work = tempfile::tempdir().unwrap();
    let src = source(work.path());
    let all = files();
    let m = TestMount::new(&src, work.path(), &["--sampler", "none"]);
    for (rel, _) in &all {
        fs::read(m.mnt.join(rel)).unwrap();
    }
    m.wait_stat("cached_files", all.len() as u64);
    m.unmount();
    let m = TestMount::new(&src, work.path(), &["--sampler", "none"]);
    assert_eq!(m.stat("reused_files"), all.len() as u64);
    for (rel, content) in &all {
        assert_eq!(&fs::read(m.mnt.join(rel)).unwrap(), content);
    }
    assert_eq!(m.stat("hits"), all.len() as u64);
    assert_eq!(m.stat("staged_files"), 0);
    m.unmount();
}

/// The metrics and log files stagefs writes (as root, often into shared directories) never
/// replace, follow or block on what someone else put there.
#[test]
fn metrics_and_log_files_never_take_what_others_put_there() {
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path();
    // A shared directory, as /tmp is.
    let shared = work.join("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
    let notes = shared.join("notes.txt");
    fs::write(&notes, b"a user's precious notes").unwrap();
    std::os::unix::fs::chown(&notes, Some(65534), Some(65534)).unwrap();
    let own = shared.join("own.txt");
    fs::write(&own, b"root's own text, not metrics").unwrap();
    let fifo = shared.join("fifo");
    stagefs::sys::mkfifo(&fifo, 0o666).unwrap();
    let src = source(work);
    let mnt = work.join("mnt");
    fs::create_dir(&mnt).unwrap();
    let mount = |extra: &[&str]| {
        let mut args = vec![
            "mount",
            src.to_str().unwrap(),
            mnt.to_str().unwrap(),
            "--cache",
        ];
        let cache = work.join("cache");
        let cache = cache.to_str().unwrap().to_string();
        args.push(&cache);
        args.extend_from_slice(extra);
        let out = common::stagefs_within(20, &args);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (option, path, why) in [
        ("--metrics-file", &notes, "belongs to another user"),
        (
            "--metrics-file",
            &own,
            "something other than stagefs metrics",
        ),
        ("--metrics-file", &fifo, "not a regular file"),
        ("--log-file", &notes, "belongs to another user"),
        ("--log-file", &fifo, "not a regular file"),
    ] {
        let (ok, stderr) = mount(&[option, path.to_str().unwrap()]);
        assert!(!ok && stderr.contains(why), "{option} {path:?}: {stderr}");
        assert!(!common::is_mounted(&mnt), "{option} {path:?} mounted");
    }
    assert_eq!(fs::read(&notes).unwrap(), b"a user's precious notes");
    assert_eq!(fs::read(&own).unwrap(), b"root's own text, not metrics");

    // A metrics file of its own, in the shared directory: written, and replaced next time.
    let metrics = shared.join("stagefs.prom");
    let (ok, stderr) = mount(&["--metrics-file", metrics.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(common::wait_for(std::time::Duration::from_secs(10), || {
        fs::read(&metrics).is_ok_and(|m| m.starts_with(b"# HELP stagefs_"))
    }));
    assert!(
        stagefs(&["unmount", mnt.to_str().unwrap()])
            .status
            .success()
    );
    let (ok, stderr) = mount(&["--metrics-file", metrics.to_str().unwrap()]);
    assert!(ok, "a previous metrics file may be replaced: {stderr}");
    assert!(
        stagefs(&["unmount", mnt.to_str().unwrap()])
            .status
            .success()
    );
}
