//! The Slurm prolog/epilog (`mount-scripts/slurm-prolog.sh`, `slurm-epilog.sh`) under a real
//! slurmctld and slurmd (Debian's slurm-wlm 22.05, one node: this host, started by
//! `tests/e2e/slurm.sh` with the scripts as `Prolog=`/`Epilog=` and `PrologFlags=Alloc`).
//! `tests/deploy.rs` runs the same scripts under a faked Slurm; this is what slurmd really
//! gives them: its environment, its handling of their processes, its reaction to a failure.
//!
//! Jobs ask for a mount the way `slurm-example.sbatch` describes the prolog mode: a
//! `stagefs.env` in the job's working directory. Each job records the mount's statistics as
//! its first command, waits until the mount has staged the dataset (a cache that holds it
//! all: the reads' hits then do not depend on timing), reads it through two ranks of a real
//! PyTorch `DistributedSampler` DataLoader started by `srun` (stepping together through a gloo
//! process group, as DDP ranks do), reads it directly too, and records the statistics again.
//!
//! Slurm's ports are per host, so the binary has one test, in phases, on one cluster, which
//! a guard stops even when an assertion fails. Needs root, FUSE, slurm-wlm, munge, and
//! python3-torch/python3-torchvision under /usr/bin/python3.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{alive, bin, e2e_dir, image_folder, is_mounted, require_fuse, text};
use serde_json::Value;
use tempfile::TempDir;

/// Longest a job (or the cluster starting, or a node changing state) may take before the test
/// gives up: a hang guard, not a timing check.
const DEADLINE: Duration = Duration::from_secs(300);
/// Debian's interpreter: torch and torchvision come from apt, not from a PATH python.
const PYTHON: &str = "/usr/bin/python3";
/// The dataset: small enough to read in a few seconds, large enough that the ranks' prefetch
/// (a few batches of 8 ahead of the step they wait in) stays well inside the window where an
/// open still counts as predicted (a quarter of the node's epoch).
const FILES: u32 = 1000;
/// Ranks per node, as the job's request says (STAGEFS_GPUS_PER_NODE); srun starts as many.
const RANKS: u32 = 2;
const EPOCHS: u32 = 2;

/// The one-node cluster; stopped (jobs cancelled, daemons stopped, mounts removed) on drop.
struct Cluster {
    state: TempDir,
}

impl Cluster {
    fn start() -> Cluster {
        require_fuse();
        let state = TempDir::new().unwrap();
        let cluster = Cluster { state };
        let out = cluster.script("start");
        assert!(
            out.status.success(),
            "slurm.sh start: {}",
            text(&out.stderr)
        );
        cluster
    }

    fn script(&self, verb: &str) -> Output {
        Command::new(e2e_dir().join("slurm.sh"))
            .arg(verb)
            .arg(self.state.path())
            .env("STAGEFS", bin())
            .output()
            .expect("run tests/e2e/slurm.sh (apt-get install slurm-wlm munge)")
    }

    fn dir(&self) -> &Path {
        self.state.path()
    }

    /// A Slurm client command against this cluster.
    fn client(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("SLURM_CONF", self.dir().join("slurm.conf"));
        cmd
    }

