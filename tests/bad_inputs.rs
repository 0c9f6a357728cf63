//! Bad inputs, through the real binary and real mounts: option values, list and order files,
//! commands aimed at things that are not mounts, a cache on a read-only file system, junk
//! written to the control xattr, and awkward source trees (non-UTF-8 names, symlink loops,
//! links leaving SOURCE).
//!
//! The tables below are the specification: each row is an input and what it must produce. A
//! command-line error is one line, `stagefs: ` and a message that says what is wrong (clap's
//! usage error, exit 2, for what clap itself rejects); nothing gets mounted; an error found
//! before the daemon starts creates no cache directory, one found by the daemon after the scan
//! leaves at most its log there; and no daemon ever panics (its log would say "panicked").
//! The basic mount-path errors (missing source, mountpoint not a directory, already mounted,
//! overlapping cache, locked cache) are in `cli_mount_errors.rs`.

mod common;

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// One command line. Placeholders: `@S` source, `@M` mountpoint, `@C` cache, `@W` the work
/// directory (input files live there), `@RO` a read-only tmpfs; a leading `mount` stands for
/// `mount @S @M --cache @C`. `expect` is the start of the one line on stderr: `stagefs: ...`
/// (exit 1) or clap's `error: ...` (exit 2).
struct Case {
    cmd: &'static str,
    /// Input files written under `@W` first.
    files: &'static [(&'static str, &'static str)],
    expect: &'static str,
    /// Found by the daemon after the scan: the cache may hold the daemon's log, nothing else.
    after_scan: bool,
}

const fn early(cmd: &'static str, expect: &'static str) -> Case {
    early_with(cmd, &[], expect)
}

const fn early_with(
    cmd: &'static str,
    files: &'static [(&'static str, &'static str)],
    expect: &'static str,
) -> Case {
    Case {
        cmd,
        files,
        expect,
        after_scan: false,
    }
}

const fn scanned(
    cmd: &'static str,
    files: &'static [(&'static str, &'static str)],
    expect: &'static str,
) -> Case {
    Case {
        cmd,
        files,
        expect,
        after_scan: true,
    }
}

const LIST: &str = "mount --layout list --list-file @W/l.txt";
const ORDER: &str = "mount --sampler list --order-file @W/o.txt";

/// Samples of the source tree ([`source_tree`]), for the messages that count them.
const SAMPLES: usize = 7;

