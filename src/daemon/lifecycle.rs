//! A mount's life: detaching (the command re-executes itself as a daemon and waits on a pipe
//! until the mount is ready), serving until a signal or an outside unmount, and tearing down
//! only the mount this daemon made.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::mounts::{self, ChildError, HeldMount};
use super::{MountConfig, MountError, checks, logging, start};
use crate::control::ControlServer;
use crate::fs::{MountedDataset, StageFs};
use crate::sys::{self, TerminationSignals};

/// The daemon reports readiness on the inherited file descriptor this variable names.
const READY_FD_ENV: &str = "STAGEFS_READY_FD";
/// How long a stopping daemon keeps serving files still open on its lazily detached mount.
const LAZY_WAIT: Duration = Duration::from_secs(10);
/// How often the daemon checks whether its mount was removed from outside.
const EXIT_POLL: Duration = Duration::from_millis(200);

/// A mount that is up, with the pieces needed to tear it down.
pub struct RunningMount {
    pub session: fuser::BackgroundSession,
    /// The control channel: closed first when stopping, so no announcement arrives then.
    pub control: ControlServer,
    pub data: Arc<MountedDataset>,
    pub passthrough: Arc<AtomicBool>,
    /// Absolute (the daemon leaves its starting directory).
    pub mountpoint: PathBuf,
    /// The mount this daemon made, held by identity: the only one it may unmount. The path
    /// alone is not enough: after `umount MNT` from outside, a new mount (another stagefs, a
    /// tmpfs) may be there by the time this daemon exits, and a directory above it may have
    /// been swapped for a link to another mount's.
    pub mount: HeldMount,
}

