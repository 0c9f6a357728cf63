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
