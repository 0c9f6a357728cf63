//! `stagefs mount`: check the request, build the engine, mount, detach, and unmount on signals.
//!
//! Every check that can fail on user input runs before anything is created or mounted, so a
//! bad invocation leaves nothing behind. Without `--foreground` the command re-executes
//! itself as a detached daemon and returns only once the mount is ready (or with the
//! daemon's one-line error), which is what job scripts need.

use std::ffi::OsString;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Args;
use fuser::{Config, MountOption, SessionACL};

use super::mounts;
use super::size::{Lookahead, parse_lookahead, parse_size};
use super::{LayoutArgs, SamplerArgs};
use crate::cache::{CacheDir, index_path};
use crate::catalog::{
    Catalog, IndexError, Layout, LayoutError, LayoutKind, check_list_file, index,
};
use crate::fs::{MountedDataset, StageFs};
use crate::order::SamplerConfig;
use crate::plan::{Plan, TrackerSettings};
use crate::stager::{LocalSource, SourceRoot, Stager, StagerSettings};
use crate::stats::Counters;

/// The daemon reports readiness on this inherited file descriptor.
const READY_FD_ENV: &str = "STAGEFS_READY_FD";
/// Share of the cache file system kept free when --cache-size is not given.
const DEFAULT_FREE_SHARE: f64 = 0.10;

#[derive(Args, Debug, Clone)]
pub struct MountArgs {
    /// Dataset directory (on the parallel file system)
    pub source: PathBuf,
    /// Where the dataset appears (an existing empty directory)
    pub mountpoint: PathBuf,

    /// Node-local directory for staged files (created, private 0700)
    #[arg(long, value_name = "DIR", help_heading = "Cache")]
    pub cache: PathBuf,
    /// Most the cache may hold, e.g. 200G, 500M [default: free space of the cache's file system minus 10% of its size]
    #[arg(long, value_name = "SIZE", help_heading = "Cache")]
    pub cache_size: Option<String>,

    #[command(flatten)]
    pub sampler: SamplerArgs,
    /// Epoch the job starts at (what it passes to set_epoch first; a resumed job's epoch)
    #[arg(
        long,
        default_value_t = 0,
        help_heading = "Prediction (the job's sampler)"
    )]
    pub epoch: u64,

    #[command(flatten)]
    pub layout: LayoutArgs,

    /// Concurrent copies from SOURCE (a parallel file system serves many at once)
    #[arg(long, default_value_t = 16, value_name = "N", help_heading = "Staging")]
    pub stage_threads: usize,
    /// How far ahead of the reader to stage: a file count (5000) or a size (20G) [default: as far as the cache allows]
    #[arg(long, value_name = "N|SIZE", help_heading = "Staging")]
    pub lookahead: Option<String>,
    /// Files at least this large are read through from SOURCE while they are copied, instead of waited for
    #[arg(
        long,
        default_value = "64M",
        value_name = "SIZE",
        help_heading = "Staging"
    )]
    pub read_through_above: String,
    /// Retries of a failed source read before the reader gets EIO
    #[arg(long, default_value_t = 3, value_name = "N", help_heading = "Staging")]
    pub retries: u32,
    /// Longest a reader waits for a copy before it gets EIO, in seconds
    #[arg(
        long,
        default_value_t = 60,
        value_name = "SECS",
        help_heading = "Staging"
    )]
    pub open_timeout: u64,
    /// How far out of order (in samples) the job's opens may come: about workers × prefetch × batch × local ranks
    #[arg(
        long,
        default_value_t = 65_536,
        value_name = "N",
        help_heading = "Staging"
    )]
    pub window: u64,

    /// Stay in the foreground instead of detaching once mounted
    #[arg(short, long, help_heading = "Mount")]
    pub foreground: bool,
    /// Let other users (e.g. a job running as another uid) use the mount; SOURCE permissions are enforced
    #[arg(long, help_heading = "Mount")]
    pub allow_other: bool,
    /// Threads answering FUSE requests (parallel DataLoader workers need several)
    #[arg(long, default_value_t = 8, value_name = "N", help_heading = "Mount")]
    pub fuse_threads: usize,
    /// Concurrent directory scans at mount time (metadata calls to a parallel file system are slow)
    #[arg(long, default_value_t = 16, value_name = "N", help_heading = "Mount")]
    pub scan_threads: usize,
    /// Serve cache hits with pread in the daemon even where FUSE passthrough is available
    #[arg(long, help_heading = "Mount")]
    pub no_passthrough: bool,
    /// Start from this saved catalog (`stagefs index`) instead of scanning SOURCE; it is checked
    /// against SOURCE first [default: the one a previous mount kept in the cache, if still valid]
    #[arg(long, value_name = "FILE", help_heading = "Mount")]
    pub index: Option<PathBuf>,
    /// Log file of the detached daemon; a symbolic link is refused [default: CACHE/stagefs/stagefs.log]
    #[arg(long, value_name = "FILE", help_heading = "Mount")]
    pub log_file: Option<PathBuf>,
    /// Write Prometheus metrics to FILE every few seconds (node_exporter textfile collector)
    #[arg(long, value_name = "FILE", help_heading = "Mount")]
    pub metrics_file: Option<PathBuf>,
}

