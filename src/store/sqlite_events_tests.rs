//! The SQLite event log ([`super::sqlite_events`]): a run's events found by their rows through
//! restarts, ends, deletions, damaged lists and the migration from the indexed log; and what it
//! is for, a commit of interleaved runs' events writing a few pages instead of one per event.

use super::backend_tests::row;
use super::sqlite::SqliteStore;
use super::{EventName, Retention, RunPatch, Store, StoredEvent, Write};
use rusqlite::Connection;
use std::path::Path;

/// A delta whose text says whose it is.
fn put(run: &str, id: u64) -> Write {
    let event = StoredEvent { id, name: EventName::TextDelta, data: format!("{{\"text\":\"{run}:{id}\"}}") };
    Write::Append { run_id: run.to_owned(), event: Some(event), patch: RunPatch::default(), webhook: None }
}

fn end(run: &str, id: u64) -> Write {
    let patch = RunPatch { status: Some("ok".into()), finished_at_ms: Some(10), ..RunPatch::default() };
    Write::Append { run_id: run.to_owned(), event: Some(StoredEvent { id, name: EventName::Final, data: "{}".into() }), patch, webhook: None }
}

async fn insert(s: &SqliteStore, runs: &[&str]) {
    let writes: Vec<Write> = runs.iter().map(|r| Write::Insert(Box::new(row(r, "acct", 1)))).collect();
    s.apply(&writes).await.expect("insert");
}

async fn ids(s: &SqliteStore, run: &str) -> Vec<u64> {
    s.events(run, 0).await.expect("events").into_iter().map(|e| e.id).collect()
}

fn open_raw(path: &Path) -> Connection {
    Connection::open(path).expect("raw connection")
}

/// The rows a run's row lists, each with the run the event there belongs to.
fn listed(c: &Connection, run: &str) -> Option<Vec<(i64, String)>> {
    let list: Option<String> = c.query_row("SELECT event_rows FROM runs WHERE run_id = ?", [run], |r| r.get(0)).expect("list");
    list.map(|l| {
        l.split(',')
            .map(|n| {
                let row: i64 = n.parse().expect("a row number");
                (row, c.query_row("SELECT run_id FROM events WHERE rowid = ?", [row], |r| r.get(0)).expect("a listed row exists"))
            })
            .collect()
    })
}

fn count(c: &Connection, sql: &str) -> i64 {
    c.query_row(sql, [], |r| r.get(0)).expect("count")
}

/// What the log is for: one commit of 100 runs' events (among 2,000 runs' 20,000) writes a few
/// pages to the WAL. With the index on `(run_id, id)` it wrote at least one per event (its entries
/// for 100 random run ids are on 100 different pages): 124 frames here, against 5.
#[tokio::test]
async fn a_commit_of_interleaved_runs_events_writes_pages_per_commit_not_per_event() {
    let dir = tempfile::tempdir().expect("dir");
    let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
    let runs: Vec<String> = (0..2000).map(|i| format!("run-{i:04}-{}", i * 7919 % 2000)).collect();
    let names: Vec<&str> = runs.iter().map(String::as_str).collect();
    insert(&s, &names).await;
    for id in 1..=10 {
        let batch: Vec<Write> = runs.iter().map(|r| put(r, id)).collect();
        s.apply(&batch).await.expect("events");
    }
    let c = open_raw(s.path());
    c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).expect("the WAL starts over");
    let batch: Vec<Write> = runs.iter().step_by(20).map(|r| put(r, 11)).collect();
    assert_eq!(batch.len(), 100);
    s.apply(&batch).await.expect("one commit");
    let frames: i64 = c.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1)).expect("frames");
    assert!(frames < 20, "one commit of 100 events wrote {frames} pages");
    assert_eq!(ids(&s, &runs[20]).await, (1..=11).collect::<Vec<_>>());
}

