//! The cluster deployment scripts in `mount-scripts/` (issue #7), run for real against the
//! real binary: `stagefs-run` around a Python reader (exit status, signals, busy
//! mountpoints, Ctrl-C at a terminal), the Slurm prolog/epilog under a faked Slurm environment
//! (two "nodes" on this machine), the sbatch example under stub srun/torchrun, the fstab helper through util-linux `mount -T`, the systemd unit through
//! `systemd-analyze verify`, `install.sh` into a staging root, and shellcheck over all of it.
//!
//! Every mount a test makes is registered with a [`Guard`], which unmounts it (and kills the
//! processes the test started) even when an assertion fails.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use common::{
    TestMount, bin, daemon_pid, image_folder, is_mounted, process_alive, signal, stagefs, stats_at,
    text, wait_until,
};
use sha2::{Digest, Sha256};
use tempfile::TempDir;

/// Longest any single step may take before the test gives up (a hang guard, not a timing check).
const DEADLINE: Duration = Duration::from_secs(60);

const PYTHON: &str = "/usr/bin/python3";

fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("mount-scripts")
}

fn script(name: &str) -> PathBuf {
    scripts_dir().join(name)
}

/// Undoes what a test set up, in reverse order, even when the test panics.
#[derive(Default)]
struct Guard {
    mounts: Vec<PathBuf>,
    children: Vec<Child>,
    /// (installed path, backup of what was there before)
    installed: Vec<(PathBuf, Option<PathBuf>)>,
    /// Mount points whose lines in mount(8)'s /run/mount/utab to drop (see [`drop_utab_entry`]).
    utab: Vec<PathBuf>,
}

impl Guard {
    fn mount(&mut self, mnt: &Path) {
        self.mounts.push(mnt.to_path_buf());
    }

    /// Puts a symlink to `target` at `path` (a system path such as /sbin/mount.fuse.stagefs),
    /// moving whatever was there aside until the guard drops.
    fn install_link(&mut self, target: &Path, path: &Path) {
        let backup = if fs::symlink_metadata(path).is_ok() {
            let b = path.with_extension(format!("deploy-test-backup-{}", std::process::id()));
            fs::rename(path, &b).unwrap();
            Some(b)
        } else {
            None
        };
        self.installed.push((path.to_path_buf(), backup));
        std::os::unix::fs::symlink(target, path).unwrap();
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        for mnt in self.mounts.iter().rev() {
            if is_mounted(mnt) {
                // umount(8) also drops mount(8)'s utab entry for fstab mounts.
                let _ = Command::new("umount").arg(mnt).output();
                let _ = stagefs(&["unmount", mnt.to_str().unwrap()]);
                let _ = Command::new("umount").arg("-l").arg(mnt).output();
            }
        }
        for mnt in &self.utab {
            drop_utab_entry(mnt);
        }
        for (path, backup) in self.installed.drain(..).rev() {
            let _ = fs::remove_file(&path);
            if let Some(b) = backup {
                let _ = fs::rename(b, &path);
            }
        }
    }
}

/// Removes the line mount(8) keeps in /run/mount/utab for an fstab mount with userspace
/// options (`_netdev`, `x-*`) at `mnt`. umount(8) removes it; `stagefs unmount` (fusermount3 or
/// umount2) does not know about it, so a test that unmounts that way cleans up here. Done
/// under libmount's lock file, as libmount itself does.
fn drop_utab_entry(mnt: &Path) {
    let utab = Path::new("/run/mount/utab");
    let Ok(lock) = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open("/run/mount/utab.lock")
    else {
        return;
    };
    // Released when `lock` is dropped.
    let _ = lock.lock();
    let Ok(body) = fs::read_to_string(utab) else {
        return;
    };
    let needle = format!(" TARGET={} ", mnt.display());
    let kept: String = body
        .lines()
        .filter(|l| !format!(" {l} ").contains(&needle))
        .map(|l| format!("{l}\n"))
        .collect();
    if kept.len() != body.len() {
        let _ = fs::write(utab, kept);
    }
}

/// Waits for `child` to exit, killing it and failing the test after [`DEADLINE`].
fn wait_deadline(child: &mut Child, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_daemon_exits(pid: i32) {
    wait_until(DEADLINE, &format!("stagefs daemon {pid} to exit"), || {
        !process_alive(pid)
    });
}

/// The daemon's command line, argument by argument.
fn daemon_args(pid: i32) -> Vec<String> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    raw.split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(text)
        .collect()
}

/// True if `args` holds `flag` immediately followed by `value`.
fn has_option(args: &[String], flag: &str, value: &str) -> bool {
    args.windows(2).any(|w| w[0] == flag && w[1] == value)
}

/// A Python reader: reads every file of SOURCE (argv[2]) through MOUNT (argv[1]) and compares
/// it, writes the daemon's pid to argv[4], then exits with status argv[3] (3 on a mismatch).
const READER: &str = r#"
import os, sys
mnt, src, code, pidfile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
open(pidfile, "w").write(os.getxattr(mnt, "user.stagefs.pid").decode())
n = 0
for d, _, files in os.walk(src):
    for f in files:
        p = os.path.join(d, f)
        with open(os.path.join(mnt, os.path.relpath(p, src)), "rb") as a, open(p, "rb") as b:
            if a.read() != b.read():
                print("differs:", p); sys.exit(3)
        n += 1
print("read", n, "files")
sys.exit(code)
"#;

/// A command that waits to be signalled: records the daemon's pid in argv[2] once running, and
/// on signal argv[1] writes "got" to argv[3], then dies of that signal. For SIGINT it keeps
/// Python's own handler (KeyboardInterrupt), which Python installs only if SIGINT was not
/// ignored when it started: so it also checks that stagefs-run un-ignores SIGINT for it.
const SLEEPER: &str = r#"
import os, signal, sys, time
sig = getattr(signal, sys.argv[1]); pidfile, marker, mnt = sys.argv[2], sys.argv[3], sys.argv[4]
def got(*_):
    open(marker, "w").write("got")
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
if sig != signal.SIGINT:
    signal.signal(sig, got)
try:
    pid = os.getxattr(mnt, "user.stagefs.pid").decode()
    open(pidfile + ".tmp", "w").write(pid); os.rename(pidfile + ".tmp", pidfile)
    time.sleep(120)
except KeyboardInterrupt:
    got()
"#;

/// Paths of one signal-test run under `work`.
struct SleeperRun {
    mnt: PathBuf,
    pidfile: PathBuf,
    marker: PathBuf,
    script: PathBuf,
}

impl SleeperRun {
    fn new(work: &Path) -> SleeperRun {
        fs::create_dir_all(work).unwrap();
        let script = work.join("sleeper.py");
        fs::write(&script, SLEEPER).unwrap();
        SleeperRun {
            mnt: work.join("mnt"),
            pidfile: work.join("daemon.pid"),
            marker: work.join("marker"),
            script,
        }
    }

