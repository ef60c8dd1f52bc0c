-- txinbox: the transactional outbox (PostgreSQL only). Rows are written in the same
-- transaction as the effects that caused them; a relay publishes them at least once.

-- One row per message to publish. `message_id` is unique: writing the same ID again (a retried
-- handler deriving the same ID) is ignored. The ordering unit is (destination, key): the relay
-- publishes the rows of one unit in `id` order; rows without a key are unordered.
CREATE TABLE txinbox.outbox (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id      text        NOT NULL UNIQUE,
    destination     text        NOT NULL,
    message_key     bytea,
    payload         bytea       NOT NULL,
    header_names    text[]      NOT NULL DEFAULT '{}',
    header_values   bytea[]     NOT NULL DEFAULT '{}',
    status          text        NOT NULL DEFAULT 'pending'
                                CHECK (status IN ('pending', 'published', 'dead_lettered')),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    CHECK (cardinality(header_names) = cardinality(header_values))
);

-- The relay's claim: pending rows in order, and "is there an earlier pending row of my key".
CREATE INDEX outbox_pending_idx ON txinbox.outbox (id) WHERE status = 'pending';
CREATE INDEX outbox_pending_key_idx ON txinbox.outbox (destination, message_key, id)
    WHERE status = 'pending';
-- Retention deletes published rows by age.
CREATE INDEX outbox_published_idx ON txinbox.outbox (published_at) WHERE status = 'published';

-- Wakes relays (LISTEN txinbox_outbox) when a transaction that wrote outbox rows commits.
-- Once per statement; PostgreSQL folds identical notifications of one transaction into one.
CREATE FUNCTION txinbox.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('txinbox_outbox', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON txinbox.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION txinbox.outbox_notify();
