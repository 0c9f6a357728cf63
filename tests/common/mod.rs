//! Shared by the integration tests: real mounts through the real `stagefs` binary, torn down
//! on drop so a failing test leaves no mount behind.
#![allow(dead_code)] // each test crate uses a different part of this module

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The uid and gid of `nobody`, the other user of the tests that need one.
pub const NOBODY: u32 = 65534;

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_stagefs"))
}

/// The end-to-end helpers: training scripts, `gluster.sh`, `slurm.sh`.
pub fn e2e_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e")
}

/// A command's output as text, for messages.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `stagefs ARGS`, returning its output.
pub fn stagefs(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("run stagefs")
}

/// Runs `stagefs ARGS` (any bytes) under coreutils `timeout`, so a hang fails the test with
/// exit status 124 instead of stalling the suite.
pub fn stagefs_within<A: AsRef<OsStr>>(secs: u32, args: impl IntoIterator<Item = A>) -> Output {
    Command::new("timeout")
        .arg(secs.to_string())
        .arg(bin())
        .args(args)
        .output()
        .expect("run timeout stagefs")
}

/// Runs `stagefs order ARGS` (the prediction a mount with those options follows) and
/// returns its lines: indices, or relative paths with `--paths`.
pub fn stagefs_order(args: &[&str]) -> Vec<String> {
    let mut full = vec!["order"];
    full.extend_from_slice(args);
    let out = stagefs(&full);
    assert!(
        out.status.success(),
        "stagefs order: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("UTF-8 paths")
        .lines()
        .map(str::to_string)
        .collect()
}

/// Mount tests need root (or a FUSE-enabled user with fusermount3); CI runs as root.
pub fn require_fuse() {
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: these tests mount FUSE file systems"
    );
    let root = stagefs::sys::euid() == 0;
    assert!(
        root || Path::new("/usr/bin/fusermount3").exists(),
        "mount tests need root or fusermount3 (apt-get install fuse3)"
    );
}

/// A mounted stagefs over `source`, with its own mountpoint and cache under `work`.
pub struct TestMount {
    pub source: PathBuf,
    pub mnt: PathBuf,
    pub cache: PathBuf,
    pub log: PathBuf,
    mounted: bool,
}

impl TestMount {
    /// Mounts `source` with `extra` options; panics with the daemon's message on failure.
    pub fn new(source: &Path, work: &Path, extra: &[&str]) -> TestMount {
        Self::try_new(source, work, extra).unwrap_or_else(|e| panic!("mount failed: {e}"))
    }

    pub fn try_new(source: &Path, work: &Path, extra: &[&str]) -> Result<TestMount, String> {
        require_fuse();
        let mnt = work.join("mnt");
        let cache = work.join("cache");
        let log = work.join("stagefs.log");
        std::fs::create_dir_all(&mnt).unwrap();
        // OsStrings, not display(): a source path need not be UTF-8.
        let mut args: Vec<OsString> = vec![
            "mount".into(),
            source.into(),
            mnt.clone().into(),
            "--cache".into(),
            cache.clone().into(),
            "--log-file".into(),
            log.clone().into(),
        ];
        args.extend(extra.iter().map(OsString::from));
        let out = Command::new(bin())
            .args(&args)
            .env("RUST_LOG", "info")
            .output()
            .expect("run stagefs mount");
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(TestMount {
            source: source.to_path_buf(),
            mnt,
            cache,
            log,
            mounted: true,
        })
    }

    /// The mount's statistics, as `getfattr -n user.stagefs.stats` gives them.
    pub fn stats(&self) -> serde_json::Value {
        stats_at(&self.mnt)
    }

    /// Attribute `name` of `path` (in this mount), as `getfattr --only-values -n NAME` prints it.
    pub fn getfattr(&self, path: &Path, name: &str) -> Vec<u8> {
        getfattr(path, name).unwrap_or_else(|e| panic!("getfattr {name} {}: {e}", path.display()))
    }

    /// The daemon's pid, as the mount reports it (`user.stagefs.pid`).
    pub fn daemon_pid(&self) -> i32 {
        daemon_pid(&self.mnt)
    }

    pub fn stat(&self, key: &str) -> u64 {
        self.stats()[key]
            .as_u64()
            .unwrap_or_else(|| panic!("stats has no integer {key}"))
    }

