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
pub enum StreamSlot {
    Predicted,
    Other(usize),
}

#[derive(Default)]
pub(super) struct Streams {
    /// The predicted stream's name, opens and misses, while something is predicted.
    predicted: Option<(String, Counts)>,
    /// Other streams by name: their opens and misses.
    others: Vec<(String, Counts)>,
}

#[derive(Clone, Copy, Default)]
struct Counts {
    opens: u64,
    misses: u64,
}

impl Streams {
    /// The prediction now follows the stream called `name` (`None`: nothing is predicted).
    /// What the one followed before counted goes on under its name, and what `name` counted
    /// before it was followed is its own: each stream keeps its opens wherever they counted.
    pub(super) fn follow(&mut self, name: Option<String>) {
        if self.predicted.as_ref().map(|(n, _)| n) == name.as_ref() {
            return;
        }
        if let Some((old, counts)) = self.predicted.take() {
            let slot = self.slot(old);
            self.add(slot, counts);
        }
        self.predicted = name.map(|name| {
            let counts = match self.others.iter().position(|(n, _)| *n == name) {
                Some(i) => self.others.remove(i).1,
                None => Counts::default(),
            };
            (name, counts)
        });
    }

    /// Counts an open of the predicted stream.
    pub(super) fn predicted_open(&mut self) -> StreamSlot {
        match &mut self.predicted {
            Some((_, counts)) => {
                counts.opens += 1;
                StreamSlot::Predicted
            }
            None => self.other_open(OTHER.into()),
        }
    }

    /// Counts an open of the stream called `name`.
    pub(super) fn other_open(&mut self, name: String) -> StreamSlot {
        let slot = self.slot(name);
        self.add(
            slot,
            Counts {
                opens: 1,
                misses: 0,
            },
        );
        slot
    }

    /// The slot of the other stream called `name`, made if new: past [`MAX_OTHER_STREAMS`],
    /// the catch-all.
    fn slot(&mut self, name: String) -> StreamSlot {
        if let Some(i) = self.others.iter().position(|(n, _)| *n == name) {
            return StreamSlot::Other(i);
        }
        if self.others.len() < MAX_OTHER_STREAMS {
            self.others.push((name, Counts::default()));
            return StreamSlot::Other(self.others.len() - 1);
        }
        if let Some(i) = self.others.iter().position(|(n, _)| n == OTHER) {
            return StreamSlot::Other(i);
        }
        // The last slot becomes the catch-all, keeping what it counted.
        let last = self.others.len() - 1;
        self.others[last].0 = OTHER.into();
        StreamSlot::Other(last)
    }

    fn add(&mut self, slot: StreamSlot, more: Counts) {
        let counts = match slot {
            StreamSlot::Predicted => match &mut self.predicted {
                Some((_, counts)) => counts,
                None => return,
            },
            StreamSlot::Other(i) => &mut self.others[i].1,
        };
        counts.opens += more.opens;
        counts.misses += more.misses;
    }

    /// The open counted under `slot` was a miss.
    pub(super) fn miss(&mut self, slot: StreamSlot) {
        self.add(
            slot,
            Counts {
                opens: 0,
                misses: 1,
            },
        );
    }

    /// Every stream that had opens, the predicted one first.
    pub(super) fn stats(&self) -> Vec<StreamStat> {
        let stat = |name: &str, c: &Counts, predicted: bool| StreamStat {
            name: name.to_string(),
            predicted,
            opens: c.opens,
            hits: c.opens - c.misses,
        };
        let predicted = self.predicted.iter().map(|(n, c)| stat(n, c, true));
        let others = self.others.iter().map(|(n, c)| stat(n, c, false));
        predicted
            .chain(others)
            .filter(|s| s.opens > 0 || s.predicted)
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
        s.follow(Some("train".into()));
        let p = s.predicted_open();
        s.miss(p);
        s.predicted_open();
        for i in 0..MAX_OTHER_STREAMS + 3 {
            let slot = s.other_open(format!("d{i}"));
            s.miss(slot);
        }
        let val = s.other_open("d0".into());
        assert_eq!(val, StreamSlot::Other(0));
        let stats = s.stats();
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

    /// Lightning's order: validation's sanity check is followed until training announces;
    /// then each keeps what it counted, under its own name.
    #[test]
    fn a_stream_keeps_its_opens_when_another_is_followed() {
        let mut s = Streams::default();
        s.other_open("train".into());
        s.follow(Some("val".into()));
        for _ in 0..3 {
            s.predicted_open();
        }
        s.follow(Some("train".into()));
        s.predicted_open();
        s.other_open("val".into());
        let got: Vec<(String, bool, u64)> = s
            .stats()
            .into_iter()
            .map(|t| (t.name, t.predicted, t.opens))
            .collect();
        assert_eq!(got, [("train".into(), true, 2), ("val".into(), false, 4)]);
        s.follow(None);
        assert!(s.stats().iter().all(|t| !t.predicted));
    }
}
