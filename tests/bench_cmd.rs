//! `stagefs bench` through the real binary on a small generated ImageFolder dataset: the
//! JSON's shape and counts, the chart, a later stagefs epoch served from the cache, a
//! reproducible subset of whole classes, nothing left behind (mount, cache, copy, SOURCE
//! untouched), bad input refused with one line, and what limits a run's numbers (not root, a
//! cache in memory) said in the report. And, run as root among other users (issue #31): a
//! `--cache` others could swap things in is refused, SOURCE files swapped for FIFOs neither
//! wedge it nor Ctrl-C, and a link where the chart goes is not followed.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::SystemTime;

use common::*;

/// Classes × files per class of the generated dataset.
const CLASSES: u32 = 10;
const PER_CLASS: u32 = 20;

/// Generous: a run reads 200 small files a few times, and syncs before each epoch.
const LIMIT_SECS: &str = "300";

/// SOURCE as the test saw it: every file's size and mtime.
fn listing(root: &Path) -> BTreeMap<PathBuf, (u64, SystemTime)> {
    walk_files(root)
        .into_iter()
        .map(|p| {
            let m = fs::metadata(&p).unwrap();
            (p, (m.len(), m.modified().unwrap()))
        })
        .collect()
}

/// `stagefs bench ARGS` with TMPDIR set to `tmp` (where the default cache goes).
fn bench(tmp: &Path, args: &[&str]) -> Output {
    Command::new("timeout")
        .arg(LIMIT_SECS)
        .arg(bin())
        .arg("bench")
        .args(args)
        .env("TMPDIR", tmp)
        .output()
        .expect("run stagefs bench")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A work directory with the dataset in `source`, an empty `tmp` and an empty `cache`.
fn setup() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let work = tempfile::tempdir().unwrap();
    let (source, tmp, cache) = (
        work.path().join("source"),
        work.path().join("tmp"),
        work.path().join("cache"),
    );
    image_folder(&source, CLASSES * PER_CLASS, CLASSES, 2_000, 30_000);
    fs::create_dir(&tmp).unwrap();
    fs::create_dir(&cache).unwrap();
    (work, source, tmp, cache)
}

/// The mount points under `dir`, from /proc/self/mountinfo.
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = fs::canonicalize(dir).unwrap();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| Path::new(p).starts_with(&dir))
        .map(str::to_string)
        .collect()
}

/// Nothing of the run is mounted anywhere under `work`.
fn assert_nothing_mounted(work: &Path) {
    let ours = mounts_under(work);
    assert!(ours.is_empty(), "left mounted: {ours:?}");
}

fn empty(dir: &Path) -> bool {
    fs::read_dir(dir).unwrap().next().is_none()
}

