//! An ImageNet-shaped tree that exists only in memory, for the scale benchmarks: a
//! [`Lister`] answering as a file system would, so millions of entries cost no disk.

// Each example compiles its own copy and uses part of it.
#![allow(dead_code)]

use std::ffi::OsString;
use std::io;
use std::path::Path;

use stagefs::catalog::{Attributes, Kind, Listed, Lister, Listing, Progress};

/// `files` samples spread evenly over `classes` folders, named like ImageNet's.
pub struct Synthetic {
    pub files: u64,
    pub classes: u64,
}

impl Synthetic {
    pub fn imagenet_like(files: u64, classes: u64) -> Synthetic {
        Synthetic { files, classes }
    }

    /// Relative path of sample `i`.
    pub fn path(&self, i: u64) -> String {
        let class = (0..self.classes)
            .find(|&c| (c + 1) * self.files / self.classes > i)
            .unwrap();
        format!("n{class:08}/n{class:08}_{i}.JPEG")
    }

    fn entry(name: String, kind: Kind) -> Listed {
        Listed {
            name: OsString::from(name),
            kind: Some(kind),
        }
    }
}

/// Every node's attributes: a directory at depth 0 or 1, a 100 KB file below.
fn attributes(path: &Path) -> Attributes {
    let file = path.components().count() == 2;
    Attributes {
        kind: if file { Kind::File } else { Kind::Directory },
        perm: if file { 0o644 } else { 0o755 },
        uid: 1000,
        gid: 1000,
        size: if file { 100_000 } else { 0 },
        mtime_secs: 1_600_000_000,
        mtime_nanos: 0,
        identity: 0,
    }
}

impl Lister for Synthetic {
    fn list(&self, dir: &Path, _: &Progress) -> io::Result<Listing> {
        let entries = if dir.as_os_str().is_empty() {
            (0..self.classes)
                .map(|c| Self::entry(format!("n{c:08}"), Kind::Directory))
                .collect()
        } else {
            let class: u64 = dir.to_str().unwrap()[1..].parse().unwrap();
            let (lo, hi) = (
                class * self.files / self.classes,
                (class + 1) * self.files / self.classes,
            );
            (lo..hi)
                .map(|i| Self::entry(format!("n{class:08}_{i}.JPEG"), Kind::File))
                .collect()
        };
        Ok(Listing {
            dir: attributes(dir),
            entries,
        })
    }

    fn lstat(&self, path: &Path) -> io::Result<Attributes> {
        Ok(attributes(path))
    }

    fn readlink(&self, _: &Path) -> io::Result<OsString> {
        Err(io::Error::from_raw_os_error(libc::EINVAL))
    }
}