    /// Waits (at most 20 s) until the integer statistic `key` reaches `n`; returns its last
    /// value, for the caller to assert on.
    pub fn wait_stat(&self, key: &str, n: u64) -> u64 {
        wait_for(Duration::from_secs(20), || self.stat(key) >= n);
        self.stat(key)
    }

    /// The daemon's log so far (for assertions on messages and for failure output).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Lazily detaches a mount whose daemon is dead (`umount -l`, what an administrator does
    /// when a process still holds something under it).
    pub fn detach_dead(mut self) {
        self.mounted = false;
        let status = Command::new("umount")
            .arg("-l")
            .arg(&self.mnt)
            .status()
            .unwrap();
        assert!(status.success(), "umount -l {}", self.mnt.display());
    }

    pub fn unmount(mut self) {
        self.mounted = false;
        let out = stagefs(&["unmount", self.mnt.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "unmount: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for TestMount {
    fn drop(&mut self) {
        // A failing test unwinds through here: show what the daemon said.
        if std::thread::panicking() {
            eprintln!(
                "--- daemon log {} ---\n{}--- end of log ---",
                self.log.display(),
                self.log_text()
            );
        }
        if self.mounted {
            let _ = stagefs(&["unmount", self.mnt.to_str().unwrap()]);
        }
    }
}

/// The statistics of the stagefs mount at `mnt` (`user.stagefs.stats`), for mounts made
/// without [`TestMount`] (scripts, mount(8)).
pub fn stats_at(mnt: &Path) -> serde_json::Value {
    let raw = getfattr(mnt, "user.stagefs.stats")
        .unwrap_or_else(|e| panic!("stats of {}: {e}", mnt.display()));
    serde_json::from_slice(&raw).expect("stats JSON")
}

/// The pid of the daemon serving the mount at `mnt`, as it reports it (`user.stagefs.pid`).
pub fn daemon_pid(mnt: &Path) -> i32 {
    let pid = getfattr(mnt, "user.stagefs.pid")
        .unwrap_or_else(|e| panic!("user.stagefs.pid of {}: {e}", mnt.display()));
    String::from_utf8_lossy(&pid)
        .parse()
        .expect("user.stagefs.pid is a number")
}

/// Whether `path` is listed as a mount point in /proc/self/mountinfo.
pub fn is_mounted(path: &Path) -> bool {
    mount_count(path) > 0
}

/// How many mounts are stacked on `path` according to /proc/self/mountinfo (read as bytes:
/// a mount point's name need not be UTF-8).
pub fn mount_count(path: &Path) -> usize {
    use std::os::unix::ffi::OsStrExt;
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    std::fs::read("/proc/self/mountinfo")
        .unwrap_or_default()
        .split(|&b| b == b'\n')
        .filter_map(|l| l.split(|&b| b == b' ').nth(4))
        .filter(|p| Path::new(OsStr::from_bytes(p)) == abs)
        .count()
}

/// Pids of live `stagefs mount` processes whose command line names `mountpoint` (the daemon
/// re-executes with the arguments it was given, so this finds it without asking the mount).
pub fn daemon_pids(mountpoint: &Path) -> Vec<i32> {
    let wanted = mountpoint.as_os_str().as_encoded_bytes();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            args.get(1) == Some(&&b"mount"[..]) && args.contains(&wanted) && process_alive(pid)
        })
        .collect()
}

/// Whether `pid` exists and is not a zombie (an exited daemon nobody reaped yet counts as gone:
/// nothing may reap a daemon reparented to init).
pub fn process_alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the parenthesised command name, which may itself contain spaces.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, None | Some('Z') | Some('X'))
}

/// Sends signal `sig` to `pid`, failing the test if it cannot be sent.
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) has no memory preconditions.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// Polls `probe` every 20 ms for up to `limit`; returns the first value it yields, or None.
/// For waiting on something asynchronous (a daemon exiting), never for asserting how long it
/// took.
pub fn poll<T>(limit: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `done` (see [`poll`]) for up to `limit`; returns whether it became true.
pub fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    poll(limit, || done().then_some(())).is_some()
}

/// Polls `probe` (see [`poll`]) until it yields a value; fails the test naming `what` if it
/// has not after `limit`.
pub fn wait_value<T>(limit: Duration, what: &str, probe: impl FnMut() -> Option<T>) -> T {
    poll(limit, probe).unwrap_or_else(|| panic!("waited {limit:?} for {what}"))
}

