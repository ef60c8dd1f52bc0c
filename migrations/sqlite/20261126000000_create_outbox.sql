-- txinbox: the transactional outbox on SQLite (see PostgreSQL's `create_outbox` migration for
-- the model). Rows are written in the same transaction as the effects that caused them; a relay
-- publishes them at least once. Times are Unix milliseconds; the headers are JSON, as in
-- `txinbox_dead_letters`.
--
-- SQLite has one writer, so row IDs follow commit order. A relay claims rows by setting
-- `leased_until` and a random `lease_token` in a short write transaction, publishes without
-- holding the write lock, and marks the rows that still carry its token in a second one; a
-- claim that outlives its lease (a relay that died or stalled) is taken over.
CREATE TABLE txinbox_outbox (
    id              INTEGER PRIMARY KEY,
    message_id      TEXT    NOT NULL UNIQUE,
    destination     TEXT    NOT NULL,
    message_key     BLOB,
    payload         BLOB    NOT NULL,
    headers         TEXT    NOT NULL DEFAULT '[]',
    status          TEXT    NOT NULL DEFAULT 'pending'
                            CHECK (status IN ('pending', 'published', 'dead_lettered')),
    attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    leased_until    INTEGER,
    lease_token     INTEGER,
    last_error      TEXT,
    created_at      INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    published_at    INTEGER
);

-- The relay's claim: pending rows in order, and "is there an earlier pending row of my key".
CREATE INDEX txinbox_outbox_pending_idx ON txinbox_outbox (id) WHERE status = 'pending';
CREATE INDEX txinbox_outbox_pending_key_idx ON txinbox_outbox (destination, message_key, id)
    WHERE status = 'pending';
-- Retention deletes published rows by age.
CREATE INDEX txinbox_outbox_published_idx ON txinbox_outbox (published_at)
    WHERE status = 'published';
