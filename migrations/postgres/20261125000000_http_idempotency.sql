-- txinbox-http: HTTP Idempotency-Key records, in the same schema as the inbox.
--
-- One row per (scope, key): the scope is the caller's principal and the matched route (see
-- txinbox-http). The row is inserted as the first statement of the request's transaction
-- (INSERT … ON CONFLICT DO NOTHING: the deduplication decision), the handler's effects run in
-- that transaction, and the response is written into the row just before COMMIT. So a
-- committed row always holds a response: there is no "in progress" state to recover after a
-- crash, and a concurrent duplicate blocks on the primary key until the first request ends.
-- `status` is 0 only inside the claiming transaction, never in a committed row.
CREATE TABLE txinbox.http_idempotency (
    principal       text        NOT NULL,
    route           text        NOT NULL,
    idempotency_key text        NOT NULL CHECK (char_length(idempotency_key) BETWEEN 1 AND 255),
    fingerprint     bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    status          smallint    NOT NULL DEFAULT 0,
    header_names    text[]      NOT NULL DEFAULT '{}',
    header_values   bytea[]     NOT NULL DEFAULT '{}',
    -- NULL when the response was stored as status and headers only (by explicit choice).
    body            bytea,
    body_size       bigint      NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (principal, route, idempotency_key),
    CHECK (cardinality(header_names) = cardinality(header_values))
);

-- Purging expired records scans by expiry.
CREATE INDEX http_idempotency_expires_idx ON txinbox.http_idempotency (expires_at);
