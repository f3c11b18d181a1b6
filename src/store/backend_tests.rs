//! The store backends against one contract: every case runs on `memory:` and SQLite (`name`) and
//! on PostgreSQL (`pg_name`, a database of its own on the server `CLAWMUX_TEST_PG_URL` names, see
//! tests/support/postgres.sh; skipped without it unless `CLAWMUX_REQUIRE_PG=1`). What must survive
//! a reopen, or two processes on one store, runs on the durable backends only.

use super::memory::MemoryStore;
use super::postgres::PgStore;
use super::sqlite::SqliteStore;
use super::{Applied, CheckpointRecord, EventName, ListQuery, NewDelivery, Retention, RunPatch, RunRow, SpecRecord, Store, StoredEvent, Write};
use crate::attribution::Usage;
use std::sync::Arc;

/// A trace id of the run's own (two live runs may not share one), the same for the same run id.
pub(super) fn trace_of(run_id: &str) -> String {
    let fnv = |seed: u64| run_id.bytes().fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{:016x}{:016x}", fnv(1), fnv(2))
}

pub(crate) fn row(run_id: &str, account: &str, created_at_ms: i64) -> RunRow {
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
            traceparent: format!("00-{}-b7ad6b7169203331-01", trace_of(run_id)),
            attribution_token: None,
            branch: None,
            abort_on_disconnect: true,
            if_busy: Default::default(),
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

pub(crate) fn event(id: u64, name: EventName, data: &str) -> StoredEvent {
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

/// A fresh PostgreSQL database's URL, or `None` (the test is skipped) without a test server.
pub(crate) async fn pg_url(test: &str) -> Option<String> {
    let Some(server) = std::env::var("CLAWMUX_TEST_PG_URL").ok().filter(|u| !u.is_empty()) else {
        assert!(
            !std::env::var("CLAWMUX_REQUIRE_PG").is_ok_and(|v| v == "1"),
            "{test}: CLAWMUX_REQUIRE_PG=1 but CLAWMUX_TEST_PG_URL is not set (tests/support/postgres.sh start DIR)"
        );
        eprintln!("SKIP {test}: no CLAWMUX_TEST_PG_URL");
        return None;
    };
    Some(super::postgres::create_test_database(&server, "cmx_unit").await.expect("a test database"))
}

async fn open_pg(url: &str) -> PgStore {
    let display = super::StoreUrl::parse(url).expect("url").display();
    PgStore::open(url, &display).await.expect("postgres opens")
}

/// Each case as `name` (memory, SQLite) and `pg_name` (PostgreSQL).
macro_rules! on_every_backend {
    ($($case:ident => $pg:ident),* $(,)?) => { $(
        #[tokio::test]
        async fn $case() {
            for (s, _dir) in backends().await {
                cases::$case(s).await;
            }
        }

        #[tokio::test]
        async fn $pg() {
            if let Some(url) = pg_url(stringify!($pg)).await {
                cases::$case(Arc::new(open_pg(&url).await)).await;
            }
        }
    )* };
}

on_every_backend! {
    a_run_document_round_trips_with_every_field => pg_a_run_document_round_trips_with_every_field,
    events_come_back_in_order_after_any_id_and_a_failed_batch_stores_nothing => pg_events_come_back_in_order_after_any_id_and_a_failed_batch_stores_nothing,
    idempotency_keys_and_run_ids_find_the_same_request_and_refuse_another => pg_idempotency_keys_and_run_ids_find_the_same_request_and_refuse_another,
    unfinished_runs_are_listed_in_admission_order => pg_unfinished_runs_are_listed_in_admission_order,
    the_end_of_a_failed_run_replaces_what_clients_never_saw => pg_the_end_of_a_failed_run_replaces_what_clients_never_saw,
    retention_sweeps_finished_runs_by_age_and_count_and_never_unfinished_ones => pg_retention_sweeps_finished_runs_by_age_and_count_and_never_unfinished_ones,
    history_filters_and_pages => pg_history_filters_and_pages,
}

async fn insert(s: &dyn Store, row: RunRow) -> i64 {
    match s.apply(&[Write::Insert(Box::new(row))]).await.expect("insert").as_slice() {
        [Applied::Inserted { seq }] => *seq,
        other => panic!("not inserted: {other:?}"),
    }
}

mod cases {
    use super::*;

    pub(super) async fn a_run_document_round_trips_with_every_field(s: Arc<dyn Store>) {
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

    pub(super) async fn events_come_back_in_order_after_any_id_and_a_failed_batch_stores_nothing(s: Arc<dyn Store>) {
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
        if s.kind() != "memory" {
            // A batch is one transaction: a duplicate event id fails it, and its other writes
            // (here a new event of another run) are not stored either.
            let bad = [append("run-2", Some(delta(6)), RunPatch::default()), append("run-1", Some(delta(5)), RunPatch::default())];
            assert!(s.apply(&bad).await.is_err());
            assert_eq!(ids(s.events("run-2", 5).await.expect("events")), Vec::<u64>::new(), "half a batch was stored");
        }
    }

    pub(super) async fn idempotency_keys_and_run_ids_find_the_same_request_and_refuse_another(s: Arc<dyn Store>) {
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
        // A key is its account's own: another account's equal key is another run.
        let mut other_account = row("run-acct-b", "b", 3);
        other_account.idempotency_key = Some("key-1".into());
        assert!(matches!(s.apply(&[Write::Insert(Box::new(other_account))]).await.expect("insert").as_slice(), [Applied::Inserted { .. }]), "{}", s.kind());
        // A deleted run (its admission failed) frees its key and id.
        s.apply(&[Write::Delete { run_id: "run-1".into() }]).await.expect("delete");
        assert!(matches!(s.apply(&[Write::Insert(Box::new(first))]).await.expect("insert").as_slice(), [Applied::Inserted { .. }]));
    }

    pub(super) async fn unfinished_runs_are_listed_in_admission_order(s: Arc<dyn Store>) {
        // Admission order, not creation time, is the order.
        for (i, id) in ["c", "a", "d", "b"].iter().enumerate() {
            insert(&*s, row(id, "acct", 100 - i as i64)).await;
        }
        s.apply(&[append("a", Some(event(1, EventName::Final, "{}")), finish(5))]).await.expect("finish a");
        let ids: Vec<String> = s.unfinished().await.expect("unfinished").into_iter().map(|r| r.run_id).collect();
        assert_eq!(ids, ["c", "d", "b"], "{}", s.kind());
    }

    pub(super) async fn the_end_of_a_failed_run_replaces_what_clients_never_saw(s: Arc<dyn Store>) {
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

    pub(super) async fn history_filters_and_pages(s: Arc<dyn Store>) {
        for i in 0..12i64 {
            let mut r = row(&format!("run-{i}"), if i % 3 == 0 { "acct-a" } else { "acct-b" }, 1_000 + i);
            r.state_key = (i % 2 == 0).then(|| "conv".to_owned());
            insert(&*s, r).await;
        }
        s.apply(&[append("run-4", Some(event(1, EventName::Final, "{}")), finish(5))]).await.expect("finish");
        let ids = |rows: Vec<RunRow>| rows.into_iter().map(|r| r.run_id).collect::<Vec<_>>();
        let q = |f: fn(&mut ListQuery)| {
            let mut q = ListQuery { limit: 100, ..ListQuery::default() };
            f(&mut q);
            q
        };
        let kind = s.kind();
        assert_eq!(ids(s.list(&q(|q| q.billing_account_id = Some("acct-a".into()))).await.expect("list")), ["run-9", "run-6", "run-3", "run-0"], "{kind}");
        assert_eq!(ids(s.list(&q(|q| q.statuses = vec!["ok".into()])).await.expect("list")), ["run-4"], "{kind}");
        assert_eq!(ids(s.list(&q(|q| q.statuses = vec!["ok".into(), "error".into()])).await.expect("list")), ["run-4"], "{kind}");
        assert_eq!(ids(s.list(&q(|q| q.state_key = Some("conv".into()))).await.expect("list")).len(), 6, "{kind}");
        assert_eq!(ids(s.list(&q(|q| q.since_ms = Some(1_010))).await.expect("list")), ["run-11", "run-10"], "{kind}");
        assert!(s.list(&q(|q| q.accounts = Some(Vec::new()))).await.expect("list").is_empty(), "{kind}");
        assert_eq!(ids(s.list(&q(|q| q.accounts = Some(vec!["acct-a".into()]))).await.expect("list")).len(), 4, "{kind}");
        // Pages by admission order: the cursor is the last row's seq.
        let first = s.list(&ListQuery { limit: 5, ..ListQuery::default() }).await.expect("page");
        let cursor = first.last().map(|r| r.seq);
        let second = s.list(&ListQuery { limit: 5, before_seq: cursor, ..ListQuery::default() }).await.expect("page");
        assert_eq!(ids(first), ["run-11", "run-10", "run-9", "run-8", "run-7"], "{kind}");
        assert_eq!(ids(second), ["run-6", "run-5", "run-4", "run-3", "run-2"], "{kind}");
    }

    pub(super) async fn retention_sweeps_finished_runs_by_age_and_count_and_never_unfinished_ones(s: Arc<dyn Store>) {
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
        // Runs finished at the same time: the later admitted is the newer one.
        for id in ["tie-1", "tie-2"] {
            insert(&*s, row(id, "a", 7)).await;
            s.apply(&[append(id, Some(event(1, EventName::Final, "{}")), finish(4_500))]).await.expect("finish");
        }
        let gone = s.sweep(Retention { max_age_ms: 1_000_000, max_count: 2 }, 5_000).await.expect("sweep");
        assert_eq!(gone, ["tie-1"], "{}", s.kind());
        let gone = s.sweep(Retention { max_age_ms: 1_000_000, max_count: 1 }, 5_000).await.expect("sweep");
        assert_eq!(gone, ["tie-2"], "{}", s.kind());
        // The count is per billing account: one account's many runs do not push another's out.
        for (id, account, at) in [("b-old", "b", 1_000), ("a-1", "a", 2_000), ("a-2", "a", 3_000), ("c-1", "c", 3_500)] {
            insert(&*s, row(id, account, 8)).await;
            s.apply(&[append(id, Some(event(1, EventName::Final, "{}")), finish(at))]).await.expect("finish");
        }
        let mut gone = s.sweep(Retention { max_age_ms: 1_000_000, max_count: 1 }, 5_000).await.expect("sweep");
        gone.sort();
        // Of account `a`: `done-5` (5,000) stays; `a-1` and `a-2` go. `b-old` and `c-1` are their
        // accounts' newest, however old.
        assert_eq!(gone, ["a-1", "a-2"], "{}", s.kind());
        assert_eq!(kept(s.clone()).await, ["b-old", "c-1", "done-5", "new-unfinished", "old-unfinished"], "{}", s.kind());
        // Nothing unfinished ever goes, however old or many.
        s.sweep(Retention { max_age_ms: 0, max_count: 0 }, i64::MAX).await.expect("sweep");
        assert_eq!(kept(s.clone()).await, ["new-unfinished", "old-unfinished"], "{}", s.kind());
        assert_eq!(s.run("done-5").await.expect("read"), None, "{}", s.kind());
    }
}

/// Opens one durable store again and again (a restart, or another process on the same store).
type Opener = Box<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Arc<dyn Store>> + Send>> + Send + Sync>;

fn sqlite_opener(path: std::path::PathBuf) -> Opener {
    Box::new(move || {
        let path = path.clone();
        Box::pin(async move { Arc::new(SqliteStore::open(&path).await.expect("sqlite opens")) as Arc<dyn Store> })
    })
}

fn pg_opener(url: String) -> Opener {
    Box::new(move || {
        let url = url.clone();
        Box::pin(async move { Arc::new(open_pg(&url).await) as Arc<dyn Store> })
    })
}

/// Each case as `sqlite_name` and `pg_name`: given a way to open the same store again.
macro_rules! on_durable_backends {
    ($($case:ident: $sqlite:ident, $pg:ident),* $(,)?) => { $(
        #[tokio::test]
        async fn $sqlite() {
            let dir = tempfile::tempdir().expect("temp dir");
            durable::$case(sqlite_opener(dir.path().join("runs.db"))).await;
        }

        #[tokio::test]
        async fn $pg() {
            if let Some(url) = pg_url(stringify!($pg)).await {
                durable::$case(pg_opener(url)).await;
            }
        }
    )* };
}

on_durable_backends! {
    keeps_runs_events_keys_and_unfinished_runs_across_a_reopen:
        sqlite_keeps_runs_events_keys_and_unfinished_runs_across_a_reopen, pg_keeps_runs_events_keys_and_unfinished_runs_across_a_reopen,
    two_processes_admitting_one_request_at_once_store_it_once:
        sqlite_two_processes_admitting_one_request_at_once_store_it_once, pg_two_processes_admitting_one_request_at_once_store_it_once,
}

mod durable {
    use super::*;

    pub(super) async fn keeps_runs_events_keys_and_unfinished_runs_across_a_reopen(open: Opener) {
        let mut r = row("run-1", "a", 1);
        r.idempotency_key = Some("key-1".into());
        {
            let s = open().await;
            r.seq = insert(&*s, r.clone()).await;
            insert(&*s, row("run-2", "a", 2)).await;
            let patch = RunPatch { status: Some("running".into()), checkpoint: Some(CheckpointRecord::Sending { boot_id: None }), ..RunPatch::default() };
            s.apply(&[append("run-1", Some(event(1, EventName::Accepted, "{}")), patch.clone()), append("run-1", Some(delta(2)), RunPatch::default())])
                .await
                .expect("events");
            patch.apply(&mut r);
            r.last_event_id = 1;
            s.apply(&[append("run-2", Some(event(1, EventName::Final, "{}")), finish(3))]).await.expect("finish");
        }
        let s = open().await;
        assert_eq!(s.run("run-1").await.expect("read"), Some(r.clone()), "{}", s.kind());
        assert_eq!(s.events("run-1", 0).await.expect("events").len(), 2, "{}", s.kind());
        assert_eq!(s.unfinished().await.expect("unfinished"), [r.clone()], "{}", s.kind());
        let mut again = row("run-new", "a", 9);
        again.idempotency_key = Some("key-1".into());
        again.fingerprint = r.fingerprint.clone();
        assert_eq!(s.apply(&[Write::Insert(Box::new(again))]).await.expect("insert"), [Applied::Existing { run_id: "run-1".into() }], "{}", s.kind());
        // A new run after the reopen continues the admission order.
        assert!(insert(&*s, row("run-3", "a", 0)).await > r.seq, "{}", s.kind());
    }

    /// Two stores on one database (two processes, or two replicas) admit the same run ids and
    /// idempotency keys at once: the database's constraints let exactly one of each in, and the
    /// other learns it is the same run.
    pub(super) async fn two_processes_admitting_one_request_at_once_store_it_once(open: Opener) {
        let (a, b) = (open().await, open().await);
        const N: usize = 40;
        let request = |i: usize, by: &str| {
            let mut r = row(&format!("run-{i}"), "acct", i as i64);
            // Odd ones: the same idempotency key under two run ids (a client retrying through
            // another replica); even ones: the same run id.
            if i % 2 == 1 {
                r.run_id = format!("run-{i}-{by}");
                r.idempotency_key = Some(format!("key-{i}"));
                r.fingerprint = format!("fp-{i}");
            }
            Write::Insert(Box::new(r))
        };
        let admit = |s: Arc<dyn Store>, by: &'static str| async move {
            let mut out = Vec::new();
            for i in 0..N {
                out.push(s.apply(&[request(i, by)]).await.expect("admission").pop().expect("one result"));
            }
            out
        };
        let (ra, rb) = tokio::join!(tokio::spawn(admit(a.clone(), "a")), tokio::spawn(admit(b.clone(), "b")));
        let (ra, rb) = (ra.expect("a"), rb.expect("b"));
        for i in 0..N {
            let inserted = [&ra[i], &rb[i]].iter().filter(|r| matches!(r, Applied::Inserted { .. })).count();
            assert_eq!(inserted, 1, "{}: request {i} stored {inserted} times: {:?} / {:?}", a.kind(), ra[i], rb[i]);
            let existing = [&ra[i], &rb[i]].into_iter().find(|r| !matches!(r, Applied::Inserted { .. })).expect("the other");
            assert!(matches!(existing, Applied::Existing { .. }), "{}: request {i}: {existing:?}", a.kind());
        }
        let all = a.list(&ListQuery { limit: 500, ..ListQuery::default() }).await.expect("list");
        assert_eq!(all.len(), N, "{}", a.kind());
    }
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

/// Keys, limits, spend and the webhook outbox: the same on every backend.
async fn tenant_rows_round_trip(s: Arc<dyn Store>, t: Arc<dyn super::tenants::TenantStore>) {
    use super::tenants::{DeliveryOutcome, KeyRecord, Limits};
    let kind = s.kind();
    let key = |id: &str, at: i64| KeyRecord {
        id: id.to_owned(),
        name: format!("key {id}"),
        secret_sha256: "ab".repeat(32),
        accounts: vec!["acct-a".into(), "acct-b".into()],
        actions: vec!["run".into(), "read".into()],
        webhook_secret: "whsec_x".into(),
        webhook_url: Some("https://hooks.example.com/k".into()),
        created_at_ms: at,
        revoked_at_ms: None,
        created_by: None,
    };
    t.create_key(&key("k2", 2)).await.expect("create");
    t.create_key(&key("k1", 1)).await.expect("create");
    assert!(t.create_key(&key("k1", 3)).await.is_err(), "{kind}: a key id is unique");
    assert_eq!(t.key("k1").await.expect("key"), Some(key("k1", 1)), "{kind}");
    assert_eq!(t.keys().await.expect("keys").into_iter().map(|k| k.id).collect::<Vec<_>>(), ["k1", "k2"], "{kind}");
    assert!(t.revoke_key("k1", 10).await.expect("revoke"), "{kind}");
    assert!(t.revoke_key("k1", 20).await.expect("revoke again"), "{kind}");
    assert_eq!(t.key("k1").await.expect("key").and_then(|k| k.revoked_at_ms), Some(10), "{kind}: the first revocation stays");
    assert!(!t.revoke_key("nope", 1).await.expect("revoke"), "{kind}");
    // Revoking a key revokes the keys it made, theirs, ...; not its maker's nor others'.
    let made_by = |id: &str, by: &str| KeyRecord { created_by: Some(by.to_owned()), ..key(id, 3) };
    for k in [made_by("k3", "k2"), made_by("k4", "k3"), made_by("k5", "k1"), key("k6", 3)] {
        t.create_key(&k).await.expect("create");
    }
    assert_eq!(t.key("k4").await.expect("key"), Some(made_by("k4", "k3")), "{kind}: the maker is stored");
    assert!(t.revoke_key("k3", 30).await.expect("revoke"), "{kind}");
    let revoked = |id: &'static str| {
        let t = t.clone();
        async move { t.key(id).await.expect("key").and_then(|k| k.revoked_at_ms) }
    };
    assert_eq!((revoked("k3").await, revoked("k4").await, revoked("k2").await, revoked("k6").await), (Some(30), Some(30), None, None), "{kind}");
    assert!(t.revoke_key("k2", 40).await.expect("revoke"), "{kind}");
    assert_eq!((revoked("k2").await, revoked("k3").await, revoked("k6").await), (Some(40), Some(30), None), "{kind}: an earlier revocation stays");

    // A branch key is the first account's that claims it, for good.
    let claim = |owner: &str, claimed_now: bool| super::tenants::BranchClaim { owner: owner.into(), claimed_now };
    assert_eq!(t.claim_branch("fix", "acct-a", 1, "c1").await.expect("claim"), claim("acct-a", true), "{kind}");
    assert_eq!(t.claim_branch("fix", "acct-b", 2, "c2").await.expect("claim"), claim("acct-a", false), "{kind}: another account's key");
    assert_eq!(t.claim_branch("fix/b", "acct-b", 4, "c4").await.expect("claim"), claim("acct-b", true), "{kind}");
    // Let go of by the claim that made it the owner's only (a refused run's), and only while no
    // later claim of the owner came (a run of that account admitted meanwhile works on the key).
    t.release_branch("fix", "c2").await.expect("release");
    assert_eq!(t.claim_branch("fix", "acct-b", 5, "c5").await.expect("claim"), claim("acct-a", false), "{kind}: let go of by another account's claim");
    assert_eq!(t.claim_branch("fix", "acct-a", 3, "c3").await.expect("claim"), claim("acct-a", false), "{kind}");
    t.release_branch("fix", "c1").await.expect("release");
    assert_eq!(t.claim_branch("fix", "acct-b", 6, "c6").await.expect("claim"), claim("acct-a", false), "{kind}: let go of while a later claim holds it");
    t.release_branch("fix/b", "c4").await.expect("release");
    assert_eq!(t.claim_branch("fix/b", "acct-a", 7, "c7").await.expect("claim"), claim("acct-a", true), "{kind}");
    // Its owner read without a claim (a base ref naming the key's branch).
    assert_eq!(t.branch_owner("fix").await.expect("owner").as_deref(), Some("acct-a"), "{kind}");
    assert_eq!(t.branch_owner("nobody").await.expect("owner"), None, "{kind}");
    assert_eq!(t.claim_branch("nobody", "acct-b", 8, "c8").await.expect("claim"), claim("acct-b", true), "{kind}: reading claimed nothing");

    let limits = Limits { max_tokens: Some(1000), period_sec: Some(60), max_concurrent: Some(2), max_runs_per_minute: None };
    assert_eq!(t.limits("acct-a").await.expect("limits"), None, "{kind}");
    t.set_limits("acct-a", &Limits::default(), 1).await.expect("set");
    t.set_limits("acct-a", &limits, 2).await.expect("set again");
    assert_eq!(t.limits("acct-a").await.expect("limits"), Some(limits), "{kind}");
    assert_eq!(t.all_limits().await.expect("all"), [("acct-a".to_owned(), limits)], "{kind}");

    let spend = |tokens| Write::Spend { account: "acct-a".into(), window_start_ms: 60_000, tokens, id: super::BillingId::new() };
    s.apply(&[spend(5), spend(7)]).await.expect("spend");
    s.apply(&[spend(30)]).await.expect("spend");
    assert_eq!(t.spend("acct-a", 60_000).await.expect("spend"), 42, "{kind}");
    assert_eq!(t.spend("acct-a", 0).await.expect("spend"), 0, "{kind}");
    // Token counts come from the upstream (untrusted): sums saturate, never fail or wrap.
    s.apply(&[spend(u64::MAX)]).await.expect("a huge spend is stored");
    s.apply(&[spend(u64::MAX)]).await.expect("and another");
    let top = t.spend("acct-a", 60_000).await.expect("spend");
    assert!(top >= u64::try_from(i64::MAX).unwrap_or(u64::MAX), "{kind}: {top}");

    insert(&*s, row("run-w", "acct-a", 1)).await;
    let webhook = NewDelivery { url: "https://hooks.example.com/k".into(), key_id: Some("k2".into()), body: "{\"runId\":\"run-w\"}".into() };
    s.apply(&[Write::Append { run_id: "run-w".into(), event: Some(event(1, EventName::Final, "{}")), patch: finish(5), webhook: Some(webhook) }])
        .await
        .expect("end with a webhook");
    let due = t.due_deliveries(super::now_ms() + 1_000, 10).await.expect("due");
    assert_eq!(due.len(), 1, "{kind}");
    assert_eq!((due[0].run_id.as_str(), due[0].key_id.as_deref(), due[0].body.as_str(), due[0].attempts), ("run-w", Some("k2"), "{\"runId\":\"run-w\"}", 0), "{kind}");
    t.record_delivery(due[0].id, &DeliveryOutcome::Retry { next_at_ms: i64::MAX, error: "503".into() }, 1).await.expect("retry");
    assert!(t.due_deliveries(super::now_ms() + 1_000, 10).await.expect("due").is_empty(), "{kind}: not due before its next attempt");
    t.record_delivery(due[0].id, &DeliveryOutcome::Delivered, 2).await.expect("delivered");
    assert_eq!(t.deliveries_of("run-w").await.expect("deliveries"), [(2, true, false, Some("503".into()))], "{kind}");

    // Due deliveries: round-robin across keys (the admin token's, `None`, are one), at most
    // `DUE_PER_KEY` of one key, so a tenant's backlog does not fill the list the others wait behind.
    let per_key = super::tenants::DUE_PER_KEY;
    for (i, key) in (0..per_key + 2).map(|i| (i, Some("k-busy"))).chain([(100, Some("k-quiet")), (101, None), (102, None)]) {
        let id = format!("run-d{i}");
        insert(&*s, row(&id, "acct-a", 1)).await;
        let webhook = NewDelivery { url: "https://hooks.example.com/k".into(), key_id: key.map(str::to_owned), body: "{}".into() };
        s.apply(&[Write::Append { run_id: id, event: Some(event(1, EventName::Final, "{}")), patch: finish(5), webhook: Some(webhook) }]).await.expect("end");
    }
    let due: Vec<(String, Option<String>)> = t.due_deliveries(super::now_ms() + 1_000, 64).await.expect("due").into_iter().map(|d| (d.run_id, d.key_id)).collect();
    let busy = |i: usize| (format!("run-d{i}"), Some("k-busy".to_owned()));
    let mut want = vec![busy(0), ("run-d100".to_owned(), Some("k-quiet".to_owned())), ("run-d101".to_owned(), None), busy(1), ("run-d102".to_owned(), None)];
    want.extend((2..per_key).map(busy));
    assert_eq!(due, want, "{kind}");
}

/// A tenant with many keys, each with a retry due (a receiver that never answers), does not
/// crowd another key's first attempt out of the due list: 64 retries, older than it, and a list
/// of 64.
async fn retries_of_many_keys_never_crowd_out_a_first_attempt(s: Arc<dyn Store>, t: Arc<dyn super::tenants::TenantStore>) {
    let kind = s.kind();
    let end = |id: &str, key: &str| Write::Append {
        run_id: id.into(),
        event: Some(event(1, EventName::Final, "{}")),
        patch: finish(5),
        webhook: Some(NewDelivery { url: "https://hooks.example.com/k".into(), key_id: Some(key.into()), body: "{}".into() }),
    };
    for i in 0..64 {
        let id = format!("run-crowd-{i}");
        insert(&*s, row(&id, "acct-crowd", 1)).await;
        s.apply(&[end(&id, &format!("k-crowd-{i}"))]).await.expect("end");
    }
    for d in t.due_deliveries(super::now_ms() + 1_000, 64).await.expect("due") {
        t.record_delivery(d.id, &super::tenants::DeliveryOutcome::Retry { next_at_ms: 0, error: "timed out".into() }, 1).await.expect("retry");
    }
    insert(&*s, row("run-victim", "acct-v", 1)).await;
    s.apply(&[end("run-victim", "k-victim")]).await.expect("end");
    let due = t.due_deliveries(super::now_ms() + 1_000, 64).await.expect("due");
    assert_eq!(due.len(), 64, "{kind}");
    assert_eq!(due[0].run_id, "run-victim", "{kind}: the first attempt goes first");
    assert_eq!(due[1].run_id, "run-crowd-0", "{kind}: then the oldest retry");
    // Still round-robin across keys: the victim's key's second delivery waits for the round of
    // every key's first.
    insert(&*s, row("run-victim-2", "acct-v", 1)).await;
    s.apply(&[end("run-victim-2", "k-victim")]).await.expect("end");
    let due: Vec<String> = t.due_deliveries(super::now_ms() + 1_000, 4).await.expect("due").into_iter().map(|d| d.run_id).collect();
    assert_eq!(due, ["run-victim", "run-crowd-0", "run-crowd-1", "run-crowd-2"], "{kind}");
    // And the other way round: first attempts of 64 keys leave the retries a turn each.
    for i in 0..64 {
        let id = format!("run-new-{i}");
        insert(&*s, row(&id, "acct-new", 1)).await;
        s.apply(&[end(&id, &format!("k-new-{i}"))]).await.expect("end");
    }
    let due: Vec<String> = t.due_deliveries(super::now_ms() + 1_000, 8).await.expect("due").into_iter().map(|d| d.run_id).collect();
    assert_eq!(due, ["run-victim", "run-crowd-0", "run-new-0", "run-crowd-1", "run-new-1", "run-crowd-2", "run-new-2", "run-crowd-3"], "{kind}");
}

#[tokio::test]
async fn retries_of_many_keys_never_crowd_out_a_first_attempt_on_memory_and_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = Arc::new(SqliteStore::open(&dir.path().join("runs.db")).await.expect("sqlite opens"));
    retries_of_many_keys_never_crowd_out_a_first_attempt(sqlite.clone(), sqlite).await;
    let memory = Arc::new(MemoryStore::new());
    retries_of_many_keys_never_crowd_out_a_first_attempt(memory.clone(), memory).await;
}

#[tokio::test]
async fn pg_retries_of_many_keys_never_crowd_out_a_first_attempt() {
    if let Some(url) = pg_url("pg_retries_of_many_keys_never_crowd_out").await {
        let pg = Arc::new(open_pg(&url).await);
        retries_of_many_keys_never_crowd_out_a_first_attempt(pg.clone(), pg).await;
    }
}

#[tokio::test]
async fn tenant_rows_round_trip_on_memory_and_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = Arc::new(SqliteStore::open(&dir.path().join("runs.db")).await.expect("sqlite opens"));
    tenant_rows_round_trip(sqlite.clone(), sqlite).await;
    let memory = Arc::new(MemoryStore::new());
    tenant_rows_round_trip(memory.clone(), memory).await;
}

#[tokio::test]
async fn pg_tenant_rows_round_trip() {
    if let Some(url) = pg_url("pg_tenant_rows_round_trip").await {
        let pg = Arc::new(open_pg(&url).await);
        tenant_rows_round_trip(pg.clone(), pg).await;
    }
}

/// Two replicas' accounts claiming one branch key at once: one of them owns it, and both are told
/// the same owner (the upsert answers the other's committed row).
#[tokio::test]
async fn pg_a_branch_key_claimed_by_two_accounts_at_once_has_one_owner() {
    use super::tenants::TenantStore;
    let Some(url) = pg_url("pg_a_branch_key_claimed_at_once").await else { return };
    let (a, b) = (open_pg(&url).await, open_pg(&url).await);
    for i in 0..20 {
        let key = format!("race-{i}");
        let (x, y) = tokio::join!(a.claim_branch(&key, "acct-a", 1, "ca"), b.claim_branch(&key, "acct-b", 1, "cb"));
        let (x, y) = (x.expect("claim"), y.expect("claim"));
        assert_eq!(x.owner, y.owner, "{key}: two owners");
        assert!(x.claimed_now != y.claimed_now, "{key}: one claim made it: {x:?} {y:?}");
    }
}

/// A stored row that does not decode (its contents are input too): skipped and logged by reads,
/// never a panic nor another run; an event of an unknown kind is an error naming the store.
async fn unreadable_rows_are_skipped_and_never_panic(s: Arc<dyn Store>, corrupt: impl std::future::Future<Output = ()>) {
    let kind = s.kind();
    insert(&*s, row("good", "a", 1)).await;
    insert(&*s, row("bad", "a", 2)).await;
    s.apply(&[append("bad", Some(delta(1)), RunPatch::default())]).await.expect("event");
    corrupt.await;
    assert_eq!(s.run("bad").await.expect("read"), None, "{kind}");
    assert_eq!(s.list(&ListQuery { limit: 10, ..ListQuery::default() }).await.expect("list").into_iter().map(|r| r.run_id).collect::<Vec<_>>(), ["good"], "{kind}");
    assert_eq!(s.unfinished().await.expect("unfinished").len(), 1, "{kind}");
    let e = s.events("bad", 0).await.expect_err("an unknown event kind");
    assert!(e.0.contains("unknown kind") && e.0.contains("run store"), "{kind}: {e}");
}

#[tokio::test]
async fn sqlite_unreadable_rows_are_skipped_and_never_panic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("runs.db");
    let s = Arc::new(SqliteStore::open(&path).await.expect("sqlite opens"));
    let corrupt = async {
        let c = rusqlite::Connection::open(&path).expect("open");
        c.execute_batch("UPDATE runs SET spec = '{not json' WHERE run_id = 'bad'; UPDATE events SET name = 'nonsense' WHERE run_id = 'bad';").expect("corrupt");
    };
    unreadable_rows_are_skipped_and_never_panic(s, corrupt).await;
}

