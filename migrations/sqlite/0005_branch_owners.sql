-- A branch key belongs to the billing account that first ran on it: its git branch
-- (`sandbox/<key>`), worktree, lock and pull request are that account's. Another account's run
-- on the same key is refused (it would have worked in the first account's worktree and pushed to
-- its pull request). Kept for good: the branch outlives the runs (their retention).
CREATE TABLE branch_owners (
    branch_key         TEXT    PRIMARY KEY,
    billing_account_id TEXT    NOT NULL,
    claimed_at         INTEGER NOT NULL
);

-- The keys of the runs stored so far belong to the account of each key's first run (its branch
-- and pull request may exist already). A spec that does not read is passed by.
INSERT OR IGNORE INTO branch_owners (branch_key, billing_account_id, claimed_at)
SELECT json_extract(spec, '$.branch.key'), billing_account_id, created_at FROM runs
WHERE json_valid(spec) AND json_type(spec, '$.branch.key') = 'text'
ORDER BY seq;
