//! Which of the job's ranks an opener is, from the environment its launcher gave it
//! (`/proc/TID/environ`): torchrun's `RANK`/`WORLD_SIZE`/`LOCAL_RANK`/`LOCAL_WORLD_SIZE`,
//! Open MPI's `OMPI_COMM_WORLD_*`, Slurm's `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`, and
//! MPICH's `PMI_RANK`/`PMI_SIZE`. DataLoader workers inherit it from their rank.
//!
//! PyTorch Lightning's own DDP launcher is the odd one: it sets `NODE_RANK`, `LOCAL_RANK` and
//! `WORLD_SIZE` in the running script (invisible in `/proc`, which shows the environment a
//! process started with) and starts local ranks 1.. as new processes with those, but no
//! `RANK`. On node 0 such a process is rank `LOCAL_RANK`; the script it started from, with
//! none of these, is rank 0, which is what an opener without a launcher's environment counts
//! as anyway.
//!
//! `torch.multiprocessing.spawn` (plain DDP scripts, Lightning's `ddp_spawn`) sets nothing:
//! each rank learns its number as a function argument. Its ranks are `multiprocessing` spawn
//! children of the script (command line `... spawn_main(...) --multiprocessing-fork`),
//! started in rank order, and their DataLoader workers are their descendants. So an opener
//! with no launcher's environment whose outermost spawn-child ancestor has spawn-child
//! siblings is rank i of n: i its place among them by start time, n their number. One job's
//! DataLoader workers started with the spawn method (not the default on Linux) look the same
//! and would be taken for ranks; whole-order samplers are judged over all ranks' opens
//! together, so their orders are still found.
//!
//! Read only while `--sampler auto` is looking for the order, once per opener thread.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::stager::JobRank;

/// Opener threads remembered; the table starts over when full (workers come and go each
/// epoch, and a reused thread id is at worst read again).
const REMEMBERED: usize = 4096;

/// The variables each launcher sets: (rank, world size, local rank, local world size).
const LAUNCHERS: [[&str; 4]; 4] = [
    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    [
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ],
    [
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
    ],
    ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
];

/// The rank of each opener thread seen.
#[derive(Default)]
pub struct Launchers(Mutex<HashMap<u32, JobRank>>);

impl Launchers {
    /// The rank thread `tid` belongs to ([`JobRank::ALONE`] without a launcher's environment,
    /// or if it cannot be read).
    pub fn rank_of(&self, tid: u32) -> JobRank {
        if let Some(&rank) = self.0.lock().get(&tid) {
            return rank;
        }
        let rank = std::fs::read(format!("/proc/{tid}/environ"))
            .ok()
            .and_then(|environ| parse(&environ))
            .or_else(|| spawned_rank(&Proc, tid))
            .unwrap_or(JobRank::ALONE);
        let mut known = self.0.lock();
        if known.len() >= REMEMBERED {
            known.clear();
        }
        known.insert(tid, rank);
        rank
    }
}

/// The rank an environment (`NAME=value` entries separated by NULs) names, if any launcher's
/// variables are there and make sense.
pub fn parse(environ: &[u8]) -> Option<JobRank> {
    let vars: HashMap<&[u8], &[u8]> = environ
        .split(|&b| b == 0)
        .filter_map(|entry| {
            let eq = entry.iter().position(|&b| b == b'=')?;
            Some((&entry[..eq], &entry[eq + 1..]))
        })
        .collect();
    let number = |name: &str| -> Option<u32> {
        let value = std::str::from_utf8(vars.get(name.as_bytes())?).ok()?;
        // Slurm writes tasks per node as "4" or "4(x2)": the count comes first.
        let digits = value.bytes().take_while(u8::is_ascii_digit).count();
        value[..digits].parse().ok()
    };
    let lightning_child = || {
        let (rank, world_size) = (number("LOCAL_RANK")?, number("WORLD_SIZE")?);
        // Another node's ranks start at NODE_RANK × devices, which nothing here tells.
        let first_node = vars.get(b"NODE_RANK".as_slice()).is_none_or(|n| *n == b"0");
        (first_node && !vars.contains_key(b"RANK".as_slice()) && rank < world_size).then_some(
            JobRank {
                rank,
                world_size,
                local: None,
            },
        )
    };
    LAUNCHERS
        .iter()
        .find_map(|[rank, world, local_rank, local_size]| {
            let (rank, world_size) = (number(rank)?, number(world)?);
            if rank >= world_size {
                return None;
            }
            let local = number(local_rank)
                .zip(number(local_size))
                .filter(|&(r, size)| r < size && size <= world_size);
            Some(JobRank {
                rank,
                world_size,
                local,
            })
        })
        .or_else(lightning_child)
}

