//! What the LLM proxy of any replica needs from a shared store (`pg_…`, see backend_tests): the
//! live run a call names, trace ids unique among live runs, usage shares summed, the calls every
//! replica recorded, the notifications of ends and shares.

use super::backend_tests::{pg_url, row, trace_of};
use super::pg_shares::{ShareNote, ENDED, USAGE};
use super::postgres::PgStore;
use super::{Applied, CallKey, Lease, RunPatch, RunRow, Store, Write};
use crate::attribution::Usage;
use std::time::Duration;

async fn open(url: &str, replica: &str) -> (PgStore, Lease) {
    let display = super::StoreUrl::parse(url).expect("url").display();
    let s = PgStore::open(url, &display).await.expect("postgres opens");
    let lease = Lease { replica: replica.to_owned(), ms: 60_000 };
    s.set_lease(&lease);
    (s, lease)
}

fn with_token(mut r: RunRow, token: &str) -> RunRow {
    r.spec.attribution_token = Some(token.to_owned());
    r.spec.graph_id = "sandbox:openclaw".into();
    r
}

fn usage(input_tokens: u64, output_tokens: u64, llm_calls: u64) -> Usage {
    Usage { input_tokens, output_tokens, llm_calls }
}

fn share(run_id: &str, u: Usage) -> Write {
    Write::Usage { run_id: run_id.to_owned(), usage: u }
}

fn finish(run_id: &str) -> Write {
    let patch = RunPatch { status: Some("ok".into()), finished_at_ms: Some(super::now_ms()), ..RunPatch::default() };
    Write::Append { run_id: run_id.to_owned(), event: None, patch, webhook: None }
}

async fn insert(s: &PgStore, r: RunRow) -> Applied {
    s.apply(&[Write::Insert(Box::new(r))]).await.expect("insert").pop().expect("one result")
}

#[tokio::test]
async fn pg_a_call_finds_the_unfinished_run_of_its_trace_id_or_token_with_this_replica_share() {
    let Some(url) = pg_url("pg_a_call_finds_the_unfinished_run").await else { return };
    let (a, _) = open(&url, "a").await;
    let (b, _) = open(&url, "b").await;
    assert!(matches!(insert(&a, with_token(row("r1", "acct-1", 1), "cmx-tok-1")).await, Applied::Inserted { .. }));
    let by_trace = b.live_run(&CallKey::Trace(trace_of("r1"))).await.expect("lookup").expect("found by trace id");
    assert_eq!(
        (by_trace.run_id.as_str(), by_trace.billing_account_id.as_str(), by_trace.graph_id.as_str(), by_trace.token.as_deref()),
        ("r1", "acct-1", "sandbox:openclaw", Some("cmx-tok-1"))
    );
    assert_eq!((by_trace.session_key, by_trace.trace_id, by_trace.share), ("agent:main:clawmux:acct-1.r.r1".to_owned(), trace_of("r1"), Usage::default()));
    assert_eq!(b.live_run(&CallKey::Token("cmx-tok-1".into())).await.expect("lookup").map(|r| r.run_id), Some("r1".into()));
    assert_eq!(b.live_run(&CallKey::Trace(trace_of("nobody"))).await.expect("lookup"), None);
    assert_eq!(b.live_run(&CallKey::Token("cmx-nobody".into())).await.expect("lookup"), None);
    // b forwarded calls of r1: its share is where its counters continue from.
    b.apply(&[share("r1", usage(7, 3, 2))]).await.expect("share");
    assert_eq!(b.live_run(&CallKey::Trace(trace_of("r1"))).await.expect("lookup").map(|r| r.share), Some(usage(7, 3, 2)));
    assert_eq!(a.live_run(&CallKey::Trace(trace_of("r1"))).await.expect("lookup").map(|r| r.share), Some(Usage::default()));
    // Finished: no longer anyone's call (fail-closed).
    a.apply(&[finish("r1")]).await.expect("finish");
    assert_eq!(b.live_run(&CallKey::Trace(trace_of("r1"))).await.expect("lookup"), None);
    assert_eq!(b.live_run(&CallKey::Token("cmx-tok-1".into())).await.expect("lookup"), None);
    assert_eq!(b.ended(&["r1".into(), "gone".into()]).await.expect("ended"), ["r1", "gone"]);
}

