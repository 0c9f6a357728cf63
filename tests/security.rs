//! Who can see what: other users and the mount (`--allow-other` or not), the source's
//! permission bits, the privacy of the cache directory, and symlinks that point outside
//! SOURCE (they are shown as links, never served or staged by the daemon).
//!
//! "Another user" is uid/gid 65534 (nobody) via `setpriv`; the tests run as root, which
//! mounts with `--allow-other` without needing `user_allow_other` in /etc/fuse.conf.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;
use std::process::{Command, Output};

use common::*;

const NOBODY: &str = "65534";

/// Runs `cmd args...` as uid/gid 65534 with no supplementary groups.
fn as_nobody(cmd: &str, args: &[&Path]) -> Output {
    Command::new("setpriv")
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "timeout",
            "20",
            cmd,
        ])
        .args(args)
        .output()
        .expect("run setpriv (util-linux)")
}

/// Asserts `cmd path` as nobody fails with "Permission denied".
fn denied(cmd: &str, path: &Path) {
    let out = as_nobody(cmd, &[path]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("Permission denied"),
        "{cmd} {path:?} as nobody: {out:?}"
    );
}

/// A work directory others may traverse (tempdir makes it 0700), so that what they are
/// refused is refused by the mount or the cache, not by the path to them.
fn open_workdir() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let control = tmp.path().join("control.txt");
    fs::write(&control, b"control").unwrap();
    let out = as_nobody("cat", &[&control]);
    assert_eq!(
        out.stdout, b"control",
        "nobody cannot reach the work directory: {out:?}"
    );
    tmp
}

/// `c1/pub.jpg` 0644, `c1/secret.jpg` 0600, `c2/` 0700 holding a 0644 file; all root's.
fn dataset(work: &Path) -> std::path::PathBuf {
    let src = work.join("src");
    write_tree(
        &src,
        &[
            ("c1/pub.jpg", b"public".to_vec()),
            ("c1/secret.jpg", b"secret".to_vec()),
            ("c2/x.jpg", b"hidden".to_vec()),
        ],
    );
    let mode =
        |p: &str, m| fs::set_permissions(src.join(p), fs::Permissions::from_mode(m)).unwrap();
    mode("c1/pub.jpg", 0o644);
    mode("c1/secret.jpg", 0o600);
    mode("c2", 0o700);
    src
}

#[test]
fn without_allow_other_other_users_get_eacces() {
    let tmp = open_workdir();
    let src = dataset(tmp.path());
    let m = TestMount::new(&src, tmp.path(), &[]);
    assert_eq!(fs::read(m.mnt.join("c1/pub.jpg")).unwrap(), b"public");
    for (cmd, path) in [("cat", "c1/pub.jpg"), ("ls", ""), ("stat", "c1")] {
        denied(cmd, &m.mnt.join(path));
    }
}

#[test]
fn allow_other_enforces_the_source_permission_bits() {
    let tmp = open_workdir();
    let src = dataset(tmp.path());
    let m = TestMount::new(&src, tmp.path(), &["--allow-other"]);
    let out = as_nobody("cat", &[&m.mnt.join("c1/pub.jpg")]);
    assert_eq!(out.stdout, b"public", "{out:?}");
    denied("cat", &m.mnt.join("c1/secret.jpg"));
    denied("ls", &m.mnt.join("c2"));
    denied("cat", &m.mnt.join("c2/x.jpg"));
    denied("touch", &m.mnt.join("c1/new.jpg"));
    // Root may read everything (the bits say so) and still write nothing.
    assert_eq!(fs::read(m.mnt.join("c1/secret.jpg")).unwrap(), b"secret");
    let err = fs::write(m.mnt.join("c1/new.jpg"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
}

#[test]
fn cache_directory_is_private() {
    let tmp = open_workdir();
    let src = dataset(tmp.path());
    let m = TestMount::new(&src, tmp.path(), &["--allow-other"]);
    assert_eq!(m.wait_stat("cached_files", 3), 3);
    let files = walk_files(&m.cache);
    assert!(files.len() >= 5, "lock, manifest, 3 data files: {files:?}");
    for f in files.iter().chain([&m.log]) {
        let mode = f.metadata().unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600, "{f:?} is {mode:o}");
    }
    let mut dirs = vec![m.cache.clone()];
    while let Some(d) = dirs.pop() {
        let mode = d.metadata().unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700, "{d:?} is {mode:o}");
        dirs.extend(
            fs::read_dir(&d)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir()),
        );
    }
    denied("ls", &m.cache);
    denied("cat", &m.cache.join("stagefs/manifest.json"));
    let data_file = files
        .iter()
        .find(|f| f.starts_with(m.cache.join("stagefs/data")))
        .unwrap();
    denied("cat", data_file);
}

#[test]
fn links_out_of_the_source_are_never_served_or_staged() {
    let shadow = fs::read("/etc/shadow").expect("/etc/shadow (Debian has one)");
    let tmp = open_workdir();
    let src = tmp.path().join("src");
    write_tree(&src, &[("c1/a.jpg", b"inside".to_vec())]);
    let secret = tmp.path().join("secret.txt");
    fs::write(&secret, b"outside secret").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    symlink("/etc/shadow", src.join("c1/shadow.jpg")).unwrap();
    symlink("../../secret.txt", src.join("c1/secret.jpg")).unwrap();
    let m = TestMount::new(&src, tmp.path(), &["--allow-other"]);

    let link = m.mnt.join("c1/shadow.jpg");
    assert!(link.symlink_metadata().unwrap().file_type().is_symlink());
    assert_eq!(fs::read_link(&link).unwrap(), Path::new("/etc/shadow"));
    // Through the mount exactly as directly: the kernel follows the link to the real file,
    // whose own permissions refuse nobody.
    let direct = as_nobody("cat", &[Path::new("/etc/shadow")]);
    let via_mount = as_nobody("cat", &[&link]);
    assert!(!direct.status.success() && !via_mount.status.success());
    assert!(String::from_utf8_lossy(&via_mount.stderr).contains("Permission denied"));
    denied("cat", &m.mnt.join("c1/secret.jpg"));

    // Root reads the links' targets, but not from the daemon: it answers no open for them.
    let opens = |m: &TestMount| m.stat("hits") + m.stat("misses");
    let before = opens(&m);
    assert_eq!(fs::read(&link).unwrap(), shadow);
    assert_eq!(
        fs::read(m.mnt.join("c1/secret.jpg")).unwrap(),
        b"outside secret"
    );
    assert_eq!(opens(&m), before, "the daemon served a file outside SOURCE");

    assert_eq!(m.wait_stat("cached_files", 1), 1, "only c1/a.jpg is staged");
    for f in walk_files(&m.cache.join("stagefs/data")) {
        let content = fs::read(&f).unwrap();
        assert!(
            content != shadow && content != b"outside secret",
            "{f:?} holds an outside file"
        );
    }
}
