//! The Slurm prolog/epilog (`mount-scripts/slurm-prolog.sh`, `slurm-epilog.sh`) under a real
//! slurmctld and slurmd (Debian's slurm-wlm 22.05), started by `tests/e2e/slurm.sh` on this
//! host with two nodes (two slurmd, each with its own "node-local" directories) and the scripts
//! as `Prolog=`/`Epilog=` with `PrologFlags=Alloc`. `tests/deploy.rs` runs the same scripts
//! under a faked Slurm; this is what slurmd really gives them: its environment, its handling of
//! their processes, its reaction to a failure.
//!
//! Jobs ask for a mount the way `slurm-example.sbatch` describes the prolog mode: a
//! `stagefs.env` in the job's working directory. A two-node job's first step records each
//! node's mount statistics and waits until the mount has staged the node's share of both
//! epochs (the cache holds it all: the reads' hits then do not depend on timing); then four
//! ranks of a real PyTorch `DistributedSampler` DataLoader, two per node started by `srun`
//! and stepping together through a gloo process group as DDP ranks do, read the dataset
//! through their node's mount, then directly; the statistics are recorded again in between.
//!
//! Slurm's ports are per host, so the binary has one test, in phases, on one cluster, which
//! a guard stops even when an assertion fails. Needs root, FUSE, slurm-wlm, munge, and
//! python3-torch/python3-torchvision under /usr/bin/python3.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{
    bin, e2e_dir, image_folder, is_mounted, process_alive, require_fuse, stagefs_order, text,
};
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
/// What tests/e2e/slurm.sh starts.
const NODES: u32 = 2;
/// Ranks per node, as the job's request says (STAGEFS_GPUS_PER_NODE); srun starts as many.
const RANKS_PER_NODE: u32 = 2;
const WORLD: u32 = NODES * RANKS_PER_NODE;
const EPOCHS: u32 = 2;
/// Positions a node's mount serves per epoch: its ranks' shares of the padded epoch.
const NODE_EPOCH: u32 = RANKS_PER_NODE * FILES.div_ceil(WORLD);

