-- Bookkeeping for the `txinbox` operations CLI.

-- What `txinbox purge` deleted up to, per consumer: inbox rows that reached a terminal status
-- before `purged_before` may be gone, so a redelivery of such a message would no longer be
-- recognised as a duplicate. `txinbox replay` refuses to start before this horizon.
CREATE TABLE txinbox.retention (
    consumer        text        PRIMARY KEY,
    purged_before   timestamptz NOT NULL,
    purged_at       timestamptz NOT NULL DEFAULT now(),
    rows_purged     bigint      NOT NULL DEFAULT 0
);

-- What operators did with a dead letter. Rows are kept (an audit trail); a dead letter is
-- pending while both timestamps are NULL.
ALTER TABLE txinbox.dead_letters
    ADD COLUMN requeued_at    timestamptz,
    ADD COLUMN requeue_count  integer     NOT NULL DEFAULT 0,
    ADD COLUMN discarded_at   timestamptz,
    ADD COLUMN discard_reason text;
