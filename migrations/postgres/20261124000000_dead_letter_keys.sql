-- Dead letters become idempotent, and say when their stored payload is not the whole message.
--
-- 1. A dead letter is recorded once per consumer, source position (Kafka topic, partition,
--    offset) and payload (SHA-256), and a conflict once per consumer, message ID and
--    fingerprint, while it is pending (neither requeued nor discarded). A restart or replay
--    that reads a dead-lettered record again finds the existing row instead of adding another;
--    another record at the same offset (a topic created again, a mirrored cluster) is
--    recorded too.
-- 2. Stored payloads are capped (ConsumerBuilder::dead_letter_payload_limit): `payload_size` and
--    `payload_sha256` describe the message as received, `truncated` says that the stored
--    payload or headers are a cut-down copy. NULL in rows written before this migration,
--    which stored everything.
-- 3. `txinbox.subscriptions`: which broker subscription (the Kafka consumer group) each consumer
--    name reads a source with, recorded by the source when it is assigned partitions. The
--    `txinbox` CLI reads the group from here; a second group under the same consumer name is
--    refused (both would share one inbox and skip each other's messages as duplicates).

ALTER TABLE txinbox.dead_letters
    ADD COLUMN payload_size   bigint,
    ADD COLUMN payload_sha256 bytea CHECK (octet_length(payload_sha256) = 32),
    ADD COLUMN truncated      boolean NOT NULL DEFAULT false;

-- Rows written before this migration stored the whole payload: their size and hash are known.
UPDATE txinbox.dead_letters
SET payload_size = octet_length(payload), payload_sha256 = sha256(payload);

-- Rows recorded twice before this migration (same position, same payload): keep the oldest
-- pending one, mark the others discarded (they stay, as every dead letter does).
UPDATE txinbox.dead_letters d
SET discarded_at = now(),
    discard_reason = 'duplicate of dead letter ' || k.keep || ' (merged by migration 20261124000000)'
FROM (SELECT id, min(id) OVER (PARTITION BY consumer, source_system, destination, source_partition, source_offset, payload_sha256) AS keep
      FROM txinbox.dead_letters
      WHERE source_offset IS NOT NULL AND requeued_at IS NULL AND discarded_at IS NULL) k
WHERE d.id = k.id AND k.id <> k.keep;

UPDATE txinbox.dead_letters d
SET discarded_at = now(),
    discard_reason = 'duplicate of dead letter ' || k.keep || ' (merged by migration 20261124000000)'
FROM (SELECT id, min(id) OVER (PARTITION BY consumer, message_id, fingerprint) AS keep
      FROM txinbox.dead_letters
      WHERE reason = 'conflict' AND message_id IS NOT NULL AND fingerprint IS NOT NULL
        AND requeued_at IS NULL AND discarded_at IS NULL) k
WHERE d.id = k.id AND k.id <> k.keep;

CREATE UNIQUE INDEX dead_letters_position_key ON txinbox.dead_letters
    (consumer, source_system, destination, source_partition, source_offset, payload_sha256)
    WHERE source_offset IS NOT NULL AND requeued_at IS NULL AND discarded_at IS NULL;

CREATE UNIQUE INDEX dead_letters_conflict_key ON txinbox.dead_letters (consumer, message_id, fingerprint)
    WHERE reason = 'conflict' AND requeued_at IS NULL AND discarded_at IS NULL;

CREATE TABLE txinbox.subscriptions (
    consumer        text        NOT NULL,
    source_system   text        NOT NULL,
    source          text        NOT NULL,
    subscription    text        NOT NULL,
    first_seen_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, source_system, source)
);
