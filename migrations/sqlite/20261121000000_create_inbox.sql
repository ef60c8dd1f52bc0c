-- txinbox on SQLite: the same tables as on PostgreSQL, prefixed `txinbox_` (SQLite has no
-- schemas). The migration ledger is `txinbox_sqlx_migrations`, never the application's
-- `_sqlx_migrations`. Timestamps are Unix milliseconds. Migrations are additive only.

CREATE TABLE txinbox_inbox (
    consumer         TEXT    NOT NULL,
    message_id       TEXT    NOT NULL,
    id_strategy      TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    status           TEXT    NOT NULL CHECK (status IN ('processed', 'retrying', 'dead_lettered')),
    attempts         INTEGER NOT NULL CHECK (attempts >= 0),
    first_seen_at    INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    processed_at     INTEGER,
    last_error       TEXT,
    source_system    TEXT    NOT NULL,
    destination      TEXT    NOT NULL,
    source_partition INTEGER,
    source_offset    INTEGER,
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;

CREATE INDEX txinbox_inbox_processed_at_idx ON txinbox_inbox (consumer, processed_at)
    WHERE status <> 'retrying';

CREATE TABLE txinbox_dead_letters (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer         TEXT    NOT NULL,
    message_id       TEXT,
    id_strategy      TEXT,
    fingerprint      BLOB,
    reason           TEXT    NOT NULL,
    error            TEXT    NOT NULL,
    attempts         INTEGER NOT NULL,
    payload          BLOB    NOT NULL,
    headers          TEXT    NOT NULL, -- JSON, as in PostgreSQL's jsonb column
    source_system    TEXT    NOT NULL,
    destination      TEXT    NOT NULL,
    source_partition INTEGER,
    source_offset    INTEGER,
    dead_lettered_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);

CREATE INDEX txinbox_dead_letters_consumer_idx ON txinbox_dead_letters (consumer, dead_lettered_at);
CREATE INDEX txinbox_dead_letters_message_idx ON txinbox_dead_letters (consumer, message_id);

CREATE TABLE txinbox_positions (
    consumer      TEXT    NOT NULL,
    source        TEXT    NOT NULL,
    lane          TEXT    NOT NULL,
    next_position INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    PRIMARY KEY (consumer, source, lane)
) WITHOUT ROWID;