const COMMAND_LINES: &[Case] = &[
    // Sizes and counts.
    early(
        "mount --cache-size 12QB",
        "stagefs: --cache-size: '12QB' is not a size: use a number with an optional K, M, G, T or P suffix",
    ),
    early(
        "mount --cache-size 16384P",
        "stagefs: --cache-size: '16384P' is not a size",
    ),
    early(
        "mount --cache-size 5KBB",
        "stagefs: --cache-size: '5KBB' is not a size",
    ),
    early(
        "mount --lookahead lots",
        "stagefs: --lookahead: 'lots' is neither a file count (e.g. 5000) nor a size (e.g. 20G)",
    ),
    early(
        "mount --lookahead 99999999999999999999999",
        "stagefs: --lookahead: '99999999999999999999999' is too large",
    ),
    early(
        "mount --read-through-above 5XB",
        "stagefs: --read-through-above: '5XB' is not a size",
    ),
    // Counts of at least 1 are clap's range checks: its usage error names the option.
    early(
        "mount --stage-threads 0",
        "error: invalid value '0' for '--stage-threads <N>': 0 is not in 1..",
    ),
    early(
        "mount --fuse-threads 0",
        "error: invalid value '0' for '--fuse-threads <N>': 0 is not in 1..",
    ),
    early(
        "mount --scan-threads 0",
        "error: invalid value '0' for '--scan-threads <N>': 0 is not in 1..",
    ),
    early(
        "mount --window 0",
        "error: invalid value '0' for '--window <N>': 0 is not in 1..",
    ),
    early(
        "index @S --scan-threads 0",
        "error: invalid value '0' for '--scan-threads <N>': 0 is not in 1..",
    ),
    early("mount --epoch -1", "error: unexpected argument '-1' found"),
    early(
        "mount --bogus",
        "error: unexpected argument '--bogus' found",
    ),
    // Ranks and world size.
    early(
        "mount --world-size 0",
        "stagefs: --world-size must be at least 1",
    ),
    early(
        "mount --rank 5 --world-size 4",
        "stagefs: --rank 5 is out of range for --world-size 4 (ranks are 0..3)",
    ),
    early(
        "mount --ranks 3-1 --world-size 4",
        "stagefs: invalid rank list \"3-1\": range 3-1 is reversed (write 1-3)",
    ),
    early(
        "mount --ranks a",
        "stagefs: invalid rank list \"a\": \"a\" is not a rank number",
    ),
    early(
        "mount --ranks 0,7 --world-size 4",
        "stagefs: --rank 7 is out of range for --world-size 4",
    ),
    early(
        "mount --ranks 0-70000 --world-size 100000",
        "stagefs: invalid rank list \"0-70000\": more than 65536 ranks",
    ),
    early(
        "mount --rank 1 --ranks 2",
        "error: the argument '--rank <R>' cannot be used with '--ranks <LIST>'",
    ),
    // Seeds and sampler settings.
    early(
        "mount --sampler numpy-legacy --seed 99999999999999999999999",
        "stagefs: --seed 99999999999999999999999 is too large for numpy-legacy: it must be between 0 and 2^32-1",
    ),
    early(
        "mount --sampler numpy-legacy --seed -1",
        "stagefs: --seed -1 is negative for numpy-legacy: it must be between 0 and 2^32-1",
    ),
    early(
        "mount --sampler torch-distributed --seed 18446744073709551616",
        "stagefs: --seed 18446744073709551616 is too large for torch-distributed",
    ),
    // auto takes the seed as a hint: one a sampler could take.
    early(
        "mount --seed 18446744073709551616",
        "stagefs: --seed 18446744073709551616 is too large for auto",
    ),
    early(
        "mount --epoch 3",
        "stagefs: --epoch does not apply to --sampler auto (the epoch is found from the job's opens)",
    ),
    early(
        "mount --seed 1000000000000000000000000000000000000000000",
        "error: invalid value '1000000000000000000000000000000000000000000' for '--seed <SEED>'",
    ),
    early(
        "mount --sampler nope",
        "error: invalid value 'nope' for '--sampler <NAME>'\n  [possible values: auto, torch-distributed, torch-random, numpy-legacy, numpy-generator, numpy-inplace, sequential, list, feed, none]",
    ),
    early(
        "mount --sampler torch-random --generator x",
        "error: invalid value 'x' for '--generator <SOURCE>'\n  [possible values: loader, sampler, global]",
    ),
    // Options the sampler does not read. A mount takes the node's seed, world size and ranks
    // whatever the sampler (deploy scripts pass them to every mount); `stagefs order` does not.
    early(
        "mount --sampler numpy-legacy --generator global",
        "stagefs: --generator does not apply to --sampler numpy-legacy (it is for torch-random): remove it, or check --sampler",
    ),
    early(
        "mount --sampler torch-random --drop-last",
        "stagefs: --drop-last does not apply to --sampler torch-random (it is for torch-distributed)",
    ),
    early(
        "mount --sampler numpy-inplace --no-set-epoch",
        "stagefs: --no-set-epoch does not apply to --sampler numpy-inplace (it is for torch-distributed)",
    ),
    early(
        "mount --sampler sequential --order-file @W/o.txt",
        "stagefs: --order-file does not apply to --sampler sequential (it is for list)",
    ),
    early(
        "mount --sampler numpy-legacy --ranks 0-1",
        "stagefs: --ranks 0-1 needs --world-size (the job's total number of ranks, DistributedSampler's num_replicas)",
    ),
    early(
        "mount --rank 2",
        "stagefs: --rank 2 needs --world-size (the job's total number of ranks",
    ),
    early(
        "order --len 10 --sampler numpy-legacy --world-size 4",
        "stagefs: --world-size does not apply to --sampler numpy-legacy (it is for torch-distributed): remove it, or check --sampler",
    ),
    early(
        "order --len 10 --sampler torch-random --rank 0",
        "stagefs: --rank does not apply to --sampler torch-random (it is for torch-distributed)",
    ),
    early(
        "order --len 10 --sampler sequential --seed 0",
        "stagefs: --seed does not apply to --sampler sequential (it is for torch-distributed, torch-random, numpy-legacy, numpy-generator, numpy-inplace)",
    ),
    early(
        "order --len 10 --sampler numpy-generator --torch-version 2.6",
        "stagefs: --torch-version does not apply to --sampler numpy-generator (it is for torch-distributed, torch-random)",
    ),
    early(
        "order --len 10 --sampler torch-distributed --persistent-workers",
        "stagefs: --persistent-workers does not apply to --sampler torch-distributed (it is for torch-random)",
    ),
    early(
        "order --len 10 --ranks 0-1",
        "stagefs: --ranks 0-1 needs --world-size (the job's total number of ranks",
    ),
    early(
        "mount --sampler torch-distributed --torch-version banana",
        "stagefs: invalid torch version \"banana\": give major.minor",
    ),
    early(
        "mount --sampler torch-distributed --torch-version 1.7",
        "stagefs: torch 1.7 is not supported by torch-distributed",
    ),
    early(
        "mount --layout nope",
        "error: invalid value 'nope' for '--layout <KIND>'\n  [possible values: imagefolder, tree, list]",
    ),
    // List files (--layout list): shape errors before the daemon starts, lookups after the scan.
    early(
        "mount --layout list",
        "stagefs: --layout list needs --list-file FILE",
    ),
    early(
        "mount --layout list --list-file @W/none.txt",
        "stagefs: cannot read --list-file @W/none.txt: No such file or directory",
    ),
    early_with(
        LIST,
        &[("l.txt", "")],
        "stagefs: --list-file @W/l.txt names no file",
    ),
    early_with(
        LIST,
        &[("l.txt", "c1/a.jpg\n\nc1/b.jpg\n")],
        "stagefs: --list-file @W/l.txt line 2: empty line",
    ),
    early_with(
        LIST,
        &[("l.txt", "c1/a.jpg\n../outside.txt\n")],
        "stagefs: --list-file @W/l.txt line 2: '../outside.txt' contains '..'",
    ),
    early_with(
        LIST,
        &[("l.txt", "c1/a.jpg\nc1/b.jpg\n/etc/passwd\n")],
        "stagefs: --list-file @W/l.txt line 3: '/etc/passwd' is absolute",
    ),
    scanned(
        "mount --sampler numpy-legacy --epoch 5000000000000",
        &[],
        "stagefs: epoch 5000000000000 of numpy-legacy means replaying the random draws of every earlier epoch",
    ),
    // Positions of the epoch and the next one must fit in 64 bits (7 per epoch here), the
    // same rule as for `stagefs epoch`.
    scanned(
        "mount --sampler torch-distributed --epoch 18446744073709551614",
        &[],
        "stagefs: epoch 18446744073709551614 is too large",
    ),
    scanned(
        "mount --sampler torch-distributed --epoch 2635249153387078801",
        &[],
        "stagefs: epoch 2635249153387078801 is too large",
    ),
    early(
        "mount --metrics-file @W/nodir/m.prom",
        "stagefs: --metrics-file @W/nodir/m.prom: cannot write in @W/nodir: No such file or directory",
    ),
    early(
        "mount --metrics-file @W",
        "stagefs: --metrics-file @W: is a directory",
    ),
    early(
        "mount --metrics-file @RO/m.prom",
        "stagefs: --metrics-file @RO/m.prom: cannot write in @RO: Read-only file system",
    ),
    scanned(
        LIST,
        &[("l.txt", "c1/a.jpg\nc1/b.jpg\nc1/nope.jpg\n")],
        "stagefs: --list-file @W/l.txt line 3: 'c1/nope.jpg' does not exist in the source",
    ),
    scanned(
        LIST,
        &[("l.txt", "c1\n")],
        "stagefs: --list-file @W/l.txt line 1: 'c1' is not a regular file",
    ),
    scanned(
        LIST,
        &[("l.txt", "c1/a.jpg\nc2/out.jpg\n")],
        "stagefs: --list-file @W/l.txt line 2: 'c2/out.jpg' is not a regular file (or a link to one) inside the source",
    ),
    scanned(
        LIST,
        &[("l.txt", "c2/abs.jpg\n")],
        "stagefs: --list-file @W/l.txt line 1: 'c2/abs.jpg' is not a regular file (or a link to one) inside the source",
    ),
    scanned(
        LIST,
        &[("l.txt", "c2/loop.jpg\n")],
        "stagefs: --list-file @W/l.txt line 1: 'c2/loop.jpg' is not a regular file",
    ),
    scanned(
        "mount --extensions xyz",
        &[],
        "stagefs: layout imagefolder found no samples under the source",
    ),
    // Order files (--sampler list).
    early(
        "mount --sampler list",
        "stagefs: sampler \"list\" needs --order-file",
    ),
    early(
        "mount --sampler list --order-file @W/none.txt",
        "stagefs: cannot read order file @W/none.txt: No such file or directory",
    ),
    early(
        "mount --sampler list --order-file /dev/zero",
        "stagefs: cannot read order file /dev/zero: it is a device or socket, not a file: give a file or a pipe",
    ),
    early(
        "mount --layout list --list-file /dev/zero",
        "stagefs: cannot read --list-file /dev/zero: it is a device or socket, not a file",
    ),
    early_with(
        ORDER,
        &[("o.txt", "0\n1\nabc\n")],
        "stagefs: order file line 3: \"abc\" is not a decimal index",
    ),
    early_with(
        ORDER,
        &[("o.txt", "0\n-3\n")],
        "stagefs: order file line 2: \"-3\" is not a decimal index",
    ),
    early_with(
        ORDER,
        &[("o.txt", "0\n4294967296\n")],
        "stagefs: order file line 2: \"4294967296\" is too large",
    ),
    early_with(
        ORDER,
        &[("o.txt", "# nothing yet\n")],
        "stagefs: the order file holds no index",
    ),
    scanned(
        ORDER,
        &[("o.txt", "0\n99\n")],
        "stagefs: order file entry 2 is index 99, out of range for a dataset of 7 samples (indices are 0..6)",
    ),
    // Other commands.
    early("order --len 0", "stagefs: the dataset is empty"),
    early(
        "order --len 10 --seed 18446744073709551615 --epoch 1",
        "stagefs: --seed 18446744073709551615 plus epoch 1 is above 2^64-1",
    ),
    early_with(
        "order --len 3 --sampler list --order-file @W/o.txt",
        &[("o.txt", "2\n3\n")],
        "stagefs: order file entry 2 is index 3, out of range for a dataset of 3 samples",
    ),
    early_with(
        "order --source @S --layout list --list-file @W/l.txt",
        &[("l.txt", "c1/a.jpg\n../x\n")],
        "stagefs: --list-file @W/l.txt line 2: '../x' contains '..'",
    ),
    early(
        "stats @W --interval nan",
        "error: invalid value 'nan' for '--interval <SECS>'",
    ),
    early(
        "stats @W --interval inf",
        "error: invalid value 'inf' for '--interval <SECS>'",
    ),
    early(
        "stats @W --interval 0",
        "error: invalid value '0' for '--interval <SECS>'",
    ),
    early(
        "stats @W --interval=-1",
        "error: invalid value '-1' for '--interval <SECS>'",
    ),
    early("unmount @W", "stagefs: @W is not a mount point"),
    early("unmount @W/nope", "stagefs: @W/nope is not a mount point"),
    early("stats @W", "stagefs: @W is not a stagefs mount"),
    early(
        "stats @W/nope",
        "stagefs: @W/nope: No such file or directory",
    ),
    // A cache on a read-only file system: it cannot be created (nor the log, which lives in it).
    early(
        "mount @S @M --cache @RO/cache",
        "stagefs: cache directory @RO/cache: Read-only file system",
    ),
    scanned(
        "mount @S @M --cache @RO/cache --log-file @W/d.log",
        &[],
        "stagefs: cache directory @RO/cache: Read-only file system",
    ),
];