#[test]
fn four_methods_measured_and_nothing_left_behind() {
    require_fuse();
    let (work, source, tmp, _cache) = setup();
    let before = listing(&source);
    let total_bytes: u64 = before.values().map(|(size, _)| size).sum();
    let json_path = work.path().join("results.json");
    let stdout = ok(&bench(
        &tmp,
        &[
            source.to_str().unwrap(),
            "--epochs",
            "2",
            "--workers",
            "2",
            "--methods",
            "direct,stagefs,stagefs-fuse,copy-first",
            "--json",
            json_path.to_str().unwrap(),
        ],
    ));
    assert!(stdout.contains("stagefs vs direct"), "{stdout}");
    assert!(stdout.contains("copy-first vs direct"), "{stdout}");
    assert!(
        stdout.contains("stagefs vs copy-first: whole run"),
        "{stdout}"
    );
    assert!(
        stdout.contains("stagefs-fuse vs copy-first: whole run"),
        "{stdout}"
    );

    let json: serde_json::Value = serde_json::from_slice(&fs::read(&json_path).unwrap()).unwrap();
    assert_eq!(json["subset"]["files"], 200);
    assert_eq!(json["subset"]["bytes"], total_bytes);
    let methods = json["methods"].as_object().unwrap();
    assert_eq!(
        methods.keys().collect::<Vec<_>>(),
        ["copy_first", "direct", "stagefs", "stagefs_fuse"]
    );
    for (name, method) in methods {
        let epochs = method["epochs"].as_array().unwrap();
        assert_eq!(epochs.len(), 2, "{name}");
        for e in epochs {
            assert_eq!(e["files"], 200, "{name}");
            assert_eq!(e["bytes"], total_bytes, "{name}");
            assert!(e["seconds"].as_f64().unwrap() > 0.0, "{name}");
        }
    }
    assert!(methods["copy_first"]["copy_seconds"].as_f64().unwrap() > 0.0);
    assert!(methods["direct"]["epochs"][0].get("hits").is_none());
    // Everything fits the default cache: once staged, every open is a hit. The hooked
    // reader's opens are batch opens, the other's FUSE opens.
    for (name, fuse_opens) in [("stagefs", 0), ("stagefs_fuse", 200)] {
        for e in &methods[name]["epochs"].as_array().unwrap()[1..] {
            assert_eq!((&e["hits"], &e["misses"]), (&200.into(), &0.into()), "{e}");
            assert_eq!(e["fuse_opens"], fuse_opens, "{name}: {e}");
        }
    }

    let svg = fs::read_to_string(work.path().join("results.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{svg}");
    let series = svg
        .lines()
        .filter(|l| l.starts_with("<polyline") && l.contains(r#"stroke-width="2""#))
        .count();
    assert_eq!(series, 4, "one line per method");
    for name in ["direct", "stagefs", "stagefs-fuse", "copy-first"] {
        assert!(svg.contains(&format!("\n{name}\n")), "legend {name}");
    }

    assert_nothing_mounted(work.path());
    assert!(
        empty(&tmp),
        "left in the default cache's place: {:?}",
        walk_files(&tmp)
    );
    assert_eq!(listing(&source), before, "SOURCE changed");
}

#[test]
fn files_picks_the_same_whole_classes_and_only_our_directory_goes() {
    require_fuse();
    let (work, source, tmp, cache) = setup();
    // Someone else's file in the cache directory the user names.
    fs::write(cache.join("keep"), "not ours").unwrap();
    let run = |json: &str| {
        let path = work.path().join(json);
        ok(&bench(
            &tmp,
            &[
                source.to_str().unwrap(),
                "--cache",
                cache.to_str().unwrap(),
                "--files",
                "50",
                "--epochs",
                "1",
                "--methods",
                "direct,stagefs",
                "--json",
                path.to_str().unwrap(),
            ],
        ));
        let json: serde_json::Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
        json
    };
    let (a, b) = (run("a.json"), run("b.json"));
    // 50 files of classes of 20: three whole classes.
    assert_eq!(a["subset"]["files"], 60);
    assert_eq!(a["subset"]["classes"].as_array().unwrap().len(), 3);
    assert_eq!(a["subset"]["classes_in_source"], 10);
    assert_eq!(a["subset"], b["subset"], "the same subset twice");
    let methods = a["methods"].as_object().unwrap();
    assert_eq!(methods.keys().collect::<Vec<_>>(), ["direct", "stagefs"]);
    assert_eq!(a["methods"]["stagefs"]["epochs"][0]["files"], 60);

    assert_nothing_mounted(work.path());
    assert_eq!(
        fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect::<Vec<_>>(),
        ["keep"]
    );
    assert!(empty(&tmp));
}

#[test]
fn bad_input_gets_one_line() {
    let (work, source, tmp, cache) = setup();
    let before = listing(&source);
    let inside = source.join("class000").to_str().unwrap().to_string();
    let source = source.to_str().unwrap();
    let missing = work.path().join("nowhere");
    let missing = missing.to_str().unwrap();
    let json_svg = work.path().join("out.svg");
    // (arguments, exit code, start of the first line of stderr, what it must mention)
    let cases: &[(&[&str], i32, &str, &str)] = &[
        (&[], 2, "error:", "required"),
        (&[missing], 1, "stagefs: SOURCE ", "No such file"),
        (
            &[source, "--files", "5", "--fraction", "0.5"],
            2,
            "error:",
            "--fraction",
        ),
        (&[source, "--fraction", "0"], 2, "error:", "outside (0, 1]"),
        (
            &[source, "--fraction", "1.5"],
            2,
            "error:",
            "outside (0, 1]",
        ),
        (&[source, "--fraction", "half"], 2, "error:", "--fraction"),
        (&[source, "--files", "0"], 2, "error:", "--files"),
        (&[source, "--methods", "rsync"], 2, "error:", "rsync"),
        (
            &[source, "--sampler", "feed"],
            1,
            "stagefs: --sampler feed",
            "name the sampler",
        ),
        (
            &[source, "--json", json_svg.to_str().unwrap()],
            1,
            "stagefs: --json",
            "another name",
        ),
        (
            &[source, "--cache", &inside],
            1,
            "stagefs: --cache",
            "inside SOURCE",
        ),
        (
            &[source, "--cache", missing],
            1,
            "stagefs: --cache",
            "existing directory",
        ),
    ];
    for (args, code, start, mentions) in cases {
        let mut full = args.to_vec();
        full.extend(["--cache", cache.to_str().unwrap()]);
        if args.contains(&"--cache") {
            full.truncate(args.len());
        }
        let out = bench(&tmp, &full);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let first = stderr.lines().next().unwrap_or_default();
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {stderr}");
        assert!(
            first.starts_with(start) && first.contains(mentions),
            "{args:?}: {stderr}"
        );
        if *code == 1 {
            assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        }
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    assert!(empty(&cache) && empty(&tmp));
    assert_eq!(listing(Path::new(source)), before);
}

#[test]
fn interrupted_while_mounted_it_still_removes_everything() {
    require_fuse();
    let (work, source, tmp, _cache) = setup();
    let before = listing(&source);
    // Slow enough (a second of compute per batch of 32) to be caught mid-epoch.
    let child = Command::new(bin())
        .args(["bench", source.to_str().unwrap(), "--compute-ms", "1000"])
        .args(["--methods", "stagefs", "--epochs", "2"])
        .env("TMPDIR", &tmp)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    assert!(
        wait_for(std::time::Duration::from_secs(60), || !mounts_under(&tmp)
            .is_empty()),
        "the mount never appeared"
    );
    // SAFETY: signalling the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("stagefs: interrupted"), "{stderr}");
    assert_nothing_mounted(work.path());
    assert!(empty(&tmp), "left behind: {:?}", walk_files(&tmp));
    assert_eq!(listing(&source), before);
}

#[test]
fn a_user_without_root_and_a_cache_in_memory_are_both_said() {
    let (work, source, _tmp, _cache) = setup();
    // Nobody reads SOURCE and writes to a cache directory of its own on tmpfs.
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    for dir in [work.path(), shm.path()] {
        fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let cache = shm.path().join("cache");
    fs::create_dir(&cache).unwrap();
    std::os::unix::fs::chown(&cache, Some(NOBODY), Some(NOBODY)).unwrap();
    let json_path = cache.join("results.json");
    // A copy nobody can run (the build tree need not be open to other users); no stagefs
    // method, as /dev/fuse may be root's only (it is on the machine this was written on).
    let exe = bin_copy(work.path());
    let out = as_nobody("timeout", [LIMIT_SECS])
        .arg(&exe)
        .args(["bench", source.to_str().unwrap(), "--epochs", "2"])
        .args(["--methods", "direct,copy-first", "--cache"])
        .arg(&cache)
        .arg("--json")
        .arg(&json_path)
        .output()
        .expect("run setpriv (util-linux)");
    let stdout = ok(&out);
    let json: serde_json::Value = serde_json::from_slice(&fs::read(&json_path).unwrap()).unwrap();
    let notes = json["notes"].as_array().unwrap();
    let said = |what: &str| notes.iter().any(|n| n.as_str().unwrap().contains(what));
    assert!(
        said("not root: the page cache was dropped file by file"),
        "{notes:?}"
    );
    assert!(said("is in memory (tmpfs)"), "{notes:?}");
    assert!(stdout.contains("is in memory (tmpfs)"), "{stdout}");
    assert_eq!(json["methods"]["copy_first"]["epochs"][1]["files"], 200);
}

/// `--cache` a directory others may rename things in (mode 0777, no sticky bit): one of them
/// could swap the benchmark's directory for a link to their victim's, which it would copy
/// into and then delete. Refused before anything is written; a sticky one (as /tmp) is fine.
#[test]
fn a_cache_directory_others_could_swap_things_in_is_refused_and_a_sticky_one_is_not() {
    let (work, source, tmp, _cache) = setup();
    let shared = work.path().join("shared");
    fs::create_dir(&shared).unwrap();
    let victim = shared.join("victim");
    fs::create_dir(&victim).unwrap();
    fs::write(victim.join("keep"), "theirs").unwrap();
    let run = |mode: u32| {
        fs::set_permissions(&shared, fs::Permissions::from_mode(mode)).unwrap();
        bench(
            &tmp,
            &[
                source.to_str().unwrap(),
                "--cache",
                shared.to_str().unwrap(),
                "--files",
                "20",
                "--epochs",
                "1",
                "--methods",
                "direct,copy-first",
            ],
        )
    };
    let left = || {
        fs::read_dir(&shared)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect::<Vec<_>>()
    };
    let out = run(0o777);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("can be changed by others"), "{stderr}");
    assert_eq!(left(), ["victim"]);
    ok(&run(0o1777));
    assert_eq!(left(), ["victim"]);
    assert_eq!(fs::read_to_string(victim.join("keep")).unwrap(), "theirs");
}

/// Waits (at most `limit`) until a file (not a directory: the scan lists those) in one of
/// `dirs` is opened, by inotify watches set up before this is called.
struct FileOpens(std::os::fd::OwnedFd);

impl FileOpens {
    fn watching(dirs: &[PathBuf]) -> FileOpens {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: no memory arguments.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(fd >= 0, "inotify_init1");
        // SAFETY: a new descriptor nothing else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        for dir in dirs {
            let c = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
            // SAFETY: a valid descriptor and C string.
            let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), c.as_ptr(), libc::IN_OPEN) };
            assert!(wd >= 0, "inotify_add_watch {}", dir.display());
        }
        FileOpens(fd)
    }

    fn wait(&self, limit: std::time::Duration) -> bool {
        use std::os::fd::AsRawFd;
        let mut buf = [0u8; 4096];
        wait_for(limit, || {
            // SAFETY: a buffer we own, of the length passed.
            let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            // struct inotify_event: wd, mask, cookie, len, then len bytes of name.
            let (mut at, n) = (0, n.max(0) as usize);
            while at + 16 <= n {
                let field =
                    |i: usize| u32::from_ne_bytes(buf[at + i..at + i + 4].try_into().unwrap());
                if field(12) > 0 && field(4) & libc::IN_ISDIR == 0 {
                    return true;
                }
                at += 16 + field(12) as usize;
            }
            false
        })
    }
}