/// Polls `done` (see [`poll`]) until it holds; fails the test naming `what` if it has not
/// after `limit`. Returns how long it took, for a test's report (not for an assertion).
pub fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    wait_value(limit, what, || done().then_some(()));
    start.elapsed()
}

/// `setpriv` set to run a command as uid and gid `uid` with exactly the supplementary
/// `groups` (none: `--clear-groups`); add the command and its arguments.
pub fn as_user(uid: u32, groups: &[u32]) -> Command {
    let groups = match groups {
        [] => "--clear-groups".to_string(),
        g => format!(
            "--groups={}",
            g.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
        ),
    };
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg(groups);
    command
}

/// `cmd args...` run as nobody (uid and gid 65534, no other groups; see [`as_user`]).
pub fn as_nobody<A: AsRef<OsStr>>(
    cmd: impl AsRef<OsStr>,
    args: impl IntoIterator<Item = A>,
) -> Command {
    let mut command = as_user(NOBODY, &[]);
    command.arg(cmd).args(args);
    command
}

/// A copy of the `stagefs` binary in `dir`, which other users can run (the build tree need not
/// be open to them).
pub fn bin_copy(dir: &Path) -> PathBuf {
    let exe = dir.join("stagefs-copy");
    std::fs::copy(bin(), &exe).unwrap();
    exe
}

/// A work directory others may traverse (tempdir makes it 0700), so that what they are
/// refused is refused by the mount or the cache, not by the path to them; checked by having
/// nobody read a file in it.
pub fn open_workdir() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let control = tmp.path().join("control.txt");
    std::fs::write(&control, b"control").unwrap();
    let out = as_nobody("cat", [&control]).output().expect("run setpriv");
    assert_eq!(
        out.stdout, b"control",
        "nobody cannot reach the work directory: {out:?}"
    );
    tmp
}

/// Writes `files` (relative path, content) under `root`.
pub fn write_tree(root: &Path, files: &[(&str, Vec<u8>)]) {
    for (rel, content) in files {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }
}

/// A synthetic ImageFolder dataset: `n` files over `classes` folders, deterministic sizes
/// between `min` and `max` bytes and content that identifies the file.
pub fn image_folder(root: &Path, n: u32, classes: u32, min: usize, max: usize) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    for i in 0..n {
        let rel = format!("class{:03}/img{i:06}.jpg", i % classes);
        let span = (max - min).max(1);
        let size = min + ((i as u64).wrapping_mul(2654435761) % span as u64) as usize;
        let body: Vec<u8> = (0..size).map(|k| (i as usize * 31 + k * 7) as u8).collect();
        let p = root.join(&rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, body).unwrap();
        paths.push(p);
    }
    paths
}

/// Extended attribute `name` of `path` (not following a final symlink), or None if it has
/// none; for per-file attributes such as `user.stagefs.state` without a process per file.
pub fn lgetxattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let p = stagefs::sys::c_path(path).ok()?;
    let n = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 64 * 1024];
    let len = stagefs::sys::getxattr(&p, &n, &mut buf, false).ok()?;
    buf.truncate(len);
    Some(buf)
}

/// The value of extended attribute `name` of `path` (`getfattr --only-values -n`), or None if
/// it cannot be read.
pub fn xattr(path: &Path, name: &str) -> Option<String> {
    lgetxattr(path, name).map(|v| String::from_utf8_lossy(&v).into_owned())
}

/// Runs `getfattr --only-values -n NAME PATH`: the value, or getfattr's complaint.
pub fn getfattr(path: &Path, name: &str) -> Result<Vec<u8>, String> {
    let out = Command::new("getfattr")
        .args(["--only-values", "-n", name])
        .arg(path)
        .output()
        .expect("run getfattr (apt-get install attr)");
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Every regular file under `dir`, recursively (e.g. what a cache directory holds).
pub fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk_files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// The environment `eval "$(stagefs feed-env)"` sets, as a shell would: the hook's path in
/// front of PYTHONPATH.
pub fn feed_env() -> Vec<(String, String)> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(r#"eval "$("$0" feed-env)" && printf %s "$PYTHONPATH""#)
        .arg(bin())
        .env_remove("PYTHONPATH")
        .output()
        .expect("run sh");
    assert!(
        out.status.success(),
        "stagefs feed-env: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    vec![(
        "PYTHONPATH".to_string(),
        String::from_utf8(out.stdout).unwrap(),
    )]
}
