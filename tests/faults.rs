//! The fault suite (issue #8): what a reader sees when things go wrong under a real mount.
//!
//! Each test mounts the real binary, provokes one fault (the daemon killed mid-epoch, SOURCE
//! gone, a full cache file system, a source file changed after mounting, 64 concurrent readers
//! over a small cache, SIGTERM under load) and checks the one promise that holds for all of
//! them: every byte a reader gets equals the source file, and otherwise the reader gets a
//! clear error. The counters (`user.stagefs.stats`) then say whether the daemon handled the
//! fault the way it claims (reuse after a crash, capacity lowered after ENOSPC, …).
//!
//! Timing is never asserted except as generous upper bounds on things that must end (an EIO
//! that comes instead of a hang, readers that finish instead of deadlocking); every wait is a
//! bounded polling loop.
mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------------------------------------
// A dataset whose every file has unique content, kept in memory so readers can be checked
// even while SOURCE is gone or changed.

struct Dataset {
    root: PathBuf,
    files: BTreeMap<String, Vec<u8>>,
}

/// Pseudo-random bytes seeded by `seed`: no two files share content, so a file served in
/// place of another is caught.
fn unique_body(seed: u64, size: usize) -> Vec<u8> {
    let mut x = seed.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(size + 8);
    while out.len() < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(size);
    out
}

impl Dataset {
    /// An ImageFolder tree of `n` `.jpg` files over `classes` folders, sizes in [min, max).
    fn image_folder(root: &Path, n: u32, classes: u32, min: usize, max: usize) -> Dataset {
        let mut ds = Dataset {
            root: root.to_path_buf(),
            files: BTreeMap::new(),
        };
        for i in 0..n {
            let size =
                min + (u64::from(i).wrapping_mul(2_654_435_761) % (max - min) as u64) as usize;
            ds.write(
                &format!("class{:03}/img{i:06}.jpg", i % classes),
                unique_body(u64::from(i), size),
            );
        }
        ds
    }

    /// Writes `rel` on SOURCE and remembers its content as the truth readers must see.
    fn write(&mut self, rel: &str, content: Vec<u8>) {
        let p = self.root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, &content).unwrap();
        self.files.insert(rel.to_string(), content);
    }

    fn size(&self, rel: &str) -> u64 {
        self.files[rel].len() as u64
    }

    fn total_bytes(&self) -> u64 {
        self.files.values().map(|c| c.len() as u64).sum()
    }

    /// Reads `rel` through the mount. A failed read is returned (faults may cause those); a
    /// read that succeeds with any byte different from the source panics: no fault may cause it.
    fn read(&self, mnt: &Path, rel: &str) -> io::Result<()> {
        let got = fs::read(mnt.join(rel))?;
        assert_same(rel, &got, &self.files[rel]);
        Ok(())
    }
}

fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    if got != want {
        let at = got
            .iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(want.len()));
        panic!(
            "{what}: WRONG BYTES: got {} bytes, source has {}; first difference at offset {at}",
            got.len(),
            want.len()
        );
    }
}

/// The job's predicted order as relative paths (`stagefs order --paths`), for `sampler` args.
fn predicted_order(source: &Path, sampler: &[&str]) -> Vec<String> {
    let mut args = vec!["--source", source.to_str().unwrap(), "--paths"];
    args.extend_from_slice(sampler);
    stagefs_order(&args)
}

// ---------------------------------------------------------------------------------------------
// The cache directory as documented: data/xx/HASH, HASH = hex of sha256(relative path)[..16].

