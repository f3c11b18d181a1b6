//! The SQLite store's event log: events are appended to a table with no index but their row
//! numbers, and a run's events are found by those numbers (migration 0004 says why: an index on
//! `(run_id, id)` cost one 4 KiB page written per event).
//!
//! Where a run's row numbers are kept:
//! - a run not finished: [`LiveRows`], in memory, updated by the writer after each commit and
//!   rebuilt at open by one scan from the oldest unfinished run's `first_event_row`;
//! - a finished run: its row's `event_rows`, written in the transaction that ends it.
//!
//! Both are store contents, so neither is trusted to name only the run's rows: a row is taken only
//! when its `run_id` is the run's, and a list that does not read (or names another run's row) is
//! replaced by a scan of the events from the run's first row: slower, the same answer.

use super::RawEvent;
use crate::expiring::ExpiringKeys;
use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, OptionalExtension};
use std::collections::{HashMap, HashSet};
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// One event's place: its row number and its event id.
pub type Place = (i64, u64);

/// The places of the events of the runs not finished, by run id: committed events only.
#[derive(Default)]
pub struct LiveRows(Mutex<HashMap<String, Vec<Place>>>);

impl LiveRows {
    /// The places of every unfinished run's events, found by one scan from the oldest unfinished
    /// run's first event row. At open, before any write.
    pub fn rebuild(c: &Connection) -> rusqlite::Result<Self> {
        let mut map: HashMap<String, Vec<Place>> = HashMap::new();
        let mut from: Option<i64> = None;
        {
            let mut st = c.prepare("SELECT run_id, first_event_row FROM runs WHERE finished_at IS NULL AND first_event_row IS NOT NULL")?;
            let mut rows = st.query([])?;
            while let Some(r) = rows.next()? {
                // A row whose run id or first row does not read is continued by nobody (it is
                // ended as unreadable at start): it needs no places.
                if let (Ok(run), Ok(first)) = (r.get::<_, String>(0), r.get::<_, i64>(1)) {
                    map.insert(run, Vec::new());
                    from = Some(from.map_or(first, |f: i64| f.min(first)));
                }
            }
        }
        if let Some(from) = from {
            let mut st = c.prepare("SELECT rowid, run_id, id FROM events WHERE rowid >= ?")?;
            let mut rows = st.query([from])?;
            while let Some(r) = rows.next()? {
                if let Some((row, run, id)) = place_of(r) {
                    if let Some(places) = map.get_mut(&run) {
                        places.push((row, id));
                    }
                }
            }
        }
        Ok(Self(Mutex::new(map)))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<Place>>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn get(&self, run_id: &str) -> Option<Vec<Place>> {
        self.lock().get(run_id).cloned()
    }

    #[cfg(test)]
    pub fn keeps(&self, run_id: &str) -> bool {
        self.lock().contains_key(run_id)
    }
}

/// A row of `(rowid, run_id, id)`, or nothing when the row number or run id does not read (an id
/// that does not read is 0: the event is still the run's, to be deleted with it).
fn place_of(r: &rusqlite::Row<'_>) -> Option<(i64, String, u64)> {
    let run = r.get::<_, String>(1).ok()?;
    let id = r.get::<_, i64>(2).ok().map_or(0, |id| u64::try_from(id).unwrap_or(0));
    Some((r.get::<_, i64>(0).ok()?, run, id))
}

/// The row numbers a finished run's row lists, in order and each once: `None` when the list
/// does not read.
fn decode(list: &str) -> Option<Vec<i64>> {
    if list.is_empty() {
        return Some(Vec::new());
    }
    let mut rows = list.split(',').map(|n| n.parse::<i64>().ok()).collect::<Option<Vec<i64>>>()?;
    rows.sort_unstable();
    rows.dedup();
    Some(rows)
}

fn encode(places: &[Place]) -> String {
    let mut out = String::with_capacity(places.len() * 8);
    for (i, (row, _)) in places.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&row.to_string());
    }
    out
}

/// What a run's row says of its events.
struct RunEntry {
    finished: bool,
    /// Its first event's row; `None` if it has had none.
    first: Option<i64>,
    /// The rows listed (a finished run's), when the list reads and agrees with the first row
    /// (both are written together: the list's first row is `first`, an empty list has none).
    listed: Option<Vec<i64>>,
    /// What the row holds does not read or does not agree: the run's events are scanned for
    /// from here.
    suspect: Option<i64>,
}

