-- The key that created a key (`NULL`: the admin token or the CLI): revoking a key revokes every
-- key it made, and theirs, so a scoped admin key that leaked takes what it minted with it.
ALTER TABLE api_keys ADD COLUMN created_by TEXT;
