//! Parsing the sizes, counts and durations users type: `200G`, `500M`, `1.5T`, `4096`, `2s`,
//! `500ms`.

use std::time::Duration;

use crate::daemon::Lookahead;

/// Byte multipliers, binary as `df -h` and `du -h` mean them.
const UNITS: &[(&str, u64)] = &[
    ("K", 1 << 10),
    ("M", 1 << 20),
    ("G", 1 << 30),
    ("T", 1 << 40),
    ("P", 1 << 50),
];

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "'{input}' is not a size: use a number with an optional K, M, G, T or P suffix (powers of 1024), e.g. 500M or 1.5T"
)]
pub struct SizeError {
    input: String,
}

/// Parses a byte size. Suffixes may be followed by `i`/`iB`/`B` (`10GiB`, `10GB`), all binary.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = || SizeError {
        input: input.to_string(),
    };
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return Err(err());
    }
    let unit = unit.trim_start();
    let multiplier = if unit.is_empty() || unit.eq_ignore_ascii_case("b") {
        1
    } else {
        let upper = unit.to_ascii_uppercase();
        // One suffix at most: "5KBB" or "9MIBB" are typos, not sizes.
        let letter = ["IB", "I", "B"]
            .iter()
            .find_map(|suffix| upper.strip_suffix(suffix))
            .unwrap_or(&upper);
        UNITS
            .iter()
            .find(|(u, _)| *u == letter)
            .map(|(_, m)| *m)
            .ok_or_else(err)?
    };
    let bytes = match number.split_once('.') {
        None => number
            .parse::<u64>()
            .map_err(|_| err())?
            .checked_mul(multiplier)
            .ok_or_else(err)?,
        Some(_) => {
            let value: f64 = number.parse().map_err(|_| err())?;
            let bytes = value * multiplier as f64;
            if !bytes.is_finite() || bytes >= u64::MAX as f64 {
                return Err(err());
            }
            bytes.round() as u64
        }
    };
    Ok(bytes)
}

/// Why a `--lookahead` value is not one.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum LookaheadError {
    #[error("'{0}' is too large")]
    TooLarge(String),
    #[error("'{0}' is neither a file count (e.g. 5000) nor a size (e.g. 20G)")]
    Neither(String),
}

/// `--lookahead`: a plain number counts files, a size (with a unit) bounds bytes.
pub fn parse_lookahead(input: &str) -> Result<Lookahead, LookaheadError> {
    let s = input.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .map(Lookahead::Files)
            .map_err(|_| LookaheadError::TooLarge(input.to_string()));
    }
    parse_size(s)
        .map(Lookahead::Bytes)
        .map_err(|_| LookaheadError::Neither(input.to_string()))
}

/// A duration such as `2s`, `500ms` or `3` (seconds), between 1 ms and an hour.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.strip_suffix("ms") {
        Some(n) => (n, Duration::from_millis(1)),
        None => (
            text.strip_suffix('s').unwrap_or(text),
            Duration::from_secs(1),
        ),
    };
    let n: u32 = (number.trim().parse())
        .map_err(|_| format!("{text:?} is not a duration; give e.g. 2s or 500ms"))?;
    let duration = unit * n;
    if duration < Duration::from_millis(1) || duration > Duration::from_secs(3600) {
        return Err(format!("{text}: give between 1ms and 3600s"));
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("500M"), Ok(500 << 20));
        assert_eq!(parse_size("200G"), Ok(200 << 30));
        assert_eq!(parse_size("1.5T"), Ok(3 << 39));
        assert_eq!(parse_size("10GiB"), Ok(10 << 30));
        assert_eq!(parse_size("10gb"), Ok(10 << 30));
        assert_eq!(parse_size("7 K"), Ok(7 << 10));
        assert_eq!(parse_size("0"), Ok(0));
        for bad in [
            "",
            "G",
            "12QB",
            "-5M",
            "1.2.3G",
            "5MM",
            ".5G",
            "5.G",
            "99999999999999999999",
            "16384P",
            "1e9",
            "NaN",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    /// Found by fuzz/size: repeated suffix letters were all stripped, so "9MIBB" was 9 MiB.
    #[test]
    fn one_suffix_only() {
        assert_eq!(parse_size("9Ki"), Ok(9 << 10));
        for bad in ["9MIBB", "5KBB", "5KII", "5IB", "5BB", "5KIBIB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lookahead() {
        assert_eq!(parse_lookahead("5000"), Ok(Lookahead::Files(5000)));
        assert_eq!(parse_lookahead("20G"), Ok(Lookahead::Bytes(20 << 30)));
        assert!(parse_lookahead("lots").is_err());
    }
}