impl RunningMount {
    /// Unmounts and stops the stager. Returns once the FUSE session has ended, or after
    /// [`LAZY_WAIT`] if readers keep files open on a lazily detached mount.
    pub fn stop(self) {
        let RunningMount {
            session,
            control,
            data,
            mountpoint,
            mount,
            ..
        } = self;
        drop(control);
        // Once the kernel has ended our session, ours is gone: nothing to unmount.
        if !session.guard.is_finished()
            && let Err(e) = detach(&mount)
        {
            log::warn!("unmounting {}: {e}", mountpoint.display());
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

/// Takes the mount out of the namespace, only while it is the mount on top where it was
/// made. A reader holding a file open makes a plain unmount fail with EBUSY, and exiting then
/// would leave a dead mount behind (ENOTCONN for everyone until someone unmounts it): the
/// mount is then detached lazily, so it disappears at once and the open files keep working
/// until they are closed. (`stagefs unmount` reports a busy mount instead: its user can close
/// the files.)
fn detach(mount: &HeldMount) -> Result<(), ChildError> {
    let path = &mount.entry.path;
    match mount.unmount(0, LAZY_WAIT) {
        Err(ChildError::Io(e)) if e.raw_os_error() == Some(libc::EBUSY) => {
            log::warn!(
                "{} is busy (a reader holds a file open): detaching it lazily",
                path.display()
            );
            mount.unmount(libc::MNT_DETACH, LAZY_WAIT)
        }
        // Unmounted from outside (`fusermount3 -u`, `umount`), maybe with another mount there
        // since: nothing of ours to take.
        Err(ChildError::Replaced) => {
            log::warn!(
                "this mount is no longer the one on top at {}: not unmounting what is there",
                path.display()
            );
            Ok(())
        }
        Err(ChildError::Io(e)) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => {
            Ok(())
        }
        // Not privileged: the setuid helper unmounts for us (only its user's own FUSE
        // mounts), lazily if it must.
        Err(ChildError::Io(e)) if e.raw_os_error() == Some(libc::EPERM) => {
            mounts::run_helper(mounts::FUSERMOUNT, &["-u"], path)
                .or_else(|_| mounts::run_helper(mounts::FUSERMOUNT, &["-u", "-z"], path))
                .map_err(|e| ChildError::Io(std::io::Error::other(e)))
        }
        other => other,
    }
}

/// Mounts as `config` says and serves until told to stop. Without `foreground` (and not yet
/// the daemon) this checks the request, starts the detached daemon and returns once it is
/// mounted, or with the daemon's error. The daemon is this process's own command line run
/// again, so a config not parsed from `stagefs mount` arguments must set `foreground`.
pub fn run(config: &MountConfig) -> Result<(), MountError> {
    let mut ready = sys::inherited_fd(READY_FD_ENV).map(fs::File::from);
    if !config.foreground && ready.is_none() {
        checks::preflight(config)?;
        return spawn_daemon(config);
    }
    // Copy buffers are 1 MiB. glibc raises its mmap threshold after the first such buffer is
    // freed and then keeps later ones in per-thread arenas: with 16 copy threads that pinned
    // ~100 MB of freed memory. A fixed threshold keeps big buffers in mmap, returned on free.
    sys::set_mmap_threshold(128 * 1024);
    // Errors from here on, the log's own included, reach the user through the pipe.
    let started = logging::init(config, ready.is_some()).and_then(|()| start(config));
    let running = match started {
        Ok(m) => m,
        Err(e) => {
            if let Some(r) = ready.as_mut() {
                let _ = writeln!(r, "error: {e}");
            }
            log::error!("{e}");
            // A cache directory this attempt created goes again (an empty SOURCE, a bad
            // index, a full disk): a refused request leaves nothing behind.
            crate::cache::remove_if_made_here(&config.cache);
            return Err(e);
        }
    };
    log::info!(
        "mounted {} at {}",
        config.source.display(),
        config.mountpoint.display()
    );
    if let Some(mut r) = ready.take()
        && writeln!(r, "ready").is_err()
    {
        // Whoever ran `stagefs mount` is gone (killed while we started): nobody would ever
        // unmount this, so do not leave it behind.
        log::warn!("the command that started this mount is gone; unmounting");
        running.stop();
        return Err(MountError::StarterGone);
    }
    serve(config, running);
    log::info!("unmounted {}", config.mountpoint.display());
    Ok(())
}

/// Serves the mount (and its metrics file) until a signal or an outside unmount, then stops it.
fn serve(config: &MountConfig, running: RunningMount) {
    // Resolved before chdir; absolute() fails only without a current directory.
    let metrics_path = (config.metrics_file.as_deref())
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()));
    // The daemon must not pin the directory it was started from (that file system could not
    // be unmounted while it runs); the paths it keeps using are absolute.
    if let Err(e) = std::env::set_current_dir("/") {
        log::warn!("cannot leave the starting directory: {e}");
    }
    let metrics = metrics_path.and_then(|path| {
        let (data, passthrough) = (running.data.clone(), running.passthrough.clone());
        let source = data.catalog.root_path().to_path_buf();
        let snapshot = move || StageFs::snapshot(&data, passthrough.load(Ordering::Relaxed));
        crate::stats::MetricsWriter::start(path, source, snapshot)
            .inspect_err(|e| log::warn!("cannot start the metrics writer: {e}"))
            .ok()
    });
    wait_for_exit(&running);
    if let Some(m) = metrics {
        m.stop();
    }
    running.stop();
}

/// Re-executes this command as a detached daemon and waits for it to say it is mounted.
fn spawn_daemon(config: &MountConfig) -> Result<(), MountError> {
    // A cache that is not stagefs's to use is refused here, where the user sees it at once.
    crate::cache::check_root(&config.cache)?;
    // Both ends close on exec; the daemon's command keeps the write end open across it.
    let (reader, writer) = std::io::pipe().map_err(MountError::Pipe)?;
    let reader = BufReader::new(reader);
    let child =
        daemon_command(writer.as_fd()).and_then(|mut cmd| cmd.spawn().map_err(MountError::Spawn));
    // Our copy of the write end goes, so EOF arrives if the daemon dies.
    drop(writer);
    let mut child = child?;
    let line = reader
        .lines()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default();
    if line == "ready" {
        return Ok(());
    }
    let _ = child.wait();
    Err(match line.strip_prefix("error: ") {
        Some(message) => MountError::Daemon(message.to_string()),
        None => MountError::DaemonDied {
            log: (config.log_file.clone()).unwrap_or_else(|| crate::cache::log_path(&config.cache)),
        },
    })
}

/// This same command line, run again in a new session with the pipe's write end inherited and
/// named by [`READY_FD_ENV`]; the daemon parses its arguments exactly as this process did.
fn daemon_command(write_end: BorrowedFd<'_>) -> Result<Command, MountError> {
    let exe = std::env::current_exe().map_err(MountError::NoExecutable)?;
    let mut cmd = Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .env(READY_FD_ENV, write_end.as_raw_fd().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    sys::detach_keeping(&mut cmd, write_end);
    Ok(cmd)
}

/// Blocks until SIGTERM/SIGINT/SIGHUP or until the mount goes away (e.g. `fusermount3 -u`).
fn wait_for_exit(mount: &RunningMount) {
    let signals = TerminationSignals::block();
    loop {
        if let Some(sig) = signals.wait_timeout(EXIT_POLL) {
            log::info!("signal {sig}: unmounting");
            return;
        }
        if mount.session.guard.is_finished() {
            log::info!("{} was unmounted", mount.mountpoint.display());
            return;
        }
    }
}
