-- The billing records the LLM proxies write (spend, LLM-call records), by the id each write
-- carries. A commit can fail without saying whether it happened (the connection lost after
-- `COMMIT` was sent, or no answer within the statement bound); the writer then writes the batch's
-- billing records again, and a record whose id is here already is not counted a second time.
-- `written_at` (the writing replica's clock, ms) lets the sweep forget ids after a day.
CREATE TABLE billing_writes (
    id         TEXT   PRIMARY KEY,
    written_at BIGINT NOT NULL
);
CREATE INDEX billing_writes_written ON billing_writes (written_at);