/// A run not finished at a restart is found again (its rows rebuilt from its first row), goes on,
/// and its end lists every one of its events, before and after the restart.
#[tokio::test]
async fn a_run_continued_after_a_restart_keeps_its_events_and_its_end_lists_all_of_them() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("r.db");
    {
        let s = SqliteStore::open(&path).await.expect("open");
        insert(&s, &["r1", "r2", "r3"]).await;
        s.apply(&[put("r1", 1), put("r2", 1), put("r1", 2), put("r3", 1), put("r2", 2), put("r1", 3)]).await.expect("events");
        s.apply(&[end("r3", 2)]).await.expect("r3 ends");
    }
    let s = SqliteStore::open(&path).await.expect("reopen");
    assert!(s.keeps_places_of("r1") && s.keeps_places_of("r2"), "the runs in flight's places are rebuilt at open");
    assert!(!s.keeps_places_of("r3"), "a finished run's are in its row");
    assert_eq!(ids(&s, "r1").await, [1, 2, 3]);
    assert_eq!(ids(&s, "r2").await, [1, 2]);
    assert_eq!(ids(&s, "r3").await, [1, 2]);
    s.apply(&[put("r2", 3), put("r1", 4)]).await.expect("more");
    s.apply(&[end("r1", 5)]).await.expect("r1 ends");
    assert_eq!(ids(&s, "r1").await, [1, 2, 3, 4, 5]);
    let c = open_raw(&path);
    let list = listed(&c, "r1").expect("an ended run lists its rows");
    assert_eq!(list.len(), 5);
    assert!(list.iter().all(|(_, run)| run == "r1"), "{list:?}");
    assert_eq!(listed(&c, "r2"), None, "a run going on has no list yet");
    drop(s);
    let s = SqliteStore::open(&path).await.expect("reopen again");
    assert_eq!(ids(&s, "r1").await, [1, 2, 3, 4, 5]);
    assert_eq!(ids(&s, "r2").await, [1, 2, 3]);
    assert_eq!(s.events("r1", 3).await.expect("after 3").len(), 2);
}

/// The lists are store contents: one that does not read, disagrees with the run's first row, or
/// names another run's rows, is not believed (the run's own events are scanned for), a row listed
/// twice is read once, and another run's event is never shown.
#[tokio::test]
async fn a_damaged_list_never_shows_another_runs_events() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("r.db");
    {
        let s = SqliteStore::open(&path).await.expect("open");
        insert(&s, &["r1", "r2"]).await;
        s.apply(&[put("r1", 1), put("r2", 1), put("r1", 2), put("r2", 2), end("r1", 3), end("r2", 3)]).await.expect("events");
    }
    let c = open_raw(&path);
    let theirs: String = c.query_row("SELECT event_rows FROM runs WHERE run_id = 'r2'", [], |r| r.get(0)).expect("r2's list");
    let mine: String = c.query_row("SELECT event_rows FROM runs WHERE run_id = 'r1'", [], |r| r.get(0)).expect("r1's list");
    let r2_first: i64 = c.query_row("SELECT first_event_row FROM runs WHERE run_id = 'r2'", [], |r| r.get(0)).expect("first");
    for (list, first) in [
        (Some(theirs.clone()), None),
        (Some(format!("{mine},{}", theirs.split(',').next().expect("a row"))), None),
        (Some("not, a list".to_owned()), None),
        (Some("".to_owned()), None),
        (Some(format!("{mine},{mine}")), None),
        (None, Some("x")),
    ] {
        c.execute("UPDATE runs SET event_rows = ? WHERE run_id = 'r1'", [&list]).expect("damage the list");
        if let Some(f) = first {
            c.execute("UPDATE runs SET first_event_row = ? WHERE run_id = 'r1'", [f]).expect("damage the first row");
        }
        let s = SqliteStore::open(&path).await.expect("reopen");
        let got = s.events("r1", 0).await.expect("events");
        let got_ids: Vec<u64> = got.iter().map(|e| e.id).collect();
        assert_eq!(got_ids, [1, 2, 3], "list {list:?}, first row {first:?}");
        assert!(got.iter().all(|e| e.data.contains("r1:") || e.name == EventName::Final), "another run's event: {got:?}");
        assert_eq!(ids(&s, "r2").await, [1, 2, 3], "r2 untouched");
    }
    // Nothing rewrote the other run's list.
    let r2 = listed(&c, "r2").expect("r2's list");
    assert_eq!(r2.len(), 3);
    assert!(r2.iter().all(|(row, run)| run == "r2" && *row >= r2_first), "{r2:?}");
}

