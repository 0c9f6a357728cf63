//! The statistics and control surface (issue #5) through real mounts and the real tools a user
//! has: `getfattr`/`setfattr` (attr), `cp -a`, `script` (util-linux) and `stagefs stats`.
//!
//! Covers: every `user.stagefs.*` attribute and the JSON's keys and types; counters that move
//! with reads made in the predicted order; per-file and per-directory state; the writable
//! epoch and its refusals; the source's own attributes passing through while ours stay
//! unlisted (so copies do not carry them); size probes and ERANGE at the syscall level; the
//! Prometheus metrics file under a strict parser; `stats --watch` on a terminal and a pipe;
//! the one-line error on a path that is not a mount.
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::io::{BufRead, BufReader};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use serde_json::Value;

const FILES: u32 = 20;
const CLASSES: u32 = 4;
/// Prediction options shared by a mount and the `stagefs order` that predicts its reads.
const SEEDED: [&str; 2] = ["--seed", "7"];

/// The keys issue #5 promises, with the JSON type each must have.
const REQUIRED: [(&str, Kind); 19] = [
    ("hits", Kind::Int),
    ("misses", Kind::Int),
    ("hit_ratio", Kind::Float),
    ("stall_seconds", Kind::Float),
    ("staged_files", Kind::Int),
    ("staged_bytes", Kind::Int),
    ("source_bytes", Kind::Int),
    ("cache_used_bytes", Kind::Int),
    ("cache_capacity_bytes", Kind::Int),
    ("evictions", Kind::Int),
    ("wasted_bytes", Kind::Int),
    ("mispredictions", Kind::Int),
    ("errors", Kind::Int),
    ("epoch", Kind::Int),
    ("position", Kind::Int),
    ("epoch_len", Kind::Int),
    ("sampler", Kind::Str),
    ("passthrough", Kind::Bool),
    ("uptime_seconds", Kind::Float),
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Int,
    Float,
    Str,
    Bool,
}

fn kind_of(v: &Value) -> Option<Kind> {
    match v {
        Value::Number(n) if n.is_u64() => Some(Kind::Int),
        Value::Number(n) if n.is_f64() => Some(Kind::Float),
        Value::String(_) => Some(Kind::Str),
        Value::Bool(_) => Some(Kind::Bool),
        _ => None,
    }
}

/// A source dataset under `work/src` and a mount of it with `extra` options, predicting
/// torch-distributed (seed 0, one rank) unless they name a sampler: the statistics follow a
/// prediction the tests know.
fn dataset_and_mount(work: &Path, extra: &[&str]) -> TestMount {
    let src = work.join("src");
    image_folder(&src, FILES, CLASSES, 1000, 3000);
    let mut args = extra.to_vec();
    if !args.contains(&"--sampler") {
        args.extend(["--sampler", "torch-distributed"]);
    }
    TestMount::new(&src, work, &args)
}

/// `getfattr --only-values -n NAME PATH`: the value, or getfattr's error message.
fn getfattr(path: &Path, name: &str) -> Result<String, String> {
    common::getfattr(path, name).map(|v| String::from_utf8(v).expect("utf-8 value"))
}

/// `setfattr -n NAME -v VALUE PATH` (`-x NAME` when `value` is None).
fn setfattr(path: &Path, name: &str, value: Option<&str>) -> Result<(), String> {
    let mut cmd = Command::new("setfattr");
    match value {
        Some(v) => cmd.args(["-n", name, "-v", v]),
        None => cmd.args(["-x", name]),
    };
    let out = cmd.arg(path).output().expect("run setfattr");
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Waits until the stager has copied the whole dataset (it runs ahead on its own).
fn wait_fully_staged(m: &TestMount) {
    wait_until(
        Duration::from_secs(30),
        "the whole dataset to be staged",
        || m.stat("cached_files") == FILES as u64,
    );
}

/// Relative paths in the order the mount (started with `SEEDED`) predicts for `epoch`.
fn predicted_order(source: &Path, epoch: u64) -> Vec<String> {
    let epoch = epoch.to_string();
    let mut args = vec!["--source", source.to_str().unwrap(), "--paths"];
    args.extend(SEEDED);
    args.extend(["--epoch", &epoch]);
    let paths = stagefs_order(&args);
    assert_eq!(paths.len(), FILES as usize);
    paths
}

/// Reads `paths` through the mount, checking each against its source file.
fn read_through(m: &TestMount, paths: &[String]) {
    for p in paths {
        let got = std::fs::read(m.mnt.join(p)).unwrap();
        assert_eq!(got, std::fs::read(m.source.join(p)).unwrap(), "{p}");
    }
}

fn c(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).unwrap()
}