fn entry(c: &Connection, run_id: &str) -> rusqlite::Result<Option<RunEntry>> {
    c.prepare_cached("SELECT finished_at IS NOT NULL, first_event_row, event_rows FROM runs WHERE run_id = ?")?
        .query_row([run_id], |r| {
            let (first, first_reads) = match r.get_ref(1)? {
                ValueRef::Integer(v) => (Some(v), true),
                ValueRef::Null => (None, true),
                _ => (None, false),
            };
            let list = match r.get_ref(2)? {
                ValueRef::Null => Ok(None),
                ValueRef::Text(t) => std::str::from_utf8(t).ok().and_then(decode).map(Some).ok_or(()),
                _ => Err(()),
            };
            let (listed, suspect) = match list {
                Ok(Some(l)) if first_reads && l.first().copied() == first => (Some(l), None),
                Ok(Some(l)) => (None, Some(l.first().copied().into_iter().chain(first).min().unwrap_or(0))),
                Ok(None) if first_reads => (None, None),
                _ => (None, Some(first.unwrap_or(0))),
            };
            Ok(RunEntry { finished: r.get(0)?, first, listed, suspect })
        })
        .optional()
}

/// Every event of `run_id` from row `from` on (a scan of the log: the way when no list serves).
fn scan(c: &Connection, run_id: &str, from: i64) -> rusqlite::Result<Vec<Place>> {
    let mut st = c.prepare_cached("SELECT rowid, run_id, id FROM events WHERE rowid >= ? AND run_id = ?")?;
    let mut rows = st.query(params![from, run_id])?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        if let Some((row, _, id)) = place_of(r) {
            out.push((row, id));
        }
    }
    Ok(out)
}

/// Runs whose damaged list was warned of lately: each once a minute, so that a client re-reading
/// a damaged run does not flood the log (the list is not repaired: each read scans); the same
/// bounded set the run store uses for the events it leaves out of streams.
static WARNED: LazyLock<Mutex<ExpiringKeys<String>>> = LazyLock::new(|| Mutex::new(ExpiringKeys::new(Duration::from_secs(60), 1_000)));

/// True when a warning about `run_id` may be logged at `now`.
fn warn_due(warned: &Mutex<ExpiringKeys<String>>, run_id: &str, now: Instant) -> bool {
    let mut warned = warned.lock().unwrap_or_else(PoisonError::into_inner);
    let key = run_id.to_owned();
    if warned.contains(&key, now) {
        return false;
    }
    warned.insert(key, now);
    true
}

fn scan_suspect(c: &Connection, run_id: &str, from: i64) -> rusqlite::Result<Vec<Place>> {
    if warn_due(&WARNED, run_id, Instant::now()) {
        tracing::warn!(run_id, "a run's list of event rows does not read or names rows that are not its events; its events are scanned for instead (logged once a minute)");
    }
    scan(c, run_id, from)
}

/// The places of a run's events as its row tells them (not [`LiveRows`]).
fn stored_places(c: &Connection, run_id: &str, e: &RunEntry) -> rusqlite::Result<Vec<Place>> {
    if let Some(from) = e.suspect {
        return scan_suspect(c, run_id, from);
    }
    let Some(listed) = &e.listed else {
        return match e.first {
            Some(first) => scan(c, run_id, first),
            None => Ok(Vec::new()),
        };
    };
    let mut st = c.prepare_cached("SELECT rowid, run_id, id FROM events WHERE rowid = ?")?;
    let mut out = Vec::with_capacity(listed.len());
    for row in listed {
        let found = st.query_row([row], |r| Ok(place_of(r))).optional()?.flatten();
        match found {
            Some((_, run, id)) if run == run_id => out.push((*row, id)),
            _ => return scan_suspect(c, run_id, listed[0].min(e.first.unwrap_or(listed[0]))),
        }
    }
    Ok(out)
}

/// The kind an event is read as when a column of it does not read (`decode_event` knows no such
/// kind: its run alone is ended as unreadable).
pub const UNREADABLE_COLUMN: &str = "<a column of another type>";

