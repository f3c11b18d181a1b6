-- Run ownership among replicas: a run belongs to the replica that admitted it (or took it over)
-- while that replica renews its lease; a run whose lease expired is claimed by another replica,
-- which continues it through the restart path. Times are milliseconds since the Unix epoch, from
-- the DATABASE's clock (replicas' clocks may differ; the database is the one judge of expiry).
ALTER TABLE runs ADD COLUMN owner TEXT;
ALTER TABLE runs ADD COLUMN lease_until BIGINT;
-- How often the run changed hands (a takeover adds one): for audits and tests ("exactly one
-- survivor took it over").
ALTER TABLE runs ADD COLUMN claims BIGINT NOT NULL DEFAULT 0;
-- An abort posted to a replica that does not own the run: the owner's renew loop sees it and
-- cancels the gateway run.
ALTER TABLE runs ADD COLUMN abort_requested_at BIGINT;

-- A run admitted by a replica while an earlier run of its session key is another replica's (or
-- itself still waits for its owner): it is given to that owner, which starts it after the earlier
-- ones (session-key FIFO across replicas). Set until the owner takes it up.
ALTER TABLE runs ADD COLUMN assigned_at BIGINT;

-- Renew (one statement per replica) and takeover both look at the unfinished runs only.
CREATE INDEX runs_owner_unfinished ON runs (owner) WHERE finished_at IS NULL;
-- A branch run's branch key (also in `spec`): runs of one branch key are assigned to one replica
-- like runs of one session key, so one replica at a time works on (and publishes) a branch.
ALTER TABLE runs ADD COLUMN branch_key TEXT;

-- An admission looks at the unfinished runs of its session key and branch key (assignment, above).
CREATE INDEX runs_session_unfinished ON runs (session_key) WHERE finished_at IS NULL;
CREATE INDEX runs_branch_unfinished ON runs (branch_key) WHERE finished_at IS NULL AND branch_key IS NOT NULL;