/// `getxattr(2)` with a buffer of exactly `size` bytes (size 0: a probe): the bytes (or, for a
/// probe, a vector of the reported length) or the errno.
fn sys_getxattr(path: &Path, name: &str, size: usize) -> Result<Vec<u8>, i32> {
    let (p, n) = (c(path), CString::new(name).unwrap());
    let mut buf = vec![0u8; size];
    let ptr = if size == 0 {
        std::ptr::null_mut()
    } else {
        buf.as_mut_ptr().cast()
    };
    // SAFETY: valid C strings; `ptr` is null or a buffer of `size` bytes.
    let len = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), ptr, size) };
    if len < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
    }
    buf.resize(len as usize, 0);
    Ok(buf)
}

/// `llistxattr(2)` with a buffer of exactly `size` bytes, as [`sys_getxattr`].
fn sys_listxattr(path: &Path, size: usize) -> Result<Vec<u8>, i32> {
    let p = c(path);
    let mut buf = vec![0u8; size];
    let ptr = if size == 0 {
        std::ptr::null_mut()
    } else {
        buf.as_mut_ptr().cast()
    };
    // SAFETY: valid C string; `ptr` is null or a buffer of `size` bytes.
    let len = unsafe { libc::llistxattr(p.as_ptr(), ptr, size) };
    if len < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
    }
    buf.resize(len as usize, 0);
    Ok(buf)
}

/// The attribute names of `path`, as listing tools see them.
fn listed_names(path: &Path) -> Vec<String> {
    let len = sys_listxattr(path, 0).unwrap().len();
    let raw = sys_listxattr(path, len.max(1)).unwrap();
    raw.split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect()
}