/// The cache file name of `rel` (a file of the dataset): its path hashed as
/// `CacheDir::path_for` does.
fn cache_name(rel: &str) -> String {
    let digest = Sha256::digest(rel.as_bytes());
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// Names (HASH) of the complete files under CACHE/stagefs/data/*/.
fn cached_names(cache: &Path) -> HashSet<String> {
    let mut names = HashSet::new();
    for sub in fs::read_dir(cache.join("stagefs/data"))
        .into_iter()
        .flatten()
        .flatten()
    {
        for f in fs::read_dir(sub.path()).into_iter().flatten().flatten() {
            names.insert(f.file_name().to_string_lossy().into_owned());
        }
    }
    names
}

/// Copies in progress (or left by a crash) of daemon `pid` under CACHE/stagefs/tmp, named
/// `PID.SEQ`.
fn temp_files(cache: &Path, pid: i32) -> usize {
    let prefix = format!("{pid}.");
    fs::read_dir(cache.join("stagefs/tmp"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                .count()
        })
        .unwrap_or(0)
}

/// Checks that every file under CACHE/stagefs/data is where the hashing puts it and equals the source
/// file it caches, byte for byte. Returns how many there are.
fn assert_cache_consistent(cache: &Path, ds: &Dataset) -> usize {
    let by_name: HashMap<String, &str> = ds
        .files
        .keys()
        .map(|rel| (cache_name(rel), rel.as_str()))
        .collect();
    let mut count = 0;
    for sub in fs::read_dir(cache.join("stagefs/data")).unwrap().flatten() {
        for f in fs::read_dir(sub.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            let rel = by_name
                .get(&name)
                .unwrap_or_else(|| panic!("cache file {name} caches no source file"));
            assert_eq!(
                sub.file_name().to_string_lossy(),
                &name[..2],
                "{name} in the wrong directory"
            );
            assert_same(
                &format!("cache copy of {rel}"),
                &fs::read(f.path()).unwrap(),
                &ds.files[*rel],
            );
            count += 1;
        }
    }
    count
}

// ---------------------------------------------------------------------------------------------
// Processes and waiting.

/// Resident memory of `pid` in kB (VmRSS).
fn rss_kb(pid: i32) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// Live processes whose command line mentions `needle` (a mountpoint: its daemon).
fn processes_mentioning(needle: &Path) -> Vec<i32> {
    let needle = needle.as_os_str().as_bytes();
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid as u32 != std::process::id() && process_alive(pid))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
        })
        .collect()
}

