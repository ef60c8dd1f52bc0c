-- How many deliveries of each message were recognised as duplicates (redeliveries absorbed by
-- the inbox). Incremented in the duplicate's own transaction, with its source position; read
-- by `txinbox status`. A constant default makes this an instant change on PostgreSQL 11+.
ALTER TABLE txinbox.inbox ADD COLUMN duplicates bigint NOT NULL DEFAULT 0;