/// The source every case runs against: an ImageFolder of 7 samples, among them a non-UTF-8
/// name, a symlink loop, a directory loop, and links that leave SOURCE.
fn source_tree(work: &Path) -> PathBuf {
    let src = work.join("src");
    write_tree(
        &src,
        &[
            ("c1/a.jpg", b"a".to_vec()),
            ("c1/b.jpg", b"b".to_vec()),
            ("c2/c.jpg", b"c".to_vec()),
        ],
    );
    fs::create_dir(src.join("c3")).unwrap();
    fs::write(
        src.join("c3").join(OsStr::from_bytes(b"caf\xe9.jpg")),
        b"latin-1",
    )
    .unwrap();
    fs::write(work.join("outside.txt"), OUTSIDE).unwrap();
    symlink("../../outside.txt", src.join("c2/out.jpg")).unwrap();
    symlink(work.join("outside.txt"), src.join("c2/abs.jpg")).unwrap();
    symlink("loop.jpg", src.join("c2/loop.jpg")).unwrap();
    symlink("../c2", src.join("c2/self")).unwrap();
    src
}

/// Content of the file outside SOURCE that links point to: it must never reach the cache.
const OUTSIDE: &[u8] = b"outside the source";

/// A read-only tmpfs, unmounted on drop.
struct ReadOnlyFs(PathBuf);

