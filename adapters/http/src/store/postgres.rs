//! PostgreSQL: the `txinbox.http_idempotency` table.

use std::time::Duration;

use txinbox::sqlx::{self, postgres::PgConnection, PgPool, Postgres, Transaction};

use super::{Claimed, Failure, Response, Scope, Stored};

/// `BEGIN; SET LOCAL lock_timeout` in one round trip.
pub(crate) async fn begin(
    pool: &PgPool,
    lock_wait: Duration,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let begin = format!(
        "BEGIN; SET LOCAL lock_timeout = '{}ms'",
        lock_wait.as_millis().max(1)
    );
    pool.begin_with(sqlx::AssertSqlSafe(begin)).await
}

/// The claim: the first statement of the request's transaction and the deduplication
/// decision. Returns a row only when this transaction inserted the key.
///
/// NOTE: a concurrent request with the same key blocks on the primary key until the first
/// transaction ends (bounded by `lock_timeout`); in READ COMMITTED it then sees the committed
/// row (no row returned: replay or 422) or, after a rollback, inserts (runs the handler).
/// `DO NOTHING`, not `DO UPDATE`: replays of a committed key take no row lock, so they do not
/// queue behind each other.
const CLAIM: &str = "\
INSERT INTO txinbox.http_idempotency (principal, route, idempotency_key, fingerprint, expires_at)
VALUES ($1, $2, $3, $4, now() + $5 * interval '1 millisecond')
ON CONFLICT (principal, route, idempotency_key) DO NOTHING
RETURNING 1";

/// Takes over an expired record (the key is new again). A concurrent takeover blocks on the
/// row lock, then re-checks the expiry on the committed row and takes nothing.
const TAKE_OVER: &str = "\
UPDATE txinbox.http_idempotency
SET fingerprint = $4, status = 0, header_names = '{}', header_values = '{}', body = NULL,
    body_size = 0, created_at = now(), expires_at = now() + $5 * interval '1 millisecond'
WHERE principal = $1 AND route = $2 AND idempotency_key = $3 AND expires_at <= now()
RETURNING 1";

const READ: &str = "\
SELECT fingerprint, status, header_names, header_values, body, expires_at <= now()
FROM txinbox.http_idempotency
WHERE principal = $1 AND route = $2 AND idempotency_key = $3";

/// Writes the response into the claimed row, just before COMMIT. It doubles as the check that
/// the transaction is still alive: after a failed statement the handler ignored, PostgreSQL
/// refuses it (25P02) instead of letting COMMIT roll back silently.
const STORE: &str = "\
UPDATE txinbox.http_idempotency
SET status = $4, header_names = $5, header_values = $6, body = $7, body_size = $8
WHERE principal = $1 AND route = $2 AND idempotency_key = $3 AND status = 0
RETURNING 1";

pub(crate) async fn claim(
    conn: &mut PgConnection,
    s: &Scope<'_>,
    fingerprint: &[u8; 32],
    ttl: Duration,
) -> Result<Claimed, sqlx::Error> {
    let ttl_ms = ttl.as_millis().min(i64::MAX as u128) as f64;
    for _ in 0..3 {
        let inserted: Option<i32> = sqlx::query_scalar(CLAIM)
            .bind(s.principal)
            .bind(s.route)
            .bind(s.key)
            .bind(&fingerprint[..])
            .bind(ttl_ms)
            .fetch_optional(&mut *conn)
            .await?;
        if inserted.is_some() {
            return Ok(Claimed::New);
        }
        // A new statement, so a new snapshot that sees the row that blocked the insert.
        type Row = (Vec<u8>, i16, Vec<String>, Vec<Vec<u8>>, Option<Vec<u8>>, bool);
        let row: Option<Row> = sqlx::query_as(READ)
            .bind(s.principal)
            .bind(s.route)
            .bind(s.key)
            .fetch_optional(&mut *conn)
            .await?;
        match row {
            None => continue, // purged meanwhile: insert again
            Some((fingerprint, status, header_names, header_values, body, false)) => {
                return Ok(Claimed::Existing(Stored {
                    fingerprint,
                    status,
                    header_names,
                    header_values,
                    body,
                }))
            }
            Some((.., true)) => {
                let taken: Option<i32> = sqlx::query_scalar(TAKE_OVER)
                    .bind(s.principal)
                    .bind(s.route)
                    .bind(s.key)
                    .bind(&fingerprint[..])
                    .bind(ttl_ms)
                    .fetch_optional(&mut *conn)
                    .await?;
                if taken.is_some() {
                    return Ok(Claimed::New);
                }
            }
        }
    }
    Ok(Claimed::Unsettled)
}

