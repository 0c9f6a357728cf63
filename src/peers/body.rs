//! A response body fed chunk by chunk from a blocking reader: at most two chunks queued per
//! stream, so a slow fetcher holds the reader, not the server's memory. The body holds the
//! transfer's permits (released when hyper drops it: sent, or the stream or connection gone)
//! and reports progress to its connection's watchdog.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use super::server::Progress;

/// Chunks a response is sent in: large enough for few frames per file, small enough that the
/// transfers allowed at once stay under 50 MB.
pub const CHUNK: usize = 256 << 10;
/// Chunks read ahead of the connection.
const IN_FLIGHT: usize = 2;

pub struct ChunkBody {
    rx: mpsc::Receiver<io::Result<Bytes>>,
    progress: Arc<Progress>,
    _permits: Vec<OwnedSemaphorePermit>,
}

impl ChunkBody {
    /// A body and the sender that feeds it (from a blocking thread: `blocking_send`).
    pub fn channel(
        progress: Arc<Progress>,
        permits: Vec<OwnedSemaphorePermit>,
    ) -> (mpsc::Sender<io::Result<Bytes>>, ChunkBody) {
        let (tx, rx) = mpsc::channel(IN_FLIGHT);
        progress.started();
        let body = ChunkBody {
            rx,
            progress,
            _permits: permits,
        };
        (tx, body)
    }
}

impl Body for ChunkBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let polled = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            self.progress.moved();
        }
        polled.map(|chunk| chunk.map(|r| r.map(Frame::data)))
    }
}

impl Drop for ChunkBody {
    fn drop(&mut self) {
        self.progress.ended();
    }
}