#[test]
fn stats_json_and_single_values_follow_predicted_reads() {
    let work = tempfile::tempdir().unwrap();
    let m = dataset_and_mount(work.path(), &SEEDED);
    wait_fully_staged(&m);

    let raw = getfattr(&m.mnt, "user.stagefs.stats").unwrap();
    assert!(
        raw.starts_with("{\"hits\":"),
        "keys in documented order: {raw}"
    );
    let stats: BTreeMap<String, Value> = serde_json::from_str(&raw).unwrap();
    for (key, kind) in REQUIRED {
        let v = stats
            .get(key)
            .unwrap_or_else(|| panic!("stats lacks {key}: {raw}"));
        assert_eq!(kind_of(v), Some(kind), "{key} = {v}");
    }
    assert_eq!(stats["sampler"], "torch-distributed");
    assert_eq!(stats["epoch_len"], FILES);
    assert_eq!(stats["staged_files"], FILES);

    // Every key alone, as its own attribute, agrees with the object (nothing moves while idle).
    for (key, v) in &stats {
        let single = getfattr(&m.mnt, &format!("user.stagefs.{key}")).unwrap();
        match (key.as_str(), v) {
            ("uptime_seconds", v) => assert!(single.parse::<f64>().unwrap() >= v.as_f64().unwrap()),
            // Reading the attributes is itself counted.
            ("ops", Value::Object(counts)) => {
                let now: BTreeMap<String, u64> = serde_json::from_str(&single).unwrap();
                assert!(counts.keys().eq(now.keys()), "{single}");
                for (op, n) in counts {
                    assert!(now[op] >= n.as_u64().unwrap(), "{op}: {single}");
                }
            }
            (_, Value::String(s)) => assert_eq!(&single, s, "{key}"),
            (_, v) => assert_eq!(single, v.to_string(), "{key}"),
        }
    }
    let hits = getfattr(&m.mnt, "user.stagefs.hits").unwrap();
    assert!(
        !hits.is_empty() && hits.bytes().all(|b| b.is_ascii_digit()),
        "bare number: {hits:?}"
    );
    let pid: u32 = getfattr(&m.mnt, "user.stagefs.pid")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "pid names the daemon"
    );
    let err = getfattr(&m.mnt, "user.stagefs.no_such_key").unwrap_err();
    assert!(err.contains("No such attribute"), "{err}");
    // Statistics belong to the root only; the request counts are on every entry.
    assert!(getfattr(&m.mnt.join("class000"), "user.stagefs.stats").is_err());
    for entry in ["class000", "class000/img000000.jpg"] {
        let ops = getfattr(&m.mnt.join(entry), "user.stagefs.ops").unwrap();
        let ops: BTreeMap<String, u64> = serde_json::from_str(&ops).unwrap();
        assert!(ops["getxattr"] > 0 && ops["lookup"] > 0, "{entry}: {ops:?}");
    }

    // Reads in the predicted order: all hits (staged beforehand), no misprediction, and the
    // tracker's position follows them.
    let order = predicted_order(&m.source, 0);
    read_through(&m, &order[..12]);
    let s = m.stats();
    assert_eq!(
        (s["hits"].as_u64(), s["misses"].as_u64()),
        (Some(12), Some(0)),
        "{s}"
    );
    assert_eq!(s["hit_ratio"], 1.0);
    assert_eq!(s["mispredictions"], 0);
    assert_eq!(
        (s["epoch"].as_u64(), s["position"].as_u64()),
        (Some(0), Some(12)),
        "{s}"
    );
    assert_eq!(s["mode"], "predicting");
    assert!(s["uptime_seconds"].as_f64() >= stats["uptime_seconds"].as_f64());

    // The rest of the epoch, then the next epoch's first files: the tracker crosses over.
    read_through(&m, &order[12..]);
    read_through(&m, &predicted_order(&m.source, 1)[..3]);
    let s = m.stats();
    assert_eq!(
        (s["epoch"].as_u64(), s["position"].as_u64()),
        (Some(1), Some(3)),
        "{s}"
    );
    assert_eq!(s["hits"], FILES as u64 + 3);
    assert_eq!(s["mispredictions"], 0);

    // `stagefs stats` reads the same thing: --json (same keys, same order) and the table.
    let out = stagefs(&["stats", "--json", m.mnt.to_str().unwrap()]);
    assert!(out.status.success());
    let json: serde_json::Map<String, Value> = serde_json::from_slice(&out.stdout).unwrap();
    let from_xattr: serde_json::Map<String, Value> = serde_json::from_str(&raw).unwrap();
    assert!(
        json.keys().eq(from_xattr.keys()),
        "--json keys: {:?}",
        json.keys()
    );
    assert_eq!(json["hits"], FILES as u64 + 3);
    let out = stagefs(&["stats", m.mnt.to_str().unwrap()]);
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("23 hits, 0 misses, hit ratio 1.0000"),
        "{table}"
    );
    assert!(table.contains(&format!("1 / 3 of {FILES}")), "{table}");
}

