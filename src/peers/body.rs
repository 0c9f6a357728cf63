//! A response body fed chunk by chunk from a blocking reader: at most two chunks in flight
//! per stream, so a slow fetcher holds the reader, not the server's memory.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame};
use tokio::sync::mpsc;

/// Chunks a response is sent in: large enough for few frames per file, small enough that 64
/// concurrent reads stay under 50 MB.
pub const CHUNK: usize = 256 << 10;
/// Chunks read ahead of the connection.
const IN_FLIGHT: usize = 2;

pub struct ChunkBody {
    rx: mpsc::Receiver<io::Result<Bytes>>,
}

impl ChunkBody {
    /// A body and the sender that feeds it (from a blocking thread: `blocking_send`).
    pub fn channel() -> (mpsc::Sender<io::Result<Bytes>>, ChunkBody) {
        let (tx, rx) = mpsc::channel(IN_FLIGHT);
        (tx, ChunkBody { rx })
    }
}

impl Body for ChunkBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.rx
            .poll_recv(cx)
            .map(|chunk| chunk.map(|r| r.map(Frame::data)))
    }
}
