//! `stagefs unmount`: detach a stagefs mount, including one whose daemon died.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Args;

use super::mount::{is_mount_point, which};

/// How long to wait for the kernel to drop the mount after asking.
const UNMOUNT_WAIT: Duration = Duration::from_secs(10);

#[derive(Args, Debug)]
pub struct UnmountArgs {
    /// The mount to detach
    pub mountpoint: PathBuf,
}

pub fn run(args: UnmountArgs) -> Result<(), String> {
    let mp = &args.mountpoint;
    // A dead mount fails stat with ENOTCONN; it is still a mount to remove.
    let dead = matches!(std::fs::metadata(mp), Err(e) if e.raw_os_error() == Some(libc::ENOTCONN));
    if !dead && !is_mount_point(mp) {
        return Err(format!("{} is not a mount point", mp.display()));
    }
    // The daemon's pid, to wait for it to exit so its cache is free for the next mount.
    let daemon_pid: Option<i32> = if dead {
        None
    } else {
        super::stats_cmd::read_xattr(mp, "user.stagefs.pid")
            .ok()
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|s| s.parse().ok())
    };
    let result = detach(mp, dead);
    if result.is_ok()
        && let Some(pid) = daemon_pid
    {
        wait_exit(pid);
    }
    result
}

/// Waits (bounded) for process `pid` to exit.
fn wait_exit(pid: i32) {
    let deadline = Instant::now() + UNMOUNT_WAIT;
    // SAFETY: signal 0 only checks for existence.
    while unsafe { libc::kill(pid, 0) } == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn detach(mp: &std::path::Path, dead: bool) -> Result<(), String> {
    let mut last_error = String::new();
    // SAFETY: no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    // As root, umount(8) also drops the mount's line from libmount's utab (fstab mounts made
    // with the mount helper have one); otherwise fusermount3 is what may unmount.
    let helpers: &[(&str, &[&str])] = if root && !dead {
        &[("umount", &[]), ("fusermount3", &["-u"])]
    } else {
        &[("fusermount3", &["-u"])]
    };
    for (tool, flags) in helpers {
        let Some(path) = which(tool) else { continue };
        match Command::new(path).args(*flags).arg(mp).output() {
            Ok(out) if out.status.success() => return wait_gone(mp),
            Ok(out) => last_error = String::from_utf8_lossy(&out.stderr).trim().to_string(),
            Err(e) => last_error = e.to_string(),
        }
    }
    let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes())
        .map_err(|_| "mountpoint contains a NUL byte".to_string())?;
    // A dead daemon's mount is detached lazily; a live one is unmounted normally so a busy
    // mount is reported instead of hidden.
    let flags = if dead { libc::MNT_DETACH } else { 0 };
    // SAFETY: valid C string.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        return wait_gone(mp);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EBUSY) {
        return Err(format!(
            "{} is busy: a process still uses it (see `fuser -vm {}`)",
            mp.display(),
            mp.display()
        ));
    }
    Err(format!(
        "cannot unmount {}: {}",
        mp.display(),
        if last_error.is_empty() {
            e.to_string()
        } else {
            last_error
        }
    ))
}

fn wait_gone(mp: &std::path::Path) -> Result<(), String> {
    let deadline = Instant::now() + UNMOUNT_WAIT;
    while is_mount_point(mp) {
        if Instant::now() > deadline {
            return Err(format!(
                "{} is still mounted after {:?}",
                mp.display(),
                UNMOUNT_WAIT
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
