-- Which claim made a branch key its account's (`first_claim`) and which claimed it last
-- (`last_claim`, every claim by the owning account): a claim made for a run that was then refused
-- is let go only if no later claim (a run of the same account admitted meanwhile, working on the
-- key) came after it. Keys claimed before have neither and are never let go.
ALTER TABLE branch_owners ADD COLUMN first_claim TEXT;
ALTER TABLE branch_owners ADD COLUMN last_claim TEXT;
