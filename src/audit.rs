//! The durable audit log of proxied LLM calls: JSON lines, one `write` + `fsync` per record,
//! append-only, rotated by size. It never holds prompts, completions or keys.
//!
//! A crash can at worst leave a partial last line (a record whose write was not acknowledged);
//! opening the log truncates such a torn tail, so every line in the file is a whole record and
//! every acknowledged record (the append returned `Ok`) is in the file.

use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One proxied LLM call.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AuditRecord {
    /// RFC 3339 time the call started.
    pub time: String,
    /// API run id.
    pub run_id: String,
    /// Billing account charged.
    pub billing_account_id: String,
    /// Model asked for.
    pub model: Option<String>,
    /// Path called, e.g. `/v1/chat/completions`.
    pub path: String,
    /// Upstream HTTP status (0 when the upstream could not be reached).
    pub status: u16,
    /// How the call ended: `ok`, `upstream_error`, `client_closed`, `unreachable`.
    pub outcome: String,
    /// Milliseconds from request to the end of the response.
    pub latency_ms: u64,
    /// Streamed (SSE) or not.
    pub streamed: bool,
    /// Input tokens reported by the upstream.
    pub input_tokens: Option<u64>,
    /// Output tokens reported by the upstream.
    pub output_tokens: Option<u64>,
    /// The upstream's call id header (`x-litellm-call-id`).
    pub upstream_call_id: Option<String>,
}

/// The append-only log.
#[derive(Debug)]
pub struct AuditLog {
    path: PathBuf,
    max_bytes: u64,
    file: Mutex<(File, u64)>,
}

fn open_append(path: &Path) -> std::io::Result<(File, u64)> {
    let mut file = OpenOptions::new().create(true).read(true).append(true).open(path)?;
    let len = repair_torn_tail(&mut file, path)?;
    Ok((file, len))
}

/// Truncates a partial last line left by a crash; returns the resulting length.
fn repair_torn_tail(file: &mut File, path: &Path) -> std::io::Result<u64> {
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(0);
    }
    // Find the last newline by scanning back in blocks.
    let mut end = len;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let start = end.saturating_sub(buf.len() as u64);
        let n = (end - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut buf[..n])?;
        if let Some(pos) = buf[..n].iter().rposition(|b| *b == b'\n') {
            let keep = start + pos as u64 + 1;
            if keep != len {
                tracing::warn!(path = %path.display(), dropped_bytes = len - keep, "audit log had a torn last record; truncated it");
                file.set_len(keep)?;
                file.sync_all()?;
            }
            return Ok(keep);
        }
        if start == 0 {
            tracing::warn!(path = %path.display(), dropped_bytes = len, "audit log held no complete record; truncated it");
            file.set_len(0)?;
            file.sync_all()?;
            return Ok(0);
        }
        end = start;
    }
}

impl AuditLog {
    /// Opens (creating) `dir/audit.jsonl`; rotates to `audit-<unix ms>.jsonl` past `max_bytes`.
    pub fn open(dir: &Path, max_bytes: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("audit.jsonl");
        let file = open_append(&path)?;
        Ok(Self { path, max_bytes: max_bytes.max(1024), file: Mutex::new(file) })
    }

    /// The current file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record durably (returns after `fsync`).
    pub fn append(&self, record: &AuditRecord) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(record).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let mut guard = match self.file.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if guard.1 > 0 && guard.1 + line.len() as u64 > self.max_bytes {
            let stamp = time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000;
            // Two rotations in one millisecond must not replace each other's file (rename would).
            let mut rotated = self.path.with_file_name(format!("audit-{stamp}.jsonl"));
            let mut n = 1;
            while rotated.exists() {
                rotated = self.path.with_file_name(format!("audit-{stamp}-{n}.jsonl"));
                n += 1;
            }
            guard.0.sync_all()?;
            std::fs::rename(&self.path, &rotated)?;
            *guard = open_append(&self.path)?;
            if let Some(dir) = self.path.parent() {
                // Make the rename itself durable.
                if let Ok(d) = File::open(dir) {
                    let _ = d.sync_all();
                }
            }
        }
        guard.0.write_all(&line)?;
        guard.0.sync_data()?;
        guard.1 += line.len() as u64;
        Ok(())
    }
}

/// One LLM call of a run as `GET /v1/runs/{runId}/llm-calls` (and the runs page) shows it: the
/// audit record minus who pays and the upstream's ids. Records hold no prompt or key anyway.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LlmCall {
    /// RFC 3339 time the call started.
    #[schema(format = DateTime)]
    pub time: String,
    /// Model asked for.
    pub model: Option<String>,
    /// Path called, e.g. `/v1/chat/completions`.
    pub path: String,
    /// Upstream HTTP status (0 when the upstream could not be reached).
    pub status: u16,
    /// `ok`, `upstream_error`, `client_closed`, `unreachable`, `run_ended`.
    pub outcome: String,
    /// Milliseconds from request to the end of the response.
    pub latency_ms: u64,
    /// Streamed (SSE) or not.
    pub streamed: bool,
    /// Input tokens reported by the upstream.
    pub input_tokens: Option<u64>,
    /// Output tokens reported by the upstream.
    pub output_tokens: Option<u64>,
}

