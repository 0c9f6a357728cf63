//! How a node proves to another that it is one of the job's, without the key leaving it.
//!
//! Each connection starts with `GET /hello`: the server answers a fresh random challenge.
//! Every request on the connection then carries a sequence number and a proof, the HMAC of
//! (challenge, number, path) under the job's key; the server takes each number once
//! ([`Replays`]). The answer carries a seal, the HMAC of (challenge, number, path, status, and
//! for a copy its size, source identity and checksum): the fetching node keeps bytes only
//! from an answer sealed for its own request, and the bytes must hash to the sealed checksum.
//! So a process listening at a peer's address instead of the daemon (a squatter on a port not
//! yet bound) gets proofs good for nothing but its own challenge, and cannot answer with bytes
//! of its own; a recorded request cannot be replayed, on the same connection or another.

use std::io::Read;

use super::secret::Key;

pub const CHALLENGE_HEADER: &str = "x-stagefs-challenge";
pub const SEQ_HEADER: &str = "x-stagefs-seq";
pub const PROOF_HEADER: &str = "x-stagefs-proof";
pub const SEAL_HEADER: &str = "x-stagefs-seal";

/// Sequence numbers remembered below the highest taken: requests of one connection arrive
/// nearly in order (at most a few dozen in flight).
const REPLAY_WINDOW: u64 = 1024;

/// A fresh challenge: 16 random bytes, in hex.
pub fn challenge() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// What a request is: its connection's challenge, its number and its path.
#[derive(Clone, Copy)]
pub struct Request<'a> {
    pub challenge: &'a str,
    pub seq: u64,
    pub path: &'a str,
}

/// What an answer says, all of which the seal covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer<'a> {
    pub status: u16,
    /// `later`, `gone`, or empty.
    pub held: &'a str,
    pub size: u64,
    pub identity: u64,
    pub sum: u128,
}

impl Request<'_> {
    fn parts<'b>(&'b self, seq: &'b [u8; 8], kind: &'b [u8]) -> [&'b [u8]; 4] {
        [kind, self.challenge.as_bytes(), seq, self.path.as_bytes()]
    }

    pub fn proof(&self, key: &Key) -> String {
        let seq = self.seq.to_le_bytes();
        key.sign(&self.parts(&seq, b"request"))
    }

    pub fn is_proved_by(&self, key: &Key, proof: &[u8]) -> bool {
        let seq = self.seq.to_le_bytes();
        key.verify(&self.parts(&seq, b"request"), proof)
    }

    pub fn seal(&self, key: &Key, answer: &Answer) -> String {
        let seq = self.seq.to_le_bytes();
        let said = answer.bytes();
        let [a, b, c, d] = self.parts(&seq, b"answer");
        key.sign(&[a, b, c, d, &said, answer.held.as_bytes()])
    }

    pub fn is_sealed(&self, key: &Key, answer: &Answer, seal: &[u8]) -> bool {
        let seq = self.seq.to_le_bytes();
        let said = answer.bytes();
        let [a, b, c, d] = self.parts(&seq, b"answer");
        key.verify(&[a, b, c, d, &said, answer.held.as_bytes()], seal)
    }
}

impl Answer<'_> {
    fn bytes(&self) -> [u8; 2 + 8 + 8 + 16] {
        let mut out = [0u8; 34];
        out[..2].copy_from_slice(&self.status.to_le_bytes());
        out[2..10].copy_from_slice(&self.size.to_le_bytes());
        out[10..18].copy_from_slice(&self.identity.to_le_bytes());
        out[18..].copy_from_slice(&self.sum.to_le_bytes());
        out
    }
}

/// The sequence numbers a connection has taken: each once, none far below the highest.
#[derive(Default)]
pub struct Replays {
    highest: u64,
    /// Bit i: `highest - i` was taken.
    window: [u64; (REPLAY_WINDOW / 64) as usize],
}

impl Replays {
    /// Takes `seq` if it was not taken before (and is not too old to tell); 0 never is.
    pub fn take(&mut self, seq: u64) -> bool {
        if seq == 0 {
            return false;
        }
        if seq > self.highest {
            self.shift(seq - self.highest);
            self.highest = seq;
            self.window[0] |= 1;
            return true;
        }
        let back = self.highest - seq;
        if back >= REPLAY_WINDOW {
            return false;
        }
        let (word, bit) = ((back / 64) as usize, back % 64);
        let taken = self.window[word] & (1 << bit) != 0;
        self.window[word] |= 1 << bit;
        !taken
    }

    /// Moves the window `by` numbers up (bit i becomes bit i + by).
    fn shift(&mut self, by: u64) {
        if by >= REPLAY_WINDOW {
            self.window = Default::default();
            return;
        }
        let (words, bits) = ((by / 64) as usize, by % 64);
        for i in (0..self.window.len()).rev() {
            let from = i.checked_sub(words);
            let high = from.map_or(0, |f| self.window[f] << bits);
            let low = match from.and_then(|f| f.checked_sub(1)) {
                Some(g) if bits > 0 => self.window[g] >> (64 - bits),
                _ => 0,
            };
            self.window[i] = high | low;
        }
    }
}