/// A rolled-back batch's rows are given to the next insert: the run that wrote it must not list
/// them (its list would name another run's event, and a sweep of it would go for that row).
#[tokio::test]
async fn a_rolled_back_batch_leaves_no_rows_to_its_runs() {
    let dir = tempfile::tempdir().expect("dir");
    let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
    insert(&s, &["r1", "r2"]).await;
    s.apply(&[put("r1", 1), put("r2", 1)]).await.expect("events");
    // r2's event 1 again: the batch fails as a whole, r1's event 2 with it.
    assert!(s.apply(&[put("r1", 2), put("r2", 1)]).await.is_err());
    s.apply(&[put("r2", 2)]).await.expect("r2 takes the row r1's event 2 had");
    s.apply(&[put("r1", 2), end("r1", 3)]).await.expect("r1 ends");
    let c = open_raw(s.path());
    let list = listed(&c, "r1").expect("list");
    assert_eq!(list.len(), 3, "{list:?}");
    assert!(list.iter().all(|(_, run)| run == "r1"), "r1 lists another run's row: {list:?}");
    assert_eq!(ids(&s, "r1").await, [1, 2, 3]);
    assert_eq!(ids(&s, "r2").await, [1, 2]);
}

/// Deleting a run, and the retention sweep, delete its events from the log (found by its list),
/// and no other run's.
#[tokio::test]
async fn deleted_and_swept_runs_take_their_events_out_of_the_log() {
    let dir = tempfile::tempdir().expect("dir");
    let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
    insert(&s, &["r1", "r2", "r3", "r4"]).await;
    s.apply(&[put("r1", 1), put("r2", 1), put("r3", 1), put("r4", 1), put("r1", 2), put("r2", 2), put("r3", 2)]).await.expect("events");
    s.apply(&[end("r2", 3)]).await.expect("r2 ends");
    s.apply(&[end("r3", 3)]).await.expect("r3 ends");
    let c = open_raw(s.path());
    assert_eq!(count(&c, "SELECT count(*) FROM events"), 9);
    s.apply(&[Write::Delete { run_id: "r1".into() }]).await.expect("delete a live run");
    assert_eq!(count(&c, "SELECT count(*) FROM events"), 7);
    assert_eq!(count(&c, "SELECT count(*) FROM events WHERE run_id = 'r1'"), 0);
    // Both ended at the same time: the later admitted is the newer, r2 goes.
    let gone = s.sweep(Retention { max_age_ms: 1_000_000, max_count: 1 }, 20).await.expect("sweep");
    assert_eq!(gone, ["r2"]);
    assert_eq!(count(&c, "SELECT count(*) FROM events WHERE run_id = 'r2'"), 0);
    assert_eq!(count(&c, "SELECT count(*) FROM events"), 4);
    assert_eq!(ids(&s, "r3").await, [1, 2, 3]);
    assert_eq!(ids(&s, "r4").await, [1]);
}

/// A store made by a build with the indexed log (schema 3) is migrated: its finished runs' events
/// are listed, its unfinished runs' found from their first rows, and the index is gone.
#[tokio::test]
async fn a_store_with_the_indexed_log_is_migrated_with_every_event_found() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("r.db");
    {
        let c = open_raw(&path);
        for sql in [
            include_str!("../../migrations/sqlite/0001_runs.sql"),
            include_str!("../../migrations/sqlite/0002_tenants.sql"),
            include_str!("../../migrations/sqlite/0003_idempotency_per_account.sql"),
        ] {
            c.execute_batch(sql).expect("old schema");
        }
        c.pragma_update(None, "user_version", 3).expect("version");
        let spec = serde_json::to_string(&row("x", "a", 1).spec).expect("spec");
        for (run, finished) in [("done", Some(5)), ("going", None), ("quiet", None)] {
            c.execute(
                "INSERT INTO runs (run_id, fingerprint, billing_account_id, session_key, spec, status, created_at, finished_at) \
                 VALUES (?, 'fp', 'a', 's', ?, 'running', 1, ?)",
                rusqlite::params![run, spec, finished],
            )
            .expect("run");
        }
        for (run, id) in [("done", 1), ("going", 1), ("done", 2), ("going", 2), ("done", 3)] {
            c.execute("INSERT INTO events (run_id, id, name, data) VALUES (?, ?, 'text_delta', '{\"text\":\"x\"}')", rusqlite::params![run, id])
                .expect("event");
        }
    }
    let s = SqliteStore::open(&path).await.expect("migrates");
    let c = open_raw(&path);
    assert_eq!(count(&c, "SELECT count(*) FROM sqlite_master WHERE name = 'events_run'"), 0, "the index is dropped");
    assert_eq!(listed(&c, "done").expect("listed").len(), 3);
    assert_eq!(ids(&s, "done").await, [1, 2, 3]);
    assert_eq!(ids(&s, "going").await, [1, 2]);
    assert!(ids(&s, "quiet").await.is_empty());
    s.apply(&[put("going", 3), put("quiet", 1)]).await.expect("they go on");
    s.apply(&[end("going", 4), end("quiet", 2)]).await.expect("and end");
    assert_eq!(listed(&c, "going").expect("listed").len(), 4);
    drop(s);
    let s = SqliteStore::open(&path).await.expect("reopen");
    assert_eq!(ids(&s, "going").await, [1, 2, 3, 4]);
    assert_eq!(ids(&s, "quiet").await, [1, 2]);
}

