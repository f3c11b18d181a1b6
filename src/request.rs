//! `POST /v1/runs` bodies: decoding (closed: unknown fields are errors) and validation, pure.

use serde::{Deserialize, Serialize};

/// The request body, exactly as the contract names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunRequest {
    /// The user's message (1 byte up to `CLAWMUX_MAX_MESSAGE_BYTES`).
    #[schema(min_length = 1)]
    pub message: String,
    /// Who pays.
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    pub billing_account_id: String,
    /// Caller-chosen id (default: a new lowercase UUID v4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    pub run_id: Option<String>,
    /// Conversation key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    pub state_key: Option<String>,
    /// Agent (default `main`); one of `GET /v1/agents`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    pub agent_id: Option<String>,
    /// Model override: at most 256 bytes of UTF-8 (the pattern's count is of characters, so a
    /// value of multi-byte characters may match it and still be refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]{1,256}$")]
    pub model: Option<String>,
    /// Graph id (default `sandbox:openclaw`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[A-Za-z0-9._:-]{1,128}$")]
    pub graph_id: Option<String>,
    /// Timeout in seconds (at most `CLAWMUX_MAX_RUN_TIMEOUT_SEC`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub timeout_sec: Option<u64>,
    /// What a closed stream means.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_disconnect: Option<OnDisconnect>,
    /// Git relay settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<BranchRequest>,
    /// What to do when another run of the session key is live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub if_busy: Option<IfBusy>,
    /// The completion webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookRequest>,
}

/// `ifBusy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum IfBusy {
    /// Wait in line (default).
    Enqueue,
    /// `409 session_busy` at once.
    Reject,
    /// Abort the running run of the session key, then run.
    Interrupt,
}

/// `webhook`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookRequest {
    /// Where the final run document is `POST`ed: at most 2,048 bytes (`maxLength` counts
    /// characters; a URL of multi-byte characters may fit it and still be refused).
    #[schema(max_length = 2048)]
    pub url: String,
}

/// `onDisconnect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum OnDisconnect {
    /// Cancel the gateway run when the caller goes away (default).
    Abort,
    /// Keep running; the caller can re-attach.
    Continue,
}

/// `branch`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BranchRequest {
    /// Explicit branch key (git's ref-name rules on `sandbox/<key>` apply too, docs/API.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[A-Za-z0-9._/-]{1,100}$")]
    pub branch_name: Option<String>,
    /// Work item id, e.g. `task.0022`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[A-Za-z0-9._/-]{1,100}$")]
    pub work_item_id: Option<String>,
    /// Use the state key as branch key (opt-in).
    #[serde(default)]
    pub use_state_key: bool,
    /// Base ref.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[A-Za-z0-9._/-]{1,200}$")]
    pub base_ref: Option<String>,
    /// PR title: 1 to 1,024 bytes of UTF-8 (`maxLength` counts characters; a title of
    /// multi-byte characters may fit it and still be refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_length = 1, max_length = 1024)]
    pub pr_title: Option<String>,
    /// PR body: at most 32 KiB of UTF-8 (`maxLength` counts characters; a body of multi-byte
    /// characters may fit it and still be refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 32768)]
    pub pr_body: Option<String>,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// `400 invalid_request`.
    Invalid(String),
    /// `413 payload_too_large`.
    TooLarge(String),
}

/// Limits that come from configuration.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest `message`.
    pub max_message_bytes: usize,
    /// Default timeout.
    pub default_timeout_sec: u64,
    /// Largest timeout.
    pub max_timeout_sec: u64,
}

/// Decodes a body, naming the offending field on error.
pub fn decode(body: &[u8]) -> Result<RunRequest, RequestError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let request = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        // A syntax error is about the body, not a field (its path would read "?").
        let syntax = matches!(inner.classify(), serde_json::error::Category::Syntax | serde_json::error::Category::Eof);
        let msg = if syntax || path.is_empty() || path == "." {
            format!("invalid JSON body: {inner}")
        } else {
            format!("field `{path}`: {inner}")
        };
        RequestError::Invalid(msg)
    })?;
    // Trailing characters after the object make the body invalid JSON too.
    de.end().map_err(|e| RequestError::Invalid(format!("invalid JSON body: {e}")))?;
    Ok(request)
}

