//! An ImageNet-shaped tree that exists only in memory, for the scale benchmarks: a
//! [`Lister`] answering as a file system would, so millions of entries cost no disk.

// Each example compiles its own copy and uses part of it.
#![allow(dead_code)]

use std::ffi::OsString;
use std::path::Path;

use stagefs::catalog::{Kind, Lister, Scanned};

/// `files` samples spread evenly over `classes` folders, named like ImageNet's.
pub struct Synthetic {
    pub files: u64,
    pub classes: u64,
    /// Size of file `i`.
    pub size_of: fn(u64) -> u64,
    /// Every entry's mtime, seconds.
    pub mtime_secs: i64,
    /// Every entry's identity (see `stagefs::catalog::identity`).
    pub identity: u64,
}

impl Synthetic {
    /// Sizes spread around ImageNet's ~110 KB mean.
    pub fn imagenet_like(files: u64, classes: u64) -> Synthetic {
        Synthetic {
            files,
            classes,
            size_of: |i| 20_000 + i * 2654435761 % 180_000,
            mtime_secs: 1_600_000_000,
            identity: 0,
        }
    }

    /// Relative path of sample `i`.
    pub fn path(&self, i: u64) -> String {
        let class = (0..self.classes)
            .find(|&c| (c + 1) * self.files / self.classes > i)
            .unwrap();
        format!("n{class:08}/n{class:08}_{i}.JPEG")
    }

    fn entry(&self, name: String, kind: Kind, size: u64) -> Scanned {
        Scanned {
            name: OsString::from(name),
            kind,
            perm: 0o644,
            uid: 1000,
            gid: 1000,
            size,
            mtime_secs: self.mtime_secs,
            mtime_nanos: 0,
            identity: self.identity,
            link_target: None,
        }
    }
}

impl Lister for Synthetic {
    fn root(&self) -> Scanned {
        self.entry(String::new(), Kind::Directory, 0)
    }

    fn list(&self, dir: &Path) -> Vec<Scanned> {
        if dir.as_os_str().is_empty() {
            return (0..self.classes)
                .map(|c| self.entry(format!("n{c:08}"), Kind::Directory, 0))
                .collect();
        }
        let class: u64 = dir.to_str().unwrap()[1..].parse().unwrap();
        let (lo, hi) = (
            class * self.files / self.classes,
            (class + 1) * self.files / self.classes,
        );
        (lo..hi)
            .map(|i| {
                self.entry(
                    format!("n{class:08}_{i}.JPEG"),
                    Kind::File,
                    (self.size_of)(i),
                )
            })
            .collect()
    }
}