/// `VACUUM` (an operator reclaiming space after sweeps) renumbers a table's implicit row ids; the
/// log's row numbers are its primary key, which it keeps: every run's events are still found, and
/// a run in flight ends with a list of its own rows.
#[tokio::test]
async fn a_vacuum_keeps_every_runs_events_found() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("r.db");
    {
        let s = SqliteStore::open(&path).await.expect("open");
        insert(&s, &["r0", "r1", "r2"]).await;
        s.apply(&[put("r0", 1), put("r0", 2), put("r1", 1), put("r2", 1), put("r1", 2), put("r2", 2), end("r1", 3)]).await.expect("events");
        // Holes at the start of the log: r0's events deleted.
        s.apply(&[Write::Delete { run_id: "r0".into() }]).await.expect("delete");
    }
    open_raw(&path).execute_batch("VACUUM").expect("vacuum");
    let s = SqliteStore::open(&path).await.expect("reopen");
    assert_eq!(ids(&s, "r1").await, [1, 2, 3]);
    assert_eq!(ids(&s, "r2").await, [1, 2]);
    s.apply(&[put("r2", 3), end("r2", 4)]).await.expect("r2 goes on and ends");
    let c = open_raw(&path);
    let list = listed(&c, "r2").expect("list");
    assert_eq!(list.len(), 4);
    assert!(list.iter().all(|(_, run)| run == "r2"), "{list:?}");
    s.sweep(Retention { max_age_ms: 0, max_count: 0 }, i64::MAX).await.expect("sweep all");
    assert_eq!(count(&c, "SELECT count(*) FROM events"), 0, "every event went with its run");
}

/// A store failure's end takes the place of the run's events from its id on; written again (its
/// end is retried until the store has it), it still lists the run's rows once.
#[tokio::test]
async fn a_failures_end_cuts_the_events_after_it_and_is_listed_once_when_written_again() {
    let dir = tempfile::tempdir().expect("dir");
    let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
    insert(&s, &["r1", "r2"]).await;
    s.apply(&[put("r1", 1), put("r2", 1), put("r1", 2), put("r1", 3)]).await.expect("events");
    let fail = Write::Fail {
        run_id: "r1".into(),
        event: StoredEvent { id: 2, name: EventName::Error, data: "{\"code\":\"internal\"}".into() },
        patch: RunPatch { status: Some("error".into()), finished_at_ms: Some(10), ..RunPatch::default() },
        webhook: None,
    };
    s.apply(std::slice::from_ref(&fail)).await.expect("the end");
    let got = s.events("r1", 0).await.expect("events");
    assert_eq!(got.iter().map(|e| (e.id, e.name)).collect::<Vec<_>>(), [(1, EventName::TextDelta), (2, EventName::Error)]);
    s.apply(&[fail]).await.expect("the end again");
    assert_eq!(ids(&s, "r1").await, [1, 2]);
    let c = open_raw(s.path());
    let list = listed(&c, "r1").expect("list");
    assert_eq!(list.len(), 2, "{list:?}");
    assert_eq!(count(&c, "SELECT count(*) FROM events WHERE run_id = 'r1'"), 2);
    assert_eq!(ids(&s, "r2").await, [1]);
}

/// A run in flight whose first row does not read is found by a scan (it is not in the places
/// rebuilt at open), and its next event is stored: the scan looks before the insert, so the new
/// event is not taken for one it already has.
#[tokio::test]
async fn a_run_whose_first_row_does_not_read_goes_on() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("r.db");
    {
        let s = SqliteStore::open(&path).await.expect("open");
        insert(&s, &["r1", "r2"]).await;
        s.apply(&[put("r1", 1), put("r2", 1), put("r1", 2)]).await.expect("events");
    }
    open_raw(&path).execute("UPDATE runs SET first_event_row = 'x' WHERE run_id = 'r1'", []).expect("damage");
    let s = SqliteStore::open(&path).await.expect("reopen");
    assert!(!s.keeps_places_of("r1"));
    assert_eq!(ids(&s, "r1").await, [1, 2]);
    s.apply(&[put("r1", 3)]).await.expect("its next event");
    s.apply(&[end("r1", 4)]).await.expect("its end");
    assert_eq!(ids(&s, "r1").await, [1, 2, 3, 4]);
    let list = listed(&open_raw(&path), "r1").expect("list");
    assert_eq!(list.len(), 4, "{list:?}");
}