/// Ancestors looked at above an opener: a rank, a worker and a few shells or launchers.
const MAX_DEPTH: usize = 16;

/// What [`spawned_rank`] needs of the process table.
trait ProcessTable {
    /// The process thread `tid` belongs to.
    fn process_of(&self, tid: u32) -> Option<u32>;
    /// The parent of `pid` and when `pid` started (clock ticks since boot).
    fn stat(&self, pid: u32) -> Option<ProcessStat>;
    /// Whether `pid` is a `multiprocessing` spawn child.
    fn is_spawn_child(&self, pid: u32) -> bool;
    /// Every process now running.
    fn pids(&self) -> Vec<u32>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ProcessStat {
    parent: u32,
    started: u64,
}

/// The rank `tid` is in a `torch.multiprocessing.spawn` job: see the module's note.
fn spawned_rank(table: &impl ProcessTable, tid: u32) -> Option<JobRank> {
    let mut rank_process = None;
    let mut pid = table.process_of(tid)?;
    for _ in 0..MAX_DEPTH {
        if table.is_spawn_child(pid) {
            rank_process = Some(pid);
        }
        pid = table.stat(pid)?.parent;
        if pid <= 1 {
            break;
        }
    }
    let rank_process = rank_process?;
    let script = table.stat(rank_process)?.parent;
    let mut ranks: Vec<(u64, u32)> = table
        .pids()
        .into_iter()
        .filter_map(|p| {
            let stat = table.stat(p)?;
            (stat.parent == script && table.is_spawn_child(p)).then_some((stat.started, p))
        })
        .collect();
    ranks.sort_unstable();
    let rank = ranks.iter().position(|&(_, p)| p == rank_process)? as u32;
    let world_size = ranks.len() as u32;
    // One spawn child is a helper process, not a set of ranks.
    (world_size > 1).then_some(JobRank {
        rank,
        world_size,
        local: Some((rank, world_size)),
    })
}

/// The machine's process table, from /proc.
struct Proc;

impl ProcessTable for Proc {
    fn process_of(&self, tid: u32) -> Option<u32> {
        let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("Tgid:"))?
            .trim()
            .parse()
            .ok()
    }

    fn stat(&self, pid: u32) -> Option<ProcessStat> {
        parse_stat(&std::fs::read(format!("/proc/{pid}/stat")).ok()?)
    }

