-- The per-minute limit counts a billing account's admissions by ONE clock, the database's: each
-- run records when the database admitted it. `created_at` is the admitting replica's clock (what
-- the run document shows); two replicas whose clocks disagree by more than the window would each
-- miss the other's recent runs if the count compared their `created_at`s.
ALTER TABLE runs ADD COLUMN admitted_at BIGINT;
-- Runs stored before this migration: their replica's time is the best there is.
UPDATE runs SET admitted_at = created_at;
ALTER TABLE runs ALTER COLUMN admitted_at SET DEFAULT (extract(epoch from clock_timestamp()) * 1000)::bigint;
ALTER TABLE runs ALTER COLUMN admitted_at SET NOT NULL;
CREATE INDEX runs_account_admitted ON runs (billing_account_id, admitted_at);
