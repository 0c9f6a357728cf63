//! End to end over a real distributed file system: unmodified training scripts
//! (`tests/e2e/*.py`: PyTorch DistributedSampler, PyTorch shuffled DataLoader, a Chainer-style
//! numpy loop) read a synthetic ImageFolder dataset on a GlusterFS volume (several bricks on
//! loopback, `tests/e2e/gluster.sh`) once directly and once through a stagefs mount over the
//! GlusterFS mount, at the same time. They must read the same samples in the same order, and
//! that order must be the one `stagefs order` predicts; the mount must never mispredict and
//! must have the files staged before they are opened.
//!
//! Per-epoch hit ratios need the mount's counters at epoch boundaries, which the scripts know
//! nothing about. They run all epochs in one process (as a job does, so torch's and numpy's
//! generators advance exactly as in a real run) with `--step`: after each epoch they print
//! the epoch's JSON line and wait for a line on stdin. The test reads the counters there and
//! lets them go on. No assertion is on a duration: the checks are counts, bytes, orders and
//! checksums (the epoch-0 hit ratio depends on the stager keeping ahead of a reader that
//! computes between batches, with a wide margin).
//!
//! Needs root, FUSE, glusterfs-server and Debian's python3-torch / python3-torchvision (the
//! scripts run under /usr/bin/python3, where apt puts torch).
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Debian's interpreter: torch and torchvision come from apt, not from a PATH python.
const PYTHON: &str = "/usr/bin/python3";
/// A job that has not finished by then is killed (a hung read must fail the test, not CI).
const JOB_DEADLINE: Duration = Duration::from_secs(240);
/// Simulated compute per batch: 50 ms per 16 samples caps a reader at 320 samples/s (about
/// 33 MB/s here), which leaves the stager room to keep ahead in epoch 0 even on a loaded
/// machine; it also has the scripts' start-up (importing torch takes seconds) to get ahead.
const COMPUTE_MS: &str = "50";
const BATCH: &str = "16";
const EPOCHS: usize = 2;

/// A GlusterFS volume for one test, mounted at `mnt`; stopped, deleted and its bricks removed
/// on drop, whatever state it got to.
struct Volume {
    name: String,
    bricks: PathBuf,
    mnt: PathBuf,
    /// Held from before `up` until after `down`: see [`ONE_VOLUME_AT_A_TIME`].
    _turn: MutexGuard<'static, ()>,
}

/// The hit ratios checked are a race between the stager and a reader that computes between
/// batches, both on GlusterFS (whose daemons need CPU of their own). Two such tests side by
/// side on a 2-core machine starved the stager (an epoch 0 at 0.89 with 7 s of stalls and no
/// misprediction), so the tests that bring up a volume take turns; the rest still run beside
/// them.
static ONE_VOLUME_AT_A_TIME: Mutex<()> = Mutex::new(());

impl Volume {
    fn up(work: &Path, bricks: u32) -> Volume {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // A test that failed while holding the turn poisons the lock; the next one may go on.
        let turn = ONE_VOLUME_AT_A_TIME
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let name = format!(
            "stagefs_e2e_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let v = Volume {
            name,
            bricks: work.join("bricks"),
            mnt: work.join("gluster"),
            _turn: turn,
        };
        let out = v.script("up", &[&bricks.to_string()]);
        assert!(
            out.status.success(),
            "gluster.sh up {}: {}",
            v.name,
            String::from_utf8_lossy(&out.stderr)
        );
        v
    }

