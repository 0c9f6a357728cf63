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
