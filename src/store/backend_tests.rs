//! The store backends against one contract: every test runs on `memory:` and on SQLite (some only
//! on SQLite: what must survive a reopen).

use super::memory::MemoryStore;
use super::sqlite::SqliteStore;
use super::{Applied, CheckpointRecord, EventName, ListQuery, NewDelivery, Retention, RunPatch, RunRow, SpecRecord, Store, StoredEvent, Write};
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

fn delta(id: u64) -> StoredEvent {
    event(id, EventName::TextDelta, &format!("{{\"text\":\"d{id}\"}}"))
}

fn append(run_id: &str, event: Option<StoredEvent>, patch: RunPatch) -> Write {
    Write::Append { run_id: run_id.to_owned(), event, patch, webhook: None }
}

fn finish(at: i64) -> RunPatch {
    RunPatch { status: Some("ok".into()), finished_at_ms: Some(at), ..RunPatch::default() }
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

#[tokio::test]
async fn events_come_back_in_order_after_any_id_and_a_failed_batch_stores_nothing() {
    for (s, _dir) in backends().await {
        insert(&*s, row("run-1", "a", 1)).await;
        insert(&*s, row("run-2", "a", 2)).await;
        // Interleaved, as live runs write them.
        let writes: Vec<Write> = (1..=5).flat_map(|i| [append("run-1", Some(delta(i)), RunPatch::default()), append("run-2", Some(delta(i)), RunPatch::default())]).collect();
        s.apply(&writes).await.expect("events");
        let ids = |v: Vec<StoredEvent>| v.into_iter().map(|e| e.id).collect::<Vec<_>>();
        assert_eq!(ids(s.events("run-1", 0).await.expect("events")), [1, 2, 3, 4, 5], "{}", s.kind());
        assert_eq!(ids(s.events("run-1", 3).await.expect("events")), [4, 5], "{}", s.kind());
        assert_eq!(ids(s.events("run-1", 5).await.expect("events")), Vec::<u64>::new(), "{}", s.kind());
        assert_eq!(s.events("run-2", 1).await.expect("events")[0], delta(2), "{}: name and data kept", s.kind());
        if s.kind() == "sqlite" {
            // A batch is one transaction: a duplicate event id fails it, and its other writes
            // (here a new event of another run) are not stored either.
            let bad = [append("run-2", Some(delta(6)), RunPatch::default()), append("run-1", Some(delta(5)), RunPatch::default())];
            assert!(s.apply(&bad).await.is_err());
            assert_eq!(ids(s.events("run-2", 5).await.expect("events")), Vec::<u64>::new(), "half a batch was stored");
        }
    }
}

#[tokio::test]
async fn idempotency_keys_and_run_ids_find_the_same_request_and_refuse_another() {
    for (s, _dir) in backends().await {
        let mut first = row("run-1", "a", 1);
        first.idempotency_key = Some("key-1".into());
        insert(&*s, first.clone()).await;
        let mut retry = first.clone();
        retry.run_id = "run-other".into();
        let mut other_body = retry.clone();
        other_body.fingerprint = "another body".into();
        let mut same_id = row("run-1", "a", 2);
        same_id.fingerprint = "another body".into();
        let writes = [
            Write::Insert(Box::new(retry)),
            Write::Insert(Box::new(other_body)),
            Write::Insert(Box::new(same_id)),
            Write::Insert(Box::new(row("run-1", "a", 1))),
        ];
        let got = s.apply(&writes).await.expect("apply");
        assert_eq!(
            got,
            [
                Applied::Existing { run_id: "run-1".into() },
                Applied::IdempotencyMismatch,
                Applied::Conflict,
                Applied::Existing { run_id: "run-1".into() }
            ],
            "{}",
            s.kind()
        );
        assert_eq!(s.run("run-other").await.expect("read"), None, "{}: a retry made a second run", s.kind());
        // A deleted run (its admission failed) frees its key and id.
        s.apply(&[Write::Delete { run_id: "run-1".into() }]).await.expect("delete");
        assert!(matches!(s.apply(&[Write::Insert(Box::new(first))]).await.expect("insert").as_slice(), [Applied::Inserted { .. }]));
    }
}

#[tokio::test]
async fn unfinished_runs_are_listed_in_admission_order() {
    for (s, _dir) in backends().await {
        // Admission order, not creation time, is the order.
        for (i, id) in ["c", "a", "d", "b"].iter().enumerate() {
            insert(&*s, row(id, "acct", 100 - i as i64)).await;
        }
        s.apply(&[append("a", Some(event(1, EventName::Final, "{}")), finish(5))]).await.expect("finish a");
        let ids: Vec<String> = s.unfinished().await.expect("unfinished").into_iter().map(|r| r.run_id).collect();
        assert_eq!(ids, ["c", "d", "b"], "{}", s.kind());
    }
}

#[tokio::test]
async fn the_end_of_a_failed_run_replaces_what_clients_never_saw() {
    for (s, _dir) in backends().await {
        let mut r = row("run-1", "a", 1);
        r.webhook_url = Some("https://hooks.example.com/x".into());
        insert(&*s, r).await;
        // Clients saw 1..=3; 4 and 5 were stored after the write of 4 had failed once (retried
        // alone, say) and were never shown.
        let writes: Vec<Write> = (1..=5).map(|i| append("run-1", Some(delta(i)), RunPatch::default())).collect();
        s.apply(&writes).await.expect("events");
        let end = event(4, EventName::Error, r#"{"code":"internal"}"#);
        let patch = RunPatch {
            status: Some("error".into()),
            error: Some(("internal".into(), "disk full".into())),
            finished_at_ms: Some(9),
            ..RunPatch::default()
        };
        let webhook = NewDelivery { url: "https://hooks.example.com/x".into(), key_id: None, body: "{}".into() };
        let fail = Write::Fail { run_id: "run-1".into(), event: end.clone(), patch, webhook: Some(webhook) };
        // With a usage update of the same run in the same batch (it must not undo the end).
        let usage = append("run-1", None, RunPatch { usage: Some(Usage { input_tokens: 1, output_tokens: 1, llm_calls: 1 }), ..RunPatch::default() });
        s.apply(&[fail, usage]).await.expect("fail");
        let ev = s.events("run-1", 0).await.expect("events");
        assert_eq!(ev.iter().map(|e| e.id).collect::<Vec<_>>(), [1, 2, 3, 4], "{}", s.kind());
        assert_eq!(ev[3], end, "{}", s.kind());
        let got = s.run("run-1").await.expect("read").expect("row");
        assert_eq!((got.status.as_str(), got.error.clone(), got.finished_at_ms, got.last_event_id), ("error", Some(("internal".into(), "disk full".into())), Some(9), 4), "{}", s.kind());
        assert!(got.usage.is_some(), "{}", s.kind());
        assert!(s.unfinished().await.expect("unfinished").is_empty(), "{}", s.kind());
    }
}

#[tokio::test]
async fn retention_sweeps_finished_runs_by_age_and_count_and_never_unfinished_ones() {
    for (s, _dir) in backends().await {
        // Finished at 1000, 2000, ..., 5000; two unfinished runs admitted long before.
        insert(&*s, row("old-unfinished", "a", 0)).await;
        for i in 1..=5 {
            let id = format!("done-{i}");
            insert(&*s, row(&id, "a", i)).await;
            s.apply(&[append(&id, Some(event(1, EventName::Final, "{}")), finish(i * 1000))]).await.expect("finish");
        }
        insert(&*s, row("new-unfinished", "a", 6)).await;
        let kept = |s: Arc<dyn Store>| async move {
            let q = ListQuery { limit: 100, ..ListQuery::default() };
            let mut ids: Vec<String> = s.list(&q).await.expect("list").into_iter().map(|r| r.run_id).collect();
            ids.sort();
            ids
        };
        let wide = Retention { max_age_ms: 1_000_000, max_count: 100 };
        assert!(s.sweep(wide, 5_000).await.expect("sweep").is_empty(), "{}", s.kind());
        // Age: finished at or before now - max_age goes.
        let mut gone = s.sweep(Retention { max_age_ms: 3_000, max_count: 100 }, 5_000).await.expect("sweep");
        gone.sort();
        assert_eq!(gone, ["done-1", "done-2"], "{}", s.kind());
        assert!(s.events("done-1", 0).await.expect("events").is_empty(), "{}: events stay behind", s.kind());
        // Count: only the newest `max_count` finished runs stay.
        let gone = s.sweep(Retention { max_age_ms: 1_000_000, max_count: 1 }, 5_000).await.expect("sweep");
        assert_eq!(gone.len(), 2, "{}: {gone:?}", s.kind());
        assert_eq!(kept(s.clone()).await, ["done-5", "new-unfinished", "old-unfinished"], "{}", s.kind());
        // Nothing unfinished ever goes, however old or many.
        s.sweep(Retention { max_age_ms: 0, max_count: 0 }, i64::MAX).await.expect("sweep");
        assert_eq!(kept(s.clone()).await, ["new-unfinished", "old-unfinished"], "{}", s.kind());
        assert_eq!(s.run("done-5").await.expect("read"), None, "{}", s.kind());
    }
}

#[tokio::test]
async fn sqlite_keeps_runs_events_keys_and_unfinished_runs_across_a_reopen() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("runs.db");
    let mut r = row("run-1", "a", 1);
    r.idempotency_key = Some("key-1".into());
    {
        let s = SqliteStore::open(&path).await.expect("open");
        r.seq = insert(&s, r.clone()).await;
        insert(&s, row("run-2", "a", 2)).await;
        let patch = RunPatch { status: Some("running".into()), checkpoint: Some(CheckpointRecord::Sending { boot_id: None }), ..RunPatch::default() };
        s.apply(&[append("run-1", Some(event(1, EventName::Accepted, "{}")), patch.clone()), append("run-1", Some(delta(2)), RunPatch::default())])
            .await
            .expect("events");
        patch.apply(&mut r);
        r.last_event_id = 1;
        s.apply(&[append("run-2", Some(event(1, EventName::Final, "{}")), finish(3))]).await.expect("finish");
    }
    let s = SqliteStore::open(&path).await.expect("reopen");
    assert_eq!(s.run("run-1").await.expect("read"), Some(r.clone()));
    assert_eq!(s.events("run-1", 0).await.expect("events").len(), 2);
    assert_eq!(s.unfinished().await.expect("unfinished"), [r.clone()]);
    let mut again = row("run-new", "a", 9);
    again.idempotency_key = Some("key-1".into());
    again.fingerprint = r.fingerprint.clone();
    assert_eq!(s.apply(&[Write::Insert(Box::new(again))]).await.expect("insert"), [Applied::Existing { run_id: "run-1".into() }]);
    // A new run after the reopen continues the admission order.
    assert!(insert(&s, row("run-3", "a", 0)).await > r.seq);
}

#[tokio::test]
async fn sqlite_refuses_to_open_what_is_not_a_store_naming_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let garbage = dir.path().join("garbage.db");
    std::fs::write(&garbage, vec![0x5a; 64 * 1024]).expect("write");
    let e = SqliteStore::open(&garbage).await.err().expect("garbage refused");
    assert!(e.0.contains(&garbage.display().to_string()) && !e.0.contains('\n'), "{e}");
    let newer = dir.path().join("newer.db");
    {
        let c = rusqlite::Connection::open(&newer).expect("create");
        c.pragma_update(None, "user_version", 99).expect("version");
    }
    let e = SqliteStore::open(&newer).await.err().expect("a newer schema is refused");
    assert!(e.0.contains("newer") && e.0.contains(&newer.display().to_string()), "{e}");
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