/// A mount that is up, with the pieces needed to tear it down.
pub struct RunningMount {
    pub session: fuser::BackgroundSession,
    pub data: Arc<MountedDataset>,
    pub passthrough: Arc<std::sync::atomic::AtomicBool>,
    /// Absolute (the daemon leaves its starting directory).
    pub mountpoint: PathBuf,
    /// The mount this daemon made, as /proc/self/mountinfo lists it: the only one it may
    /// unmount. The path alone is not enough: after `umount MNT` from outside, a new mount
    /// (another stagefs, a tmpfs) may be there by the time this daemon exits.
    pub mount: mounts::MountEntry,
}

impl RunningMount {
    /// Unmounts and stops the stager. Returns once the FUSE session has ended, or after
    /// [`LAZY_WAIT`] if readers keep files open on a lazily detached mount.
    pub fn stop(self) {
        let RunningMount {
            session,
            data,
            mountpoint,
            mount,
            ..
        } = self;
        // umount2 goes by path: only while the mount on top there is ours. Once the kernel
        // has ended our session, ours is gone and its ID and device may be a new mount's.
        let alive = !session.guard.is_finished();
        let on_top = mounts::at(&mountpoint)
            .last()
            .is_some_and(|m| m.same(&mount));
        if alive && on_top {
            if let Err(e) = detach(&mountpoint) {
                log::warn!("unmounting {}: {e}", mountpoint.display());
            }
        } else if alive {
            log::warn!(
                "this mount is no longer the one on top at {}: not unmounting by path",
                mountpoint.display()
            );
        }
        let deadline = Instant::now() + LAZY_WAIT;
        while !session.guard.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let finished = session.guard.is_finished();
        // Dropping the session would make fuser unmount by path, taking whatever is mounted
        // there by now; the kernel has ended ours already (or ends it when we exit).
        std::mem::forget(session);
        if !finished {
            log::warn!(
                "files on {} are still open after {LAZY_WAIT:?}; exiting anyway (their readers get ENOTCONN)",
                mountpoint.display()
            );
            return;
        }
        if let Ok(data) = Arc::try_unwrap(data) {
            data.stager.shutdown();
        }
    }
}

/// How long a stopping daemon keeps serving files still open on its lazily detached mount.
const LAZY_WAIT: Duration = Duration::from_secs(10);

