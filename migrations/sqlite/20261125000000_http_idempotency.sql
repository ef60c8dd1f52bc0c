-- txinbox-http on SQLite: HTTP Idempotency-Key records (see the PostgreSQL migration of the
-- same name). Times are Unix milliseconds; the stored headers are one BLOB of
-- length-prefixed (name, value) pairs. `status` is 0 only inside the claiming transaction.
CREATE TABLE txinbox_http_idempotency (
    principal       TEXT    NOT NULL,
    route           TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL CHECK (length(idempotency_key) BETWEEN 1 AND 255),
    fingerprint     BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    status          INTEGER NOT NULL DEFAULT 0,
    headers         BLOB    NOT NULL DEFAULT X'',
    body            BLOB,
    body_size       INTEGER NOT NULL DEFAULT 0,
    created_at      INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    expires_at      INTEGER NOT NULL,
    PRIMARY KEY (principal, route, idempotency_key)
);

CREATE INDEX txinbox_http_idempotency_expires_idx ON txinbox_http_idempotency (expires_at);
