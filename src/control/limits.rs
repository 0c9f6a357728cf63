//! What the control channel lets one user hold, so that no user can exhaust the daemon or
//! lock the mount's owner and root out: connections (in all, per user, and a reserve only the
//! owner and root may take), the one large request in flight per class of user, and the
//! entries a user's connections have registered together.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

/// The channel's limits; [`Limits::default`] is what mounts use (tests shorten the times).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once: every rank of a node plus a few `stagefs` commands...
    pub connections: usize,
    /// ...of those, the most one user may hold...
    pub per_user: usize,
    /// ...and how many only the mount's owner and root may take, so that other users
    /// together can never shut them out.
    pub reserved: usize,
    /// A request must arrive whole within this time from its first byte: a client trickling
    /// bytes cannot hold its connection by sending one now and then.
    pub request_deadline: Duration,
    /// A reply must be taken within this time by a client that stopped reading.
    pub reply_deadline: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            connections: 64,
            per_user: 16,
            reserved: 16,
            // A 128 MiB request arrives in well under a second; the rest is room for waiting
            // behind another large request.
            request_deadline: Duration::from_secs(30),
            reply_deadline: Duration::from_secs(10),
        }
    }
}

/// Connections open: in all, per user, and of users other than the owner and root.
#[derive(Default)]
pub(super) struct Slots {
    per_user: HashMap<u32, usize>,
    total: usize,
    others: usize,
}

/// One connection's slot, given back when the connection ends.
pub(super) struct Slot {
    slots: Arc<Mutex<Slots>>,
    uid: u32,
    privileged: bool,
}

impl Slot {
    /// A slot for a connection of `uid` (`privileged`: the owner or root), if one is free.
    pub(super) fn take(
        slots: &Arc<Mutex<Slots>>,
        limits: &Limits,
        uid: u32,
        privileged: bool,
    ) -> Option<Slot> {
        let mut s = slots.lock();
        let mine = s.per_user.get(&uid).copied().unwrap_or(0);
        let others_full = s.others >= limits.connections.saturating_sub(limits.reserved);
        if s.total >= limits.connections || mine >= limits.per_user || (!privileged && others_full)
        {
            return None;
        }
        s.total += 1;
        s.others += usize::from(!privileged);
        *s.per_user.entry(uid).or_default() += 1;
        Some(Slot {
            slots: slots.clone(),
            uid,
            privileged,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.slots.lock();
        s.total -= 1;
        s.others -= usize::from(!self.privileged);
        if let Some(n) = s.per_user.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                s.per_user.remove(&self.uid);
            }
        }
    }
}

/// Requests longer than [`super::LARGE_REQUEST_BYTES`] are read and handled one at a time per
/// class of user, so that many clients cannot make the daemon hold many maximal requests,
/// and another user's never delays the owner's or root's.
#[derive(Default)]
pub(super) struct LargeRequests {
    privileged: Mutex<()>,
    others: Mutex<()>,
}

impl LargeRequests {
    pub(super) fn turn(&self, privileged: bool) -> &Mutex<()> {
        if privileged {
            &self.privileged
        } else {
            &self.others
        }
    }
}

/// Entries held per user over all their connections, within one budget per user.
pub(super) struct Held {
    budget: usize,
    per_user: Mutex<HashMap<u32, usize>>,
}

impl Held {
    pub(super) fn new(budget: usize) -> Held {
        Held {
            budget,
            per_user: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn budget(&self) -> usize {
        self.budget
    }

    /// Takes `n` more entries for `uid`, if that stays within the budget.
    pub(super) fn take(&self, uid: u32, n: usize) -> bool {
        let mut held = self.per_user.lock();
        let mine = held.entry(uid).or_default();
        if mine.saturating_add(n) > self.budget {
            return false;
        }
        *mine += n;
        true
    }

    /// Gives back `n` entries `uid` took.
    pub(super) fn give_back(&self, uid: u32, n: usize) {
        let mut held = self.per_user.lock();
        if let Some(mine) = held.get_mut(&uid) {
            *mine = mine.saturating_sub(n);
            if *mine == 0 {
                held.remove(&uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_users_never_take_the_reserve() {
        let limits = Limits {
            connections: 6,
            per_user: 3,
            reserved: 2,
            ..Limits::default()
        };
        let slots = Arc::new(Mutex::new(Slots::default()));
        let take = |uid, privileged| Slot::take(&slots, &limits, uid, privileged);
        let a: Vec<Slot> = (0..3).map_while(|_| take(1, false)).collect();
        assert_eq!(a.len(), 3, "one user's share");
        assert!(take(1, false).is_none());
        let b = take(2, false).unwrap();
        assert!(
            take(3, false).is_none(),
            "the rest is the owner's and root's"
        );
        let owner: Vec<Slot> = (0..2).map_while(|_| take(0, true)).collect();
        assert_eq!(owner.len(), 2);
        assert!(take(0, true).is_none(), "all taken");
        drop(b);
        let c = take(3, false);
        assert!(c.is_some(), "a shared slot freed is anyone's");
        assert!(take(4, false).is_none());
    }

    #[test]
    fn a_users_connections_share_one_budget() {
        let held = Held::new(10);
        assert!(held.take(7, 6));
        assert!(!held.take(7, 5), "over the budget");
        assert!(held.take(8, 10), "another user's own budget");
        held.give_back(7, 6);
        assert!(held.take(7, 10));
    }
}