#[test]
fn file_state_goes_remote_to_cached_and_directories_count() {
    let work = tempfile::tempdir().unwrap();
    // No prediction: nothing is staged until it is read.
    let m = dataset_and_mount(work.path(), &["--sampler", "none"]);
    let file = "class001/img000005.jpg";
    let state = |rel: &str| getfattr(&m.mnt.join(rel), "user.stagefs.state").unwrap();
    assert_eq!(state(file), "remote");
    assert_eq!(state("class001/img000001.jpg"), "remote");
    assert_eq!(state("class001"), "0/5 cached");
    assert_eq!(state(""), format!("0/{FILES} cached"));
    assert_eq!(m.stat("staged_files"), 0);

    read_through(&m, &[file.to_string()]);
    assert_eq!(state(file), "cached");
    assert_eq!(state("class001/img000001.jpg"), "remote");
    assert_eq!(state("class001"), "1/5 cached");
    assert_eq!(state("class002"), "0/5 cached");
    // The root counts its whole subtree.
    assert_eq!(state(""), format!("1/{FILES} cached"));
    let s = m.stats();
    assert_eq!(
        (
            s["hits"].as_u64(),
            s["misses"].as_u64(),
            s["staged_files"].as_u64()
        ),
        (Some(0), Some(1), Some(1)),
        "{s}"
    );
    let size = std::fs::metadata(m.source.join(file)).unwrap().len();
    assert_eq!(s["staged_bytes"], size);
    assert_eq!(s["hit_ratio"], 0.0);

    // Read again: now a hit.
    read_through(&m, &[file.to_string()]);
    let s = m.stats();
    assert_eq!(
        (s["hits"].as_u64(), s["misses"].as_u64()),
        (Some(1), Some(1)),
        "{s}"
    );
    assert_eq!(s["hit_ratio"], 0.5);

    // Without a sampler there is no epoch to restart at.
    let out = stagefs(&["epoch", m.mnt.to_str().unwrap(), "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no epochs to move between"), "{err}");

    // `stagefs stats` on a directory inside the mount names the problem.
    let out = stagefs(&["stats", m.mnt.join("class001").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("is inside a stagefs mount"), "{err}");
}

/// `stagefs epoch` moves a running mount; every attribute write is refused (the superblock
/// is read-only) and moves nothing.
#[test]
fn epoch_moves_by_command_and_attribute_writes_are_refused() {
    let work = tempfile::tempdir().unwrap();
    let m = dataset_and_mount(work.path(), &SEEDED);
    let epoch = |value: &str| stagefs(&["epoch", m.mnt.to_str().unwrap(), value]);
    assert!(epoch("3").status.success());
    assert_eq!(getfattr(&m.mnt, "user.stagefs.epoch").unwrap(), "3");
    let s = m.stats();
    assert_eq!(
        (s["epoch"].as_u64(), s["position"].as_u64()),
        (Some(3), Some(0)),
        "{s}"
    );

    let refused = |path: &Path, name: &str, value: Option<&str>| {
        let err = setfattr(path, name, value).expect_err(name);
        assert!(
            err.contains("Read-only file system"),
            "{name}={value:?} on {}: {err}",
            path.display()
        );
        assert_eq!(getfattr(&m.mnt, "user.stagefs.epoch").unwrap(), "3");
    };
    let file = m.mnt.join("class000/img000000.jpg");
    for path in [&m.mnt, &file, &m.mnt.join("class000")] {
        for name in [
            "user.stagefs.epoch",
            "user.stagefs.stats",
            "user.stagefs.state",
            "user.foo",
        ] {
            refused(path, name, Some("1"));
        }
    }
    refused(&m.mnt, "user.stagefs.epoch", None);
    // u64::MAX parses, but its positions would not fit in 64 bits: one line, nothing moved.
    let out = epoch("18446744073709551615");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&out.stderr).lines().count(), 1);
    assert_eq!(m.stat("epoch"), 3);

    // The tracker really is at epoch 3: reading epoch 3's predicted order matches the plan.
    read_through(&m, &predicted_order(&m.source, 3)[..5]);
    let s = m.stats();
    assert_eq!(
        (s["epoch"].as_u64(), s["position"].as_u64()),
        (Some(3), Some(5)),
        "{s}"
    );
    assert_eq!(s["mispredictions"], 0);
    // Back to epoch 0 (a job restarted from scratch).
    assert!(epoch("0").status.success());
    assert_eq!(m.stat("epoch"), 0);
    assert_eq!(m.stat("position"), 0);
}