    /// The command stagefs-run runs: the sleeper, waiting for signal `name`.
    fn command(&self, name: &str) -> Vec<String> {
        [PYTHON, self.script.to_str().unwrap(), name]
            .into_iter()
            .map(str::to_string)
            .chain([&self.pidfile, &self.marker, &self.mnt].map(|p| p.display().to_string()))
            .collect()
    }

    /// Waits until the sleeper runs under the mount; returns the daemon's pid.
    fn wait_ready(&self, child: &mut Child, stderr: &Path) -> i32 {
        wait_until(DEADLINE, "the command under stagefs-run to start", || {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "exited early with {status}: {}",
                    fs::read_to_string(stderr).unwrap_or_default()
                );
            }
            self.pidfile.exists()
        });
        fs::read_to_string(&self.pidfile).unwrap().parse().unwrap()
    }

    /// After the run: the command got the signal, the mount is gone, the daemon exited.
    fn assert_cleaned_up(&self, daemon: i32, what: &str) {
        assert_eq!(
            fs::read_to_string(&self.marker).ok().as_deref(),
            Some("got"),
            "{what}: the command did not get the signal"
        );
        assert!(!is_mounted(&self.mnt), "{what}: still mounted");
        assert_daemon_exits(daemon);
    }
}

/// Makes SIGINT and SIGQUIT default in a child, as a terminal or srun would start it: the test
/// harness may itself have been started with them ignored, and bash cannot trap a signal that
/// was ignored when it started.
fn default_interrupt_signals(cmd: &mut Command) {
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            Ok(())
        });
    }
}

/// `stagefs-run SOURCE MNT --cache .. --log-file .. -- COMMAND`, with its output in files
/// under `work` (pipes could fill up while we wait) and the stagefs binary given by $STAGEFS.
/// It runs in its own process group, as under srun or a service manager (not in a terminal's
/// foreground group, where Ctrl-C would reach the command directly).
fn spawn_run<S: AsRef<std::ffi::OsStr>>(
    work: &Path,
    source: &Path,
    mnt: &Path,
    command: &[S],
) -> Child {
    let out = fs::File::create(work.join("run.out")).unwrap();
    let err = fs::File::create(work.join("run.err")).unwrap();
    let mut cmd = Command::new(script("stagefs-run"));
    cmd.arg(source)
        .arg(mnt)
        .arg("--cache")
        .arg(work.join("cache"))
        .arg("--log-file")
        .arg(work.join("stagefs.log"))
        .arg("--")
        .args(command)
        .env("STAGEFS", bin())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0);
    default_interrupt_signals(&mut cmd);
    cmd.spawn().expect("run stagefs-run")
}

fn run_output(work: &Path) -> (String, String) {
    let read = |n: &str| fs::read_to_string(work.join(n)).unwrap_or_default();
    (read("run.out"), read("run.err"))
}

/// Opens (hits + misses) from the statistics table stagefs-run prints at the end.
fn final_opens(stderr: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("opens"))
        .unwrap_or_else(|| panic!("no final statistics in stagefs-run's stderr:\n{stderr}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let count = |label: &str| -> u64 {
        let i = words
            .iter()
            .position(|w| w.trim_end_matches(',') == label)
            .unwrap();
        words[i - 1].parse().unwrap()
    };
    count("hits") + count("misses")
}