/// A tmpfs mounted for the test's lifetime (unmounted on drop, lazily if something still
/// holds it, so a failing test leaves no mount behind).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mount tmpfs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// SOURCE renamed away (the daemon's opens of SOURCE/relative fail, even for root), put
/// back by `restore` or on drop.
/// Detaches `0` lazily on drop if it is still mounted: the last resort when a test fails
/// while its daemon is dead and `stagefs unmount` did not get to run or failed.
struct DetachOnDrop(PathBuf);

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// A deterministic permutation of `items` (Fisher–Yates driven by xorshift from `seed`).
fn shuffled<T: Clone>(items: &[T], seed: u64) -> Vec<T> {
    let mut v = items.to_vec();
    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// 1. kill -9 mid-epoch, unmount the dead mount, remount with the same cache.

#[test]
fn kill9_mid_epoch_then_remount_reuses_completed_files() {
    let work = tempfile::tempdir().unwrap();
    let ds = Dataset::image_folder(&work.path().join("src"), 2000, 20, 40_000, 60_000);
    let sampler = ["--sampler", "torch-distributed"];
    // Two copy threads and no lookahead bound: the stager copies without a pause from the
    // mount until the epoch is staged, so the kill lands in the middle of its work.
    let args = ["--sampler", "torch-distributed", "--stage-threads", "2"];
    let order = predicted_order(&ds.root, &sampler);
    assert_eq!(order.len(), 2000);
    let m = TestMount::new(&ds.root, work.path(), &args);
    let _detach = DetachOnDrop(m.mnt.clone());
    let pid = daemon_pid(&m.mnt);

    // A reader goes through the epoch; when half of it is staged, the daemon is killed.
    let progress = AtomicUsize::new(0);
    let (completed, read_before_kill, temps_at_kill) = thread::scope(|s| {
        let reader = s.spawn(|| {
            for rel in &order {
                if ds.read(&m.mnt, rel).is_err() {
                    break; // the daemon is gone: ENOTCONN from here on
                }
                progress.fetch_add(1, Ordering::SeqCst);
            }
        });
        wait_until(
            Duration::from_secs(120),
            "half the epoch to be staged",
            || m.stat("staged_files") >= 1000 || reader.is_finished(),
        );
        let completed = cached_names(&m.cache);
        let temps = temp_files(&m.cache, pid);
        signal(pid, libc::SIGKILL);
        reader.join().unwrap();
        (completed, progress.load(Ordering::SeqCst), temps)
    });
    assert!(
        read_before_kill < order.len(),
        "the reader finished before the kill: not mid-epoch"
    );
    assert!(
        completed.len() >= 1000,
        "only {} files in the cache after 1000 were staged",
        completed.len()
    );
    wait_until(Duration::from_secs(10), "the killed daemon to exit", || {
        !process_alive(pid)
    });

    // `stagefs unmount` removes the dead mount.
    let mnt = m.mnt.clone();
    m.unmount();
    assert!(!is_mounted(&mnt));
    let cache = work.path().join("cache");
    let temps_left = temp_files(&cache, pid);
    // Nothing half-copied is under data/: every file there is a complete, correct copy.
    let in_data = assert_cache_consistent(&cache, &ds);

    let m = TestMount::new(&ds.root, work.path(), &args);
    assert_eq!(
        temp_files(&m.cache, pid),
        0,
        "the killed daemon's temporary files survived the remount"
    );
    let reused = m.stat("reused_files");
    let completed_bytes: u64 = ds
        .files
        .keys()
        .filter(|rel| completed.contains(&cache_name(rel)))
        .map(|rel| ds.size(rel))
        .sum();
    let not_completed_bytes = ds.total_bytes() - completed_bytes;
    // The restarted job reads the whole epoch again.
    for rel in &order {
        ds.read(&m.mnt, rel)
            .unwrap_or_else(|e| panic!("{rel} after the remount: {e}"));
    }
    let s = m.stats();
    let staged = s["staged_files"].as_u64().unwrap();
    let source_bytes = s["source_bytes"].as_u64().unwrap();
    eprintln!(
        "kill -9: {read_before_kill} files read, {} complete in the cache and {temps_at_kill} copies in flight at the kill; \
         {temps_left} temp files left, {in_data} files in data/ after; reused {reused} ({:.2}% of the completed); \
         after the remount {staged} files / {source_bytes} bytes copied (not completed before the kill: {not_completed_bytes} bytes)",
        completed.len(),
        100.0 * reused as f64 / completed.len() as f64
    );
    assert!(
        reused as f64 >= 0.99 * completed.len() as f64,
        "reused {reused} of {} completed files",
        completed.len()
    );
    assert_eq!(
        reused + staged,
        2000,
        "every file is either reused or copied exactly once"
    );
    assert!(
        source_bytes <= not_completed_bytes + ds.total_bytes() / 100,
        "copied {source_bytes} bytes again; only {not_completed_bytes} were not cached before the kill"
    );
    assert_eq!(s["errors"], 0);
}

// ---------------------------------------------------------------------------------------------
// 2. SOURCE goes away mid-epoch and comes back.

#[test]
fn source_gone_mid_epoch_staged_files_serve_unstaged_get_eio_and_staging_resumes() {
    let work = tempfile::tempdir().unwrap();
    let ds = Dataset::image_folder(&work.path().join("src"), 400, 10, 20_000, 30_000);
    let order = predicted_order(&ds.root, &[]);
    // SOURCE is itself a FUSE mount, as a GlusterFS or BeeGFS client is: its daemon killed is
    // an outage (ENOTCONN), a new mount at the same place is the file system coming back.
    let client = work.path().join("client");
    fs::create_dir(&client).unwrap();
    let source_client = || TestMount::new(&ds.root, &client, &["--sampler", "none"]);
    let mut pfs = Some(source_client());
    let source = client.join("mnt");
    let outer = work.path().join("outer");
    fs::create_dir(&outer).unwrap();
    let m = TestMount::new(
        &source,
        &outer,
        &[
            "--lookahead",
            "50",
            "--retries",
            "2",
            "--open-timeout",
            "10",
        ],
    );
    let state = |rel: &str| xattr(&m.mnt.join(rel), "user.stagefs.state").unwrap();
    for rel in &order[..100] {
        ds.read(&m.mnt, rel).unwrap();
    }
    // The frontier stages 50 files ahead of the reader, and no further.
    wait_until(
        Duration::from_secs(60),
        "the frontier to stage 50 ahead",
        || order[100..150].iter().all(|r| state(r) == "cached"),
    );
    // The reader has looked up what it reads next (the mount knows those files' attributes).
    for rel in &order[150..153] {
        assert_eq!(state(rel), "remote");
    }

    let client_pid = pfs.as_ref().unwrap().daemon_pid();
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(client_pid, libc::SIGKILL) }, 0);
    assert!(wait_for(Duration::from_secs(10), || !process_alive(
        client_pid
    )));
    // Staged files keep being served (and move the cursor on, so the frontier hits the fault).
    for rel in &order[100..150] {
        ds.read(&m.mnt, rel)
            .unwrap_or_else(|e| panic!("staged {rel} while SOURCE is gone: {e}"));
    }
    // Unstaged ones fail with EIO once the retries are spent, not after the open timeout.
    let mut worst = Duration::ZERO;
    for rel in &order[150..153] {
        let t = Instant::now();
        let err = ds
            .read(&m.mnt, rel)
            .expect_err("read of an unstaged file while SOURCE is gone");
        let took = t.elapsed();
        assert_eq!(errno(&err), libc::EIO, "{rel}: {err}");
        assert!(took < Duration::from_secs(10), "{rel}: EIO took {took:?}");
        worst = worst.max(took);
        let log = m.log_text();
        assert!(
            log.lines()
                .any(|l| l.contains(rel.as_str()) && l.contains("failed after 2 retries")),
            "no log line names {rel}:\n{log}"
        );
        assert!(
            !log.lines()
                .any(|l| l.contains(rel.as_str()) && l.contains("gave up waiting")),
            "{rel} hit the open timeout"
        );
    }
    let errors = m.stat("errors"); // the daemon is still up and answering
    assert!(errors >= 3);

    // The client comes back: the dead mount is detached and a new one made at the same place.
    pfs.take().unwrap().detach_dead();
    let pfs = source_client();
    let before = m.stat("staged_files");
    // No reader: the frontier finds the source back by itself and stages ahead again.
    let resumed = wait_until(
        Duration::from_secs(60),
        "staging to resume without a reader",
        || order[153..203].iter().all(|r| state(r) == "cached"),
    );
    let after = m.stat("staged_files");
    assert!(after >= before + 50, "staged_files {before} → {after}");
    for rel in &order[150..] {
        ds.read(&m.mnt, rel)
            .unwrap_or_else(|e| panic!("{rel} after SOURCE came back: {e}"));
    }
    eprintln!(
        "source gone: EIO after at most {worst:.2?} (retries 2), {errors} errors counted; staging resumed {resumed:.1?} after the source came back ({before} → {after} staged files)"
    );
    // The mount over the client first: it holds SOURCE's root open.
    m.unmount();
    pfs.unmount();
}

