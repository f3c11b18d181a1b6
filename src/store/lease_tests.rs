//! Run leases on PostgreSQL (`pg_…`, see backend_tests): concurrent takeovers, fencing of a
//! replica that lost a run, renewal reports, claims at start.

use super::backend_tests::{pg_url, row};
use super::postgres::PgStore;
use super::{AbortReason, Applied, EventName, Lease, RunPatch, Store, StoredEvent, Write};
use std::collections::{HashMap, HashSet};

async fn open(url: &str, replica: &str, ms: i64) -> (PgStore, Lease) {
    let display = super::StoreUrl::parse(url).expect("url").display();
    let s = PgStore::open(url, &display).await.expect("postgres opens");
    let lease = Lease { replica: replica.to_owned(), ms };
    s.set_lease(&lease);
    (s, lease)
}

fn delta(run_id: &str, id: u64) -> Write {
    let event = StoredEvent { id, name: EventName::TextDelta, data: format!("{{\"text\":\"{run_id}-{id}\"}}") };
    Write::Append { run_id: run_id.to_owned(), event: Some(event), patch: RunPatch::default(), webhook: None }
}

/// The admission of run `id` of account "acct" on session `session`, on branch key `branch`.
fn keyed(id: &str, session: &str, branch: Option<&str>) -> Write {
    let mut r = row(id, "acct", 1);
    r.session_key = format!("agent:main:clawmux:acct.s.{session}");
    r.spec.branch = branch.map(|key| clawmux_actors::branch::BranchPlan { key: key.into(), base_ref: "main".into(), pr_title: None, pr_body: None });
    Write::Insert(Box::new(r))
}

async fn one(s: &PgStore, w: Write) -> Applied {
    s.apply(&[w]).await.expect("insert").pop().expect("one result")
}

async fn claims_of(url: &str) -> HashMap<String, (String, i64)> {
    let pool = sqlx::PgPool::connect(url).await.expect("connect");
    let rows: Vec<(String, Option<String>, i64)> = sqlx::query_as("SELECT run_id, owner, claims FROM runs").fetch_all(&pool).await.expect("read");
    pool.close().await;
    rows.into_iter().map(|(id, owner, claims)| (id, (owner.unwrap_or_default(), claims))).collect()
}

#[tokio::test]
async fn pg_concurrent_takeovers_give_each_expired_run_to_exactly_one_claimer_with_its_session_key() {
    let Some(url) = pg_url("pg_concurrent_takeovers").await else { return };
    // A replica whose leases are expired from the start (a negative lease): as if it died.
    let (dead, _) = open(&url, "dead", -1000).await;
    const N: usize = 300;
    let mut batch = Vec::new();
    for i in 0..N {
        let mut r = row(&format!("run-{i:03}"), "acct", 1000 + i as i64);
        // Six runs per session key: they must be continued by one replica, in admission order.
        r.session_key = format!("agent:main:clawmux:acct.s.{}", i % 50);
        batch.push(Write::Insert(Box::new(r)));
    }
    assert!(dead.apply(&batch).await.expect("insert").iter().all(|a| matches!(a, Applied::Inserted { .. })));
    let mut claimers = Vec::new();
    for i in 0..4 {
        claimers.push(open(&url, &format!("claimer-{i}"), 60_000).await);
    }
    let mut won: HashMap<String, Vec<super::RunRow>> = HashMap::new();
    for _round in 0..20 {
        let all = futures_util::future::join_all(claimers.iter().map(|(s, l)| s.claim(l, false, &[]))).await;
        for ((_, l), got) in claimers.iter().zip(all) {
            let got = got.expect("claim");
            assert!(got.windows(2).all(|w| w[0].seq < w[1].seq), "not in admission order");
            won.entry(l.replica.clone()).or_default().extend(got);
        }
        if won.values().map(Vec::len).sum::<usize>() >= N {
            break;
        }
    }
    let total: usize = won.values().map(Vec::len).sum();
    let distinct: HashSet<&str> = won.values().flatten().map(|r| r.run_id.as_str()).collect();
    assert_eq!((total, distinct.len()), (N, N), "a run was won twice, or not at all: {:?}", won.iter().map(|(k, v)| (k, v.len())).collect::<Vec<_>>());
    let stored = claims_of(&url).await;
    for (replica, rows) in &won {
        for r in rows {
            assert_eq!(stored[&r.run_id], (replica.clone(), 1), "{}", r.run_id);
        }
    }
    let mut holder: HashMap<&str, &str> = HashMap::new();
    for (replica, rows) in &won {
        for r in rows {
            let h = holder.entry(r.session_key.as_str()).or_insert(replica.as_str());
            assert_eq!(*h, replica.as_str(), "the runs of {} were split between claimers", r.session_key);
        }
    }
    // Claimed runs hold a fresh lease: nothing is left to take.
    for (s, l) in &claimers {
        assert!(s.claim(l, false, &[]).await.expect("claim").is_empty());
    }
}