#[test]
fn every_script_has_a_header_and_is_shellcheck_clean() {
    let mut checked = Vec::new();
    for entry in fs::read_dir(scripts_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let body = fs::read_to_string(&path).unwrap();
        // Every file says what it is and how to use it at the top.
        let top: String = body.lines().take(3).collect::<Vec<_>>().join("\n");
        if name != "README.md" {
            assert!(
                top.contains(&format!("# {name}: ")),
                "{name} does not open with a `# {name}: ...` header"
            );
        }
        let shell = body.starts_with("#!/usr/bin/env bash") || body.starts_with("#!/bin/bash");
        if !(shell || name.ends_with(".sh")) {
            continue;
        }
        if shell && name != "slurm-example.sbatch" {
            let mode = fs::metadata(&path).unwrap().permissions().mode();
            assert!(mode & 0o111 != 0, "{name} is not executable");
        }
        checked.push(name);
    }
    checked.sort();
    let expected = [
        "install.sh",
        "mount.fuse.stagefs",
        "slurm-epilog.sh",
        "slurm-example.sbatch",
        "slurm-prolog.sh",
        "slurm-task-prolog.sh",
        "stagefs-lib.sh",
        "stagefs-run",
    ];
    assert_eq!(checked, expected, "the set of shell scripts changed");
    let out = Command::new("shellcheck")
        .arg("-x")
        .args(&checked)
        .current_dir(scripts_dir())
        .output()
        .expect("run shellcheck (apt-get install shellcheck)");
    assert!(
        out.status.success(),
        "shellcheck -x:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

#[test]
fn stagefs_run_returns_the_command_status_and_unmounts() {
    let tmp = TempDir::new().unwrap();
    let source = tmp.path().join("src");
    let files = image_folder(&source, 30, 3, 100, 3000).len() as u64;
    for (i, (code, command_exists)) in [(0, true), (7, true), (127, false)].into_iter().enumerate()
    {
        let work = tmp.path().join(format!("run{i}"));
        fs::create_dir_all(&work).unwrap();
        let mnt = work.join("mnt");
        let pidfile = work.join("daemon.pid");
        let mut guard = Guard::default();
        guard.mount(&mnt);
        let code_arg = code.to_string();
        let (mnt_s, src_s, pid_s) = (
            mnt.to_str().unwrap(),
            source.to_str().unwrap(),
            pidfile.to_str().unwrap(),
        );
        let command: Vec<&str> = if command_exists {
            vec![PYTHON, "-c", READER, mnt_s, src_s, &code_arg, pid_s]
        } else {
            vec!["/nonexistent/command"]
        };
        let mut child = spawn_run(&work, &source, &mnt, &command);
        let status = wait_deadline(&mut child, "stagefs-run");
        let (stdout, stderr) = run_output(&work);
        assert_eq!(
            status.code(),
            Some(code),
            "stagefs-run exit status\nstdout: {stdout}\nstderr: {stderr}"
        );
        assert!(
            !is_mounted(&mnt),
            "{} still mounted after stagefs-run exited",
            mnt.display()
        );
        if command_exists {
            assert!(
                stdout.contains(&format!("read {files} files")),
                "reader output: {stdout}"
            );
            // The final statistics are the mount's, taken after the reader finished.
            assert_eq!(final_opens(&stderr), files, "stderr:\n{stderr}");
            assert_daemon_exits(fs::read_to_string(&pidfile).unwrap().parse().unwrap());
        }
    }
}

/// Where the job's hook directory is: the first PYTHONPATH entry, holding the hook.
fn hook_first(pythonpath: &str, rest: &str) {
    let (first, after) = pythonpath.split_once(':').unwrap_or((pythonpath, ""));
    assert!(
        Path::new(first).join("stagefs_feed/opens.py").is_file(),
        "{pythonpath}"
    );
    assert_eq!(after, rest, "{pythonpath}");
}

/// The hook is on by default where we launch the job: the Slurm TaskProlog prints it into
/// every task's environment (whole, Slurm does no expansion) and stagefs-run gives it to
/// COMMAND; STAGEFS_HOOK=0 in the job's environment turns both off.
#[test]
fn the_hook_is_on_in_launched_jobs_unless_they_turn_it_off() {
    let task_prolog = |env: &[(&str, &str)]| {
        let out = Command::new(script("slurm-task-prolog.sh"))
            .env("STAGEFS", bin())
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(text(&out.stderr), "");
        text(&out.stdout)
    };
    let on = task_prolog(&[("PYTHONPATH", "/site/a:/site/b")]);
    let value = on.strip_prefix("export PYTHONPATH=").expect(&on);
    hook_first(value.trim_end(), "/site/a:/site/b");
    let alone = task_prolog(&[]);
    hook_first(
        alone
            .strip_prefix("export PYTHONPATH=")
            .expect(&alone)
            .trim_end(),
        "",
    );
    assert_eq!(task_prolog(&[("STAGEFS_HOOK", "0")]), "");

    let tmp = TempDir::new().unwrap();
    let source = tmp.path().join("src");
    image_folder(&source, 3, 1, 10, 20);
    let show = [
        PYTHON,
        "-c",
        "import os; print(os.environ.get('PYTHONPATH', '-'))",
    ];
    for (hook, want_hook) in [("1", true), ("0", false)] {
        let work = tmp.path().join(format!("hook{hook}"));
        fs::create_dir_all(&work).unwrap();
        let mnt = work.join("mnt");
        let mut guard = Guard::default();
        guard.mount(&mnt);
        let mut cmd = Command::new(script("stagefs-run"));
        let out = cmd
            .arg(&source)
            .arg(&mnt)
            .arg("--cache")
            .arg(work.join("cache"))
            .arg("--")
            .args(show)
            .env("STAGEFS", bin())
            .env("STAGEFS_HOOK", hook)
            .env("PYTHONPATH", "/site")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let seen = text(&out.stdout).trim().to_string();
        if want_hook {
            hook_first(&seen, "/site");
        } else {
            assert_eq!(seen, "/site");
        }
    }
}

#[test]
fn stagefs_run_forwards_signals_and_cleans_up() {
    let tmp = TempDir::new().unwrap();
    let source = tmp.path().join("src");
    image_folder(&source, 10, 2, 100, 1000);
    for (sig, name) in [
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGHUP, "SIGHUP"),
    ] {
        let work = tmp.path().join(name);
        let run = SleeperRun::new(&work);
        let mut guard = Guard::default();
        guard.mount(&run.mnt);
        guard
            .children
            .push(spawn_run(&work, &source, &run.mnt, &run.command(name)));
        let child = guard.children.last_mut().unwrap();
        let daemon = run.wait_ready(child, &work.join("run.err"));
        signal(child.id() as i32, sig);
        let status = wait_deadline(child, "stagefs-run after a signal");
        let stderr = run_output(&work).1;
        assert_eq!(
            status.code(),
            Some(128 + sig),
            "{name}: stagefs-run status; stderr:\n{stderr}"
        );
        run.assert_cleaned_up(daemon, name);
    }
}

/// stagefs-run under script(1), which gives it a terminal whose foreground process group it
/// shares with its command: a ^C typed into it is the terminal's SIGINT to both.
struct TerminalRun {
    child: Child,
    keyboard: std::process::ChildStdin,
    output: PathBuf,
}

impl TerminalRun {
    fn start(guard: &mut Guard, work: &Path, source: &Path, run: &SleeperRun) -> TerminalRun {
        let line = format!(
            "{} {} {} --cache {} --log-file {} -- {}; echo \"stagefs-run status $?\"",
            script("stagefs-run").display(),
            source.display(),
            run.mnt.display(),
            work.join("cache").display(),
            work.join("stagefs.log").display(),
            run.command("SIGINT").join(" ")
        );
        let output = work.join("script.out");
        let mut cmd = Command::new("script");
        // script(1) runs the line with $SHELL. dash (Debian's /bin/sh, and what a bare CI
        // environment gets) dies of the terminal's SIGINT before the echo; bash waits for
        // its child and carries on when the child handled the signal, as a user's shell does.
        cmd.args(["-q", "-e", "-c", &line, "/dev/null"])
            .env("SHELL", "/bin/bash")
            .env("STAGEFS", bin())
            .stdin(Stdio::piped())
            .stdout(fs::File::create(&output).unwrap())
            .stderr(Stdio::null());
        default_interrupt_signals(&mut cmd);
        guard.mount(&run.mnt);
        let mut child = cmd.spawn().expect("run script (util-linux)");
        // Kept open until the end: script(1) may end the session when its input closes.
        let keyboard = child.stdin.take().unwrap();
        TerminalRun {
            child,
            keyboard,
            output,
        }
    }

    fn type_ctrl_c(&mut self) {
        std::io::Write::write_all(&mut self.keyboard, b"\x03").unwrap();
    }

    /// Waits for the end; returns what the terminal showed. script(1)'s own status is not
    /// stagefs-run's (it differs between util-linux versions): the line echoes that.
    fn finish(mut self) -> String {
        wait_deadline(&mut self.child, "stagefs-run after ^C");
        fs::read_to_string(&self.output).unwrap_or_default()
    }
}

#[test]
fn stagefs_run_stops_on_ctrl_c_at_a_terminal() {
    let tmp = TempDir::new().unwrap();
    let source = tmp.path().join("src");
    image_folder(&source, 10, 2, 100, 1000);
    let work = tmp.path().join("tty");
    let run = SleeperRun::new(&work);
    let mut guard = Guard::default();
    let mut term = TerminalRun::start(&mut guard, &work, &source, &run);
    let daemon = run.wait_ready(&mut term.child, &term.output);
    term.type_ctrl_c();
    let output = term.finish();
    assert!(
        output.contains("stagefs-run status 130"),
        "output:\n{output}"
    );
    assert!(output.contains("final statistics"), "output:\n{output}");
    run.assert_cleaned_up(daemon, "^C");
}

/// Pids of stagefs daemons whose command line names `mnt`.
fn daemons_for(mnt: &Path) -> Vec<i32> {
    let want = mnt.display().to_string();
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let args: Vec<String> = fs::read(format!("/proc/{pid}/cmdline"))
                .map(|raw| raw.split(|&b| b == 0).map(text).collect())
                .unwrap_or_default();
            args.iter().any(|a| a == "mount") && args.contains(&want)
        })
        .collect()
}