#[tokio::test]
async fn pg_unreadable_rows_are_skipped_and_never_panic() {
    if let Some(url) = pg_url("pg_unreadable_rows_are_skipped_and_never_panic").await {
        let s = Arc::new(open_pg(&url).await);
        let pool = s.pool().clone();
        let corrupt = async move {
            sqlx::query("UPDATE runs SET spec = '{not json', last_event_id = -5 WHERE run_id = 'bad'").execute(&pool).await.expect("corrupt");
            sqlx::query("UPDATE events SET name = 'nonsense' WHERE run_id = 'bad'").execute(&pool).await.expect("corrupt");
        };
        unreadable_rows_are_skipped_and_never_panic(s, corrupt).await;
    }
}

/// Not a test: `CLAWMUX_TEST_PG_URL=… cargo test --release -p clawmux --lib pg_batch_cost -- --ignored --nocapture`
/// prints what a batch of events costs the PostgreSQL store on this machine (as
/// `store::sqlite::probe` does for SQLite).
#[tokio::test]
#[ignore]
async fn pg_batch_cost() {
    for leased in [false, true] {
        let Some(url) = pg_url("pg_batch_cost").await else { return };
        let s = open_pg(&url).await;
        if leased {
            // As `clawmux serve` runs it: owned runs, each batch fenced and notifying followers.
            s.set_lease(&super::Lease { replica: "bench".into(), ms: 60_000 });
        }
        println!("{}", if leased { "with leases (clawmux serve):" } else { "without leases:" });
        batch_cost(&s).await;
    }
}