/// One event as stored. SQLite keeps any value in any column: a damaged or hand-edited row (a blob,
/// a real, text that is not UTF-8) reads as an event of no known kind, so that it ends its own run
/// as unreadable rather than failing the read of every run at a restart.
fn raw_event(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawEvent> {
    let id = match r.get_ref(0)? {
        ValueRef::Integer(id) => Some(id),
        _ => None,
    };
    let text = |i: usize| r.get_ref(i).ok().and_then(|v| v.as_str().ok()).map(str::to_owned);
    Ok(match (id, text(1), text(2)) {
        (Some(id), Some(name), Some(data)) => RawEvent { id, name, data },
        (id, _, _) => RawEvent { id: id.unwrap_or(0), name: UNREADABLE_COLUMN.to_owned(), data: String::new() },
    })
}

/// The events of `run_id` with an id above `after`, in id order.
pub fn read(c: &Connection, live: &LiveRows, run_id: &str, after: u64) -> rusqlite::Result<Vec<RawEvent>> {
    let places = match live.get(run_id) {
        Some(p) => p,
        None => match entry(c, run_id)? {
            Some(RunEntry { listed: Some(listed), first, suspect: None, .. }) => match read_listed(c, run_id, &listed, after)? {
                Some(events) => return Ok(events),
                None => scan_suspect(c, run_id, listed.first().copied().into_iter().chain(first).min().unwrap_or(0))?,
            },
            Some(e) => stored_places(c, run_id, &e)?,
            None => return Ok(Vec::new()),
        },
    };
    let mut st = c.prepare_cached("SELECT id, name, data FROM events WHERE rowid = ? AND run_id = ?")?;
    let mut out = Vec::new();
    for (row, id) in places {
        if id == 0 && after == 0 {
            // An id that is not a positive integer (a damaged row; a place reads it as 0): a
            // whole read (a restart continuing the run) must not go on without the event.
            out.push(RawEvent { id: 0, name: UNREADABLE_COLUMN.to_owned(), data: String::new() });
            continue;
        }
        if id <= after {
            continue;
        }
        // Gone meanwhile (the run was deleted): left out, as a later read would.
        if let Some(ev) = st.query_row(params![row, run_id], raw_event).optional()? {
            out.push(ev);
        }
    }
    out.sort_by_key(|e| e.id);
    Ok(out)
}

/// A finished run's events after `after` by its list, read from its end (rows and ids grow
/// together: an event is appended after every event of a lower id, a failure's end after the
/// events it cut), so a re-attach near the end reads a few rows. `None` when a row read is
/// missing or not the run's: the list is not to be believed.
fn read_listed(c: &Connection, run_id: &str, listed: &[i64], after: u64) -> rusqlite::Result<Option<Vec<RawEvent>>> {
    let mut st = c.prepare_cached("SELECT id, name, data, run_id FROM events WHERE rowid = ?")?;
    let mut out = Vec::new();
    for row in listed.iter().rev() {
        let found = st.query_row([row], |r| Ok((raw_event(r), r.get::<_, String>(3).ok()))).optional()?;
        let ev = match found {
            Some((ev, Some(run))) if run == run_id => ev?,
            _ => return Ok(None),
        };
        let id = u64::try_from(ev.id).unwrap_or(0);
        if id == 0 {
            // An id that does not read (a damaged row) says nothing of where the events after
            // `after` start: a whole read has the event (unreadable: said so), others pass it.
            if after == 0 {
                out.push(ev);
            }
            continue;
        }
        if id <= after {
            break;
        }
        out.push(ev);
    }
    out.reverse();
    out.sort_by_key(|e| e.id);
    Ok(Some(out))
}

fn delete<'a>(c: &Connection, run_id: &str, places: impl Iterator<Item = &'a Place>) -> rusqlite::Result<()> {
    let mut st = c.prepare_cached("DELETE FROM events WHERE rowid = ? AND run_id = ?")?;
    for (row, _) in places {
        st.execute(params![row, run_id])?;
    }
    Ok(())
}

