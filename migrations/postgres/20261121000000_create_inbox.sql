-- txinbox: inbox, dead letters and source positions, in their own schema.
-- The migration ledger lives beside them (txinbox._sqlx_migrations), never in the
-- application's public._sqlx_migrations. Migrations are additive only.

CREATE SCHEMA IF NOT EXISTS txinbox;

-- One row per (consumer, message ID). Inserted as 'processed' in the same transaction as the
-- handler's effects; left 'retrying' by a failed attempt (counted in its own short
-- transaction); 'dead_lettered' once dead-lettered.
CREATE TABLE txinbox.inbox (
    consumer        text        NOT NULL,
    message_id      text        NOT NULL,
    id_strategy     text        NOT NULL,
    fingerprint     bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    status          text        NOT NULL CHECK (status IN ('processed', 'retrying', 'dead_lettered')),
    attempts        integer     NOT NULL CHECK (attempts >= 0),
    first_seen_at   timestamptz NOT NULL DEFAULT now(),
    processed_at    timestamptz,
    last_error      text,
    source_system   text        NOT NULL,
    destination     text        NOT NULL,
    source_partition integer,
    source_offset   bigint,
    PRIMARY KEY (consumer, message_id)
);

-- Retention (purging terminal rows older than a window) scans by consumer and age.
CREATE INDEX inbox_processed_at_idx ON txinbox.inbox (consumer, processed_at)
    WHERE status <> 'retrying';

-- Dead letters keep the original message so nothing is lost and it can be requeued.
CREATE TABLE txinbox.dead_letters (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer        text        NOT NULL,
    message_id      text,
    id_strategy     text,
    fingerprint     bytea,
    reason          text        NOT NULL,
    error           text        NOT NULL,
    attempts        integer     NOT NULL,
    payload         bytea       NOT NULL,
    headers         jsonb       NOT NULL,
    source_system   text        NOT NULL,
    destination     text        NOT NULL,
    source_partition integer,
    source_offset   bigint,
    dead_lettered_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX dead_letters_consumer_idx ON txinbox.dead_letters (consumer, dead_lettered_at);
CREATE INDEX dead_letters_message_idx ON txinbox.dead_letters (consumer, message_id);

-- Where each consumer resumes in each lane of each source (Kafka: topic, partition, next
-- offset). Updated in the same transaction as the effects.
CREATE TABLE txinbox.positions (
    consumer        text        NOT NULL,
    source          text        NOT NULL,
    lane            text        NOT NULL,
    next_position   bigint      NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, source, lane)
);
