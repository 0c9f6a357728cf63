//! Nothing waits forever, and a mount is its own (issue #12): `stagefs unmount` and `stagefs
//! stats` answer within seconds when the daemon is stopped; an exiting daemon never unmounts a
//! mount made after its own at the same path; two mounts started together at one mountpoint
//! give one mount; a printing command whose pipe closes ends quietly. And a hung SOURCE (issue
//! #31) holds up no cache hit, stat, `df` or `stagefs stats`, for any user.
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Well under the 30 s `stagefs_within` allows: a hang shows as a slow answer, not a stall.
const BOUND: Duration = Duration::from_secs(15);

fn signal(pid: i32, sig: i32) {
    // SAFETY: sending a signal has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid} {sig}");
}

/// Runs `stagefs ARGS` under a 30 s deadline; returns its output and how long it took.
fn timed(args: &[&str]) -> (std::process::Output, Duration) {
    let started = Instant::now();
    let out = stagefs_within(30, args);
    (out, started.elapsed())
}

#[test]
fn a_stopped_daemon_does_not_hang_stats_or_unmount() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 6, 2, 10, 100);
    let m = TestMount::new(&src, tmp.path(), &[]);
    let pid = m.daemon_pid();
    let mnt = m.mnt.to_str().unwrap().to_string();
    signal(pid, libc::SIGSTOP);
    for extra in [&[][..], &["--json"], &["--watch"]] {
        let mut args = vec!["stats", mnt.as_str()];
        args.extend_from_slice(extra);
        let (out, took) = timed(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(took < BOUND, "stats {extra:?} took {took:?}");
        assert_eq!(out.status.code(), Some(1), "stats {extra:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
        assert!(stderr.contains("did not answer"), "{stderr:?}");
    }
    let (out, took) = timed(&["unmount", &mnt]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(took < BOUND, "unmount took {took:?}");
    assert!(out.status.success(), "unmount: {stderr}");
    assert!(stderr.contains("aborted its FUSE connection"), "{stderr:?}");
    assert!(!is_mounted(&m.mnt), "still mounted");
    // Continued by the unmount, the daemon found its connection gone and exited: its cache
    // is free for the next mount.
    assert!(
        stderr.contains(&format!(
            "continued its stopped daemon (pid {pid}), which exited"
        )),
        "{stderr:?}"
    );
    assert!(!process_alive(pid), "the stopped daemon is still there");
    std::mem::forget(m); // unmounted above
    // Its cache is not held by anyone: the next mount takes it.
    TestMount::new(&src, tmp.path(), &[]);
}

#[test]
fn unmount_takes_only_stagefs_mounts_and_follows_a_link_to_one() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 2, 2, 10, 100);
    let other = tmp.path().join("tmpfs");
    std::fs::create_dir(&other).unwrap();
    let tmpfs = Command::new("mount")
        .args(["-t", "tmpfs", "none"])
        .arg(&other)
        .status()
        .unwrap();
    assert!(tmpfs.success());
    let (out, _) = timed(&["unmount", other.to_str().unwrap()]);
    let refused = is_mounted(&other);
    let _ = Command::new("umount").arg(&other).status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(refused, "stagefs unmount took a tmpfs away");
    assert!(
        stderr.contains("is not a stagefs mount (it is tmpfs)"),
        "{stderr}"
    );

    let m = TestMount::new(&src, tmp.path(), &[]);
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&m.mnt, &link).unwrap();
    unmount_with_the_command(m, &link);
}

/// `stagefs unmount PATH` (PATH leading to `m`) succeeds and `m` is gone.
fn unmount_with_the_command(m: TestMount, path: &Path) {
    let (out, _) = timed(&["unmount", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!is_mounted(&m.mnt), "still mounted");
    std::mem::forget(m); // unmounted
}

#[test]
fn an_exiting_daemon_leaves_the_next_mount_at_its_path_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 6, 2, 10, 100);
    let m = TestMount::new(&src, tmp.path(), &[]);
    let pid = m.daemon_pid();
    // Stopped, so the tmpfs is surely in place before the daemon sees its session end.
    signal(pid, libc::SIGSTOP);
    // umount2(2) itself, as `umount MNT` ends up doing; umount(8) would stat the stopped mount.
    let c = std::ffi::CString::new(m.mnt.to_str().unwrap()).unwrap();
    // SAFETY: valid C string.
    assert_eq!(unsafe { libc::umount2(c.as_ptr(), 0) }, 0, "umount2");
    let tmpfs = Command::new("mount")
        .args(["-t", "tmpfs", "none"])
        .arg(&m.mnt)
        .status()
        .unwrap();
    assert!(tmpfs.success());
    signal(pid, libc::SIGCONT);
    let exited = wait_for(Duration::from_secs(20), || !process_alive(pid));
    let survived = is_mounted(&m.mnt);
    let _ = Command::new("umount").arg(&m.mnt).status();
    assert!(exited, "the old daemon did not exit");
    assert!(
        survived,
        "the old daemon unmounted the tmpfs mounted after it"
    );
    std::mem::forget(m);
}

