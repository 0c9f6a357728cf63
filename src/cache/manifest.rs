//! `manifest.json`: which SOURCE a cache holds copies of, so a remount reuses them only for
//! that SOURCE. Its own module because it is an on-disk format (fuzzed by
//! fuzz/cache_manifest), read before anything else in the cache is trusted.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CacheError, MANIFEST, io_err};
use crate::files::{open_nofollow, write_atomically};

const MANIFEST_FORMAT: u32 = 1;

/// What `manifest.json` records: which SOURCE the cached files are copies of.
#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub format: u32,
    #[serde(with = "path_bytes")]
    pub source: PathBuf,
}

/// SOURCE in the manifest: a JSON string when it is UTF-8 (as format 1 has always written
/// it), otherwise its bytes as an array of numbers. Linux paths are bytes; serde's own
/// `PathBuf` serialization refuses non-UTF-8 ones.
mod path_bytes {
    use std::ffi::OsString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    use std::path::{Path, PathBuf};

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
        match path.to_str() {
            Some(text) => s.serialize_str(text),
            None => s.collect_seq(path.as_os_str().as_bytes()),
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Text(String),
        Bytes(Vec<u8>),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        Ok(match Repr::deserialize(d)? {
            Repr::Text(text) => PathBuf::from(text),
            Repr::Bytes(bytes) => PathBuf::from(OsString::from_vec(bytes)),
        })
    }
}

impl Manifest {
    /// The manifest of a cache holding copies of `source`.
    pub fn for_source(source: &Path) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT,
            source: source.to_path_buf(),
        }
    }

    /// The file's content.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("a manifest serializes, whatever its path")
    }

    /// Reads a manifest as found on disk; anything that is not one (truncated, foreign,
    /// hand-edited) is `None`.
    pub fn parse(bytes: &[u8]) -> Option<Manifest> {
        serde_json::from_slice(bytes).ok()
    }

    /// Whether the files of a cache with this manifest may be reused for `source`.
    pub fn holds(&self, source: &Path) -> bool {
        self.format == MANIFEST_FORMAT && self.source == source
    }

    /// The manifest in the stagefs directory `own`, if there is a valid one (a link is not).
    pub(super) fn read(own: &Path) -> Option<Manifest> {
        let mut bytes = Vec::new();
        open_nofollow(&own.join(MANIFEST))
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .ok()?;
        Manifest::parse(&bytes)
    }
}

pub(super) fn write_manifest(own: &Path, source: &Path) -> Result<(), CacheError> {
    let path = own.join(MANIFEST);
    // Private like everything in the cache: it names the dataset.
    write_atomically(&path, &Manifest::for_source(source).to_bytes(), 0o600).map_err(io_err(&path))
}
