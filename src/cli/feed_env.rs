//! `stagefs feed-env`: prints the shell lines that turn the feed hook on in every Python
//! process the job starts (`eval "$(stagefs feed-env)"`), so an unmodified training script
//! announces its samplers' orders to a `--sampler feed` mount.
//!
//! The hook is a `sitecustomize` on `PYTHONPATH`: launchers (torchrun, srun, accelerate,
//! Lightning) pass the environment to every rank, where a file-based flag could not reach.
//! The hook's files are part of this binary, so its version always matches the daemon's; an
//! installed copy (`install.sh`) or the checkout's `python/` is used when it is the same,
//! otherwise the files are written once to a per-user directory named by their digest, or,
//! where that directory cannot be trusted, to a fresh private one.
//!
//! Every Python process of the job imports from that directory before the standard library
//! (a `json.py` there would be everyone's `json`), as root if the job is root's. So a
//! directory is used by who could have put or change what is in it, never by its contents:
//! it and every directory above it must belong to root or this user and be writable by
//! nobody else (a sticky one such as /tmp above it only holds what is ours: others cannot
//! rename or remove it), and everything in it must belong to root or this user and be
//! writable by nobody else.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use sha2::{Digest, Sha256};

/// The hook as shipped: (path under the PYTHONPATH entry, contents).
const HOOK_FILES: [(&str, &str); 4] = [
    (
        "sitecustomize.py",
        include_str!("../../python/sitecustomize.py"),
    ),
    (
        "stagefs_feed/__init__.py",
        include_str!("../../python/stagefs_feed/__init__.py"),
    ),
    (
        "stagefs_feed/channel.py",
        include_str!("../../python/stagefs_feed/channel.py"),
    ),
    (
        "stagefs_feed/opens.py",
        include_str!("../../python/stagefs_feed/opens.py"),
    ),
];

/// What the hook reads to find the mount of a dataset that does not list its files.
const MOUNT_ENV: &str = "STAGEFS_FEED_MOUNT";

#[derive(Args, Debug)]
pub struct FeedEnvArgs {
    /// The mount that datasets not listing their files (no `samples`, `imgs` or `files`)
    /// announce to, as sample indices of its --layout
    pub mountpoint: Option<PathBuf>,
}

pub fn run(args: FeedEnvArgs) -> Result<()> {
    let dir = hook_dir()?;
    let mut out = format!(
        "export PYTHONPATH={}${{PYTHONPATH:+:$PYTHONPATH}}\n",
        shell_quote(&dir)
    );
    if let Some(mp) = &args.mountpoint {
        let mp = std::path::absolute(mp).with_context(|| format!("{}", mp.display()))?;
        super::stats_cmd::read_xattr(&mp, crate::fs::CONTROL_XATTR)?;
        out += &format!("export {MOUNT_ENV}={}\n", shell_quote(&mp));
    }
    print!("{out}");
    Ok(())
}

/// A directory holding exactly this binary's hook, which only root and this user can have
/// filled.
fn hook_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the stagefs binary")?;
    let beside = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    // Installed (PREFIX/bin → PREFIX/lib/stagefs/python), then a checkout (target/release).
    for candidate in [
        beside.join("../lib/stagefs/python"),
        beside.join("../../python"),
    ] {
        if let Ok(dir) = fs::canonicalize(&candidate)
            && trusted_hook(&dir)
        {
            return Ok(dir);
        }
    }
    extract()
}

/// Whether `dir` (without links) holds this binary's hook, and only what root and this user
/// put there (see the module's note).
fn trusted_hook(dir: &Path) -> bool {
    trusted(dir) && unshared_tree(dir, 0) && holds_hook(dir)
}

/// Whether everything under `dir` (a trusted directory) is a file or directory of root or
/// this user that nobody else may write. Hook directories are small: a deep or large tree is
/// not one.
fn unshared_tree(dir: &Path, depth: usize) -> bool {
    const MAX_DEPTH: usize = 3;
    const MAX_ENTRIES: usize = 256;
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    let mut seen = 0;
    entries.into_iter().all(|entry| {
        seen += 1;
        let Ok(entry) = entry else { return false };
        let Ok(m) = entry.path().symlink_metadata() else {
            return false;
        };
        seen <= MAX_ENTRIES
            && owned_unshared(&m)
            && (m.is_file()
                || (m.is_dir() && depth < MAX_DEPTH && unshared_tree(&entry.path(), depth + 1)))
    })
}

fn holds_hook(dir: &Path) -> bool {
    HOOK_FILES
        .iter()
        .all(|(name, text)| fs::read(dir.join(name)).is_ok_and(|b| b == text.as_bytes()))
}

