//! `stagefs unmount`: detach a stagefs mount, including one whose daemon died, is stopped or
//! is wedged. Nothing here waits on the daemon for more than a few seconds: a daemon that does
//! not answer gets its FUSE connection aborted (fusectl) and its mount detached lazily, and a
//! stopped one is continued so it can see its mount gone and exit, freeing its cache.
//!
//! Run as root on paths other users may change, it acts only on what it identified: the mount
//! the path leads to is held by identity ([`HeldMount`]), so a directory above it swapped for
//! a link, or another mount put in its place, is never unmounted instead; only a mount of type
//! `fuse.stagefs` is touched (a tmpfs or bind mount is refused, whatever attributes it
//! carries); and the daemon waited for or continued is the process the kernel shows serving
//! the mount's connection, never one found by its name or arguments.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Args;

use super::stats_cmd::ANSWER_WAIT;
use crate::daemon::mounts::{self, ChildError, FUSERMOUNT, HeldMount, Server};

/// How long to wait for the kernel to drop the mount after asking.
const UNMOUNT_WAIT: Duration = Duration::from_secs(10);

#[derive(Args, Debug)]
pub struct UnmountArgs {
    /// The mount to detach
    pub mountpoint: std::path::PathBuf,
}

/// The mount type of every stagefs mount (`fuse.` and the subtype it mounts with).
const STAGEFS_TYPE: &str = "fuse.stagefs";

pub fn run(args: UnmountArgs) -> anyhow::Result<()> {
    // A link to the mount point names the mount it leads to, as for every other command.
    let mut mount = HeldMount::find(&args.mountpoint, ANSWER_WAIT)
        .map_err(|e| anyhow!("{} {e}", args.mountpoint.display()))?;
    if mount.entry.fstype != STAGEFS_TYPE {
        bail!(
            "{} is not a stagefs mount (it is {}): unmount it with umount",
            args.mountpoint.display(),
            mount.entry.fstype
        );
    }
    // Found while the mount is held, so its connection number is surely its own.
    let servers = mount.servers();
    // A dead daemon's mount answers ENOTCONN at once; a stopped or wedged one not at all.
    let answer = mount.getxattr(crate::fs::PID_XATTR, ANSWER_WAIT);
    let dead = match &answer {
        Err(ChildError::NoAnswer(limit)) => {
            let why = format!("its daemon did not answer within {limit:?} (stopped or wedged)");
            return force(mount, &servers, &why);
        }
        Err(ChildError::Io(e)) => e.raw_os_error() == Some(libc::ENOTCONN),
        _ => false,
    };
    // Waited for so its cache is free for the next mount. A kernel that does not show who
    // serves a connection leaves the daemon's own answer, if a process of the mount's owner
    // has that pid: waited for, never signalled.
    let waited = match servers.is_empty() {
        false => servers,
        true => answer
            .ok()
            .and_then(|v| String::from_utf8(v).ok()?.parse().ok())
            .and_then(|pid| Server::claimed(pid, mount.entry.owner))
            .into_iter()
            .collect(),
    };
    // A plain unmount finds the mount busy while this process holds its root.
    mount.unpin();
    match detach(&mount, dead) {
        Err(Detach::NoAnswer) => force(
            mount,
            &waited,
            &format!("unmounting it did not finish within {UNMOUNT_WAIT:?}"),
        ),
        Err(Detach::Failed(e)) => Err(e),
        Ok(()) => {
            let deadline = Instant::now() + UNMOUNT_WAIT;
            match waited.iter().find(|s| !s.exited_by(deadline)) {
                Some(s) => bail!(
                    "unmounted {}, but its daemon (pid {}) is still running after {UNMOUNT_WAIT:?}: its cache stays in use until it exits",
                    mount.entry.path.display(),
                    s.pid
                ),
                None => Ok(()),
            }
        }
    }
}

