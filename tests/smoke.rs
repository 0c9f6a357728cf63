//! The smallest real-mount round trip; the fuller suites live in their own files.
mod common;

use common::*;

#[test]
fn mount_read_unmount() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    write_tree(&src, &[("a/x.jpg", b"hello".to_vec())]);
    let m = TestMount::new(&src, work.path(), &[]);
    assert_eq!(std::fs::read(m.mnt.join("a/x.jpg")).unwrap(), b"hello");
    assert_eq!(m.stat("hits") + m.stat("misses"), 1);
    let mnt = m.mnt.clone();
    m.unmount();
    assert!(!is_mounted(&mnt));
}

/// The README's first command: the demo mounts, reads through the mount from its own process
/// (which must not be mistaken for the daemon re-entering itself), and unmounts cleanly.
#[test]
fn the_demo_runs_to_the_end() {
    require_fuse();
    let out = stagefs_within(120, ["demo"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stagefs demo: {stderr}");
    assert!(!stderr.contains("stagefs:"), "an error line: {stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("unmounted"));
}
