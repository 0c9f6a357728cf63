//! `stagefs feed-env`: prints the shell lines that turn the feed hook on in every Python
//! process the job starts (`eval "$(stagefs feed-env)"`), so an unmodified training script
//! announces its samplers' orders to a `--sampler feed` mount.
//!
//! The hook is a `sitecustomize` on `PYTHONPATH`: launchers (torchrun, srun, accelerate,
//! Lightning) pass the environment to every rank, where a file-based flag could not reach.
//! The hook's files are part of this binary, so its version always matches the daemon's; an
//! installed copy (`install.sh`) or the checkout's `python/` is used when it is the same,
//! otherwise the files are written once to a per-user directory named by their digest.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use sha2::{Digest, Sha256};

/// The hook as shipped: (path under the PYTHONPATH entry, contents).
const HOOK_FILES: [(&str, &str); 3] = [
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

/// A directory holding exactly this binary's hook.
fn hook_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the stagefs binary")?;
    let beside = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    // Installed (PREFIX/bin → PREFIX/lib/stagefs/python), then a checkout (target/release).
    for candidate in [
        beside.join("../lib/stagefs/python"),
        beside.join("../../python"),
    ] {
        if holds_hook(&candidate) {
            return Ok(fs::canonicalize(&candidate).unwrap_or(candidate));
        }
    }
    extract_into(&cache_base())
}

fn holds_hook(dir: &Path) -> bool {
    HOOK_FILES
        .iter()
        .all(|(name, text)| fs::read(dir.join(name)).is_ok_and(|b| b == text.as_bytes()))
}

/// `$XDG_CACHE_HOME/stagefs`, else `~/.cache/stagefs`, else a per-user directory in /tmp.
fn cache_base() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(format!("/tmp/stagefs-{}", crate::sys::euid())))
        .join("stagefs")
}

/// Writes the hook to `base/python-DIGEST`, complete before it is visible: built aside, then
/// renamed into place.
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
    if holds_hook(&dir) {
        return Ok(dir);
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(base)
        .with_context(|| format!("cannot create {}", base.display()))?;
    let temp = tempfile::Builder::new()
        .prefix(".python-")
        .tempdir_in(base)
        .with_context(|| format!("cannot write in {}", base.display()))?;
    for (name, text) in HOOK_FILES {
        let path = temp.path().join(name);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let staged = temp.keep();
    if let Err(e) = fs::rename(&staged, &dir) {
        let _ = fs::remove_dir_all(&staged);
        // Another `feed-env` won the race with the same files.
        if !holds_hook(&dir) {
            return Err(e).with_context(|| format!("cannot create {}", dir.display()));
        }
    }
    Ok(dir)
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
}