/// The cluster; stopped (jobs cancelled, daemons stopped, mounts removed) on drop.
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
            .env("SLURM_TEST_NODES", NODES.to_string())
            .output()
            .expect("run tests/e2e/slurm.sh (apt-get install slurm-wlm munge)")
    }

    fn dir(&self) -> &Path {
        self.state.path()
    }

    fn output_of(&self, program: &str, args: &[&str]) -> String {
        let out = Command::new(program)
            .env("SLURM_CONF", self.dir().join("slurm.conf"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?}: {}",
            text(&out.stderr)
        );
        text(&out.stdout).trim().to_string()
    }

    /// Each node's state as `scontrol show node` gives it, e.g. IDLE or IDLE+DRAIN.
    fn node_states(&self) -> Vec<String> {
        let show = self.output_of("scontrol", &["show", "node", "--oneliner"]);
        let states: Vec<String> = show
            .lines()
            .filter_map(|l| {
                l.split_whitespace()
                    .find_map(|kv| kv.strip_prefix("State="))
            })
            .map(str::to_string)
            .collect();
        assert_eq!(states.len(), NODES as usize, "{show}");
        states
    }

    fn all_idle(&self) -> bool {
        self.node_states().iter().all(|s| s == "IDLE")
    }

    /// Polls every 200 ms (each poll runs Slurm's commands) until `cond` holds.
    fn wait_for(&self, what: &str, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < DEADLINE,
                "gave up waiting for {what}; slurmctld's log:\n{}",
                self.log("slurmctld.log")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until job `id` has ended and its epilogs have finished (a job is COMPLETING until
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

    /// Node `index`'s own directory (node-local storage on a real cluster).
    fn node_dir(&self, index: u32) -> PathBuf {
        self.dir().join("node").join(format!("n{}", index + 1))
    }

    fn mnt(&self, index: u32, job: &str) -> PathBuf {
        self.node_dir(index).join("mnt").join(job)
    }

    fn cache(&self, index: u32, job: &str) -> PathBuf {
        self.node_dir(index).join("cache").join(job)
    }

    /// Adds lines to every node's prolog site configuration (read at every job).
    fn configure(&self, lines: &str) {
        for index in 0..NODES {
            let conf = self.node_dir(index).join("stagefs.conf");
            let mut all = fs::read_to_string(&conf).unwrap();
            all.push_str(lines);
            fs::write(conf, all).unwrap();
        }
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
    /// A two-node job asking for SOURCE with SEED. Its first step waits until node i's mount
    /// holds `staged[i]` files.
    fn new(cluster: &Cluster, name: &str, source: &Path, seed: u32, staged: &[usize]) -> Job {
        let dir = cluster.dir().join("jobs").join(name);
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("stagefs.env"),
            format!(
                "STAGEFS_SOURCE={}\nSTAGEFS_SEED={seed}\nSTAGEFS_SAMPLER=torch-distributed\n\
                 STAGEFS_GPUS_PER_NODE={RANKS_PER_NODE}\n",
                source.display()
            ),
        )
        .unwrap();
        // What each task runs on its node, where the node's mount is.
        let on_node = format!(
            r#"#!/bin/bash
set -u
mnt={nodes}/$SLURMD_NODENAME/mnt/$SLURM_JOB_ID
staged=({staged})
case $1 in
  first)
    {stagefs} stats --json "$mnt" > "stats-first.$SLURM_NODEID.json"
    getfattr --only-values -n user.stagefs.pid "$mnt" > "daemon.$SLURM_NODEID.pid"
    if ! mountpoint -q "$mnt"; then
      echo "no stagefs mount at $mnt"
      exit 3
    fi
    # Every file of both epochs staged before the reads, so the hits do not depend on timing.
    want=${{staged[SLURM_NODEID]}}
    for _ in $(seq 600); do
      cached=$({stagefs} stats --json "$mnt" | {python} -c 'import json, sys; print(json.load(sys.stdin)["cached_files"])')
      [ "$cached" = "$want" ] && exit 0
      sleep 0.1
    done
    echo "the mount staged $cached of $want files in 60 s"
    exit 6
    ;;
  last) exec {stagefs} stats --json "$mnt" > "stats-last.$SLURM_NODEID.json" ;;
  read)
    root=$2
    [ "$root" = mount ] && root=$mnt
    exec {python} {train} "$root" --world-size {WORLD} --rank "$SLURM_PROCID" --seed {seed} \
      --epochs {EPOCHS} --batch-size 8 --workers 1 --sync-url "tcp://127.0.0.1:$3"
    ;;
esac
"#,
            nodes = cluster.dir().join("node").display(),
            staged = staged
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(" "),
            stagefs = bin().display(),
            python = PYTHON,
            train = e2e_dir().join("train_distributed.py").display(),
        );
        fs::write(dir.join("on_node.sh"), on_node).unwrap();
        // slurm-example.sbatch's prolog mode: the mounts are there before the first step.
        let script = format!(
            r#"#!/bin/bash
#SBATCH --nodes={NODES}
#SBATCH --ntasks-per-node={RANKS_PER_NODE}
#SBATCH --output=job.out
set -u
srun --ntasks={NODES} --ntasks-per-node=1 bash on_node.sh first || exit 3
port=$((20000 + 2 * (SLURM_JOB_ID % 10000)))
srun --output=mount.%t.out bash on_node.sh read mount "$port" || exit 4
srun --ntasks={NODES} --ntasks-per-node=1 bash on_node.sh last
srun --output=direct.%t.out bash on_node.sh read {source} $((port + 1)) || exit 5
"#,
            source = source.display(),
        );
        fs::write(dir.join("job.sh"), script).unwrap();
        Job { dir }
    }

    fn sbatch(&self, cluster: &Cluster, wait: bool) -> (String, Output) {
        let mut cmd = Command::new("timeout");
        cmd.env("SLURM_CONF", cluster.dir().join("slurm.conf"))
            .arg(DEADLINE.as_secs().to_string())
            .arg("sbatch");
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
        (0..WORLD)
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

/// Node `index`'s ranks, as `--ranks` writes them.
fn node_ranks(index: u32) -> String {
    let first = index * RANKS_PER_NODE;
    format!("{first}-{}", first + RANKS_PER_NODE - 1)
}

/// How many files node `index` stages for the job's epochs: the union of its ranks' shares.
fn node_files(index: u32, seed: u32) -> usize {
    let (seed, len, world, ranks) = (
        seed.to_string(),
        FILES.to_string(),
        WORLD.to_string(),
        node_ranks(index),
    );
    let mut files = BTreeSet::new();
    for epoch in 0..EPOCHS {
        let epoch = epoch.to_string();
        files.extend(stagefs_order(&[
            "--seed",
            &seed,
            "--epoch",
            &epoch,
            "--len",
            &len,
            "--world-size",
            &world,
            "--ranks",
            &ranks,
        ]));
    }
    files.len()
}

/// A two-node job that asked for a mount: on each node it was there with the node's ranks
/// before the first step, the reads through it were hits of the predicted order with the
/// source's bytes, and after the job the epilog removed the mount, its daemon, the cache and
/// the prolog's state.
/// Runs a two-node job that reads SOURCE through its mounts and directly, and checks every read
/// was a predicted hit of the right bytes and the epilog left nothing. `peers`: the site turned
/// peers on, so each node staged some of its files from the other.
fn run_good_job(cluster: &Cluster, name: &str, source: &Path, seed: u32, peers: bool) {
    let staged: Vec<usize> = (0..NODES).map(|node| node_files(node, seed)).collect();
    let job = Job::new(cluster, name, source, seed, &staged);
    let (id, out) = job.sbatch(cluster, true);
    assert!(
        out.status.success(),
        "job {name} ({id}) failed: {}\njob output: {}\nthe prolog's log: {}",
        text(&out.stderr),
        job.read("job.out"),
        cluster.log("stagefs-slurm.log")
    );

    let log = cluster.log("stagefs-slurm.log");
    for node in 0..NODES {
        let ranks = node_ranks(node);
        let first = job.stats(&format!("stats-first.{node}.json"));
        let want = format!(
            "configured: --sampler torch-distributed --seed {seed} --world-size {WORLD} \
             --ranks {ranks} --epoch 0"
        );
        assert_eq!(first["prediction"], want.as_str(), "node {node}: {first}");
        assert_eq!(
            first["hits"], 0,
            "node {node}: read before the job: {first}"
        );
        assert_eq!(first["epoch_len"], NODE_EPOCH, "node {node}: {first}");

        let last = job.stats(&format!("stats-last.{node}.json"));
        let opens = u64::from(NODE_EPOCH * EPOCHS);
        let counts = ["hits", "misses", "mispredictions"].map(|k| last[k].as_u64());
        assert_eq!(
            counts,
            [Some(opens), Some(0), Some(0)],
            "node {node}: every read a predicted hit: {last}"
        );
        // The TaskProlog turned the hook on: the reads were batch opens, not FUSE opens.
        assert_eq!(last["descriptor_opens"], opens, "node {node}: {last}");
        assert_eq!(last["ops"]["open"], 0, "node {node}: {last}");
        if peers {
            // Epoch 1's files the other node read in epoch 0 came from it.
            let from_peers = last["peer_files"].as_u64().unwrap();
            assert!(from_peers > 0, "node {node}: nothing from its peer: {last}");
            assert!(
                last["served_files"].as_u64().unwrap() > 0,
                "node {node}: {last}"
            );
            assert_eq!(last["served_refused"], 0, "node {node}: {last}");
            assert_eq!(
                last["peer_fallbacks_by_cause"]["refused"], 0,
                "node {node}: {last}"
            );
        } else {
            assert_eq!(last["peer_files"], 0, "node {node}: {last}");
        }
        let mounted = format!(
            "job {id}: mounted {} at {} (node {node}: ranks {ranks} of {WORLD})",
            source.display(),
            cluster.mnt(node, &id).display()
        );
        assert!(
            log.contains(&mounted),
            "no {mounted:?} in the prolog's log: {log}"
        );
    }
    let (mount, direct) = (job.epochs("mount"), job.epochs("direct"));
    for (rank, (m, d)) in mount.iter().zip(&direct).enumerate() {
        assert_eq!(m.len(), EPOCHS as usize, "rank {rank}: {m:?}");
        for (em, ed) in m.iter().zip(d) {
            assert_eq!(em["samples"], FILES.div_ceil(WORLD), "rank {rank}: {em}");
            assert_eq!(em["checksum"], ed["checksum"], "rank {rank}: {em} vs {ed}");
        }
    }

    cluster.wait_gone(&id);
    for node in 0..NODES {
        let mnt = cluster.mnt(node, &id);
        assert!(!is_mounted(&mnt), "job {id} node {node}: still mounted");
        assert!(
            !mnt.exists(),
            "job {id} node {node}: the mountpoint is left"
        );
        assert!(
            !cluster.cache(node, &id).exists(),
            "job {id} node {node}: the cache is left"
        );
        let secret_dir = PathBuf::from(format!("{}.peers", cluster.cache(node, &id).display()));
        assert!(
            !secret_dir.exists(),
            "job {id} node {node}: the peer secret is left"
        );
        let pid: i32 = job
            .read(&format!("daemon.{node}.pid"))
            .trim()
            .parse()
            .unwrap();
        assert!(
            !process_alive(pid),
            "job {id} node {node}: daemon {pid} outlived the epilog"
        );
        let states = fs::read_dir(cluster.node_dir(node).join("prolog-state"))
            .unwrap()
            .count();
        assert_eq!(
            states, 0,
            "job {id} node {node}: the prolog's state file is left"
        );
    }
}

#[test]
fn slurm_prolog_and_epilog_under_a_real_slurmd() {
    let cluster = Cluster::start();
    let source = cluster.dir().join("dataset");
    image_folder(&source, FILES, 4, 200, 2000);
    assert!(cluster.all_idle(), "{:?}", cluster.node_states());

    // Two jobs in a row on the same nodes, each with its own mounts, order and caches; the
    // second with peers on (both "nodes" are this host: each listens on its own port, the
    // job's port followed by the node's index).
    run_good_job(&cluster, "first", &source, 3, false);
    let key = cluster.dir().join("peer.key");
    fs::write(&key, "the site's peer key, the same on every node\n").unwrap();
    fs::set_permissions(
        &key,
        <fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
    )
    .unwrap();
    cluster.configure(&format!(
        "PEER_PORT=2000\nPEER_ADDRESS=127.0.0.1:%p%i\nPEER_KEY={}\n",
        key.display()
    ));
    run_good_job(&cluster, "second", &source, 11, true);

    // A request for a source that does not exist: by default the job runs without a mount,
    // the reason is in the prolog's log, and the nodes stay in service.
    let missing = cluster.dir().join("no-such-dataset");
    let bad = Job::new(&cluster, "bad", &missing, 0, &[0; NODES as usize]);
    let (id, out) = bad.sbatch(&cluster, true);
    assert_eq!(
        out.status.code(),
        Some(3),
        "job output: {}",
        bad.read("job.out")
    );
    assert!(bad.read("job.out").contains("no stagefs mount"));
    cluster.wait_gone(&id);
    assert!(cluster.all_idle(), "{:?}", cluster.node_states());
    let log = cluster.log("stagefs-slurm.log");
    let failed = format!("job {id}: stagefs mount {} failed", missing.display());
    assert_eq!(
        log.matches(&failed).count(),
        NODES as usize,
        "one failure per node: {log}"
    );
    assert!(log.contains("no dataset mounted"), "{log}");
    for node in 0..NODES {
        assert!(!cluster.mnt(node, &id).exists() && !cluster.cache(node, &id).exists());
    }
    // Why the prolog has its own log: slurmd drops the output of a prolog that succeeds.
    assert!(!cluster.log("slurmd.n1.log").contains("no dataset mounted"));

    // With ON_FAILURE=drain the same request fails the prologs: Slurm drains the nodes and
    // holds the job, which never runs.
    cluster.configure("ON_FAILURE=drain\n");
    let drained = Job::new(&cluster, "drained", &missing, 0, &[0; NODES as usize]);
    let (id, _) = drained.sbatch(&cluster, false);
    cluster.wait_for("the nodes to drain", || {
        cluster.node_states().iter().all(|s| s.contains("DRAIN"))
    });
    let reasons = cluster.output_of("sinfo", &["--noheader", "--format=%E"]);
    assert_eq!(reasons, "Prolog error");
    assert!(
        cluster.log("slurmd.n1.log").contains("no dataset mounted"),
        "slurmd logs a failing prolog's output"
    );
    cluster.output_of("scancel", &[&id]);
    cluster.wait_gone(&id);
    assert!(drained.read("job.out").is_empty(), "the held job ran");
    for node in 0..NODES {
        assert!(!cluster.mnt(node, &id).exists() && !cluster.cache(node, &id).exists());
    }
    let nodes = format!("nodename=n[1-{NODES}]");
    cluster.output_of("scontrol", &["update", &nodes, "state=resume"]);
    cluster.wait_for("the nodes to be resumed", || cluster.all_idle());
}