impl ReadOnlyFs {
    fn new(path: PathBuf) -> ReadOnlyFs {
        fs::create_dir_all(&path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"])
            .arg(&path)
            .status()
            .unwrap()
            .success();
        assert!(
            ok,
            "mount a read-only tmpfs at {path:?} (tests run as root)"
        );
        ReadOnlyFs(path)
    }
}

impl Drop for ReadOnlyFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Unmounts `path` on drop if a case left it mounted (so a failure cannot leak a mount).
struct UnmountGuard(PathBuf);

impl Drop for UnmountGuard {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            let _ = stagefs(&["unmount", self.0.to_str().unwrap()]);
        }
    }
}

/// Runs one case in a fresh work directory; returns what went wrong, if anything.
fn run_case(case: &Case, ro: &Path) -> Result<(), String> {
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path();
    let src = source_tree(work);
    let (mnt, cache) = (work.join("mnt"), work.join("cache"));
    fs::create_dir(&mnt).unwrap();
    let _guard = UnmountGuard(mnt.clone());
    for (name, content) in case.files {
        fs::write(work.join(name), content).unwrap();
    }
    let expand = |s: &str| {
        s.replace("@S", src.to_str().unwrap())
            .replace("@M", mnt.to_str().unwrap())
            .replace("@C", cache.to_str().unwrap())
            .replace("@W", work.to_str().unwrap())
            .replace("@RO", ro.to_str().unwrap())
    };
    let cmd = match case.cmd.strip_prefix("mount ") {
        Some(rest) if !rest.starts_with('@') => format!("mount @S @M --cache @C {rest}"),
        _ => case.cmd.to_string(),
    };
    let args: Vec<String> = expand(&cmd).split(' ').map(str::to_string).collect();
    let out = stagefs_within(30, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want = expand(case.expect);
    let code = out.status.code();
    if want.starts_with("stagefs: ") {
        if code != Some(1) || stderr.trim_end().contains('\n') || !stderr.starts_with(&want) {
            return Err(format!(
                "exit {code:?}, stderr {stderr:?}; want one line starting {want:?}"
            ));
        }
    } else if code != Some(2) || !stderr.starts_with(&want) || !stderr.contains("try '--help'") {
        return Err(format!(
            "exit {code:?}, stderr {stderr:?}; want clap's {want:?}"
        ));
    }
    if !out.stdout.is_empty() {
        return Err(format!("stdout {:?}", String::from_utf8_lossy(&out.stdout)));
    }
    if is_mounted(&mnt) {
        return Err("left a mount behind".into());
    }
    let left: Vec<OsString> = fs::read_dir(&cache)
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    if cache.exists() && !case.after_scan {
        return Err(format!(
            "created the cache directory ({left:?}) for an input error"
        ));
    }
    let own: Vec<OsString> = fs::read_dir(cache.join("stagefs"))
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    if left.iter().any(|n| n != "stagefs")
        || own
            .iter()
            .any(|n| n != "stagefs.log" && n != "manifest.json")
    {
        return Err(format!("left {left:?} and stagefs/{own:?} in the cache"));
    }
    for log in [cache.join("stagefs/stagefs.log"), work.join("d.log")] {
        if fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("panicked")
        {
            return Err(format!("the daemon panicked: {log:?}"));
        }
    }
    Ok(())
}

#[test]
fn bad_command_lines_fail_with_one_clear_line_and_leave_nothing() {
    require_fuse();
    assert!(COMMAND_LINES.len() >= 30);
    let ro_dir = tempfile::tempdir().unwrap();
    let ro = ReadOnlyFs::new(ro_dir.path().join("ro"));
    let failures: Vec<String> = COMMAND_LINES
        .iter()
        .filter_map(|case| {
            run_case(case, &ro.0)
                .err()
                .map(|e| format!("{}: {e}", case.cmd))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        COMMAND_LINES.len(),
        failures.join("\n")
    );
}

/// Writes to attributes of a mount (as `setfattr -n NAME -v VALUE MNT/PATH` does): the
/// superblock is read-only, so all of them get EROFS, ours and the dataset's alike.
const XATTR_WRITES: &[(&str, &str, &[u8])] = &[
    ("", "user.stagefs.epoch", b"3"),
    ("", "user.stagefs.epoch", b"junk"),
    ("c1/a.jpg", "user.stagefs.epoch", b"3"),
    ("", "user.stagefs.stats", b"{}"),
    ("", "user.comment", b"x"),
    ("c1/a.jpg", "user.comment", b"x"),
];

fn set_xattr(path: &Path, name: &str, value: &[u8]) -> Result<(), i32> {
    let p = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: valid C strings and a buffer of the stated length.
    let r = unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

/// `stagefs epoch MOUNT ARGS...`: exit code and stderr.
fn epoch_cmd(m: &TestMount, args: &[&str]) -> (Option<i32>, String) {
    let mut full = vec!["epoch", m.mnt.to_str().unwrap()];
    full.extend_from_slice(args);
    let out = stagefs(&full);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn xattr_writes_are_refused_and_junk_epochs_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source_tree(tmp.path());
    let m = TestMount::new(&src, tmp.path(), &["--sampler", "torch-distributed"]);
    for &(path, name, value) in XATTR_WRITES {
        let target = m.mnt.join(path);
        assert_eq!(
            set_xattr(&target, name, value),
            Err(libc::EROFS),
            "{name}={value:?} on {target:?}"
        );
    }
    let out = Command::new("setfattr")
        .args(["-x", "user.stagefs.epoch"])
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Read-only file system"),
        "{out:?}"
    );
    // Junk epochs: clap's usage error, and nothing reaches the daemon.
    for junk in ["junk", "-1", "1e3", "", "99999999999999999999999"] {
        let (code, stderr) = epoch_cmd(&m, &[junk]);
        assert_eq!(code, Some(2), "{junk:?}: {stderr}");
        assert!(
            stderr.contains("invalid value") || stderr.contains("unexpected argument"),
            "{junk:?}: {stderr}"
        );
    }
    // Positions of the epoch and the next must fit in 64 bits: one clear line.
    let (code, stderr) = epoch_cmd(&m, &["18446744073709551614"]);
    assert_eq!(code, Some(1));
    assert!(
        stderr.starts_with("stagefs: ")
            && stderr.contains("is too large")
            && stderr.lines().count() == 1,
        "{stderr}"
    );
    assert_eq!(m.stat("epoch"), 0, "junk moved the epoch");
    // The control still works afterwards.
    assert_eq!(epoch_cmd(&m, &["2"]), (Some(0), String::new()));
    assert_eq!(m.stat("epoch"), 2);
    assert!(!m.log_text().contains("panicked"), "{}", m.log_text());
}

/// An epoch a replaying sampler would need hours to reach is refused at once, not computed
/// while the command hangs; a mount without epochs says so.
#[test]
fn a_far_epoch_of_a_replaying_sampler_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source_tree(tmp.path());
    let m = TestMount::new(&src, tmp.path(), &["--sampler", "numpy-legacy"]);
    let (code, stderr) = epoch_cmd(&m, &["1000000000000"]);
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("epoch 1000000000000 of numpy-legacy means replaying"),
        "{stderr}"
    );
    assert_eq!(m.stat("epoch"), 0);
    assert_eq!(epoch_cmd(&m, &["3"]), (Some(0), String::new()));
    assert_eq!(m.stat("epoch"), 3);
    m.unmount();
    let none = TestMount::new(&src, &tmp.path().join("none"), &["--sampler", "none"]);
    let (code, stderr) = epoch_cmd(&none, &["1"]);
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("no epochs to move between (--sampler none)"),
        "{stderr}"
    );
}

