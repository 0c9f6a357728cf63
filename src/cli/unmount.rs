//! `stagefs unmount`: detach a stagefs mount, including one whose daemon died, is stopped or
//! is wedged. Nothing here waits on the daemon for more than a few seconds: a daemon that does
//! not answer gets its FUSE connection aborted (fusectl) and its mount detached lazily.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Args;

use super::stats_cmd::ANSWER_WAIT;
use crate::daemon::mounts::{self, FUSERMOUNT, HelperError, MountEntry};

/// How long to wait for the kernel to drop the mount after asking.
const UNMOUNT_WAIT: Duration = Duration::from_secs(10);

#[derive(Args, Debug)]
pub struct UnmountArgs {
    /// The mount to detach
    pub mountpoint: PathBuf,
}

pub fn run(args: UnmountArgs) -> anyhow::Result<()> {
    let mp = args.mountpoint;
    // Found in the mount table, not by stat: a stopped daemon's mount never answers a stat.
    let Some(mount) = mounts::at(&mp).pop() else {
        bail!("{} is not a mount point", mp.display());
    };
    // The daemon's pid, to wait for it to exit so its cache is free for the next mount. A dead
    // daemon's mount answers ENOTCONN at once; a stopped or wedged one not at all.
    let answer = mounts::bounded_getxattr(&mp, crate::fs::PID_XATTR, ANSWER_WAIT);
    let Some(answer) = answer else {
        return force(
            &mp,
            &mount,
            &format!("its daemon did not answer within {ANSWER_WAIT:?} (stopped or wedged)"),
        );
    };
    let dead = matches!(&answer, Err(e) if e.raw_os_error() == Some(libc::ENOTCONN));
    let daemon_pid: Option<i32> = answer
        .ok()
        .and_then(|v| String::from_utf8(v).ok())
        .and_then(|s| s.parse().ok());
    let (path, entry) = (mp.clone(), mount.clone());
    match mounts::bounded(UNMOUNT_WAIT, move || detach(&path, &entry, dead)) {
        None => force(
            &mp,
            &mount,
            &format!("unmounting it did not finish within {UNMOUNT_WAIT:?}"),
        ),
        Some(Err(e)) => Err(e),
        Some(Ok(())) => {
            if let Some(pid) = daemon_pid {
                wait_exit(pid);
            }
            Ok(())
        }
    }
}

/// Removes a mount whose daemon does not answer: aborts its FUSE connection (every waiting
/// call fails at once) and detaches it lazily, then says on one line what was done.
fn force(mp: &Path, mount: &MountEntry, why: &str) -> anyhow::Result<()> {
    let mut done = Vec::new();
    if mount.fstype.starts_with("fuse") {
        mounts::abort_connection(mount)
            .map_err(|e| anyhow!("{} does not answer ({why}) and {e}", mp.display()))?;
        done.push(format!("aborted its FUSE connection {}", mount.minor));
    }
    // Only if it is still the mount on top there: never detach a mount made since.
    if mounts::on_top(mp, mount) {
        let path = mp.to_path_buf();
        match mounts::bounded(UNMOUNT_WAIT, move || {
            mounts::umount(&path, libc::MNT_DETACH)
        }) {
            Some(Ok(())) => done.push("detached it".to_string()),
            Some(Err(e)) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Some(Err(e)) => {
                return Err(e).with_context(|| format!("cannot detach {}", mp.display()));
            }
            None => bail!(
                "{} does not answer ({why}) and detaching it hangs too",
                mp.display()
            ),
        }
    }
    wait_gone(mp, mount)?;
    eprintln!("stagefs: {}: {why}: {}", mp.display(), done.join(" and "));
    Ok(())
}

/// Waits (bounded) for process `pid` to exit.
fn wait_exit(pid: i32) {
    let deadline = Instant::now() + UNMOUNT_WAIT;
    // SAFETY: signal 0 only checks for existence.
    while unsafe { libc::kill(pid, 0) } == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Unmounts with the system's helpers first (they keep libmount's records straight), then
/// with umount2 itself. Unlike the daemon stopping, a busy mount is reported, not hidden: the
/// user can close what holds it.
fn detach(mp: &Path, mount: &MountEntry, dead: bool) -> anyhow::Result<()> {
    let mut last_error = String::new();
    let root = crate::sys::euid() == 0;
    // As root, umount(8) also drops the mount's line from libmount's utab (fstab mounts made
    // with the mount helper have one); otherwise fusermount3 is what may unmount.
    let helpers: &[(&str, &[&str])] = if root && !dead {
        &[("umount", &[]), (FUSERMOUNT, &["-u"])]
    } else {
        &[(FUSERMOUNT, &["-u"])]
    };
    for (tool, flags) in helpers {
        match mounts::run_helper(tool, flags, mp) {
            Ok(()) => return wait_gone(mp, mount),
            Err(HelperError::NotFound(_)) => {}
            Err(HelperError::Failed(why)) => last_error = why,
        }
    }
    // A dead daemon's mount is detached lazily; a live one is unmounted normally so a busy
    // mount is reported instead of hidden.
    let flags = if dead { libc::MNT_DETACH } else { 0 };
    let e = match mounts::umount(mp, flags) {
        Ok(()) => return wait_gone(mp, mount),
        Err(e) => e,
    };
    if e.raw_os_error() == Some(libc::EBUSY) {
        bail!(
            "{} is busy: a process still uses it (see `fuser -vm {}`)",
            mp.display(),
            mp.display()
        );
    }
    let why = if last_error.is_empty() {
        e.to_string()
    } else {
        last_error
    };
    bail!("cannot unmount {}: {why}", mp.display())
}

/// Waits for `mount` (at `mp`) to leave the mount table.
fn wait_gone(mp: &Path, mount: &MountEntry) -> anyhow::Result<()> {
    let deadline = Instant::now() + UNMOUNT_WAIT;
    while mounts::exists(mount) {
        if Instant::now() > deadline {
            bail!("{} is still mounted after {UNMOUNT_WAIT:?}", mp.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
