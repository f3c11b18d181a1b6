-- Events become an append-only log: no index on (run_id, id). With that index every event of
-- ~1,000 interleaved runs dirtied a 4 KiB index page of its own (random run ids put concurrent runs'
-- entries on different pages), written whole to the WAL and again by the checkpoint: ~15% of
-- clawmux's CPU per run (BENCHMARKS.md, "SQLite events as an append-only log").
--
-- A run's events are found by their row numbers instead: `first_event_row` (set with its first
-- event) bounds a scan for a run not finished, and `event_rows` (its rows, comma-separated, written
-- with its end in the same transaction) lists those of a finished run. Existing runs get both here,
-- while the index still finds their events.
ALTER TABLE runs ADD COLUMN first_event_row INTEGER;
ALTER TABLE runs ADD COLUMN event_rows TEXT;
UPDATE runs SET first_event_row = (SELECT min(e.rowid) FROM events e WHERE e.run_id = runs.run_id);
UPDATE runs SET event_rows = (SELECT group_concat(e.rowid, ',') FROM events e WHERE e.run_id = runs.run_id)
    WHERE finished_at IS NOT NULL AND first_event_row IS NOT NULL;
DROP INDEX events_run;
