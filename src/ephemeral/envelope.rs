//! The JSON envelope `openclaw agent --local --json` prints on stdout (pure; the bytes are the
//! agent's, so untrusted): `{"payloads":[{"text",...}],"meta":{"agentMeta":{"usage"},"error",
//! "aborted"}}`. Only what clawmux needs is read; everything else may change between OpenClaw
//! versions without breaking runs. Anything that is not such an envelope is an error with the
//! reason, never a panic.

use serde::Deserialize;

/// What a run's envelope says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The payloads' texts, joined by blank lines (the run's answer).
    pub text: String,
    /// The agent's own error (`meta.error`), as a sentence.
    pub error: Option<String>,
    /// OpenClaw's token counts `(input, output)`: a hint, never billing truth.
    pub usage: Option<(u64, u64)>,
}

#[derive(Deserialize)]
struct Raw {
    payloads: Vec<RawPayload>,
    #[serde(default)]
    meta: Option<RawMeta>,
}

#[derive(Deserialize)]
struct RawPayload {
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawMeta {
    #[serde(default)]
    agent_meta: Option<RawAgentMeta>,
    #[serde(default)]
    error: Option<serde_json::Value>,
    #[serde(default)]
    aborted: Option<bool>,
}

#[derive(Deserialize)]
struct RawAgentMeta {
    #[serde(default)]
    usage: Option<RawUsage>,
}

#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    input: Option<u64>,
    #[serde(default)]
    output: Option<u64>,
}

/// Longest error text kept from the envelope (it ends up in the run document).
const MAX_ERROR_CHARS: usize = 2000;

/// Parses stdout. OpenClaw may log lines before the JSON on some paths: the envelope is the
/// text from the first line that starts with `{`.
pub fn parse(stdout: &[u8]) -> Result<Envelope, String> {
    let text = std::str::from_utf8(stdout).map_err(|e| format!("the agent's output is not UTF-8 ({e})"))?;
    let start = text
        .char_indices()
        .find(|&(i, c)| c == '{' && (i == 0 || text[..i].ends_with('\n')))
        .map(|(i, _)| i)
        .ok_or_else(|| if text.trim().is_empty() { "the agent printed nothing".to_owned() } else { "the agent's output holds no JSON envelope".to_owned() })?;
    let raw: Raw = serde_json::from_str(text[start..].trim_end()).map_err(|e| format!("the agent's JSON envelope is malformed: {e}"))?;
    let texts: Vec<&str> = raw.payloads.iter().filter_map(|p| p.text.as_deref()).filter(|t| !t.is_empty()).collect();
    let meta = raw.meta;
    let usage = meta.as_ref().and_then(|m| m.agent_meta.as_ref()).and_then(|a| a.usage.as_ref()).map(|u| (u.input.unwrap_or(0), u.output.unwrap_or(0)));
    let error = meta.as_ref().and_then(|m| match &m.error {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(v) => {
            let kind = v.get("kind").and_then(|k| k.as_str());
            let message = v.get("message").and_then(|k| k.as_str());
            Some(match (kind, message) {
                (Some(k), Some(m)) => format!("{k}: {m}"),
                (None, Some(m)) => m.to_owned(),
                (Some(k), None) => k.to_owned(),
                (None, None) => v.to_string(),
            })
        }
    });
    let error = error.or_else(|| (meta.as_ref().and_then(|m| m.aborted) == Some(true)).then(|| "the agent run was aborted".to_owned()));
    Ok(Envelope { text: texts.join("\n\n"), error: error.map(|e| e.chars().take(MAX_ERROR_CHARS).collect()), usage })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_real_envelope_of_openclaw_2026_9_6() {
        let out = br#"{"payloads":[{"text":"Reply to: hi | w1","mediaUrl":null}],"meta":{"durationMs":2723,"agentMeta":{"sessionId":"run-1","provider":"cogni","usage":{"input":7227,"output":8,"total":7235}},"aborted":false}}"#;
        let e = parse(out).expect("envelope");
        assert_eq!(e, Envelope { text: "Reply to: hi | w1".into(), error: None, usage: Some((7227, 8)) });
    }

    #[test]
    fn errors_and_leading_log_lines() {
        let out = b"[warn] something\n{\"payloads\":[],\"meta\":{\"error\":{\"kind\":\"context_overflow\",\"message\":\"too long\"}}}\n";
        let e = parse(out).expect("envelope");
        assert_eq!(e.error.as_deref(), Some("context_overflow: too long"));
        assert_eq!(e.text, "");
        let e = parse(br#"{"payloads":[{"text":"a"},{"text":"b"}],"meta":{"aborted":true}}"#).expect("envelope");
        assert_eq!(e.text, "a\n\nb");
        assert_eq!(e.error.as_deref(), Some("the agent run was aborted"));
    }

    #[test]
    fn bad_envelopes_name_the_reason() {
        for (out, want) in [
            (&b""[..], "printed nothing"),
            (b"Error: unknown option", "no JSON envelope"),
            (b"{\"payloads\": 3}", "malformed"),
            (b"{\"meta\":{}}", "malformed"),
            (b"{\"payloads\":[]", "malformed"),
            (b"\xff\xfe", "not UTF-8"),
        ] {
            let err = parse(out).expect_err("bad");
            assert!(err.contains(want), "{out:?}: {err}");
        }
    }

    proptest! {
        #[test]
        fn any_output_parses_or_errs_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn any_payload_text_comes_back(texts in proptest::collection::vec(".{1,40}", 0..4), input in any::<u64>()) {
            let payloads: Vec<serde_json::Value> = texts.iter().map(|t| serde_json::json!({"text": t})).collect();
            let out = serde_json::json!({"payloads": payloads, "meta": {"agentMeta": {"usage": {"input": input, "output": 1}}}}).to_string();
            let e = parse(out.as_bytes()).expect("envelope");
            prop_assert_eq!(e.text, texts.join("\n\n"));
            prop_assert_eq!(e.usage, Some((input, 1)));
        }
    }
}
