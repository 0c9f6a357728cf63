//! `stagefs mount` refusing bad input (issue #2).
//!
//! A job script sees only the exit status and stderr, so each refusal must exit non-zero with
//! exactly one line, `stagefs: ...`, that names the problem; and it must leave nothing behind:
//! no mount, no daemon, no cache directory or log file (nothing at all changes under the test's
//! directory), and an existing mount it collided with keeps working.
mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// A valid request: SOURCE (a small ImageFolder), an empty MOUNTPOINT, a CACHE path that does
/// not exist yet, all in a directory everyone may enter (some cases run as `nobody`).
struct Setup {
    work: tempfile::TempDir,
    src: PathBuf,
    mnt: PathBuf,
    cache: PathBuf,
}

fn setup() -> Setup {
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let src = work.path().join("src");
    image_folder(&src, 4, 2, 10, 100);
    let mnt = work.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let cache = work.path().join("cache");
    Setup {
        work,
        src,
        mnt,
        cache,
    }
}

/// `stagefs mount SOURCE MOUNTPOINT --cache CACHE EXTRA...` as arguments.
fn mount_args(src: &Path, mnt: &Path, cache: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec!["mount".into()];
    v.extend([src, mnt].iter().map(|p| p.display().to_string()));
    v.extend(["--cache".into(), cache.display().to_string()]);
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// Every path under `root` with its type, not descending into other mounts (a stagefs
/// mounted inside it is somebody else's business).
fn tree(root: &Path) -> Vec<(PathBuf, u32)> {
    let dev = fs::symlink_metadata(root).unwrap().dev();
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).unwrap();
        out.push((p.clone(), m.mode() & libc::S_IFMT));
        if m.is_dir() && m.dev() == dev {
            stack.extend(fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        }
    }
    out.sort();
    out
}

/// What a refused mount must not change.
#[derive(Debug, PartialEq)]
struct World {
    mounts: usize,
    daemons: Vec<i32>,
    files: Vec<(PathBuf, u32)>,
}

fn world(s: &Setup, mnt: &Path) -> World {
    World {
        mounts: mount_count(mnt),
        daemons: daemon_pids(mnt),
        files: tree(s.work.path()),
    }
}

/// Runs `cmd` (a `stagefs mount` aimed at `mnt`) and asserts it was refused with one line
/// saying all of `phrases`, changing nothing.
fn assert_refused(s: &Setup, mnt: &Path, cmd: &mut Command, phrases: &[&str]) {
    let before = world(s, mnt);
    let out = cmd.output().expect("run stagefs mount");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit status; stderr: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr:?}");
    assert!(
        stderr.starts_with("stagefs: ") && stderr.ends_with('\n'),
        "{stderr:?}"
    );
    for phrase in phrases {
        assert!(
            stderr.contains(phrase),
            "{stderr:?} does not say {phrase:?}"
        );
    }
    assert_eq!(world(s, mnt), before, "the refused mount changed something");
}

/// SOURCE, MOUNTPOINT and CACHE of one request.
type Paths = (PathBuf, PathBuf, PathBuf);

fn standard(s: &Setup) -> Paths {
    (s.src.clone(), s.mnt.clone(), s.cache.clone())
}

/// A request as root with the paths `paths` makes from a fresh `Setup` (it may also create
/// what it needs there) must be refused.
fn refuse(paths: impl FnOnce(&Setup) -> Paths, extra: &[&str], phrases: &[&str]) {
    let s = setup();
    let (src, mnt, cache) = paths(&s);
    let mut cmd = Command::new(bin());
    cmd.args(mount_args(&src, &mnt, &cache, extra));
    assert_refused(&s, &mnt, &mut cmd, phrases);
}

/// A regular file in the test's directory.
fn a_file(s: &Setup) -> PathBuf {
    let f = s.work.path().join("a file");
    fs::write(&f, b"x").unwrap();
    f
}

#[test]
fn missing_source() {
    refuse(
        |s| (s.work.path().join("nope"), s.mnt.clone(), s.cache.clone()),
        &[],
        &["source", "nope: No such file or directory"],
    );
}

#[test]
fn source_is_a_file() {
    refuse(
        |s| (a_file(s), s.mnt.clone(), s.cache.clone()),
        &[],
        &["source", "is not a directory"],
    );
}

#[test]
fn missing_mountpoint() {
    refuse(
        |s| (s.src.clone(), s.work.path().join("nope"), s.cache.clone()),
        &[],
        &["mountpoint", "nope: No such file or directory"],
    );
}

#[test]
fn mountpoint_is_a_file() {
    refuse(
        |s| (s.src.clone(), a_file(s), s.cache.clone()),
        &[],
        &["mountpoint", "is not a directory"],
    );
}

