//! Checks of a [`MountConfig`] that can fail on user input, run before anything is created or
//! mounted so a bad request leaves nothing behind: the paths, the options that do not need
//! the dataset, and the mountpoint claim that serializes concurrent mounts.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::error::{MetricsFileProblem, MountError};
use super::{MountConfig, mounts};
use crate::catalog::{LayoutError, LayoutKind, check_list_file};

/// Everything checkable without creating anything: the paths, then the options.
pub fn preflight(config: &MountConfig) -> Result<(), MountError> {
    check_paths(config)?;
    check_options(config)
}

/// Checks everything about the paths that can be checked without creating anything.
pub fn check_paths(config: &MountConfig) -> Result<(), MountError> {
    let source = &config.source;
    let source_err = |e| MountError::Source {
        path: source.clone(),
        source: e,
    };
    let meta = fs::metadata(source).map_err(source_err)?;
    if !meta.is_dir() {
        return Err(MountError::SourceNotDirectory(source.clone()));
    }
    fs::read_dir(source).map_err(|e| MountError::SourceUnreadable {
        path: source.clone(),
        source: e,
    })?;
    let mp = &config.mountpoint;
    // Before any stat of it: a stopped daemon's mount there would never answer one.
    if mounts::is_mount_point(mp) {
        return Err(MountError::AlreadyMounted(mp.clone()));
    }
    let mp_err = |e| MountError::Mountpoint {
        path: mp.clone(),
        source: e,
    };
    if !fs::metadata(mp).map_err(mp_err)?.is_dir() {
        return Err(MountError::MountpointNotDirectory(mp.clone()));
    }
    let source_abs = fs::canonicalize(source).map_err(source_err)?;
    let mp_abs = fs::canonicalize(mp).map_err(mp_err)?;
    let cache_abs = absolute_for_new(&config.cache)?;
    for (first, a, second, b) in [
        ("cache", &cache_abs, "source", &source_abs),
        ("cache", &cache_abs, "mountpoint", &mp_abs),
        ("mountpoint", &mp_abs, "source", &source_abs),
    ] {
        if inside(a, b) || inside(b, a) {
            let (a, b) = (a.clone(), b.clone());
            return Err(MountError::Overlap {
                first,
                a,
                second,
                b,
            });
        }
    }
    if fs::read_dir(mp).map_err(mp_err)?.next().is_some() {
        return Err(MountError::MountpointNotEmpty(mp.clone()));
    }
    if let Ok(m) = fs::metadata(&config.cache)
        && !m.is_dir()
    {
        return Err(MountError::CacheNotDirectory(config.cache.clone()));
    }
    check_fuse_available()
}

/// Whether `path` (absolute, resolved) is `dir` or below it: by name, and by identity, so a
/// bind mount of `dir` elsewhere (another name for the same directory) is caught too. A part
/// of `path` not created yet is skipped.
fn inside(path: &Path, dir: &Path) -> bool {
    if path.starts_with(dir) {
        return true;
    }
    let Ok(dir) = fs::metadata(dir) else {
        return false;
    };
    path.ancestors()
        .filter_map(|p| fs::metadata(p).ok())
        .any(|m| (m.dev(), m.ino()) == (dir.dev(), dir.ino()))
}

/// Checks the options that do not need the dataset, so a typo is reported before the daemon
/// starts (without creating the cache directory or its log).
pub fn check_options(config: &MountConfig) -> Result<(), MountError> {
    // The largest dataset supported: only checks that do not depend on the length can fail
    // (they run again against the real length after the scan).
    config.sampler.validate(1 << 32, &config.ranks)?;
    if let Some(path) = &config.metrics_file {
        check_metrics_file(path).map_err(|problem| MountError::MetricsFile {
            path: path.clone(),
            problem,
        })?;
    }
    if config.layout == LayoutKind::List {
        let list = config.list_file.as_deref();
        list.ok_or(LayoutError::ListFileMissing)
            .and_then(check_list_file)?;
    }
    Ok(())
}

