-- Events become an append-only log: no index on (run_id, id). With that index every event of
-- ~1,000 interleaved runs dirtied a 4 KiB index page of its own (random run ids put concurrent runs'
-- entries on different pages), written whole to the WAL and again by the checkpoint: ~10-15% of
-- clawmux's CPU per run (BENCHMARKS.md, "SQLite events as an append-only log").
--
-- A run's events are found by their row numbers instead: `first_event_row` (set with its first
-- event) bounds a scan for a run not finished, and `event_rows` (its rows, comma-separated, written
-- with its end in the same transaction, with its first row) lists those of a finished run. The row
-- number is an INTEGER PRIMARY KEY, not the implicit rowid: VACUUM renumbers implicit rowids of a
-- table without one, and every list would then name other rows. Existing runs get both columns
-- here, while the index still finds their events.
ALTER TABLE runs ADD COLUMN first_event_row INTEGER;
ALTER TABLE runs ADD COLUMN event_rows TEXT;
UPDATE runs SET first_event_row = (SELECT min(e.rowid) FROM events e WHERE e.run_id = runs.run_id);
UPDATE runs SET event_rows = (SELECT group_concat(e.rowid, ',') FROM events e WHERE e.run_id = runs.run_id)
    WHERE finished_at IS NOT NULL AND first_event_row IS NOT NULL;
-- No foreign key: events of a deleted run are deleted with it (Delete, sweep), and one stray event
-- must never fail a whole group commit.
CREATE TABLE event_log (
    row     INTEGER PRIMARY KEY,
    run_id  TEXT    NOT NULL,
    id      INTEGER NOT NULL,
    name    TEXT    NOT NULL,
    data    TEXT    NOT NULL
);
INSERT INTO event_log (row, run_id, id, name, data) SELECT rowid, run_id, id, name, data FROM events;
DROP TABLE events;
ALTER TABLE event_log RENAME TO events;
