//! The daemon's log: on stderr in the foreground, in a private file once detached (its stderr
//! is /dev/null then), with panics recorded there too.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::{MountConfig, MountError};

/// The log as every command sets it up: `RUST_LOG` if set, else `default` (a level), on stderr
/// unless the caller sends it elsewhere before `try_init`.
pub fn logger(default: &str) -> env_logger::Builder {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default))
}

/// Checks the cache directory as given (a link to one is refused, not resolved) before
/// anything is written, and sends a detached daemon's log to its file.
pub fn init(config: &MountConfig, detached: bool) -> Result<(), MountError> {
    let mut builder = logger("info");
    crate::cache::check_root(&config.cache)?;
    if detached {
        let path = log_file_path(config)?;
        builder.target(env_logger::Target::Pipe(Box::new(open_log(&path)?)));
    }
    let _ = builder.try_init();
    log_panics();
    Ok(())
}

/// `log_file` with its directory created, or the default in stagefs's own, private part of
/// the cache (created too).
fn log_file_path(config: &MountConfig) -> Result<PathBuf, MountError> {
    if let Some(path) = &config.log_file {
        if let Some(dir) = path.parent() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| MountError::LogDirectory {
                    path: dir.to_path_buf(),
                    source: e,
                })?;
        }
        return Ok(path.clone());
    }
    let source = fs::canonicalize(&config.source).map_err(|e| MountError::Source {
        path: config.source.clone(),
        source: e,
    })?;
    crate::cache::prepare(&config.cache, &source)?;
    Ok(crate::cache::log_path(&config.cache))
}

/// Opens the log for appending. It names the dataset's files: private like the cache. A link
/// is never followed: one planted there would make root append to its target. Non-blocking: a
/// FIFO planted there must not hold the mount.
fn open_log(path: &Path) -> Result<fs::File, MountError> {
    let file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => MountError::LogSymlink(path.to_path_buf()),
            // A FIFO with no reader, opened non-blocking for writing.
            Some(libc::ENXIO) => MountError::LogNotRegular(path.to_path_buf()),
            _ => MountError::LogOpen {
                path: path.to_path_buf(),
                source: e,
            },
        })?;
    let meta = file.metadata().map_err(|e| MountError::LogStat {
        path: path.to_path_buf(),
        source: e,
    })?;
    if !meta.is_file() {
        return Err(MountError::LogNotRegular(path.to_path_buf()));
    }
    if meta.uid() != crate::sys::euid() {
        return Err(MountError::LogNotOwned {
            path: path.to_path_buf(),
            uid: meta.uid(),
        });
    }
    Ok(file)
}

/// A detached daemon's stderr is /dev/null: panics go to the log as well, where they are seen.
fn log_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        log::error!("{info}");
        default(info);
    }));
}