pub(crate) async fn store(
    conn: &mut PgConnection,
    s: &Scope<'_>,
    r: &Response<'_>,
) -> Result<bool, sqlx::Error> {
    let row: Option<i32> = sqlx::query_scalar(STORE)
        .bind(s.principal)
        .bind(s.route)
        .bind(s.key)
        .bind(r.status as i16)
        .bind(&r.header_names)
        .bind(&r.header_values)
        .bind(r.body)
        .bind(r.body_size)
        .fetch_optional(conn)
        .await?;
    Ok(row.is_some())
}

/// How a PostgreSQL error answers the client. A lost lock conflict (lock wait, deadlock,
/// serialization failure) is decided by [`txinbox::store::is_lock_conflict`] and an outage
/// (the database unreachable, refusing connections, shutting down, the session ended) by
/// [`txinbox::store::is_unavailable`], as for the inbox and the relay: the first is not reported
/// as an outage, the second answers 503 with `Retry-After`, never 500.
pub(crate) fn classify(e: &sqlx::Error) -> Failure {
    if txinbox::store::is_lock_conflict(e) {
        return Failure::LockWait;
    }
    if txinbox::store::is_unavailable(e) {
        return Failure::Unavailable;
    }
    match e.as_database_error().and_then(|db| db.code()).as_deref() {
        Some("25P02") => Failure::Aborted,
        // The database is up but could not serve this in time: retry later too (503).
        Some(
            "57014" // query_canceled (statement_timeout)
            | "25P03", // idle_in_transaction_session_timeout
        ) => Failure::Unavailable,
        _ => Failure::Fatal,
    }
}

/// Deletes up to `batch` expired idempotency records in one statement; returns how many.
/// A record being re-claimed right now is locked (skipped) and gets a new expiry; the outer
/// condition re-checks the expiry of each row it deletes.
pub(crate) async fn purge_batch(pool: &PgPool, batch: i64) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(
        "DELETE FROM txinbox.http_idempotency AS h
         WHERE (h.principal, h.route, h.idempotency_key) IN (
             SELECT principal, route, idempotency_key FROM txinbox.http_idempotency
             WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED)
           AND h.expires_at <= now()",
    )
    .bind(batch.max(1))
    .execute(pool)
    .await?
    .rows_affected())
}

/// Seconds since the earliest expiry (along `http_idempotency_expires_idx`), `None` when no
/// record has expired.
pub(crate) async fn overdue(pool: &PgPool) -> Result<Option<f64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(expires_at))::float8
         FROM txinbox.http_idempotency WHERE expires_at <= now()",
    )
    .fetch_one(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real PostgreSQL error with SQLSTATE `code`.
    async fn error_with(pool: &PgPool, code: &str) -> sqlx::Error {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DO $$ BEGIN RAISE EXCEPTION 'test' USING ERRCODE = '{code}'; END $$"
        )))
        .execute(pool)
        .await
        .expect_err("raised")
    }

    /// A lost lock conflict is contention, as txinbox's stores see it, not an unavailable
    /// database: a deadlock or a serialization failure answers like a lock wait (409, retry
    /// later), never "the database is unavailable" with a WARN for an outage.
    #[tokio::test]
    async fn lock_conflicts_are_contention_not_an_outage() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let pool = PgPool::connect(&url).await.expect("DATABASE_URL");
        for code in ["40001", "40P01", "55P03"] {
            let e = error_with(&pool, code).await;
            assert_eq!(classify(&e), Failure::LockWait, "{code}");
        }
        assert_eq!(classify(&error_with(&pool, "57P01").await), Failure::Unavailable);
        // A statement's 55000 (object not in prerequisite state) is the statement's own; only a
        // refused connection's (fatal) is an outage.
        assert_eq!(classify(&error_with(&pool, "55000").await), Failure::Fatal);
        assert_eq!(classify(&error_with(&pool, "25P02").await), Failure::Aborted);
        assert_eq!(classify(&error_with(&pool, "23505").await), Failure::Fatal);
    }
}