/// `[A-Za-z0-9._:-]{1,128}`.
pub fn is_valid_id(s: &str) -> bool {
    (1..=128).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// A branch key: git's ref-name rules on `sandbox/<key>` and clawmux's stricter ones
/// ([`crate::refname`]); the message names the rule.
pub fn validate_branch_key(key: &str, base_ref: &str) -> Result<(), String> {
    crate::refname::validate_branch_key(key, base_ref).map_err(|r| r.to_string())
}

/// A validated request with defaults applied.
#[derive(Debug, Clone)]
pub struct ValidRun {
    /// The request as sent (defaults not applied): its canonical JSON is the fingerprint.
    pub request: RunRequest,
    /// Run id (given or generated).
    pub run_id: String,
    /// Agent id.
    pub agent_id: String,
    /// Graph id.
    pub graph_id: String,
    /// Timeout.
    pub timeout_sec: u64,
    /// On disconnect.
    pub on_disconnect: OnDisconnect,
    /// The branch key, if the request has one.
    pub branch_key: Option<String>,
}

/// The longest `webhook.url`.
pub const MAX_URL_BYTES: usize = 2048;
/// The longest `branch.prTitle` (GitHub's limit is 256 characters).
pub const MAX_PR_TITLE_BYTES: usize = 1024;
/// The longest `branch.prBody` (GitHub's limit is 65,536 characters).
pub const MAX_PR_BODY_BYTES: usize = 32 * 1024;
/// The longest every field but `message` may be together, decoded: five ids of 128 bytes
/// (`billingAccountId`, `runId`, `stateKey`, `agentId`, `graphId`), `model` (256), the branch's
/// keys (`branchName`, `workItemId`: 100 each; `baseRef`: 200), `prTitle`, `prBody` and
/// `webhook.url`. What the body limit allows besides the message.
pub const MAX_OTHER_FIELDS_BYTES: usize = 5 * 128 + 256 + 100 + 100 + 200 + MAX_PR_TITLE_BYTES + MAX_PR_BODY_BYTES + MAX_URL_BYTES;

/// Validates a decoded request against the contract's rules.
pub fn validate(request: RunRequest, limits: Limits, new_run_id: impl FnOnce() -> String) -> Result<ValidRun, RequestError> {
    let invalid = |m: String| Err(RequestError::Invalid(m));
    if request.message.is_empty() {
        return invalid("field `message`: must not be empty".to_owned());
    }
    if request.message.len() > limits.max_message_bytes {
        return Err(RequestError::TooLarge(format!(
            "field `message` is {} bytes; the limit is {} bytes (CLAWMUX_MAX_MESSAGE_BYTES)",
            request.message.len(),
            limits.max_message_bytes
        )));
    }
    let ids = [
        ("billingAccountId", Some(&request.billing_account_id)),
        ("runId", request.run_id.as_ref()),
        ("stateKey", request.state_key.as_ref()),
        ("agentId", request.agent_id.as_ref()),
    ];
    for (name, value) in ids {
        if let Some(v) = value {
            if !is_valid_id(v) {
                return invalid(format!("field `{name}`: must match [A-Za-z0-9._:-]{{1,128}}"));
            }
        }
    }
    if let Some(m) = &request.model {
        if m.is_empty() || m.len() > 256 || m.chars().any(char::is_control) {
            return invalid("field `model`: must be 1 to 256 bytes of printable characters".to_owned());
        }
    }
    if let Some(g) = &request.graph_id {
        if !is_valid_id(g) {
            return invalid("field `graphId`: must match [A-Za-z0-9._:-]{1,128}".to_owned());
        }
    }
    // Every field but `message` fits the body's overhead (the body is read up to six times the
    // message limit, for escapes): each is stored with the run, and sent on (GitHub, webhooks).
    if request.webhook.as_ref().is_some_and(|w| w.url.len() > MAX_URL_BYTES) {
        return invalid(format!("field `webhook.url`: must be at most {MAX_URL_BYTES} bytes"));
    }
    if let Some(b) = &request.branch {
        if b.pr_title.as_ref().is_some_and(|t| t.is_empty() || t.len() > MAX_PR_TITLE_BYTES) {
            return invalid(format!("field `branch.prTitle`: must be 1 to {MAX_PR_TITLE_BYTES} bytes"));
        }
        if b.pr_body.as_ref().is_some_and(|t| t.len() > MAX_PR_BODY_BYTES) {
            return invalid(format!("field `branch.prBody`: must be at most {MAX_PR_BODY_BYTES} bytes"));
        }
    }
    let timeout_sec = match request.timeout_sec {
        None => limits.default_timeout_sec,
        Some(0) => return invalid("field `timeoutSec`: must be at least 1".to_owned()),
        Some(t) if t > limits.max_timeout_sec => {
            return invalid(format!("field `timeoutSec`: must be at most {} (CLAWMUX_MAX_RUN_TIMEOUT_SEC)", limits.max_timeout_sec))
        }
        Some(t) => t,
    };
    let branch_key = match &request.branch {
        None => None,
        Some(b) => {
            let base_ref = b.base_ref.as_deref().unwrap_or("main");
            if let Some(r) = &b.base_ref {
                crate::refname::validate_base_ref(r).map_err(|rule| RequestError::Invalid(format!("field `branch.baseRef`: {rule}")))?;
            }
            let key = b
                .branch_name
                .clone()
                .or_else(|| b.work_item_id.clone())
                .or_else(|| if b.use_state_key { request.state_key.clone() } else { None });
            if b.use_state_key && b.branch_name.is_none() && b.work_item_id.is_none() && request.state_key.is_none() {
                return invalid("field `branch.useStateKey`: is true but the request has no `stateKey`".to_owned());
            }
            // Both keys are checked when both are given: the one not used is stored with the run
            // too, so it is held to the same rules (and length).
            for (field, k) in [("branch.branchName", &b.branch_name), ("branch.workItemId", &b.work_item_id)] {
                if let Some(k) = k {
                    validate_branch_key(k, base_ref).map_err(|m| RequestError::Invalid(format!("field `{field}`: branch key: {m}")))?;
                }
            }
            if let (Some(k), None, None) = (&key, &b.branch_name, &b.work_item_id) {
                validate_branch_key(k, base_ref).map_err(|m| RequestError::Invalid(format!("field `stateKey`: branch key: {m}")))?;
            }
            key
        }
    };
    let run_id = request.run_id.clone().unwrap_or_else(new_run_id);
    Ok(ValidRun {
        agent_id: request.agent_id.clone().unwrap_or_else(|| "main".to_owned()),
        graph_id: request.graph_id.clone().unwrap_or_else(|| "sandbox:openclaw".to_owned()),
        on_disconnect: request.on_disconnect.unwrap_or(OnDisconnect::Abort),
        timeout_sec,
        branch_key,
        run_id,
        request,
    })
}

/// A stable fingerprint of a request body (field order and whitespace do not matter): SHA-256 of
/// its canonical JSON, hex. Stored with the run, so it must not change between builds or processes.
pub fn fingerprint(request: &RunRequest) -> String {
    use sha2::Digest;
    let canonical = serde_json::to_string(request).unwrap_or_default();
    sha2::Sha256::digest(canonical.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { max_message_bytes: 100, default_timeout_sec: 600, max_timeout_sec: 3600 };

    fn ok(body: &str) -> ValidRun {
        validate(decode(body.as_bytes()).expect("decodes"), LIMITS, || "generated".into()).expect("valid")
    }

    fn err(body: &str) -> RequestError {
        match decode(body.as_bytes()) {
            Err(e) => e,
            Ok(r) => validate(r, LIMITS, || "generated".into()).expect_err("invalid"),
        }
    }

    #[test]
    fn defaults() {
        let v = ok(r#"{"message":"hi","billingAccountId":"acct-42"}"#);
        assert_eq!(v.run_id, "generated");
        assert_eq!(v.agent_id, "main");
        assert_eq!(v.graph_id, "sandbox:openclaw");
        assert_eq!(v.timeout_sec, 600);
        assert_eq!(v.on_disconnect, OnDisconnect::Abort);
        assert_eq!(v.branch_key, None);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"billingAccountId":"a"}"#, "message"),
            (r#"{"message":"hi"}"#, "billingAccountId"),
            (r#"{"message":"hi","billingAccountId":"a","mesage":"typo"}"#, "mesage"),
            (r#"{"message":5,"billingAccountId":"a"}"#, "message"),
            (r#"{"message":"","billingAccountId":"a"}"#, "message"),
            (r#"{"message":"hi","billingAccountId":"a b"}"#, "billingAccountId"),
            (r#"{"message":"hi","billingAccountId":"a","runId":"x/y"}"#, "runId"),
            (r#"{"message":"hi","billingAccountId":"a","timeoutSec":0}"#, "timeoutSec"),
            (r#"{"message":"hi","billingAccountId":"a","timeoutSec":3601}"#, "timeoutSec"),
            (r#"{"message":"hi","billingAccountId":"a","onDisconnect":"later"}"#, "onDisconnect"),
            (r#"{"message":"hi","billingAccountId":"a","branch":{"branchName":"x","extra":1}}"#, "extra"),
            (r#"{"message":"hi","billingAccountId":"a","branch":{"branchName":"x","prTitle":""}}"#, "branch.prTitle"),
        ];
        for (body, field) in cases {
            match err(body) {
                RequestError::Invalid(m) => assert!(m.contains(field), "{body}: {m}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        for body in ["{not json", "", r#"{"message":"hi","billingAccountId":"a"} trailing"#] {
            assert!(matches!(err(body), RequestError::Invalid(m) if m.starts_with("invalid JSON body")), "{body}");
        }
    }

    /// The fields besides `message` are bounded on their own: the body may be six times the
    /// message limit, and each is stored with the run and sent on.
    #[test]
    fn long_urls_and_pull_request_texts_are_refused() {
        let long = |n: usize| "x".repeat(n);
        let cases = [
            (format!(r#"{{"message":"hi","billingAccountId":"a","webhook":{{"url":"https://h/{}"}}}}"#, long(MAX_URL_BYTES)), "webhook.url"),
            (format!(r#"{{"message":"hi","billingAccountId":"a","branch":{{"branchName":"x","prTitle":"{}"}}}}"#, long(MAX_PR_TITLE_BYTES + 1)), "branch.prTitle"),
            (format!(r#"{{"message":"hi","billingAccountId":"a","branch":{{"branchName":"x","prBody":"{}"}}}}"#, long(MAX_PR_BODY_BYTES + 1)), "branch.prBody"),
            // The key not used is stored too: held to the same rules.
            (format!(r#"{{"message":"hi","billingAccountId":"a","branch":{{"branchName":"x","workItemId":"{}"}}}}"#, long(101)), "branch.workItemId"),
            (r#"{"message":"hi","billingAccountId":"a","branch":{"branchName":"x","workItemId":"a b"}}"#.to_owned(), "branch.workItemId"),
        ];
        for (body, field) in cases {
            assert!(matches!(err(&body), RequestError::Invalid(m) if m.contains(field)), "{field}");
        }
        let fine = format!(r#"{{"message":"hi","billingAccountId":"a","branch":{{"branchName":"x","prTitle":"{}","prBody":"{}"}}}}"#, long(MAX_PR_TITLE_BYTES), long(MAX_PR_BODY_BYTES));
        assert_eq!(ok(&fine).branch_key.as_deref(), Some("x"));
        let both = r#"{"message":"hi","billingAccountId":"a","branch":{"branchName":"x","workItemId":"task.1"}}"#;
        assert_eq!(ok(both).branch_key.as_deref(), Some("x"), "the branch name is the key");
    }

    proptest::proptest! {
        /// Fuzz: any body (fields of any JSON value, lengths around every bound, raw bytes) is
        /// accepted or refused with an error, never a panic; an accepted run keeps every bound.
        #[test]
        fn any_body_is_refused_or_accepted_within_the_bounds(
            message in proptest::prelude::prop_oneof![proptest::prelude::Just(String::new()), "[a-zé\\\\\"]{0,120}"],
            title_len in 0usize..(MAX_PR_TITLE_BYTES + 3),
            body_len in proptest::prelude::prop_oneof![0usize..8, (MAX_PR_BODY_BYTES - 2)..(MAX_PR_BODY_BYTES + 3)],
            url_len in proptest::prelude::prop_oneof![0usize..8, (MAX_URL_BYTES - 2)..(MAX_URL_BYTES + 3)],
            key in "[A-Za-z0-9._/-]{0,12}",
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            let body = serde_json::json!({
                "message": message, "billingAccountId": "acct",
                "webhook": {"url": "u".repeat(url_len)},
                "branch": {"branchName": key, "prTitle": "t".repeat(title_len), "prBody": "b".repeat(body_len)},
            });
            let decoded = decode(body.to_string().as_bytes());
            if let Ok(r) = decoded {
                if let Ok(v) = validate(r, LIMITS, || "generated".into()) {
                    let b = v.request.branch.as_ref().expect("branch");
                    proptest::prop_assert!(!v.request.message.is_empty() && v.request.message.len() <= LIMITS.max_message_bytes);
                    proptest::prop_assert!(b.pr_title.as_ref().is_some_and(|t| !t.is_empty() && t.len() <= MAX_PR_TITLE_BYTES));
                    proptest::prop_assert!(b.pr_body.as_ref().is_some_and(|t| t.len() <= MAX_PR_BODY_BYTES));
                    proptest::prop_assert!(v.request.webhook.as_ref().is_some_and(|w| w.url.len() <= MAX_URL_BYTES));
                }
            }
            let _ = decode(&raw).map(|r| validate(r, LIMITS, || "generated".into()));
        }
    }

    #[test]
    fn oversize_message_is_413() {
        let body = format!(r#"{{"message":"{}","billingAccountId":"a"}}"#, "x".repeat(101));
        assert!(matches!(err(&body), RequestError::TooLarge(m) if m.contains("message")));
    }

    #[test]
    fn branch_key_priority_and_opt_in() {
        let v = ok(r#"{"message":"m","billingAccountId":"a","stateKey":"s1","branch":{"branchName":"feat/x","workItemId":"task.1"}}"#);
        assert_eq!(v.branch_key.as_deref(), Some("feat/x"));
        let v = ok(r#"{"message":"m","billingAccountId":"a","stateKey":"s1","branch":{"workItemId":"task.1"}}"#);
        assert_eq!(v.branch_key.as_deref(), Some("task.1"));
        let v = ok(r#"{"message":"m","billingAccountId":"a","stateKey":"s1","branch":{}}"#);
        assert_eq!(v.branch_key, None, "the state key is used only on opt-in");
        let v = ok(r#"{"message":"m","billingAccountId":"a","stateKey":"s1","branch":{"useStateKey":true}}"#);
        assert_eq!(v.branch_key.as_deref(), Some("s1"));
        let v = ok(r#"{"message":"m","billingAccountId":"a","runId":"r1","branch":{}}"#);
        assert_eq!(v.branch_key, None, "never the run id");
    }

    #[test]
    fn hostile_branch_keys_are_refused() {
        let long = "a".repeat(300);
        for key in ["../x", "-f", "a..b", "x.lock", "with space", long.as_str(), "/abs", "main", "MASTER", "HEAD", "a//b", "a/", ".hidden", "a@{1}", "x.lock/y", "x/y.lock/z"] {
            let body = format!(r#"{{"message":"m","billingAccountId":"a","branch":{{"branchName":{}}}}}"#, serde_json::json!(key));
            assert!(matches!(err(&body), RequestError::Invalid(m) if m.contains("branchName")), "{key}");
        }
        assert!(validate_branch_key("task.0022", "main").is_ok());
        assert!(validate_branch_key("feat/x-1_y", "main").is_ok());
        assert!(validate_branch_key("develop", "develop").is_err(), "the base ref is protected");
    }

    #[test]
    fn fingerprint_ignores_formatting_not_content() {
        let a = decode(br#"{"message":"m","billingAccountId":"a"}"#).expect("decodes");
        let b = decode(b"{ \"billingAccountId\" : \"a\",\n \"message\":\"m\" }").expect("decodes");
        let c = decode(br#"{"message":"m2","billingAccountId":"a"}"#).expect("decodes");
        assert_eq!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a), fingerprint(&c));
    }
}