/// Not a test: `CLAWMUX_TEST_PG_URL=… cargo test --release -p clawmux --lib pg_sweep_cost -- --ignored --nocapture`
/// prints what one retention sweep costs PostgreSQL with many stored runs, their usage shares and
/// LLM-call records (the sweep runs every 10 s on every replica).
#[tokio::test]
#[ignore]
async fn pg_sweep_cost() {
    let Some(url) = pg_url("pg_sweep_cost").await else { return };
    let pool = open_pg(&url).await.pool().clone();
    for (runs, calls_per_run) in [(10_000i64, 5i64), (100_000, 5)] {
        sqlx::query("TRUNCATE runs, run_usage, llm_calls").execute(&pool).await.expect("truncate");
        sqlx::query(
            "INSERT INTO runs (run_id, fingerprint, billing_account_id, session_key, spec, status, content, created_at, finished_at) \
             SELECT 'r' || g, 'fp', 'acct', 'agent:main:clawmux:acct.r.' || g, '{}', 'ok', '', 1, 2 FROM generate_series(1, $1) g",
        )
        .bind(runs)
        .execute(&pool)
        .await
        .expect("runs");
        sqlx::query("INSERT INTO run_usage (run_id, replica, input_tokens, output_tokens, llm_calls) SELECT 'r' || g, 'a', 1, 1, 1 FROM generate_series(1, $1) g")
            .bind(runs)
            .execute(&pool)
            .await
            .expect("usage");
        sqlx::query("INSERT INTO llm_calls (run_id, replica, record) SELECT 'r' || (g % $1 + 1), 'a', '{}' FROM generate_series(1, $1 * $2) g")
            .bind(runs)
            .bind(calls_per_run)
            .execute(&pool)
            .await
            .expect("calls");
        sqlx::query("ANALYZE").execute(&pool).await.expect("analyze");
        // The default count (`CLAWMUX_RUN_RETENTION_MAX`), and none.
        for max_count in [10_000, usize::MAX] {
            let keep = Retention { max_age_ms: i64::MAX, max_count };
            // A fresh store's first sweep also looks for orphaned records (then every 10 minutes).
            let s = open_pg(&url).await;
            let t0 = std::time::Instant::now();
            let gone = s.sweep(keep, super::now_ms()).await.expect("sweep").len();
            let first = t0.elapsed();
            let t0 = std::time::Instant::now();
            for _ in 0..5 {
                s.sweep(keep, super::now_ms()).await.expect("sweep");
            }
            println!(
                "{runs} runs, {} call records, max_count {max_count}: first sweep (with orphans, {gone} runs deleted) {:.1} ms, then {:.1} ms per sweep",
                runs * calls_per_run,
                first.as_secs_f64() * 1000.0,
                t0.elapsed().as_secs_f64() * 1000.0 / 5.0
            );
        }
    }
}

