//! The job's secret: read from a file only the daemon's user can read, and kept as a token (its
//! SHA-256) that requests carry and servers compare in constant time.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::files::open_nofollow;

/// Shortest secret taken: 16 bytes (e.g. `head -c 32 /dev/urandom | base64`).
const MIN_SECRET: u64 = 16;
const MAX_SECRET: u64 = 4096;

/// What requests carry: the SHA-256 of the secret, in hex.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
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

impl Token {
    /// The token of a secret.
    pub fn of(secret: &[u8]) -> Token {
        let digest = Sha256::digest(secret.trim_ascii());
        Token(digest.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Reads the secret in `path`: a regular file (not through a link) owned by `owner`,
    /// readable by nobody else, of 16 to 4096 bytes once trimmed.
    pub fn read(path: &Path, owner: u32) -> Result<Token, SecretError> {
        let io = |e| SecretError::Io(path.to_path_buf(), e);
        let mut file = open_nofollow(path).map_err(io)?;
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
        Ok(Token::of(&secret))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `offered` is this token, in time independent of where they differ.
    pub fn matches(&self, offered: &[u8]) -> bool {
        let mine = self.0.as_bytes();
        if offered.len() != mine.len() {
            return false;
        }
        offered
            .iter()
            .zip(mine)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}