#[tokio::test]
async fn pg_a_replica_that_lost_a_run_is_fenced_told_by_its_renewal_and_aborts_reach_the_owner() {
    let Some(url) = pg_url("pg_lost_run_fenced").await else { return };
    let (a, la) = open(&url, "a", -1000).await;
    let (b, lb) = open(&url, "b", 60_000).await;
    assert!(matches!(a.apply(&[Write::Insert(Box::new(row("r1", "acct", 1)))]).await.expect("insert")[..], [Applied::Inserted { .. }]));
    assert_eq!(a.apply(&[delta("r1", 1)]).await.expect("a writes its run"), [Applied::Done]);
    // A's lease expired (it renews with a negative lease: as if too slow); b takes the run over.
    assert!(a.renew(&la, &["r1".to_owned()]).await.expect("renew").lost.is_empty(), "still a's until someone claims it");
    let got = b.claim(&lb, false, &[]).await.expect("claim");
    assert_eq!(got.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(), ["r1"]);
    // A's next writes are dropped (fenced), b's are stored; a's renewal reports the loss.
    assert_eq!(a.apply(&[delta("r1", 2), Write::Spend { account: "acct".into(), window_start_ms: 0, tokens: 1, id: super::BillingId::new() }]).await.expect("batch"), [Applied::Fenced, Applied::Done]);
    assert_eq!(b.apply(&[delta("r1", 2)]).await.expect("b writes"), [Applied::Done]);
    let texts: Vec<String> = b.events("r1", 0).await.expect("events").into_iter().map(|e| e.data).collect();
    assert_eq!(texts, ["{\"text\":\"r1-1\"}", "{\"text\":\"r1-2\"}"]);
    assert_eq!(a.renew(&la, &["r1".to_owned()]).await.expect("renew").lost, ["r1"]);
    let rb = b.renew(&lb, &["r1".to_owned()]).await.expect("renew");
    assert!(rb.lost.is_empty() && rb.aborts.is_empty(), "{rb:?}");
    // An abort posted to a (not the owner) reaches b's next renewal.
    assert!(a.request_abort("r1", AbortReason::Api).await.expect("abort"));
    assert_eq!(b.renew(&lb, &["r1".to_owned()]).await.expect("renew").aborts, [("r1".to_owned(), AbortReason::Api)]);
    // A budget stop posted elsewhere says why: the owner ends the run `budget_exceeded`.
    assert!(matches!(a.apply(&[Write::Insert(Box::new(row("r3", "acct", 3)))]).await.expect("insert")[..], [Applied::Inserted { .. }]));
    assert!(b.request_abort("r3", AbortReason::BudgetExceeded).await.expect("abort"));
    assert_eq!(a.renew(&la, &["r3".to_owned()]).await.expect("renew").aborts, [("r3".to_owned(), AbortReason::BudgetExceeded)]);
    sqlx::query("UPDATE runs SET finished_at = 1 WHERE run_id = 'r3'").execute(&sqlx::PgPool::connect(&url).await.expect("connect")).await.expect("end r3");
    // At start, a replica continues its own runs (a restart under its id) even with a lease that
    // holds; another replica does not take them.
    assert!(a.claim(&la, true, &[]).await.expect("claim").is_empty());
    // A run whose (old) owner's batch is being committed is passed by until that commits: a
    // takeover never reads its events while they grow.
    assert!(matches!(a.apply(&[Write::Insert(Box::new(row("r2", "acct", 2)))]).await.expect("insert")[..], [Applied::Inserted { .. }]));
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    let mut batch = pool.begin().await.expect("begin");
    sqlx::query("SELECT run_id FROM runs WHERE run_id = 'r2' FOR KEY SHARE").execute(&mut *batch).await.expect("lock");
    assert!(b.claim(&lb, false, &[]).await.expect("claim").is_empty(), "claimed a run while its owner's batch was being committed");
    batch.commit().await.expect("commit");
    assert_eq!(b.claim(&lb, false, &[]).await.expect("claim").len(), 1);
    pool.close().await;
    let (b2, lb2) = open(&url, "b", 60_000).await;
    assert_eq!(b2.claim(&lb2, true, &[]).await.expect("claim").len(), 2);
    assert_eq!(claims_of(&url).await["r1"], ("b".to_owned(), 1), "a restart under the same id is no change of hands");
}