// ---------------------------------------------------------------------------------------------
// 3. The cache file system is smaller than --cache-size and fills up.

#[test]
fn cache_filesystem_full_lowers_capacity_and_readers_see_no_error() {
    let work = tempfile::tempdir().unwrap();
    let ds = Dataset::image_folder(&work.path().join("src"), 200, 10, 150_000, 250_000);
    let order = predicted_order(&ds.root, &[]);
    // Declared before the mount so it is unmounted after it.
    let _tmpfs = Tmpfs::mount(&work.path().join("cache"), "8m");
    let m = TestMount::new(
        &ds.root,
        work.path(),
        &["--cache-size", "64M", "--sampler", "torch-distributed"],
    );
    for epoch in 0..2 {
        for rel in &order {
            ds.read(&m.mnt, rel)
                .unwrap_or_else(|e| panic!("epoch {epoch}, {rel}: {e}"));
        }
    }
    let s = m.stats();
    eprintln!(
        "cache full: {} bytes of data, {} ENOSPC events, capacity after {} bytes, used {}, hits {} misses {}, evictions {}",
        ds.total_bytes(),
        s["cache_full_events"],
        s["cache_capacity_bytes"],
        s["cache_used_bytes"],
        s["hits"],
        s["misses"],
        s["evictions"]
    );
    assert!(s["cache_full_events"].as_u64().unwrap() >= 1);
    let capacity = s["cache_capacity_bytes"].as_u64().unwrap();
    assert!(
        capacity < 8 << 20,
        "capacity {capacity} after ENOSPC on an 8 MiB file system"
    );
    assert!(
        capacity >= 1 << 20,
        "capacity collapsed to {capacity}: the cache is useless after one ENOSPC"
    );
    assert!(s["hits"].as_u64().unwrap() > 0);
    // Checked once the daemon is gone: until then the frontier goes on staging the next epoch,
    // evicting files between the listing and the read.
    let cache = m.cache.clone();
    m.unmount();
    assert_cache_consistent(&cache, &ds);
}

