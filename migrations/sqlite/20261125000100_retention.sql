-- What `txinbox purge` deleted up to, per consumer (see PostgreSQL's `txinbox.retention`, from
-- its `operations` migration): inbox rows that became terminal before `purged_before` may be
-- gone, so a redelivery of such a message would no longer be recognised as a duplicate.
-- `txinbox status` shows it, `txinbox replay` refuses to start before it. Times are Unix
-- milliseconds.
CREATE TABLE txinbox_retention (
    consumer      TEXT    PRIMARY KEY,
    purged_before INTEGER NOT NULL,
    purged_at     INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    rows_purged   INTEGER NOT NULL DEFAULT 0
);