/// Takes the mount out of the namespace. A reader holding a file open makes a plain unmount
/// fail with EBUSY, and exiting then would leave a dead mount behind (ENOTCONN for everyone
/// until someone unmounts it): the mount is then detached lazily, so it disappears at once
/// and the open files keep working until they are closed.
fn detach(mountpoint: &Path) -> Result<(), String> {
    let Err(err) = mounts::umount(mountpoint, 0) else {
        return Ok(());
    };
    match err.raw_os_error() {
        Some(libc::EBUSY) => {
            log::warn!(
                "{} is busy (a reader holds a file open): detaching it lazily",
                mountpoint.display()
            );
            mounts::umount(mountpoint, libc::MNT_DETACH).map_err(|e| e.to_string())
        }
        // Already unmounted from outside (`fusermount3 -u`, `umount`).
        Some(libc::EINVAL) | Some(libc::ENOENT) => Ok(()),
        // Not privileged: the setuid helper unmounts for us, lazily if it must.
        Some(libc::EPERM) => {
            let fusermount = which("fusermount3").ok_or("fusermount3 not found")?;
            for args in [&["-u"][..], &["-u", "-z"][..]] {
                if Command::new(&fusermount)
                    .args(args)
                    .arg(mountpoint)
                    .status()
                    .is_ok_and(|s| s.success())
                {
                    return Ok(());
                }
            }
            Err("fusermount3 -u failed".into())
        }
        _ => Err(err.to_string()),
    }
}

pub fn run(args: MountArgs) -> Result<(), String> {
    let ready_fd: Option<RawFd> = std::env::var(READY_FD_ENV)
        .ok()
        .and_then(|v| v.parse().ok());
    if !args.foreground && ready_fd.is_none() {
        check_paths(&args)?;
        settings(&args)?;
        return spawn_daemon(&args);
    }
    // Copy buffers are 1 MiB. glibc raises its mmap threshold after the first such buffer is
    // freed and then keeps later ones in per-thread arenas: with 16 copy threads that pinned
    // ~100 MB of freed memory. A fixed threshold keeps big buffers in mmap, returned on free.
    // SAFETY: mallopt only tunes the allocator.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024) };
    // SAFETY: the fd was created for us by the parent and is owned by this process alone.
    let mut ready = ready_fd.map(|fd| unsafe { fs::File::from_raw_fd(fd) });
    // Errors from here on, the log's own included, reach the user through the pipe.
    let started = init_logging(&args, ready.is_some()).and_then(|()| {
        log_panics();
        start(&args)
    });
    let started = match started {
        Ok(m) => m,
        Err(message) => {
            if let Some(r) = ready.as_mut() {
                let _ = writeln!(r, "error: {message}");
            }
            log::error!("{message}");
            return Err(message);
        }
    };
    log::info!(
        "mounted {} at {}",
        args.source.display(),
        args.mountpoint.display()
    );
    if let Some(mut r) = ready.take()
        && writeln!(r, "ready").is_err()
    {
        // Whoever ran `stagefs mount` is gone (killed while we started): nobody would ever
        // unmount this, so do not leave it behind.
        log::warn!("the command that started this mount is gone; unmounting");
        started.stop();
        return Err("the starting command exited before the mount was ready".into());
    }
    // Resolved before chdir; absolute() fails only without a current directory.
    let metrics_path = (args.metrics_file.as_deref())
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()));
    // The daemon must not pin the directory it was started from (that file system could not
    // be unmounted while it runs); the paths it keeps using are absolute.
    // SAFETY: valid C string.
    if unsafe { libc::chdir(c"/".as_ptr()) } != 0 {
        log::warn!(
            "cannot leave the starting directory: {}",
            std::io::Error::last_os_error()
        );
    }
    let metrics = metrics_path.and_then(|path| {
        let (data, passthrough) = (started.data.clone(), started.passthrough.clone());
        let source = data.catalog.root_path().to_path_buf();
        let snapshot = move || StageFs::snapshot(&data, passthrough.load(Ordering::Relaxed));
        crate::stats::MetricsWriter::start(path, source, snapshot)
            .inspect_err(|e| log::warn!("cannot start the metrics writer: {e}"))
            .ok()
    });
    wait_for_exit(&started);
    if let Some(m) = metrics {
        m.stop();
    }
    started.stop();
    log::info!("unmounted {}", args.mountpoint.display());
    Ok(())
}