    fn script(&self, verb: &str, extra: &[&str]) -> std::process::Output {
        Command::new(e2e_dir().join("gluster.sh"))
            .arg(verb)
            .arg(&self.name)
            .arg(&self.bricks)
            .arg(&self.mnt)
            .args(extra)
            .output()
            .expect("run tests/e2e/gluster.sh")
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        let out = self.script("down", &[]);
        if !out.status.success() {
            eprintln!(
                "gluster.sh down {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// A synthetic ImageFolder dataset of real JPEG files, written through the GlusterFS mount.
struct Dataset {
    root: PathBuf,
    /// Relative path → size, for every sample file.
    files: BTreeMap<String, u64>,
}

impl Dataset {
    fn make(root: &Path, files: u32, classes: u32) -> Dataset {
        Self::make_sized(root, files, classes, (10, 200))
    }

    /// `files` JPEGs of `kb.0` to `kb.1` KB in `classes` class folders.
    fn make_sized(root: &Path, files: u32, classes: u32, kb: (u32, u32)) -> Dataset {
        let out = Command::new(PYTHON)
            .arg(e2e_dir().join("common.py"))
            .args([
                "make-dataset",
                root.to_str().unwrap(),
                "--files",
                &files.to_string(),
            ])
            .args([
                "--classes",
                &classes.to_string(),
                "--min-kb",
                &kb.0.to_string(),
                "--max-kb",
                &kb.1.to_string(),
            ])
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .expect("run common.py make-dataset");
        assert!(
            out.status.success(),
            "make-dataset: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut map = BTreeMap::new();
        for class in std::fs::read_dir(root).unwrap() {
            let class = class.unwrap();
            for f in std::fs::read_dir(class.path()).unwrap() {
                let f = f.unwrap();
                let rel = format!(
                    "{}/{}",
                    class.file_name().to_str().unwrap(),
                    f.file_name().to_str().unwrap()
                );
                map.insert(rel, f.metadata().unwrap().len());
            }
        }
        assert_eq!(map.len(), files as usize, "files on the volume");
        Dataset {
            root: root.to_path_buf(),
            files: map,
        }
    }

    fn bytes<'a>(&self, files: impl IntoIterator<Item = &'a String>) -> u64 {
        files.into_iter().map(|f| self.files[f]).sum()
    }
}

/// `stagefs order` for `sampler` over the dataset: indices (or paths), epoch after epoch.
fn predicted(source: &Path, sampler: &[&str], epochs: usize, paths: bool) -> Vec<String> {
    let mut args = vec!["--source", source.to_str().unwrap()];
    args.extend_from_slice(sampler);
    let epochs = epochs.to_string();
    args.extend_from_slice(&["--epochs", &epochs]);
    if paths {
        args.push("--paths");
    }
    stagefs_order(&args)
}

/// What to run: a script of tests/e2e, its own arguments, for how many epochs, with what
/// environment on top of the test's.
struct Launch<'a> {
    script: &'a str,
    args: &'a [&'a str],
    epochs: usize,
    env: Vec<(String, String)>,
}

impl<'a> Launch<'a> {
    fn new(script: &'a str, args: &'a [&'a str]) -> Launch<'a> {
        Launch {
            script,
            args,
            epochs: EPOCHS,
            env: Vec::new(),
        }
    }
}

/// One run of a training script, killed if it outlives the test or [`JOB_DEADLINE`].
struct Job {
    child: Child,
    stdin: Option<ChildStdin>,
    epochs: usize,
    name: String,
    stderr: PathBuf,
    order: PathBuf,
    started: Instant,
}

impl Job {
    fn spawn(work: &Path, name: &str, launch: &Launch, root: &Path) -> Job {
        let stderr = work.join(format!("{name}.stderr"));
        let order = work.join(format!("{name}.order"));
        let mut child = Command::new(PYTHON)
            .arg(e2e_dir().join(launch.script))
            .arg(root)
            .args([
                "--epochs",
                &launch.epochs.to_string(),
                "--batch-size",
                BATCH,
                "--compute-ms",
                COMPUTE_MS,
                "--step",
            ])
            .arg("--order-out")
            .arg(&order)
            .args(launch.args)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("OMP_NUM_THREADS", "1")
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("run /usr/bin/python3 (apt-get install python3-torch python3-torchvision)");
        let stdin = child.stdin.take();
        Job {
            child,
            stdin,
            epochs: launch.epochs,
            name: name.to_string(),
            stderr,
            order,
            started: Instant::now(),
        }
    }

    /// Runs the job to its end, calling `at_epoch_end` with each epoch's JSON line while the
    /// script waits; returns the lines and the order it read in.
    fn finish(mut self, mut at_epoch_end: impl FnMut(&Value)) -> (Vec<Value>, Vec<String>) {
        let deadline = self.started + JOB_DEADLINE;
        let mut lines = Vec::new();
        {
            // Reading stdout blocks: a watchdog kills the child at the deadline. It is joined
            // before the child is reaped, so it never signals a recycled pid.
            let _watchdog = Watchdog::start(self.child.id(), deadline);
            for line in BufReader::new(self.child.stdout.take().unwrap()).lines() {
                let line = line.unwrap();
                let value: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("{}: bad line {line:?}: {e}", self.name));
                at_epoch_end(&value);
                lines.push(value);
                if let Some(stdin) = self.stdin.as_mut() {
                    // The last epoch does not wait: the pipe may be closed by then.
                    let _ = stdin.write_all(b"\n").and_then(|_| stdin.flush());
                }
            }
        }
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        assert!(
            status.success(),
            "{} failed ({status}) after {:.0?}:\n{stderr}",
            self.name,
            self.started.elapsed()
        );
        assert_eq!(
            lines.len(),
            self.epochs,
            "{}: epoch lines\n{stderr}",
            self.name
        );
        let order = std::fs::read_to_string(&self.order)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        (lines, order)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Kills process `pid` if it is still running at `deadline`; stops watching when dropped.
struct Watchdog {
    done: std::sync::mpsc::Sender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(pid: u32, deadline: Instant) -> Watchdog {
        let (done, stop) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(left) {
                // SAFETY: plain kill(2); the owner has not reaped the child while we run.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        });
        Watchdog {
            done,
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.done.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a run through a mount saw, epoch by epoch: the script's lines, its order and the
/// mount's counters before the job and after each epoch.
struct Observed {
    lines: Vec<Value>,
    order: Vec<String>,
    stats: Vec<Value>,
}

impl Observed {
    fn delta(&self, epoch: usize, key: &str) -> u64 {
        let at = |i: usize| self.stats[i][key].as_u64().unwrap();
        at(epoch + 1) - at(epoch)
    }

    fn hit_ratio(&self, epoch: usize) -> f64 {
        let (hits, misses) = (self.delta(epoch, "hits"), self.delta(epoch, "misses"));
        hits as f64 / (hits + misses).max(1) as f64
    }
}

/// Runs `direct` on `source` and `through` on `mount` at the same time (the same script, the
/// latter perhaps with the feed hook); `at_epoch_end` is called on the mounted run's epoch
/// boundaries after the counters are read.
fn run_both(
    work: &Path,
    name: &str,
    (direct, through): (&Launch, &Launch),
    source: &Path,
    mount: &TestMount,
    mut at_epoch_end: impl FnMut(usize, &TestMount),
) -> (Vec<Value>, Vec<String>, Observed) {
    let direct = Job::spawn(work, &format!("{name}-direct"), direct, source);
    let mut stats = vec![mount.stats()];
    let through = Job::spawn(work, &format!("{name}-stagefs"), through, &mount.mnt);
    std::thread::scope(|s| {
        let direct = s.spawn(|| direct.finish(|_| {}));
        let (lines, order) = through.finish(|line| {
            stats.push(mount.stats());
            at_epoch_end(line["epoch"].as_u64().unwrap() as usize, mount);
        });
        let (dlines, dorder) = direct.join().expect("direct run");
        (
            dlines,
            dorder,
            Observed {
                lines,
                order,
                stats,
            },
        )
    })
}

/// [`run_both`], but the direct run first, to its end: where what is measured is how soon
/// staging catches up with a reader (`--sampler auto`'s first epoch), a twin competing for
/// this machine's two cores would measure the machine.
fn run_direct_first(
    work: &Path,
    name: &str,
    launch: &Launch,
    source: &Path,
    mount: &TestMount,
) -> (Vec<Value>, Vec<String>, Observed) {
    let (dlines, dorder) =
        Job::spawn(work, &format!("{name}-direct"), launch, source).finish(|_| {});
    let mut stats = vec![mount.stats()];
    let (lines, order) = Job::spawn(work, &format!("{name}-stagefs"), launch, &mount.mnt)
        .finish(|_| stats.push(mount.stats()));
    (
        dlines,
        dorder,
        Observed {
            lines,
            order,
            stats,
        },
    )
}

/// Asserts two index orders are equal, naming the first difference instead of printing both.
fn same_order(what: &str, got: &[String], want: &[String]) {
    if let Some(i) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
        let window = |v: &[String]| v[i.min(v.len())..(i + 8).min(v.len())].join(",");
        panic!(
            "{what}: orders differ at position {i} of {}/{}: {} vs {}",
            got.len(),
            want.len(),
            window(got),
            window(want)
        );
    }
}

/// The checks every mounted run must pass against its direct twin and the prediction.
fn check_run(
    what: &str,
    direct: &[Value],
    direct_order: &[String],
    seen: &Observed,
    predicted: &[String],
    min_hit_ratios: &[f64],
    exact_from_epoch: usize,
) {
    same_order(
        &format!("{what}: the real loader vs `stagefs order`"),
        direct_order,
        predicted,
    );
    same_order(
        &format!("{what}: through the mount vs direct"),
        &seen.order,
        direct_order,
    );
    for (e, (d, m)) in direct.iter().zip(&seen.lines).enumerate() {
        assert_eq!(
            m["checksum"], d["checksum"],
            "{what} epoch {e}: checksum through the mount"
        );
        assert_eq!(m["samples"], d["samples"], "{what} epoch {e}: samples");
        assert_eq!(m["bytes"], d["bytes"], "{what} epoch {e}: bytes");
        // Each sample is one open() of its file by the loader: every one went through the mount.
        let opens = seen.delta(e, "hits") + seen.delta(e, "misses");
        assert_eq!(
            opens,
            m["samples"].as_u64().unwrap(),
            "{what} epoch {e}: opens through the mount"
        );
        let want = min_hit_ratios[e.min(min_hit_ratios.len() - 1)];
        let ratio = seen.hit_ratio(e);
        assert!(
            ratio >= want,
            "{what} epoch {e}: hit ratio {ratio:.4} < {want}; stats {}",
            seen.stats[e + 1]
        );
    }
    let last = seen.stats.last().unwrap();
    let mispredicted: u64 = (exact_from_epoch..seen.lines.len())
        .map(|e| seen.delta(e, "mispredictions"))
        .sum();
    assert_eq!(
        mispredicted, 0,
        "{what}: mispredictions from epoch {exact_from_epoch}; stats {last}"
    );
    assert_eq!(last["errors"], 0, "{what}: errors; stats {last}");
    eprintln!(
        "{what}: hit ratio per epoch {:?}; direct wall {:?} s, through stagefs {:?} s",
        (0..seen.lines.len())
            .map(|e| format!("{:.4}", seen.hit_ratio(e)))
            .collect::<Vec<_>>(),
        direct
            .iter()
            .map(|l| l["wall_s"].as_f64().unwrap())
            .collect::<Vec<_>>(),
        seen.lines
            .iter()
            .map(|l| l["wall_s"].as_f64().unwrap())
            .collect::<Vec<_>>(),
    );
}

/// One script, one node: GlusterFS volume, dataset, direct and mounted runs, all the checks.
fn single_node(script: &str, sampler: &[&str], script_args: &[&str], files: u32) {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let volume = Volume::up(work.path(), 3);
    let data = Dataset::make(&volume.mnt.join("train"), files, 10);
    let mount = TestMount::new(&data.root, &work.path().join("node"), sampler);
    let launch = Launch::new(script, script_args);
    let (direct, direct_order, seen) = run_both(
        work.path(),
        "job",
        (&launch, &launch),
        &data.root,
        &mount,
        |_, _| {},
    );
    let predicted = predicted(&data.root, sampler, EPOCHS, false);
    check_run(
        script,
        &direct,
        &direct_order,
        &seen,
        &predicted,
        &[0.95, 0.999],
        0,
    );
    mount.unmount();
    drop(volume);
}

#[test]
fn torch_distributed_sampler_through_gluster() {
    // Rank 1 of 2, 401 files: the rank's share is half the set and DistributedSampler pads.
    let sampler = [
        "--sampler",
        "torch-distributed",
        "--seed",
        "17",
        "--world-size",
        "2",
        "--rank",
        "1",
    ];
    single_node(
        "train_distributed.py",
        &sampler,
        &["--seed", "17", "--world-size", "2", "--rank", "1"],
        401,
    );
}

#[test]
fn torch_shuffled_loader_through_gluster() {
    // The loader's own generator; files decoded as images, as torchvision's loader would.
    let sampler = ["--sampler", "torch-random", "--seed", "29"];
    single_node(
        "train_random.py",
        &sampler,
        &["--seed", "29", "--decode"],
        300,
    );
}

#[test]
fn chainer_style_numpy_loop_through_gluster() {
    let sampler = ["--sampler", "numpy-legacy", "--seed", "4242"];
    single_node("train_chainer_style.py", &sampler, &["--seed", "4242"], 400);
}

/// The `user.stagefs.state` of every dataset file as the mount reports it: the cached set.
fn cached_files(mount: &TestMount, data: &Dataset) -> BTreeSet<String> {
    data.files
        .keys()
        .filter(|rel| {
            lgetxattr(&mount.mnt.join(rel), "user.stagefs.state").as_deref()
                == Some(b"cached".as_slice())
        })
        .cloned()
        .collect()
}

/// After a node's epoch 0: the cached set and the counters, taken when they agree (the stager
/// may still be copying files of the next epochs; it stops at the end of epoch 2).
fn settled(mount: &TestMount, data: &Dataset) -> (BTreeSet<String>, Value) {
    for _ in 0..300 {
        let before = mount.stats();
        let cached = cached_files(mount, data);
        let after = mount.stats();
        let same = |k: &str| before[k] == after[k];
        if same("staged_files")
            && same("source_bytes")
            && after["staged_files"] == cached.len() as u64
        {
            return (cached, after);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("the cache never matched its counters: {}", mount.stats());
}

#[test]
fn four_nodes_each_stage_their_share_from_gluster() {
    const W: u32 = 4;
    const SEED: &str = "3";
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let volume = Volume::up(work.path(), 4);
    // 602 = 4 × 150 + 2: DistributedSampler pads the last ranks with two repeated samples.
    let data = Dataset::make(&volume.mnt.join("train"), 602, 10);
    let ranks: Vec<String> = (0..W).map(|r| r.to_string()).collect();
    let sampler = |r: usize| {
        [
            "--sampler",
            "torch-distributed",
            "--seed",
            SEED,
            "--world-size",
            "4",
            "--rank",
            &ranks[r],
        ]
    };
    let mounts: Vec<TestMount> = (0..W as usize)
        .map(|r| {
            TestMount::new(
                &data.root,
                &work.path().join(format!("node{r}")),
                &sampler(r),
            )
        })
        .collect();

    // Each node's predicted share of epochs 0, 1 and 2, as file sets. The stager plans to the
    // end of the epoch after the reader's: once a node has read epoch 0, its reader stands at
    // the start of epoch 1 and the stager may be copying files of epochs 1 and 2.
    let shares: Vec<Vec<BTreeSet<String>>> = (0..W as usize)
        .map(|r| {
            let paths = predicted(&data.root, &sampler(r), 3, true);
            paths
                .chunks(paths.len() / 3)
                .map(|c| c.iter().cloned().collect())
                .collect()
        })
        .collect();

    let results = run_nodes(work.path(), &data, &mounts, SEED);
    let mut epoch0_gluster_bytes = 0;
    for (r, ((direct, direct_order, seen), (cached, stats))) in results.iter().enumerate() {
        let what = format!("rank {r} of {W}");
        let predicted = predicted(&data.root, &sampler(r), EPOCHS, false);
        check_run(
            &what,
            direct,
            direct_order,
            seen,
            &predicted,
            &[0.95, 0.999],
            0,
        );
        let share0 = &shares[r][0];
        // The node staged its epoch-0 share and, ahead, only files of its next shares: nothing
        // of the other ranks' data, and each file read from GlusterFS once.
        assert!(
            share0.is_subset(cached),
            "{what}: epoch-0 share not all staged"
        );
        let foreign: Vec<_> = cached
            .iter()
            .filter(|f| !shares[r].iter().any(|share| share.contains(*f)))
            .collect();
        assert!(
            foreign.is_empty(),
            "{what}: staged files outside its shares: {foreign:?}"
        );
        assert_eq!(stats["evictions"], 0, "{what}");
        assert_eq!(
            stats["source_bytes"],
            data.bytes(cached),
            "{what}: bytes read from GlusterFS vs staged files"
        );
        epoch0_gluster_bytes += data.bytes(share0);
        eprintln!(
            "{what}: epoch-0 share {} files / {} bytes; staged by the end of epoch 0: {} files, {} bytes from GlusterFS",
            share0.len(),
            data.bytes(share0),
            cached.len(),
            stats["source_bytes"]
        );
    }
    assert_epoch0_read_once(&data, &shares, epoch0_gluster_bytes);
    for m in mounts {
        m.unmount();
    }
    drop(volume);
}

/// What each node's job (rank r of 4) saw reading directly and through its mount, and the
/// node's cache and statistics once its epoch 0 settled.
type NodeRun = (
    (Vec<Value>, Vec<String>, Observed),
    (BTreeSet<String>, Value),
);

/// Runs the training job of each rank of a world of 4 (`seed`) against its mount (rank r's is
/// `mounts[r]`), all at once.
fn run_nodes(work: &Path, data: &Dataset, mounts: &[TestMount], seed: &str) -> Vec<NodeRun> {
    let ranks: Vec<String> = (0..mounts.len()).map(|r| r.to_string()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..mounts.len())
            .map(|r| {
                let (mount, ranks) = (&mounts[r], &ranks);
                s.spawn(move || {
                    let args = ["--seed", seed, "--world-size", "4", "--rank", &ranks[r]];
                    let launch = Launch::new("train_distributed.py", &args);
                    let mut after_epoch0 = None;
                    let run = run_both(
                        work,
                        &format!("rank{r}"),
                        (&launch, &launch),
                        &data.root,
                        mount,
                        |e, m| {
                            if e == 0 {
                                after_epoch0 = Some(settled(m, data));
                            }
                        },
                    );
                    (run, after_epoch0.expect("epoch 0 was observed"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// Together the nodes read the whole dataset from GlusterFS for epoch 0 (their
/// `epoch0_gluster_bytes`, given each node's epoch `shares`), once: the only excess is the
/// files DistributedSampler repeats to pad the last ranks, when they land in another rank's
/// share than their first occurrence.
fn assert_epoch0_read_once(
    data: &Dataset,
    shares: &[Vec<BTreeSet<String>>],
    epoch0_gluster_bytes: u64,
) {
    let nodes = shares.len();
    let all: BTreeSet<String> = data.files.keys().cloned().collect();
    let union: BTreeSet<String> = shares.iter().flat_map(|s| s[0].iter().cloned()).collect();
    assert_eq!(union, all, "the epoch-0 shares cover the dataset");
    let total = data.bytes(&all);
    let mut counted: BTreeMap<&String, u32> = BTreeMap::new();
    for s in shares {
        for f in &s[0] {
            *counted.entry(f).or_default() += 1;
        }
    }
    let repeated: Vec<_> = counted
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(f, n)| (*f, *n))
        .collect();
    let padding = (nodes * all.len().div_ceil(nodes)) - all.len();
    assert!(
        repeated
            .iter()
            .map(|(_, n)| (n - 1) as usize)
            .sum::<usize>()
            <= padding,
        "{repeated:?}"
    );
    let excess: u64 = repeated
        .iter()
        .map(|(f, n)| data.files[*f] * u64::from(n - 1))
        .sum();
    assert_eq!(
        epoch0_gluster_bytes,
        total + excess,
        "epoch-0 bytes from GlusterFS over the four nodes"
    );
    eprintln!(
        "four nodes, epoch 0: {epoch0_gluster_bytes} bytes from GlusterFS for a {total}-byte dataset ({excess} bytes of padding repeats)"
    );
}

/// Four nodes of a real PyTorch job with peers, no flag saying its order: ranks in a gloo
/// group, a DistributedSampler and the feed hook, each rank on its own node's mount of the
/// GlusterFS volume. Each mount learns its share from the hook, and the whole of each epoch
/// (which the mounts ask the hook for) places the files on the nodes: from epoch 1 on, the
/// nodes stage what they read from each other, and every rank reads what it reads without
/// the mount.
#[test]
fn four_fed_nodes_of_a_torch_job_stage_from_each_other() {
    const W: usize = 4;
    const SEED: &str = "7";
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let volume = Volume::up(work.path(), 2);
    // 600 = 4 × 150: no padding, each file read once an epoch.
    let data = Dataset::make(&volume.mnt.join("train"), 600, 10);
    let total = data.bytes(data.files.keys());
    let peers = (0..W)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect::<Vec<_>>()
        .join(",");
    let secret = work.path().join("secret");
    std::fs::write(&secret, "the job's secret, 0123456789abcdef").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let cache_size = (2 * total / W as u64).to_string();
    let node_args: Vec<Vec<String>> = (0..W)
        .map(|i| {
            let args = [
                "--sampler",
                "feed",
                "--peers",
                &peers,
                "--node",
                &i.to_string(),
            ];
            let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            args.extend(["--peer-secret-file".into(), secret.display().to_string()]);
            args.extend(["--cache-size".into(), cache_size.clone()]);
            args
        })
        .collect();
    let mounts: Vec<TestMount> = (0..W)
        .map(|i| {
            let args: Vec<&str> = node_args[i].iter().map(String::as_str).collect();
            TestMount::new(&data.root, &work.path().join(format!("node{i}")), &args)
        })
        .collect();
    let sync = format!("tcp://127.0.0.1:{}", free_port());
    let ranks: Vec<String> = (0..W).map(|r| r.to_string()).collect();
    let runs: Vec<(Vec<String>, Vec<Value>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..W)
            .map(|r| {
                let (mount, rank, sync) = (&mounts[r], &ranks[r], &sync);
                let work = work.path();
                s.spawn(move || {
                    let args = [
                        "--seed",
                        SEED,
                        "--world-size",
                        "4",
                        "--rank",
                        rank,
                        "--sync-url",
                        sync,
                    ];
                    let launch = Launch {
                        epochs: FEED_EPOCHS,
                        env: feed_env(),
                        ..Launch::new("train_distributed.py", &args)
                    };
                    let mut stats = vec![mount.stats()];
                    let name = format!("peers-rank{r}");
                    let (_, order) = Job::spawn(work, &name, &launch, &mount.mnt)
                        .finish(|_| stats.push(mount.stats()));
                    (order, stats)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let counted = |key: &str, epoch: usize| -> u64 {
        (runs.iter())
            .map(|(_, stats)| stats[epoch][key].as_u64().unwrap())
            .sum()
    };
    for (r, (order, stats)) in runs.iter().enumerate() {
        let sampler = [
            "--sampler",
            "torch-distributed",
            "--seed",
            SEED,
            "--world-size",
            "4",
            "--rank",
            &ranks[r],
        ];
        let want = predicted(&data.root, &sampler, FEED_EPOCHS, false);
        same_order(&format!("rank {r} through its node's mount"), order, &want);
        let last = stats.last().unwrap();
        assert_eq!(
            last["prediction"], "announced by the job",
            "rank {r}: {last}"
        );
        let log = mounts[r].log_text();
        assert!(
            log.contains(&format!("epoch {FEED_EPOCHS} announced whole (4 ranks)")),
            "node {r}: the hook did not announce the epochs whole:\n{log}"
        );
        assert!(
            !log.contains("stages from the source only"),
            "node {r}:\n{log}"
        );
    }
    let stderr = |r: usize| {
        std::fs::read_to_string(work.path().join(format!("peers-rank{r}.stderr")))
            .unwrap_or_default()
    };
    for r in 0..W {
        assert!(
            !stderr(r).contains("stagefs-feed: warning"),
            "rank {r}:\n{}",
            stderr(r)
        );
    }
    let read_later = (FEED_EPOCHS as u64 - 1) * total;
    let source_later = counted("source_bytes", FEED_EPOCHS) - counted("source_bytes", 1);
    let source_all = counted("source_bytes", FEED_EPOCHS);
    let peer_all = counted("peer_bytes", FEED_EPOCHS);
    eprintln!(
        "four fed nodes: {total} B dataset; SOURCE {source_all} B in all, {source_later} B in epochs 1-{} ({:.2}% of their reads); from peers {peer_all} B; hits {} misses {}",
        FEED_EPOCHS - 1,
        100.0 * source_later as f64 / read_later as f64,
        counted("hits", FEED_EPOCHS),
        counted("misses", FEED_EPOCHS),
    );
    assert!(
        source_later * 20 <= read_later,
        "epochs 1-{}: {source_later} of {read_later} bytes from SOURCE (over 5%)",
        FEED_EPOCHS - 1
    );
    assert!(
        source_all <= total + read_later / 20,
        "{source_all} bytes from SOURCE in all for a dataset of {total}"
    );
    assert!(peer_all > 0, "nothing came from a peer");
    for m in mounts {
        m.unmount();
    }
    drop(volume);
}

/// Files in the feed tests' datasets (small ones: what counts is their number) and the
/// cache's share of their bytes, 30%: only staging in the announced order reaches the hit
/// ratios checked. An epoch's first batches race its announcement (about a dozen opens), so
/// epochs must be long enough for the 0.99 of the later ones to mean something.
const FEED_FILES: u32 = 2000;
const FEED_FILE_KB: (u32, u32) = (4, 40);
const FEED_CACHE_PERCENT: u64 = 30;
const FEED_EPOCHS: usize = 3;

/// A mount with `sampler` (flags) and a 30% cache over a fresh dataset on GlusterFS.
fn small_cache_mount(work: &Path, sampler: &[&str]) -> (Volume, Dataset, TestMount) {
    let volume = Volume::up(work, 2);
    let data = Dataset::make_sized(&volume.mnt.join("train"), FEED_FILES, 10, FEED_FILE_KB);
    let cache_size = (data.bytes(data.files.keys()) * FEED_CACHE_PERCENT / 100).to_string();
    let mut args = vec!["--cache-size", &cache_size];
    args.extend_from_slice(sampler);
    let mount = TestMount::new(&data.root, &work.join("node"), &args);
    (volume, data, mount)
}

/// An unmodified training stack (`tests/e2e/train_stacks.py --stack NAME`) no flag can
/// predict, run with the feed hook through a 30% cache and without it directly: the same
/// indices in the same order, with the files staged before they are opened.
fn fed_stack(stack: &str, extra: &[&str]) {
    fed_stack_through(&["--sampler", "feed"], stack, extra);
}

/// [`fed_stack`] through a mount with `sampler` (its flags).
fn fed_stack_through(sampler: &[&str], stack: &str, extra: &[&str]) {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let (volume, data, mount) = small_cache_mount(work.path(), sampler);
    let mut args = vec!["--stack", stack, "--seed", "5"];
    args.extend_from_slice(extra);
    let direct = Launch {
        epochs: FEED_EPOCHS,
        ..Launch::new("train_stacks.py", &args)
    };
    let through = Launch {
        epochs: FEED_EPOCHS,
        env: feed_env(),
        ..Launch::new("train_stacks.py", &args)
    };
    let (lines, order, seen) = run_both(
        work.path(),
        stack,
        (&direct, &through),
        &data.root,
        &mount,
        |_, _| {},
    );
    // The prediction is the job's own: what it read directly, without the hook.
    // Later epochs: ≥ 0.97, not 0.99: an epoch's first batches race its announcement, and on
    // this 2-core machine that race cost up to 26 of 2,000 opens (0 mispredictions).
    check_run(stack, &lines, &order, &seen, &order, &[0.95, 0.97], 0);
    let stderr = std::fs::read_to_string(work.path().join(format!("{stack}-stagefs.stderr")));
    assert!(
        !stderr.unwrap_or_default().contains("stagefs-feed: warning"),
        "{stack}: the hook warned"
    );
    let last = seen.stats.last().unwrap();
    assert_eq!(last["sampler"], "feed");
    assert_eq!(last["prediction"], "announced by the job");
    mount.unmount();
    drop(volume);
}

#[test]
fn fed_global_generator_after_model_init() {
    fed_stack("global", &[]);
}

/// A mount with no prediction flags follows what the job announces: the hook takes precedence
/// over detection (and finds what no search can: a global generator drawn from by the model).
#[test]
fn an_announced_order_takes_precedence_over_auto() {
    fed_stack_through(&[], "global", &[]);
}

#[test]
fn fed_loader_generator() {
    fed_stack("loader", &[]);
}

#[test]
fn fed_loader_generator_with_persistent_workers() {
    fed_stack("loader", &["--persistent"]);
}

#[test]
fn fed_random_sampler_with_its_own_generator() {
    fed_stack("sampler", &[]);
}

#[test]
fn fed_weighted_random_sampler() {
    fed_stack("weighted", &[]);
}

#[test]
fn fed_user_defined_class_balanced_sampler() {
    fed_stack("balanced", &[]);
}

#[test]
fn fed_numpy_in_place_shuffle() {
    fed_stack("numpy", &[]);
}

/// A port for one torch.distributed rendezvous, distinct per test process and call.
fn free_port() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port().to_string()
}

/// Runs the `ddp` stack of train_stacks.py with `args` as two ranks on one node (see
/// [`two_ranks_of`]).
fn two_ranks(
    work: &tempfile::TempDir,
    data: &Dataset,
    mount: &TestMount,
    args: &[&str],
    env: &[(String, String)],
) -> (Value, Value, Vec<Value>) {
    let mut args_of_job = vec!["--stack", "ddp"];
    args_of_job.extend_from_slice(args);
    two_ranks_of(
        "train_stacks.py",
        &args_of_job,
        work,
        &data.root,
        mount,
        env,
    )
}

/// Runs `script` with `args_of_job` as two ranks on one node (gloo, with the environment
/// torchrun gives them) directly on `source`, then through `mount` with `env` on top; checks
/// each mounted rank read what its direct twin read.
/// Returns the mount's statistics before the job and after, and at each of rank 0's epoch ends.
fn two_ranks_of(
    script: &str,
    args_of_job: &[&str],
    work: &tempfile::TempDir,
    source: &Path,
    mount: &TestMount,
    env: &[(String, String)],
) -> (Value, Value, Vec<Value>) {
    let launch = |rank: usize, port: &str, mounted: bool| {
        let mut vars = vec![
            ("RANK".to_string(), rank.to_string()),
            ("LOCAL_RANK".to_string(), rank.to_string()),
            ("WORLD_SIZE".to_string(), "2".to_string()),
            ("LOCAL_WORLD_SIZE".to_string(), "2".to_string()),
            ("MASTER_ADDR".to_string(), "127.0.0.1".to_string()),
            ("MASTER_PORT".to_string(), port.to_string()),
        ];
        if mounted {
            vars.extend(env.iter().cloned());
        }
        Launch {
            epochs: FEED_EPOCHS,
            env: vars,
            ..Launch::new(script, args_of_job)
        }
    };
    // The direct pair first, to its end: the mounted pair measures how soon staging keeps up
    // with two ranks, not with four on two cores.
    let run_pair = |mounted: bool, epoch_ends: &std::sync::Mutex<Vec<Value>>| {
        let port = free_port();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let launch = launch(rank, &port, mounted);
                    let (name, root) = if mounted {
                        (format!("ddp-stagefs-{rank}"), mount.mnt.as_path())
                    } else {
                        (format!("ddp-direct-{rank}"), source)
                    };
                    s.spawn(move || {
                        Job::spawn(work.path(), &name, &launch, root).finish(|_| {
                            if mounted && rank == 0 {
                                epoch_ends.lock().unwrap().push(mount.stats());
                            }
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    };
    let epoch_ends = std::sync::Mutex::new(Vec::new());
    let direct = run_pair(false, &epoch_ends);
    let before = mount.stats();
    let through = run_pair(true, &epoch_ends);
    let runs: Vec<(Vec<Value>, Vec<String>)> = direct
        .into_iter()
        .zip(through)
        .flat_map(|(d, t)| [d, t])
        .collect();
    let after = mount.stats();
    for rank in 0..2 {
        let ((dlines, dorder), (lines, order)) = (&runs[2 * rank], &runs[2 * rank + 1]);
        same_order(
            &format!("rank {rank}: through the mount vs direct"),
            order,
            dorder,
        );
        for (d, m) in dlines.iter().zip(lines) {
            assert_eq!(m["checksum"], d["checksum"], "rank {rank}: epoch checksum");
        }
    }
    (before, after, epoch_ends.into_inner().unwrap())
}

#[test]
fn fed_two_ranks_on_one_node_share_one_mount() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let (volume, data, mount) = small_cache_mount(work.path(), &["--sampler", "feed"]);
    let (before, after, _) = two_ranks(&work, &data, &mount, &["--seed", "5"], &feed_env());
    let delta = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    let (hits, misses) = (delta("hits"), delta("misses"));
    let ratio = hits as f64 / (hits + misses) as f64;
    // Every open is predicted (below); the misses are copies GlusterFS did not finish in
    // time. Alone that is ≥ 0.95 over three epochs, but beside another e2e test on two cores
    // one CI run measured 0.909 (15 s of stalls, 0 mispredictions): ≥ 0.85 here.
    assert!(
        ratio >= 0.85,
        "hit ratio {ratio:.4} over both ranks; {after}"
    );
    assert_eq!(after["mispredictions"], 0, "{after}");
    let log = mount.log_text();
    for rank in 0..2 {
        assert!(
            log.contains(&format!("rank {rank} announced epoch {}", FEED_EPOCHS - 1)),
            "rank {rank} announced every epoch:\n{log}"
        );
    }
    eprintln!("two ranks through one fed mount: hit ratio {ratio:.4}");
    mount.unmount();
    drop(volume);
}

/// The hook never breaks a job: announcements refused cost nothing (not even a warning: the
/// mount predicts its order itself), the daemon gone mid-run one warning line and nothing
/// else. The job reads SOURCE itself here (a dataset that hides its
/// paths, announcing indices to STAGEFS_FEED_MOUNT), so it can outlive the mount.
#[test]
fn the_hook_survives_refusals_and_a_dead_daemon() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("train");
    image_folder(&source, 120, 4, 2_000, 8_000);
    let args = ["--stack", "loader", "--seed", "3", "--opaque"];
    let plain = Launch {
        epochs: 3,
        ..Launch::new("train_stacks.py", &args)
    };
    let (want_lines, want_order) = Job::spawn(work.path(), "plain", &plain, &source).finish(|_| {});
    for (case, sampler) in [
        ("refused", "sequential"),
        ("killed", "feed"),
        ("unmounted", "feed"),
    ] {
        let mount = TestMount::new(&source, &work.path().join(case), &["--sampler", sampler]);
        let mut env = feed_env();
        env.push((
            "STAGEFS_FEED_MOUNT".to_string(),
            mount.mnt.to_str().unwrap().to_string(),
        ));
        let hooked = Launch {
            env,
            ..Launch {
                epochs: 3,
                ..Launch::new("train_stacks.py", &args)
            }
        };
        let pid = mount.daemon_pid();
        let job = Job::spawn(work.path(), case, &hooked, &source);
        let stderr = job.stderr.clone();
        let (lines, order) = job.finish(|line| {
            if line["epoch"] != 0 {
                return;
            }
            match case {
                // SAFETY: plain kill(2) of the mount's daemon.
                "killed" => unsafe {
                    libc::kill(pid, libc::SIGKILL);
                },
                "unmounted" => {
                    let out = stagefs(&["unmount", mount.mnt.to_str().unwrap()]);
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                _ => {}
            }
        });
        same_order(case, &order, &want_order);
        for (got, want) in lines.iter().zip(&want_lines) {
            assert_eq!(got["checksum"], want["checksum"], "{case}");
        }
        let stderr = std::fs::read_to_string(stderr).unwrap();
        let warnings = stderr.matches("stagefs-feed: warning").count();
        // A mount that predicts its order itself has nothing for the hook to announce: a
        // hook on by default stays quiet there.
        let expected = if case == "refused" { 0 } else { 1 };
        assert_eq!(warnings, expected, "{case}: warning lines:\n{stderr}");
        match case {
            "refused" => mount.unmount(),
            "killed" => {
                assert!(wait_for(Duration::from_secs(10), || !process_alive(pid)));
                mount.detach_dead();
            }
            _ => assert!(!is_mounted(&mount.mnt)),
        }
    }
}

/// The hook's look-ahead, checked against the real torch without a mount
/// (`tests/e2e/hook_lookahead.py`): the next epoch announced ahead is the one then drawn, for
/// loader and sampler generators and `set_epoch` samplers, and the job draws the same.
#[test]
fn the_hook_announces_next_epochs_exactly_and_draws_nothing_extra() {
    hook_script_passes("hook_lookahead.py", &[]);
}

/// Runs `tests/e2e/SCRIPT ARGS` with the checkout's hook on PYTHONPATH (a hang fails it after
/// 3 minutes) and asserts it succeeds.
fn hook_script_passes(script: &str, args: &[&Path]) {
    let out = Command::new("timeout")
        .arg("180")
        .arg(PYTHON)
        .arg(e2e_dir().join(script))
        .args(args)
        .env(
            "PYTHONPATH",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("python"),
        )
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("run /usr/bin/python3");
    assert!(
        out.status.success(),
        "{script}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The hook against hostile servers (`tests/e2e/hook_channel.py`): a reply trickled a byte at
/// a time, a reply of hundreds of megabytes, a look-alike mount carrying a control address,
/// and another user's socket for a real mount each end in one refusal, quickly and in little
/// memory; the real daemon is still talked to. Before, the hook waited for ever on the
/// trickle, buffered the whole reply, and connected to any socket the attribute named.
#[test]
fn the_hook_talks_only_to_a_verified_daemon_within_bounds() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("train");
    image_folder(&source, 8, 2, 100, 200);
    let mount = TestMount::new(&source, work.path(), &["--sampler", "feed"]);
    hook_script_passes("hook_channel.py", &[&mount.mnt, work.path()]);
    mount.unmount();
}

/// Hit ratios `--sampler auto` must reach with a 30% cache: epoch 0 pays for the opens before
/// the order is found, the later ones only for the races at their start.
const AUTO_HIT_RATIOS: [f64; 2] = [0.9, 0.99];

/// The same for a numpy order, whose candidates cost a whole permutation each: finding seed
/// 4242 took 0.86 s beside another test on two busy cores (0.1 s alone), and the job read
/// about 250 files on demand meanwhile (epoch 0 measured 0.876 then, 0.9+ alone).
const NUMPY_AUTO_HIT_RATIOS: [f64; 2] = [0.8, 0.99];

/// Where `--sampler auto` found an order in a later epoch than the first (a variant the first
/// epoch cannot tell apart): that epoch pays for the opens before the switch.
const REFINED_HIT_RATIOS: [f64; 3] = [0.9, 0.95, 0.99];

/// An unmodified one-process job (a script of tests/e2e with `args`) over a mount with no
/// prediction flags: `--sampler auto` finds `expected` from its opens, which `stagefs order`
/// confirms is the order the job read, and stages by it through a 30% cache. `found_in` is the
/// epoch it is found in (a variant found after the first differs from it only later).
fn detected(script: &str, args: &[&str], expected: &str, found_in: usize, min: &[f64]) {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let (volume, data, mount) = small_cache_mount(work.path(), &[]);
    let launch = Launch {
        epochs: FEED_EPOCHS,
        ..Launch::new(script, args)
    };
    let (lines, order, seen) = run_direct_first(work.path(), script, &launch, &data.root, &mount);
    let flags: Vec<&str> = expected.split_whitespace().collect();
    // The order as found runs from epoch 0; the epochs before `found_in` were read before it.
    let found = predicted(&data.root, &flags, FEED_EPOCHS, false);
    let per_epoch = order.len() / FEED_EPOCHS;
    let (before, after) = (
        &order[..found_in * per_epoch],
        &found[found_in * per_epoch..],
    );
    let predicted_order: Vec<String> = before.iter().chain(after).cloned().collect();
    check_run(
        script,
        &lines,
        &order,
        &seen,
        &predicted_order,
        min,
        found_in + 1,
    );
    let last = seen.stats.last().unwrap();
    assert_eq!(
        last["prediction"],
        format!("detected: {expected}"),
        "{last}"
    );
    assert_eq!(last["mode"], "predicting", "{last}");
    mount.unmount();
    drop(volume);
}

#[test]
fn auto_finds_a_loader_generator() {
    let args = ["--stack", "loader", "--seed", "5"];
    let flags = "--sampler torch-random --seed 5 --generator loader --epoch 0";
    detected("train_stacks.py", &args, flags, 0, &AUTO_HIT_RATIOS);
}

#[test]
fn auto_finds_a_loader_generator_with_persistent_workers() {
    let args = ["--stack", "loader", "--seed", "5", "--persistent"];
    let flags = "--sampler torch-random --seed 5 --generator loader --persistent-workers --epoch 0";
    detected("train_stacks.py", &args, flags, 1, &REFINED_HIT_RATIOS);
}

#[test]
fn auto_finds_a_random_sampler_with_its_own_generator() {
    let args = ["--stack", "sampler", "--seed", "5"];
    let flags = "--sampler torch-random --seed 5 --generator sampler --epoch 0";
    detected("train_stacks.py", &args, flags, 0, &AUTO_HIT_RATIOS);
}

#[test]
fn auto_finds_a_numpy_permutation_per_epoch() {
    let args = ["--seed", "4242"];
    let flags = "--sampler numpy-legacy --seed 4242 --epoch 0";
    detected(
        "train_chainer_style.py",
        &args,
        flags,
        0,
        &NUMPY_AUTO_HIT_RATIOS,
    );
}

#[test]
fn auto_finds_the_numpy_in_place_shuffle() {
    let args = ["--stack", "numpy", "--seed", "5"];
    let flags = "--sampler numpy-inplace --seed 5 --epoch 0";
    detected("train_stacks.py", &args, flags, 1, &REFINED_HIT_RATIOS);
}

/// Two DDP ranks on one node (`ddp` stack with `args`) over a mount with no prediction flags:
/// `--sampler auto` finds `expected`, and the node's hit ratio per epoch (at rank 0's epoch
/// ends) reaches `min`.
fn detected_ranks(args: &[&str], expected: &str, min: &[f64]) {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let (volume, data, mount) = small_cache_mount(work.path(), &[]);
    // Each rank computes 100 ms a batch: the node then reads as fast as the one-process
    // tests' job (two ranks at 50 ms read twice as fast), and epoch 0 measures how soon
    // staging catches up after detection, not GlusterFS's throughput on two busy cores.
    let mut args = args.to_vec();
    args.extend(["--compute-ms", "100"]);
    let (before, after, epoch_ends) = two_ranks(&work, &data, &mount, &args, &[]);
    let mut at = vec![before];
    at.extend(epoch_ends);
    let ratios: Vec<f64> = at
        .windows(2)
        .map(|w| {
            let delta = |k: &str| w[1][k].as_u64().unwrap() - w[0][k].as_u64().unwrap();
            delta("hits") as f64 / (delta("hits") + delta("misses")).max(1) as f64
        })
        .collect();
    for (e, ratio) in ratios.iter().enumerate() {
        let want = min[e.min(min.len() - 1)];
        assert!(
            ratio >= &want,
            "epoch {e}: hit ratio {ratio:.4} < {want}; {after}"
        );
    }
    assert_eq!(
        after["prediction"],
        format!("detected: {expected}"),
        "{after}"
    );
    assert_eq!(after["mode"], "predicting", "{after}");
    let last_epoch = &at[at.len() - 2];
    assert_eq!(
        after["mispredictions"], last_epoch["mispredictions"],
        "mispredictions in the last epoch; {after}"
    );
    eprintln!("{expected}: hit ratios per epoch {ratios:.4?}");
    mount.unmount();
    drop(volume);
}

#[test]
fn auto_finds_a_distributed_sampler_with_its_default_seed() {
    let flags = "--sampler torch-distributed --seed 0 --world-size 2 --ranks 0-1 --epoch 0";
    detected_ranks(&["--seed", "0"], flags, &AUTO_HIT_RATIOS);
}

#[test]
fn auto_finds_a_distributed_sampler_with_seed_42() {
    let flags = "--sampler torch-distributed --seed 42 --world-size 2 --ranks 0-1 --epoch 0";
    detected_ranks(&["--seed", "42"], flags, &AUTO_HIT_RATIOS);
}

#[test]
fn auto_finds_a_resumed_job_at_its_epoch() {
    let flags = "--sampler torch-distributed --seed 0 --world-size 2 --ranks 0-1 --epoch 3";
    detected_ranks(
        &["--seed", "0", "--start-epoch", "3"],
        flags,
        &AUTO_HIT_RATIOS,
    );
}

#[test]
fn auto_finds_a_job_that_never_calls_set_epoch() {
    let flags = "--sampler torch-distributed --seed 0 --world-size 2 --ranks 0-1 --no-set-epoch";
    detected_ranks(
        &["--seed", "0", "--no-set-epoch"],
        flags,
        &REFINED_HIT_RATIOS,
    );
}

/// Two DDP ranks started by `torch.multiprocessing.spawn`, as DDP tutorials and Lightning's
/// `ddp_spawn` do: nothing in their environment says which rank they are, only the process
/// tree does. `--sampler auto` finds the DistributedSampler of both, each rank reads what
/// `stagefs order` says for it, and the 30% cache is mostly hits (without the prediction,
/// epochs after the first would hit about 30%). The job steps nothing (its ranks share stdin),
/// so the hit ratio is over the whole run.
#[test]
fn auto_finds_ranks_started_by_torch_multiprocessing_spawn() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let (volume, data, mount) = small_cache_mount(work.path(), &[]);
    let order_out = work.path().join("spawn.order");
    let stderr = work.path().join("spawn.stderr");
    let epochs = FEED_EPOCHS.to_string();
    // As in detected_ranks: 100 ms a batch per rank.
    let status = Command::new("timeout")
        .arg(JOB_DEADLINE.as_secs().to_string())
        .arg(PYTHON)
        .arg(e2e_dir().join("train_stacks.py"))
        .arg(&mount.mnt)
        .args([
            "--stack", "ddp", "--spawn", "2", "--seed", "0", "--epochs", &epochs,
        ])
        .args(["--batch-size", BATCH, "--compute-ms", "100", "--order-out"])
        .arg(&order_out)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", free_port())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .status()
        .expect("run /usr/bin/python3");
    assert!(
        status.success(),
        "the spawned job failed ({status}):\n{}",
        std::fs::read_to_string(&stderr).unwrap_or_default()
    );
    let stats = mount.stats();
    let flags = "--sampler torch-distributed --seed 0 --world-size 2 --ranks 0-1 --epoch 0";
    assert_eq!(stats["prediction"], format!("detected: {flags}"), "{stats}");
    assert_eq!(stats["mode"], "predicting", "{stats}");
    for rank in ["0", "1"] {
        let sampler = [
            "--sampler",
            "torch-distributed",
            "--world-size",
            "2",
            "--rank",
            rank,
        ];
        let read: Vec<String> = std::fs::read_to_string(format!("{}.{rank}", order_out.display()))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        same_order(
            &format!("spawned rank {rank} vs `stagefs order`"),
            &read,
            &predicted(&data.root, &sampler, FEED_EPOCHS, false),
        );
    }
    let (hits, misses) = (
        stats["hits"].as_u64().unwrap(),
        stats["misses"].as_u64().unwrap(),
    );
    assert_eq!(
        hits + misses,
        u64::from(FEED_FILES) * FEED_EPOCHS as u64,
        "{stats}"
    );
    let ratio = hits as f64 / (hits + misses) as f64;
    assert!(ratio >= 0.8, "hit ratio {ratio:.4} over the run; {stats}");
    eprintln!("torch.multiprocessing.spawn: hit ratio {ratio:.4} over {FEED_EPOCHS} epochs");
    mount.unmount();
    drop(volume);
}

/// A wrong configuration on a dataset shorter than `--window` (a chance match anywhere in the
/// window used to count as predicted): lost within the first epoch, with a hint naming the
/// causes and `--sampler auto`, and from then on nothing staged that the job does not read.
fn wrong_configuration(sampler: &[&str], hint_names: &str) {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let (volume, data, mount) = small_cache_mount(work.path(), sampler);
    let args = ["--stack", "loader", "--seed", "5"];
    let launch = Launch {
        epochs: FEED_EPOCHS,
        ..Launch::new("train_stacks.py", &args)
    };
    let (_, _, seen) = run_both(
        work.path(),
        "wrong",
        (&launch, &launch),
        &data.root,
        &mount,
        |_, _| {},
    );
    let after_first = &seen.stats[1];
    assert_eq!(after_first["mode"], "lost", "{after_first}");
    let hint = after_first["hint"].as_str().unwrap();
    assert!(hint.contains(hint_names), "{hint}");
    assert!(hint.contains("--sampler auto"), "{hint}");
    assert!(mount.log_text().contains(hint), "the hint is in the log");
    for e in 1..FEED_EPOCHS {
        let (staged, misses) = (seen.delta(e, "staged_files"), seen.delta(e, "misses"));
        assert!(
            staged <= misses,
            "epoch {e}: {staged} files staged for {misses} misses; {}",
            seen.stats[e + 1]
        );
        assert_eq!(
            seen.delta(e, "mispredictions"),
            seen.delta(e, "hits") + misses,
            "epoch {e}: every open counts as mispredicted while lost"
        );
    }
    mount.unmount();
    drop(volume);
}

#[test]
fn a_wrong_seed_is_lost_within_the_first_epoch() {
    wrong_configuration(&["--sampler", "torch-random", "--seed", "6"], "--generator");
}

#[test]
fn a_wrong_sampler_is_lost_within_the_first_epoch() {
    wrong_configuration(
        &["--sampler", "numpy-legacy", "--seed", "5"],
        "numpy-inplace",
    );
}

/// A dataset root as the programs users run expect it (the PyTorch ImageNet example, timm,
/// Lightning): `train/` and `val/`, each an ImageFolder, on local disk.
struct SplitRoot {
    root: PathBuf,
    train: Dataset,
    val: Dataset,
}

/// Training and validation set sizes: validation a tenth, as usual.
const SPLIT_TRAIN_FILES: u32 = 2000;
const SPLIT_VAL_FILES: u32 = 200;

impl SplitRoot {
    fn make(root: &Path) -> SplitRoot {
        SplitRoot {
            root: root.to_path_buf(),
            train: Dataset::make_sized(&root.join("train"), SPLIT_TRAIN_FILES, 10, FEED_FILE_KB),
            val: Dataset::make_sized(&root.join("val"), SPLIT_VAL_FILES, 10, FEED_FILE_KB),
        }
    }

    /// A mount of the whole root with `flags` and a cache of 30% of it.
    fn mount(&self, work: &Path, flags: &[&str]) -> TestMount {
        let bytes =
            self.train.bytes(self.train.files.keys()) + self.val.bytes(self.val.files.keys());
        let cache_size = (bytes * FEED_CACHE_PERCENT / 100).to_string();
        let mut args = vec!["--cache-size", &cache_size];
        args.extend_from_slice(flags);
        TestMount::new(&self.root, &work.join("node"), &args)
    }
}

/// The stream named `name` in a stats snapshot: (predicted, opens, hits).
fn stream(stats: &Value, name: &str) -> (bool, u64, u64) {
    let found = stats["streams"].as_array().and_then(|streams| {
        streams.iter().find(|s| s["name"] == name).map(|s| {
            (
                s["predicted"].as_bool().unwrap(),
                s["opens"].as_u64().unwrap(),
                s["hits"].as_u64().unwrap(),
            )
        })
    });
    found.unwrap_or((false, 0, 0))
}

/// The training stream's hit ratio per epoch, from snapshots taken before the job and at each
/// epoch's end.
fn train_hit_ratios(at: &[Value]) -> Vec<f64> {
    at.windows(2)
        .map(|w| {
            let ((_, o0, h0), (_, o1, h1)) = (stream(&w[0], "train"), stream(&w[1], "train"));
            (h1 - h0) as f64 / (o1 - o0).max(1) as f64
        })
        .collect()
}

/// The checks of a job's training stream through a mount of a root with train/ and val/:
/// predicted with hit ratios `min` per epoch, never lost, every training open predicted from
/// epoch `exact_from` on; validation is another stream, served on demand and never judged.
fn check_split_run(what: &str, at: &[Value], min: &[f64], exact_from: usize) {
    let ratios = train_hit_ratios(at);
    for (e, ratio) in ratios.iter().enumerate() {
        let want = min[e.min(min.len() - 1)];
        assert!(
            *ratio >= want,
            "{what} epoch {e}: training hit ratio {ratio:.4} < {want}; {}",
            at[e + 1]
        );
    }
    for (e, s) in at.iter().enumerate().skip(1 + exact_from) {
        assert_eq!(
            s["mode"],
            "predicting",
            "{what} at epoch {} end: {s}",
            e - 1
        );
    }
    let last = at.last().unwrap();
    let (predicted, ..) = stream(last, "train");
    assert!(predicted, "{what}: train is the predicted stream: {last}");
    let (val_predicted, val_opens, _) = stream(last, "val");
    assert!(
        !val_predicted && val_opens > 0,
        "{what}: validation read as a stream of its own: {last}"
    );
    for q in last["prediction_quality_by_epoch"].as_array().unwrap() {
        let (opens, predicted) = (
            q["opens"].as_u64().unwrap(),
            q["predicted"].as_u64().unwrap(),
        );
        if q["epoch"].as_u64().unwrap() as usize >= exact_from {
            assert!(
                predicted as f64 >= 0.99 * opens as f64,
                "{what}: training prediction quality {q}; {last}"
            );
        }
    }
    eprintln!("{what}: training hit ratio per epoch {ratios:.4?}");
}

/// One process over a root with train/ and val/ (`train_val.py` with `args`), run directly and
/// through `mount` with `env`: the same training order and bytes; returns the mount's
/// snapshots before the job and at each epoch's end.
fn split_job(
    work: &Path,
    split: &SplitRoot,
    mount: &TestMount,
    args: &[&str],
    env: Vec<(String, String)>,
) -> Vec<Value> {
    let launch = Launch {
        epochs: FEED_EPOCHS,
        ..Launch::new("train_val.py", args)
    };
    let hooked = Launch {
        env,
        epochs: FEED_EPOCHS,
        ..Launch::new("train_val.py", args)
    };
    let (dlines, dorder) = Job::spawn(work, "split-direct", &launch, &split.root).finish(|_| {});
    let mut at = vec![mount.stats()];
    let (lines, order) =
        Job::spawn(work, "split-stagefs", &hooked, &mount.mnt).finish(|_| at.push(mount.stats()));
    same_order(
        "training order through the mount vs direct",
        &order,
        &dorder,
    );
    for (e, (d, m)) in dlines.iter().zip(&lines).enumerate() {
        assert_eq!(
            m["checksum"], d["checksum"],
            "epoch {e}: checksum through the mount"
        );
    }
    at
}

/// The hook on a mount of a root with train/ and val/, no flags: a validation sanity check
/// before training (Lightning's) and a validation pass between epochs. The mount follows the
/// training loader's stream from its first announcement (not validation's), every training
/// open is predicted and the tracker is never lost; validation is served on demand as a stream
/// of its own.
#[test]
fn the_hook_follows_training_over_a_root_with_train_and_val() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let split = SplitRoot::make(&work.path().join("src"));
    let mount = split.mount(work.path(), &[]);
    let args = ["--sampler", "global", "--sanity-check", "--seed", "5"];
    let at = split_job(work.path(), &split, &mount, &args, feed_env());
    check_split_run("hooked, train/ + val/", &at, &[0.95, 0.97], 0);
    let last = at.last().unwrap();
    assert_eq!(last["prediction"], "announced by the job", "{last}");
    assert_eq!(
        last["epoch"],
        FEED_EPOCHS as u64 - 1,
        "training epochs count from 0: {last}"
    );
    let ((_, train_opens, _), (_, val_opens, _)) = (stream(last, "train"), stream(last, "val"));
    assert_eq!(
        train_opens,
        FEED_EPOCHS as u64 * SPLIT_TRAIN_FILES as u64,
        "{last}"
    );
    // Two sanity-check batches of 16 (and what the workers prefetched), then a pass after
    // each epoch but the last's (whose pass comes after the last snapshot).
    let passes = (FEED_EPOCHS as u64 - 1) * SPLIT_VAL_FILES as u64;
    assert!(val_opens >= 32 + passes, "{last}");
    mount.unmount();
}

/// timm's ImageDataset keeps its files in `reader.samples`: the hook maps it like an
/// ImageFolder.
#[test]
fn the_hook_maps_a_dataset_that_keeps_its_files_in_a_reader() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let split = SplitRoot::make(&work.path().join("src"));
    let mount = split.mount(work.path(), &["--sampler", "feed"]);
    let args = ["--sampler", "global", "--timm-like", "--seed", "5"];
    let at = split_job(work.path(), &split, &mount, &args, feed_env());
    check_split_run("hooked timm-like dataset", &at, &[0.95, 0.97], 0);
    let stderr = std::fs::read_to_string(work.path().join("split-stagefs.stderr")).unwrap();
    assert!(!stderr.contains("stagefs-feed: warning"), "{stderr}");
    mount.unmount();
}

/// No flags, no hook, one process shuffling with torch's global generator after building a
/// model (the ImageNet example's single-process shape): no search can find that order, and
/// the mount says so, and why, by the end of the first epoch.
#[test]
fn auto_says_why_it_cannot_find_an_order_within_the_first_epoch() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let split = SplitRoot::make(&work.path().join("src"));
    let mount = split.mount(work.path(), &[]);
    let args = ["--sampler", "global", "--seed", "5"];
    let at = split_job(work.path(), &split, &mount, &args, Vec::new());
    // Searches run on a thread, slower on a busy machine: the verdict may come after the
    // epoch's last open, but it judges that epoch's opens, not the 4,096 a search needs at most.
    let said = |s: &Value| {
        s["prediction"]
            .as_str()
            .unwrap_or("")
            .starts_with("auto: not found")
    };
    assert!(
        wait_for(Duration::from_secs(120), || said(&mount.stats())),
        "no verdict: {}",
        mount.stats()
    );
    let prediction = mount.stats()["prediction"].as_str().unwrap().to_string();
    let first_epoch = format!("from the first {SPLIT_TRAIN_FILES} opens");
    assert!(
        prediction.contains(&first_epoch),
        "the verdict judges the first epoch: {prediction}; at its end: {}",
        at[1]
    );
    for told in ["train", "global generator", "feed-env"] {
        assert!(
            prediction.contains(told),
            "the verdict names {told:?}: {prediction}"
        );
    }
    mount.unmount();
}

/// torchrun DDP over a root with train/ and val/, no flags and no hook: auto finds the
/// DistributedSampler of `train/` in epoch 0 (validation's in-order opens between epochs are
/// another stream), and the training stream is predicted from then on.
#[test]
fn auto_finds_ddp_training_over_a_root_with_train_and_val() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let split = SplitRoot::make(&work.path().join("src"));
    let mount = split.mount(work.path(), &[]);
    let args = ["--sampler", "ddp", "--seed", "0", "--compute-ms", "100"];
    let (before, after, ends) =
        two_ranks_of("train_val.py", &args, &work, &split.root, &mount, &[]);
    let mut at = vec![before];
    at.extend(ends);
    at.push(after.clone());
    check_split_run(
        "auto, ddp over train/ + val/",
        &at[..at.len() - 1],
        &AUTO_HIT_RATIOS,
        1,
    );
    assert_eq!(
        after["prediction"],
        "detected: --sampler torch-distributed --seed 0 --world-size 2 --ranks 0-1 --epoch 0 --dataset train",
        "{after}"
    );
    mount.unmount();
}

/// A Lightning-style DDP job: its shuffling loader's sampler is a DistributedSampler over the
/// list a RandomSampler draws from the global generator each epoch, which nothing can predict
/// from flags; with the hook, every training open after the first epoch's start is predicted.
#[test]
fn the_hook_follows_a_wrapped_distributed_sampler() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let split = SplitRoot::make(&work.path().join("src"));
    let mount = split.mount(work.path(), &[]);
    let args = [
        "--sampler",
        "wrapped",
        "--seed",
        "7",
        "--sanity-check",
        "--compute-ms",
        "100",
    ];
    let (before, after, ends) = two_ranks_of(
        "train_val.py",
        &args,
        &work,
        &split.root,
        &mount,
        &feed_env(),
    );
    let mut at = vec![before];
    at.extend(ends);
    check_split_run("hooked, wrapped DistributedSampler", &at, &[0.9, 0.97], 0);
    assert_eq!(after["prediction"], "announced by the job", "{after}");
    mount.unmount();
}

/// Two ranks launched without gradient sync, one a fifth slower: they drift apart by hundreds
/// of samples (half an epoch by the end). Each is followed on its own: the training stream
/// stays predicted and hit, and little staged is thrown away. (A rank more than an epoch
/// ahead of the slowest waits for it in the tracker: docs/limits.md.)
#[test]
fn ranks_that_drift_apart_keep_their_hits() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let split = SplitRoot::make(&work.path().join("src"));
    let flags = [
        "--sampler",
        "torch-distributed",
        "--seed",
        "0",
        "--world-size",
        "2",
        "--ranks",
        "0-1",
        "--dataset",
        "train",
    ];
    let mount = split.mount(work.path(), &flags);
    let args = [
        "--sampler",
        "ddp",
        "--no-sync",
        "--compute-ms",
        "100",
        "--slow-ms",
        "20",
        "--seed",
        "0",
    ];
    let (before, after, ends) =
        two_ranks_of("train_val.py", &args, &work, &split.root, &mount, &[]);
    let mut at = vec![before];
    at.extend(ends);
    check_split_run("drifting ranks", &at, &[0.9, 0.97], 0);
    let wasted = after["wasted_bytes"].as_u64().unwrap();
    let train_bytes = split.train.bytes(split.train.files.keys());
    assert!(
        wasted < train_bytes / 10,
        "wasted {wasted} of a {train_bytes}-byte dataset: {after}"
    );
    mount.unmount();
}