/// A run deleted and admitted again under its id in one batch starts a log of its own.
#[tokio::test]
async fn a_run_deleted_and_admitted_again_in_one_batch_starts_over() {
    let dir = tempfile::tempdir().expect("dir");
    let s = SqliteStore::open(&dir.path().join("r.db")).await.expect("open");
    insert(&s, &["r1"]).await;
    s.apply(&[put("r1", 1), put("r1", 2)]).await.expect("events");
    s.apply(&[Write::Delete { run_id: "r1".into() }, Write::Insert(Box::new(row("r1", "acct", 2))), put("r1", 1)]).await.expect("again");
    assert!(s.keeps_places_of("r1"));
    assert_eq!(ids(&s, "r1").await, [1]);
    s.apply(&[end("r1", 2)]).await.expect("end");
    assert_eq!(ids(&s, "r1").await, [1, 2]);
    let c = open_raw(s.path());
    assert_eq!(count(&c, "SELECT count(*) FROM events"), 2, "the first run's events are gone");
    assert_eq!(listed(&c, "r1").expect("list").len(), 2);
}

/// A run whose row does not read is ended by the start that takes the runs up; its events are
/// listed with that end like any run's, and no longer kept in memory.
#[tokio::test]
async fn a_run_ended_at_start_for_an_unreadable_row_gets_its_list() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("r.db");
    {
        let s = SqliteStore::open(&path).await.expect("open");
        insert(&s, &["bad", "good"]).await;
        s.apply(&[put("bad", 1), put("good", 1), put("bad", 2)]).await.expect("events");
    }
    open_raw(&path).execute("UPDATE runs SET spec = '{not json' WHERE run_id = 'bad'", []).expect("damage");
    let s = SqliteStore::open(&path).await.expect("reopen");
    assert!(s.keeps_places_of("bad"));
    let lease = super::Lease { replica: "one".into(), ms: 60_000 };
    let claimed: Vec<String> = s.claim(&lease, true, &[]).await.expect("claim").into_iter().map(|r| r.run_id).collect();
    assert_eq!(claimed, ["good"]);
    assert!(!s.keeps_places_of("bad"), "an ended run's places are in its row");
    let list = listed(&open_raw(&path), "bad").expect("its end lists its events");
    assert_eq!(list.len(), 2);
    assert!(list.iter().all(|(_, run)| run == "bad"), "{list:?}");
    assert_eq!(ids(&s, "bad").await, [1, 2]);
}

/// A finished run (its events found by its list) with an event whose id does not read (a damaged
/// row): a re-attach after a later event still gets the events after it, and a whole read says
/// the run holds an event it cannot read (it failed the read before; with the tolerant reader the
/// events before it were dropped without a word).
#[tokio::test]
async fn a_finished_runs_event_with_an_id_that_does_not_read_is_passed_by_a_re_attach_and_named_by_a_whole_read() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("r.db");
    let s = SqliteStore::open(&path).await.expect("open");
    insert(&s, &["r1"]).await;
    s.apply(&[put("r1", 1), put("r1", 2), put("r1", 3)]).await.expect("events");
    s.apply(&[end("r1", 4)]).await.expect("r1 ends");
    drop(s);
    open_raw(&path).execute("UPDATE events SET id = 'x' WHERE run_id = 'r1' AND id = 2", []).expect("damage");
    let s = SqliteStore::open(&path).await.expect("reopen");
    assert_eq!(s.events("r1", 2).await.expect("after 2").into_iter().map(|e| e.id).collect::<Vec<_>>(), [3, 4]);
    assert_eq!(s.events("r1", 1).await.expect("after 1").into_iter().map(|e| e.id).collect::<Vec<_>>(), [3, 4], "passed by, the ones before kept");
    assert!(s.events("r1", 0).await.is_err_and(|e| e.to_string().contains("unknown kind")), "a whole read names the damage");
}