/// Whether `m` belongs to root or this user, and only its owner may write it.
fn owned_unshared(m: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    (m.uid() == crate::sys::euid() || m.uid() == 0) && m.mode() & 0o022 == 0
}

/// `$XDG_CACHE_HOME/stagefs`, else `~/.cache/stagefs`; None without either.
fn cache_base() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|dir| dir.join("stagefs"))
}

/// The hook in `base/python-DIGEST` if `base` can be trusted (see [`trusted`]), else in a
/// fresh private directory of its own. Every Python process of the job imports from there
/// (before the standard library): a directory someone else could write to, or swap, would
/// run their code in the job, as root if the job is root's.
fn extract() -> Result<PathBuf> {
    if let Some(base) = cache_base() {
        // Created private where missing, then judged as it is.
        let _ = fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&base);
        if trusted(&base) {
            return extract_into(&base);
        }
    }
    let fresh = tempfile::Builder::new()
        .prefix("stagefs-python-")
        .tempdir()
        .context("cannot create a private directory for the feed hook")?
        .keep();
    write_hook(&fresh)?;
    Ok(fresh)
}

/// Whether `path` and every directory above it are real directories (not links), owned by
/// root or this user, and writable by no one else, except sticky ones such as /tmp above it
/// (there others cannot rename or remove what is ours, and the next directory down must be
/// ours too).
fn trusted(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(path) = std::path::absolute(path) else {
        return false;
    };
    path.ancestors().enumerate().all(|(depth, dir)| {
        fs::symlink_metadata(dir).is_ok_and(|m| {
            let ours = m.uid() == crate::sys::euid() || m.uid() == 0;
            let sticky = m.mode() & libc::S_ISVTX != 0;
            m.is_dir() && ours && (m.mode() & 0o022 == 0 || (depth > 0 && sticky))
        })
    })
}

/// Writes the hook to `base/python-DIGEST` (whose parents are trusted), complete before it is
/// visible: built aside, then renamed into place.
fn extract_into(base: &Path) -> Result<PathBuf> {
    let mut digest = Sha256::new();
    for (name, text) in HOOK_FILES {
        digest.update(name.as_bytes());
        digest.update(text.as_bytes());
    }
    let digest: String = digest.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = base.join(format!("python-{digest}"));
    if trusted_hook(&dir) {
        return Ok(dir);
    }
    let temp = tempfile::Builder::new()
        .prefix(".python-")
        .tempdir_in(base)
        .with_context(|| format!("cannot write in {}", base.display()))?;
    write_hook(temp.path())?;
    let staged = temp.keep();
    if let Err(e) = fs::rename(&staged, &dir) {
        let _ = fs::remove_dir_all(&staged);
        // Another `feed-env` won the race with the same files.
        if !trusted_hook(&dir) {
            return Err(e).with_context(|| format!("cannot create {}", dir.display()));
        }
    }
    Ok(dir)
}

/// The hook's files in `dir`, an empty directory of ours.
fn write_hook(dir: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .mode(0o755)
        .create(dir.join("stagefs_feed"))
        .with_context(|| format!("cannot write in {}", dir.display()))?;
    for (name, text) in HOOK_FILES {
        let path = dir.join(name);
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `path` in single quotes for sh, quotes inside escaped.
fn shell_quote(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_the_shell() {
        assert_eq!(shell_quote(Path::new("/a b/it's")), r"'/a b/it'\''s'");
    }

    #[test]
    fn the_checkout_holds_the_embedded_hook() {
        // The embedded copy is the checkout's: a hook edited without rebuilding is caught.
        let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
        assert!(holds_hook(&checkout));
    }

    #[test]
    fn extraction_is_complete_and_reused() {
        let home = tempfile::tempdir().unwrap();
        let dir = extract_into(home.path()).unwrap();
        assert!(holds_hook(&dir));
        assert_eq!(extract_into(home.path()).unwrap(), dir);
    }

    #[test]
    fn a_directory_others_could_write_or_swap_is_not_trusted() {
        use std::os::unix::fs::PermissionsExt;
        let home = tempfile::tempdir().unwrap();
        assert!(trusted(home.path()));
        let shared = home.path().join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(!trusted(&shared));
        fs::create_dir(shared.join("inside")).unwrap();
        assert!(
            !trusted(&shared.join("inside")),
            "a parent others can write"
        );
        let link = home.path().join("link");
        std::os::unix::fs::symlink(home.path(), &link).unwrap();
        assert!(!trusted(&link));
        // A planted copy with an extra module is not reused: a fresh one is written instead.
        let planted = extract_into(home.path()).unwrap();
        fs::set_permissions(
            planted.join("stagefs_feed"),
            fs::Permissions::from_mode(0o777),
        )
        .unwrap();
        assert!(!trusted(&planted.join("stagefs_feed")));
    }
}