#[tokio::test]
async fn pg_two_live_runs_may_not_share_a_trace_id_or_token_across_replicas() {
    let Some(url) = pg_url("pg_two_live_runs_may_not_share_a_trace_id").await else { return };
    let (a, _) = open(&url, "a").await;
    let (b, _) = open(&url, "b").await;
    assert!(matches!(insert(&a, with_token(row("r1", "acct", 1), "cmx-t1")).await, Applied::Inserted { .. }));
    // Another run id, the same trace id, admitted by another replica: refused, naming the holder.
    let mut same_trace = row("r2", "acct", 2);
    same_trace.spec.traceparent = row("r1", "acct", 1).spec.traceparent;
    assert_eq!(insert(&b, same_trace.clone()).await, Applied::TraceInUse { run_id: "r1".into() });
    assert_eq!(insert(&b, with_token(row("r3", "acct", 3), "cmx-t1")).await, Applied::TraceInUse { run_id: "r1".into() });
    assert!(b.run("r2").await.expect("read").is_none(), "nothing stored");
    // The same request again is still the same run (not a conflict of trace ids).
    assert!(matches!(insert(&b, with_token(row("r1", "acct", 1), "cmx-t1")).await, Applied::Existing { .. }));
    // Once r1 ended, its trace id is free.
    a.apply(&[finish("r1")]).await.expect("finish");
    assert!(matches!(insert(&b, same_trace).await, Applied::Inserted { .. }));
}

#[tokio::test]
async fn pg_a_run_usage_is_the_sum_of_every_replica_share_each_written_idempotently() {
    let Some(url) = pg_url("pg_a_run_usage_is_the_sum_of_every_replica_share").await else { return };
    let (a, la) = open(&url, "a").await;
    let (b, lb) = open(&url, "b").await;
    let mut r = row("r1", "acct", 1);
    r.usage = Some(Usage::default());
    assert!(matches!(insert(&a, r).await, Applied::Inserted { .. }));
    assert_eq!(a.apply(&[share("r1", usage(10, 1, 1))]).await.expect("a's share"), [Applied::Done]);
    // b does not own r1: its share is stored all the same (its proxy forwarded those calls).
    assert_eq!(b.apply(&[share("r1", usage(5, 2, 2))]).await.expect("b's share"), [Applied::Done]);
    // Again, and older totals arriving late: nothing changes (absolute, and counters only grow).
    b.apply(&[share("r1", usage(5, 2, 2)), share("r1", usage(4, 2, 1))]).await.expect("again");
    let sum = usage(15, 3, 3);
    assert_eq!(b.run("r1").await.expect("read").and_then(|r| r.usage), Some(sum));
    let listed = a.list(&super::ListQuery { limit: 10, ..super::ListQuery::default() }).await.expect("list");
    assert_eq!(listed.iter().map(|r| r.usage).collect::<Vec<_>>(), [Some(sum)]);
    assert_eq!(a.unfinished().await.expect("unfinished")[0].usage, Some(sum));
    let shares = a.usage_shares("r1", None).await.expect("shares");
    assert_eq!((shares.mine, shares.others.get("b").copied()), (usage(10, 1, 1), Some(usage(5, 2, 2))));
    // b takes r1 over (a died): its share goes on from where it was, a's stays; the sum is unchanged.
    sqlx::query("UPDATE runs SET lease_until = 0").execute(&sqlx::PgPool::connect(&url).await.expect("connect")).await.expect("expire");
    let claimed = b.claim(&lb, false, &[]).await.expect("claim");
    assert_eq!(claimed.iter().map(|r| (r.run_id.as_str(), r.usage)).collect::<Vec<_>>(), [("r1", Some(sum))]);
    let shares = b.usage_shares("r1", claimed[0].usage).await.expect("shares");
    assert_eq!((shares.mine, shares.others.get("a").copied()), (usage(5, 2, 2), Some(usage(10, 1, 1))));
    b.apply(&[share("r1", usage(6, 3, 3)), finish("r1")]).await.expect("b goes on");
    // a (fenced: it lost the run) still stores its share of a call it had forwarded.
    assert_eq!(a.apply(&[share("r1", usage(11, 1, 1))]).await.expect("late share"), [Applied::Done]);
    assert_eq!(b.run("r1").await.expect("read").and_then(|r| r.usage), Some(usage(17, 4, 4)));
    let _ = la;
    // A run no proxy forwarded calls for keeps the usage its row has.
    let mut quiet = row("r2", "acct", 2);
    quiet.usage = Some(usage(1, 1, 1));
    insert(&a, quiet).await;
    assert_eq!(a.run("r2").await.expect("read").and_then(|r| r.usage), Some(usage(1, 1, 1)));
    assert_eq!(a.usage_shares("r2", Some(usage(1, 1, 1))).await.expect("shares").mine, usage(1, 1, 1), "a row without shares is all its own");
}