// ---------------------------------------------------------------------------------------------
// 4. A source file changes after mounting.

#[test]
fn changed_source_file_is_old_snapshot_or_estale_never_mixed() {
    let work = tempfile::tempdir().unwrap();
    let mut ds = Dataset::image_folder(&work.path().join("src"), 20, 2, 10_000, 20_000);
    ds.write("class000/big1.jpg", unique_body(1001, 3 << 20));
    ds.write("class000/big2.jpg", unique_body(1002, 3 << 20));
    let m = TestMount::new(
        &ds.root,
        work.path(),
        &["--sampler", "none", "--read-through-above", "1M"],
    );
    let state = |rel: &str| xattr(&m.mnt.join(rel), "user.stagefs.state").unwrap();
    let change = |rel: &str, content: &[u8]| fs::write(ds.root.join(rel), content).unwrap();
    let open_errno = |rel: &str| match fs::read(m.mnt.join(rel)) {
        Ok(_) => panic!("{rel} changed on the source but was served"),
        Err(e) => errno(&e),
    };
    // The job has looked at its files: the mount has shown their attributes, so what changes
    // now changes under it (a file first used after a change is simply its new version).
    for rel in ds.files.keys() {
        fs::metadata(m.mnt.join(rel)).unwrap();
    }

    // Cached, then changed: the old snapshot, whole.
    let cached = "class000/img000000.jpg";
    ds.read(&m.mnt, cached).unwrap();
    assert_eq!(state(cached), "cached");
    change(cached, &unique_body(7, 12_345));
    for _ in 0..2 {
        ds.read(&m.mnt, cached).unwrap();
    }

    // Not cached, size changed.
    let resized = "class001/img000001.jpg";
    assert_eq!(state(resized), "remote");
    change(resized, &unique_body(8, ds.size(resized) as usize + 100));
    let resized_errno = open_errno(resized);
    // Not cached, same size, only the mtime moved.
    let touched = "class000/img000002.jpg";
    let f = fs::File::options()
        .write(true)
        .open(ds.root.join(touched))
        .unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(100))
        .unwrap();
    drop(f);
    let touched_errno = open_errno(touched);
    // Read through from SOURCE (above --read-through-above), changed before the open.
    change("class000/big1.jpg", &unique_body(9, 3 << 20));
    let big_errno = open_errno("class000/big1.jpg");
    for (what, e) in [
        ("resized", resized_errno),
        ("touched", touched_errno),
        ("read-through", big_errno),
    ] {
        assert!(e == libc::ESTALE || e == libc::EIO, "{what}: errno {e}");
    }
    // And the error is stable: a second open is refused the same way.
    assert_eq!(open_errno(resized), resized_errno);

    // Read through, changed in place while open: the rest must not come from the new version.
    let big = "class000/big2.jpg";
    let want = &ds.files[big];
    let mut f = fs::File::open(m.mnt.join(big)).unwrap();
    let mut head = vec![0u8; 1 << 20];
    f.read_exact(&mut head).unwrap();
    assert_same("big2 first MiB", &head, &want[..1 << 20]);
    let mut w = fs::File::options()
        .write(true)
        .open(ds.root.join(big))
        .unwrap();
    std::io::Write::write_all(&mut w, &unique_body(10, 3 << 20)).unwrap();
    drop(w);
    let mut rest = Vec::new();
    let tail = f.read_to_end(&mut rest);
    match &tail {
        Ok(_) => assert_same("big2 after an in-place change", &rest, &want[1 << 20..]),
        Err(e) => assert!(
            errno(e) == libc::ESTALE || errno(e) == libc::EIO,
            "big2 tail: {e}"
        ),
    }
    eprintln!(
        "changed source: cached file → old bytes; uncached resized → errno {resized_errno}, mtime only → errno {touched_errno}, \
         read-through → errno {big_errno}; read-through changed while open → {}",
        match tail {
            Ok(_) => "old bytes".to_string(),
            Err(e) => format!("errno {}", errno(&e)),
        }
    );
    // The rest of the dataset is unaffected.
    ds.read(&m.mnt, "class001/img000003.jpg").unwrap();
}