#[test]
fn cache_inside_source() {
    let paths = |s: &Setup| (s.src.clone(), s.mnt.clone(), s.src.join("cache"));
    refuse(paths, &[], &["cache", "source", "overlap"]);
}

#[test]
fn source_inside_cache() {
    // The cache directory exists already: it holds the dataset.
    let paths = |s: &Setup| (s.src.clone(), s.mnt.clone(), s.work.path().to_path_buf());
    refuse(paths, &[], &["cache", "source", "overlap"]);
}

#[test]
fn cache_inside_mountpoint() {
    let paths = |s: &Setup| (s.src.clone(), s.mnt.clone(), s.mnt.join("cache"));
    refuse(paths, &[], &["cache", "mountpoint", "overlap"]);
}

#[test]
fn mountpoint_inside_source() {
    let paths = |s: &Setup| (s.src.clone(), s.src.join("class000"), s.cache.clone());
    refuse(paths, &[], &["mountpoint", "source", "overlap"]);
}

/// Refused by the daemon, after it made the cache directory and its log: they go again.
#[test]
fn source_without_samples() {
    let paths = |s: &Setup| {
        let empty = s.work.path().join("empty");
        fs::create_dir(&empty).unwrap();
        (empty, s.mnt.clone(), s.cache.clone())
    };
    refuse(paths, &[], &["found no samples"]);
}

/// The same with a cache directory that was there before: it stays, as it was.
#[test]
fn source_without_samples_leaves_an_existing_cache_directory() {
    let paths = |s: &Setup| {
        let empty = s.work.path().join("empty");
        fs::create_dir(&empty).unwrap();
        fs::create_dir(&s.cache).unwrap();
        fs::set_permissions(&s.cache, fs::Permissions::from_mode(0o700)).unwrap();
        (empty, s.mnt.clone(), s.cache.clone())
    };
    refuse(paths, &[], &["found no samples"]);
}

#[test]
fn mountpoint_not_empty() {
    let paths = |s: &Setup| {
        fs::write(s.mnt.join("notes.txt"), b"mine").unwrap();
        standard(s)
    };
    refuse(
        paths,
        &[],
        &["mountpoint", "is not empty", "would hide its files"],
    );
}