/// A claimed row's usage is the sum of every share, and the takeover hands that sum to
/// `usage_shares` as the row's stored usage: a claimer that forwarded no call of the run must get
/// an empty share of its own (the sum stands only for a run with no shares at all), else its
/// counters would start at the sum and every other share be counted twice in the run's usage.
#[tokio::test]
async fn pg_a_claimer_without_a_share_continues_from_nothing_not_from_the_claimed_sum() {
    let Some(url) = pg_url("pg_a_claimer_without_a_share_continues_from_nothing").await else { return };
    let (a, _) = open(&url, "a").await;
    let (b, _) = open(&url, "b").await;
    let (c, lc) = open(&url, "c").await;
    let mut r = row("r1", "acct", 1);
    r.usage = Some(Usage::default());
    insert(&a, r).await;
    a.apply(&[share("r1", usage(10, 1, 1))]).await.expect("a's share");
    b.apply(&[share("r1", usage(5, 2, 2))]).await.expect("b's share");
    sqlx::query("UPDATE runs SET lease_until = 0").execute(&sqlx::PgPool::connect(&url).await.expect("connect")).await.expect("expire");
    let claimed = c.claim(&lc, false, &[]).await.expect("claim");
    assert_eq!(claimed.iter().map(|r| (r.run_id.as_str(), r.usage)).collect::<Vec<_>>(), [("r1", Some(usage(15, 3, 3)))]);
    let shares = c.usage_shares("r1", claimed[0].usage).await.expect("shares");
    assert_eq!(shares.mine, Usage::default(), "the claimed sum taken as the claimer's own share");
    let mut others: Vec<(String, Usage)> = shares.others.into_iter().collect();
    others.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(others, [("a".to_owned(), usage(10, 1, 1)), ("b".to_owned(), usage(5, 2, 2))]);
    // c's own calls from there: the run's usage is every call once.
    c.apply(&[share("r1", usage(1, 1, 1)), finish("r1")]).await.expect("c goes on");
    assert_eq!(a.run("r1").await.expect("read").and_then(|r| r.usage), Some(usage(16, 4, 4)));
}

#[tokio::test]
async fn pg_shares_at_the_top_sum_to_the_largest_int8_instead_of_failing_the_reads() {
    let Some(url) = pg_url("pg_shares_at_the_top_sum_to_the_largest_int8").await else { return };
    let (a, _) = open(&url, "a").await;
    let (b, _) = open(&url, "b").await;
    insert(&a, row("r1", "acct", 1)).await;
    insert(&a, row("r2", "acct", 2)).await;
    // Counts from upstream answers (untrusted): each share saturates at the largest int8 when
    // stored, and two of them must not make their sum overflow.
    let top = usage(u64::MAX, u64::MAX, u64::MAX);
    a.apply(&[share("r1", top)]).await.expect("a's share");
    b.apply(&[share("r1", top), share("r2", usage(1, 2, 3))]).await.expect("b's shares");
    let max = i64::MAX as u64;
    assert_eq!(a.run("r1").await.expect("the run is read").and_then(|r| r.usage), Some(usage(max, max, max)));
    let listed = b.list(&super::ListQuery { limit: 10, ..super::ListQuery::default() }).await.expect("the page is read");
    assert_eq!(listed.iter().map(|r| (r.run_id.as_str(), r.usage)).collect::<Vec<_>>(), [("r2", Some(usage(1, 2, 3))), ("r1", Some(usage(max, max, max)))]);
}

