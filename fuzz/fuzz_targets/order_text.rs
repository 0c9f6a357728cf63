//! `--order-file` contents: `parse_order_text` keeps exactly the index lines (blank lines and
//! `#` comments ignored), each a decimal u32, and an error names the first bad line.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs::order::{OrderError, parse_order_text};

/// A line's entry: the text before any `#`, trimmed; `None` if there is none.
fn entry(line: &str) -> Option<&str> {
    let e = line
        .split_once('#')
        .map_or(line, |(before, _)| before)
        .trim();
    (!e.is_empty()).then_some(e)
}

fn index(entry: &str) -> Option<u32> {
    if !entry.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    entry.parse().ok()
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let lines: Vec<&str> = text.lines().collect();
    match parse_order_text(text) {
        Ok(order) => {
            let want: Vec<u32> = lines
                .iter()
                .filter_map(|l| entry(l))
                .map(|e| index(e).expect("accepted line is an index"))
                .collect();
            assert_eq!(order, want);
            let rendered: String = order.iter().map(|i| format!("{i}\n")).collect();
            assert_eq!(parse_order_text(&rendered).unwrap(), order, "round trip");
        }
        Err(OrderError::OrderFileSyntax {
            line, text: bad, ..
        }) => {
            assert!(
                (1..=lines.len()).contains(&line),
                "line {line} of {}",
                lines.len()
            );
            assert_eq!(entry(lines[line - 1]), Some(bad.as_str()));
            assert_eq!(index(&bad), None, "line {line} ({bad:?}) is a valid index");
            for l in &lines[..line - 1] {
                assert!(
                    entry(l).is_none_or(|e| index(e).is_some()),
                    "earlier bad line {l:?}"
                );
            }
        }
        Err(other) => panic!("unexpected error kind: {other}"),
    }
});
