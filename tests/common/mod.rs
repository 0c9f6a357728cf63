//! Shared by the integration tests: real mounts through the real `stagefs` binary, torn down
//! on drop so a failing test leaves no mount behind.
#![allow(dead_code)] // each test crate uses a different part of this module

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_stagefs"))
}

/// Runs `stagefs ARGS`, returning its output.
pub fn stagefs(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("run stagefs")
}

/// Runs `stagefs ARGS` (any bytes) under coreutils `timeout`, so a hang fails the test with
/// exit status 124 instead of stalling the suite.
pub fn stagefs_within<A: AsRef<OsStr>>(secs: u32, args: impl IntoIterator<Item = A>) -> Output {
    Command::new("timeout").arg(secs.to_string()).arg(bin()).args(args).output().expect("run timeout stagefs")
}

/// Mount tests need root (or a FUSE-enabled user with fusermount3); CI runs as root.
pub fn require_fuse() {
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: these tests mount FUSE file systems");
    // SAFETY: no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
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
        let out = Command::new(bin()).args(&args).env("RUST_LOG", "info").output().expect("run stagefs mount");
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(TestMount { source: source.to_path_buf(), mnt, cache, log, mounted: true })
    }

    /// The mount's statistics, as `getfattr -n user.stagefs.stats` gives them.
    pub fn stats(&self) -> serde_json::Value {
        let out = Command::new("getfattr")
            .args(["--only-values", "-n", "user.stagefs.stats"])
            .arg(&self.mnt)
            .output()
            .expect("run getfattr (apt-get install attr)");
        assert!(out.status.success(), "getfattr: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("stats JSON")
    }

    pub fn stat(&self, key: &str) -> u64 {
        self.stats()[key].as_u64().unwrap_or_else(|| panic!("stats has no integer {key}"))
    }

    /// Waits (at most 20 s) until the integer statistic `key` reaches `n`; returns its last
    /// value, for the caller to assert on.
    pub fn wait_stat(&self, key: &str, n: u64) -> u64 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while self.stat(key) < n && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        self.stat(key)
    }

    /// The daemon's log so far (for assertions on messages and for failure output).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn unmount(mut self) {
        self.mounted = false;
        let out = stagefs(&["unmount", self.mnt.to_str().unwrap()]);
        assert!(out.status.success(), "unmount: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for TestMount {
    fn drop(&mut self) {
        if self.mounted {
            let _ = stagefs(&["unmount", self.mnt.to_str().unwrap()]);
        }
    }
}

/// Whether `path` is listed as a mount point in /proc/self/mountinfo.
pub fn is_mounted(path: &Path) -> bool {
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|p| Path::new(p) == abs)
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