async fn batch_cost(s: &PgStore) {
    let inserts: Vec<Write> = (0..1000).map(|i| Write::Insert(Box::new(row(&format!("run-{i}"), "a", 1)))).collect();
    s.apply(&inserts).await.expect("insert");
    let mut id = 0u64;
    for batch in [1usize, 10, 100, 1000] {
        let rounds = 20_000 / batch;
        let t0 = std::time::Instant::now();
        for r in 0..rounds {
            let writes: Vec<Write> = (0..batch)
                .map(|i| {
                    id += 1;
                    append(&format!("run-{}", (r * batch + i) % 1000), Some(event(1_000_000 + id, EventName::TextDelta, "{\"text\":\"hello world, a delta\"}")), RunPatch::default())
                })
                .collect();
            s.apply(&writes).await.expect("apply");
        }
        let el = t0.elapsed();
        println!(
            "batch {batch:>5}: {rounds} commits, {:.1} us per event, {:.2} ms per commit",
            el.as_micros() as f64 / 20_000.0,
            el.as_secs_f64() * 1000.0 / rounds as f64
        );
    }
}

#[tokio::test]
async fn pg_heartbeats_keep_one_row_per_replica_newest_first() {
    let Some(url) = pg_url("pg_heartbeats_keep_one_row_per_replica_newest_first").await else { return };
    let s = open_pg(&url).await;
    let beat = |id: &str, started, at| super::Replica { id: id.into(), started_at_ms: started, heartbeat_at_ms: at, version: "0.1.0".into() };
    assert_eq!(s.replicas().await.expect("replicas"), Some(Vec::new()));
    s.heartbeat(&beat("a", 1, 10)).await.expect("beat");
    s.heartbeat(&beat("b", 2, 20)).await.expect("beat");
    s.heartbeat(&beat("a", 1, 30)).await.expect("beat");
    assert_eq!(s.replicas().await.expect("replicas"), Some(vec![beat("a", 1, 30), beat("b", 2, 20)]));
    // A restart under the same id is a new start.
    s.heartbeat(&beat("b", 40, 40)).await.expect("beat");
    assert_eq!(s.replicas().await.expect("replicas").expect("tracked")[0], beat("b", 40, 40));
}

