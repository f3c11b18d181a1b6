-- The run store: one row per run, every SSE event it emitted, in order.
-- Times are milliseconds since the Unix epoch. JSON columns hold what clawmux needs to continue a
-- run after a restart (`spec`, `checkpoint`) and the run document's structured parts.

CREATE TABLE runs (
    -- Admission order: newest first in history, FIFO order of a restart's re-queue.
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id           TEXT    NOT NULL UNIQUE,
    idempotency_key  TEXT    UNIQUE,
    fingerprint      TEXT    NOT NULL,
    billing_account_id TEXT  NOT NULL,
    state_key        TEXT,
    session_key      TEXT    NOT NULL,
    spec             TEXT    NOT NULL,
    status           TEXT    NOT NULL,
    checkpoint       TEXT,
    gateway_run_id   TEXT,
    content          TEXT    NOT NULL DEFAULT '',
    error_code       TEXT,
    error_message    TEXT,
    gateway_usage    TEXT,
    usage            TEXT,
    relay            TEXT,
    created_at       INTEGER NOT NULL,
    finished_at      INTEGER,
    last_event_id    INTEGER NOT NULL DEFAULT 0
);

CREATE INDEX runs_unfinished ON runs (seq) WHERE finished_at IS NULL;
CREATE INDEX runs_finished_at ON runs (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX runs_account ON runs (billing_account_id, seq);
CREATE INDEX runs_state_key ON runs (state_key, seq);
CREATE INDEX runs_status ON runs (status, seq);

-- A rowid table (appends stay at the end of the file) with a unique index for a run's events: a
-- WITHOUT ROWID table keyed by (run_id, id) cost ~3x more per event under interleaved runs (every
-- event lands on another page of the tree, and every touched page goes to the WAL).
-- No foreign key: events of a deleted run are deleted with it (Delete, sweep), and one stray event
-- must never fail a whole group commit.
CREATE TABLE events (
    run_id  TEXT    NOT NULL,
    id      INTEGER NOT NULL,
    name    TEXT    NOT NULL,
    data    TEXT    NOT NULL
);
CREATE UNIQUE INDEX events_run ON events (run_id, id);
