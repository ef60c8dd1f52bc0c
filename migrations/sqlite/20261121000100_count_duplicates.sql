-- How many deliveries of each message were recognised as duplicates (see the PostgreSQL
-- migration of the same name).
ALTER TABLE txinbox_inbox ADD COLUMN duplicates INTEGER NOT NULL DEFAULT 0;
