//! SQLite: the `txinbox_http_idempotency` table (times in Unix milliseconds, headers in one
//! length-prefixed BLOB).

use std::time::Duration;

use txinbox::sqlx::{self, sqlite::SqliteConnection, Sqlite, SqlitePool, Transaction};

use super::{Claimed, Failure, Response, Scope, Stored};

const NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// One writer at a time: the write lock is taken up front, so the claim is the serialisation
/// point and no lock upgrade can deadlock (as `SqliteInbox` does).
pub(crate) async fn begin(pool: &SqlitePool) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
    pool.begin_with("BEGIN IMMEDIATE").await
}

pub(crate) async fn claim(
    conn: &mut SqliteConnection,
    s: &Scope<'_>,
    fingerprint: &[u8; 32],
    ttl: Duration,
) -> Result<Claimed, sqlx::Error> {
    let ttl_ms = ttl.as_millis().min(i64::MAX as u128 / 2) as i64;
    let claim = format!(
        "INSERT INTO txinbox_http_idempotency (principal, route, idempotency_key, fingerprint, expires_at)
         VALUES (?1, ?2, ?3, ?4, {NOW_MS} + ?5)
         ON CONFLICT (principal, route, idempotency_key) DO NOTHING
         RETURNING 1"
    );
    let read = format!(
        "SELECT fingerprint, status, headers, body, expires_at <= {NOW_MS}
         FROM txinbox_http_idempotency
         WHERE principal = ?1 AND route = ?2 AND idempotency_key = ?3"
    );
    let take_over = format!(
        "UPDATE txinbox_http_idempotency
         SET fingerprint = ?4, status = 0, headers = X'', body = NULL, body_size = 0,
             created_at = {NOW_MS}, expires_at = {NOW_MS} + ?5
         WHERE principal = ?1 AND route = ?2 AND idempotency_key = ?3 AND expires_at <= {NOW_MS}
         RETURNING 1"
    );
    for _ in 0..3 {
        let inserted: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(claim.clone()))
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
        type Row = (Vec<u8>, i64, Vec<u8>, Option<Vec<u8>>, bool);
        let row: Option<Row> = sqlx::query_as(sqlx::AssertSqlSafe(read.clone()))
            .bind(s.principal)
            .bind(s.route)
            .bind(s.key)
            .fetch_optional(&mut *conn)
            .await?;
        match row {
            None => continue,
            Some((fingerprint, status, headers, body, false)) => {
                let (header_names, header_values) = decode_headers(&headers);
                return Ok(Claimed::Existing(Stored {
                    fingerprint,
                    status: status as i16,
                    header_names,
                    header_values,
                    body,
                }));
            }
            Some((.., true)) => {
                let taken: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(take_over.clone()))
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
    conn: &mut SqliteConnection,
    s: &Scope<'_>,
    r: &Response<'_>,
) -> Result<bool, sqlx::Error> {
    let row: Option<i64> = sqlx::query_scalar(
        "UPDATE txinbox_http_idempotency SET status = ?4, headers = ?5, body = ?6, body_size = ?7
         WHERE principal = ?1 AND route = ?2 AND idempotency_key = ?3 AND status = 0
         RETURNING 1",
    )
    .bind(s.principal)
    .bind(s.route)
    .bind(s.key)
    .bind(r.status as i64)
    .bind(encode_headers(&r.header_names, &r.header_values))
    .bind(r.body)
    .bind(r.body_size)
    .fetch_optional(conn)
    .await?;
    Ok(row.is_some())
}

/// `u32 BE name length ‖ name ‖ u32 BE value length ‖ value`, repeated.
fn encode_headers(names: &[&str], values: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (n, v) in names.iter().zip(values) {
        out.extend_from_slice(&(n.len() as u32).to_be_bytes());
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(&(v.len() as u32).to_be_bytes());
        out.extend_from_slice(v);
    }
    out
}

fn decode_headers(mut b: &[u8]) -> (Vec<String>, Vec<Vec<u8>>) {
    fn take<'a>(b: &mut &'a [u8]) -> Option<&'a [u8]> {
        let len = u32::from_be_bytes(b.get(..4)?.try_into().ok()?) as usize;
        let part = b.get(4..4 + len)?;
        *b = &b[4 + len..];
        Some(part)
    }
    let (mut names, mut values) = (Vec::new(), Vec::new());
    while let (Some(n), Some(v)) = (take(&mut b), take(&mut b)) {
        names.push(String::from_utf8_lossy(n).into_owned());
        values.push(v.to_vec());
    }
    (names, values)
}

/// How a SQLite error answers the client: an outage ([`txinbox::store::is_unavailable`]: I/O, a
/// file that cannot be opened, disk full, a pool timeout) and a lost lock conflict
/// ([`txinbox::store::is_lock_conflict`]: `SQLITE_BUSY`, `SQLITE_LOCKED`) both answer 503: the
/// lock is the whole database's (`BEGIN IMMEDIATE`), not the key's, so a 409 "this key is in
/// flight" would not be true.
pub(crate) fn classify(e: &sqlx::Error) -> Failure {
    if txinbox::store::is_unavailable(e) || txinbox::store::is_lock_conflict(e) {
        Failure::Unavailable
    } else {
        Failure::Fatal
    }
}

/// Deletes up to `batch` expired idempotency records in one statement; returns how many.
pub(crate) async fn purge_batch(pool: &SqlitePool, batch: i64) -> Result<u64, sqlx::Error> {
    let delete = format!(
        "DELETE FROM txinbox_http_idempotency
         WHERE (principal, route, idempotency_key) IN (
             SELECT principal, route, idempotency_key FROM txinbox_http_idempotency
             WHERE expires_at <= {NOW_MS} LIMIT ?1)
           AND expires_at <= {NOW_MS}"
    );
    Ok(sqlx::query(sqlx::AssertSqlSafe(delete))
        .bind(batch.max(1))
        .execute(pool)
        .await?
        .rows_affected())
}

/// Seconds since the earliest expiry, `None` when no record has expired.
pub(crate) async fn overdue(pool: &SqlitePool) -> Result<Option<f64>, sqlx::Error> {
    let sql = format!(
        "SELECT ({NOW_MS} - min(expires_at)) / 1000.0 FROM txinbox_http_idempotency WHERE expires_at <= {NOW_MS}"
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await
}

#[cfg(test)]
mod tests {
    #[test]
    fn headers_round_trip() {
        let enc = super::encode_headers(&["content-type", "location"], &[b"a/b", b"/x"]);
        let (n, v) = super::decode_headers(&enc);
        assert_eq!(n, ["content-type", "location"]);
        assert_eq!(v, [b"a/b".to_vec(), b"/x".to_vec()]);
        assert_eq!(super::decode_headers(&[]), (vec![], vec![]));
    }
}
