-- Per-account limits across replicas: an admission counts the account's unfinished runs and its
-- runs admitted in the last minute in the database, in the same transaction as the insert (under
-- the account's advisory lock), so two replicas cannot both admit the run that crosses a limit.
CREATE INDEX runs_account_unfinished ON runs (billing_account_id) WHERE finished_at IS NULL;
CREATE INDEX runs_account_created ON runs (billing_account_id, created_at);