/// SOURCE's files swapped for FIFOs while the benchmark reads them (an open of one waits for
/// a writer that never comes), then Ctrl-C: it stops, with nothing left behind.
#[test]
fn source_files_swapped_for_fifos_neither_wedge_it_nor_keep_ctrl_c_waiting() {
    let (_work, source, tmp, _cache) = setup();
    let classes: Vec<PathBuf> = fs::read_dir(&source)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let opens = FileOpens::watching(&classes);
    let mut child = Command::new(bin())
        .args(["bench", source.to_str().unwrap(), "--methods", "direct"])
        .args(["--epochs", "2", "--workers", "1", "--batch-size", "1"])
        .args(["--compute-ms", "300"])
        .env("TMPDIR", &tmp)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let reading = opens.wait(std::time::Duration::from_secs(60));
    for file in walk_files(&source) {
        fs::remove_file(&file).unwrap();
        let c = std::ffi::CString::new(file.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    }
    // SAFETY: signalling the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let ended = wait_for(std::time::Duration::from_secs(30), || {
        child.try_wait().unwrap().is_some()
    });
    if !ended {
        let _ = child.kill(); // a wait on a FIFO ends with SIGKILL
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(reading, "the benchmark never opened a file: {stderr}");
    assert!(ended, "still running 30 s after Ctrl-C: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("stagefs: interrupted") || stderr.contains("was replaced"),
        "{stderr}"
    );
    assert!(empty(&tmp), "left behind: {:?}", walk_files(&tmp));
}

/// A link planted where the chart goes (beside `--json`, in a directory others can write) is
/// replaced by the chart, not followed to the file it names.
#[test]
fn a_link_where_the_chart_goes_is_replaced_not_followed() {
    let (work, source, tmp, _cache) = setup();
    let victim = work.path().join("victim");
    fs::write(&victim, "precious").unwrap();
    std::os::unix::fs::symlink(&victim, work.path().join("out.svg")).unwrap();
    let json = work.path().join("out.json");
    ok(&bench(
        &tmp,
        &[
            source.to_str().unwrap(),
            "--files",
            "20",
            "--epochs",
            "1",
            "--methods",
            "direct",
            "--json",
            json.to_str().unwrap(),
        ],
    ));
    let kept = fs::read_to_string(&victim).unwrap() == "precious";
    assert!(kept, "the file the link names was overwritten");
    let svg = fs::symlink_metadata(work.path().join("out.svg")).unwrap();
    assert!(svg.is_file(), "the chart is not a file of its own");
}
