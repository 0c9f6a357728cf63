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

/// The README's first command: the demo mounts its slow remote and stagefs on it, reads the
/// remote directly and through the mount from its own process (which must not be mistaken for
/// the daemon re-entering itself), prints the bench's table, and unmounts both cleanly.
#[test]
fn the_demo_runs_to_the_end() {
    require_fuse();
    let out = stagefs_within(120, ["demo"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stagefs demo: {stderr}");
    assert!(!stderr.contains("stagefs:"), "an error line: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("unmounted"), "{stdout}");
    // One row per epoch and method: "EPOCH METHOD seconds files/s MB/s hits stall read".
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() == 8 && w[0].parse::<u64>().is_ok())
        .collect();
    for epoch in ["0", "1", "2"] {
        let direct = rows.iter().find(|w| w[0] == epoch && w[1] == "direct");
        assert_eq!(direct.map(|w| w[5]), Some("-"), "epoch {epoch}: {stdout}");
        let stagefs = rows.iter().find(|w| w[0] == epoch && w[1] == "stagefs");
        let hits =
            stagefs.unwrap_or_else(|| panic!("no stagefs row for epoch {epoch}: {stdout}"))[5];
        // Everything is staged during epoch 0 (the default cache holds it all), so the later
        // epochs are all hits.
        if epoch != "0" {
            assert_eq!(hits, "2000/2000", "epoch {epoch}: {stdout}");
        }
    }
    assert!(stdout.contains("stagefs vs direct"), "no ratios: {stdout}");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains("stagefs-demo."),
        "a demo mount is left: {mounts}"
    );
}