#[test]
fn stagefs_run_ctrl_c_while_mounting_leaves_no_mount() {
    // A source large enough that its scan takes a while; ^C as soon as the daemon has started
    // (its log exists). Killing the `stagefs mount` that waits for the daemon would leave the
    // daemon to finish mounting with no one to unmount it; stagefs-run must instead let the
    // mount finish, remove it and exit 130. If the ^C comes too late to land in the scan, the
    // command gets it instead, with the same outcome.
    let tmp = TempDir::new().unwrap();
    let source = tmp.path().join("src");
    image_folder(&source, 30_000, 100, 1, 2);
    let work = tmp.path().join("tty");
    let run = SleeperRun::new(&work);
    let mut guard = Guard::default();
    let mut term = TerminalRun::start(&mut guard, &work, &source, &run);
    let log = work.join("stagefs.log");
    wait_until(DEADLINE, "the daemon to start", || log.exists());
    term.type_ctrl_c();
    let output = term.finish();
    assert!(
        output.contains("stagefs-run status 130"),
        "output:\n{output}"
    );
    eprintln!(
        "^C landed {}",
        if output.contains("while mounting") {
            "during the mount"
        } else {
            "after it"
        }
    );
    for pid in daemons_for(&run.mnt) {
        assert_daemon_exits(pid);
    }
    assert!(!is_mounted(&run.mnt), "a mount was left behind:\n{output}");
}

#[test]
fn stagefs_run_refuses_a_busy_mountpoint() {
    let tmp = TempDir::new().unwrap();
    let source = tmp.path().join("src");
    image_folder(&source, 5, 1, 10, 100);
    let existing = TestMount::new(&source, &tmp.path().join("existing"), &[]);
    let full = tmp.path().join("full");
    fs::create_dir_all(&full).unwrap();
    fs::write(full.join("keep.txt"), "mine").unwrap();
    let cases = [
        (&existing.mnt, "already a mount point"),
        (&full, "is not empty"),
    ];
    for (i, (mnt, message)) in cases.into_iter().enumerate() {
        let work = tmp.path().join(format!("w{i}"));
        fs::create_dir_all(&work).unwrap();
        let marker = work.join("ran");
        let mut child = spawn_run(
            &work,
            &source,
            mnt,
            &["/usr/bin/touch", marker.to_str().unwrap()],
        );
        let status = wait_deadline(&mut child, "stagefs-run");
        let stderr = run_output(&work).1;
        assert_eq!(status.code(), Some(125), "stderr: {stderr}");
        assert!(
            stderr.contains(message),
            "expected {message:?} in: {stderr}"
        );
        assert!(
            !marker.exists(),
            "the command ran although the mount was refused"
        );
        assert!(
            !work.join("cache").exists(),
            "a refused run created its cache"
        );
    }
    // The mount that was there is untouched, and the directory's file is still visible.
    assert!(is_mounted(&existing.mnt));
    assert_eq!(existing.stats()["sampler"], "auto");
    assert_eq!(fs::read_to_string(full.join("keep.txt")).unwrap(), "mine");
    // And a command line without `-- COMMAND` is a usage error.
    let out = Command::new(script("stagefs-run"))
        .args(["/src", "/mnt", "--seed", "1"])
        .env("STAGEFS", bin())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("usage: stagefs-run"));
    existing.unmount();
}

/// A faked Slurm setup on this machine: site configuration with per-node (%n) paths under a
/// temporary directory, and a stub `scontrol` expanding the job's node list.
struct FakeSlurm {
    dir: TempDir,
    source: PathBuf,
    samples: u64,
}

impl FakeSlurm {
    /// A job on the nodes `gpu[01-02]`.
    fn new(extra_config: &str) -> FakeSlurm {
        FakeSlurm::with_nodes(extra_config, "gpu[01-02]", &["gpu01", "gpu02"])
    }