// ---------------------------------------------------------------------------------------------
// 5. 64 concurrent readers (threads and processes) over a cache a quarter of the data.

const READERS_PY: &str = r#"
import random, sys, time
mnt, src, listing, mode, seed, secs = sys.argv[1:7]
paths = [p for p in open(listing).read().split("\n") if p]
if mode == "random":
    random.Random(int(seed)).shuffle(paths)
else:
    k = int(seed) * 37 % len(paths)
    paths = paths[k:] + paths[:k]
end = time.monotonic() + float(secs)
reads = errors = wrong = i = 0
while time.monotonic() < end:
    rel = paths[i % len(paths)]
    i += 1
    try:
        with open(mnt + "/" + rel, "rb") as f:
            got = f.read()
    except OSError as e:
        errors += 1
        print("error", rel, e, file=sys.stderr)
        continue
    with open(src + "/" + rel, "rb") as f:
        want = f.read()
    reads += 1
    if got != want:
        wrong += 1
        print("WRONG BYTES", rel, len(got), len(want), file=sys.stderr)
print(reads, errors, wrong)
sys.exit(1 if errors or wrong else 0)
"#;

/// Reader threads and reader processes of the 64-reader test.
const READER_THREADS: usize = 32;
const READER_PROCESSES: usize = 32;
/// How long the 64 readers read.
const READERS_RUN: Duration = Duration::from_secs(15);
/// Readers that have not finished this long after [`READERS_RUN`] are stuck: a deadlock.
const READERS_BOUND: Duration = Duration::from_secs(60);