#[test]
fn two_mounts_started_together_at_one_mountpoint_give_one() {
    require_fuse();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 6, 2, 10, 100);
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let start = |cache: &str| {
        Command::new(bin())
            .arg("mount")
            .args([&src, &mnt])
            .arg("--cache")
            .arg(tmp.path().join(cache))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (start("c1"), start("c2"));
    let outs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
    let mounts = mount_count(&mnt);
    while is_mounted(&mnt) {
        let _ = stagefs(&["unmount", mnt.to_str().unwrap()]);
    }
    let ok = outs.iter().filter(|o| o.status.success()).count();
    assert_eq!(ok, 1, "{outs:?}");
    assert_eq!(mounts, 1);
    let failed = outs.iter().find(|o| !o.status.success()).unwrap();
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(stderr.contains("is already a mount point"), "{stderr:?}");
}

/// The daemon leaves the directory it was started from, so that file system can be unmounted.
#[test]
fn the_daemon_does_not_pin_its_starting_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 4, 2, 10, 100);
    let m = TestMount::new(&src, tmp.path(), &[]);
    let cwd = std::fs::read_link(format!("/proc/{}/cwd", m.daemon_pid())).unwrap();
    assert_eq!(cwd, Path::new("/"));
    m.unmount();
}

/// `stagefs stats --watch | head -1`: the command ends when `head` does, without a panic.
#[test]
fn a_closed_pipe_ends_stats_watch_quietly() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 4, 2, 10, 100);
    let m = TestMount::new(&src, tmp.path(), &[]);
    let mut child = Command::new(bin())
        .args(["stats", "--watch", "--interval", "0.1"])
        .arg(&m.mnt)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one line, then close the pipe as `head -1` does.
    let mut first = [0u8; 1];
    use std::io::Read;
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    let ended = wait_for(Duration::from_secs(10), || {
        child.try_wait().unwrap().is_some()
    });
    if !ended {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(ended, "stats --watch kept running after its pipe closed");
    assert!(!stderr.contains("panicked"), "{stderr}");
    m.unmount();
}

/// A FUSE server that answers INIT and then reads every request without ever answering: a
/// daemon stopped just after it read a request (SIGSTOP lands asynchronously), the one state
/// where a caller's wait cannot be ended by any signal, even SIGKILL.
struct SilentServer {
    mnt: std::path::PathBuf,
    device: Option<std::fs::File>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl SilentServer {
    fn mount(mnt: &Path) -> SilentServer {
        require_fuse();
        let device = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .expect("/dev/fuse");
        use std::os::fd::AsRawFd;
        let options = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0",
            device.as_raw_fd()
        );
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let target = c(mnt.to_str().unwrap());
        // Typed as stagefs mounts are: `stagefs unmount` touches nothing else.
        let (source, fstype, data) = (c("silent"), c("fuse.stagefs"), c(&options));
        // SAFETY: valid C strings; the kernel reads the options.
        let mounted = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                data.as_ptr().cast(),
            )
        };
        assert_eq!(mounted, 0, "mount: {}", std::io::Error::last_os_error());
        let mut requests = device.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut buf = vec![0u8; 1 << 20];
            let mut first = true;
            // Ends when the connection is aborted (the device is closed): ENODEV.
            while let Ok(n) = requests.read(&mut buf) {
                if !first || n < 40 {
                    continue; // never answered
                }
                first = false;
                let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
                // fuse_out_header, then fuse_init_out: 7.31, nothing offered.
                let mut reply = Vec::new();
                reply.extend_from_slice(&(16u32 + 64).to_ne_bytes());
                reply.extend_from_slice(&0i32.to_ne_bytes());
                reply.extend_from_slice(&unique.to_ne_bytes());
                let mut init = [0u8; 64];
                init[0..4].copy_from_slice(&7u32.to_ne_bytes());
                init[4..8].copy_from_slice(&31u32.to_ne_bytes());
                init[20..24].copy_from_slice(&4096u32.to_ne_bytes()); // max_write
                init[24..28].copy_from_slice(&1u32.to_ne_bytes()); // time_gran
                reply.extend_from_slice(&init);
                requests.write_all(&reply).unwrap();
            }
        });
        SilentServer {
            mnt: mnt.to_path_buf(),
            device: Some(device),
            reader: Some(reader),
        }
    }
}

impl Drop for SilentServer {
    fn drop(&mut self) {
        // `stagefs unmount` aborted the connection, which ended the reader's read (ENODEV);
        // if it did not, the reader is left blocked rather than this test.
        drop(self.device.take());
        let c = std::ffi::CString::new(self.mnt.to_str().unwrap()).unwrap();
        // SAFETY: valid C string.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        if let Some(reader) = self.reader.take()
            && reader.is_finished()
        {
            let _ = reader.join();
        }
    }
}

