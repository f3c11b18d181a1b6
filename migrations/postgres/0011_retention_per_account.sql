-- The retention count is per billing account (one tenant's many runs must not push another's
-- history out): the sweep numbers each account's finished runs newest first by walking this
-- index, without sorting them. Built in the migration's transaction, like `runs_finished_order`
-- (the table holds the retained runs only).
CREATE INDEX runs_account_finished ON runs (billing_account_id, finished_at DESC, seq DESC) WHERE finished_at IS NOT NULL;
