-- The retention sweep (every 10 s on every replica) finds the newest `max_count` finished runs'
-- boundary by walking this index from its newest end, instead of sorting every finished run.
-- Built in the migration's transaction (inserts wait for it): the table holds the retained runs
-- only (`CLAWMUX_RUN_RETENTION_MAX`, 10,000 by default): 71 ms for 100,000 runs on the machine of
-- BENCHMARKS.md (with other work running).
CREATE INDEX runs_finished_order ON runs (finished_at, seq) WHERE finished_at IS NOT NULL;
-- It serves every use of the old one (a range of `finished_at`).
DROP INDEX runs_finished_at;