#[test]
fn stats_and_unmount_return_when_the_daemon_holds_the_request() {
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let server = SilentServer::mount(&mnt);
    for args in [&["stats"][..], &["stats", "--json"], &["unmount"]] {
        let started = Instant::now();
        let mut child = Command::new(bin())
            .args(args)
            .arg(&mnt)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            // A process that cannot exit shows as one that never ends: fail, do not hang.
            assert!(
                started.elapsed() < BOUND,
                "stagefs {args:?} did not end within {BOUND:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stderr = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        if args[0] == "stats" {
            assert_eq!(status.code(), Some(1), "{args:?}: {stderr}");
            assert!(stderr.contains("did not answer"), "{stderr}");
        } else {
            assert!(status.success(), "{args:?}: {stderr}");
            assert!(stderr.contains("aborted its FUSE connection"), "{stderr}");
        }
    }
    assert!(!is_mounted(&mnt), "still mounted");
    drop(server);
}

#[test]
fn stats_of_a_killed_daemon_says_how_to_remove_its_mount() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 2, 2, 10, 100);
    let m = TestMount::new(&src, tmp.path(), &[]);
    let pid = m.daemon_pid();
    signal(pid, libc::SIGKILL);
    assert!(wait_for(Duration::from_secs(20), || !process_alive(pid)));
    let mnt = m.mnt.to_str().unwrap();
    let (out, _) = timed(&["stats", mnt]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(stderr.contains("its daemon is gone"), "{stderr:?}");
    assert!(
        stderr.contains(&format!("`stagefs unmount {mnt}`")),
        "{stderr:?}"
    );
    let mnt = m.mnt.clone();
    unmount_with_the_command(m, &mnt);
}

/// Starts `cmd args` as uid/gid 65534 (nobody), or as root if `nobody` is false.
fn start_as(nobody: bool, cmd: &Path, args: &[&Path]) -> std::process::Child {
    let mut c = Command::new("setpriv");
    if nobody {
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
    }
    c.arg(cmd)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run setpriv (util-linux)")
}

/// Issue #31: with SOURCE hung, another user's stat and open of a cached file waited on it
/// (its ACLs and the permission walk were read on FUSE threads), and a few `df` took every
/// FUSE thread, after which every request hung, root's hits included. SOURCE here is the
/// slow remote, frozen once every file is cached. A process waiting on a FUSE answer cannot
/// be killed, so the test polls, thaws SOURCE, and then asserts.
#[test]
fn a_hung_source_holds_up_no_hit_stat_or_df_for_any_user() {
    use stagefs::slow_remote::{Latency, SlowRemote};
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let backing = tmp.path().join("backing");
    let files = image_folder(&backing, 12, 3, 100, 1000);
    let remote = tmp.path().join("remote");
    std::fs::create_dir(&remote).unwrap();
    let latency = Latency {
        metadata: Duration::from_millis(1),
    };
    let slow = SlowRemote::mount_for_everyone(&backing, &remote, latency).unwrap();
    let m = TestMount::new(&remote, tmp.path(), &["--allow-other"]);
    let in_mount: Vec<_> = files
        .iter()
        .map(|f| m.mnt.join(f.strip_prefix(&backing).unwrap()))
        .collect();
    for f in &in_mount {
        std::fs::read(f).unwrap();
    }
    assert_eq!(m.wait_stat("staged_files", 12), 12, "{}", m.stats());
    // Nobody has read half of them before: SOURCE said yes then.
    let (known, unknown) = in_mount.split_at(6);
    let cat = Path::new("cat");
    for f in known {
        assert!(start_as(true, cat, &[f]).wait().unwrap().success(), "{f:?}");
    }
    slow.freeze();
    // Past the remote's attribute and entry TTL (1 s): from now on every SOURCE call waits.
    std::thread::sleep(Duration::from_secs(2));
    let mut runs = Vec::new();
    for i in 0..12 {
        runs.push(("df", start_as(i % 2 == 0, Path::new("df"), &[&m.mnt])));
    }
    for f in known {
        runs.push(("root cat", start_as(false, cat, &[f])));
        runs.push(("nobody cat (known)", start_as(true, cat, &[f])));
    }
    for f in unknown {
        runs.push(("root cat", start_as(false, cat, &[f])));
        runs.push(("nobody stat", start_as(true, Path::new("stat"), &[f])));
        runs.push(("nobody cat (unknown)", start_as(true, cat, &[f])));
    }
    runs.push((
        "stagefs stats",
        start_as(false, &bin(), &[Path::new("stats"), &m.mnt]),
    ));
    let started = Instant::now();
    let mut ended: Vec<_> = runs.iter().map(|_| None).collect();
    while ended.iter().any(Option::is_none) && started.elapsed() < BOUND {
        for ((_, child), end) in runs.iter_mut().zip(&mut ended) {
            if end.is_none() {
                *end = child.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    slow.thaw();
    for ((what, mut child), end) in runs.into_iter().zip(ended) {
        let Some(status) = end else {
            let _ = child.wait();
            panic!("{what} waited on the hung SOURCE for {BOUND:?}");
        };
        // Answered from what is known without SOURCE; only files nobody was never allowed
        // by SOURCE may be refused.
        if !what.ends_with("(unknown)") && what != "nobody stat" {
            assert!(status.success(), "{what}: {status}");
        }
    }
    m.unmount();
}
