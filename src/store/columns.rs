//! A run row read back from either SQL backend. The two differ only in how one column is fetched,
//! so each implements [`Columns`] and the row is assembled once, here: a column added to the
//! schema is read the same way on SQLite and PostgreSQL. Store contents are input too: a bad row
//! is an error naming the column, never a panic and never another run.

use super::{CheckpointRecord, RunPatch, RunRow, SpecRecord};

/// One column of the current row, by name; `None` is SQL `NULL`.
pub(crate) trait Columns {
    /// A text column.
    fn text(&self, column: &str) -> Result<Option<String>, String>;
    /// An integer column.
    fn int(&self, column: &str) -> Result<Option<i64>, String>;
}

/// A value as its JSON text column (`null` for what cannot be serialized, which no stored type is).
pub(crate) fn json_text<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".to_owned())
}

/// What a patch writes: its text columns (JSON-valued ones serialized) and `finished_at`.
pub(crate) fn patch_columns(p: &RunPatch) -> (Vec<(&'static str, String)>, Option<i64>) {
    let mut set = Vec::new();
    if let Some(v) = &p.status {
        set.push(("status", v.clone()));
    }
    if let Some(v) = &p.checkpoint {
        set.push(("checkpoint", json_text(v)));
    }
    if let Some(v) = &p.gateway_run_id {
        set.push(("gateway_run_id", v.clone()));
    }
    if let Some(v) = &p.content {
        set.push(("content", v.clone()));
    }
    if let Some((code, message)) = &p.error {
        set.push(("error_code", code.clone()));
        set.push(("error_message", message.clone()));
    }
    if let Some(v) = &p.gateway_usage {
        set.push(("gateway_usage", json_text(v)));
    }
    if let Some(v) = &p.usage {
        set.push(("usage", json_text(v)));
    }
    if let Some(v) = &p.relay {
        set.push(("relay", json_text(v)));
    }
    (set, p.finished_at_ms)
}

fn required<T>(value: Option<T>, column: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("column {column}: NULL"))
}

fn json<T: serde::de::DeserializeOwned>(r: &impl Columns, column: &str) -> Result<Option<T>, String> {
    r.text(column)?.map(|s| serde_json::from_str(&s).map_err(|e| format!("column {column}: {e}"))).transpose()
}

/// The run row of the current database row.
pub(crate) fn decode_row(r: &impl Columns) -> Result<RunRow, String> {
    let text = |c: &str| required(r.text(c)?, c);
    let spec: SpecRecord = json(r, "spec")?.ok_or("column spec: empty")?;
    let error = match (r.text("error_code")?, r.text("error_message")?) {
        (Some(c), m) => Some((c, m.unwrap_or_default())),
        _ => None,
    };
    Ok(RunRow {
        seq: required(r.int("seq")?, "seq")?,
        run_id: text("run_id")?,
        idempotency_key: r.text("idempotency_key")?,
        fingerprint: text("fingerprint")?,
        billing_account_id: text("billing_account_id")?,
        state_key: r.text("state_key")?,
        session_key: text("session_key")?,
        spec,
        status: text("status")?,
        checkpoint: json::<CheckpointRecord>(r, "checkpoint")?,
        gateway_run_id: r.text("gateway_run_id")?,
        content: text("content")?,
        error,
        gateway_usage: json(r, "gateway_usage")?,
        usage: json(r, "usage")?,
        relay: json(r, "relay")?,
        created_at_ms: required(r.int("created_at")?, "created_at")?,
        finished_at_ms: r.int("finished_at")?,
        // A negative id is no id: the run's events are numbered from the stored ones.
        last_event_id: u64::try_from(required(r.int("last_event_id")?, "last_event_id")?).unwrap_or(0),
        key_id: r.text("key_id")?,
        webhook_url: r.text("webhook_url")?,
    })
}
