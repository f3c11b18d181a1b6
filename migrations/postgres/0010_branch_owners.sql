-- A branch key belongs to the billing account that first ran on it: its git branch
-- (`sandbox/<key>`), worktree, lock and pull request are that account's. Another account's run
-- on the same key is refused (it would have worked in the first account's worktree and pushed to
-- its pull request). Kept for good: the branch outlives the runs (their retention).
CREATE TABLE branch_owners (
    branch_key         TEXT   PRIMARY KEY,
    billing_account_id TEXT   NOT NULL,
    claimed_at         BIGINT NOT NULL
);

-- The keys of the runs stored so far belong to the account of each key's first run (its branch
-- and pull request may exist already).
INSERT INTO branch_owners (branch_key, billing_account_id, claimed_at)
SELECT DISTINCT ON (branch_key) branch_key, billing_account_id, created_at FROM runs
WHERE branch_key IS NOT NULL
ORDER BY branch_key, seq
ON CONFLICT DO NOTHING;