/// What one transaction does to its runs' event places. [`LiveRows`] is changed only once it
/// committed ([`Batch::committed`]): a rolled-back insert's row number is given to the next one.
/// Only the writer changes [`LiveRows`], holding the write connection, so it stands still while a
/// batch is applied: a batch keeps what it adds and cuts, not a copy of a run's places. (A reader
/// between the commit and [`Batch::committed`] sees the places before the batch: as if it read
/// just before the commit; no client has been told of the batch's events yet.)
pub struct Batch<'l> {
    live: &'l LiveRows,
    runs: HashMap<String, Touched>,
}

#[derive(Default)]
struct Touched {
    /// The run's places before this batch when [`LiveRows`] does not have them (a finished run, a
    /// run without events yet, a run deleted and admitted again in this batch, or no run): as its
    /// row tells them.
    stored: Option<Vec<Place>>,
    added: Vec<Place>,
    /// Rows deleted by this batch.
    cut: HashSet<i64>,
    /// The run finished before this batch, or has no row: it is not kept in [`LiveRows`].
    settled: bool,
    /// The run's row has no first event row yet: this batch's first event gives it one.
    first_missing: bool,
    new_first: Option<i64>,
    /// The batch ends the run: its list is written.
    ends: bool,
    /// The batch deletes the run.
    gone: bool,
}

impl<'l> Batch<'l> {
    pub fn new(live: &'l LiveRows) -> Self {
        Self { live, runs: HashMap::new() }
    }

    fn touch(&mut self, c: &Connection, run_id: &str) -> rusqlite::Result<&mut Touched> {
        let known = self.runs.get(run_id).map(|t| t.gone);
        // A run deleted earlier in this batch and written again is a new run of that id: as its
        // row (inserted again) tells it, not as the places the batch deleted.
        if known != Some(false) {
            let t = if known.is_none() && self.live.lock().contains_key(run_id) {
                Touched::default()
            } else {
                match entry(c, run_id)? {
                    Some(e) => Touched {
                        stored: Some(stored_places(c, run_id, &e)?),
                        settled: e.finished,
                        first_missing: e.first.is_none(),
                        ..Touched::default()
                    },
                    // A stray event (no run): stored, found by no one, as before.
                    None => Touched { stored: Some(Vec::new()), settled: true, ..Touched::default() },
                }
            };
            self.runs.insert(run_id.to_owned(), t);
        }
        Ok(self.runs.get_mut(run_id).expect("inserted above"))
    }

    /// The run's places as of now in this batch.
    fn current(&self, run_id: &str) -> Vec<Place> {
        let Some(t) = self.runs.get(run_id) else { return Vec::new() };
        let mut places = match &t.stored {
            Some(p) => p.clone(),
            None => self.live.get(run_id).unwrap_or_default(),
        };
        if !t.cut.is_empty() {
            places.retain(|p| !t.cut.contains(&p.0));
        }
        places.extend_from_slice(&t.added);
        places
    }

