//! The control channel's messages: what a client may ask, parsed strictly (an unknown field is
//! an error, not ignored, so a typo never passes as a no-op), and the replies.

use std::os::fd::OwnedFd;

use serde::Deserialize;
use serde_json::{Map, Value};

/// One request line.
#[derive(Debug, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Registers a dataset's files, index by index, as paths relative to the mount's root
    /// (`null` for an index whose file is not on this mount). Answered with a handle that
    /// [`Request::Order`] names for the rest of the connection.
    Dataset { paths: Vec<Option<String>> },
    /// The order rank `rank` of `world_size` reads in `epoch` of one loader: indices into a
    /// registered dataset, or without one, sample indices of the mount's layout of the dataset
    /// at `root`. `current`: the rank is starting that epoch now (otherwise it is the next
    /// one, announced ahead). `root` (the dataset's directory under the mount, `.` for its
    /// root) and `shuffled` (whether the loader's sampler shuffles) tell the job's loaders
    /// apart: the mount follows the training loader's stream.
    Order {
        epoch: u64,
        rank: u32,
        world_size: u32,
        current: bool,
        #[serde(default)]
        dataset: Option<u64>,
        #[serde(default)]
        root: Option<String>,
        #[serde(default = "shuffled_by_default")]
        shuffled: bool,
        indices: Vec<u64>,
    },
    /// The whole of `epoch` of one loader, as a DistributedSampler splits it over the job's
    /// ranks: rank `r` of `world_size` reads `indices[r]`, `indices[r + world_size]`, ...
    /// Indices, `dataset`, `root` and `shuffled` as in [`Request::Order`]. A mount with peers
    /// asks for it in its reply to an order (`"world": true`): the job's files are placed on
    /// its nodes with it. Answered `"kept"`: false unless the mount has peers, follows this
    /// stream, and each of its ranks that announced `epoch` has its share in it.
    World {
        epoch: u64,
        world_size: u32,
        #[serde(default)]
        dataset: Option<u64>,
        #[serde(default)]
        root: Option<String>,
        #[serde(default = "shuffled_by_default")]
        shuffled: bool,
        indices: Vec<u64>,
    },
    /// The job (re)starts at `epoch` (`stagefs epoch`).
    Epoch { epoch: u64 },
    /// Opens `paths` (relative to the mount's root, at most [`MAX_BATCH`]) for reading, each
    /// decided as the caller's open through the mount would be, in this order: answered with
    /// `files`, one entry per path: the number of the descriptor sent with the reply for that
    /// file (read-only, its own offset), `{"errno": N}` for an open that failed as a FUSE
    /// open would have, or `null` where the caller must open through the mount (not a file
    /// of the catalog, or one the caller may not read: the mount answers it as it always
    /// does).
    Open { paths: Vec<String> },
    /// The job's hook found a dataset on the mount whose files it cannot map (a class it does
    /// not know): said in the statistics, so a mount waiting for announcements says why none
    /// come.
    Unmapped { dataset: String },
}

/// Most files one batch open takes: their descriptors travel in one message, and the kernel
/// takes at most 253 (SCM_MAX_FD) in one.
pub const MAX_BATCH: usize = 250;

/// An announcement that does not say is taken for the training loader's.
fn shuffled_by_default() -> bool {
    true
}

impl Request {
    pub fn parse(line: &[u8]) -> Result<Request, super::RequestError> {
        Ok(serde_json::from_slice(line)?)
    }
}

/// One reply line: `{"ok": true, ...}` or `{"ok": false, "error": "..."}`, and the
/// descriptors sent with it (a batch open's).
#[derive(Debug)]
pub struct Reply {
    fields: Map<String, Value>,
    pub fds: Vec<OwnedFd>,
}

impl Reply {
    pub fn ok() -> Reply {
        Reply::new(true)
    }

    pub fn error(why: &str) -> Reply {
        Reply::new(false).with("error", why)
    }

    fn new(ok: bool) -> Reply {
        let mut fields = Map::new();
        fields.insert("ok".into(), Value::Bool(ok));
        Reply {
            fields,
            fds: Vec::new(),
        }
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Reply {
        self.fields.insert(key.into(), value.into());
        self
    }

    pub fn to_line(&self) -> String {
        Value::Object(self.fields.clone()).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_strictly() {
        assert_eq!(
            Request::parse(br#"{"op":"epoch","epoch":3}"#).unwrap(),
            Request::Epoch { epoch: 3 }
        );
        let order =
            br#"{"op":"order","epoch":1,"rank":0,"world_size":2,"current":true,"indices":[2,0]}"#;
        assert_eq!(
            Request::parse(order).unwrap(),
            Request::Order {
                epoch: 1,
                rank: 0,
                world_size: 2,
                current: true,
                dataset: None,
                root: None,
                shuffled: true,
                indices: vec![2, 0]
            }
        );
        for bad in [
            &br#"{"op":"epoch","epoch":3,"typo":1}"#[..],
            br#"{"op":"epoch","epoch":-1}"#,
            br#"{"op":"launch"}"#,
            br#"{"op":"order","epoch":1}"#,
            b"not json",
        ] {
            assert!(
                Request::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn replies_are_one_json_line() {
        assert_eq!(
            Reply::ok().with("dataset", 4).to_line(),
            r#"{"dataset":4,"ok":true}"#
        );
        let err = Reply::error("no\nnewline").to_line();
        assert!(!err.contains('\n'));
        assert_eq!(serde_json::from_str::<Value>(&err).unwrap()["ok"], false);
    }
}
