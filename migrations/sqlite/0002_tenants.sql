-- Tenants: API keys scoped to billing accounts, per-account limits and spend, completion webhooks.

CREATE TABLE api_keys (
    -- The public part of a key (`cmx_<id>_<secret>`); the secret is kept only as its SHA-256.
    id             TEXT    PRIMARY KEY,
    name           TEXT    NOT NULL,
    secret_sha256  TEXT    NOT NULL,
    -- JSON array of billing account ids, or ["*"] for all.
    accounts       TEXT    NOT NULL,
    -- JSON array of actions: run, read, abort, admin.
    actions        TEXT    NOT NULL,
    -- Signs the key's webhook deliveries (HMAC-SHA256); it must be usable, so it is kept as is.
    webhook_secret TEXT    NOT NULL,
    -- Default webhook URL of the key's runs.
    webhook_url    TEXT,
    created_at     INTEGER NOT NULL,
    revoked_at     INTEGER
);

CREATE TABLE account_limits (
    billing_account_id  TEXT    PRIMARY KEY,
    max_tokens          INTEGER,
    period_sec          INTEGER,
    max_concurrent      INTEGER,
    max_runs_per_minute INTEGER,
    updated_at          INTEGER NOT NULL
);

-- Tokens the LLM proxy recorded per account and budget window (window_start: ms, a multiple of
-- the account's period).
CREATE TABLE spend (
    billing_account_id TEXT    NOT NULL,
    window_start       INTEGER NOT NULL,
    tokens             INTEGER NOT NULL,
    PRIMARY KEY (billing_account_id, window_start)
) WITHOUT ROWID;

-- Completion webhooks to deliver (at least once, across restarts): written in the same
-- transaction as the run's terminal event.
CREATE TABLE webhook_outbox (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id       TEXT    NOT NULL,
    url          TEXT    NOT NULL,
    key_id       TEXT,
    body         TEXT    NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    next_at      INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    delivered_at INTEGER,
    gave_up_at   INTEGER,
    last_error   TEXT
);
CREATE INDEX webhook_outbox_due ON webhook_outbox (next_at) WHERE delivered_at IS NULL AND gave_up_at IS NULL;

-- Who started a run (a key id; NULL for the admin token) and where its webhook goes.
ALTER TABLE runs ADD COLUMN key_id TEXT;
ALTER TABLE runs ADD COLUMN webhook_url TEXT;