/// Absolute, symlink-resolved form of a path that may not exist yet.
pub fn absolute_for_new(path: &Path) -> Result<PathBuf, MountError> {
    let fail = |path: &Path, e| MountError::Path {
        path: path.to_path_buf(),
        source: e,
    };
    let abs = std::path::absolute(path).map_err(|e| fail(path, e))?;
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    while !existing.exists() {
        rest.push(existing.file_name().unwrap_or_default().to_os_string());
        existing = existing.parent().ok_or_else(|| {
            let none = std::io::Error::other("no existing parent");
            fail(path, none)
        })?;
    }
    let mut out = fs::canonicalize(existing).map_err(|e| fail(existing, e))?;
    out.extend(rest.iter().rev());
    Ok(out)
}

/// How long a mount waits for another `stagefs mount` at the same mountpoint to finish.
const CLAIM_WAIT: Duration = Duration::from_secs(10);

/// Serializes mounts at one mountpoint: takes an flock on the directory (the one underneath,
/// while nothing is mounted there) and checks again that nothing is mounted. Two `stagefs
/// mount` started together both pass [`check_paths`]; the later one waits here until the
/// first has mounted, then sees its mount. The lock lasts as long as the returned file.
pub fn claim_mountpoint(mp: &Path) -> Result<fs::File, MountError> {
    let dir = fs::File::open(mp).map_err(|e| MountError::Mountpoint {
        path: mp.to_path_buf(),
        source: e,
    })?;
    let deadline = Instant::now() + CLAIM_WAIT;
    // Non-blocking (flock with LOCK_NB), so the wait stays bounded.
    while dir.try_lock().is_err() {
        if Instant::now() > deadline {
            return Err(MountError::MountpointClaimed {
                path: mp.to_path_buf(),
                wait: CLAIM_WAIT,
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if mounts::is_mount_point(mp) {
        return Err(MountError::AlreadyMounted(mp.to_path_buf()));
    }
    Ok(dir)
}

/// /dev/fuse must open, and without root only the setuid fusermount3 may mount.
fn check_fuse_available() -> Result<(), MountError> {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| match e.kind() {
            io::ErrorKind::PermissionDenied => MountError::FuseDeviceClosed,
            _ => MountError::NoFuseDevice(e),
        })?;
    if crate::sys::euid() != 0 && which::which(mounts::FUSERMOUNT).is_err() {
        return Err(MountError::NoFusermount);
    }
    Ok(())
}

/// The metrics file is replaced atomically (temp file + rename in its directory): that
/// directory must exist and be writable, and the path must not be a directory. Checked before
/// the daemon starts, since the daemon could only log it.
fn check_metrics_file(path: &Path) -> Result<(), MetricsFileProblem> {
    // The daemon replaces the file every few seconds: only a file stagefs wrote before may be
    // replaced, never a user's file, someone else's, or what a link points to.
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => return Err(MetricsFileProblem::Directory),
        Ok(m) if !m.is_file() => return Err(MetricsFileProblem::NotRegular),
        Ok(m) if m.uid() != crate::sys::euid() => {
            return Err(MetricsFileProblem::NotOwned(m.uid()));
        }
        Ok(m) if m.len() > 0 && !is_stagefs_metrics(path) => {
            return Err(MetricsFileProblem::Foreign);
        }
        _ => {}
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if dir.as_os_str().as_encoded_bytes().contains(&0) {
        return Err(MetricsFileProblem::Nul);
    }
    crate::sys::access(dir, libc::W_OK | libc::X_OK).map_err(|source| {
        MetricsFileProblem::NotWritable {
            dir: dir.to_path_buf(),
            source,
        }
    })
}

/// Whether the file at `path` starts as [`crate::stats`] writes metrics files.
fn is_stagefs_metrics(path: &Path) -> bool {
    let mut head = [0u8; 15];
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
        .is_ok_and(|()| &head == b"# HELP stagefs_")
}
