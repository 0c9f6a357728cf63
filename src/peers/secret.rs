//! The job's secret: read from a file only the daemon's user can read, and kept as a key that
//! never travels. Requests and answers carry HMAC-SHA256 tags made with it (see [`super::auth`]):
//! a node proves it holds the key without showing it, so whoever listens at a peer's address
//! (a squatter on a port the daemon has not bound yet) learns nothing it could replay elsewhere
//! and cannot answer with bytes of its own.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

/// Shortest secret taken: 16 bytes (e.g. `head -c 32 /dev/urandom | base64`).
const MIN_SECRET: u64 = 16;
const MAX_SECRET: u64 = 4096;

/// The key the job's nodes sign with: SHA-256 of the secret, under its own name.
#[derive(Clone, PartialEq, Eq)]
pub struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("--peer-secret-file {0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("--peer-secret-file {0} is not a regular file")]
    NotAFile(PathBuf),
    #[error(
        "--peer-secret-file {path} belongs to uid {owner}, not to this stagefs (uid {uid}); use the job's own secret file"
    )]
    NotOwned { path: PathBuf, owner: u32, uid: u32 },
    #[error("--peer-secret-file {path} can be read by others (mode {mode:o}); chmod 600 {path}")]
    Shared { path: PathBuf, mode: u32 },
    #[error(
        "--peer-secret-file {0} must hold {MIN_SECRET} to {MAX_SECRET} bytes (e.g. head -c 32 /dev/urandom | base64 > FILE)"
    )]
    Length(PathBuf),
}

impl Key {
    /// The key of a secret (surrounding white space aside).
    pub fn of(secret: &[u8]) -> Key {
        let mut hasher = Sha256::new();
        hasher.update(b"stagefs peers key\0");
        hasher.update(secret.trim_ascii());
        Key(hasher.finalize().into())
    }

    /// Reads the secret in `path`: a regular file (not through a link, and opened without
    /// waiting, so a FIFO there cannot hold the mount) owned by `owner`, readable by nobody
    /// else, of 16 to 4096 bytes once trimmed.
    pub fn read(path: &Path, owner: u32) -> Result<Key, SecretError> {
        let io = |e| SecretError::Io(path.to_path_buf(), e);
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(SecretError::NotAFile(path.to_path_buf()));
        }
        if meta.uid() != owner {
            return Err(SecretError::NotOwned {
                path: path.to_path_buf(),
                owner: meta.uid(),
                uid: owner,
            });
        }
        if meta.mode() & 0o077 != 0 {
            return Err(SecretError::Shared {
                path: path.to_path_buf(),
                mode: meta.mode() & 0o7777,
            });
        }
        let mut secret = Vec::new();
        file.by_ref()
            .take(MAX_SECRET + 1)
            .read_to_end(&mut secret)
            .map_err(io)?;
        let len = secret.trim_ascii().len() as u64;
        if !(MIN_SECRET..=MAX_SECRET).contains(&len) {
            return Err(SecretError::Length(path.to_path_buf()));
        }
        Ok(Key::of(&secret))
    }

    /// The tag of `parts` (each length-prefixed, so no two lists of parts sign alike), in hex.
    pub fn sign(&self, parts: &[&[u8]]) -> String {
        let tag = self.mac(parts).finalize().into_bytes();
        tag.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `tag` (hex) is the tag of `parts`, compared in constant time.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let Some(bytes) = decode_hex(tag) else {
            return false;
        };
        self.mac(parts).verify_slice(&bytes).is_ok()
    }

    fn mac(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC takes a key of any length");
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }
}

/// The bytes of lowercase or uppercase hex, if it is hex.
pub fn decode_hex(hex: &[u8]) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    hex.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}
