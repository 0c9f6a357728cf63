//! The cache's room: bytes used by complete copies and reserved by copies under way, the
//! capacity they must fit in (lowered when the cache file system turns out smaller, grown
//! back as it frees up), and the eviction index that says which copy goes first.
//!
//! Pure bookkeeping, tested without threads; the engine core applies it.

use super::eviction::Eviction;

/// Kept free on the cache file system when the capacity grows back after it was full, so the
/// next copy does not run straight into ENOSPC again.
const FULL_HEADROOM: u64 = 1 << 20;

pub struct Space {
    /// Bytes of complete copies.
    pub used: u64,
    /// Bytes of copies under way.
    pub reserved: u64,
    /// What used and reserved must fit in now.
    pub capacity: u64,
    /// What the user configured: the capacity never grows back past it.
    configured: u64,
    /// Which copy goes first (the policy knows when each is next needed, or last used).
    pub evict: Box<dyn Eviction>,
}

impl Space {
    pub fn new(capacity: u64, evict: Box<dyn Eviction>) -> Space {
        Space {
            used: 0,
            reserved: 0,
            capacity,
            configured: capacity,
            evict,
        }
    }

    /// Whether `bytes` more fit besides what is cached and being copied.
    pub fn fits(&self, bytes: u64) -> bool {
        self.used + self.reserved + bytes <= self.capacity
    }

    /// The cache file system was full: what it holds now is the limit. True if that lowered
    /// the capacity.
    pub fn full(&mut self) -> bool {
        let limit = self.used + self.reserved;
        let lowered = limit < self.capacity;
        self.capacity = self.capacity.min(limit);
        lowered
    }

    /// Whether the capacity is below what was configured (the file system was full).
    pub fn is_lowered(&self) -> bool {
        self.capacity < self.configured
    }

    /// Gives back capacity as the cache file system frees up (evicted files still open
    /// elsewhere keep their blocks until closed), up to what was configured. `free` is its
    /// free space. True if the capacity grew.
    pub fn regrow(&mut self, free: u64) -> bool {
        // Copies in flight are not counted: what they wrote so far is already missing from
        // `free`, and counting their full size as well could grow the capacity past the file
        // system's size (seen with 16 copies into an 8 MiB tmpfs).
        let room = (self.used + free.saturating_sub(FULL_HEADROOM)).min(self.configured);
        let grew = room > self.capacity;
        self.capacity = self.capacity.max(room);
        grew
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_lowers_the_capacity_and_free_space_gives_it_back_up_to_the_configured() {
        let mut s = Space::new(100 << 20, crate::stager::EvictionKind::Belady.policy());
        s.used = 30 << 20;
        s.reserved = 2 << 20;
        assert!(s.fits(68 << 20));
        assert!(!s.fits((68 << 20) + 1));
        assert!(s.full());
        assert_eq!(s.capacity, 32 << 20);
        assert!(s.is_lowered());
        assert!(!s.full(), "already at the limit");
        // 10 MiB free: back up to used + free - headroom (reserved bytes are in `free` already).
        assert!(s.regrow(10 << 20));
        assert_eq!(s.capacity, (40 << 20) - FULL_HEADROOM);
        assert!(!s.regrow(1 << 20), "never shrinks on less free space");
        assert!(s.regrow(1 << 40));
        assert_eq!(s.capacity, 100 << 20, "never past what was configured");
        assert!(!s.is_lowered());
    }
}
