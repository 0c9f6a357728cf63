//! Opens counted per stream. A job reads more than the dataset it trains on: a validation set
//! between epochs, label files, a test set at the end. Only the predicted stream's opens are
//! judged against the prediction; the others are served on demand and counted here, under the
//! dataset they come from, so `stagefs stats` shows where every open went.

use crate::catalog::{Catalog, FileId, ROOT};
use crate::stats::StreamStat;

/// Streams told apart besides the predicted one; opens of any further one count as `other`.
const MAX_OTHER_STREAMS: usize = 16;
/// The name of opens past [`MAX_OTHER_STREAMS`].
const OTHER: &str = "(other)";

/// Which stream an open counted under (to count its miss under it too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StreamSlot {
    Predicted,
    Other(usize),
}

#[derive(Default)]
pub(super) struct Streams {
    /// The predicted stream's opens and misses.
    predicted: Counts,
    /// Other streams by name: their opens and misses.
    others: Vec<(String, Counts)>,
}

#[derive(Clone, Copy, Default)]
struct Counts {
    opens: u64,
    misses: u64,
}

impl Streams {
    /// Counts an open of the predicted stream.
    pub(super) fn predicted_open(&mut self) -> StreamSlot {
        self.predicted.opens += 1;
        StreamSlot::Predicted
    }

    /// Counts an open of the stream called `name`.
    pub(super) fn other_open(&mut self, name: String) -> StreamSlot {
        let i = match self.others.iter().position(|(n, _)| *n == name) {
            Some(i) => i,
            None if self.others.len() < MAX_OTHER_STREAMS => {
                self.others.push((name, Counts::default()));
                self.others.len() - 1
            }
            None => match self.others.iter().position(|(n, _)| n == OTHER) {
                Some(i) => i,
                None => {
                    // The last slot becomes the catch-all, keeping what it counted.
                    let last = self.others.len() - 1;
                    self.others[last].0 = OTHER.into();
                    last
                }
            },
        };
        self.others[i].1.opens += 1;
        StreamSlot::Other(i)
    }

    /// The open counted under `slot` was a miss.
    pub(super) fn miss(&mut self, slot: StreamSlot) {
        match slot {
            StreamSlot::Predicted => self.predicted.misses += 1,
            StreamSlot::Other(i) => self.others[i].1.misses += 1,
        }
    }

    /// Every stream that had opens, the predicted one (named `predicted_name`) first.
    pub(super) fn stats(&self, predicted_name: &str) -> Vec<StreamStat> {
        let stat = |name: &str, c: &Counts, predicted: bool| StreamStat {
            name: name.to_string(),
            predicted,
            opens: c.opens,
            hits: c.opens - c.misses,
        };
        (self.predicted.opens > 0)
            .then(|| stat(predicted_name, &self.predicted, true))
            .into_iter()
            .chain(self.others.iter().map(|(n, c)| stat(n, c, false)))
            .collect()
    }
}

/// The dataset an open of `file` outside the predicted stream most likely comes from: the
/// directory above its class folder, as for an `ImageFolder` (`val/cat/1.jpg` is `val`'s),
/// or SOURCE for a file near the top.
pub(super) fn dataset_of(catalog: &Catalog, file: FileId) -> FileId {
    let parent = |id: FileId| catalog.entry(id).map_or(ROOT, |e| e.parent);
    match parent(file) {
        ROOT => ROOT,
        class => parent(class),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_beyond_the_bound_count_as_other_and_misses_go_where_their_open_went() {
        let mut s = Streams::default();
        let p = s.predicted_open();
        s.miss(p);
        s.predicted_open();
        for i in 0..MAX_OTHER_STREAMS + 3 {
            let slot = s.other_open(format!("d{i}"));
            s.miss(slot);
        }
        let val = s.other_open("d0".into());
        assert_eq!(val, StreamSlot::Other(0));
        let stats = s.stats("train");
        assert_eq!(
            (
                stats[0].name.as_str(),
                stats[0].predicted,
                stats[0].opens,
                stats[0].hits
            ),
            ("train", true, 2, 1)
        );
        assert_eq!((stats[1].opens, stats[1].hits), (2, 1));
        let other = stats.iter().find(|s| s.name == OTHER).unwrap();
        assert_eq!((other.opens, other.hits), (4, 0));
        assert_eq!(stats.len(), 1 + MAX_OTHER_STREAMS);
    }
}