/// A detached daemon's stderr is /dev/null: panics go to the log as well, where they are seen.
fn log_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        log::error!("{info}");
        default(info);
    }));
}

/// Blocks until SIGTERM/SIGINT/SIGHUP or until the mount goes away (e.g. `fusermount3 -u`).
fn wait_for_exit(mount: &RunningMount) {
    let signals = blocked_signals();
    loop {
        let timeout = libc::timespec {
            tv_sec: 0,
            tv_nsec: 200_000_000,
        };
        // SAFETY: valid signal set and timeout; no siginfo wanted.
        let sig = unsafe { libc::sigtimedwait(&signals, std::ptr::null_mut(), &timeout) };
        if sig > 0 {
            log::info!("signal {sig}: unmounting");
            return;
        }
        if mount.session.guard.is_finished() {
            log::info!("{} was unmounted", mount.mountpoint.display());
            return;
        }
    }
}

/// Blocks the termination signals in this thread (and every thread started after it), so
/// `wait_for_exit` can take them synchronously.
fn blocked_signals() -> libc::sigset_t {
    // SAFETY: plain sigset manipulation on a local value.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Checks the cache directory as given (a link to one is refused, not resolved) before
/// anything is written, and sends a detached daemon's log to its file.
fn init_logging(args: &MountArgs, detached: bool) -> Result<(), String> {
    let mut builder = super::logger("info");
    crate::cache::check_root(&args.cache).map_err(|e| e.to_string())?;
    if detached {
        let path = match &args.log_file {
            Some(path) => {
                if let Some(dir) = path.parent() {
                    fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(dir)
                        .map_err(|e| {
                            format!("cannot create log directory {}: {e}", dir.display())
                        })?;
                }
                path.clone()
            }
            None => {
                // By default the log lives in stagefs's own, private part of the cache.
                let source = fs::canonicalize(&args.source)
                    .map_err(|e| format!("source {}: {e}", args.source.display()))?;
                crate::cache::prepare(&args.cache, &source).map_err(|e| e.to_string())?;
                crate::cache::log_path(&args.cache)
            }
        };
        // It names the dataset's files: private like the cache. A link is never followed: one
        // planted there would make root append to its target.
        // Non-blocking: a FIFO planted there must not hold the mount.
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => format!(
                    "log file {} is a symbolic link, which stagefs does not follow; remove it or give another --log-file",
                    path.display()
                ),
                // A FIFO with no reader, opened non-blocking for writing.
                Some(libc::ENXIO) => format!(
                    "log file {} is not a regular file; give another --log-file",
                    path.display()
                ),
                _ => format!("cannot open log file {}: {e}", path.display()),
            })?;
        let meta = file
            .metadata()
            .map_err(|e| format!("log file {}: {e}", path.display()))?;
        if !meta.is_file() {
            return Err(format!(
                "log file {} is not a regular file; give another --log-file",
                path.display()
            ));
        }
        if meta.uid() != crate::sys::euid() {
            return Err(format!(
                "log file {} belongs to another user (uid {}), who could read what the daemon logs; give a file of your own",
                path.display(),
                meta.uid()
            ));
        }
        builder.target(env_logger::Target::Pipe(Box::new(file)));
    }
    let _ = builder.try_init();
    Ok(())
}