#[tokio::test]
async fn pg_a_run_whose_session_key_another_replica_runs_is_assigned_to_that_replica_in_admission_order() {
    let Some(url) = pg_url("pg_session_key_assignment").await else { return };
    let (a, la) = open(&url, "a", 60_000).await;
    let (b, _) = open(&url, "b", 60_000).await;
    let (dead, _) = open(&url, "dead", -1000).await;
    assert!(matches!(one(&a, keyed("k1", "x", None)).await, Applied::Inserted { .. }));
    // b admits a run of a's key: it is a's, to start after k1; b's other runs stay b's.
    assert!(matches!(one(&b, keyed("k2", "x", None)).await, Applied::Assigned { .. }));
    assert!(matches!(one(&b, keyed("other", "y", None)).await, Applied::Inserted { .. }));
    // a admits one more of the key while k2 waits to be taken up: it queues behind k2.
    assert!(matches!(one(&a, keyed("k3", "x", None)).await, Applied::Assigned { .. }));
    let owners = claims_of(&url).await;
    assert_eq!((owners["k2"].0.as_str(), owners["k3"].0.as_str(), owners["other"].0.as_str()), ("a", "a", "b"));
    let took: Vec<String> = a.claim(&la, false, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(took, ["k2", "k3"], "taken up in admission order");
    assert_eq!(claims_of(&url).await["k2"].1, 0, "assigned to a from the start: no change of hands");
    assert!(matches!(one(&a, keyed("k4", "x", None)).await, Applied::Inserted { .. }), "nothing waits any more: a's own");
    // A key whose runs belong to a dead replica: a new run of it expires with them, and one
    // claimer takes them all.
    assert!(matches!(one(&dead, keyed("d1", "z", None)).await, Applied::Inserted { .. }));
    assert!(matches!(one(&b, keyed("d2", "z", None)).await, Applied::Assigned { .. }));
    let took: Vec<String> = a.claim(&la, false, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(took, ["d1", "d2"]);
}

/// A renewal holds only the runs the replica says it holds (and the runs assigned to it that it
/// has not taken up): a run it owns in the store but holds nowhere (its continuation failed
/// halfway) expires, and another replica claims it, instead of being renewed forever.
#[tokio::test]
async fn pg_a_renewal_renews_only_the_runs_held_and_those_assigned_not_taken_up() {
    let Some(url) = pg_url("pg_renew_only_held").await else { return };
    // Leases of 2 s: "held" is renewed right before the claim, so only a stall of 2 s could let it
    // expire (at 300 ms, 150 ms of a busy machine between the last renewal and the claim did).
    let (a, la) = open(&url, "a", 2000).await;
    let inserted = std::time::Instant::now();
    for id in ["held", "orphan"] {
        assert!(matches!(one(&a, Write::Insert(Box::new(row(id, "acct", 1000)))).await, Applied::Inserted { .. }));
    }
    // A run of another key that `b` admits while `a` runs that key: assigned to `a`.
    let (b, lb) = open(&url, "b", 60_000).await;
    let mut assigned = row("assigned", "acct", 1001);
    assigned.session_key = row("held", "acct", 0).session_key;
    assert!(matches!(one(&b, Write::Insert(Box::new(assigned))).await, Applied::Assigned { .. }));
    // `a` renews, holding only "held", until the orphan's lease has run out, and once more.
    while inserted.elapsed() < std::time::Duration::from_millis(2300) {
        a.renew(&la, &["held".to_owned()]).await.expect("renew");
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    a.renew(&la, &["held".to_owned()]).await.expect("renew");
    let claimed: Vec<String> = b.claim(&lb, false, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(claimed, ["orphan"], "only the run `a` holds nowhere expired");
    let owners = claims_of(&url).await;
    assert_eq!((owners["held"].0.as_str(), owners["assigned"].0.as_str(), owners["orphan"].0.as_str()), ("a", "a", "b"));
}

/// `ifBusy: interrupt` is done once: a run taken up by the replica its session key runs on (it was
/// assigned there) keeps it; a run claimed again (a restart under the same id, a takeover) comes
/// back without it, so it cannot end a run it did not interrupt at its admission.
#[tokio::test]
async fn pg_an_interrupt_is_kept_only_for_the_first_take_up_of_an_assigned_run() {
    let Some(url) = pg_url("pg_interrupt_once").await else { return };
    let (a, la) = open(&url, "a", 60_000).await;
    let (b, _) = open(&url, "b", 60_000).await;
    let mut own = row("own", "acct", 1000);
    own.spec.if_busy = super::BusyPolicy::Interrupt;
    assert!(matches!(one(&a, Write::Insert(Box::new(own))).await, Applied::Inserted { .. }));
    let mut given = row("given", "acct", 1001);
    given.session_key = row("own", "acct", 0).session_key;
    given.spec.if_busy = super::BusyPolicy::Interrupt;
    assert!(matches!(one(&b, Write::Insert(Box::new(given))).await, Applied::Assigned { .. }));
    // `a` starts again under its id: it claims its own run and the one `b` gave it.
    let claimed = a.claim(&la, true, &[]).await.expect("claim");
    let policy: HashMap<String, super::BusyPolicy> = claimed.into_iter().map(|r| (r.run_id, r.spec.if_busy)).collect();
    assert_eq!(policy["own"], super::BusyPolicy::Enqueue, "taken up before: no second interrupt");
    assert_eq!(policy["given"], super::BusyPolicy::Interrupt, "first take-up of an assigned run");
}

/// The per-minute limit counts every replica's admissions by the database's clock: runs that a
/// replica whose clock is five minutes behind admitted (their `createdAt` five minutes ago) still
/// count for a replica with the right time. Before, each admission compared the others' `createdAt`
/// with its own clock, and the fast replica admitted past the limit.
#[tokio::test]
async fn pg_the_per_minute_limit_counts_admissions_by_the_databases_clock_not_the_replicas() {
    use super::tenants::{Limits, TenantStore};
    let Some(url) = pg_url("pg_minute_one_clock").await else { return };
    let (slow, _) = open(&url, "slow", 60_000).await;
    let (right, _) = open(&url, "right", 60_000).await;
    let limits = Limits { max_runs_per_minute: Some(3), ..Limits::default() };
    right.set_limits("acct-rate", &limits, 1).await.expect("limits");
    let now = super::now_ms();
    let behind = now - 5 * 60_000;
    for i in 0..3 {
        let r = row(&format!("slow-{i}"), "acct-rate", behind + i);
        assert!(matches!(one(&slow, Write::Insert(Box::new(r))).await, Applied::Inserted { .. }), "within the limit");
    }
    let next = one(&right, Write::Insert(Box::new(row("right-0", "acct-rate", now)))).await;
    let Applied::Limited { budget: false, retry_after_sec, message } = next else { panic!("the fourth run in the minute was admitted: {next:?}") };
    assert!((55..=60).contains(&retry_after_sec), "retry when the oldest of the minute leaves it: {retry_after_sec} s ({message})");
    // Also the other way round: the slow replica does not admit a fourth either.
    let again = one(&slow, Write::Insert(Box::new(row("slow-3", "acct-rate", behind + 10)))).await;
    assert!(matches!(again, Applied::Limited { budget: false, .. }), "{again:?}");
    // Another account is not limited by this one's admissions.
    assert!(matches!(one(&right, Write::Insert(Box::new(row("other-0", "acct-other", now)))).await, Applied::Inserted { .. }));
}

/// The spend a batch stores counts for an admission in the same batch (under group commit the
/// call that spends an account's budget often shares a batch with its next admission): before,
/// the check read only the spend already stored, and admitted the run. A spend record a committed
/// batch already stored (written again after a lost answer) is not counted twice.
#[tokio::test]
async fn pg_a_spend_in_the_same_batch_counts_for_the_token_budget_of_an_admission() {
    use super::tenants::{Limits, TenantStore};
    let Some(url) = pg_url("pg_batch_spend_counts").await else { return };
    let (s, _) = open(&url, "a", 60_000).await;
    let limits = Limits { max_tokens: Some(100), period_sec: Some(86_400), ..Limits::default() };
    s.set_limits("acct-b", &limits, 1).await.expect("limits");
    let now = super::now_ms();
    let (window, _) = super::tenants::window(86_400, now);
    let spend = |tokens: u64, id: &super::BillingId| Write::Spend { account: "acct-b".into(), window_start_ms: window, tokens, id: id.clone() };
    // 60 tokens stored; a batch with 50 more and an insert: 110 of 100, refused.
    let first = super::BillingId::new();
    assert_eq!(one(&s, spend(60, &first)).await, Applied::Done);
    let out = s.apply(&[spend(50, &super::BillingId::new()), Write::Insert(Box::new(row("b-1", "acct-b", now)))]).await.expect("batch");
    assert!(matches!(out[1], Applied::Limited { budget: true, .. }), "the batch's own spend was not counted: {out:?}");
    // Another account: a record of 60 stored, then written again beside an insert (its id is
    // stored): 60 of 100, admitted.
    let limits = Limits { max_tokens: Some(100), period_sec: Some(86_400), ..Limits::default() };
    s.set_limits("acct-c", &limits, 1).await.expect("limits");
    let again = super::BillingId::new();
    let spend_c = |tokens: u64, id: &super::BillingId| Write::Spend { account: "acct-c".into(), window_start_ms: window, tokens, id: id.clone() };
    assert_eq!(one(&s, spend_c(60, &again)).await, Applied::Done);
    let out = s.apply(&[spend_c(60, &again), Write::Insert(Box::new(row("c-1", "acct-c", now)))]).await.expect("batch");
    assert!(matches!(out[1], Applied::Inserted { .. }), "a spend already stored was counted again: {out:?}");
}

/// A run whose row cannot be read (damaged contents), taken over after its owner died: it can
/// be neither continued nor shown, so the claimer ends it `internal` (and tells the others), and
/// it no longer holds its session key: a later run of the key starts where it is admitted instead
/// of being assigned, for good, to the claimer of a run that never ends.
#[tokio::test]
async fn pg_an_unreadable_run_taken_over_is_ended_and_frees_its_session_key() {
    let Some(url) = pg_url("pg_an_unreadable_run_taken_over").await else { return };
    let (dead, _) = open(&url, "dead", -1000).await;
    let keyed = |id: &str, key: &str, at: i64| {
        let mut r = row(id, "acct", at);
        r.session_key = format!("agent:main:clawmux:acct.s.{key}");
        Write::Insert(Box::new(r))
    };
    assert!(dead.apply(&[keyed("bad", "k1", 1), keyed("good", "k2", 2)]).await.expect("insert").iter().all(|a| matches!(a, Applied::Inserted { .. })));
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    sqlx::query("UPDATE runs SET spec = '{not json' WHERE run_id = 'bad'").execute(&pool).await.expect("damage");
    let mut listener = sqlx::postgres::PgListener::connect(&url).await.expect("listen");
    listener.listen(super::pg_shares::ENDED).await.expect("listen");

    let (b, lb) = open(&url, "b", 60_000).await;
    let claimed: Vec<String> = b.claim(&lb, false, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(claimed, ["good"]);
    let (status, code, message, finished): (String, Option<String>, Option<String>, Option<i64>) =
        sqlx::query_as("SELECT status, error_code, error_message, finished_at FROM runs WHERE run_id = 'bad'").fetch_one(&pool).await.expect("read");
    assert_eq!((status.as_str(), code.as_deref(), message.as_deref(), finished.is_some()), ("error", Some("internal"), Some(super::UNREADABLE_RUN), true));
    let note = tokio::time::timeout(std::time::Duration::from_secs(10), listener.recv()).await.expect("notified").expect("note");
    assert_eq!(note.payload(), "bad");
    // Nothing left to claim, and the key is free: another replica's run of it is its own.
    assert!(b.claim(&lb, false, &[]).await.expect("claim").is_empty());
    let (c, _) = open(&url, "c", 60_000).await;
    assert!(matches!(one(&c, keyed("next", "k1", 3)).await, Applied::Inserted { .. }));
}

/// Ending an unreadable run can fail too (here a trigger refuses it): the readable runs claimed
/// with it are still returned, to be continued (the claim failed as a whole before), and the next
/// claim ends it.
#[tokio::test]
async fn pg_a_failed_end_of_an_unreadable_run_still_gives_the_claimer_the_readable_ones() {
    let Some(url) = pg_url("pg_a_failed_end_of_an_unreadable_run").await else { return };
    let (dead, _) = open(&url, "dead", -1000).await;
    assert!(dead.apply(&[Write::Insert(Box::new(row("bad", "acct", 1))), Write::Insert(Box::new(row("good", "acct", 2)))]).await.expect("insert").len() == 2);
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    sqlx::query("UPDATE runs SET spec = '{not json' WHERE run_id = 'bad'").execute(&pool).await.expect("damage");
    sqlx::query("CREATE FUNCTION refuse_end() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$ LANGUAGE plpgsql").execute(&pool).await.expect("function");
    sqlx::query("CREATE TRIGGER refuse_end BEFORE UPDATE OF status ON runs FOR EACH ROW EXECUTE FUNCTION refuse_end()").execute(&pool).await.expect("trigger");
    // Its leases expire at once: the next claimer takes everything again.
    let (b, lb) = open(&url, "b", -1000).await;
    let claimed: Vec<String> = b.claim(&lb, false, &[]).await.expect("the claim stands").into_iter().map(|r| r.run_id).collect();
    assert_eq!(claimed, ["good"]);
    let unfinished: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE run_id = 'bad' AND finished_at IS NULL").fetch_one(&pool).await.expect("read");
    assert_eq!(unfinished, 1);
    sqlx::query("DROP TRIGGER refuse_end ON runs").execute(&pool).await.expect("drop");
    let (c, lc) = open(&url, "c", 60_000).await;
    let claimed: Vec<String> = c.claim(&lc, false, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(claimed, ["good"]);
    let code: Option<String> = sqlx::query_scalar("SELECT error_code FROM runs WHERE run_id = 'bad'").fetch_one(&pool).await.expect("read");
    assert_eq!(code.as_deref(), Some("internal"));
}

/// A run this replica owns whose lease expired and that it holds no log of (a takeover's claim
/// committed, then reading its events failed) is claimed again by this replica's next takeover;
/// before, only another replica could, and alone it never was: the run stayed unfinished for good.
/// A run it still holds (its renewal late) is not claimed again.
#[tokio::test]
async fn pg_a_replica_claims_again_its_own_expired_runs_it_holds_no_log_of() {
    let Some(url) = pg_url("pg_own_orphans_claimed").await else { return };
    // A negative lease: every run a inserts is expired at once.
    let (a, la) = open(&url, "a", -1000).await;
    for id in ["orphan", "held"] {
        assert!(matches!(a.apply(&[Write::Insert(Box::new(row(id, "acct", 1)))]).await.expect("insert")[..], [Applied::Inserted { .. }]));
    }
    let took: Vec<String> = a.claim(&la, false, &["held".to_owned()]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(took, ["orphan"]);
    assert_eq!(claims_of(&url).await["orphan"], ("a".to_owned(), 0), "no change of hands");
}

/// A run this replica holds a live log of is never claimed by its takeover, whoever owns the row:
/// here it was taken over by b while a's renewals failed, and b's lease lapsed in turn. Claimed
/// again, a second actor would continue it beside the first. Nor is a run of its session key (y)
/// or of its branch key (z): claimed here while x goes to another replica, the key would run on
/// two replicas at once. a's next renewal reports x lost (the first actor hands it off), and only
/// then does a takeover claim the three, in admission order; a run of other keys (w) is claimed
/// at once.
#[tokio::test]
async fn pg_a_takeover_never_claims_a_run_live_here_that_another_replica_owned() {
    let Some(url) = pg_url("pg_live_not_claimed").await else { return };
    let (a, la) = open(&url, "a", 60_000).await;
    assert!(matches!(one(&a, keyed("x", "s1", Some("feat"))).await, Applied::Inserted { .. }));
    let (b, _) = open(&url, "b", 60_000).await;
    for (id, session, branch) in [("y", "s1", None), ("z", "s2", Some("feat")), ("w", "s3", Some("other"))] {
        // (Those of x's keys are assigned to a, x's owner then.)
        assert!(matches!(one(&b, keyed(id, session, branch)).await, Applied::Inserted { .. } | Applied::Assigned { .. }), "{id}");
    }
    // b took x (and so its keys' runs) over, then its lease lapsed.
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    sqlx::query("UPDATE runs SET owner = 'b', lease_until = 0, assigned_at = NULL, claims = claims + 1 WHERE run_id IN ('x', 'y', 'z')").execute(&pool).await.expect("b took x");
    sqlx::query("UPDATE runs SET lease_until = 0 WHERE owner = 'b'").execute(&pool).await.expect("b lapsed");
    pool.close().await;
    let held = ["x".to_owned()];
    let took: Vec<String> = a.claim(&la, false, &held).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(took, ["w"], "a run live here, or one of its keys, was claimed");
    assert_eq!(a.renew(&la, &held).await.expect("renew").lost, held, "the renewal reports it lost");
    let took: Vec<String> = a.claim(&la, false, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(took, ["x", "y", "z"], "once handed off, a takeover continues them");
    assert_eq!(claims_of(&url).await["x"].0, "a");
}

/// A branch run whose session key has unfinished runs on one replica and whose branch key has
/// unfinished runs on another is refused (nothing stored): given to either, it would run one of
/// its keys on two replicas at once (two runs of a session side by side, or two runs on one
/// branch: the branch lock is per process). Before, it went to the owner of the earliest run of
/// either key. With both keys on one replica it is assigned there as before.
#[tokio::test]
async fn pg_a_run_whose_two_keys_are_on_two_replicas_is_refused_and_stored_nowhere() {
    let Some(url) = pg_url("pg_keys_on_two_replicas").await else { return };
    let (x, _) = open(&url, "x", 60_000).await;
    let (z, _) = open(&url, "z", 60_000).await;
    let (y, _) = open(&url, "y", 60_000).await;
    assert!(matches!(one(&x, keyed("a", "s1", Some("feat"))).await, Applied::Inserted { .. }));
    assert!(matches!(one(&z, keyed("c", "s2", None)).await, Applied::Inserted { .. }));
    // Session s2 is z's, branch feat is x's.
    assert_eq!(one(&y, keyed("d", "s2", Some("feat"))).await, Applied::KeysOnTwoReplicas);
    assert!(!claims_of(&url).await.contains_key("d"), "a refused run was stored");
    // Both keys on x: assigned to x, as before.
    assert!(matches!(one(&y, keyed("e", "s1", Some("feat"))).await, Applied::Assigned { .. }));
    assert_eq!(claims_of(&url).await["e"].0, "x");
}
