//! Whether a directory may be the cache: who owns it and every directory above it, who can
//! write there, and what it already holds. Refusals happen before anything is created,
//! emptied or chmod'ed, since stagefs runs as root on shared nodes (see the parent module).

use std::fs::{self, Metadata};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::{CacheError, LOCK, Manifest, OLD_MANIFEST, OWN_DIR, io_err, write_manifest};
use crate::files::open_nofollow;
use crate::sys::euid;

/// Creates a directory of stagefs's own (0700); one already there must be a real directory.
pub(super) fn mkdir_private(path: &Path) -> Result<(), CacheError> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let meta = fs::symlink_metadata(path).map_err(io_err(path))?;
            if meta.is_dir() {
                Ok(())
            } else {
                Err(CacheError::NotADirectory(path.to_path_buf()))
            }
        }
        other => other.map_err(io_err(path)),
    }
}

/// Whether others than the owner can write to a directory with this mode (a sticky
/// directory such as /tmp lets them add entries but not replace the owner's).
fn others_can_replace(mode: u32) -> bool {
    mode & 0o022 != 0 && mode & libc::S_ISVTX == 0
}

/// Checks, without changing anything, that the cache `root` (which need not exist yet) is
/// stagefs's to use: see [`CacheDir::open`]. Called before the daemon starts, so a refusal
/// reaches the user at once.
pub fn check_root(root: &Path) -> Result<(), CacheError> {
    check_parents(root)?;
    match fs::symlink_metadata(root) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(root)(e)),
        Ok(meta) => check_existing(root, &meta),
    }
}

/// Every directory above `root`, as written and with links resolved, must be changeable by
/// root or the daemon's user alone: anyone else could rename the cache away and put their
/// own directory in its place between two checks. (`stagefs bench` holds the directory it
/// works in to the same rule.)
pub fn check_parents(root: &Path) -> Result<(), CacheError> {
    let abs = std::path::absolute(root).map_err(io_err(root))?;
    let mut dirs: Vec<PathBuf> = abs.ancestors().skip(1).map(Path::to_path_buf).collect();
    if let Some(real) = dirs.iter().find_map(|d| fs::canonicalize(d).ok()) {
        dirs.extend(real.ancestors().map(Path::to_path_buf));
    }
    let uid = euid();
    for dir in dirs {
        let meta = match fs::metadata(&dir) {
            Ok(m) => m,
            // Not there yet: created by us, below a directory checked here.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&dir)(e)),
        };
        if (meta.uid() != 0 && meta.uid() != uid) || others_can_replace(meta.mode()) {
            return Err(CacheError::UnsafeParent {
                cache: root.to_path_buf(),
                dir,
                owner: meta.uid(),
                mode: meta.mode() & 0o7777,
            });
        }
    }
    Ok(())
}

/// An existing directory must be the daemon user's, private, and hold nothing but a valid
/// (or empty) stagefs directory.
fn check_existing(path: &Path, meta: &Metadata) -> Result<(), CacheError> {
    check_private_dir(path, meta)?;
    let mut foreign = None;
    for entry in fs::read_dir(path).map_err(io_err(path))? {
        let name = entry.map_err(io_err(path))?.file_name();
        if name == OLD_MANIFEST {
            return Err(CacheError::OldLayout(path.to_path_buf()));
        }
        if name != OWN_DIR {
            foreign.get_or_insert(name);
        }
    }
    if let Some(entry) = foreign {
        return Err(CacheError::Foreign {
            path: path.to_path_buf(),
            entry,
        });
    }
    let own = path.join(OWN_DIR);
    match fs::symlink_metadata(&own) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&own)(e)),
        Ok(meta) => {
            check_private_dir(&own, &meta)?;
            // Empty: created by a stagefs that stopped before writing the manifest.
            let empty = fs::read_dir(&own).map_err(io_err(&own))?.next().is_none();
            if empty || Manifest::read(&own).is_some() {
                Ok(())
            } else {
                Err(CacheError::NoManifest(path.to_path_buf()))
            }
        }
    }
}

/// A real directory (not a link) owned by the daemon's user and writable by no one else.
fn check_private_dir(path: &Path, meta: &Metadata) -> Result<(), CacheError> {
    if meta.file_type().is_symlink() {
        return Err(CacheError::Symlink(path.to_path_buf()));
    }
    if !meta.is_dir() {
        return Err(CacheError::NotADirectory(path.to_path_buf()));
    }
    if meta.uid() != euid() {
        return Err(CacheError::NotOwned {
            path: path.to_path_buf(),
            owner: meta.uid(),
            uid: euid(),
        });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(CacheError::Shared {
            path: path.to_path_buf(),
            mode: meta.mode() & 0o7777,
        });
    }
    Ok(())
}

/// The outermost directory of the cache this process created (the cache itself, or only
/// stagefs's own directory in it), with its device and inode.
static MADE_HERE: OnceLock<(PathBuf, u64, u64)> = OnceLock::new();

/// Removes what this process created of cache `root` after a mount failed, unless a daemon
/// holds the cache's lock: a refused mount leaves nothing behind, and never takes away a
/// directory another mount made or uses (two mounts started at once with one `--cache`).
pub fn remove_if_made_here(root: &Path) {
    let Some((made, dev, ino)) = MADE_HERE.get() else {
        return;
    };
    let Ok(meta) = fs::symlink_metadata(made) else {
        return;
    };
    if !meta.is_dir() || (meta.dev(), meta.ino()) != (*dev, *ino) {
        return;
    }
    // Held while removing: whoever else has it uses this cache.
    let lock = match open_nofollow(&root.join(OWN_DIR).join(LOCK)) {
        Ok(lock) => Some(lock),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(_) => return,
    };
    if lock.as_ref().is_some_and(|l| l.try_lock().is_err()) {
        return;
    }
    // Links inside are removed, never followed.
    let _ = fs::remove_dir_all(made);
}

/// Notes `dir` as made by this process, if none was before.
fn made_here(dir: &Path) -> Result<(), CacheError> {
    let meta = fs::symlink_metadata(dir).map_err(io_err(dir))?;
    let _ = MADE_HERE.set((dir.to_path_buf(), meta.dev(), meta.ino()));
    Ok(())
}

/// Checks `root` as [`check_root`] does and creates what is missing: CACHE itself (0700) and
/// stagefs's own directory with a manifest for `source`. Returns the own directory. Empties
/// nothing, so it may run before the cache lock is taken (the daemon's log lives there).
pub fn prepare(root: &Path, source: &Path) -> Result<PathBuf, CacheError> {
    check_parents(root)?;
    if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .map_err(io_err(parent))?;
    }
    // Made by this call, or there already (a link to a directory is refused just below).
    let made = match fs::DirBuilder::new().mode(0o700).create(root) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
        Err(e) => return Err(io_err(root)(e)),
    };
    check_existing(root, &fs::symlink_metadata(root).map_err(io_err(root))?)?;
    let own = root.join(OWN_DIR);
    let own_existed = fs::symlink_metadata(&own).is_ok();
    mkdir_private(&own)?;
    if made {
        made_here(root)?;
    } else if !own_existed {
        made_here(&own)?;
    }
    if Manifest::read(&own).is_none() {
        write_manifest(&own, source)?;
    }
    Ok(own)
}
