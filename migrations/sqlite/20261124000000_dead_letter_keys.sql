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

UPDATE txinbox_dead_letters
SET discarded_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    discard_reason = 'duplicate of dead letter ' || (
        SELECT min(k.id) FROM txinbox_dead_letters k
        WHERE k.consumer = txinbox_dead_letters.consumer AND k.source_system = txinbox_dead_letters.source_system
          AND k.destination = txinbox_dead_letters.destination
          AND k.source_partition IS txinbox_dead_letters.source_partition
          AND k.source_offset = txinbox_dead_letters.source_offset) || ' (merged by migration 20261124000000)'
WHERE source_offset IS NOT NULL
  AND id > (SELECT min(k.id) FROM txinbox_dead_letters k
            WHERE k.consumer = txinbox_dead_letters.consumer AND k.source_system = txinbox_dead_letters.source_system
              AND k.destination = txinbox_dead_letters.destination
              AND k.source_partition IS txinbox_dead_letters.source_partition
              AND k.source_offset = txinbox_dead_letters.source_offset);

UPDATE txinbox_dead_letters
SET discarded_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    discard_reason = 'duplicate of dead letter ' || (
        SELECT min(k.id) FROM txinbox_dead_letters k
        WHERE k.reason = 'conflict' AND k.consumer = txinbox_dead_letters.consumer
          AND k.message_id = txinbox_dead_letters.message_id AND k.fingerprint = txinbox_dead_letters.fingerprint
          AND k.discarded_at IS NULL) || ' (merged by migration 20261124000000)'
WHERE reason = 'conflict' AND message_id IS NOT NULL AND fingerprint IS NOT NULL AND discarded_at IS NULL
  AND id > (SELECT min(k.id) FROM txinbox_dead_letters k
            WHERE k.reason = 'conflict' AND k.consumer = txinbox_dead_letters.consumer
              AND k.message_id = txinbox_dead_letters.message_id AND k.fingerprint = txinbox_dead_letters.fingerprint
              AND k.discarded_at IS NULL);

CREATE UNIQUE INDEX txinbox_dead_letters_position_key ON txinbox_dead_letters
    (consumer, source_system, destination, source_partition, source_offset)
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