#[test]
fn source_attributes_pass_through_and_ours_stay_unlisted() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    image_folder(&src, FILES, CLASSES, 1000, 3000);
    let rel = "class002/img000006.jpg";
    setfattr(&src.join(rel), "user.origin", Some("abc")).unwrap();
    setfattr(&src.join("class003"), "user.origin", Some("dir")).unwrap();
    // A source attribute in our namespace is shadowed: neither listed nor readable as set.
    setfattr(&src.join(rel), "user.stagefs.stale", Some("x")).unwrap();
    let m = TestMount::new(&src, work.path(), &SEEDED);
    let file = m.mnt.join(rel);

    assert_eq!(getfattr(&file, "user.origin").unwrap(), "abc");
    assert_eq!(
        getfattr(&m.mnt.join("class003"), "user.origin").unwrap(),
        "dir"
    );
    assert!(
        getfattr(&file, "user.other")
            .unwrap_err()
            .contains("No such attribute")
    );
    assert!(getfattr(&file, "user.stagefs.stale").is_err());
    assert_eq!(listed_names(&file), ["user.origin"]);
    assert!(listed_names(&m.mnt).is_empty(), "root lists none of ours");
    assert!(listed_names(&m.mnt.join("class000/img000000.jpg")).is_empty());
    // getfattr -d (the dump a user or a backup script makes) shows only the source's.
    let out = Command::new("getfattr")
        .args(["-R", "-d", "-m", "-"])
        .arg(&m.mnt)
        .output()
        .unwrap();
    let dump = String::from_utf8(out.stdout).unwrap();
    assert!(!dump.contains("stagefs"), "{dump}");
    assert_eq!(dump.matches("user.origin=").count(), 2, "{dump}");

    // Syscall level: size probes report the length, a short buffer gets ERANGE, an exact one works.
    assert_eq!(
        sys_listxattr(&file, 0).unwrap().len(),
        b"user.origin\0".len()
    );
    assert_eq!(sys_listxattr(&file, 4), Err(libc::ERANGE));
    assert_eq!(sys_listxattr(&file, 12).unwrap(), b"user.origin\0");
    assert_eq!(sys_getxattr(&file, "user.origin", 0).unwrap().len(), 3);
    assert_eq!(sys_getxattr(&file, "user.origin", 2), Err(libc::ERANGE));
    assert_eq!(sys_getxattr(&file, "user.origin", 3).unwrap(), b"abc");
    assert_eq!(sys_getxattr(&file, "user.other", 0), Err(libc::ENODATA));
    assert_eq!(
        sys_getxattr(&file, "user.stagefs.state", 0).unwrap().len(),
        "cached".len()
    );
    assert_eq!(
        sys_getxattr(&m.mnt, "user.stagefs.stats", 8),
        Err(libc::ERANGE)
    );
    // The probe-then-read-exactly pattern never fails, though uptime changes length between
    // the two calls and reads advance the counters.
    let order = predicted_order(&m.source, 0);
    for i in 0..300 {
        if i % 15 == 0 {
            read_through(&m, &order[i / 15..i / 15 + 1]);
        }
        let len = sys_getxattr(&m.mnt, "user.stagefs.stats", 0).unwrap().len();
        let value = sys_getxattr(&m.mnt, "user.stagefs.stats", len)
            .unwrap_or_else(|e| panic!("read {i}: errno {e}"));
        serde_json::from_slice::<Value>(&value).unwrap();
    }

    // cp -a copies the source's attributes and none of ours.
    let copy = work.path().join("copy");
    let out = Command::new("cp")
        .arg("-a")
        .arg(&m.mnt)
        .arg(&copy)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cp -a: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(getfattr(&copy.join(rel), "user.origin").unwrap(), "abc");
    assert_eq!(
        getfattr(&copy.join("class003"), "user.origin").unwrap(),
        "dir"
    );
    let mut entries = 0;
    let mut stack = vec![copy.clone()];
    while let Some(p) = stack.pop() {
        entries += 1;
        let names = listed_names(&p);
        assert!(
            names.iter().all(|n| n == "user.origin"),
            "{}: {names:?}",
            p.display()
        );
        if p.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else {
            let relative = p.strip_prefix(&copy).unwrap();
            assert_eq!(
                std::fs::read(&p).unwrap(),
                std::fs::read(src.join(relative)).unwrap()
            );
        }
    }
    assert_eq!(entries, 1 + CLASSES + FILES, "every entry copied");
}

/// One sample line of the exposition: its metric family and value.
#[derive(Debug)]
struct Sample {
    family: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A sample value as the text format writes it: a decimal float or +Inf, -Inf, NaN.
fn parse_value(text: &str) -> Result<f64, String> {
    match text {
        "+Inf" => return Ok(f64::INFINITY),
        "-Inf" => return Ok(f64::NEG_INFINITY),
        "NaN" => return Ok(f64::NAN),
        _ => {}
    }
    let body = text.strip_prefix(['-', '+']).unwrap_or(text);
    let (mantissa, exponent) = match body.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e.strip_prefix(['-', '+']).unwrap_or(e))),
        None => (body, None),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    let ok = !(int.is_empty() && frac.is_empty())
        && digits(int)
        && digits(frac)
        && exponent.is_none_or(|e| !e.is_empty() && digits(e));
    if !ok {
        return Err(format!("bad value {text:?}"));
    }
    text.parse().map_err(|e| format!("bad value {text:?}: {e}"))
}