/// Re-executes this command as a detached daemon and waits for it to say it is mounted.
fn spawn_daemon(args: &MountArgs) -> Result<(), String> {
    // A cache that is not stagefs's to use is refused here, where the user sees it at once.
    crate::cache::check_root(&args.cache).map_err(|e| e.to_string())?;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array. The read end is close-on-exec; the write end
    // is inherited by the daemon.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!(
            "cannot create a pipe: {}",
            std::io::Error::last_os_error()
        ));
    }
    let (read_fd, write_fd) = (fds[0], fds[1]);
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the stagefs binary: {e}"))?;
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mut cmd = Command::new(exe);
    cmd.args(argv)
        .env(READY_FD_ENV, write_fd.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            // Keep the write end open across exec.
            let flags = libc::fcntl(write_fd, libc::F_GETFD);
            libc::fcntl(write_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start the daemon: {e}"));
    // SAFETY: closing our copy of the write end so EOF arrives if the daemon dies.
    unsafe { libc::close(write_fd) };
    let mut child = child?;
    // SAFETY: read_fd is ours.
    let reader = BufReader::new(unsafe { fs::File::from_raw_fd(read_fd) });
    let line = reader
        .lines()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default();
    match line.as_str() {
        "ready" => Ok(()),
        other => {
            let _ = child.wait();
            let log = args
                .log_file
                .clone()
                .unwrap_or_else(|| crate::cache::log_path(&args.cache));
            Err(other
                .strip_prefix("error: ")
                .map(str::to_string)
                .unwrap_or_else(|| {
                    format!("the daemon exited while starting; see {}", log.display())
                }))
        }
    }
}

/// Checks everything about the paths that can be checked without creating anything.
pub fn check_paths(args: &MountArgs) -> Result<(), String> {
    let source = &args.source;
    let meta = fs::metadata(source).map_err(|e| format!("source {}: {e}", source.display()))?;
    if !meta.is_dir() {
        return Err(format!("source {} is not a directory", source.display()));
    }
    fs::read_dir(source)
        .map_err(|e| format!("source {} is not readable: {e}", source.display()))?;
    let mp = &args.mountpoint;
    // Before any stat of it: a stopped daemon's mount there would never answer one.
    if mounts::is_mount_point(mp) {
        return Err(already_mounted(mp));
    }
    let mp_meta = fs::metadata(mp).map_err(|e| format!("mountpoint {}: {e}", mp.display()))?;
    if !mp_meta.is_dir() {
        return Err(format!("mountpoint {} is not a directory", mp.display()));
    }
    let source_abs =
        fs::canonicalize(source).map_err(|e| format!("source {}: {e}", source.display()))?;
    let mp_abs = fs::canonicalize(mp).map_err(|e| format!("mountpoint {}: {e}", mp.display()))?;
    let cache_abs = absolute_for_new(&args.cache)?;
    for (a, an, b, bn) in [
        (&cache_abs, "cache", &source_abs, "source"),
        (&cache_abs, "cache", &mp_abs, "mountpoint"),
        (&mp_abs, "mountpoint", &source_abs, "source"),
    ] {
        if a.starts_with(b) || b.starts_with(a) {
            return Err(format!(
                "{an} {} and {bn} {} overlap; they must be separate directories",
                a.display(),
                b.display()
            ));
        }
    }
    if let Ok(m) = fs::metadata(&args.cache)
        && !m.is_dir()
    {
        return Err(format!("cache {} is not a directory", args.cache.display()));
    }
    check_fuse_available()?;
    Ok(())
}

/// Absolute, symlink-resolved form of a path that may not exist yet.
fn absolute_for_new(path: &Path) -> Result<PathBuf, String> {
    let abs = std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    while !existing.exists() {
        rest.push(
            existing
                .file_name()
                .map(|n| n.to_os_string())
                .unwrap_or_default(),
        );
        existing = existing
            .parent()
            .ok_or_else(|| format!("{}: no existing parent", path.display()))?;
    }
    let mut out = fs::canonicalize(existing).map_err(|e| format!("{}: {e}", existing.display()))?;
    out.extend(rest.iter().rev());
    Ok(out)
}

fn already_mounted(mp: &Path) -> String {
    format!(
        "mountpoint {} is already a mount point; unmount it first or pick another directory",
        mp.display()
    )
}

/// How long a mount waits for another `stagefs mount` at the same mountpoint to finish.
const CLAIM_WAIT: Duration = Duration::from_secs(10);

/// Serializes mounts at one mountpoint: takes an flock on the directory (the one underneath,
/// while nothing is mounted there) and checks again that nothing is mounted. Two `stagefs
/// mount` started together both pass [`check_paths`]; the later one waits here until the
/// first has mounted, then sees its mount. The lock lasts as long as the returned file.
fn claim_mountpoint(mp: &Path) -> Result<fs::File, String> {
    let dir = fs::File::open(mp).map_err(|e| format!("mountpoint {}: {e}", mp.display()))?;
    let deadline = Instant::now() + CLAIM_WAIT;
    // SAFETY: flock on a descriptor we own; non-blocking, so the wait stays bounded.
    while unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        if Instant::now() > deadline {
            return Err(format!(
                "another stagefs mount at {} has been starting for {CLAIM_WAIT:?}; wait for it or pick another directory",
                mp.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if mounts::is_mount_point(mp) {
        return Err(already_mounted(mp));
    }
    Ok(dir)
}

fn check_fuse_available() -> Result<(), String> {
    if let Err(e) = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        return Err(format!(
            "cannot open /dev/fuse ({e}): load the fuse module (`modprobe fuse`) or, in a container, pass the device (--device /dev/fuse)"
        ));
    }
    let root = crate::sys::euid() == 0;
    if !root && which("fusermount3").is_none() {
        return Err("fusermount3 not found: install FUSE 3 (`apt-get install fuse3` or `dnf install fuse3`)".into());
    }
    Ok(())
}

pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// The catalog from `--index`, else from the index a previous mount kept in the cache, else
/// from a scan of SOURCE. Returns whether it was scanned (so the index should be saved).
fn load_catalog(
    args: &MountArgs,
    source: &Path,
    cache_root: &Path,
) -> Result<(Catalog, bool), String> {
    let from_index = |path: &Path| -> Result<Catalog, IndexError> {
        let started = Instant::now();
        let catalog = index::load(path, source)?;
        index::check_fresh(&catalog, path, args.scan_threads)?;
        log::info!(
            "loaded {} entries from index {} in {:.2?}",
            catalog.len(),
            path.display(),
            started.elapsed()
        );
        Ok(catalog)
    };
    if let Some(path) = &args.index {
        return from_index(path)
            .map(|c| (c, false))
            .map_err(|e| e.to_string());
    }
    let kept = index_path(cache_root);
    if kept.exists() {
        match from_index(&kept) {
            Ok(c) => return Ok((c, false)),
            Err(e) => log::info!("not using the cache's index: {e}; scanning"),
        }
    }
    Catalog::scan(source, args.scan_threads)
        .map(|c| (c, true))
        .map_err(|e| e.to_string())
}

/// The option values, parsed and checked as far as they can be without the dataset.
struct Settings {
    sampler: SamplerConfig,
    ranks: Vec<u32>,
    cache_size: Option<u64>,
    lookahead: Option<Lookahead>,
    read_through_above: u64,
}

/// Checks every option value that does not need the scan. The command runs it before it
/// starts the daemon, so a typo is reported without creating the cache directory (or its log).
fn settings(args: &MountArgs) -> Result<Settings, String> {
    let (sampler, ranks) = args.sampler.config().map_err(|e| e.to_string())?;
    // The largest dataset supported: only checks that do not depend on the length can fail
    // (they run again against the real length after the scan).
    sampler
        .validate(1 << 32, &ranks)
        .map_err(|e| e.to_string())?;
    let cache_size = args
        .cache_size
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| format!("--cache-size: {e}"))?;
    let lookahead = args
        .lookahead
        .as_deref()
        .map(parse_lookahead)
        .transpose()
        .map_err(|e| format!("--lookahead: {e}"))?;
    let read_through_above =
        parse_size(&args.read_through_above).map_err(|e| format!("--read-through-above: {e}"))?;
    if let Some(path) = &args.metrics_file {
        check_metrics_file(path)?;
    }
    if args.stage_threads == 0 || args.fuse_threads == 0 || args.scan_threads == 0 {
        return Err("--stage-threads, --fuse-threads and --scan-threads must be at least 1".into());
    }
    if args.window == 0 {
        return Err("--window must be at least 1".into());
    }
    if args.layout.layout == LayoutKind::List {
        let list = args.layout.list_file.as_deref();
        list.ok_or(LayoutError::ListFileMissing)
            .and_then(check_list_file)
            .map_err(|e| e.to_string())?;
    }
    Ok(Settings {
        sampler,
        ranks,
        cache_size,
        lookahead,
        read_through_above,
    })
}

/// The metrics file is replaced atomically (temp file + rename in its directory): that
/// directory must exist and be writable, and the path must not be a directory. Checked before
/// the daemon starts, since the daemon could only log it.
fn check_metrics_file(path: &Path) -> Result<(), String> {
    let fail = |why: String| format!("--metrics-file {}: {why}", path.display());
    // The daemon replaces the file every few seconds: only a file stagefs wrote before may be
    // replaced, never a user's file, someone else's, or what a link points to.
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => return Err(fail("is a directory; give a file name".into())),
        Ok(m) if !m.is_file() => {
            return Err(fail(
                "is not a regular file (a link, FIFO or device); give a new file name".into(),
            ));
        }
        Ok(m) if m.uid() != crate::sys::euid() => {
            return Err(fail(format!(
                "belongs to another user (uid {}); give a file of your own",
                m.uid()
            )));
        }
        Ok(m) if m.len() > 0 && !is_stagefs_metrics(path) => {
            return Err(fail(
                "holds something other than stagefs metrics, and stagefs replaces this file; give a new file name".into(),
            ));
        }
        _ => {}
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| fail("contains a NUL byte".into()))?;
    // SAFETY: valid C string.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Err(fail(format!(
            "cannot write in {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
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

/// Builds catalog, plan, cache and stager, and mounts. Nothing is left mounted on error.
pub fn start(args: &MountArgs) -> Result<RunningMount, String> {
    check_paths(args)?;
    let Settings {
        sampler,
        ranks,
        cache_size,
        lookahead,
        read_through_above,
    } = settings(args)?;
    let source = fs::canonicalize(&args.source)
        .map_err(|e| format!("source {}: {e}", args.source.display()))?;
    // Not a mount point (checked above), so resolving it does not enter one.
    let mountpoint = fs::canonicalize(&args.mountpoint)
        .map_err(|e| format!("mountpoint {}: {e}", args.mountpoint.display()))?;

    let cache_root = absolute_for_new(&args.cache)?;
    let (catalog, scanned) = load_catalog(args, &source, &cache_root)?;
    log::info!(
        "catalog: {} entries in {:.1} MB ({:.0} bytes per entry)",
        catalog.len(),
        catalog.heap_bytes() as f64 / 1e6,
        catalog.heap_bytes() as f64 / catalog.len() as f64
    );
    let catalog = Arc::new(catalog);
    let layout = Arc::new(
        Layout::build(
            &catalog,
            args.layout.layout,
            &args.layout.extensions(),
            args.layout.list_file.as_deref(),
        )
        .map_err(|e| e.to_string())?,
    );
    if !layout.classes().is_empty() {
        log::info!(
            "{} classes, {} samples",
            layout.classes().len(),
            layout.len()
        );
    }
    let sampler_name = format!("{}", sampler.kind);
    let plan =
        Arc::new(Plan::new(sampler, ranks, layout, catalog.len()).map_err(|e| e.to_string())?);
    plan.check_epoch_reachable(args.epoch)
        .map_err(|e| e.to_string())?;
    let cache = CacheDir::open(&cache_root, &source).map_err(|e| e.to_string())?;
    if scanned {
        // Kept for the next mount of this cache; written off the start-up path.
        let (catalog, path) = (catalog.clone(), index_path(&cache_root));
        std::thread::spawn(move || {
            if let Err(e) = index::save(&catalog, &path) {
                log::warn!("{e}; the next mount will scan again");
            }
        });
    }
    let capacity = match cache_size {
        Some(c) => c,
        None => {
            let (free, total) = cache
                .filesystem_space()
                .map_err(|e| format!("cache {}: {e}", args.cache.display()))?;
            free.saturating_sub((total as f64 * DEFAULT_FREE_SHARE) as u64)
        }
    };
    let (lookahead_files, lookahead_bytes) = match lookahead {
        Some(Lookahead::Files(n)) => (n.max(1), u64::MAX),
        Some(Lookahead::Bytes(b)) => (u64::MAX, b.max(1)),
        None => (u64::MAX, u64::MAX),
    };
    let settings = StagerSettings {
        threads: args.stage_threads,
        lookahead_files,
        lookahead_bytes,
        capacity,
        read_through_above,
        retries: args.retries,
        open_timeout: Duration::from_secs(args.open_timeout.max(1)),
        tracker: TrackerSettings {
            window: args.window,
            ..TrackerSettings::default()
        },
    };
    let counters = Arc::new(Counters::default());
    // Signals must be blocked before any thread exists so none of them takes a SIGTERM.
    blocked_signals();
    let source_root = Arc::new(
        SourceRoot::open(&source).map_err(|e| format!("source {}: {e}", source.display()))?,
    );
    // Held until mounted; taken before staging starts so a refused mount copies nothing.
    let claim = claim_mountpoint(&mountpoint)?;
    let stager = Stager::start(
        catalog.clone(),
        Arc::new(LocalSource::new(source_root.clone())),
        cache,
        plan.clone(),
        settings,
        counters.clone(),
    );
    if args.epoch > 0 {
        stager.set_epoch(args.epoch);
    }
    log::info!(
        "{} files ({} bytes); {} positions per epoch on this node; cache capacity {} bytes",
        catalog.file_count(),
        catalog.total_file_bytes(),
        plan.epoch_len(),
        capacity
    );
    let data = Arc::new(MountedDataset {
        catalog,
        stager,
        counters,
        sampler_name,
        started: Instant::now(),
        passthrough_wanted: !args.no_passthrough,
        source_root,
        control_address: Default::default(),
    });
    let fs_impl = StageFs::new(data.clone());
    let passthrough = fs_impl.passthrough_flag();
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(source.display().to_string()),
        MountOption::Subtype("stagefs".into()),
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoAtime,
    ];
    config.acl = if args.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(args.fuse_threads);
    config.clone_fd = true;
    let session = fuser::spawn_mount(fs_impl, &mountpoint, &config)
        .map_err(|e| format!("cannot mount at {}: {e}", mountpoint.display()))?;
    // Under the claim, the FUSE mount on top at the mountpoint is the one just made (its type
    // reads `fuse` or `fuse.stagefs` depending on how it was mounted).
    let mount = mounts::at(&mountpoint)
        .into_iter()
        .rfind(|m| m.fstype.starts_with("fuse"))
        .ok_or_else(|| {
            format!(
                "mounted at {} but the mount is not in /proc/self/mountinfo",
                mountpoint.display()
            )
        })?;
    drop(claim);
    log::info!("passthrough in use: {}", passthrough.load(Ordering::SeqCst));
    Ok(RunningMount {
        session,
        data,
        passthrough,
        mountpoint,
        mount,
    })
}
