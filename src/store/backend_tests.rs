//! The store backends against one contract: every test runs on `memory:` and on SQLite.

use super::memory::MemoryStore;
use super::sqlite::SqliteStore;
use super::{Applied, CheckpointRecord, EventName, ListQuery, Retention, RunPatch, RunRow, SpecRecord, Store, StoredEvent, Write};
use crate::attribution::Usage;
use std::sync::Arc;

pub(super) fn row(run_id: &str, account: &str, created_at_ms: i64) -> RunRow {
    RunRow {
        seq: 0,
        run_id: run_id.to_owned(),
        idempotency_key: None,
        fingerprint: format!("fp-{run_id}"),
        billing_account_id: account.to_owned(),
        state_key: None,
        session_key: format!("agent:main:clawmux:{account}.r.{run_id}"),
        spec: SpecRecord {
            gateway_run_id: format!("gw-{run_id}"),
            agent_id: "main".into(),
            message: format!("hello from {run_id}"),
            model: None,
            graph_id: "g".into(),
            timeout_ms: 60_000,
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            attribution_token: None,
            branch: None,
            abort_on_disconnect: true,
        },
        status: "queued".into(),
        checkpoint: None,
        gateway_run_id: None,
        content: String::new(),
        error: None,
        gateway_usage: None,
        usage: None,
        relay: None,
        created_at_ms,
        finished_at_ms: None,
        last_event_id: 0,
        key_id: None,
        webhook_url: None,
    }
}

fn event(id: u64, name: EventName, data: &str) -> StoredEvent {
    StoredEvent { id, name, data: data.to_owned() }
}

fn append(run_id: &str, event: Option<StoredEvent>, patch: RunPatch) -> Write {
    Write::Append { run_id: run_id.to_owned(), event, patch, webhook: None }
}

/// A fresh store of each kind (the temp dir lives as long as the store is used).
async fn backends() -> Vec<(Arc<dyn Store>, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = SqliteStore::open(&dir.path().join("runs.db")).await.expect("sqlite opens");
    vec![(Arc::new(MemoryStore::new()), None), (Arc::new(sqlite), Some(dir))]
}

async fn insert(s: &dyn Store, row: RunRow) -> i64 {
    match s.apply(&[Write::Insert(Box::new(row))]).await.expect("insert").as_slice() {
        [Applied::Inserted { seq }] => *seq,
        other => panic!("not inserted: {other:?}"),
    }
}

#[tokio::test]
async fn a_run_document_round_trips_with_every_field() {
    for (s, _dir) in backends().await {
        let mut r = row("run-1", "acct-a", 1_000);
        r.idempotency_key = Some("idem-1".into());
        r.state_key = Some("conv:1".into());
        r.spec.model = Some("m-1".into());
        r.spec.attribution_token = Some("cmx-tok".into());
        r.spec.branch = Some(clawmux_actors::branch::BranchPlan {
            key: "task.1".into(),
            base_ref: "main".into(),
            pr_title: Some("t".into()),
            pr_body: None,
        });
        r.spec.abort_on_disconnect = false;
        r.key_id = Some("key-1".into());
        r.webhook_url = Some("https://hooks.example.com/x".into());
        r.usage = Some(Usage::default());
        let seq = insert(&*s, r.clone()).await;
        assert!(seq > 0, "{}", s.kind());
        r.seq = seq;
        assert_eq!(s.run("run-1").await.expect("read").as_ref(), Some(&r), "{}: as inserted", s.kind());

        let patches = [
            RunPatch { status: Some("running".into()), checkpoint: Some(CheckpointRecord::Running), ..RunPatch::default() },
            RunPatch { checkpoint: Some(CheckpointRecord::Sending { boot_id: Some("boot-1".into()) }), ..RunPatch::default() },
            RunPatch { gateway_run_id: Some("gw-run-1".into()), ..RunPatch::default() },
            RunPatch { usage: Some(Usage { input_tokens: 3, output_tokens: 4, llm_calls: 1 }), ..RunPatch::default() },
            RunPatch {
                checkpoint: Some(CheckpointRecord::Publishing { content: "done".into(), gateway_usage: Some((5, 6)) }),
                relay: Some(serde_json::json!({"branch": "sandbox/task.1", "pushed": true})),
                ..RunPatch::default()
            },
            RunPatch {
                status: Some("error".into()),
                content: Some("partial".into()),
                error: Some(("agent_error".into(), "boom".into())),
                gateway_usage: Some((7, 8)),
                finished_at_ms: Some(2_000),
                ..RunPatch::default()
            },
        ];
        // One event per patch, half of them in one batch (their row changes are coalesced).
        let writes: Vec<Write> =
            patches.iter().enumerate().map(|(i, p)| append("run-1", Some(event(i as u64 + 1, EventName::Status, "{}")), p.clone())).collect();
        s.apply(&writes[..3]).await.expect("first batch");
        s.apply(&writes[3..]).await.expect("second batch");
        for p in &patches {
            p.apply(&mut r);
        }
        r.last_event_id = 6;
        assert_eq!(s.run("run-1").await.expect("read").as_ref(), Some(&r), "{}: after every change", s.kind());
        assert_eq!(s.run("no-such-run").await.expect("read"), None);
    }
}

#[actix_rt::test]
async fn history_pages_have_a_cursor_only_when_more_runs_follow() {
    let backend = Arc::new(MemoryStore::new());
    let metrics = super::writer::StoreMetrics::new(&prometheus::Registry::new()).expect("metrics");
    let retention = Retention { max_age_ms: i64::MAX, max_count: usize::MAX };
    let store = super::RunStore::with_backend(backend.clone(), backend, retention, metrics, "memory:".into(), None);
    for i in 0..4 {
        assert!(matches!(store.insert(row(&format!("run-{i}"), "a", i)).await.expect("insert"), super::Insert::New(_)));
    }
    let page = |limit: usize, before_seq: Option<i64>| {
        let store = store.clone();
        async move {
            let (docs, next) = store.list(&ListQuery { limit, before_seq, ..ListQuery::default() }).await.expect("list");
            (docs.into_iter().map(|d| d.run_id).collect::<Vec<_>>(), next)
        }
    };
    let (first, next) = page(2, None).await;
    assert_eq!(first, ["run-3", "run-2"]);
    let next = next.expect("more runs follow");
    // The last page is full, and has no cursor: no empty page after it.
    assert_eq!(page(2, Some(next)).await, (vec!["run-1".to_owned(), "run-0".to_owned()], None));
    assert_eq!(page(4, None).await.1, None);
    assert_eq!(page(5, None).await.1, None);
}
