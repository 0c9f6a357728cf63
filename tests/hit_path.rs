//! What a cache hit costs the reader in FUSE round trips (issue #14), counted by the daemon
//! itself (`user.stagefs.ops`): one Python `open(path, "rb").read()` of a cached file, as a
//! data loader does it, must not send the daemon more requests than listed here. An added round
//! trip (a GETATTR the attribute cache should have answered, a FLUSH the kernel should have
//! stopped sending, a READ passthrough should have taken) fails the test.
mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const PYTHON: &str = "/usr/bin/python3";

/// The mount's request counts by kind, read through `path` (one GETXATTR).
fn ops(path: &Path) -> BTreeMap<String, u64> {
    let raw = lgetxattr(path, "user.stagefs.ops").expect("user.stagefs.ops");
    serde_json::from_slice(&raw).expect("ops JSON")
}

/// Runs Python's `open(path, "rb").read()` and returns the requests it cost, by kind (those
/// with none left out). RELEASE is sent in the background after close(), so the counts are
/// taken once it has arrived. Left out: GETXATTR (this test's own reads of the counts) and
/// FORGET (the kernel dropping an inode, whenever it likes, not a round trip of the reader).
fn python_read(path: &Path) -> BTreeMap<String, u64> {
    let before = ops(path);
    let code = format!("open({:?}, 'rb').read()", path.to_str().unwrap());
    let out = Command::new(PYTHON)
        .args(["-c", &code])
        .output()
        .expect("run /usr/bin/python3");
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let released = wait_for(Duration::from_secs(5), || {
        ops(path)["release"] > before["release"]
    });
    assert!(released, "no RELEASE after the reader closed the file");
    ops(path)
        .into_iter()
        .filter(|(op, _)| op != "getxattr" && op != "forget")
        .map(|(op, n)| {
            let d = n - before.get(&op).copied().unwrap_or(0);
            (op, d)
        })
        .filter(|&(_, d)| d > 0)
        .collect()
}

/// Mounts a small dataset with `extra` options and returns the mount and a file of it made
/// cached (read once, then staged).
fn mount_with_cached_file(work: &Path, extra: &[&str]) -> (TestMount, std::path::PathBuf) {
    let src = work.join("src");
    let files = image_folder(&src, 4, 1, 20_000, 40_000);
    let mut args = vec!["--sampler", "none"];
    args.extend_from_slice(extra);
    let m = TestMount::new(&src, work, &args);
    let rel = files[0].strip_prefix(&src).unwrap();
    let path = m.mnt.join(rel);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(&files[0]).unwrap()
    );
    let cached = wait_for(Duration::from_secs(20), || {
        xattr(&path, "user.stagefs.state").as_deref() == Some("cached")
    });
    assert!(cached, "{} never became cached", path.display());
    (m, path)
}

/// Asserts every request kind of `cost` is within `allowed` (kinds not listed: none allowed).
fn assert_within(cost: &BTreeMap<String, u64>, allowed: &[(&str, u64)], what: &str) {
    let allowed: BTreeMap<&str, u64> = allowed.iter().copied().collect();
    for (op, &n) in cost {
        let max = allowed.get(op.as_str()).copied().unwrap_or(0);
        assert!(
            n <= max,
            "{what}: {n} {op} requests, at most {max} expected; all: {cost:?}"
        );
    }
}

/// With passthrough, measured on 6.18 with Python 3.11 (the second of two opens, so the
/// entry and attributes are cached as they are for a loader's every file):
/// OPEN 1 (the daemon hands the kernel the cache file), IOCTL 1 (Python's isatty probe,
/// TCGETS, which the kernel forwards on every open: see `ioctl` in src/fs/fuse.rs), RELEASE 1
/// (asynchronous, after close). No LOOKUP or GETATTR (a day's TTL, read-only superblock), no
/// FLUSH (ENOSYS once, remembered), no READ (the kernel reads the cache file itself).
#[test]
fn python_open_read_close_of_a_cached_file_costs_open_ioctl_release() {
    let work = tempfile::tempdir().unwrap();
    let (m, path) = mount_with_cached_file(work.path(), &[]);
    assert_eq!(
        m.stats()["passthrough"],
        true,
        "this test measures the passthrough hit path (needs root and a kernel with it)"
    );
    let first = python_read(&path);
    let second = python_read(&path);
    assert_within(
        &second,
        &[("open", 1), ("ioctl", 1), ("release", 1)],
        "second open of a cached file",
    );
    // The first pays at most a LOOKUP and GETATTR more (the entry was just read and waited on,
    // so normally not even those).
    assert_within(
        &first,
        &[
            ("lookup", 1),
            ("getattr", 1),
            ("open", 1),
            ("ioctl", 1),
            ("release", 1),
        ],
        "first Python open of a cached file",
    );
    // The counts see the reader at all (a counter that missed everything would pass the above).
    assert_eq!(second.get("open"), Some(&1), "{second:?}");
    assert_eq!(second.get("release"), Some(&1), "{second:?}");
}

/// Without passthrough the daemon serves reads, but the page cache the first read filled
/// (FOPEN_KEEP_CACHE) answers a repeated one: measured the same OPEN 1, IOCTL 1, RELEASE 1 and
/// no READ. Should the kernel have dropped those pages, the file comes back in one READ (it is
/// under 128 KiB) and one more at its end at most.
#[test]
fn python_open_read_close_without_passthrough_reads_from_the_page_cache() {
    let work = tempfile::tempdir().unwrap();
    let (m, path) = mount_with_cached_file(work.path(), &["--no-passthrough"]);
    assert_eq!(m.stats()["passthrough"], false);
    python_read(&path);
    let second = python_read(&path);
    assert_within(
        &second,
        &[("open", 1), ("ioctl", 1), ("release", 1), ("read", 2)],
        "second open of a cached file, no passthrough",
    );
    assert_eq!(second.get("open"), Some(&1), "{second:?}");
}
