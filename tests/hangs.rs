//! Nothing waits forever, and a mount is its own (issue #12): `stagefs unmount` and `stagefs
//! stats` answer within seconds when the daemon is stopped; an exiting daemon never unmounts a
//! mount made after its own at the same path; two mounts started together at one mountpoint
//! give one mount; a printing command whose pipe closes ends quietly. And (issue #31) a hung
//! SOURCE holds up no cache hit, stat, `df` or `stagefs stats`, for any user; and `stagefs
//! unmount` as root acts only on the stagefs mount it identified and on its daemon: not on a
//! mount that claims to be one, not on another mount a swapped directory leads to, not on
//! processes that look like its daemon.
mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Well under the 30 s `stagefs_within` allows: a hang shows as a slow answer, not a stall.
const BOUND: Duration = Duration::from_secs(15);

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

/// Mounts a FUSE file system served through a new /dev/fuse descriptor at `mnt`, typed as
/// stagefs mounts are (`stagefs unmount` touches nothing else) and owned by uid `owner` (as
/// fusermount3 mounts a user's, without allow_other), and returns the descriptor.
fn mount_fake_stagefs(mnt: &Path, owner: u32) -> std::fs::File {
    require_fuse();
    let device = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .expect("/dev/fuse");
    use std::os::fd::AsRawFd;
    let options = format!(
        "fd={},rootmode=40000,user_id={owner},group_id={owner}",
        device.as_raw_fd()
    );
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    let target = c(mnt.to_str().unwrap());
    let (source, fstype, data) = (c("fake"), c("fuse.stagefs"), c(&options));
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
    device
}

/// FUSE opcodes and sizes the fake servers here use (linux/fuse.h).
const FUSE_INIT: u32 = 26;
const FUSE_GETXATTR: u32 = 22;
/// Requests that get no reply.
const FUSE_NO_REPLY: [u32; 3] = [2, 36, 42]; // FORGET, INTERRUPT, BATCH_FORGET
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;