/// `{a="x",b="y"}` (the braces included) into a map; escapes `\\`, `\"`, `\n` only.
fn parse_labels(text: &str) -> Result<BTreeMap<String, String>, String> {
    let inner = text
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .ok_or("labels not in braces")?;
    let mut labels = BTreeMap::new();
    let mut rest = inner;
    while !rest.is_empty() {
        let (name, after) = rest
            .split_once("=\"")
            .ok_or(format!("bad label in {text}"))?;
        if !valid_label_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars
                .next()
                .ok_or(format!("unterminated label value in {text}"))?
            {
                (i, '"') => break i,
                (_, '\\') => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?} in {text}")),
                },
                (_, '\n') => return Err("newline in label value".into()),
                (_, c) => value.push(c),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} twice"));
        }
        rest = &after[end + 1..];
        if !rest.is_empty() {
            rest = rest
                .strip_prefix(',')
                .ok_or(format!("expected ',' in {text}"))?;
        }
    }
    Ok(labels)
}

/// Strict Prometheus text-format parser for what we emit: every family has one `# HELP` and
/// then one `# TYPE` (counter or gauge) before its samples, which are contiguous; sample lines
/// are `name{labels} value`; counters end in `_total`; no series twice; a final newline.
fn parse_exposition(text: &str) -> Result<Vec<Sample>, String> {
    if !text.ends_with('\n') {
        return Err("no final newline".into());
    }
    let mut samples = Vec::new();
    let mut families: BTreeMap<String, &str> = BTreeMap::new();
    let mut current: Option<(String, Option<&str>)> = None;
    let mut series = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let err = |m: String| format!("line {}: {m}: {line:?}", n + 1);
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest
                .split_once(' ')
                .ok_or_else(|| err("HELP without text".into()))?;
            if !valid_metric_name(name) || help.trim().is_empty() {
                return Err(err("bad HELP".into()));
            }
            if families.contains_key(name) || current.as_ref().is_some_and(|(c, _)| c == name) {
                return Err(err("family described twice".into()));
            }
            if let Some((prev, kind)) = current.take() {
                families.insert(
                    prev,
                    kind.ok_or_else(|| err("previous family has no TYPE".into()))?,
                );
            }
            current = Some((name.to_string(), None));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest
                .split_once(' ')
                .ok_or_else(|| err("TYPE without type".into()))?;
            let kind = match kind {
                "counter" => "counter",
                "gauge" => "gauge",
                _ => return Err(err("unexpected type".into())),
            };
            match &mut current {
                Some((c, k @ None)) if c == name => *k = Some(kind),
                _ => return Err(err("TYPE not right after its HELP".into())),
            }
            if kind == "counter" && !name.ends_with("_total") {
                return Err(err("counter without _total".into()));
            }
        } else if line.starts_with('#') || line.is_empty() {
            return Err(err("unexpected line".into()));
        } else {
            let (series_text, value) = line
                .rsplit_once(' ')
                .ok_or_else(|| err("no value".into()))?;
            let (name, labels) = match series_text.find('{') {
                Some(i) => (
                    &series_text[..i],
                    parse_labels(&series_text[i..]).map_err(err)?,
                ),
                None => (series_text, BTreeMap::new()),
            };
            if !valid_metric_name(name) {
                return Err(err("bad metric name".into()));
            }
            match &current {
                Some((c, Some(_))) if c == name => {}
                _ => return Err(err("sample outside its family (HELP and TYPE first)".into())),
            }
            let value = parse_value(value).map_err(err)?;
            if !series.insert((name.to_string(), labels.clone())) {
                return Err(err("duplicate series".into()));
            }
            samples.push(Sample {
                family: name.to_string(),
                labels,
                value,
            });
        }
    }
    if let Some((_, None)) = current {
        return Err("last family has no TYPE".into());
    }
    Ok(samples)
}