#[tokio::test]
async fn pg_every_replica_lists_the_calls_any_replica_recorded_and_they_go_with_the_run() {
    let Some(url) = pg_url("pg_every_replica_lists_the_calls").await else { return };
    let (a, _) = open(&url, "a").await;
    let (b, _) = open(&url, "b").await;
    insert(&a, row("r1", "acct", 1)).await;
    let call = |n: u64| {
        Write::LlmCall { id: super::BillingId::new(), record: Box::new(crate::audit::AuditRecord {
            time: "2026-11-21T00:00:00Z".into(),
            run_id: "r1".into(),
            billing_account_id: "acct".into(),
            model: Some("m".into()),
            path: "/v1/chat/completions".into(),
            status: 200,
            outcome: "ok".into(),
            latency_ms: n,
            streamed: true,
            input_tokens: Some(n),
            output_tokens: Some(1),
            upstream_call_id: Some(format!("c{n}")),
        }) }
    };
    a.apply(&[call(1)]).await.expect("a's call");
    b.apply(&[call(2), call(3)]).await.expect("b's calls");
    let (calls, more) = a.llm_calls("r1", 10).await.expect("read").expect("kept");
    assert_eq!((calls.iter().map(|c| c.latency_ms).collect::<Vec<_>>(), more), (vec![1, 2, 3], false));
    let (calls, more) = b.llm_calls("r1", 2).await.expect("read").expect("kept");
    assert_eq!((calls.len(), more), (2, true));
    a.apply(&[finish("r1")]).await.expect("finish");
    let gone = a.sweep(super::Retention { max_age_ms: 0, max_count: 0 }, super::now_ms() + 1).await.expect("sweep");
    assert_eq!(gone, ["r1"]);
    assert_eq!(a.llm_calls("r1", 10).await.expect("read"), Some((Vec::new(), false)));
}

#[tokio::test]
async fn pg_ends_and_shares_are_notified_at_commit() {
    let Some(url) = pg_url("pg_ends_and_shares_are_notified").await else { return };
    let (a, _) = open(&url, "a").await;
    let (b, _) = open(&url, "b").await;
    let mut listener = sqlx::postgres::PgListener::connect(&url).await.expect("listen");
    listener.listen_all([ENDED, USAGE]).await.expect("listen");
    insert(&a, row("r1", "acct", 1)).await;
    b.apply(&[share("r1", usage(4, 2, 1))]).await.expect("share");
    a.apply(&[finish("r1")]).await.expect("finish");
    let mut got = Vec::new();
    while got.len() < 2 {
        let n = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await.expect("notified").expect("notification");
        got.push((n.channel().to_owned(), n.payload().to_owned()));
    }
    assert_eq!(got[0].0, USAGE);
    let note: ShareNote = serde_json::from_str(&got[0].1).expect("a share note");
    assert_eq!(note, ShareNote { run_id: "r1".into(), replica: "b".into(), usage: usage(4, 2, 1) });
    assert_eq!(got[1], (ENDED.to_owned(), "r1".to_owned()));
}

/// A commit can fail without saying whether it happened; the writer then writes the batch's
/// billing records again. Written again under their ids, they are counted once: the spend is not
/// added twice and the call is listed once (both were before). Ids are forgotten after a day.
#[tokio::test]
async fn pg_billing_records_written_again_after_an_ambiguous_commit_count_once() {
    use crate::store::tenants::TenantStore;
    let Some(url) = pg_url("pg_billing_records_written_again").await else { return };
    let (a, _) = open(&url, "a").await;
    insert(&a, row("r1", "acct", 1)).await;
    let record = crate::audit::AuditRecord {
        time: "2026-11-27T00:00:00Z".into(),
        run_id: "r1".into(),
        billing_account_id: "acct".into(),
        model: None,
        path: "/v1/chat/completions".into(),
        status: 200,
        outcome: "ok".into(),
        latency_ms: 5,
        streamed: false,
        input_tokens: Some(40),
        output_tokens: Some(2),
        upstream_call_id: None,
    };
    let (spend_id, call_id) = (super::BillingId::new(), super::BillingId::new());
    let batch = [
        Write::Spend { account: "acct".into(), window_start_ms: 0, tokens: 42, id: spend_id.clone() },
        Write::LlmCall { id: call_id.clone(), record: Box::new(record.clone()) },
    ];
    a.apply(&batch).await.expect("the first commit");
    a.apply(&batch).await.expect("the same records again");
    // And once more with a new spend beside them: only the new one is added.
    let more = Write::Spend { account: "acct".into(), window_start_ms: 0, tokens: 8, id: super::BillingId::new() };
    a.apply(&[batch[0].clone(), more]).await.expect("again, with a new one");
    assert_eq!(a.spend("acct", 0).await.expect("spend"), 50);
    let (calls, _) = a.llm_calls("r1", 10).await.expect("read").expect("kept");
    assert_eq!(calls.len(), 1, "{calls:?}");
    // The sweep forgets ids older than a day, not newer ones.
    let now = super::now_ms();
    a.sweep(super::Retention { max_age_ms: i64::MAX, max_count: usize::MAX }, now).await.expect("sweep");
    a.apply(&batch[..1]).await.expect("within a day");
    assert_eq!(a.spend("acct", 0).await.expect("spend"), 50);
    a.sweep(super::Retention { max_age_ms: i64::MAX, max_count: usize::MAX }, now + super::pg_shares::BILLING_IDS_KEPT_MS + 1_000).await.expect("sweep");
    a.apply(&batch[..1]).await.expect("a day later");
    assert_eq!(a.spend("acct", 0).await.expect("spend"), 92, "the id was forgotten");
}

