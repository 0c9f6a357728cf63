//! Reading and writing whole files safely, for any module that keeps a file of its own (the
//! cache's manifest, the catalog index, the metrics file): opening without following links,
//! and replacing a file atomically. A leaf, below everything that writes files, so the catalog
//! and stats need not reach up into the cache for it.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Opens an existing file for reading; a symbolic link is an error (ELOOP).
pub fn open_nofollow(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Writes `bytes` to `path` via a temporary file and rename, so readers see the old or the
/// new content, never a mix. `mode` is the new file's permission bits (before the umask).
pub fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    write_atomically_with(path, mode, |mut f| f.write_all(bytes))
}

/// [`write_atomically`] for content that `write` streams into the temporary file.
pub fn write_atomically_with(
    path: &Path,
    mode: u32,
    write: impl FnOnce(&File) -> io::Result<()>,
) -> io::Result<()> {
    // A new file under a random name, created exclusively: nothing planted under a
    // predictable name (a link, a FIFO that would block the writer, another user's file)
    // can be opened instead. Removed again if anything fails before the rename.
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .permissions(fs::Permissions::from_mode(mode))
        .tempfile_in(dir)?;
    write(tmp.as_file())?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}
