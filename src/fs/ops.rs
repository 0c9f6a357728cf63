//! How many requests of each kind the kernel sent the daemon (`user.stagefs.ops`, and `ops` in
//! the statistics): what shows whether a cache hit costs the reader FUSE round trips, and
//! which ones (issue #14). The FUSE adapter counts every request fuser hands it, answered or
//! not; fuser answers a few without the adapter (INIT, DESTROY, INTERRUPT, NOTIFY_REPLY and
//! opcodes it does not know), so those are not counted.
//!
//! Here rather than in the adapter so the names and the counting are tested without a mount.
//! One relaxed atomic add per request, no lock: the cost is nothing next to the round trip.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! ops {
    ($($variant:ident = $name:literal,)*) => {
        /// A request the kernel sends; named as fuser's `Filesystem` method that receives it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Op {
            $($variant,)*
        }

        impl Op {
            pub const ALL: &[Op] = &[$(Op::$variant,)*];

            pub fn name(self) -> &'static str {
                match self {
                    $(Op::$variant => $name,)*
                }
            }
        }
    };
}

ops! {
    Lookup = "lookup",
    Forget = "forget",
    Getattr = "getattr",
    Setattr = "setattr",
    Readlink = "readlink",
    Mknod = "mknod",
    Mkdir = "mkdir",
    Unlink = "unlink",
    Rmdir = "rmdir",
    Symlink = "symlink",
    Rename = "rename",
    Link = "link",
    Open = "open",
    Read = "read",
    Write = "write",
    Flush = "flush",
    Release = "release",
    Fsync = "fsync",
    Opendir = "opendir",
    Readdir = "readdir",
    Readdirplus = "readdirplus",
    Releasedir = "releasedir",
    Fsyncdir = "fsyncdir",
    Statfs = "statfs",
    Setxattr = "setxattr",
    Getxattr = "getxattr",
    Listxattr = "listxattr",
    Removexattr = "removexattr",
    Access = "access",
    Create = "create",
    Getlk = "getlk",
    Setlk = "setlk",
    Bmap = "bmap",
    Ioctl = "ioctl",
    Poll = "poll",
    Fallocate = "fallocate",
    Lseek = "lseek",
    CopyFileRange = "copy_file_range",
}

const COUNT: usize = Op::ALL.len();

/// One counter per [`Op`], since the mount started.
pub struct OpCounts([AtomicU64; COUNT]);

impl Default for OpCounts {
    fn default() -> OpCounts {
        OpCounts(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl OpCounts {
    pub fn count(&self, op: Op) {
        self.0[op as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, op: Op) -> u64 {
        self.0[op as usize].load(Ordering::Relaxed)
    }

    /// Every request kind by name, those never sent as 0 (so the keys do not depend on the
    /// workload).
    pub fn by_name(&self) -> BTreeMap<String, u64> {
        Op::ALL
            .iter()
            .map(|&op| (op.name().to_string(), self.get(op)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_has_its_own_counter_and_name() {
        let counts = OpCounts::default();
        for (i, &op) in Op::ALL.iter().enumerate() {
            assert_eq!(op as usize, i, "{op:?} indexes its own slot");
            for _ in 0..=i {
                counts.count(op);
            }
        }
        let names = counts.by_name();
        assert_eq!(names.len(), COUNT, "names are distinct");
        for (i, &op) in Op::ALL.iter().enumerate() {
            assert_eq!(names[op.name()], i as u64 + 1, "{op:?}");
        }
        assert!(Op::ALL.iter().all(|op| {
            let n = op.name();
            !n.is_empty() && n.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        }));
    }
}