#[test]
fn sixty_four_concurrent_readers_small_cache_no_deadlock_no_wrong_byte() {
    let work = tempfile::tempdir().unwrap();
    let ds = Dataset::image_folder(&work.path().join("src"), 600, 12, 20_000, 40_000);
    let cache_size = (ds.total_bytes() / 4).to_string();
    let order = predicted_order(&ds.root, &[]);
    let listing = work.path().join("order.txt");
    fs::write(&listing, order.join("\n")).unwrap();
    let m = TestMount::new(
        &ds.root,
        work.path(),
        &["--cache-size", &cache_size, "--open-timeout", "30"],
    );
    let pid = daemon_pid(&m.mnt);
    let rss_before = rss_kb(pid);

    let mut children = spawn_reader_processes(&m.mnt, &ds.root, &listing);
    let (reads, errors) = read_from_threads(&ds, &order, &m.mnt, pid, &mut children);
    let proc_reads = wait_reader_processes(&mut children, pid);
    assert!(
        errors.is_empty(),
        "{} failed reads, e.g. {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    let rss_after = rss_kb(pid);
    let s = m.stats();
    eprintln!(
        "64 readers: {reads} thread reads + {proc_reads} process reads in {READERS_RUN:?}; daemon RSS {rss_before} kB → {rss_after} kB; \
         hits {} misses {} evictions {} mispredictions {} mode {} errors {}",
        s["hits"], s["misses"], s["evictions"], s["mispredictions"], s["mode"], s["errors"]
    );
    assert!(reads > 0 && proc_reads > 0);
    assert!(
        s["evictions"].as_u64().unwrap() > 0,
        "a cache of a quarter of the data never evicted"
    );
    assert_eq!(s["errors"], 0);
    assert!(rss_after < 200 * 1024, "daemon RSS {rss_after} kB");
    assert_no_evicted_copy_held(pid, &m.cache);
}

/// [`READERS_PY`] processes reading `mnt` for [`READERS_RUN`], checked against `source`: half
/// follow the prediction (`listing`) from different offsets, half read a random permutation.
fn spawn_reader_processes(mnt: &Path, source: &Path, listing: &Path) -> Vec<Child> {
    (0..READER_PROCESSES)
        .map(|i| {
            Command::new("python3")
                .args(["-c", READERS_PY])
                .arg(mnt)
                .arg(source)
                .arg(listing)
                .args([
                    if i % 2 == 0 { "predicted" } else { "random" },
                    &i.to_string(),
                    &READERS_RUN.as_secs().to_string(),
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("python3")
        })
        .collect()
}

/// Reads `mnt` from [`READER_THREADS`] threads for [`READERS_RUN`], half in the predicted
/// `order` from different offsets, half in a random permutation: how many reads succeeded and
/// the failures. A thread still reading [`READERS_BOUND`] later is a deadlock: the daemon
/// `pid` and the reader `children` are killed (so the threads end) and the test fails.
fn read_from_threads(
    ds: &Dataset,
    order: &[String],
    mnt: &Path,
    pid: i32,
    children: &mut [Child],
) -> (u64, Vec<String>) {
    let (tx, rx) = mpsc::channel();
    thread::scope(|s| {
        for i in 0..READER_THREADS {
            let tx = tx.clone();
            s.spawn(move || {
                let mine = if i % 2 == 0 {
                    order[i * 37 % order.len()..]
                        .iter()
                        .chain(order)
                        .cloned()
                        .collect()
                } else {
                    shuffled(order, i as u64 + 1)
                };
                let end = Instant::now() + READERS_RUN;
                let (mut reads, mut errors) = (0u64, Vec::new());
                for rel in mine.iter().cycle() {
                    if Instant::now() >= end {
                        break;
                    }
                    match ds.read(mnt, rel) {
                        Ok(()) => reads += 1,
                        Err(e) => errors.push(format!("{rel}: {e}")),
                    }
                }
                let _ = tx.send((reads, errors));
            });
        }
        drop(tx);
        let deadline = Instant::now() + READERS_RUN + READERS_BOUND;
        let mut reads = 0;
        let mut errors = Vec::new();
        let mut finished = 0;
        while finished < READER_THREADS {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((r, e)) => {
                    reads += r;
                    errors.extend(e);
                    finished += 1;
                }
                Err(_) => {
                    // Unblock the stuck readers (kill the daemon) so the scope can end, then fail.
                    signal(pid, libc::SIGKILL);
                    children.iter_mut().for_each(|c| drop(c.kill()));
                    panic!(
                        "{} of {READER_THREADS} reader threads still running {READERS_BOUND:?} after the run: deadlock",
                        READER_THREADS - finished
                    );
                }
            }
        }
        (reads, errors)
    })
}

/// Waits for the reader processes, each of which must succeed; the reads they counted. One
/// still running [`READERS_BOUND`] from now is a deadlock: the daemon `pid` is killed and the
/// test fails.
fn wait_reader_processes(children: &mut [Child], pid: i32) -> u64 {
    let mut proc_reads = 0;
    let deadline = Instant::now() + READERS_BOUND;
    for (i, c) in children.iter_mut().enumerate() {
        let status = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                signal(pid, libc::SIGKILL);
                panic!(
                    "reader process {i} still running {READERS_BOUND:?} after the run: deadlock"
                );
            }
            thread::sleep(Duration::from_millis(50));
        };
        let mut out = String::new();
        c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        let mut err = String::new();
        c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        assert!(status.success(), "reader process {i}: {out} {err}");
        proc_reads += out
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
    }
    proc_reads
}

/// The daemon `pid` keeps hits' copies open between opens; an evicted one kept open would
/// hold its disk space past the cache's bound.
fn assert_no_evicted_copy_held(pid: i32, cache: &Path) {
    let held: Vec<_> = fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|fd| fs::read_link(fd.unwrap().path()).ok())
        .filter(|t| t.starts_with(cache))
        .collect();
    assert!(held.len() > 1, "hits' copies are kept open: {held:?}");
    let deleted: Vec<_> = held
        .iter()
        .filter(|t| t.to_string_lossy().ends_with(" (deleted)"))
        .collect();
    assert!(deleted.is_empty(), "evicted copies still open: {deleted:?}");
}