    fn is_spawn_child(&self, pid: u32) -> bool {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| is_spawn_command(&c))
    }

    fn pids(&self) -> Vec<u32> {
        std::fs::read_dir("/proc")
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The parent and start time in a `/proc/PID/stat` line: fields 4 and 22.
fn parse_stat(stat: &[u8]) -> Option<ProcessStat> {
    let fields: Vec<&[u8]> = crate::sys::proc_stat_fields(stat)?.collect();
    let number =
        |i: usize| -> Option<u64> { std::str::from_utf8(fields.get(i)?).ok()?.parse().ok() };
    Some(ProcessStat {
        parent: u32::try_from(number(1)?).ok()?,
        started: number(19)?,
    })
}

/// Whether a NUL-separated command line is a `multiprocessing` spawn child's.
fn is_spawn_command(cmdline: &[u8]) -> bool {
    let mut args = cmdline.split(|&b| b == 0);
    args.clone().any(|a| a == b"--multiprocessing-fork")
        && args.any(|a| a.windows(11).any(|w| w == b"spawn_main("))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_slurm_and_nothing() {
        let torchrun = b"PATH=/bin\0RANK=5\0WORLD_SIZE=8\0LOCAL_RANK=1\0LOCAL_WORLD_SIZE=4\0";
        assert_eq!(
            parse(torchrun),
            Some(JobRank {
                rank: 5,
                world_size: 8,
                local: Some((1, 4))
            })
        );
        let slurm =
            b"SLURM_PROCID=3\0SLURM_NTASKS=4\0SLURM_LOCALID=1\0SLURM_NTASKS_PER_NODE=2(x2)\0";
        assert_eq!(parse(slurm).unwrap().local, Some((1, 2)));
        assert_eq!(parse(b"HOME=/root\0"), None);
        // A rank past the world is no launcher's.
        assert_eq!(parse(b"RANK=4\0WORLD_SIZE=4\0"), None);
        assert_eq!(parse(b"RANK=0\0WORLD_SIZE=2\0").unwrap().local, None);
    }

    #[test]
    fn lightning_children_on_the_first_node() {
        let child = b"MASTER_PORT=1\0NODE_RANK=0\0LOCAL_RANK=1\0WORLD_SIZE=2\0";
        assert_eq!(
            parse(child),
            Some(JobRank {
                rank: 1,
                world_size: 2,
                local: None
            })
        );
        assert_eq!(parse(b"LOCAL_RANK=3\0WORLD_SIZE=4\0").unwrap().rank, 3);
        // Another node's: its global rank is unknown.
        assert_eq!(parse(b"NODE_RANK=1\0LOCAL_RANK=1\0WORLD_SIZE=4\0"), None);
        assert_eq!(parse(b"LOCAL_RANK=2\0WORLD_SIZE=2\0"), None);
        // With RANK it is torchrun's, whatever else is there.
        let torchrun = b"RANK=3\0WORLD_SIZE=4\0LOCAL_RANK=1\0NODE_RANK=1\0";
        assert_eq!(parse(torchrun).unwrap().rank, 3);
    }

    /// A process table made up for a test: pid → (parent, start, spawn child).
    struct Table(HashMap<u32, (u32, u64, bool)>);

    impl ProcessTable for Table {
        fn process_of(&self, tid: u32) -> Option<u32> {
            self.0.contains_key(&tid).then_some(tid)
        }
        fn stat(&self, pid: u32) -> Option<ProcessStat> {
            let &(parent, started, _) = self.0.get(&pid)?;
            Some(ProcessStat { parent, started })
        }
        fn is_spawn_child(&self, pid: u32) -> bool {
            self.0.get(&pid).is_some_and(|p| p.2)
        }
        fn pids(&self) -> Vec<u32> {
            self.0.keys().copied().collect()
        }
    }

    #[test]
    fn spawned_ranks_are_numbered_by_start_and_their_workers_belong_to_them() {
        let table = Table(HashMap::from([
            (1, (0, 0, false)),
            (50, (1, 5, false)),    // a shell
            (100, (50, 9, false)),  // the script: mp.spawn(nprocs=3)
            (90, (100, 10, false)), // its resource tracker (not a spawn child)
            // The ranks, started in rank order (a reused lower pid for rank 2).
            (201, (100, 11, true)),
            (202, (100, 12, true)),
            (7, (100, 13, true)),
            // Forked DataLoader workers carry their rank's command line.
            (301, (202, 20, true)),
            (302, (7, 21, true)),
        ]));
        let rank = |tid| spawned_rank(&table, tid).map(|r| (r.rank, r.world_size, r.local));
        assert_eq!(rank(201), Some((0, 3, Some((0, 3)))));
        assert_eq!(rank(301), Some((1, 3, Some((1, 3)))));
        assert_eq!(rank(302), Some((2, 3, Some((2, 3)))));
        // The script itself and processes outside the job are no spawned rank.
        assert_eq!(rank(100), None);
        assert_eq!(rank(90), None);
        assert_eq!(rank(999), None);
        // A lone spawn child is a helper, not a job of one rank.
        let lone = Table(HashMap::from([
            (100, (1, 9, false)),
            (201, (100, 11, true)),
        ]));
        assert_eq!(spawned_rank(&lone, 201), None);
    }

    #[test]
    fn stat_and_command_lines() {
        let stat =
            b"4242 (py (x) y) S 77 4242 4242 0 -1 4194304 1 0 0 0 0 0 0 0 20 0 1 0 123456 0 0";
        assert_eq!(
            parse_stat(stat),
            Some(ProcessStat {
                parent: 77,
                started: 123456
            })
        );
        assert_eq!(parse_stat(b"4242 (py) S"), None);
        let spawned = b"/usr/bin/python3\0-c\0from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)\0--multiprocessing-fork\0";
        assert!(is_spawn_command(spawned));
        let tracker =
            b"/usr/bin/python3\0-c\0from multiprocessing.resource_tracker import main;main(5)\0";
        assert!(!is_spawn_command(tracker));
        assert!(!is_spawn_command(
            b"python3\0train.py\0--multiprocessing-fork\0"
        ));
    }

    /// The real thing: Python's spawn start method (as `torch.multiprocessing.spawn` uses),
    /// three children, each with a forked grandchild like a DataLoader worker.
    #[test]
    fn real_spawn_children_are_ranks() {
        let script = r#"
import multiprocessing as mp, os, sys, time
def until_orphaned():
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.05)
def rank(i, q):
    pid = os.fork()
    if pid == 0:
        until_orphaned()
        os._exit(0)
    q.put((i, os.getpid(), pid))
    until_orphaned()
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = []
    for i in range(3):
        p = ctx.Process(target=rank, args=(i, q), daemon=True)
        p.start()
        ps.append(p)
    for _ in range(3):
        print(*q.get(), flush=True)
    sys.stdin.read()
"#;
        // From a file: spawn children import the script's module to find `rank`.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spawn_ranks.py");
        std::fs::write(&path, script).unwrap();
        // A broken interpreter must fail the test, not hang it.
        let mut child = std::process::Command::new("timeout")
            .args(["60", "python3"])
            .arg(&path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
        let mut seen = Vec::new();
        for _ in 0..3 {
            let line = lines.next().expect("a line per rank").unwrap();
            let v: Vec<u32> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            seen.push((v[0], v[1], v[2]));
        }
        let launchers = Launchers::default();
        for (i, rank_pid, worker_pid) in seen {
            for pid in [rank_pid, worker_pid] {
                let found = launchers.rank_of(pid);
                assert_eq!((found.rank, found.world_size), (i, 3), "pid {pid}");
            }
        }
        // `timeout` and the script (its child) are no spawned rank.
        assert_eq!(launchers.rank_of(child.id()), JobRank::ALONE);
        // End of input: the script exits, its ranks and their workers follow.
        drop(child.stdin.take());
        child.wait().unwrap();
    }

    #[test]
    fn this_process_is_read_from_proc() {
        // The test runner has no launcher variables (CI would not set RANK for cargo).
        let tid = std::process::id();
        let launchers = Launchers::default();
        let expected = std::fs::read(format!("/proc/{tid}/environ"))
            .ok()
            .and_then(|e| parse(&e))
            .unwrap_or(JobRank::ALONE);
        assert_eq!(launchers.rank_of(tid), expected);
    }
}
