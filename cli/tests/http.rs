//! `txinbox http purge`: expired HTTP Idempotency-Key records (txinbox-http) are deleted, after
//! the count and a confirmation; live ones never. Against real PostgreSQL (`DATABASE_URL`).

mod support;

use support::*;

async fn records(db: &TestDb) -> (i64, i64) {
    (
        db.scalar("SELECT count(*) FROM txinbox.http_idempotency WHERE expires_at <= now()")
            .await,
        db.scalar("SELECT count(*) FROM txinbox.http_idempotency WHERE expires_at > now()")
            .await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_purge_deletes_only_expired_keys_after_the_count_and_a_confirmation() {
    let db = TestDb::new().await;
    db.exec(
        "INSERT INTO txinbox.http_idempotency (principal, route, idempotency_key, fingerprint, status, body, body_size, expires_at)
         SELECT 'tenant-a', '/payments', 'k-' || i, sha256(i::text::bytea), 201, 'ok', 2,
                CASE WHEN i <= 3 THEN now() - interval '1 hour' ELSE now() + interval '1 day' END
         FROM generate_series(1, 5) AS i",
    )
    .await;
    assert_eq!(records(&db).await, (3, 2));

    let dry = txinbox(&db.url, None, &["--json", "http", "purge", "--dry-run"])
        .await
        .ok();
    assert_eq!(dry["expired"], 3, "{dry:#}");
    assert_eq!(dry["deleted"], 0, "{dry:#}");
    assert_eq!(records(&db).await, (3, 2), "a dry run deletes nothing");

    let unconfirmed = txinbox(&db.url, None, &["http", "purge"]).await;
    assert_eq!(unconfirmed.code, 1, "{unconfirmed:?}");
    assert!(
        unconfirmed.stderr.contains("3 expired"),
        "the count first: {unconfirmed:?}"
    );
    assert!(unconfirmed.stderr.contains("--yes"), "{unconfirmed:?}");
    assert_eq!(records(&db).await, (3, 2), "not confirmed, nothing deleted");

    let done = txinbox(&db.url, None, &["--json", "http", "purge", "--yes"])
        .await
        .ok();
    assert_eq!(done["deleted"], 3, "{done:#}");
    assert_eq!(records(&db).await, (0, 2), "live keys stay");
}