#[tokio::test]
async fn stores_of_one_process_track_no_replicas() {
    for (s, _dir) in backends().await {
        s.heartbeat(&super::Replica { id: "a".into(), started_at_ms: 1, heartbeat_at_ms: 1, version: "x".into() }).await.expect("no-op");
        assert_eq!(s.replicas().await.expect("replicas"), None, "{}", s.kind());
    }
}

/// A database migrated by a newer clawmux (a downgrade): refused at start, in one line naming the
/// store without its password.
#[tokio::test]
async fn pg_refuses_a_schema_newer_than_this_build_in_one_line() {
    let Some(url) = pg_url("pg_refuses_a_schema_newer_than_this_build_in_one_line").await else { return };
    let s = open_pg(&url).await;
    sqlx::query("INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (99, 'from the future', true, '\\x00'::bytea, 1)")
        .execute(s.pool())
        .await
        .expect("a newer migration");
    let display = super::StoreUrl::parse(&url).expect("url").display();
    let e = PgStore::open(&url, &display).await.err().expect("a newer schema is refused");
    let password = reqwest::Url::parse(&url).expect("url").password().unwrap_or_default().to_owned();
    assert!(e.0.contains(&display) && e.0.contains("99") && !e.0.contains('\n'), "{e}");
    assert!(!e.0.contains(&password), "{e}");
}