/// A wait for a run's end (a `?wait=true` POST served by a replica that does not own the run) is
/// woken by the end, not by each batch of the run's events (before, it read the run again at
/// every batch).
#[tokio::test]
async fn pg_a_wait_for_a_runs_end_is_woken_by_its_end_not_by_its_events() {
    let Some(url) = pg_url("pg_a_wait_for_a_runs_end").await else { return };
    let (a, _) = open(&url, "a").await;
    let follow = super::follow::Follow::new(a.pool().clone());
    let mut end = follow.subscribe_end("r1");
    let mut batches = follow.subscribe("r1");
    let mut other = follow.subscribe_end("r2");
    // The listener is up once a reconnect's wake-up (which wakes every follower) went by.
    tokio::time::timeout(Duration::from_secs(10), end.changed()).await.expect("listening").expect("open");
    end.borrow_and_update();
    batches.borrow_and_update();
    other.borrow_and_update();
    let notify = |channel: &'static str| {
        let pool = a.pool().clone();
        async move { sqlx::query("SELECT pg_notify($1, 'r1')").bind(channel).execute(&pool).await.expect("notify") }
    };
    notify(super::follow::CHANNEL).await;
    tokio::time::timeout(Duration::from_secs(10), batches.changed()).await.expect("the batch is heard").expect("open");
    assert!(!end.has_changed().expect("open"), "an event batch woke the wait for the end");
    notify(ENDED).await;
    tokio::time::timeout(Duration::from_secs(10), end.changed()).await.expect("the end is heard").expect("open");
    assert!(!other.has_changed().expect("open"), "another run's wait was woken");
}

/// A run this replica suspended through a store outage and takes back comes with its usage summed
/// from every share, as a claimed one does: its document shows that sum until its billing is
/// registered again, and its billing continues from it (before, the row's own column was used:
/// the usage at admission, 0).
#[tokio::test]
async fn pg_a_run_taken_back_after_an_outage_comes_with_every_share_summed() {
    let Some(url) = pg_url("pg_a_run_taken_back_comes_with_every_share").await else { return };
    let (a, la) = open(&url, "a").await;
    let (b, _) = open(&url, "b").await;
    let mut r = row("r1", "acct", 1);
    r.usage = Some(Usage::default());
    insert(&a, r).await;
    a.apply(&[share("r1", usage(10, 1, 1))]).await.expect("a's share");
    b.apply(&[share("r1", usage(5, 2, 2))]).await.expect("b's share");
    let back = a.readopt(&la, &["r1".to_owned()]).await.expect("readopt");
    assert_eq!(back.iter().map(|r| (r.run_id.as_str(), r.usage)).collect::<Vec<_>>(), [("r1", Some(usage(15, 3, 3)))]);
    let shares = a.usage_shares("r1", back[0].usage).await.expect("shares");
    assert_eq!((shares.mine, shares.others.get("b").copied()), (usage(10, 1, 1), Some(usage(5, 2, 2))));
}
