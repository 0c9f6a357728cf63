//! How the stager opens files on SOURCE.
//!
//! One seam between the engine and the parallel file system, so engine tests can inject the
//! faults a real one produces (errors, slowness) without a mount or a broken server.

use std::fs::File;
use std::io;
use std::path::Path;

pub trait Source: Send + Sync {
    fn open(&self, path: &Path) -> io::Result<File>;
}

/// The real thing: files opened on the mounted parallel file system.
pub struct LocalSource;

impl Source for LocalSource {
    fn open(&self, path: &Path) -> io::Result<File> {
        File::open(path)
    }
}
