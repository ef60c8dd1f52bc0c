//! Migrations run on databases that already hold data: dead letters recorded twice before
//! dead letters had keys are merged only where they are the same record.

use std::borrow::Cow;

use sqlx::Executor as _;
use txinbox_testing::database::TestDatabase;

/// The migrations before `version`, then the rows `setup` writes, then every migration.
const KEYS: i64 = 20261124000000;

fn before(mut m: sqlx::migrate::Migrator, version: i64) -> sqlx::migrate::Migrator {
    m.migrations = Cow::Owned(
        m.migrations
            .iter()
            .filter(|x| x.version < version)
            .cloned()
            .collect(),
    );
    m
}

/// Old rows: offset 7 twice with one payload (a restart read it again), once with another
/// payload (another record at a reused offset), and offset 8 once.
const OLD_ROWS: [(i64, &[u8]); 4] = [
    (7, b"poison"),
    (7, b"poison"),
    (7, b"other record"),
    (8, b"poison"),
];

#[tokio::test]
async fn postgres_keys_merge_only_the_same_record_read_twice() {
    let db = TestDatabase::builder("txinbox_t_upgrade")
        .migrate(false)
        .inbox_timeouts(false)
        .create()
        .await;
    let pool = db.pool().clone();
    before(txinbox::postgres::migrator(), KEYS)
        .run(&pool)
        .await
        .unwrap();
    for (offset, payload) in OLD_ROWS {
        sqlx::query(
            "INSERT INTO txinbox.dead_letters (consumer, reason, error, attempts, payload, headers,
                 source_system, destination, source_partition, source_offset)
             VALUES ('c', 'undecodable', 'e', 0, $1, '{}', 'kafka', 't', 0, $2)",
        )
        .bind(payload)
        .bind(offset)
        .execute(&pool)
        .await
        .unwrap();
    }
    txinbox::postgres::migrate(&pool).await.unwrap();
    let rows: Vec<(i64, Vec<u8>, Option<i64>, bool)> = sqlx::query_as(
        "SELECT source_offset, payload, payload_size, discarded_at IS NOT NULL
         FROM txinbox.dead_letters ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            (7, b"poison".to_vec(), Some(6), false),
            (7, b"poison".to_vec(), Some(6), true),
            (7, b"other record".to_vec(), Some(12), false),
            (8, b"poison".to_vec(), Some(6), false),
        ]
    );
    let hashed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM txinbox.dead_letters WHERE payload_sha256 = sha256(payload)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        hashed, 4,
        "old rows get the hash of the payload they stored whole"
    );
    drop(pool);
    db.drop_database().await;
}

#[tokio::test]
async fn sqlite_keys_merge_only_the_same_record_read_twice_in_one_pass() {
    let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
    before(txinbox::sqlite::migrator(), KEYS)
        .run(&pool)
        .await
        .unwrap();
    for (offset, payload) in OLD_ROWS {
        sqlx::query(
            "INSERT INTO txinbox_dead_letters (consumer, reason, error, attempts, payload, headers,
                 source_system, destination, source_partition, source_offset)
             VALUES ('c', 'undecodable', 'e', 0, ?1, '{}', 'kafka', 't', 0, ?2)",
        )
        .bind(payload)
        .bind(offset)
        .execute(&pool)
        .await
        .unwrap();
    }
    // Enough rows that a quadratic migration would show (20,000 took 87 s before).
    pool.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
         INSERT INTO txinbox_dead_letters (consumer, reason, error, attempts, payload, headers,
             source_system, destination, source_partition, source_offset)
         SELECT 'bulk', 'undecodable', 'e', 0, x'00', '{}', 'kafka', 't', 0, i / 2 FROM n",
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    txinbox::sqlite::migrator().run(&pool).await.unwrap();
    let took = started.elapsed();
    let rows: Vec<(i64, Vec<u8>, Option<i64>, bool)> = sqlx::query_as(
        "SELECT source_offset, payload, payload_size, discarded_at IS NOT NULL
         FROM txinbox_dead_letters WHERE consumer = 'c' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            (7, b"poison".to_vec(), Some(6), false),
            (7, b"poison".to_vec(), Some(6), true),
            (7, b"other record".to_vec(), Some(12), false),
            (8, b"poison".to_vec(), Some(6), false),
        ]
    );
    let pending: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM txinbox_dead_letters WHERE consumer = 'bulk' AND discarded_at IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(pending, 10001, "one per offset 0..=10000");
    eprintln!("sqlite migration over 20,004 dead letters: {took:?}");
}
