-- The per-minute limit counts a billing account's admissions by ONE clock, the database's: each
-- run records when the database admitted it. `created_at` is the admitting replica's clock (what
-- the run document shows); two replicas whose clocks disagree by more than the window would each
-- miss the other's recent runs if the count compared their `created_at`s.
-- Added without a default (no rewrite of the table), the default set afterwards (new rows only).
ALTER TABLE runs ADD COLUMN admitted_at BIGINT;
-- Only the last minute is ever read: older runs keep NULL (never counted), so the migration
-- touches (and locks) only that minute's runs, with their replica's time as the best there is.
UPDATE runs SET admitted_at = created_at
    WHERE created_at >= (extract(epoch from clock_timestamp()) * 1000)::bigint - 60000;
ALTER TABLE runs ALTER COLUMN admitted_at SET DEFAULT (extract(epoch from clock_timestamp()) * 1000)::bigint;
CREATE INDEX runs_account_admitted ON runs (billing_account_id, admitted_at);
-- The count no longer reads `created_at`; its index (0006) only cost every insert.
DROP INDEX runs_account_created;