    /// Inserts an event of `run_id` (`insert` does, giving its row). An id the run has already
    /// fails the batch, as the unique index did: two events under one id would show a client
    /// either. The run is looked at before the insert: a scan of its events must not find the
    /// new one.
    pub fn append(&mut self, c: &Connection, run_id: &str, id: u64, insert: impl FnOnce() -> rusqlite::Result<i64>) -> rusqlite::Result<()> {
        let t = self.touch(c, run_id)?;
        // Ids grow: the last one is all there is to compare but after a cut.
        let last = match (t.added.last(), &t.stored) {
            (Some(p), _) => Some(p.1),
            (None, Some(stored)) => stored.iter().map(|p| p.1).max(),
            (None, None) => self.live.lock().get(run_id).and_then(|v| v.last().map(|p| p.1)),
        };
        if last.is_some_and(|l| l >= id) && self.current(run_id).iter().any(|p| p.1 == id) {
            return Err(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE),
                Some(format!("run {run_id} has an event {id} already")),
            ));
        }
        let row = insert()?;
        let t = self.runs.get_mut(run_id).expect("touched");
        t.added.push((row, id));
        if t.first_missing && t.new_first.is_none() {
            t.new_first = Some(row);
        }
        Ok(())
    }

    /// Deletes the events of `run_id` from id `id` on (a store failure's end takes their place).
    pub fn cut_from(&mut self, c: &Connection, run_id: &str, id: u64) -> rusqlite::Result<()> {
        self.touch(c, run_id)?;
        let doomed: Vec<Place> = self.current(run_id).into_iter().filter(|p| p.1 >= id).collect();
        delete(c, run_id, doomed.iter())?;
        let t = self.runs.get_mut(run_id).expect("touched");
        t.added.retain(|p| p.1 < id);
        t.cut.extend(doomed.iter().map(|p| p.0));
        Ok(())
    }

    /// Deletes every event of `run_id` (the run is deleted).
    pub fn delete_all(&mut self, c: &Connection, run_id: &str) -> rusqlite::Result<()> {
        self.touch(c, run_id)?;
        let doomed = self.current(run_id);
        delete(c, run_id, doomed.iter())?;
        let t = self.runs.get_mut(run_id).expect("touched");
        t.added.clear();
        t.cut.extend(doomed.iter().map(|p| p.0));
        t.gone = true;
        Ok(())
    }

    /// The batch ends `run_id`.
    pub fn ends(&mut self, c: &Connection, run_id: &str) -> rusqlite::Result<()> {
        self.touch(c, run_id)?.ends = true;
        Ok(())
    }

    /// Writes the runs' first rows and the lists of the runs the batch ends (or changed after
    /// their end), in the batch's transaction. A list is written with its first row (the two
    /// must agree for the list to be believed: see [`RunEntry`]).
    pub fn write(&self, c: &Connection) -> rusqlite::Result<()> {
        for (run_id, t) in &self.runs {
            if t.gone {
                continue;
            }
            let changed = !t.added.is_empty() || !t.cut.is_empty();
            if t.ends || (t.settled && changed) {
                let places = self.current(run_id);
                c.prepare_cached("UPDATE runs SET event_rows = ?, first_event_row = ? WHERE run_id = ?")?
                    .execute(params![encode(&places), places.iter().map(|p| p.0).min(), run_id])?;
            } else if let Some(first) = t.new_first {
                c.prepare_cached("UPDATE runs SET first_event_row = COALESCE(first_event_row, ?) WHERE run_id = ?")?.execute(params![first, run_id])?;
            }
        }
        Ok(())
    }

    /// The transaction committed: runs still going keep their places in memory, the others not.
    pub fn committed(self) {
        let mut map = self.live.lock();
        for (run_id, t) in self.runs {
            if t.gone || t.ends || t.settled {
                map.remove(&run_id);
                continue;
            }
            let mut places = match t.stored {
                Some(p) => p,
                None => map.remove(&run_id).unwrap_or_default(),
            };
            if !t.cut.is_empty() {
                places.retain(|p| !t.cut.contains(&p.0));
            }
            places.extend(t.added);
            map.insert(run_id, places);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_reads_back_and_a_damaged_one_does_not() {
        let places = [(3, 1), (17, 2), (9_000_000_000, 3)];
        assert_eq!(decode(&encode(&places)), Some(vec![3, 17, 9_000_000_000]));
        assert_eq!(decode("17,3,17"), Some(vec![3, 17]), "in order, each once");
        assert_eq!(decode(""), Some(vec![]));
        for bad in ["1,,2", "1,x", "1;2", " 1", "1,", "99999999999999999999"] {
            assert_eq!(decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_damaged_list_is_warned_of_once_a_minute() {
        let warned = Mutex::new(ExpiringKeys::new(Duration::from_secs(60), 1_000));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(warn_due(&warned, "r1", at(0)));
        assert!(!warn_due(&warned, "r1", at(0)));
        assert!(!warn_due(&warned, "r1", at(59)));
        assert!(warn_due(&warned, "r1", at(60)));
        assert!(!warn_due(&warned, "r1", at(60)));
    }

    proptest::proptest! {
        #[test]
        fn any_list_text_decodes_or_is_refused_without_panic(s in ".{0,64}") {
            let _ = decode(&s);
        }

        #[test]
        fn every_list_of_rows_reads_back_in_order_each_once(rows in proptest::collection::vec(proptest::num::i64::ANY, 0..50)) {
            let places: Vec<Place> = rows.iter().map(|r| (*r, 0)).collect();
            let mut want = rows.clone();
            want.sort_unstable();
            want.dedup();
            proptest::prop_assert_eq!(decode(&encode(&places)), Some(want));
        }
    }
}
