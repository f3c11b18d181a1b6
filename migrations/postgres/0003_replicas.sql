-- The clawmux processes sharing this store: each renews its row while it runs (`doctor` lists
-- them with their last heartbeat). Times are milliseconds since the Unix epoch.
CREATE TABLE replicas (
    -- CLAWMUX_REPLICA_ID (default hostname-pid).
    id           TEXT   PRIMARY KEY,
    -- When this process started; a restart under the same id starts a new one.
    started_at   BIGINT NOT NULL,
    heartbeat_at BIGINT NOT NULL,
    -- The clawmux version it runs.
    version      TEXT   NOT NULL
);