/// A line of the log as [`calls_of_run`] reads it.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct CallLine {
    run_id: String,
    billing_account_id: String,
    #[serde(flatten)]
    call: LlmCall,
}

/// The run whose calls [`calls_of_run`] reads: a run id may be used again once its run is gone
/// (deleted, swept), by another billing account too, so the earlier run's records are told apart
/// by their account and time.
#[derive(Debug, Clone)]
pub struct RunOfCalls {
    /// The run id.
    pub run_id: String,
    /// Its billing account.
    pub billing_account_id: String,
    /// Its admission (ms since the epoch): its calls are not older.
    pub since_ms: i64,
}

/// A record's time in ms (`None` when it does not read: the record is not taken).
fn time_ms(rfc3339: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(rfc3339, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos().div_euclid(1_000_000)).ok()
}

/// The log's files that may hold calls made at or after `since_ms`, oldest first: rotated files
/// (`audit-<ms>[-<n>].jsonl`, named by when they were rotated, so one rotated before `since_ms`
/// holds only older calls) and then the current `audit.jsonl`.
fn files_since(dir: &Path, since_ms: i64) -> std::io::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut rotated: Vec<((i64, u64), PathBuf)> = Vec::new();
    for entry in entries {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        let Some(stem) = name.strip_prefix("audit-").and_then(|n| n.strip_suffix(".jsonl")) else { continue };
        let (ms, n) = stem.split_once('-').unwrap_or((stem, "0"));
        let (Ok(ms), Ok(n)) = (ms.parse::<i64>(), n.parse::<u64>()) else { continue };
        if ms >= since_ms {
            rotated.push(((ms, n), path));
        }
    }
    rotated.sort();
    let mut files: Vec<PathBuf> = rotated.into_iter().map(|(_, p)| p).collect();
    files.push(dir.join("audit.jsonl"));
    Ok(files)
}

/// The LLM calls of `run` in the audit log in `dir`, in the order they were recorded, at most
/// `limit` (the bool says more were left out): records of its id, its billing account, made at
/// or after its admission (an earlier run of the same id, of any account, is another run). Only
/// files that can hold calls made since then are read. Lines that are not whole records are
/// skipped (a file rotated away while it is read is skipped too: its calls show on the next read).
pub fn calls_of_run(dir: &Path, run: &RunOfCalls, limit: usize) -> std::io::Result<(Vec<LlmCall>, bool)> {
    use std::io::BufRead;
    let (run_id, since_ms) = (run.run_id.as_str(), run.since_ms);
    // Records are compact JSON and run ids never need escaping (`[A-Za-z0-9._:-]`): a cheap
    // substring test skips the other runs' lines without parsing them.
    let needle = format!("\"runId\":{}", serde_json::to_string(run_id).map_err(std::io::Error::other)?);
    let mut calls = Vec::new();
    for path in files_since(dir, since_ms)? {
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for line in std::io::BufReader::new(file).lines() {
            let line = line?;
            if !line.contains(&needle) {
                continue;
            }
            let Ok(rec) = serde_json::from_str::<CallLine>(&line) else { continue };
            if rec.run_id != run_id || rec.billing_account_id != run.billing_account_id || time_ms(&rec.call.time).is_none_or(|t| t < since_ms) {
                continue;
            }
            if calls.len() == limit {
                return Ok((calls, true));
            }
            calls.push(rec.call);
        }
    }
    Ok((calls, false))
}

