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

/// Another user than nobody, for controls: what nobody is refused, this one is not.
const CONTROL: u32 = 1000;

/// Runs `cmd args...` as nobody (within 20 s), for its output.
fn run_as_nobody(cmd: &str, args: &[&Path]) -> Output {
    run_as(NOBODY, &[], cmd, args)
}

/// Runs `cmd args...` as uid and gid `uid` with exactly the supplementary `groups` (within
/// 20 s), for its output.
fn run_as(uid: u32, groups: &[u32], cmd: &str, args: &[&Path]) -> Output {
    as_user(uid, groups)
        .args(["timeout", "20", cmd])
        .args(args)
        .output()
        .expect("run setpriv (util-linux)")
}

/// Asserts `cmd path` as nobody fails with "Permission denied".
fn denied(cmd: &str, path: &Path) {
    denied_to(NOBODY, &[], cmd, path);
}

/// Asserts `cmd path` as `uid` with `groups` fails with "Permission denied".
fn denied_to(uid: u32, groups: &[u32], cmd: &str, path: &Path) {
    let out = run_as(uid, groups, cmd, &[path]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("Permission denied"),
        "{cmd} {path:?} as {uid} (groups {groups:?}): {out:?}"
    );
}

/// Asserts `cat path` as `uid` with `groups` prints `want`.
fn reads(uid: u32, groups: &[u32], path: &Path, want: &[u8]) {
    let out = run_as(uid, groups, "cat", &[path]);
    assert_eq!(
        out.stdout, want,
        "cat {path:?} as {uid} (groups {groups:?}): {out:?}"
    );
}