    fn output_of(&self, program: &str, args: &[&str]) -> String {
        let out = self.client(program).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?}: {}",
            text(&out.stderr)
        );
        text(&out.stdout).trim().to_string()
    }

    fn node(&self) -> String {
        self.output_of("sinfo", &["--noheader", "--format=%N"])
    }

    /// The node's state as `scontrol show node` gives it, e.g. IDLE or IDLE+DRAIN.
    fn node_state(&self) -> String {
        let show = self.output_of("scontrol", &["show", "node", "--oneliner", &self.node()]);
        show.split_whitespace()
            .find_map(|kv| kv.strip_prefix("State="))
            .unwrap_or_else(|| panic!("no State= in {show}"))
            .to_string()
    }

    fn wait_for(&self, what: &str, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < DEADLINE,
                "gave up waiting for {what}; slurmd's log:\n{}",
                self.log("slurmd.log")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until job `id` has ended and its epilog has finished (a job is COMPLETING until
    /// then, and stays listed, COMPLETED or CANCELLED, for a while after).
    fn wait_gone(&self, id: &str) {
        const ENDED: [&str; 4] = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"];
        self.wait_for(&format!("job {id} to end"), || {
            let state = self.output_of(
                "squeue",
                &["--noheader", "--jobs", id, "--states=all", "--format=%T"],
            );
            ENDED.contains(&state.as_str())
        });
    }

    fn log(&self, name: &str) -> String {
        fs::read_to_string(self.dir().join("log").join(name)).unwrap_or_default()
    }

    fn mnt(&self, job: &str) -> PathBuf {
        self.dir().join("mnt").join(job)
    }

    fn cache(&self, job: &str) -> PathBuf {
        self.dir().join("cache").join(job)
    }

    /// Adds lines to the prolog's site configuration (read at every job).
    fn configure(&self, lines: &str) {
        let conf = self.dir().join("stagefs.conf");
        let mut all = fs::read_to_string(&conf).unwrap();
        all.push_str(lines);
        fs::write(conf, all).unwrap();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let out = self.script("stop");
        if !out.status.success() && !std::thread::panicking() {
            panic!("slurm.sh stop: {}", text(&out.stderr));
        }
    }
}

/// A job's working directory with its request and batch script.
struct Job {
    dir: PathBuf,
}

impl Job {
    /// A job asking for SOURCE with SEED, for RANKS ranks on its one node.
    fn new(cluster: &Cluster, name: &str, source: &Path, seed: u32) -> Job {
        let dir = cluster.dir().join("jobs").join(name);
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("stagefs.env"),
            format!(
                "STAGEFS_SOURCE={}\nSTAGEFS_SEED={seed}\nSTAGEFS_SAMPLER=torch-distributed\n\
                 STAGEFS_GPUS_PER_NODE={RANKS}\n",
                source.display()
            ),
        )
        .unwrap();
        // slurm-example.sbatch's prolog mode: the mount is there before the first step; each
        // rank reads it with the DataLoader the prediction names, then the same ranks read
        // SOURCE directly for comparison.
        let script = format!(
            r#"#!/bin/bash
#SBATCH --ntasks={RANKS}
#SBATCH --output=job.out
set -u
MNT={mnt_root}/$SLURM_JOB_ID
{stagefs} stats --json "$MNT" > stats-first.json
getfattr --only-values -n user.stagefs.pid "$MNT" > daemon.pid
if ! mountpoint -q "$MNT"; then
  echo "no stagefs mount at $MNT"
  exit 3
fi
for _ in $(seq 600); do
  {stagefs} stats --json "$MNT" | grep -q '"cached_files": {FILES},' && break
  sleep 0.1
done
# read_all ROOT NAME PORT: the ranks step together through a process group on PORT.
read_all() {{
  srun --ntasks={RANKS} --output="$2.%t.out" bash -c \
    'exec {python} {train} "$0" --world-size {RANKS} --rank "$SLURM_PROCID" --seed {seed} \
       --epochs {EPOCHS} --batch-size 8 --workers 1 --sync-url "tcp://127.0.0.1:$1"' "$1" "$3"
}}
port=$((20000 + 2 * (SLURM_JOB_ID % 10000)))
read_all "$MNT" mount "$port" || exit 4
{stagefs} stats --json "$MNT" > stats-last.json
read_all {source} direct $((port + 1)) || exit 5
"#,
            mnt_root = cluster.dir().join("mnt").display(),
            stagefs = bin().display(),
            python = PYTHON,
            train = e2e_dir().join("train_distributed.py").display(),
            source = source.display(),
        );
        fs::write(dir.join("job.sh"), script).unwrap();
        Job { dir }
    }

    fn sbatch(&self, cluster: &Cluster, wait: bool) -> (String, Output) {
        let mut cmd = cluster.client("timeout");
        cmd.arg(DEADLINE.as_secs().to_string()).arg("sbatch");
        if wait {
            cmd.arg("--wait");
        }
        let out = cmd
            .args(["--parsable", "--chdir"])
            .arg(&self.dir)
            .arg(self.dir.join("job.sh"))
            .output()
            .unwrap();
        let id = text(&out.stdout)
            .trim()
            .split(';')
            .next()
            .unwrap()
            .to_string();
        assert!(
            !id.is_empty(),
            "sbatch gave no job id: {}",
            text(&out.stderr)
        );
        (id, out)
    }

    fn read(&self, name: &str) -> String {
        fs::read_to_string(self.dir.join(name)).unwrap_or_default()
    }

    fn stats(&self, name: &str) -> Value {
        let raw = self.read(name);
        serde_json::from_str(&raw).unwrap_or_else(|e| {
            panic!("{name}: {e}: {raw:?}; job output: {}", self.read("job.out"))
        })
    }

    /// Each rank's per-epoch JSON lines from one read (`mount` or `direct`).
    fn epochs(&self, read: &str) -> Vec<Vec<Value>> {
        (0..RANKS)
            .map(|rank| {
                self.read(&format!("{read}.{rank}.out"))
                    .lines()
                    .filter(|l| l.starts_with('{'))
                    .map(|l| serde_json::from_str(l).unwrap())
                    .collect()
            })
            .collect()
    }
}