/// A store made by the previous schema (idempotency keys unique across accounts) is migrated:
/// every run kept, the admission counter kept (a swept run's seq is never handed out again), and
/// keys become per account.
#[tokio::test]
async fn sqlite_migrates_a_version_2_store_keeping_runs_and_the_admission_counter() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("runs.db");
    {
        let c = rusqlite::Connection::open(&path).expect("create");
        c.execute_batch(include_str!("../../migrations/sqlite/0001_runs.sql")).expect("v1");
        c.execute_batch(include_str!("../../migrations/sqlite/0002_tenants.sql")).expect("v2");
        c.pragma_update(None, "user_version", 2).expect("version");
        for (id, key) in [("run-1", "key-1"), ("run-2", "key-2"), ("run-3", "key-3")] {
            c.execute(
                "INSERT INTO runs (run_id, idempotency_key, fingerprint, billing_account_id, session_key, spec, status, created_at) \
                 VALUES (?, ?, ?, 'a', 's', ?, 'queued', 1)",
                rusqlite::params![id, key, format!("fp-{id}"), serde_json::to_string(&row(id, "a", 1).spec).expect("spec")],
            )
            .expect("insert");
        }
        c.execute("DELETE FROM runs WHERE run_id = 'run-3'", []).expect("swept");
    }
    let s = SqliteStore::open(&path).await.expect("migrates");
    let every = i64::try_from(super::sqlite::MIGRATIONS.len()).expect("a few");
    assert_eq!(s.schema().await.expect("schema"), Some(super::SchemaVersion { applied: every, known: every }));
    let kept: Vec<(String, i64)> = s.unfinished().await.expect("runs").into_iter().map(|r| (r.run_id, r.seq)).collect();
    assert_eq!(kept, [("run-1".to_owned(), 1), ("run-2".to_owned(), 2)]);
    let mut same = row("run-again", "a", 2);
    same.idempotency_key = Some("key-1".into());
    same.fingerprint = "fp-run-1".into();
    assert_eq!(s.apply(&[Write::Insert(Box::new(same))]).await.expect("insert"), [Applied::Existing { run_id: "run-1".into() }]);
    let mut other = row("run-b", "b", 2);
    other.idempotency_key = Some("key-1".into());
    assert_eq!(insert(&s, other).await, 4, "a new run after the swept run-3, on another account's equal key");
}