/// `setfacl ARGS` (package acl).
fn setfacl(args: &[&str], path: &Path) {
    let out = Command::new("setfacl")
        .args(args)
        .arg(path)
        .output()
        .expect("run setfacl (apt-get install acl)");
    assert!(out.status.success(), "setfacl {args:?} {path:?}: {out:?}");
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
    let out = run_as_nobody("cat", &[&m.mnt.join("c1/pub.jpg")]);
    assert_eq!(out.stdout, b"public", "{out:?}");
    denied("cat", &m.mnt.join("c1/secret.jpg"));
    denied("ls", &m.mnt.join("c2"));
    denied("cat", &m.mnt.join("c2/x.jpg"));
    // Nobody writes anything: the superblock is read-only (the kernel says so before it
    // checks permissions).
    let out = run_as_nobody("touch", &[&m.mnt.join("c1/new.jpg")]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Read-only file system"),
        "{out:?}"
    );
    // Root may read everything (the bits say so) and still write nothing.
    assert_eq!(fs::read(m.mnt.join("c1/secret.jpg")).unwrap(), b"secret");
    let err = fs::write(m.mnt.join("c1/new.jpg"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
}

#[test]
fn cache_directory_is_private() {
    let tmp = open_workdir();
    let src = dataset(tmp.path());
    let m = TestMount::new(
        &src,
        tmp.path(),
        &["--allow-other", "--sampler", "torch-distributed"],
    );
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
    let m = TestMount::new(
        &src,
        tmp.path(),
        &["--allow-other", "--sampler", "torch-distributed"],
    );

    let link = m.mnt.join("c1/shadow.jpg");
    assert!(link.symlink_metadata().unwrap().file_type().is_symlink());
    assert_eq!(fs::read_link(&link).unwrap(), Path::new("/etc/shadow"));
    // Through the mount exactly as directly: the kernel follows the link to the real file,
    // whose own permissions refuse nobody.
    let direct = run_as_nobody("cat", &[Path::new("/etc/shadow")]);
    let via_mount = run_as_nobody("cat", &[&link]);
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

/// Mode bits say yes, SOURCE says no: an ACL entry refusing nobody a 0644 file, and one
/// refusing nobody search in a 0755 directory. The mount must refuse what SOURCE refuses,
/// and still serve the same files to another user and to root. Fails on the code that only
/// had the kernel check the catalogued mode bits (`default_permissions`).
#[test]
fn acls_on_source_are_honoured() {
    let tmp = open_workdir();
    let src = tmp.path().join("src");
    write_tree(
        &src,
        &[
            ("c1/open.jpg", b"open".to_vec()),
            ("c1/acl.jpg", b"acl".to_vec()),
            ("c3/x.jpg", b"behind acl dir".to_vec()),
        ],
    );
    setfacl(&["-m", &format!("u:{NOBODY}:-")], &src.join("c1/acl.jpg"));
    setfacl(&["-m", &format!("u:{NOBODY}:-")], &src.join("c3"));
    // SOURCE itself: the mode bits allow, the ACLs do not.
    assert_eq!(
        src.join("c1/acl.jpg").metadata().unwrap().mode() & 0o777,
        0o644
    );
    denied("cat", &src.join("c1/acl.jpg"));
    denied("cat", &src.join("c3/x.jpg"));

    let m = TestMount::new(&src, tmp.path(), &["--allow-other"]);
    reads(NOBODY, &[], &m.mnt.join("c1/open.jpg"), b"open");
    denied("cat", &m.mnt.join("c1/acl.jpg"));
    denied("cat", &m.mnt.join("c3/x.jpg"));
    denied("ls", &m.mnt.join("c3"));
    // Asked again (the decision is cached now): still refused.
    denied("cat", &m.mnt.join("c1/acl.jpg"));
    // Another user, and root, read all of it; the refusals were nobody's alone.
    reads(CONTROL, &[], &m.mnt.join("c1/acl.jpg"), b"acl");
    reads(CONTROL, &[], &m.mnt.join("c3/x.jpg"), b"behind acl dir");
    let out = run_as(CONTROL, &[], "ls", &[&m.mnt.join("c3")]);
    assert_eq!(out.stdout, b"x.jpg\n", "{out:?}");
    // The kernel knows c3/x.jpg now; its name and attributes stay refused as on SOURCE.
    denied("stat", &src.join("c3/x.jpg"));
    denied("stat", &m.mnt.join("c3/x.jpg"));
    denied("stat", &m.mnt.join("c3/nosuch.jpg"));
    assert_eq!(fs::read(m.mnt.join("c1/acl.jpg")).unwrap(), b"acl");
    assert_eq!(fs::read(m.mnt.join("c3/x.jpg")).unwrap(), b"behind acl dir");
    // Once staged, the cached copy is refused as the source file was.
    assert_eq!(m.wait_stat("cached_files", 3), 3);
    denied("cat", &m.mnt.join("c1/acl.jpg"));
    reads(CONTROL, &[], &m.mnt.join("c1/acl.jpg"), b"acl");
}

/// Supplementary groups count as on SOURCE: a 0640 file of group G is read by a user who
/// has G only as a supplementary group and refused to the same user without it; and an ACL
/// entry refusing group H refuses a member of H that the mode bits alone would let in. The
/// last part fails on the code that checked mode bits only; the first passes there too (the
/// kernel's own check sees the groups), and guards that the new check is given them.
#[test]
fn supplementary_groups_are_honoured() {
    const G: u32 = 4242;
    const H: u32 = 4243;
    let tmp = open_workdir();
    let src = tmp.path().join("src");
    write_tree(
        &src,
        &[
            ("c1/group.jpg", b"for G".to_vec()),
            ("c1/not_h.jpg", b"not for H".to_vec()),
        ],
    );
    let group_file = src.join("c1/group.jpg");
    std::os::unix::fs::chown(&group_file, None, Some(G)).unwrap();
    fs::set_permissions(&group_file, fs::Permissions::from_mode(0o640)).unwrap();
    setfacl(&["-m", &format!("g:{H}:-")], &src.join("c1/not_h.jpg"));

    let m = TestMount::new(&src, tmp.path(), &["--allow-other"]);
    reads(CONTROL, &[G], &m.mnt.join("c1/group.jpg"), b"for G");
    reads(CONTROL, &[7, G, 8], &m.mnt.join("c1/group.jpg"), b"for G");
    denied_to(CONTROL, &[], "cat", &m.mnt.join("c1/group.jpg"));
    denied_to(CONTROL, &[7], "cat", &m.mnt.join("c1/group.jpg"));

    reads(CONTROL, &[], &m.mnt.join("c1/not_h.jpg"), b"not for H");
    denied_to(CONTROL, &[H], "cat", &m.mnt.join("c1/not_h.jpg"));
    denied_to(CONTROL, &[G, H], "cat", &m.mnt.join("c1/not_h.jpg"));
    reads(CONTROL, &[G], &m.mnt.join("c1/not_h.jpg"), b"not for H");

    assert_eq!(fs::read(m.mnt.join("c1/group.jpg")).unwrap(), b"for G");
    assert_eq!(fs::read(m.mnt.join("c1/not_h.jpg")).unwrap(), b"not for H");
}

/// A large dataset file replaced, after the scan, by a link back into the mount itself:
/// the daemon reads it through from SOURCE on the FUSE thread that got the open, so its own
/// open arrives as a request from the daemon, and must be refused at once. On the code
/// before, each hop took another FUSE thread until none was left, and the mount hung for
/// every reader and for `stagefs unmount`. (The cache is smaller than the file, so it is
/// never staged before the swap.)
#[test]
fn a_source_link_back_into_the_mount_is_refused_not_waited_on() {
    let tmp = open_workdir();
    let src = tmp.path().join("src");
    write_tree(
        &src,
        &[
            ("c1/big.jpg", vec![7u8; 256 * 1024]),
            ("c1/ok.jpg", b"ok".to_vec()),
        ],
    );
    let m = TestMount::new(
        &src,
        tmp.path(),
        &[
            "--read-through-above",
            "32K",
            "--cache-size",
            "64K",
            "--fuse-threads",
            "4",
        ],
    );
    let big = src.join("c1/big.jpg");
    fs::remove_file(&big).unwrap();
    symlink(m.mnt.join("c1/big.jpg"), &big).unwrap();
    let run = |secs: &str, path: &Path| {
        let started = std::time::Instant::now();
        let out = Command::new("timeout")
            .args([secs, "cat"])
            .arg(path)
            .output()
            .unwrap();
        (out, started.elapsed())
    };
    for _ in 0..3 {
        let (out, took) = run("15", &m.mnt.join("c1/big.jpg"));
        assert!(
            !out.status.success() && out.status.code() != Some(124),
            "cat big.jpg: {:?} {} bytes, stderr {:?}, after {took:?}",
            out.status,
            out.stdout.len(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(took.as_secs() < 5, "refused only after {took:?}");
    }
    // Every FUSE thread is still free: the mount answers, and serves the rest.
    let (out, _) = run("10", &m.mnt.join("c1/ok.jpg"));
    assert_eq!(out.stdout, b"ok", "{out:?}");
}

/// `user.stagefs.state` on a directory counts only the files of the directories the caller
/// may list on SOURCE: nobody sees `c1`'s two files, not `c2`'s, which is 0700 (before, the
/// root's answer counted all three), and a file's state is refused as its contents are.
#[test]
fn state_counts_only_what_the_caller_may_list() {
    let tmp = open_workdir();
    let src = dataset(tmp.path());
    let m = TestMount::new(&src, tmp.path(), &["--allow-other"]);
    let state_as_nobody = |path: &Path| {
        run_as_nobody(
            "getfattr",
            &[
                Path::new("--only-values"),
                Path::new("-n"),
                Path::new("user.stagefs.state"),
                path,
            ],
        )
    };
    let out = state_as_nobody(&m.mnt);
    assert_eq!(text(&out.stdout), "0/2 cached", "{out:?}");
    assert_eq!(xattr(&m.mnt, "user.stagefs.state").unwrap(), "0/3 cached");
    let out = state_as_nobody(&m.mnt.join("c1/secret.jpg"));
    assert!(
        !out.status.success() && text(&out.stderr).contains("Permission denied"),
        "{out:?}"
    );
    assert_eq!(
        text(&state_as_nobody(&m.mnt.join("c1/pub.jpg")).stdout),
        "remote"
    );
}

/// `feed-env` never takes a hook directory for its contents: beside a binary in a
/// world-writable sticky directory, another user makes `lib/stagefs/python` with the genuine
/// hook and a `json.py` of their own; the job must not import from there (before, it did: as
/// root in root's job). A root-owned installation beside the binary is still used.
#[test]
fn feed_env_takes_no_hook_directory_another_user_could_have_filled() {
    let tmp = tempfile::tempdir().unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let install = |prefix: &Path| {
        fs::create_dir_all(prefix.join("bin")).unwrap();
        fs::copy(bin(), prefix.join("bin/stagefs")).unwrap();
        prefix.join("lib/stagefs/python")
    };
    let feed_env = |prefix: &Path| {
        let home = tempfile::tempdir().unwrap();
        let out = Command::new(prefix.join("bin/stagefs"))
            .arg("feed-env")
            .env("HOME", home.path())
            .env_remove("XDG_CACHE_HOME")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        text(&out.stdout)
    };
    let copy_hook = |user: u32, to: &Path| {
        let out = run_as(user, &[], "mkdir", &[Path::new("-p"), to]);
        assert!(out.status.success(), "{out:?}");
        let out = run_as(user, &[], "cp", &[Path::new("-r"), &checkout.join("."), to]);
        assert!(out.status.success(), "{out:?}");
    };

    let shared = tmp.path().join("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
    let planted = install(&shared);
    copy_hook(NOBODY, &planted);
    let json = planted.join("json.py");
    let out = run_as_nobody(
        "sh",
        &[
            Path::new("-c"),
            Path::new(&format!("echo 'import os' > {}", json.display())),
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let env = feed_env(&shared);
    assert!(
        !env.contains(planted.to_str().unwrap()),
        "the job would import another user's files: {env}"
    );

    let installed = tmp.path().join("prefix");
    let hook = install(&installed);
    copy_hook(0, &hook);
    let env = feed_env(&installed);
    assert!(env.contains(hook.to_str().unwrap()), "{env}");
}