    /// A job whose node list `list` `scontrol show hostnames` expands to `hosts`.
    fn with_nodes(extra_config: &str, list: &str, hosts: &[&str]) -> FakeSlurm {
        let dir = TempDir::new().unwrap();
        let root = dir.path();
        let source = root.join("src");
        let samples = image_folder(&source, 100, 5, 50, 500).len() as u64;
        let config = format!(
            "# test site configuration\nMOUNTPOINT={r}/mnt/%j.%n\nCACHE_DIR=\"{r}/cache/%j.%n\"\n\
             STATE_DIR={r}/state\nSTAGEFS={bin}\nexport OPTIONS=--log-file {r}/log.%j.%n\n{extra_config}",
            r = root.display(),
            bin = bin().display()
        );
        fs::write(root.join("slurm.conf"), config).unwrap();
        let stub = root.join("bin/scontrol");
        fs::create_dir_all(stub.parent().unwrap()).unwrap();
        fs::write(
            &stub,
            format!(
                "#!/bin/sh\ncase \"$1 $2\" in\n\
                 'show hostnames') [ \"$3\" = '{list}' ] && printf '%s\\n' {hosts} ;;\n\
                 *) exit 1 ;;\nesac\n",
                hosts = hosts.join(" ")
            ),
        )
        .unwrap();
        fs::set_permissions(&stub, fs::Permissions::from_mode(0o755)).unwrap();
        FakeSlurm {
            dir,
            source,
            samples,
        }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Adds `lines` to the site configuration (a key given again overrides the earlier one).
    fn add_config(&self, lines: &str) {
        let conf = self.root().join("slurm.conf");
        let config = fs::read_to_string(&conf).unwrap() + lines;
        fs::write(&conf, config).unwrap();
    }

    fn mnt(&self, job: &str, node: u32) -> PathBuf {
        self.root().join(format!("mnt/{job}.{node}"))
    }

    fn cache(&self, job: &str, node: u32) -> PathBuf {
        self.root().join(format!("cache/{job}.{node}"))
    }

    /// Runs `script` with only the given variables (and a PATH with the stub first).
    fn run(&self, script_name: &str, vars: &[(&str, &str)]) -> Output {
        let path = format!(
            "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            self.root().join("bin").display()
        );
        let mut child = Command::new(script(script_name))
            .env_clear()
            .env("PATH", path)
            .env("STAGEFS_SLURM_CONF", self.root().join("slurm.conf"))
            .envs(vars.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_deadline(&mut child, script_name);
        child.wait_with_output().unwrap()
    }
}

/// A job id no other test run uses at the same time.
fn job_id(tag: u32) -> String {
    format!("{}{tag}", std::process::id())
}

#[test]
fn slurm_prolog_mounts_each_node_with_its_ranks_and_epilog_removes_everything() {
    let slurm = FakeSlurm::new("");
    let job = job_id(1);
    let mut guard = Guard::default();
    guard.mount(&slurm.mnt(&job, 0));
    guard.mount(&slurm.mnt(&job, 1));
    let source = slurm.source.to_str().unwrap().to_string();

    // Node 0 gets everything from its environment, as in a task prolog.
    let node0 = [
        ("SLURM_JOB_ID", job.as_str()),
        ("SLURM_NODEID", "0"),
        ("SLURM_JOB_NUM_NODES", "2"),
        ("SLURM_GPUS_ON_NODE", "4"),
        ("STAGEFS_SOURCE", source.as_str()),
        ("STAGEFS_SEED", "7"),
        ("STAGEFS_SAMPLER", "torch-distributed"),
    ];
    // Node 1 sees what slurmd 22.05 gives its Prolog (see tests/slurm.rs): no SLURM_NODEID (its
    // index comes from its name in SLURM_NODELIST, expanded by scontrol), GPU ids instead of a
    // count, and the job's request in its working directory.
    let workdir = slurm.root().join("submit");
    fs::create_dir_all(&workdir).unwrap();
    fs::write(
        workdir.join("stagefs.env"),
        format!("# the job's request\nSTAGEFS_SOURCE={source}\nexport STAGEFS_SEED='7'\nSTAGEFS_SAMPLER=\"torch-distributed\"\n"),
    )
    .unwrap();
    let node1 = [
        ("SLURM_JOB_ID", job.as_str()),
        ("SLURMD_NODENAME", "gpu02"),
        ("SLURM_NODELIST", "gpu[01-02]"),
        ("SLURM_JOB_NUM_NODES", "2"),
        ("SLURM_JOB_GPUS", "0,1,2,3"),
        ("SLURM_JOB_WORK_DIR", workdir.to_str().unwrap()),
    ];
    for vars in [&node0[..], &node1[..]] {
        let out = slurm.run("slurm-prolog.sh", vars);
        assert!(
            out.status.success() && text(&out.stderr).contains("mounted"),
            "prolog: {}",
            text(&out.stderr)
        );
    }

    // 2 nodes × 4 GPUs: node n serves ranks 4n..4n+3 of 8, i.e. 4 × ceil(100 / 8) positions.
    let per_node = 4 * slurm.samples.div_ceil(8);
    let mut daemons = Vec::new();
    for node in 0..2u32 {
        let mnt = slurm.mnt(&job, node);
        assert!(is_mounted(&mnt), "node {node} not mounted");
        let pid = daemon_pid(&mnt);
        let args = daemon_args(pid);
        let ranks = format!("{}-{}", 4 * node, 4 * node + 3);
        for (flag, value) in [
            ("--ranks", ranks.as_str()),
            ("--world-size", "8"),
            ("--seed", "7"),
            ("--sampler", "torch-distributed"),
            ("--cache", slurm.cache(&job, node).to_str().unwrap()),
        ] {
            assert!(
                has_option(&args, flag, value),
                "node {node}: no {flag} {value} in {args:?}"
            );
        }
        let stats = stats_at(&mnt);
        assert_eq!(stats["epoch_len"], per_node, "node {node}: {stats}");
        let sample = slurm.source.join("class001/img000001.jpg");
        assert_eq!(
            fs::read(mnt.join("class001/img000001.jpg")).unwrap(),
            fs::read(sample).unwrap()
        );
        daemons.push(pid);
    }

    // Running the prolog again for the same job and node changes nothing.
    let again = slurm.run("slurm-prolog.sh", &node0);
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert_eq!(daemon_pid(&slurm.mnt(&job, 0)), daemons[0]);

    let epilog = [("SLURM_JOB_ID", job.as_str())];
    let out = slurm.run("slurm-epilog.sh", &epilog);
    assert!(out.status.success(), "epilog: {}", text(&out.stderr));
    for (node, pid) in (0..2u32).zip(daemons) {
        assert!(
            !is_mounted(&slurm.mnt(&job, node)),
            "node {node} still mounted"
        );
        assert_daemon_exits(pid);
        assert!(
            !slurm.cache(&job, node).exists(),
            "node {node}: cache left behind"
        );
        assert!(
            !slurm.mnt(&job, node).exists(),
            "node {node}: mountpoint the prolog made left behind"
        );
    }
    assert_eq!(
        fs::read_dir(slurm.root().join("state")).unwrap().count(),
        0,
        "state files left"
    );
    let out = slurm.run("slurm-epilog.sh", &epilog);
    assert!(out.status.success(), "second epilog: {}", text(&out.stderr));
}

#[test]
fn slurm_prolog_failures_leave_nothing_and_drain_only_when_asked() {
    let slurm = FakeSlurm::new("");
    let draining = FakeSlurm::new("ON_FAILURE=drain\n");
    let mut guard = Guard::default();
    let missing = slurm.root().join("no-such-dataset");
    let missing = missing.to_str().unwrap();
    fn one_node_job(job: &str) -> Vec<(&str, &str)> {
        vec![
            ("SLURM_JOB_ID", job),
            ("SLURM_NODEID", "0"),
            ("SLURM_JOB_NUM_NODES", "1"),
            ("SLURM_GPUS_ON_NODE", "2"),
        ]
    }
    let (job_a, job_b, job_c) = (job_id(2), job_id(3), job_id(4));
    for s in [&slurm, &draining] {
        for job in [&job_a, &job_b, &job_c] {
            guard.mount(&s.mnt(job, 0));
        }
    }

    // Not a stagefs job: nothing happens.
    let out = slurm.run("slurm-prolog.sh", &one_node_job(&job_a));
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        text(&out.stderr)
    );
    assert!(!slurm.mnt(&job_a, 0).exists() && !slurm.cache(&job_a, 0).exists());

    // A bad request: reported, nothing left behind; the prolog fails only with ON_FAILURE=drain.
    for (s, code) in [(&slurm, 0), (&draining, 1)] {
        let mut vars = one_node_job(&job_b);
        vars.push(("STAGEFS_SOURCE", missing));
        let out = s.run("slurm-prolog.sh", &vars);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{stderr}");
        assert!(
            stderr.contains("no-such-dataset") && stderr.contains("no dataset mounted"),
            "{stderr}"
        );
        assert!(!s.mnt(&job_b, 0).exists(), "mountpoint left: {stderr}");
        assert!(!s.cache(&job_b, 0).exists(), "cache left: {stderr}");
        let states = fs::read_dir(s.root().join("state"))
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(states, 0, "state file left: {stderr}");
    }

    // For another user's job, stagefs runs as that user: a source only root may read is
    // refused by stagefs itself. (The user can reach everything else: a world-readable tree
    // and a copy of the binary, wherever the build directory is.)
    let root = draining.root();
    fs::set_permissions(root, fs::Permissions::from_mode(0o755)).unwrap();
    let binary = root.join("bin/stagefs");
    fs::copy(bin(), &binary).unwrap();
    let private = root.join("private");
    image_folder(&private, 3, 1, 10, 20);
    fs::set_permissions(&private, fs::Permissions::from_mode(0o700)).unwrap();
    let mut vars = one_node_job(&job_c);
    vars.extend([
        ("STAGEFS", binary.to_str().unwrap()),
        ("STAGEFS_SOURCE", private.to_str().unwrap()),
        ("SLURM_JOB_UID", "65534"),
        ("SLURM_JOB_GID", "65534"),
        ("SLURM_JOB_USER", "nobody"),
    ]);
    let out = draining.run("slurm-prolog.sh", &vars);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let denied = format!(
        "source {} is not readable: Permission denied",
        private.display()
    );
    assert!(
        stderr.contains(&denied),
        "expected {denied:?} (stagefs running as nobody) in: {stderr}"
    );
    assert!(!is_mounted(&draining.mnt(&job_c, 0)) && !draining.mnt(&job_c, 0).exists());
}

/// Issue #29: one listing per job. Node 0 writes the job's index (INDEX) once and every node's
/// mount starts from it; a node that finds none in time, or one another user put there (the
/// mount refuses it), lists SOURCE itself; node 0's epilog removes it.
#[test]
fn slurm_prolog_shares_one_listing_per_job() {
    let slurm = FakeSlurm::new("");
    let shared = slurm.root().join("shared");
    fs::create_dir(&shared).unwrap();
    slurm.add_config(&format!(
        "INDEX={}/%j.index\nINDEX_WAIT=2\n",
        shared.display()
    ));
    let (job, late) = (job_id(5), job_id(6));
    let mut guard = Guard::default();
    for j in [&job, &late] {
        guard.mount(&slurm.mnt(j, 0));
        guard.mount(&slurm.mnt(j, 1));
    }
    let source = slurm.source.to_str().unwrap().to_string();
    let node = |job: &str, n: &'static str| {
        vec![
            ("SLURM_JOB_ID", job.to_string()),
            ("SLURM_NODEID", n.to_string()),
            ("SLURM_JOB_NUM_NODES", "2".to_string()),
            ("SLURM_GPUS_ON_NODE", "1".to_string()),
            ("STAGEFS_SOURCE", source.clone()),
        ]
    };
    let run = |vars: Vec<(&str, String)>| {
        let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let out = slurm.run("slurm-prolog.sh", &vars);
        assert!(out.status.success(), "prolog: {}", text(&out.stderr));
        text(&out.stderr)
    };

