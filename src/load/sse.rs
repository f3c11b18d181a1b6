//! An incremental Server-Sent Events parser (pure; fed whatever byte chunks the HTTP body yields).
//!
//! The load driver reads thousands of streams at once, so it parses each chunk as it arrives
//! instead of buffering whole bodies: the time of each event is the time its bytes arrived, which
//! is what the latency percentiles measure. Lines end with `\n` or `\r\n`; a blank line ends an
//! event; comment lines (`: keep-alive`) and unknown fields are ignored, as the SSE spec says.

/// One event as sent: `id:`, `event:` and the joined `data:` lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawSseEvent {
    /// `id:`, when present.
    pub id: Option<String>,
    /// `event:` (the SSE default `message` when absent).
    pub event: String,
    /// The `data:` lines joined by `\n`.
    pub data: String,
}

/// Largest line the parser keeps: clawmux events are far smaller, and a stream that sends an
/// endless line must not grow the driver's memory without bound.
pub const MAX_LINE_BYTES: usize = 8 << 20;

/// Why a stream could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// A line longer than [`MAX_LINE_BYTES`].
    #[error("SSE line longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong,
    /// A line that is not UTF-8.
    #[error("SSE line is not UTF-8")]
    NotUtf8,
}

/// Parser state between chunks.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    id: Option<String>,
    event: Option<String>,
    data: Option<String>,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds a chunk; appends every event it completes to `out`.
    pub fn push(&mut self, chunk: &[u8], out: &mut Vec<RawSseEvent>) -> Result<(), SseError> {
        let mut rest = chunk;
        while let Some(pos) = rest.iter().position(|b| *b == b'\n') {
            self.line.extend_from_slice(&rest[..pos]);
            rest = &rest[pos + 1..];
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
            let line = std::mem::take(&mut self.line);
            self.on_line(&line, out)?;
        }
        self.line.extend_from_slice(rest);
        if self.line.len() > MAX_LINE_BYTES {
            return Err(SseError::LineTooLong);
        }
        Ok(())
    }

    fn on_line(&mut self, line: &[u8], out: &mut Vec<RawSseEvent>) -> Result<(), SseError> {
        if line.is_empty() {
            if self.data.is_some() || self.event.is_some() || self.id.is_some() {
                out.push(RawSseEvent {
                    id: self.id.take(),
                    event: self.event.take().unwrap_or_else(|| "message".to_owned()),
                    data: self.data.take().unwrap_or_default(),
                });
            }
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(());
        }
        let line = std::str::from_utf8(line).map_err(|_| SseError::NotUtf8)?;
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "id" => self.id = Some(value.to_owned()),
            "event" => self.event = Some(value.to_owned()),
            "data" => match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse_chunks(chunks: &[&[u8]]) -> Vec<RawSseEvent> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for c in chunks {
            p.push(c, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn events_split_across_chunks_at_any_byte() {
        let text = "id: 1\nevent: accepted\ndata: {\"a\":1}\n\n: keep-alive\n\nid: 2\r\nevent: text_delta\r\ndata: {\"text\":\"h\u{e9}\"}\r\n\r\n";
        let whole = parse_chunks(&[text.as_bytes()]);
        assert_eq!(whole.len(), 2);
        assert_eq!(whole[0], RawSseEvent { id: Some("1".into()), event: "accepted".into(), data: "{\"a\":1}".into() });
        assert_eq!(whole[1].data, "{\"text\":\"h\u{e9}\"}");
        for cut in 0..text.len() {
            let (a, b) = text.as_bytes().split_at(cut);
            assert_eq!(parse_chunks(&[a, b]), whole, "cut at {cut}");
        }
    }

    #[test]
    fn multi_line_data_is_joined() {
        let out = parse_chunks(&[b"data: a\ndata: b\n\n"]);
        assert_eq!(out[0].data, "a\nb");
        assert_eq!(out[0].event, "message");
    }

    #[test]
    fn endless_lines_are_refused() {
        let mut p = SseParser::new();
        let big = vec![b'x'; MAX_LINE_BYTES + 1];
        assert_eq!(p.push(&big, &mut Vec::new()), Err(SseError::LineTooLong));
    }
}
