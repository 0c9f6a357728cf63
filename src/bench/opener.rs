//! How the benchmark opens the files it reads, copies and evicts. SOURCE's exactly as a mount
//! opens them ([`crate::stager::open_verified`]): beneath SOURCE's root held open, through no
//! link, non-blocking (a FIFO planted in SOURCE fails at once instead of holding a reader
//! forever), and checked against the catalog the subset was chosen from, so a file swapped
//! after the scan (for a link to another file, a FIFO, a device) is refused as changed. Its
//! own copy and the mount's files are opened beneath their directory the same way, and must
//! be regular files.

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::catalog::{Catalog, FileId};
use crate::stager::{LocalSource, Source, SourceError, SourceRoot, open_verified};

/// Where one method's files are opened (see the module's note).
pub enum Opener {
    /// SOURCE: sample i is catalog file `files[i]`.
    Source {
        root: LocalSource,
        catalog: Arc<Catalog>,
        files: Arc<[FileId]>,
    },
    /// A directory the benchmark made or mounted.
    Beneath(LocalSource),
}

impl Opener {
    /// SOURCE's root at `path`, for [`Opener::source`] (and whatever else reads SOURCE as the
    /// mount does).
    pub fn source_root(path: &Path) -> io::Result<LocalSource> {
        Ok(LocalSource::new(Arc::new(SourceRoot::open(path)?)))
    }

    /// SOURCE through `root`, listed into `catalog`; sample i is `files[i]`.
    pub fn source(root: LocalSource, catalog: Arc<Catalog>, files: Arc<[FileId]>) -> Opener {
        Opener::Source {
            root,
            catalog,
            files,
        }
    }

    /// The directory at `path`.
    pub fn beneath(path: &Path) -> io::Result<Opener> {
        Ok(Opener::Beneath(Self::source_root(path)?))
    }

    /// Opens sample `i`, at `relative` in the directory.
    pub fn open(&self, i: usize, relative: &Path) -> io::Result<File> {
        match self {
            Opener::Source {
                root,
                catalog,
                files,
            } => open_verified(root, catalog, files[i])
                .map(|(file, _)| file)
                .map_err(|e| match e {
                    SourceError::Changed { why, error, .. } => io::Error::new(
                        io::Error::from_raw_os_error(error.errno()).kind(),
                        format!("{why} since the benchmark chose its files"),
                    ),
                    SourceError::Io { source, .. } => source,
                }),
            Opener::Beneath(dir) => {
                let file = dir.open(relative)?;
                if !file.metadata()?.is_file() {
                    return Err(io::Error::other("not a regular file"));
                }
                Ok(file)
            }
        }
    }
}
