-- The retention count is per billing account (one tenant's many runs must not push another's
-- history out): the sweep numbers each account's finished runs newest first by walking this
-- index, without sorting them.
CREATE INDEX runs_account_finished ON runs (billing_account_id, finished_at DESC, seq DESC) WHERE finished_at IS NOT NULL;