/// A store of the schema before branch keys had owners: each stored run's key belongs to the
/// account of its first run (its branch and pull request may exist already); a spec that does not
/// read is passed by, not a failed migration.
#[tokio::test]
async fn sqlite_migrating_to_branch_owners_gives_each_stored_key_to_its_first_runs_account() {
    use super::tenants::{BranchClaim, TenantStore};
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("runs.db");
    {
        let c = rusqlite::Connection::open(&path).expect("create");
        for m in [
            include_str!("../../migrations/sqlite/0001_runs.sql"),
            include_str!("../../migrations/sqlite/0002_tenants.sql"),
            include_str!("../../migrations/sqlite/0003_idempotency_per_account.sql"),
            include_str!("../../migrations/sqlite/0004_event_log.sql"),
        ] {
            c.execute_batch(m).expect("migration");
        }
        c.pragma_update(None, "user_version", 4).expect("version");
        let spec = |id: &str, account: &str, key: Option<&str>| {
            let mut r = row(id, account, 1);
            r.spec.branch = key.map(|k| clawmux_actors::branch::BranchPlan { key: k.into(), base_ref: "main".into(), pr_title: None, pr_body: None });
            serde_json::to_string(&r.spec).expect("spec")
        };
        for (id, account, text) in [
            ("run-1", "acct-a", spec("run-1", "acct-a", Some("shared"))),
            ("run-2", "acct-b", spec("run-2", "acct-b", Some("shared"))),
            ("run-3", "acct-b", spec("run-3", "acct-b", Some("b-own"))),
            ("run-4", "acct-c", spec("run-4", "acct-c", None)),
            ("run-5", "acct-c", "not json".to_owned()),
        ] {
            c.execute(
                "INSERT INTO runs (run_id, fingerprint, billing_account_id, session_key, spec, status, created_at) VALUES (?, ?, ?, 's', ?, 'queued', 1)",
                rusqlite::params![id, format!("fp-{id}"), account, text],
            )
            .expect("insert");
        }
    }
    let s = SqliteStore::open(&path).await.expect("migrates");
    let claim = |key: &'static str, account: &'static str| {
        let s = &s;
        async move { s.claim_branch(key, account, 2, &format!("{key}-{account}")).await.expect("claim") }
    };
    assert_eq!(claim("shared", "acct-c").await, BranchClaim { owner: "acct-a".into(), claimed_now: false });
    assert_eq!(claim("b-own", "acct-a").await, BranchClaim { owner: "acct-b".into(), claimed_now: false });
    assert_eq!(claim("new", "acct-c").await, BranchClaim { owner: "acct-c".into(), claimed_now: true });
}

