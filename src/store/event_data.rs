//! The `data` of a `text_delta` event, written directly: it is built once per streamed delta (the
//! hot path, thousands per second), so it is one string written in one pass, not a JSON value
//! tree serialized afterwards. Byte for byte what `serde_json` writes for `{"text": …}`.

/// `{"text":"<text, JSON-escaped>"}`.
pub fn text_delta(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 11);
    out.push_str("{\"text\":\"");
    escape_into(&mut out, text);
    out.push_str("\"}");
    out
}

/// Appends `s` escaped as the inside of a JSON string, as `serde_json` escapes it: `"` and `\`,
/// the short forms of `\b \t \n \f \r`, `\u00XX` for the other control characters; everything
/// else (including non-ASCII) as it is.
fn escape_into(out: &mut String, s: &str) {
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0x08 => "\\b",
            b'\t' => "\\t",
            b'\n' => "\\n",
            0x0c => "\\f",
            b'\r' => "\\r",
            0x00..=0x1f => "",
            _ => continue,
        };
        // `i` is at an ASCII byte, so both slices end on char boundaries.
        out.push_str(&s[start..i]);
        if short.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        } else {
            out.push_str(short);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_as_serde_json_does() {
        for s in ["", "plain", "q\"b\\s", "\u{0}\u{1}\u{8}\t\n\u{b}\u{c}\r\u{1f}\u{7f}", "é ✓ 🦀", "</script>\u{2028}"] {
            assert_eq!(text_delta(s), serde_json::json!({ "text": s }).to_string(), "{s:?}");
        }
    }

    proptest! {
        #[test]
        fn is_what_serde_json_writes(s in any::<String>(), ctl in proptest::collection::vec(0u8..0x20, 0..4)) {
            let s: String = s.chars().chain(ctl.into_iter().map(char::from)).collect();
            prop_assert_eq!(text_delta(&s), serde_json::json!({ "text": s }).to_string());
        }
    }
}
