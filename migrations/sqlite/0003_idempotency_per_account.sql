-- An Idempotency-Key is a billing account's own: another tenant's equal key is another run (it
-- was unique across accounts, so one tenant's key could refuse another's request). SQLite cannot
-- drop a column's UNIQUE constraint: the table is rebuilt, its rows, admission order and
-- AUTOINCREMENT counter kept.

CREATE TABLE runs_new (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id           TEXT    NOT NULL UNIQUE,
    idempotency_key  TEXT,
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
    last_event_id    INTEGER NOT NULL DEFAULT 0,
    key_id           TEXT,
    webhook_url      TEXT,
    UNIQUE (billing_account_id, idempotency_key)
);

INSERT INTO runs_new (seq, run_id, idempotency_key, fingerprint, billing_account_id, state_key, session_key, spec, status,
                      checkpoint, gateway_run_id, content, error_code, error_message, gateway_usage, usage, relay,
                      created_at, finished_at, last_event_id, key_id, webhook_url)
SELECT seq, run_id, idempotency_key, fingerprint, billing_account_id, state_key, session_key, spec, status,
       checkpoint, gateway_run_id, content, error_code, error_message, gateway_usage, usage, relay,
       created_at, finished_at, last_event_id, key_id, webhook_url
FROM runs;

-- The counter, not the highest kept seq: runs deleted since (retention) never lend their seq.
INSERT INTO sqlite_sequence (name, seq) SELECT 'runs_new', 0 WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'runs_new');
UPDATE sqlite_sequence SET seq = max(seq, coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'runs'), 0)) WHERE name = 'runs_new';

DROP TABLE runs;
ALTER TABLE runs_new RENAME TO runs;

CREATE INDEX runs_unfinished ON runs (seq) WHERE finished_at IS NULL;
CREATE INDEX runs_finished_at ON runs (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX runs_account ON runs (billing_account_id, seq);
CREATE INDEX runs_state_key ON runs (state_key, seq);
CREATE INDEX runs_status ON runs (status, seq);