/// The deterministic core of the concurrency faults: one file open twice at once, both times
/// from the cache, and once read through from SOURCE while its cached copy is opened. With
/// FUSE passthrough the kernel fails such opens with EIO unless the daemon answers every open
/// of an inode the same way (passthrough with one backing file, or not at all).
#[test]
fn same_file_open_twice_from_cache_and_from_source() {
    let work = tempfile::tempdir().unwrap();
    let mut ds = Dataset::image_folder(&work.path().join("src"), 4, 1, 10_000, 20_000);
    ds.write("class000/big.jpg", unique_body(77, 3 << 20));
    let m = TestMount::new(
        &ds.root,
        work.path(),
        &["--sampler", "none", "--read-through-above", "1M"],
    );
    let open =
        |rel: &str| fs::File::open(m.mnt.join(rel)).unwrap_or_else(|e| panic!("open {rel}: {e}"));
    let read_rest = |f: &mut fs::File| {
        let mut v = Vec::new();
        f.read_to_end(&mut v).unwrap();
        v
    };

    let small = "class000/img000000.jpg";
    ds.read(&m.mnt, small).unwrap();
    let (mut a, mut b) = (open(small), open(small));
    assert_same("first of two opens", &read_rest(&mut a), &ds.files[small]);
    assert_same("second of two opens", &read_rest(&mut b), &ds.files[small]);

    let big = "class000/big.jpg";
    let mut through = open(big); // not cached yet: read through from SOURCE while it is copied
    let mut head = vec![0u8; 4096];
    through.read_exact(&mut head).unwrap();
    wait_until(Duration::from_secs(30), "the big file to be cached", || {
        xattr(&m.mnt.join(big), "user.stagefs.state").as_deref() == Some("cached")
    });
    let mut cached = open(big);
    assert_same(
        "cached open beside a read-through one",
        &read_rest(&mut cached),
        &ds.files[big],
    );
    head.extend(read_rest(&mut through));
    assert_same("read-through open", &head, &ds.files[big]);
    let s = m.stats();
    assert_eq!(s["errors"], 0);
    eprintln!(
        "same file open twice: fine (passthrough {})",
        s["passthrough"]
    );
}

// ---------------------------------------------------------------------------------------------
// 6. SIGTERM while readers are busy.

#[test]
fn sigterm_during_heavy_reading_unmounts_cleanly_and_leaves_a_consistent_cache() {
    let work = tempfile::tempdir().unwrap();
    let ds = Dataset::image_folder(&work.path().join("src"), 800, 16, 20_000, 40_000);
    let order = predicted_order(&ds.root, &[]);
    let m = TestMount::new(&ds.root, work.path(), &[]);
    let pid = daemon_pid(&m.mnt);
    let reads = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    thread::scope(|s| {
        for i in 0..8 {
            let (ds, mnt, reads, stop) = (&ds, &m.mnt, &reads, &stop);
            let mine = shuffled(&order, i + 1);
            s.spawn(move || {
                for rel in mine.iter().cycle() {
                    if stop.load(Ordering::SeqCst) || ds.read(mnt, rel).is_err() {
                        return;
                    }
                    reads.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        let ready = wait_until(Duration::from_secs(60), "the readers to get going", || {
            reads.load(Ordering::SeqCst) >= 300
        });
        signal(pid, libc::SIGTERM);
        let exit = wait_until(
            Duration::from_secs(30),
            "the daemon to exit after SIGTERM",
            || !process_alive(pid),
        );
        stop.store(true, Ordering::SeqCst);
        eprintln!(
            "sigterm: sent after {ready:.1?} ({} reads); daemon exited {exit:.1?} later",
            reads.load(Ordering::SeqCst)
        );
    });
    let mnt = m.mnt.clone();
    let log = m.log_text();
    assert!(
        !is_mounted(&mnt),
        "still in mountinfo after SIGTERM:\n{log}"
    );
    assert!(
        processes_mentioning(&mnt).is_empty(),
        "stray processes: {:?}",
        processes_mentioning(&mnt)
    );
    drop(m);
    let cache = work.path().join("cache");
    let in_data = assert_cache_consistent(&cache, &ds);
    let m = TestMount::new(&ds.root, work.path(), &[]);
    assert_eq!(
        temp_files(&m.cache, pid),
        0,
        "the stopped daemon's temporary files survived the remount"
    );
    assert_eq!(m.stat("reused_files") as usize, in_data);
    for rel in order.iter().take(100) {
        ds.read(&m.mnt, rel).unwrap();
    }
    eprintln!(
        "sigterm: {in_data} consistent files in the cache, all reused; busy mount detached lazily: {}",
        log.contains("detaching it lazily")
    );
}