#[test]
fn strict_parser_rejects_malformed_expositions() {
    let good = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 3\na_total{x=\"2\\\"\\n\"} 1.5e3\n";
    let parsed = parse_exposition(good).unwrap();
    assert_eq!(parsed.len(), 2);
    assert_eq!(parsed[1].labels["x"], "2\"\n");
    assert_eq!(parsed[1].value, 1500.0);
    let bad = [
        "# HELP a_total A.\n# TYPE a_total counter\na_total 3", // no final newline
        "# HELP a A.\n# TYPE a counter\na 3\n",                 // counter without _total
        "# TYPE a gauge\na 3\n",                                // no HELP
        "# HELP a A.\na 3\n",                                   // no TYPE
        "a 3\n",                                                // no family
        "# HELP a A.\n# TYPE a gauge\na 1,5\n",                 // bad float
        "# HELP a A.\n# TYPE a gauge\na inf\n",                 // not +Inf
        "# HELP a A.\n# TYPE a gauge\na{x=\"1\"} 3\na{x=\"1\"} 4\n", // duplicate series
        "# HELP 9a A.\n# TYPE 9a gauge\n9a 3\n",                // bad name
        "# HELP a A.\n# TYPE a gauge\na{x=\"1} 3\n",            // unterminated label
        "# HELP a A.\n# TYPE a gauge\na{x=\"\\t\"} 3\n",        // bad escape
        "# HELP a A.\n# TYPE a gauge\n# HELP b B.\n# TYPE b gauge\nb 1\na 2\n", // interleaved
        "# HELP a A.\n# TYPE a gauge\na 1\n# HELP a A.\n# TYPE a gauge\n", // family twice
        "# HELP a A.\n# TYPE a summary\na 1\n",                 // unexpected type
    ];
    for text in bad {
        assert!(parse_exposition(text).is_err(), "accepted: {text:?}");
    }
}

/// The JSON key a metric family stands for.
fn json_key(family: &str) -> &str {
    let name = family.strip_prefix("stagefs_").expect("stagefs_ prefix");
    match name {
        "epoch_length" => "epoch_len",
        "frontier_positions" => "frontier",
        _ => name.strip_suffix("_total").unwrap_or(name),
    }
}

#[test]
fn metrics_file_is_strict_prometheus_and_agrees_with_stats() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("textfile");
    std::fs::create_dir(&dir).unwrap();
    let prom = dir.join("stagefs.prom");
    let mut args = vec!["--metrics-file", prom.to_str().unwrap()];
    args.extend(SEEDED);
    let m = dataset_and_mount(work.path(), &args);
    wait_fully_staged(&m);
    read_through(&m, &predicted_order(&m.source, 0)[..10]);
    let stats = m.stats();
    assert_eq!(stats["hits"], 10);

    // The file is rewritten every few seconds: wait until it shows the reads.
    let samples = wait_value(
        Duration::from_secs(20),
        "the metrics file to show the reads",
        || {
            let text = std::fs::read_to_string(&prom).ok()?;
            let samples = parse_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            samples
                .iter()
                .any(|s| s.family == "stagefs_hits_total" && s.value == 10.0)
                .then_some(samples)
        },
    );
    let source = m.source.to_str().unwrap();
    let mut seen = BTreeSet::new();
    for s in &samples {
        assert_eq!(
            s.labels.get("source").map(String::as_str),
            Some(source),
            "{s:?}"
        );
        assert_eq!(s.labels["sampler"], "torch-distributed");
        if s.family == "stagefs_mode" {
            assert_eq!(
                s.value,
                f64::from(u8::from(s.labels["mode"] == "predicting")),
                "{s:?}"
            );
            continue;
        }
        assert_eq!(s.labels.len(), 2, "{s:?}");
        let key = json_key(&s.family);
        let expected = match &stats[key] {
            Value::Bool(b) => f64::from(u8::from(*b)),
            v => v
                .as_f64()
                .unwrap_or_else(|| panic!("{} has no numeric JSON counterpart {key}", s.family)),
        };
        if key == "uptime_seconds" {
            assert!(s.value > 0.0 && s.value <= expected + 10.0, "{s:?}");
        } else {
            // Nothing moves once the reads are done and the cache is full (the tolerance only
            // absorbs float formatting round trips).
            assert!(
                (s.value - expected).abs() <= 1e-9 * expected.abs(),
                "{} = {} vs stats {key} = {expected}",
                s.family,
                s.value
            );
        }
        seen.insert(key.to_string());
    }
    let modes: BTreeSet<&str> = samples
        .iter()
        .filter(|s| s.family == "stagefs_mode")
        .map(|s| s.labels["mode"].as_str())
        .collect();
    assert_eq!(modes, BTreeSet::from(["predicting", "lost", "on-demand"]));
    // Every number and flag of the JSON is exported (names and lists are not metrics).
    let numeric: BTreeSet<String> = stats
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, v)| v.is_number() || v.is_boolean())
        .map(|(k, _)| k.clone())
        .collect();
    assert_eq!(seen, numeric);

    // Unmounting writes the final values; the atomic writes leave no temp file behind.
    m.unmount();
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [std::ffi::OsString::from("stagefs.prom")]);
    parse_exposition(&std::fs::read_to_string(&prom).unwrap()).unwrap();
}

