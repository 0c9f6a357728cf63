//! Parsers for user input that feeds the predictors: `--order-file` (an explicit access
//! order) and rank lists such as `0,2,4-6`.

use std::path::Path;

use super::OrderError;

/// More ranks than any node serves; stops a typo like `0-4000000000` from allocating gigabytes.
const MAX_RANKS: u64 = 1 << 16;

/// Reads an `--order-file`: one decimal index per line; blank lines and `#` comments (whole
/// line or after the index) are ignored. Errors name the file or the line.
pub fn parse_order_file(path: &Path) -> Result<Vec<u32>, OrderError> {
    let read_err = |source| OrderError::OrderFileRead {
        path: path.to_owned(),
        source,
    };
    let bytes = crate::input::read(path).map_err(read_err)?;
    let text = String::from_utf8(bytes).map_err(|_| {
        read_err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "it is not UTF-8 text",
        ))
    })?;
    parse_order_text(&text)
}

/// [`parse_order_file`] on text already in memory.
pub fn parse_order_text(text: &str) -> Result<Vec<u32>, OrderError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let entry = raw.split_once('#').map_or(raw, |(before, _)| before).trim();
        if entry.is_empty() {
            continue;
        }
        let syntax = |reason| OrderError::OrderFileSyntax {
            line: i + 1,
            text: entry.to_owned(),
            reason,
        };
        if !entry.bytes().all(|b| b.is_ascii_digit()) {
            return Err(syntax(
                "is not a decimal index (one non-negative integer per line)",
            ));
        }
        out.push(
            entry
                .parse()
                .map_err(|_| syntax("is too large (indices are at most 4294967295)"))?,
        );
    }
    Ok(out)
}

/// Parses a rank list: comma-separated ranks (`3`) and inclusive ranges (`0-7`). The result is
/// sorted and deduplicated.
pub fn parse_ranks(s: &str) -> Result<Vec<u32>, OrderError> {
    let bad = |reason: String| OrderError::BadRanks {
        input: s.to_owned(),
        reason,
    };
    let number = |t: &str| {
        let t = t.trim();
        if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(format!("{t:?} is not a rank number")));
        }
        t.parse::<u32>()
            .map_err(|_| bad(format!("{t} is too large for a rank")))
    };
    let mut ranks = Vec::new();
    for item in s.split(',') {
        let (lo, hi) = match item.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let r = number(item)?;
                (r, r)
            }
        };
        if lo > hi {
            return Err(bad(format!(
                "range {lo}-{hi} is reversed (write {hi}-{lo})"
            )));
        }
        if ranks.len() as u64 + u64::from(hi - lo) + 1 > MAX_RANKS {
            return Err(bad(format!("more than {MAX_RANKS} ranks")));
        }
        ranks.extend(lo..=hi);
    }
    ranks.sort_unstable();
    ranks.dedup();
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_file_that_is_not_text_is_one_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o.txt");
        std::fs::write(&path, b"0\n\xe9\n").unwrap();
        let err = parse_order_file(&path).unwrap_err().to_string();
        assert!(err.ends_with("o.txt: it is not UTF-8 text"), "{err}");
    }

    #[test]
    fn order_text_accepts_blanks_comments_and_crlf() {
        let text = "# header\n3\n\n  1  \r\n0 # first sample\n2";
        assert_eq!(parse_order_text(text).unwrap(), [3, 1, 0, 2]);
        assert_eq!(parse_order_text("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_order_text("4294967295\n").unwrap(), [u32::MAX]);
    }

    #[test]
    fn order_text_errors_name_the_line() {
        for (text, line, needle) in [
            ("1\n2\nabc\n", 3, "\"abc\" is not a decimal index"),
            ("1\n-2\n", 2, "\"-2\" is not a decimal index"),
            ("\n\n1 2\n", 3, "\"1 2\" is not a decimal index"),
            ("+1\n", 1, "not a decimal index"),
            ("0\n4294967296\n", 2, "too large"),
        ] {
            let msg = parse_order_text(text).unwrap_err().to_string();
            assert!(
                msg.starts_with(&format!("order file line {line}: ")),
                "{msg}"
            );
            assert!(msg.contains(needle), "{msg}");
        }
    }

    #[test]
    fn order_file_reads_and_reports_missing_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("order.txt");
        std::fs::write(&path, "5\n4\n").unwrap();
        assert_eq!(parse_order_file(&path).unwrap(), [5, 4]);
        let missing = dir.path().join("nope.txt");
        let msg = parse_order_file(&missing).unwrap_err().to_string();
        assert!(
            msg.starts_with("cannot read order file ") && msg.contains("nope.txt"),
            "{msg}"
        );
    }

    #[test]
    fn ranks_parse_sort_and_dedup() {
        assert_eq!(parse_ranks("3").unwrap(), [3]);
        assert_eq!(parse_ranks("0-7").unwrap(), (0..8).collect::<Vec<_>>());
        assert_eq!(parse_ranks("0,2,4-6").unwrap(), [0, 2, 4, 5, 6]);
        assert_eq!(parse_ranks(" 5 , 1-2,2 ").unwrap(), [1, 2, 5]);
    }

    #[test]
    fn ranks_reject_junk() {
        for (input, needle) in [
            ("", "\"\" is not a rank number"),
            ("1,,2", "\"\" is not a rank number"),
            ("a", "\"a\" is not a rank number"),
            ("-3", "\"\" is not a rank number"),
            ("1-2-3", "\"2-3\" is not a rank number"),
            ("7-0", "range 7-0 is reversed"),
            ("4294967296", "too large"),
            ("0-4000000000", "more than 65536 ranks"),
        ] {
            let msg = parse_ranks(input).unwrap_err().to_string();
            assert!(
                msg.starts_with(&format!("invalid rank list {input:?}: ")),
                "{msg}"
            );
            assert!(msg.contains(needle), "{input}: {msg}");
        }
    }
}
