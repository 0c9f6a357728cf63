//! Extended attributes: statistics and control under `user.stagefs.*`, the source's own
//! attributes passed through unchanged.
//!
//! Ours are answered by name but never listed, so `cp -a`, `rsync -X` and `getfattr -d` copy
//! or show only what the dataset itself carries (`getfattr -n NAME` still reads them).
//!
//! - root: `user.stagefs.stats` (one JSON object) and `user.stagefs.<key>` for each of its keys;
//!   `user.stagefs.epoch` is writable: the epoch the job (re)starts at; `user.stagefs.pid` is
//!   the daemon's process id (`stagefs unmount` waits for it to exit).
//! - a file: `user.stagefs.state` = `cached`, `staging` or `remote`.
//! - a directory: `user.stagefs.state` = `N/M cached` for its M files (not recursive).

use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;

use fuser::{Errno, ReplyEmpty, ReplyXattr};

use super::StageFs;
use crate::catalog::{FileId, Kind, ROOT};

pub const PREFIX: &str = "user.stagefs.";
/// Largest value we pass through from the source (Linux's own XATTR_SIZE_MAX).
const MAX_SOURCE_VALUE: usize = 64 * 1024;

/// Answers a size probe (`size == 0`), the value, or ERANGE when the caller's buffer is short.
fn reply_bytes(reply: ReplyXattr, size: u32, bytes: &[u8]) {
    if size == 0 {
        reply.size(bytes.len() as u32);
    } else if bytes.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(bytes);
    }
}

fn ours(fs: &StageFs, id: FileId, key: &str) -> Option<Vec<u8>> {
    let data = &fs.data;
    if id == ROOT {
        let snapshot = StageFs::snapshot(data, fs.passthrough.load(Ordering::Relaxed));
        let value = serde_json::to_value(&snapshot).expect("snapshot serializes");
        if key == "stats" {
            return Some(value.to_string().into_bytes());
        }
        if let Some(v) = value.get(key) {
            return Some(match v {
                serde_json::Value::String(s) => s.clone().into_bytes(),
                other => other.to_string().into_bytes(),
            });
        }
    }
    if id == ROOT && key == "pid" {
        return Some(std::process::id().to_string().into_bytes());
    }
    if key != "state" {
        return None;
    }
    let entry = data.catalog.entry(id)?;
    Some(match entry.kind {
        Kind::File => data.stager.file_state(id).as_bytes().to_vec(),
        Kind::Directory => {
            let catalog = &data.catalog;
            let files: Vec<FileId> = catalog
                .children(id)
                .filter(|&c| catalog.entry(c).is_some_and(|e| e.kind == Kind::File))
                .collect();
            format!(
                "{}/{} cached",
                data.stager.cached_count(files.iter().copied()),
                files.len()
            )
            .into_bytes()
        }
        Kind::Symlink => return None,
    })
}

pub(super) fn get(fs: &StageFs, id: FileId, name: &OsStr, size: u32, reply: ReplyXattr) {
    if fs.data.catalog.entry(id).is_none() {
        return reply.error(Errno::ENOENT);
    }
    if let Some(key) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) {
        return match ours(fs, id, key) {
            Some(v) => reply_bytes(reply, size, &v),
            None => reply.error(Errno::NO_XATTR),
        };
    }
    let path = fs.data.catalog.source_path(id);
    match source_xattr(&path, name) {
        Ok(v) => reply_bytes(reply, size, &v),
        Err(errno) => reply.error(Errno::from_i32(errno)),
    }
}

pub(super) fn list(fs: &StageFs, id: FileId, size: u32, reply: ReplyXattr) {
    if fs.data.catalog.entry(id).is_none() {
        return reply.error(Errno::ENOENT);
    }
    match source_list(&fs.data.catalog.source_path(id)) {
        Ok(names) => reply_bytes(reply, size, &names),
        Err(errno) => reply.error(Errno::from_i32(errno)),
    }
}

pub(super) fn set(fs: &StageFs, id: FileId, name: &OsStr, value: &[u8], reply: ReplyEmpty) {
    let Some(key) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else {
        return reply.error(Errno::EROFS);
    };
    if id != ROOT || key != "epoch" {
        return reply.error(Errno::EINVAL);
    }
    match parse_epoch(value) {
        Some(epoch) if fs.data.stager.plan_predicts() => {
            fs.data.stager.set_epoch(epoch);
            reply.ok();
        }
        _ => reply.error(Errno::EINVAL),
    }
}

/// An epoch as `setfattr -v 37` sends it: decimal digits, surrounding whitespace allowed.
pub fn parse_epoch(value: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(value).ok()?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn c_path(path: &std::path::Path) -> Result<CString, i32> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| libc::EINVAL)
}

/// Reads one attribute of the source entry itself (not following a final symlink).
fn source_xattr(path: &std::path::Path, name: &OsStr) -> Result<Vec<u8>, i32> {
    let p = c_path(path)?;
    let n = CString::new(name.as_bytes()).map_err(|_| libc::EINVAL)?;
    let mut buf = vec![0u8; MAX_SOURCE_VALUE];
    // SAFETY: valid C strings and a buffer of the stated length.
    let len =
        unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if len < 0 {
        return Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO));
    }
    buf.truncate(len as usize);
    Ok(buf)
}

fn source_list(path: &std::path::Path) -> Result<Vec<u8>, i32> {
    let p = c_path(path)?;
    let mut buf = vec![0u8; MAX_SOURCE_VALUE];
    // SAFETY: valid C string and a buffer of the stated length.
    let len = unsafe { libc::llistxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if len < 0 {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        // A source without xattr support simply has none.
        return if errno == libc::ENOTSUP {
            Ok(Vec::new())
        } else {
            Err(errno)
        };
    }
    buf.truncate(len as usize);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::parse_epoch;

    #[test]
    fn epoch_values() {
        assert_eq!(parse_epoch(b"37"), Some(37));
        assert_eq!(parse_epoch(b" 0\n"), Some(0));
        for junk in [
            &b""[..],
            b"-1",
            b"1e3",
            b"abc",
            b"99999999999999999999999",
            b"3 4",
            b"\xff",
        ] {
            assert_eq!(parse_epoch(junk), None, "{junk:?}");
        }
    }
}