    let index = shared.join(format!("{job}.index"));
    for n in ["0", "1"] {
        run(node(&job, n));
    }
    assert!(index.is_file(), "node 0 wrote no index");
    for n in 0..2u32 {
        let args = daemon_args(daemon_pid(&slurm.mnt(&job, n)));
        assert!(
            has_option(&args, "--index", index.to_str().unwrap()),
            "node {n}: {args:?}"
        );
        let log = fs::read_to_string(slurm.root().join(format!("log.{job}.{n}"))).unwrap();
        assert!(log.contains("from index"), "node {n}: {log}");
        assert!(!log.contains("scanned"), "node {n} listed SOURCE: {log}");
    }

    // Node 1 of another job, before node 0 wrote anything, finds only a file another user put
    // where the index goes: its mount refuses it, and it lists SOURCE itself.
    let planted = shared.join(format!("{late}.index"));
    fs::copy(&index, &planted).unwrap();
    std::os::unix::fs::chown(&planted, Some(65534), Some(65534)).unwrap();
    let said = run(node(&late, "1"));
    assert!(
        said.contains("belongs to uid 65534") && said.contains("listing SOURCE here"),
        "{said}"
    );
    assert!(is_mounted(&slurm.mnt(&late, 1)));
    fs::remove_file(&planted).unwrap();

    for j in [&job, &late] {
        let out = slurm.run("slurm-epilog.sh", &[("SLURM_JOB_ID", j.as_str())]);
        assert!(out.status.success(), "epilog: {}", text(&out.stderr));
    }
    assert!(!index.exists(), "the job's index left behind");
}

/// Issue #30: with PEER_PORT, a job of several nodes gets `--peers` (every node of its list at
/// PEER_PORT + job id % 1000), `--node` and a per-job secret derived from the site's PEER_KEY,
/// written beside the cache and removed by the epilog; a key that is not root's 0600 file, or
/// none at all, mounts without peers. The two "nodes" are 127.0.0.1 and 127.0.0.2.
#[test]
fn slurm_prolog_gives_a_job_of_several_nodes_its_peers() {
    let list = "127.0.0.[1-2]";
    let slurm = FakeSlurm::with_nodes("", list, &["127.0.0.1", "127.0.0.2"]);
    let key = slurm.root().join("peer.key");
    fs::write(&key, "the site's peer key, for this test only\n").unwrap();
    fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
    let (job, shared_key, no_key) = (job_id(7), job_id(8), job_id(9));
    // The job's port, free on both addresses; PEER_PORT is what gives it to this job.
    let port = (0..100)
        .find_map(|_| {
            let one = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
            let port = one.local_addr().ok()?.port();
            std::net::TcpListener::bind(("127.0.0.2", port)).ok()?;
            Some(port)
        })
        .expect("a port free on 127.0.0.1 and 127.0.0.2");
    let base = port - (job.parse::<u64>().unwrap() % 1000) as u16;
    slurm.add_config(&format!("PEER_PORT={base}\nPEER_KEY={}\n", key.display()));
    let mut guard = Guard::default();
    for j in [&job, &shared_key, &no_key] {
        guard.mount(&slurm.mnt(j, 0));
        guard.mount(&slurm.mnt(j, 1));
    }
    let source = slurm.source.to_str().unwrap().to_string();
    // Node 0 knows its index (SLURM_NODEID); node 1 finds its name in the node list.
    let node = |job: &str, n: u32| {
        let mut vars = vec![
            ("SLURM_JOB_ID", job.to_string()),
            ("SLURM_JOB_NUM_NODES", "2".to_string()),
            ("SLURM_GPUS_ON_NODE", "1".to_string()),
            ("STAGEFS_SOURCE", source.clone()),
        ];
        if n == 0 {
            vars.extend([
                ("SLURM_NODEID", "0".to_string()),
                ("SLURM_JOB_NODELIST", list.to_string()),
            ]);
        } else {
            vars.extend([
                ("SLURMD_NODENAME", format!("127.0.0.{}", n + 1)),
                ("SLURM_NODELIST", list.to_string()),
            ]);
        }
        vars
    };
    let run = |vars: Vec<(&str, String)>| {
        let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let out = slurm.run("slurm-prolog.sh", &vars);
        let said = text(&out.stderr);
        assert!(
            out.status.success() && said.contains("mounted"),
            "prolog: {said}"
        );
        said
    };
    let peer_dir =
        |job: &str, n: u32| PathBuf::from(format!("{}.peers", slurm.cache(job, n).display()));
    // What the prolog derives: the SHA-256 (hex) of the key and the job id.
    let secret_of = |job: &str| {
        let mut input = fs::read(&key).unwrap();
        input.extend(format!("stagefs peers, job {job}\n").bytes());
        Sha256::digest(&input)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };

    for n in 0..2 {
        run(node(&job, n));
    }
    // Each node's secret lets it in at the other: copies go between them (node 1, started
    // after node 0, stages its share of the next epoch from node 0), and none is refused.
    let served = |n| {
        stats_at(&slurm.mnt(&job, n))["served_files"]
            .as_u64()
            .unwrap()
    };
    wait_until(DEADLINE, "a copy to go from one node to the other", || {
        served(0) + served(1) > 0
    });
    assert_ne!(secret_of(&job), secret_of(&shared_key));
    let peers = format!("127.0.0.1:{port},127.0.0.2:{port}");
    let mut daemons = Vec::new();
    for n in 0..2u32 {
        let mnt = slurm.mnt(&job, n);
        assert!(is_mounted(&mnt), "node {n} not mounted");
        let pid = daemon_pid(&mnt);
        let args = daemon_args(pid);
        let secret = peer_dir(&job, n).join("secret");
        for (flag, value) in [
            ("--peers", peers.as_str()),
            ("--node", &n.to_string()),
            ("--peer-secret-file", secret.to_str().unwrap()),
        ] {
            assert!(
                has_option(&args, flag, value),
                "node {n}: no {flag} {value} in {args:?}"
            );
        }
        let meta = fs::metadata(&secret).unwrap();
        assert!(
            meta.is_file(),
            "node {n}: {} is not a file",
            secret.display()
        );
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600, "node {n}");
        // The same on both nodes (another job's differs: below).
        let content = fs::read_to_string(&secret).unwrap();
        assert_eq!(content.trim(), secret_of(&job), "node {n}'s secret");

        let out = stagefs(&["stats", "--json", mnt.to_str().unwrap()]);
        assert!(out.status.success(), "stats: {}", text(&out.stderr));
        let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(stats["served_refused"], 0, "node {n}: {stats}");
        for counter in ["peer_files", "served_files"] {
            assert!(
                stats.get(counter).is_some(),
                "node {n}: no {counter} in {stats}"
            );
        }
        let sample = "class001/img000001.jpg";
        assert_eq!(
            fs::read(mnt.join(sample)).unwrap(),
            fs::read(slurm.source.join(sample)).unwrap()
        );
        daemons.push(pid);
    }

    // A key others can read, or none: the job is mounted all the same, without peers.
    fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
    let shared = run(node(&shared_key, 0));
    fs::remove_file(&key).unwrap();
    let missing = run(node(&no_key, 0));
    for (j, said) in [(&shared_key, shared), (&no_key, missing)] {
        assert!(
            said.contains(&format!("peer key {} ", key.display())) && said.contains("peers off"),
            "job {j}: {said}"
        );
        let args = daemon_args(daemon_pid(&slurm.mnt(j, 0)));
        for flag in ["--peers", "--node", "--peer-secret-file"] {
            assert!(
                !args.iter().any(|a| a == flag),
                "job {j}: {flag} in {args:?}"
            );
        }
        assert!(
            !peer_dir(j, 0).exists(),
            "job {j}: a directory for no secret"
        );
    }

    for j in [&job, &shared_key, &no_key] {
        let out = slurm.run("slurm-epilog.sh", &[("SLURM_JOB_ID", j.as_str())]);
        assert!(out.status.success(), "epilog: {}", text(&out.stderr));
    }
    for (n, pid) in (0..2u32).zip(daemons) {
        assert!(!is_mounted(&slurm.mnt(&job, n)), "node {n} still mounted");
        assert_daemon_exits(pid);
        assert!(
            !slurm.cache(&job, n).exists(),
            "node {n}: cache left behind"
        );
        assert!(
            !peer_dir(&job, n).exists(),
            "node {n}: peer secret left behind"
        );
    }
    assert_eq!(
        fs::read_dir(slurm.root().join("state")).unwrap().count(),
        0,
        "state files left"
    );
}

