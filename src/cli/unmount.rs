//! `stagefs unmount`: detach a stagefs mount, including one whose daemon died, is stopped or
//! is wedged. Nothing here waits on the daemon for more than a few seconds: a daemon that does
//! not answer gets its FUSE connection aborted (fusectl) and its mount detached lazily, and a
//! stopped one is continued so it can see its mount gone and exit, freeing its cache. Only
//! stagefs mounts are touched: run as root by mistake on a tmpfs or a bind mount, it refuses.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Args;

use super::stats_cmd::ANSWER_WAIT;
use crate::daemon::MOUNTPOINT_ENV;
use crate::daemon::mounts::{self, FUSERMOUNT, HelperError, MountEntry};

/// How long to wait for the kernel to drop the mount after asking.
const UNMOUNT_WAIT: Duration = Duration::from_secs(10);

#[derive(Args, Debug)]
pub struct UnmountArgs {
    /// The mount to detach
    pub mountpoint: PathBuf,
}

pub fn run(args: UnmountArgs) -> anyhow::Result<()> {
    // A link to the mount point names the mount it leads to, as for every other command.
    let mp = mounts::resolve(&args.mountpoint);
    // Found in the mount table, not by stat: a stopped daemon's mount never answers a stat.
    let Some(mount) = mounts::at(&mp).pop() else {
        bail!("{} is not a mount point", args.mountpoint.display());
    };
    // The daemon's pid, to wait for it to exit so its cache is free for the next mount. A dead
    // daemon's mount answers ENOTCONN at once; a stopped or wedged one not at all.
    let answer = mounts::bounded_getxattr(&mp, crate::fs::PID_XATTR, ANSWER_WAIT);
    let daemon_pid: Option<i32> = answer
        .as_ref()
        .and_then(|a| a.as_ref().ok())
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|s| s.parse().ok());
    // Its type says so (`fuse.stagefs`), or its daemon does.
    if mount.fstype != STAGEFS_TYPE && daemon_pid.is_none() {
        bail!(
            "{} is not a stagefs mount (it is {}): unmount it with umount",
            args.mountpoint.display(),
            mount.fstype
        );
    }
    let Some(answer) = answer else {
        return force(
            &mp,
            &mount,
            &format!("its daemon did not answer within {ANSWER_WAIT:?} (stopped or wedged)"),
        );
    };
    let dead = matches!(&answer, Err(e) if e.raw_os_error() == Some(libc::ENOTCONN));
    let (path, entry) = (mp.clone(), mount.clone());
    match mounts::bounded(UNMOUNT_WAIT, move || detach(&path, &entry, dead)) {
        None => force(
            &mp,
            &mount,
            &format!("unmounting it did not finish within {UNMOUNT_WAIT:?}"),
        ),
        Some(Err(e)) => Err(e),
        Some(Ok(())) => match daemon_pid {
            Some(pid) if !exited(pid) => bail!(
                "unmounted {}, but its daemon (pid {pid}) is still running after {UNMOUNT_WAIT:?}: its cache stays in use until it exits",
                mp.display()
            ),
            _ => Ok(()),
        },
    }
}

/// The mount type of every stagefs mount (`fuse.` and the subtype it mounts with).
const STAGEFS_TYPE: &str = "fuse.stagefs";

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
    // A stopped daemon would hold its cache until someone continues it: with its connection
    // aborted, it exits as soon as it runs.
    if let Some(pid) = stopped_daemon(mp) {
        // SAFETY: kill has no memory arguments.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        done.push(match exited(pid) {
            true => format!("continued its stopped daemon (pid {pid}), which exited"),
            false => format!("continued its stopped daemon (pid {pid}), still running"),
        });
    }
    eprintln!("stagefs: {}: {why}: {}", mp.display(), done.join(" and "));
    Ok(())
}

/// Waits (bounded) for process `pid` to exit; whether it did. A zombie has exited: a reaper
/// that does not reap (a container's init) must not make the unmount fail.
fn exited(pid: i32) -> bool {
    let deadline = Instant::now() + UNMOUNT_WAIT;
    while !matches!(
        process_state(Path::new(&format!("/proc/{pid}"))),
        None | Some('Z' | 'X')
    ) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// The state letter of the process whose /proc directory is `proc_dir` (None: gone).
fn process_state(proc_dir: &Path) -> Option<char> {
    let stat = std::fs::read(proc_dir.join("stat")).ok()?;
    let state = crate::sys::proc_stat_fields(&stat)?.next()?;
    state.first().map(|&b| b as char)
}

/// The stopped (state T) stagefs daemon of the mount at `mp` (resolved), if exactly one
/// process is that: a `stagefs mount` in this mount namespace whose environment names `mp`
/// ([`MOUNTPOINT_ENV`], the detached daemon's) or whose command line does as an absolute
/// path (a foreground one's). Nothing is continued on a doubt.
fn stopped_daemon(mp: &Path) -> Option<i32> {
    let own_namespace = std::fs::read_link("/proc/self/ns/mnt").ok()?;
    let wanted = format!("{MOUNTPOINT_ENV}={}", mp.display());
    let serves_mp = |proc_dir: &Path| {
        let args = std::fs::read(proc_dir.join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = args.split(|&b| b == 0).collect();
        if args.get(1) != Some(&&b"mount"[..])
            || std::fs::read_link(proc_dir.join("ns/mnt")).ok() != Some(own_namespace.clone())
        {
            return false;
        }
        let env = std::fs::read(proc_dir.join("environ")).unwrap_or_default();
        env.split(|&b| b == 0).any(|v| v == wanted.as_bytes())
            || args.iter().any(|a| {
                a.starts_with(b"/") && mounts::resolve(Path::new(OsStr::from_bytes(a))) == mp
            })
    };
    let found: Vec<i32> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse::<i32>().ok()?, e.path())))
        .filter(|(_, dir)| {
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            comm.trim_end() == "stagefs" && process_state(dir) == Some('T') && serves_mp(dir)
        })
        .map(|(pid, _)| pid)
        .collect();
    match found[..] {
        [pid] => Some(pid),
        _ => None,
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