/// Writes into `reply` the answer to request `unique`: `error` (0 or minus an errno), then
/// `body`; its length. Allocates nothing (a forked server's).
fn fuse_reply(reply: &mut [u8], unique: u64, error: i32, body: &[u8]) -> usize {
    let len = OUT_HEADER + body.len();
    reply[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
    reply[4..8].copy_from_slice(&error.to_ne_bytes());
    reply[8..16].copy_from_slice(&unique.to_ne_bytes());
    reply[OUT_HEADER..len].copy_from_slice(body);
    len
}

/// fuse_init_out for protocol 7.31, offering nothing.
fn fuse_init_out() -> [u8; 64] {
    let mut init = [0u8; 64];
    init[0..4].copy_from_slice(&7u32.to_ne_bytes());
    init[4..8].copy_from_slice(&31u32.to_ne_bytes());
    init[20..24].copy_from_slice(&4096u32.to_ne_bytes()); // max_write
    init[24..28].copy_from_slice(&1u32.to_ne_bytes()); // time_gran
    init
}

impl SilentServer {
    fn mount(mnt: &Path) -> SilentServer {
        let device = mount_fake_stagefs(mnt, 0);
        let mut requests = device.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut buf = vec![0u8; 1 << 20];
            let mut reply = [0u8; 128];
            let mut first = true;
            // Ends when the connection is aborted (the device is closed): ENODEV.
            while let Ok(n) = requests.read(&mut buf) {
                if !first || n < IN_HEADER {
                    continue; // never answered
                }
                first = false;
                let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
                let len = fuse_reply(&mut reply, unique, 0, &fuse_init_out());
                requests.write_all(&reply[..len]).unwrap();
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

/// Starts `cmd args` as uid and gid `uid` (see [`as_user`]).
fn start_as(uid: u32, cmd: &Path, args: &[&Path]) -> std::process::Child {
    as_user(uid, &[])
        .arg(cmd)
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
    let tmp = open_workdir();
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
        assert!(
            start_as(NOBODY, cat, &[f]).wait().unwrap().success(),
            "{f:?}"
        );
    }
    slow.freeze();
    // Past the remote's attribute and entry TTL (1 s): from now on every SOURCE call waits.
    std::thread::sleep(Duration::from_secs(2));
    let mut runs = Vec::new();
    for i in 0..12 {
        let uid = if i % 2 == 0 { NOBODY } else { 0 };
        runs.push(("df", start_as(uid, Path::new("df"), &[&m.mnt])));
    }
    for f in known {
        runs.push(("root cat", start_as(0, cat, &[f])));
        runs.push(("nobody cat (known)", start_as(NOBODY, cat, &[f])));
    }
    for f in unknown {
        runs.push(("root cat", start_as(0, cat, &[f])));
        runs.push(("nobody stat", start_as(NOBODY, Path::new("stat"), &[f])));
        runs.push(("nobody cat (unknown)", start_as(NOBODY, cat, &[f])));
    }
    runs.push((
        "stagefs stats",
        start_as(0, &bin(), &[Path::new("stats"), &m.mnt]),
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

/// Unmounts (lazily) the mounts a test made, even when it fails.
struct Unmounts(Vec<PathBuf>);

impl Drop for Unmounts {
    fn drop(&mut self) {
        for path in self.0.iter().rev() {
            while is_mounted(path) {
                if !Command::new("umount")
                    .arg("-l")
                    .arg(path)
                    .status()
                    .unwrap()
                    .success()
                {
                    break;
                }
            }
        }
    }
}

/// Mounts `args...` at `target` with mount(8), unmounted by `guard` in the end.
fn mount_at(guard: &mut Unmounts, target: &Path, args: &[&str]) {
    std::fs::create_dir_all(target).unwrap();
    let status = Command::new("mount")
        .args(args)
        .arg(target)
        .status()
        .unwrap();
    assert!(status.success(), "mount {args:?} {}", target.display());
    guard.0.push(target.to_path_buf());
}

/// A tmpfs and a bind mount whose roots carry the attribute stagefs answers its daemon's pid
/// in, set by the user who owns them: neither is a stagefs mount, and neither is taken.
#[test]
fn unmount_refuses_a_mount_that_only_claims_to_be_stagefs() {
    let tmp = open_workdir();
    let mut guard = Unmounts(Vec::new());
    let tmpfs = tmp.path().join("tmpfs");
    mount_at(
        &mut guard,
        &tmpfs,
        &["-t", "tmpfs", "-o", "uid=65534,mode=0755", "none"],
    );
    let dir = tmp.path().join("dir");
    std::fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let bind = tmp.path().join("bind");
    mount_at(&mut guard, &bind, &["--bind", dir.to_str().unwrap()]);
    // A live process, as a daemon's pid would be.
    let pid = std::process::id().to_string();
    for claimed in [&tmpfs, &bind] {
        let set = as_nobody(
            Path::new("setfattr"),
            ["-n", "user.stagefs.pid", "-v", &pid],
        )
        .arg(claimed)
        .output()
        .unwrap();
        assert!(set.status.success(), "setfattr as nobody: {set:?}");
        let (out, _) = timed(&["unmount", claimed.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            is_mounted(claimed),
            "{} was unmounted: {stderr}",
            claimed.display()
        );
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("is not a stagefs mount"), "{stderr}");
    }
}

/// A fake stagefs mount at `mnt` owned by uid `owner`, served by a forked child of this test
/// running as that user, so that the process the kernel shows serving it is not the test: it
/// answers INIT, runs `on_getxattr` when the first GETXATTR comes and answers that with
/// `value`, refuses anything else (ENOSYS), and exits once its connection ends. Returns the
/// child's pid.
fn fork_server(
    mnt: &Path,
    owner: u32,
    value: &'static [u8],
    on_getxattr: impl FnOnce(),
) -> libc::pid_t {
    use std::os::fd::AsRawFd;
    let device = mount_fake_stagefs(mnt, owner);
    // Everything the child uses is made before the fork: this test is multi-threaded.
    let fd = device.as_raw_fd();
    let mut buf = vec![0u8; (1 << 20) + 4096];
    let mut reply = [0u8; 256];
    let (init, size) = (fuse_init_out(), (value.len() as u64).to_ne_bytes());
    let mut on_getxattr = Some(on_getxattr);
    // SAFETY: the child makes only system calls (read, write, _exit and those of
    // `on_getxattr`) on memory prepared above.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: system calls with no memory arguments.
        if unsafe { libc::setgid(owner) != 0 || libc::setuid(owner) != 0 } {
            // SAFETY: ends the child.
            unsafe { libc::_exit(1) };
        }
        loop {
            // SAFETY: a buffer we own, of the length passed.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n < IN_HEADER as isize {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                // SAFETY: ends the child; the connection is over (ENODEV).
                unsafe { libc::_exit(0) };
            }
            let opcode = u32::from_ne_bytes(buf[4..8].try_into().unwrap());
            let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
            let len = match opcode {
                FUSE_INIT => fuse_reply(&mut reply, unique, 0, &init),
                FUSE_GETXATTR => {
                    if let Some(hook) = on_getxattr.take() {
                        hook();
                    }
                    // fuse_getxattr_in.size 0 asks for the length (fuse_getxattr_out).
                    match buf[IN_HEADER..IN_HEADER + 4] == [0; 4] {
                        true => fuse_reply(&mut reply, unique, 0, &size),
                        false => fuse_reply(&mut reply, unique, 0, value),
                    }
                }
                op if FUSE_NO_REPLY.contains(&op) => continue,
                _ => fuse_reply(&mut reply, unique, -libc::ENOSYS, &[]),
            };
            // SAFETY: the reply written above.
            unsafe { libc::write(fd, reply.as_ptr().cast(), len) };
        }
    }
    assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
    pid
}

/// Reaps child `pid`, killing it first if it is still running after a few seconds.
fn reap(pid: libc::pid_t) {
    let exited = wait_for(Duration::from_secs(5), || !process_alive(pid));
    if !exited {
        signal(pid, libc::SIGKILL);
    }
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
}

/// The owner of the directory above a mount swaps it for a link to the directory of another
/// mount while `stagefs unmount` waits for the daemon's answer (the fake daemon does it as it
/// answers): the mount that was identified is unmounted where it now is, the other is not.
#[test]
fn unmount_takes_the_mount_it_identified_when_a_directory_above_is_swapped() {
    let tmp = tempfile::tempdir().unwrap();
    let (above, moved, other) = (
        tmp.path().join("above"),
        tmp.path().join("moved"),
        tmp.path().join("other"),
    );
    let mut guard = Unmounts(Vec::new());
    let other_mount = other.join("mnt");
    mount_at(&mut guard, &other_mount, &["-t", "tmpfs", "none"]);
    let mnt = above.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    guard.0.push(moved.join("mnt"));
    let c = |p: &Path| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let (above_c, moved_c, other_c) = (c(&above), c(&moved), c(&other));
    let server = fork_server(&mnt, 0, b"1", move || {
        // SAFETY: valid C strings made before the fork.
        unsafe {
            libc::rename(above_c.as_ptr(), moved_c.as_ptr());
            libc::symlink(other_c.as_ptr(), above_c.as_ptr());
        }
    });
    let (out, _) = timed(&["unmount", mnt.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let (other_kept, ours_gone) = (is_mounted(&other_mount), !is_mounted(&moved.join("mnt")));
    drop(guard);
    reap(server);
    assert!(
        std::fs::symlink_metadata(&above).unwrap().is_symlink(),
        "not swapped"
    );
    assert!(other_kept, "the other mount was taken: {stderr}");
    assert!(ours_gone, "the mount identified is still there: {stderr}");
    assert!(out.status.success(), "{stderr}");
}

/// The state letter of process `pid` (R, S, T...).
fn state_of(pid: i32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim().chars().next());
    state.unwrap_or('?')
}

/// Stopped processes of another user named `stagefs`, with command lines and environments of
/// a daemon of the mount (one of them naming a path on another stopped mount, which a look at
/// it would wait on): `stagefs unmount` of a stopped daemon's mount continues that daemon, and
/// only it, within seconds.
#[test]
fn unmount_continues_the_stopped_daemon_and_no_process_that_looks_like_it() {
    let tmp = open_workdir();
    let src = tmp.path().join("src");
    image_folder(&src, 6, 2, 10, 100);
    let (first, second) = (tmp.path().join("first"), tmp.path().join("second"));
    std::fs::create_dir_all(&first).unwrap();
    std::fs::create_dir_all(&second).unwrap();
    let m = TestMount::new(&src, &first, &[]);
    let other = TestMount::new(&src, &second, &[]);
    let (pid, other_pid) = (m.daemon_pid(), other.daemon_pid());
    signal(other_pid, libc::SIGSTOP);
    // `cat` named stagefs, blocked opening the FIFO `mount` its first argument names.
    let decoys = tmp.path().join("decoys");
    std::fs::create_dir(&decoys).unwrap();
    let fake = decoys.join("stagefs");
    std::fs::copy("/bin/cat", &fake).unwrap();
    stagefs::sys::mkfifo(&decoys.join("mount"), 0o644).unwrap();
    let through_other = other.mnt.join("class000/img000000.jpg");
    let spawn = |args: &[&OsStr], env: &[(&str, &Path)]| {
        let mut decoy = as_nobody(&fake, args)
            .current_dir(&decoys)
            .envs(env.iter().copied())
            .spawn()
            .unwrap();
        let id = decoy.id() as i32;
        let blocked = wait_for(Duration::from_secs(10), || {
            std::fs::read_to_string(format!("/proc/{id}/comm")).is_ok_and(|c| c == "stagefs\n")
                && state_of(id) == 'S'
        });
        if !blocked {
            let _ = decoy.kill();
        }
        assert!(blocked, "the decoy did not start");
        signal(id, libc::SIGSTOP);
        decoy
    };
    let mut decoys = [
        spawn(
            &[OsStr::new("mount"), src.as_os_str(), m.mnt.as_os_str()],
            &[("STAGEFS_MOUNTPOINT", &m.mnt)],
        ),
        spawn(&[OsStr::new("mount"), through_other.as_os_str()], &[]),
    ];
    signal(pid, libc::SIGSTOP);
    let (out, took) = timed(&["unmount", m.mnt.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let decoy_states: Vec<char> = decoys.iter().map(|d| state_of(d.id() as i32)).collect();
    for decoy in &mut decoys {
        let _ = decoy.kill();
        let _ = decoy.wait();
    }
    signal(other_pid, libc::SIGCONT);
    other.unmount();
    assert!(took < BOUND, "unmount took {took:?}: {stderr}");
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "continued its stopped daemon (pid {pid}), which exited"
        )),
        "{stderr}"
    );
    assert_eq!(decoy_states, ['T', 'T'], "a decoy was continued");
    assert!(!process_alive(pid));
    std::mem::forget(m); // unmounted above
}

/// A directory above a mount swapped for a link to another mount's directory, then the
/// daemon told to stop: it unmounts its own mount where that now is, and not the other.
#[test]
fn a_stopping_daemon_unmounts_its_own_mount_wherever_a_swap_put_it() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 4, 2, 10, 100);
    let (above, moved, other) = (
        tmp.path().join("above"),
        tmp.path().join("moved"),
        tmp.path().join("other"),
    );
    std::fs::create_dir(&above).unwrap();
    let mut guard = Unmounts(vec![moved.join("mnt")]);
    let other_mount = other.join("mnt");
    mount_at(&mut guard, &other_mount, &["-t", "tmpfs", "none"]);
    let m = TestMount::new(&src, &above, &[]);
    let pid = m.daemon_pid();
    std::fs::rename(&above, &moved).unwrap();
    std::os::unix::fs::symlink(&other, &above).unwrap();
    signal(pid, libc::SIGTERM);
    let exited = wait_for(Duration::from_secs(20), || !process_alive(pid));
    let (other_kept, ours_gone) = (is_mounted(&other_mount), !is_mounted(&moved.join("mnt")));
    std::mem::forget(m); // its path leads elsewhere now
    drop(guard);
    assert!(exited, "the daemon did not exit");
    assert!(other_kept, "the daemon unmounted the other mount");
    assert!(ours_gone, "the daemon left its own mount behind");
}

/// Another mount whose mount point's name is not UTF-8 (any user can name a directory so and
/// mount a FUSE file system there): stagefs still finds its own mounts in the mount table.
#[test]
fn a_mount_point_name_that_is_not_utf8_hides_no_mount() {
    use std::os::unix::ffi::OsStrExt;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    image_folder(&src, 4, 2, 10, 100);
    let mut guard = Unmounts(Vec::new());
    let odd = tmp.path().join(OsStr::from_bytes(b"caf\xe9"));
    std::fs::create_dir(&odd).unwrap();
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "none"])
        .arg(&odd)
        .status()
        .unwrap();
    assert!(status.success());
    guard.0.push(odd);
    let outcome = TestMount::try_new(&src, tmp.path(), &[]).map(|m| {
        let out = stagefs(&["unmount", m.mnt.to_str().unwrap()]);
        let gone = !is_mounted(&m.mnt);
        if gone {
            std::mem::forget(m);
        }
        (out, gone)
    });
    let odd_seen = guard.0.iter().all(|p| is_mounted(p));
    drop(guard);
    let (unmounted, gone) = outcome.expect("mount");
    assert!(odd_seen, "the test cannot see its own mount");
    assert!(unmounted.status.success(), "{unmounted:?}");
    assert!(gone, "still mounted");
}

/// A user's own stagefs mount (owned by nobody, without allow_other, so root may not look
/// inside it): root's `stagefs unmount` still identifies and unmounts it, and waits for the
/// user's daemon, which the kernel shows serving it, to exit.
#[test]
fn root_unmounts_a_users_own_mount_and_waits_for_its_daemon() {
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    std::os::unix::fs::chown(&mnt, Some(65534), Some(65534)).unwrap();
    let guard = Unmounts(vec![mnt.clone()]);
    let server = fork_server(&mnt, 65534, b"1", || {});
    let (out, _) = timed(&["unmount", mnt.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let gone = !is_mounted(&mnt);
    let server_exited = !process_alive(server);
    drop(guard);
    reap(server);
    assert!(out.status.success(), "{stderr}");
    assert!(gone, "still mounted");
    assert!(server_exited, "its daemon is still running");
}