/// Reads every record of a log file (tests, tools).
pub fn read_records(path: &Path) -> std::io::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path)?;
    text.lines().map(|l| serde_json::from_str(l).map_err(std::io::Error::other)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(run: &str) -> AuditRecord {
        AuditRecord {
            time: "2026-11-21T00:00:00Z".into(),
            run_id: run.into(),
            billing_account_id: "acct".into(),
            model: Some("m".into()),
            path: "/v1/chat/completions".into(),
            status: 200,
            outcome: "ok".into(),
            latency_ms: 5,
            streamed: true,
            input_tokens: Some(10),
            output_tokens: Some(3),
            upstream_call_id: Some("c1".into()),
        }
    }

    fn tmp() -> PathBuf {
        let d = std::env::temp_dir().join(format!("clawmux-audit-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).expect("tmp");
        d
    }

    #[test]
    fn appends_whole_lines() {
        let d = tmp();
        let log = AuditLog::open(&d, 1 << 20).expect("open");
        log.append(&record("r1")).expect("append");
        log.append(&record("r2")).expect("append");
        let recs = read_records(log.path()).expect("read");
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[1]["runId"], "r2");
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_torn_tail_is_truncated_on_open() {
        let d = tmp();
        {
            let log = AuditLog::open(&d, 1 << 20).expect("open");
            log.append(&record("r1")).expect("append");
        }
        let path = d.join("audit.jsonl");
        let mut f = OpenOptions::new().append(true).open(&path).expect("open");
        f.write_all(br#"{"time":"2026","runId":"r2","billin"#).expect("torn write");
        drop(f);
        let log = AuditLog::open(&d, 1 << 20).expect("reopen");
        log.append(&record("r3")).expect("append");
        let recs = read_records(&path).expect("every line is a whole record");
        assert_eq!(recs.iter().map(|r| r["runId"].as_str().unwrap_or_default().to_owned()).collect::<Vec<_>>(), ["r1", "r3"]);
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn rotates_by_size_and_keeps_everything() {
        let d = tmp();
        let log = AuditLog::open(&d, 1024).expect("open");
        for i in 0..20 {
            log.append(&record(&format!("r{i}"))).expect("append");
        }
        let mut total = 0;
        for e in std::fs::read_dir(&d).expect("dir") {
            let p = e.expect("entry").path();
            assert!(std::fs::metadata(&p).expect("meta").len() <= 1024 + 400);
            total += read_records(&p).expect("records").len();
        }
        assert_eq!(total, 20, "rotation loses nothing");
        assert!(std::fs::read_dir(&d).expect("dir").count() > 1, "it rotated");
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn calls_of_a_run_come_from_every_file_it_may_be_in_and_no_other_run() {
        let d = tmp();
        let log = AuditLog::open(&d, 1024).expect("open");
        for i in 0..12 {
            log.append(&record(if i % 3 == 0 { "run-a" } else { "run-a2" })).expect("append");
        }
        assert!(std::fs::read_dir(&d).expect("dir").count() > 2, "the calls are spread over rotated files");
        let (calls, more) = calls_of_run(&d, &of("run-a", 0), 100).expect("read");
        assert_eq!((calls.len(), more), (4, false), "run-a's calls and not run-a2's");
        assert_eq!(calls[0].model.as_deref(), Some("m"));
        assert_eq!((calls[0].input_tokens, calls[0].latency_ms, calls[0].status), (Some(10), 5, 200));
        let (calls, more) = calls_of_run(&d, &of("run-a2", 0), 3).expect("read");
        assert_eq!((calls.len(), more), (3, true), "bounded, and says so");
        // Files rotated before the run began are not read: it has no calls there.
        let (calls, _) = calls_of_run(&d, &of("run-a", i64::MAX), 100).expect("read");
        assert!(calls.len() < 4, "only the current file is read");
        assert_eq!(calls_of_run(&d.join("missing"), &of("run-a", 0), 10).expect("no log yet"), (Vec::new(), false));
        let _ = std::fs::remove_dir_all(d);
    }

    fn of(run_id: &str, since_ms: i64) -> RunOfCalls {
        RunOfCalls { run_id: run_id.into(), billing_account_id: "acct".into(), since_ms }
    }

    /// A run id used again (its first run deleted or swept), by another account or later by the
    /// same one: the new run's calls are its own, not the earlier run's (before, records were
    /// matched by run id alone: another tenant's calls showed in a run of the reused id).
    #[test]
    fn a_reused_run_id_shows_only_its_own_runs_calls() {
        let d = tmp();
        let log = AuditLog::open(&d, 1 << 20).expect("open");
        let at = |account: &str, time: &str| AuditRecord { billing_account_id: account.into(), time: time.into(), ..record("job-7") };
        log.append(&at("acct-a", "2026-11-21T00:00:00Z")).expect("append");
        log.append(&at("acct-b", "2026-11-21T00:10:00.5Z")).expect("append");
        log.append(&at("acct-b", "not a time")).expect("append");
        let second = time_ms("2026-11-21T00:10:00Z").expect("time");
        let b = RunOfCalls { run_id: "job-7".into(), billing_account_id: "acct-b".into(), since_ms: second };
        let (calls, _) = calls_of_run(&d, &b, 100).expect("read");
        assert_eq!(calls.iter().map(|c| c.time.as_str()).collect::<Vec<_>>(), ["2026-11-21T00:10:00.5Z"]);
        // The same account, the id used again later: the earlier run's call is not the new one's.
        let a_again = RunOfCalls { run_id: "job-7".into(), billing_account_id: "acct-a".into(), since_ms: second };
        assert!(calls_of_run(&d, &a_again, 100).expect("read").0.is_empty());
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_call_shows_no_account_or_upstream_ids() {
        let v = serde_json::to_value(LlmCall {
            time: "t".into(),
            model: None,
            path: "/v1/chat/completions".into(),
            status: 200,
            outcome: "ok".into(),
            latency_ms: 1,
            streamed: false,
            input_tokens: None,
            output_tokens: None,
        })
        .expect("json");
        for k in ["billingAccountId", "upstreamCallId", "runId"] {
            assert!(v.get(k).is_none(), "{k}");
        }
    }

    #[test]
    fn records_hold_no_prompt_or_key_fields() {
        let v = serde_json::to_value(record("r")).expect("json");
        let keys: Vec<&String> = v.as_object().expect("object").keys().collect();
        for k in keys {
            assert!(!["messages", "prompt", "content", "authorization", "apiKey"].contains(&k.as_str()), "{k}");
        }
    }
}