/// A job that asked for a mount: it was there with the node's ranks before the first step,
/// the reads through it were hits of the predicted order with the source's bytes, and after
/// the job the epilog removed the mount, its daemon, the cache and the prolog's state.
fn run_good_job(cluster: &Cluster, name: &str, source: &Path, seed: u32) {
    let job = Job::new(cluster, name, source, seed);
    let (id, out) = job.sbatch(cluster, true);
    assert!(
        out.status.success(),
        "job {name} ({id}) failed: {}\njob output: {}\nthe prolog's log: {}",
        text(&out.stderr),
        job.read("job.out"),
        cluster.log("stagefs-slurm.log")
    );

    let first = job.stats("stats-first.json");
    let want = format!(
        "configured: --sampler torch-distributed --seed {seed} --world-size {RANKS} --ranks 0-{} --epoch 0",
        RANKS - 1
    );
    assert_eq!(first["prediction"], want.as_str(), "{first}");
    assert_eq!(
        first["hits"].as_u64(),
        Some(0),
        "read before the job: {first}"
    );
    assert_eq!(
        first["epoch_len"].as_u64(),
        Some(u64::from(FILES)),
        "{first}"
    );

    let last = job.stats("stats-last.json");
    let opens = u64::from(FILES * EPOCHS);
    assert_eq!(
        (
            last["hits"].as_u64(),
            last["misses"].as_u64(),
            last["mispredictions"].as_u64()
        ),
        (Some(opens), Some(0), Some(0)),
        "every read a predicted hit: {last}"
    );
    let (mount, direct) = (job.epochs("mount"), job.epochs("direct"));
    assert_eq!(mount.len(), RANKS as usize);
    for (rank, (m, d)) in mount.iter().zip(&direct).enumerate() {
        assert_eq!(m.len(), EPOCHS as usize, "rank {rank}: {m:?}");
        for (em, ed) in m.iter().zip(d) {
            assert_eq!(em["samples"].as_u64(), Some(u64::from(FILES / RANKS)));
            assert_eq!(em["checksum"], ed["checksum"], "rank {rank}: {em} vs {ed}");
        }
    }

    cluster.wait_gone(&id);
    let mnt = cluster.mnt(&id);
    assert!(
        !is_mounted(&mnt),
        "job {id}: still mounted after the epilog"
    );
    assert!(
        !mnt.exists(),
        "job {id}: the mountpoint the prolog made is left"
    );
    assert!(!cluster.cache(&id).exists(), "job {id}: the cache is left");
    let pid: i32 = job.read("daemon.pid").trim().parse().unwrap();
    assert!(!alive(pid), "job {id}: daemon {pid} outlived the epilog");
    let states = fs::read_dir(cluster.dir().join("prolog-state"))
        .unwrap()
        .count();
    assert_eq!(states, 0, "job {id}: the prolog's state file is left");
    assert!(
        cluster
            .log("stagefs-slurm.log")
            .contains(&format!("job {id}: mounted {}", source.display())),
        "the prolog's message: {}",
        cluster.log("stagefs-slurm.log")
    );
}

#[test]
fn slurm_prolog_and_epilog_under_a_real_slurmd() {
    let cluster = Cluster::start();
    let source = cluster.dir().join("dataset");
    image_folder(&source, FILES, 4, 200, 2000);
    assert_eq!(cluster.node_state(), "IDLE");

    // Two jobs in a row on the same node, each with its own mount, order and cache.
    run_good_job(&cluster, "first", &source, 3);
    run_good_job(&cluster, "second", &source, 11);

    // A request for a source that does not exist: by default the job runs without a mount,
    // the reason is in the prolog's log, and the node stays in service.
    let missing = cluster.dir().join("no-such-dataset");
    let bad = Job::new(&cluster, "bad", &missing, 0);
    let (id, out) = bad.sbatch(&cluster, true);
    assert_eq!(
        out.status.code(),
        Some(3),
        "job output: {}",
        bad.read("job.out")
    );
    assert!(bad.read("job.out").contains("no stagefs mount"));
    cluster.wait_gone(&id);
    assert_eq!(cluster.node_state(), "IDLE");
    let log = cluster.log("stagefs-slurm.log");
    assert!(
        log.contains(&format!(
            "job {id}: stagefs mount {} failed",
            missing.display()
        )) && log.contains("no dataset mounted"),
        "{log}"
    );
    assert!(!cluster.mnt(&id).exists() && !cluster.cache(&id).exists());
    // Why the prolog has its own log: slurmd drops the output of a prolog that succeeds.
    assert!(!cluster.log("slurmd.log").contains("no dataset mounted"));

    // With ON_FAILURE=drain the same request fails the prolog: Slurm drains the node and
    // holds the job, which never runs.
    cluster.configure("ON_FAILURE=drain\n");
    let drained = Job::new(&cluster, "drained", &missing, 0);
    let (id, _) = drained.sbatch(&cluster, false);
    cluster.wait_for("the node to drain", || {
        cluster.node_state().contains("DRAIN")
    });
    let reason = cluster.output_of("sinfo", &["--noheader", "--format=%E"]);
    assert_eq!(reason, "Prolog error");
    assert!(
        cluster.log("slurmd.log").contains("no dataset mounted"),
        "slurmd logs a failing prolog's output"
    );
    cluster.output_of("scancel", &[&id]);
    cluster.wait_gone(&id);
    assert!(drained.read("job.out").is_empty(), "the held job ran");
    assert!(!cluster.mnt(&id).exists() && !cluster.cache(&id).exists());
    cluster.output_of(
        "scontrol",
        &[
            "update",
            &format!("nodename={}", cluster.node()),
            "state=resume",
        ],
    );
    cluster.wait_for("the node to be resumed", || cluster.node_state() == "IDLE");
}