/// The awkward tree of [`source_tree`] mounts and reads: the non-UTF-8 name byte for byte,
/// loops are not followed (ELOOP, no hang), links that leave SOURCE are shown as links and
/// their targets never staged: exactly the 4 real files reach the cache.
#[test]
fn awkward_source_tree_mounts_reads_and_stages_only_what_is_inside() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source_tree(tmp.path());
    let m = TestMount::new(&src, tmp.path(), &["--sampler", "torch-distributed"]);
    let latin = m.mnt.join("c3").join(OsStr::from_bytes(b"caf\xe9.jpg"));
    assert_eq!(fs::read(&latin).unwrap(), b"latin-1");
    let names: Vec<OsString> = fs::read_dir(m.mnt.join("c3"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [OsStr::from_bytes(b"caf\xe9.jpg")]);
    let err = fs::read(m.mnt.join("c2/loop.jpg")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ELOOP));
    for (link, target) in [
        ("c2/out.jpg", PathBuf::from("../../outside.txt")),
        ("c2/abs.jpg", tmp.path().join("outside.txt")),
    ] {
        let p = m.mnt.join(link);
        assert!(
            p.symlink_metadata().unwrap().file_type().is_symlink(),
            "{link}"
        );
        assert_eq!(fs::read_link(&p).unwrap(), target);
    }
    assert_eq!(m.stat("epoch_len"), SAMPLES as u64);
    assert_eq!(
        m.wait_stat("cached_files", 4),
        4,
        "the 4 files inside SOURCE, nothing else"
    );
    for f in walk_files(&m.cache.join("stagefs/data")) {
        assert_ne!(
            fs::read(&f).unwrap(),
            OUTSIDE,
            "{f:?} holds the outside file"
        );
    }
    assert!(
        m.log_text()
            .contains("symlink loop at c2/self; not followed"),
        "{}",
        m.log_text()
    );
    assert!(!m.log_text().contains("panicked"), "{}", m.log_text());
}

/// A SOURCE whose own path is not UTF-8 (Linux allows any bytes) mounts and is served.
#[test]
fn non_utf8_source_path_mounts() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join(OsStr::from_bytes(b"data\xff"));
    write_tree(&src, &[("c1/a.jpg", b"a".to_vec())]);
    let m = TestMount::new(&src, tmp.path(), &[]);
    assert_eq!(fs::read(m.mnt.join("c1/a.jpg")).unwrap(), b"a");
    assert!(!m.log_text().contains("panicked"), "{}", m.log_text());
    m.unmount();
    // And a remount recognises its cache.
    let m = TestMount::new(&src, tmp.path(), &[]);
    assert_eq!(m.wait_stat("cached_files", 1), 1);
    assert_eq!(m.stat("reused_files"), 1, "{}", m.log_text());
}