/// A child process killed (by its own id) when the test ends, however it ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Removes terminal control sequences (`ESC [ ... letter`) and carriage returns.
fn strip_ansi(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                if chars.next() == Some('[') {
                    for c in chars.by_ref() {
                        if c.is_ascii_alphabetic() {
                            break;
                        }
                    }
                }
            }
            '\r' => out.push('\n'),
            c => out.push(c),
        }
    }
    out
}

/// The status line `--watch` shows after 5 of 20 predicted reads, all hits.
fn check_status_line(line: &str) {
    let expected = format!("epoch 0 [{}", "=".repeat(30 * 5 / FILES as usize));
    assert!(line.starts_with(&expected), "{line:?}");
    assert!(
        line.contains(&format!("] 5/{FILES} (25.0%) | ahead ")),
        "{line:?}"
    );
    assert!(
        line.contains("| hit ratio 1.000 | source ") && line.contains(" MB/s | predicting"),
        "{line:?}"
    );
}

#[test]
fn watch_draws_on_a_terminal_and_prints_lines_into_a_pipe() {
    let work = tempfile::tempdir().unwrap();
    let m = dataset_and_mount(work.path(), &SEEDED);
    wait_fully_staged(&m);
    read_through(&m, &predicted_order(&m.source, 0)[..5]);
    let mnt = m.mnt.to_str().unwrap();
    let bin = bin();

    // A terminal (script's pseudo-terminal): the line is redrawn in place. TERM is set as a
    // login gives it; unset or `dumb` (a bare CI environment) means no cursor control, and
    // then plain lines are printed, as into a pipe.
    let inner = format!(
        "timeout -s INT 3 {} stats --watch --interval 0.2 {mnt}",
        bin.display()
    );
    let out = Command::new("script")
        .args(["-qfec", &inner, "/dev/null"])
        .env("TERM", "xterm")
        .stdin(Stdio::null())
        .output()
        .expect("run script (util-linux)");
    let raw = String::from_utf8_lossy(&out.stdout);
    assert!(raw.contains("\u{1b}["), "no redraw on a terminal: {raw:?}");
    let lines: Vec<String> = strip_ansi(&raw)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    assert!(lines.len() >= 2, "several refreshes: {lines:?}");
    lines.iter().for_each(|l| check_status_line(l));

    // A pipe: plain lines, one per refresh, no control sequences.
    let child = Command::new(&bin)
        .args(["stats", "--watch", "--interval", "0.2", mnt])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let piped: Vec<String> = (0..3)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(20))
                .expect("a line per refresh")
        })
        .collect();
    drop(child);
    for line in &piped {
        assert!(!line.contains('\u{1b}'), "{line:?}");
        check_status_line(line);
    }
}

/// Runs `stagefs ARGS` expecting exit status 1 with exactly one line on stderr.
fn fails_with_one_line(args: &[&str]) -> String {
    let out = stagefs(args);
    assert_eq!(out.status.code(), Some(1), "{args:?}");
    assert!(out.stdout.is_empty(), "{args:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

#[test]
fn stats_on_a_plain_directory_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().to_path_buf();
    let p = path.to_str().unwrap();
    for args in [
        vec!["stats", p],
        vec!["stats", "--json", p],
        vec!["stats", "--watch", p],
    ] {
        let err = fails_with_one_line(&args);
        assert_eq!(err, format!("stagefs: {p} is not a stagefs mount\n"));
    }
    let missing = path.join("missing");
    let err = fails_with_one_line(&["stats", missing.to_str().unwrap()]);
    assert!(err.contains("No such file or directory"), "{err}");
}
