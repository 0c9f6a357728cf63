//! Cold epochs: each epoch of a benchmark starts from storage, not memory, as a job's first
//! epoch on a fresh node would; and whether the benchmark's own files live in memory (tmpfs),
//! which the report warns about.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use super::opener::Opener;
use super::work::WorkDir;

/// Makes each epoch start from storage, not memory. As root the kernel's page cache is
/// dropped whole. Otherwise each file the benchmark reads is told to leave it
/// (`posix_fadvise(DONTNEED)`): the subset's files in SOURCE and every file under the
/// directories it wrote (the mount's cache, the copy), never through the mountpoint, where an
/// open would count as the job's. That frees their data, not the kernel's directory and inode
/// caches, so the note says so.
pub(super) struct ColdCache<'a> {
    pub(super) enabled: bool,
    /// Where the benchmark writes: dirty pages are written out before dropping.
    pub(super) work: &'a WorkDir,
    /// SOURCE's files, opened as a mount opens them, and the subset's paths in it.
    pub(super) source: Arc<Opener>,
    pub(super) paths: Arc<[PathBuf]>,
    /// Directories the benchmark writes files into, evicted whole (absent ones are skipped).
    pub(super) written: Vec<PathBuf>,
    /// What kept an epoch from starting cold, said once in the report.
    pub(super) problem: OnceLock<String>,
}

/// Where the kernel takes "drop clean caches" requests; 3 = page cache, dentries and inodes.
const DROP_CACHES: &str = "/proc/sys/vm/drop_caches";

impl ColdCache<'_> {
    pub(super) fn drop_page_cache(&self) {
        if !self.enabled {
            return;
        }
        if crate::sys::euid() == 0 {
            // Dirty pages are not dropped: write out the benchmark's first.
            if let Err(e) = self.work.sync() {
                log::debug!("syncing {}: {e}", self.work.path().display());
            }
            match fs::write(DROP_CACHES, "3") {
                Ok(()) => return,
                Err(e) => {
                    let _ = self.problem.set(format!(
                        "{DROP_CACHES}: {e}: the page cache was dropped file by file instead, which leaves directories and inodes cached"
                    ));
                }
            }
        } else {
            let _ = self.problem.set(
                "not root: the page cache was dropped file by file (posix_fadvise), which leaves directories and inodes cached, so opens may be faster than a cold job's"
                    .into(),
            );
        }
        let mut missed = 0u64;
        for (i, relative) in self.paths.iter().enumerate() {
            let file = self.source.open(i, relative);
            missed += u64::from(file.and_then(|f| evict(&f)).is_err());
        }
        for dir in &self.written {
            missed += evict_tree(dir);
        }
        if missed > 0 {
            log::debug!("{missed} files could not be evicted from the page cache");
        }
    }

    pub(super) fn note(&self) -> Option<String> {
        self.problem.get().cloned()
    }
}

/// Asks the kernel to drop `file`'s clean cached pages (dirty ones stay).
fn evict(file: &fs::File) -> io::Result<()> {
    crate::sys::drop_cached_pages(std::os::fd::AsFd::as_fd(file))
}

/// [`evict`] for every regular file under `dir`, written out first (the benchmark wrote
/// them, maybe just now); how many could not be.
fn evict_tree(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut missed = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        match entry.file_type() {
            Ok(t) if t.is_dir() => missed += evict_tree(&path),
            Ok(t) if t.is_file() => {
                let file = crate::files::open_nofollow(&path);
                let evicted = file.and_then(|f| f.sync_data().and_then(|()| evict(&f)));
                missed += u64::from(evicted.is_err());
            }
            _ => {}
        }
    }
    missed
}

/// Whether `path` is on a file system kept in memory (tmpfs, ramfs), as /tmp often is.
pub(super) fn in_memory(path: &Path) -> bool {
    crate::sys::statfs(path).is_ok_and(|st| [libc::TMPFS_MAGIC, RAMFS_MAGIC].contains(&st.f_type))
}

/// ramfs's statfs type (linux/magic.h), which the libc crate does not name.
const RAMFS_MAGIC: libc::__fsword_t = 0x858458f6u32 as libc::__fsword_t;

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `path` in the page cache, by mincore over a mapping of it.
    fn resident_pages(path: &Path) -> usize {
        let file = fs::File::open(path).unwrap();
        let len = file.metadata().unwrap().len() as usize;
        crate::sys::resident_pages(std::os::fd::AsFd::as_fd(&file), len).unwrap()
    }

    #[test]
    fn evicted_files_leave_the_page_cache_and_directories_are_walked() {
        // Not on tmpfs, whose pages are the files themselves.
        let tmp = std::env::temp_dir();
        let parent = if in_memory(&tmp) {
            "/var/tmp".into()
        } else {
            tmp
        };
        assert!(!in_memory(&parent), "{}", parent.display());
        let dir = tempfile::tempdir_in(parent).unwrap();
        let nested = dir.path().join("a/b");
        fs::create_dir_all(&nested).unwrap();
        let files = [dir.path().join("top"), nested.join("deep")];
        for f in &files {
            fs::write(f, vec![7u8; 1 << 20]).unwrap();
            fs::read(f).unwrap();
        }
        // Written just now, so dirty: evict_tree writes them out before evicting.
        assert_eq!(evict_tree(dir.path()), 0);
        for f in &files {
            assert_eq!(resident_pages(f), 0, "{}", f.display());
        }
        assert_eq!(evict_tree(&dir.path().join("absent")), 0);
    }

    #[test]
    fn tmpfs_is_memory() {
        assert!(in_memory(Path::new("/dev/shm")));
        assert!(!in_memory(Path::new("/proc/self")));
    }
}