/// Replicas sharing a PostgreSQL store: of two delivery loops taking one due webhook at once,
/// exactly one gets it; it is not due again while taken, comes back when a taker died (its claim
/// ended), and is never taken again once delivered.
#[tokio::test]
async fn pg_replicas_take_a_due_webhook_once() {
    use crate::store::tenants::{DeliveryOutcome, TenantStore};
    let Some(url) = pg_url("pg_replicas_take_a_due_webhook_once").await else { return };
    let (a, b) = (Arc::new(open_pg(&url).await), Arc::new(open_pg(&url).await));
    insert(&*a, row("run-w", "acct-a", 1)).await;
    let webhook = NewDelivery { url: "https://hooks.example.com/k".into(), key_id: None, body: "{}".into() };
    a.apply(&[Write::Append { run_id: "run-w".into(), event: Some(event(1, EventName::Final, "{}")), patch: finish(5), webhook: Some(webhook) }])
        .await
        .expect("end with a webhook");
    let now = super::now_ms() + 1_000;
    let due = b.due_deliveries(now, 10).await.expect("due");
    assert_eq!(due.len(), 1);
    let id = due[0].id;
    let (x, y) = tokio::join!(a.claim_delivery(id, now, now + 60_000), b.claim_delivery(id, now, now + 60_000));
    assert_eq!([x.expect("claim"), y.expect("claim")].iter().filter(|won| **won).count(), 1, "exactly one replica takes it");
    assert!(a.due_deliveries(now, 10).await.expect("due").is_empty(), "taken: not due for anyone");
    assert!(!b.claim_delivery(id, now, now + 60_000).await.expect("claim"));
    // Its taker died mid-attempt: due again once the claim ended.
    assert_eq!(b.due_deliveries(now + 60_001, 10).await.expect("due").len(), 1);
    assert!(b.claim_delivery(id, now + 60_001, now + 120_000).await.expect("claim"));
    b.record_delivery(id, &DeliveryOutcome::Delivered, now + 60_002).await.expect("delivered");
    assert!(!a.claim_delivery(id, now + 200_000, now + 300_000).await.expect("claim"), "a delivered webhook is never taken again");
}

/// One process on SQLite: a run whose row cannot be read is ended `internal` when a start takes
/// the unfinished runs up (it stayed unfinished for good before), and the others are taken up.
#[tokio::test]
async fn sqlite_an_unreadable_run_is_ended_when_a_start_takes_the_runs_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("runs.db");
    let s = SqliteStore::open(&path).await.expect("sqlite opens");
    insert(&s, row("bad", "a", 1)).await;
    insert(&s, row("good", "a", 2)).await;
    let c = rusqlite::Connection::open(&path).expect("open");
    c.execute("UPDATE runs SET spec = '{not json' WHERE run_id = 'bad'", []).expect("damage");
    let lease = super::Lease { replica: "one".into(), ms: 60_000 };
    // Ending it can fail too (a trigger refuses it here): the readable runs are taken up all the
    // same (the start continued none before), and the next start ends it.
    c.execute_batch("CREATE TRIGGER refuse_end BEFORE UPDATE OF status ON runs BEGIN SELECT RAISE(ABORT, 'refused'); END;").expect("trigger");
    let claimed: Vec<String> = s.claim(&lease, true, &[]).await.expect("the claim stands").into_iter().map(|r| r.run_id).collect();
    assert_eq!(claimed, ["good"]);
    let finished: Option<i64> = c.query_row("SELECT finished_at FROM runs WHERE run_id = 'bad'", [], |r| r.get(0)).expect("read");
    assert_eq!(finished, None);
    c.execute_batch("DROP TRIGGER refuse_end;").expect("drop");
    let claimed: Vec<String> = s.claim(&lease, true, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(claimed, ["good"]);
    let (status, code, finished): (String, Option<String>, Option<i64>) =
        c.query_row("SELECT status, error_code, finished_at FROM runs WHERE run_id = 'bad'", [], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).expect("read");
    assert_eq!((status.as_str(), code.as_deref(), finished.is_some()), ("error", Some("internal"), true));
    let claimed: Vec<String> = s.claim(&lease, true, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(claimed, ["good"], "taken up again at the next start, the ended one not");
}