/// Writes an executable script.
fn write_executable(path: &Path, body: &str) {
    fs::write(path, body).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn sbatch_example_runs_one_stagefs_per_node_with_its_ranks() {
    // The batch script itself, with the real stagefs-run, under stubs: `srun` runs its command
    // once per node, one node after the other, with that node's SLURM_NODEID; `torchrun`
    // records its arguments and the command line of the daemon serving --data.
    let slurm = FakeSlurm::new("");
    let root = slurm.root();
    let stubs = root.join("bin");
    write_executable(
        &stubs.join("srun"),
        "#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\nstatus=0\n\
         for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do\n\
           SLURM_NODEID=$i SLURM_NNODES=$SLURM_JOB_NUM_NODES \"$@\" || status=$?\n\
         done\nexit $status\n",
    );
    let torchrun = format!(
        "#!{PYTHON}\nimport json, os, sys\nargs = sys.argv[1:]\ndata = args[args.index('--data') + 1]\n\
         pid = os.getxattr(data, 'user.stagefs.pid').decode()\n\
         daemon = open('/proc/%s/cmdline' % pid).read().split(chr(0))\n\
         out = os.path.join(os.environ['RECORD'], os.environ['SLURM_NODEID'])\n\
         open(out, 'w').write(json.dumps({{'torchrun': args, 'daemon': daemon}}))\n"
    );
    write_executable(&stubs.join("torchrun"), &torchrun);
    let record = root.join("record");
    fs::create_dir_all(&record).unwrap();
    let job = job_id(5);
    let (mnt, cache) = (root.join("job-mnt"), root.join("job-cache"));
    let mut guard = Guard::default();
    guard.mount(&mnt);
    let path = format!(
        "{}:{}:/usr/bin:/bin",
        stubs.display(),
        scripts_dir().display()
    );
    let mut child = Command::new("bash")
        .arg(script("slurm-example.sbatch"))
        .env_clear()
        .env("PATH", path)
        .env("STAGEFS", bin())
        .env("RECORD", &record)
        .env("SLURM_JOB_ID", &job)
        .env("SLURM_JOB_NUM_NODES", "2")
        .env("SLURM_JOB_NODELIST", "gpu[01-02]")
        .env("DATASET", &slurm.source)
        .env("GPUS_PER_NODE", "2")
        .env("MOUNT", &mnt)
        .env("CACHE", &cache)
        .stdout(Stdio::null())
        .stderr(fs::File::create(root.join("job.err")).unwrap())
        .spawn()
        .unwrap();
    let status = wait_deadline(&mut child, "slurm-example.sbatch");
    let stderr = fs::read_to_string(root.join("job.err")).unwrap();
    assert!(status.success(), "the batch script failed: {stderr}");
    for node in 0..2u32 {
        let raw = fs::read_to_string(record.join(node.to_string()))
            .unwrap_or_else(|_| panic!("torchrun did not run on node {node}: {stderr}"));
        let seen: serde_json::Value = serde_json::from_str(&raw).unwrap();
        let list = |key: &str| -> Vec<String> {
            seen[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect()
        };
        let (torchrun, daemon) = (list("torchrun"), list("daemon"));
        for arg in [
            format!("--node_rank={node}"),
            "--nnodes=2".into(),
            "--nproc_per_node=2".into(),
            "--master_addr=gpu01".into(),
        ] {
            assert!(
                torchrun.contains(&arg),
                "node {node}: no {arg} in torchrun {torchrun:?}"
            );
        }
        assert!(has_option(&torchrun, "--seed", "42"), "{torchrun:?}");
        let ranks = format!("{}-{}", 2 * node, 2 * node + 1);
        for (flag, value) in [
            ("--ranks", ranks.as_str()),
            ("--world-size", "4"),
            ("--seed", "42"),
        ] {
            assert!(
                has_option(&daemon, flag, value),
                "node {node}: no {flag} {value} in {daemon:?}"
            );
        }
    }
    assert!(!is_mounted(&mnt), "the example left its mount");
    assert!(!cache.exists(), "the example left its cache");
}

#[test]
fn fstab_entry_mounts_through_the_helper_and_unmounts() {
    let tmp = TempDir::new().unwrap();
    let source = tmp.path().join("src");
    // With extensions="jpg,txt" the two .txt files are samples and the .png is not; by default
    // it would be the other way round, and the sample count would differ.
    let mut samples = image_folder(&source, 20, 2, 100, 1000).len();
    let extra = [
        ("class000/extra.png", b"png".to_vec()),
        ("class000/a.txt", b"a".to_vec()),
        ("class001/b.txt", b"b".to_vec()),
    ];
    common::write_tree(&source, &extra);
    samples += 2;
    let mnt = tmp.path().join("mnt");
    fs::create_dir_all(&mnt).unwrap();
    let (cache, log) = (tmp.path().join("cache"), tmp.path().join("stagefs.log"));
    let fstab = tmp.path().join("fstab");
    fs::write(
        &fstab,
        format!(
            "# test fstab\n{} {} fuse.stagefs cache={},sampler=torch-distributed,seed=5,log_file={},\
             extensions=\"jpg,txt\",_netdev,nofail,x-systemd.requires=x.mount 0 0\n",
            source.display(),
            mnt.display(),
            cache.display(),
            log.display()
        ),
    )
    .unwrap();
    let mut guard = Guard::default();
    guard.mount(&mnt);
    guard.utab.push(mnt.clone());
    // mount(8) runs /sbin/mount.fuse.TYPE for fuse.TYPE and nothing else: put the helper there.
    guard.install_link(
        &script("mount.fuse.stagefs"),
        Path::new("/sbin/mount.fuse.stagefs"),
    );

    for unmount_with in ["umount", "stagefs unmount"] {
        let out = Command::new("mount")
            .arg("-T")
            .arg(&fstab)
            .arg(&mnt)
            .env("STAGEFS", bin())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mount -T: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        assert!(is_mounted(&mnt));
        let pid = daemon_pid(&mnt);
        let args = daemon_args(pid);
        for (flag, value) in [
            ("--cache", cache.to_str().unwrap()),
            ("--seed", "5"),
            ("--sampler", "torch-distributed"),
            ("--log-file", log.to_str().unwrap()),
            ("--extensions", "jpg,txt"),
        ] {
            assert!(
                has_option(&args, flag, value),
                "no {flag} {value} in {args:?}"
            );
        }
        assert!(
            !args
                .iter()
                .any(|a| a.contains("netdev") || a.contains("nofail") || a.contains("x-")),
            "{args:?}"
        );
        assert_eq!(stats_at(&mnt)["epoch_len"], samples as u64);
        assert_eq!(fs::read(mnt.join("class001/b.txt")).unwrap(), b"b");

        let out = match unmount_with {
            "umount" => Command::new("umount").arg(&mnt).output().unwrap(),
            _ => stagefs(&["unmount", mnt.to_str().unwrap()]),
        };
        assert!(
            out.status.success(),
            "{unmount_with}: {}",
            text(&out.stderr)
        );
        assert!(!is_mounted(&mnt), "still mounted after {unmount_with}");
        assert_daemon_exits(pid);
    }
}

#[test]
fn systemd_unit_passes_systemd_analyze_verify() {
    let unit = fs::read_to_string(script("stagefs@.service")).unwrap();
    for line in [
        "Type=forking",
        "EnvironmentFile=/etc/stagefs/%i.env",
        "ExecStart=/usr/local/bin/stagefs mount ${SOURCE} ${MOUNTPOINT} --cache ${CACHE} $OPTIONS",
        "ExecStop=/usr/local/bin/stagefs unmount ${MOUNTPOINT}",
    ] {
        assert!(unit.lines().any(|l| l == line), "unit lacks {line}");
    }
    // verify wants the executables to exist: point the unit at the binary under test.
    let tmp = TempDir::new().unwrap();
    let verify = |body: &str| -> Output {
        fs::write(tmp.path().join("stagefs@.service"), body).unwrap();
        Command::new("systemd-analyze")
            .arg("verify")
            .arg(tmp.path().join("stagefs@imagenet.service"))
            .output()
            .expect("run systemd-analyze (apt-get install systemd)")
    };
    let ours = unit.replace("/usr/local/bin/stagefs", bin().to_str().unwrap());
    let out = verify(&ours);
    // verify exits 0 even on unknown keys and bad values, which it reports as warnings.
    let report = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success() && report.trim().is_empty(),
        "systemd-analyze verify:\n{report}"
    );
    let broken = verify(&ours.replace("Type=forking", "Type=forkng"));
    assert!(
        text(&broken.stderr).contains("forkng"),
        "verify did not notice a broken unit"
    );
}

#[test]
fn install_sh_installs_a_layout_whose_scripts_find_the_binary() {
    let tmp = TempDir::new().unwrap();
    let dest = tmp.path().join("root");
    let prefix = "/opt/stagefs-test";
    let out = Command::new(script("install.sh"))
        .arg("--binary")
        .arg(bin())
        .env("DESTDIR", &dest)
        .env("PREFIX", prefix)
        .output()
        .unwrap();
    assert!(out.status.success(), "install.sh: {}", text(&out.stderr));
    let at = |p: &str| dest.join(p.trim_start_matches('/'));
    for exe in [
        "bin/stagefs",
        "libexec/stagefs/stagefs-run",
        "libexec/stagefs/mount.fuse.stagefs",
        "libexec/stagefs/slurm-prolog.sh",
        "libexec/stagefs/slurm-epilog.sh",
        "libexec/stagefs/slurm-task-prolog.sh",
    ] {
        let mode = fs::metadata(at(&format!("{prefix}/{exe}")))
            .unwrap()
            .permissions()
            .mode();
        assert!(mode & 0o111 != 0, "{exe} not executable");
    }
    assert_eq!(
        fs::read_link(at("/sbin/mount.fuse.stagefs")).unwrap(),
        Path::new(&format!("{prefix}/libexec/stagefs/mount.fuse.stagefs"))
    );
    let unit = fs::read_to_string(at("/etc/systemd/system/stagefs@.service")).unwrap();
    assert!(
        unit.contains(&format!("ExecStart={prefix}/bin/stagefs mount"))
            && !unit.contains("/usr/local/bin")
    );

    // The installed stagefs-run (through its bin/ symlink) finds the installed binary with no
    // STAGEFS and no stagefs on PATH.
    let source = tmp.path().join("src");
    image_folder(&source, 3, 1, 10, 20);
    let mnt = tmp.path().join("mnt");
    let mut guard = Guard::default();
    guard.mount(&mnt);
    let show_exe = "import os,sys; print(os.readlink('/proc/%s/exe' % os.getxattr(sys.argv[1], 'user.stagefs.pid').decode()))";
    let out = Command::new(at(&format!("{prefix}/bin/stagefs-run")))
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .arg(&source)
        .arg(&mnt)
        .arg("--cache")
        .arg(tmp.path().join("cache"))
        .args(["--", PYTHON, "-c", show_exe, mnt.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "installed stagefs-run: {}",
        text(&out.stderr)
    );
    assert_eq!(
        PathBuf::from(text(&out.stdout).trim()),
        at(&format!("{prefix}/bin/stagefs"))
    );
    assert!(!is_mounted(&mnt));
}