/// The cache inside SOURCE, named through a bind mount of SOURCE: the same directory under
/// another name is still SOURCE.
#[test]
fn cache_inside_source_through_a_bind_mount() {
    require_fuse();
    let s = setup();
    let alias = s.work.path().join("alias");
    fs::create_dir(&alias).unwrap();
    let bound = Command::new("mount")
        .arg("--bind")
        .args([&s.src, &alias])
        .status()
        .unwrap();
    assert!(bound.success(), "mount --bind");
    let mut cmd = Command::new(bin());
    cmd.args(mount_args(&s.src, &s.mnt, &alias.join("cache"), &[]));
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        assert_refused(&s, &s.mnt, &mut cmd, &["cache", "source", "overlap"])
    }));
    let _ = Command::new("umount").arg(&alias).status();
    if let Err(panic) = refused {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn bad_cache_size() {
    refuse(
        standard,
        &["--cache-size", "12QB"],
        &["--cache-size: '12QB' is not a size"],
    );
}

/// `--job-user` names a user the node knows, on a mount others may use.
#[test]
fn bad_job_user() {
    refuse(
        standard,
        &["--allow-other", "--job-user", "no-such-user-here"],
        &["--job-user: no user no-such-user-here"],
    );
    refuse(
        standard,
        &["--job-user", "nobody"],
        &["--job-user needs --allow-other"],
    );
}

#[test]
fn rank_out_of_range() {
    refuse(
        standard,
        &["--rank", "4", "--world-size", "4"],
        &["--rank 4 is out of range for --world-size 4"],
    );
}

#[test]
fn unknown_option() {
    let s = setup();
    let before = world(&s, &s.mnt);
    let out = Command::new(bin())
        .args(mount_args(&s.src, &s.mnt, &s.cache, &["--frobnicate"]))
        .output()
        .unwrap();
    // clap's own usage error: exit 2 and a few lines, naming the option.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("'--frobnicate'"), "{stderr}");
    assert!(stderr.contains("Usage: stagefs mount"), "{stderr}");
    assert_eq!(world(&s, &s.mnt), before);
}

#[test]
fn mountpoint_already_mounted() {
    let s = setup();
    // Outside `s.work`: the first daemon keeps writing to its own cache and log.
    let other = tempfile::tempdir().unwrap();
    let first = TestMount::new(&s.src, other.path(), &[]);
    let pid = first.daemon_pid();
    let mut cmd = Command::new(bin());
    cmd.args(mount_args(&s.src, &first.mnt, &s.cache, &[]));
    assert_refused(&s, &first.mnt, &mut cmd, &["already a mount point"]);
    // The mount it collided with still serves, from the same daemon.
    assert_eq!(fs::read_dir(first.mnt.join("class000")).unwrap().count(), 2);
    assert_eq!(first.daemon_pid(), pid);
    first.unmount();
}

#[test]
fn cache_in_use_by_another_mount() {
    let s = setup();
    let other = tempfile::tempdir().unwrap();
    let first = TestMount::new(&s.src, other.path(), &[]);
    // This one fails in the daemon, at the cache lock, after it opened its log: keep that log
    // out of the directory that must stay unchanged.
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("second.log");
    let mut cmd = Command::new(bin());
    cmd.args(mount_args(
        &s.src,
        &s.mnt,
        &first.cache,
        &["--log-file", log.to_str().unwrap()],
    ));
    assert_refused(
        &s,
        &s.mnt,
        &mut cmd,
        &["cache directory", "in use by another stagefs"],
    );
    assert!(
        fs::read_to_string(&log)
            .unwrap()
            .contains("in use by another stagefs")
    );
    // The mount that holds the cache still serves, with the right bytes.
    let rel = "class001/img000001.jpg";
    assert_eq!(
        fs::read(first.mnt.join(rel)).unwrap(),
        fs::read(s.src.join(rel)).unwrap()
    );
    first.unmount();
}

/// `stagefs ARGS` run as `nobody` (for the cases root, who reads anything, cannot produce)
/// with `PATH=env_path`, from a copy of the binary `nobody` can execute.
fn stagefs_as_nobody(s: &Setup, args: &[String], env_path: &str) -> Command {
    let exe = bin_copy(s.work.path());
    let mut cmd = as_nobody("env", [format!("PATH={env_path}")]);
    cmd.arg(&exe).args(args);
    cmd
}

/// `sh -c SCRIPT` in a private mount namespace, then `exec` of `inner`: for the cases that
/// need this one command to see a different /dev.
fn in_mount_namespace(script: &str, inner: &Command) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!(r#"{script} && exec "$@""#))
        .arg("sh")
        .arg(inner.get_program())
        .args(inner.get_args());
    cmd
}

/// Root reads every directory, so this runs as `nobody`.
#[test]
fn unreadable_source() {
    let s = setup();
    fs::set_permissions(&s.src, fs::Permissions::from_mode(0o000)).unwrap();
    let mut cmd = stagefs_as_nobody(
        &s,
        &mount_args(&s.src, &s.mnt, &s.cache, &[]),
        "/usr/bin:/bin",
    );
    assert_refused(
        &s,
        &s.mnt,
        &mut cmd,
        &["source", "is not readable: Permission denied"],
    );
}

/// A machine or container without the FUSE device: /dev is an empty tmpfs for this command.
#[test]
fn no_fuse_device() {
    let s = setup();
    let mut plain = Command::new(bin());
    plain.args(mount_args(&s.src, &s.mnt, &s.cache, &[]));
    let mut cmd = in_mount_namespace("mount -t tmpfs none /dev", &plain);
    assert_refused(
        &s,
        &s.mnt,
        &mut cmd,
        &["cannot open /dev/fuse", "No such file or directory"],
    );
}

/// An unprivileged user where /dev/fuse is root's only (as on some hardened nodes): the line
/// says what mode it needs.
#[test]
fn fuse_device_closed_to_the_user() {
    let s = setup();
    let nobody = stagefs_as_nobody(
        &s,
        &mount_args(&s.src, &s.mnt, &s.cache, &[]),
        "/usr/bin:/bin",
    );
    let mut cmd = in_mount_namespace(
        "mount -t tmpfs none /dev && mknod -m 600 /dev/fuse c 10 229",
        &nobody,
    );
    assert_refused(
        &s,
        &s.mnt,
        &mut cmd,
        &["cannot open /dev/fuse (Permission denied)", "chmod 0666"],
    );
}

/// An unprivileged user who may open /dev/fuse but has no fusermount3 (what mounts FUSE for
/// non-root users) on PATH. /dev/fuse on this machine is root-only, so /dev/null, open to
/// everyone, stands in for it: the check under test only opens the device.
#[test]
fn no_fusermount3_for_unprivileged_user() {
    let s = setup();
    let nobody = stagefs_as_nobody(
        &s,
        &mount_args(&s.src, &s.mnt, &s.cache, &[]),
        "/nonexistent",
    );
    let mut cmd = in_mount_namespace("mount --bind /dev/null /dev/fuse", &nobody);
    assert_refused(&s, &s.mnt, &mut cmd, &["fusermount3 not found"]);
}