/// Removes a mount whose daemon does not answer: aborts its FUSE connection (every waiting
/// call fails at once) and detaches it lazily, continues its stopped daemon so it exits,
/// then says on one line what was done.
fn force(mut mount: HeldMount, servers: &[Server], why: &str) -> anyhow::Result<()> {
    let mp = mount.entry.path.clone();
    let mut done = Vec::new();
    mount
        .abort_connection(ANSWER_WAIT)
        .map_err(|e| anyhow!("{} does not answer ({why}) and {e}", mp.display()))?;
    done.push(format!("aborted its FUSE connection {}", mount.entry.minor));
    // Only while it is still the mount on top there: never one mounted over it since.
    match mount.unmount(libc::MNT_DETACH, UNMOUNT_WAIT) {
        Ok(()) => done.push("detached it".to_string()),
        Err(ChildError::Replaced) => {}
        Err(ChildError::Io(e)) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(ChildError::Io(e)) => {
            return Err(e).with_context(|| format!("cannot detach {}", mp.display()));
        }
        Err(ChildError::NoAnswer(_)) => bail!(
            "{} does not answer ({why}) and detaching it hangs too",
            mp.display()
        ),
    }
    // Let go, so its file system ends and its daemon sees the session over.
    mount.unpin();
    wait_gone(&mount)?;
    // A stopped daemon would hold its cache until someone continues it: with its connection
    // aborted, it exits as soon as it runs.
    let deadline = Instant::now() + UNMOUNT_WAIT;
    for server in servers.iter().filter(|s| s.stopped()) {
        let pid = server.pid;
        done.push(
            match server.resume().is_ok() && server.exited_by(deadline) {
                true => format!("continued its stopped daemon (pid {pid}), which exited"),
                false => format!("continued its stopped daemon (pid {pid}), still running"),
            },
        );
    }
    eprintln!("stagefs: {}: {why}: {}", mp.display(), done.join(" and "));
    Ok(())
}

/// Why [`detach`] did not unmount.
enum Detach {
    /// The unmount did not return in time.
    NoAnswer,
    Failed(anyhow::Error),
}

/// Unmounts `mount` (its root let go). A live daemon's mount is unmounted normally, so a busy
/// mount is reported instead of hidden (the user can close what holds it; the daemon itself
/// detaches lazily when it stops); a dead one's is detached lazily. A user without the
/// privilege has fusermount3 unmount their own mount, by its path: it unmounts nothing of
/// anyone else's.
fn detach(mount: &HeldMount, dead: bool) -> Result<(), Detach> {
    let mp = &mount.entry.path;
    let flags = if dead { libc::MNT_DETACH } else { 0 };
    let failed = |e: anyhow::Error| Detach::Failed(e);
    match mount.unmount(flags, UNMOUNT_WAIT) {
        Ok(()) => {}
        Err(ChildError::NoAnswer(_)) => return Err(Detach::NoAnswer),
        // Unmounted meanwhile by someone else: done.
        Err(ChildError::Replaced) if !mounts::exists(&mount.entry) => {}
        Err(ChildError::Replaced) => {
            return Err(failed(anyhow!(
                "{} has another mount on top of it now: not unmounting that",
                mp.display()
            )));
        }
        Err(ChildError::Io(e)) if e.raw_os_error() == Some(libc::EBUSY) => {
            return Err(failed(anyhow!(
                "{} is busy: a process still uses it (see `fuser -vm {}`)",
                mp.display(),
                mp.display()
            )));
        }
        Err(ChildError::Io(e)) if e.raw_os_error() == Some(libc::EPERM) => fusermount(mp, dead)?,
        Err(ChildError::Io(e)) => {
            return Err(failed(anyhow!("cannot unmount {}: {e}", mp.display())));
        }
    }
    wait_gone(mount).map_err(failed)
}

/// `fusermount3 -u` (`-z`: lazily) of `mp`, waited for at most [`UNMOUNT_WAIT`].
fn fusermount(mp: &Path, lazily: bool) -> Result<(), Detach> {
    let path = mp.to_path_buf();
    let flags: &'static [&'static str] = if lazily { &["-u", "-z"] } else { &["-u"] };
    match mounts::bounded(UNMOUNT_WAIT, move || {
        mounts::run_helper(FUSERMOUNT, flags, &path)
    }) {
        None => Err(Detach::NoAnswer),
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => Err(Detach::Failed(anyhow!(
            "cannot unmount {}: {e}",
            mp.display()
        ))),
    }
}

/// Waits for `mount` to leave the mount table.
fn wait_gone(mount: &HeldMount) -> anyhow::Result<()> {
    let deadline = Instant::now() + UNMOUNT_WAIT;
    while mounts::exists(&mount.entry) {
        if Instant::now() > deadline {
            bail!(
                "{} is still mounted after {UNMOUNT_WAIT:?}",
                mount.entry.path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
