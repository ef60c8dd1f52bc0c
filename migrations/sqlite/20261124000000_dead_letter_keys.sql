-- Dead letters become idempotent and say when their stored payload is not the whole message;
-- subscriptions are recorded (see the PostgreSQL migration of the same name). The operator
-- columns of PostgreSQL's `operations` migration come along, so both stores' dead letters
-- have one shape.

ALTER TABLE txinbox_dead_letters ADD COLUMN requeued_at INTEGER;
ALTER TABLE txinbox_dead_letters ADD COLUMN requeue_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE txinbox_dead_letters ADD COLUMN discarded_at INTEGER;
ALTER TABLE txinbox_dead_letters ADD COLUMN discard_reason TEXT;
ALTER TABLE txinbox_dead_letters ADD COLUMN payload_size INTEGER;
ALTER TABLE txinbox_dead_letters ADD COLUMN payload_sha256 BLOB CHECK (length(payload_sha256) = 32);
ALTER TABLE txinbox_dead_letters ADD COLUMN truncated INTEGER NOT NULL DEFAULT 0;

-- Rows written before this migration stored the whole payload: their size is known. (SQLite
-- has no SHA-256 function: their hash stays NULL, so such a row, if read again at its
-- position, is recorded once more with its hash.)
UPDATE txinbox_dead_letters SET payload_size = length(payload);

-- Rows recorded twice before this migration (same position, same payload; same conflict):
-- keep the oldest pending one, mark the others discarded. Window functions, so one pass.
UPDATE txinbox_dead_letters
SET discarded_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    discard_reason = 'duplicate of dead letter ' || k.keep || ' (merged by migration 20261124000000)'
FROM (SELECT id, min(id) OVER (PARTITION BY consumer, source_system, destination, source_partition, source_offset, payload) AS keep
      FROM txinbox_dead_letters
      WHERE source_offset IS NOT NULL AND discarded_at IS NULL) AS k
WHERE txinbox_dead_letters.id = k.id AND k.id <> k.keep;

UPDATE txinbox_dead_letters
SET discarded_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    discard_reason = 'duplicate of dead letter ' || k.keep || ' (merged by migration 20261124000000)'
FROM (SELECT id, min(id) OVER (PARTITION BY consumer, message_id, fingerprint) AS keep
      FROM txinbox_dead_letters
      WHERE reason = 'conflict' AND message_id IS NOT NULL AND fingerprint IS NOT NULL
        AND discarded_at IS NULL) AS k
WHERE txinbox_dead_letters.id = k.id AND k.id <> k.keep;

CREATE UNIQUE INDEX txinbox_dead_letters_position_key ON txinbox_dead_letters
    (consumer, source_system, destination, source_partition, source_offset, payload_sha256)
    WHERE source_offset IS NOT NULL AND requeued_at IS NULL AND discarded_at IS NULL;

CREATE UNIQUE INDEX txinbox_dead_letters_conflict_key ON txinbox_dead_letters (consumer, message_id, fingerprint)
    WHERE reason = 'conflict' AND requeued_at IS NULL AND discarded_at IS NULL;

CREATE TABLE txinbox_subscriptions (
    consumer      TEXT    NOT NULL,
    source_system TEXT    NOT NULL,
    source        TEXT    NOT NULL,
    subscription  TEXT    NOT NULL,
    first_seen_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    last_seen_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    PRIMARY KEY (consumer, source_system, source)
) WITHOUT ROWID;
