//! `GET /v1/runs?status=&billingAccountId=&stateKey=&since=&limit=&cursor=`: parsing and
//! validation (pure), and the opaque cursor.
//!
//! Pages are newest first by admission order. The cursor is the admission order of the last run of
//! a page, so the next page starts right after it whatever was admitted meanwhile: stable under
//! pagination while runs keep arriving.

use super::ListQuery;

/// Default page size.
pub const DEFAULT_LIMIT: usize = 50;
/// Largest page.
pub const MAX_LIMIT: usize = 500;

/// Statuses a run can have.
pub const STATUSES: [&str; 6] = ["queued", "running", "ok", "error", "aborted", "timeout"];

/// A bad query: the parameter and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryError {
    /// The parameter's name.
    pub param: &'static str,
    /// What is wrong, in a sentence.
    pub message: String,
}

fn bad(param: &'static str, message: impl Into<String>) -> QueryError {
    QueryError { param, message: message.into() }
}

/// The cursor of a page that ends with the run of admission order `seq`.
pub fn cursor(seq: i64) -> String {
    format!("r{seq}")
}

fn decode_pair(pair: &str) -> Result<(String, String), QueryError> {
    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
    let dec = |s: &str, what: &'static str| {
        percent_decode(s).ok_or_else(|| bad(what, "is not valid percent-encoded UTF-8"))
    };
    Ok((dec(k, "query")?, dec(v, "query")?))
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Parses the query string of `GET /v1/runs`.
pub fn parse(query: &str) -> Result<ListQuery, QueryError> {
    let mut q = ListQuery { limit: DEFAULT_LIMIT, ..ListQuery::default() };
    let mut seen = std::collections::HashSet::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = decode_pair(pair)?;
        let param: &'static str = match k.as_str() {
            "status" => "status",
            "billingAccountId" => "billingAccountId",
            "stateKey" => "stateKey",
            "since" => "since",
            "limit" => "limit",
            "cursor" => "cursor",
            other => {
                return Err(bad("query", format!("unknown parameter {other:?} (status, billingAccountId, stateKey, since, limit, cursor)")))
            }
        };
        if !seen.insert(param) {
            return Err(bad(param, "is given more than once"));
        }
        match param {
            "status" => {
                for s in v.split(',') {
                    if !STATUSES.contains(&s) {
                        return Err(bad("status", format!("{s:?} is not one of {}", STATUSES.join(", "))));
                    }
                    q.statuses.push(s.to_owned());
                }
            }
            "billingAccountId" | "stateKey" => {
                if !crate::request::is_valid_id(&v) {
                    return Err(bad(param, "must match [A-Za-z0-9._:-]{1,128}"));
                }
                if param == "stateKey" {
                    q.state_key = Some(v);
                } else {
                    q.billing_account_id = Some(v);
                }
            }
            "since" => {
                let t = time::OffsetDateTime::parse(&v, &time::format_description::well_known::Rfc3339)
                    .map_err(|_| bad("since", "must be an RFC 3339 time, e.g. 2026-11-23T10:00:00Z"))?;
                q.since_ms = Some(i64::try_from(t.unix_timestamp_nanos() / 1_000_000).map_err(|_| bad("since", "is out of range"))?);
            }
            "limit" => {
                let n: usize = v.parse().map_err(|_| bad("limit", format!("must be a number from 1 to {MAX_LIMIT}")))?;
                if !(1..=MAX_LIMIT).contains(&n) {
                    return Err(bad("limit", format!("must be a number from 1 to {MAX_LIMIT}")));
                }
                q.limit = n;
            }
            _ => {
                let seq = v.strip_prefix('r').and_then(|n| n.parse::<i64>().ok()).filter(|n| *n > 0);
                q.before_seq = Some(seq.ok_or_else(|| bad("cursor", "is not a cursor this service returned (use nextCursor)"))?);
            }
        }
    }
    Ok(q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_filter() {
        let q = parse("status=ok,error&billingAccountId=acct-1&stateKey=c%3A1&since=2026-11-23T10%3A00%3A00Z&limit=7&cursor=r42")
            .expect("valid");
        assert_eq!(q.statuses, ["ok", "error"]);
        assert_eq!(q.billing_account_id.as_deref(), Some("acct-1"));
        assert_eq!(q.state_key.as_deref(), Some("c:1"));
        assert_eq!(q.since_ms, Some(1_795_428_000_000));
        assert_eq!((q.limit, q.before_seq), (7, Some(42)));
        assert_eq!(parse("").expect("empty").limit, DEFAULT_LIMIT);
    }

    #[test]
    fn bad_filters_name_the_parameter() {
        for (query, param) in [
            ("status=done", "status"),
            ("limit=0", "limit"),
            ("limit=501", "limit"),
            ("limit=x", "limit"),
            ("since=yesterday", "since"),
            ("cursor=42", "cursor"),
            ("cursor=r-1", "cursor"),
            ("billingAccountId=a%20b", "billingAccountId"),
            ("stateKey=", "stateKey"),
            ("limit=1&limit=2", "limit"),
            ("colour=red", "query"),
            ("status=%ZZ", "query"),
        ] {
            assert_eq!(parse(query).map_err(|e| e.param), Err(param), "{query}");
        }
    }
}
