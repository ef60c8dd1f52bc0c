//! The pgbench rows: what PostgreSQL itself commits on this machine, at the same batch sizes.

use anyhow::{bail, Context as _};

use crate::bench::Bench;
use crate::measure::CpuMeter;
use crate::report::Row;

impl Bench {
    /// pgbench, `clients` connections for `seconds`, each transaction inserting `batch` inbox
    /// rows and `batch` effect rows: what PostgreSQL itself commits on this machine.
    ///
    /// `like_txinbox`: the statements the consumer sends instead of the least that inserts the
    /// same rows: its claim (`ON CONFLICT DO UPDATE … RETURNING`, rows in key order) and its
    /// check before COMMIT (a primary-key probe), one round trip more. The difference between
    /// the two pgbench rows is what the guarantee costs PostgreSQL; the difference between this
    /// one and the consumer's row is what the runtime costs. (The probe's key is a sub-select:
    /// `currval` is volatile, and compared directly it would make the probe a scan.)
    pub(crate) fn pgbench(&self, batch: usize, like_txinbox: bool) -> anyhow::Result<Row> {
        let script = if like_txinbox {
            format!(
                "BEGIN;\n\
                 INSERT INTO txinbox.inbox AS i (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at, source_system, destination) SELECT 'pgbench', 'pgb-' || nextval('bench_pgb_seq'), 'native', decode(repeat('00', 32), 'hex'), 'processed', 1, now(), 'memory', 'bench' FROM generate_series(1, {batch}) ORDER BY 2 ON CONFLICT (consumer, message_id) DO UPDATE SET status = 'processed', attempts = i.attempts + 1, processed_at = now() WHERE i.status = 'retrying' AND i.fingerprint = EXCLUDED.fingerprint RETURNING i.message_id, i.attempts;\n\
                 INSERT INTO bench_effects (message_id, bytes) SELECT 'pgb', g FROM generate_series(1, {batch}) g;\n\
                 SELECT status FROM txinbox.inbox WHERE consumer = 'pgbench' AND message_id = (SELECT 'pgb-' || currval('bench_pgb_seq'));\n\
                 COMMIT;\n"
            )
        } else {
            format!(
                "BEGIN;\n\
                 INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at, source_system, destination) SELECT 'pgbench', 'pgb-' || nextval('bench_pgb_seq'), 'native', decode(repeat('00', 32), 'hex'), 'processed', 1, now(), 'memory', 'bench' FROM generate_series(1, {batch}) ON CONFLICT (consumer, message_id) DO NOTHING;\n\
                 INSERT INTO bench_effects (message_id, bytes) SELECT 'pgb', g FROM generate_series(1, {batch}) g;\n\
                 COMMIT;\n"
            )
        };
        let path = std::env::temp_dir().join(format!(
            "txinbox-bench-{}-{batch}-{like_txinbox}.sql",
            self.run_id
        ));
        std::fs::write(&path, script)?;
        let clients = self.args.concurrency.to_string();
        let meter = CpuMeter::start();
        let out = std::process::Command::new("pgbench")
            .args(["-n", "-M", "prepared", "-c", &clients, "-j", "2", "-T"])
            .arg(self.args.pgbench_seconds.to_string())
            .arg("-f")
            .arg(&path)
            .arg(&self.url)
            .output()
            .context("running pgbench (is it installed? /usr/bin/pgbench)")?;
        let cpu = meter.and_then(CpuMeter::since);
        let _ = std::fs::remove_file(&path);
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!("pgbench failed: {text}{}", String::from_utf8_lossy(&out.stderr));
        }
        let field = |prefix: &str| -> Option<f64> {
            text.lines()
                .find(|l| l.starts_with(prefix))?
                .trim_start_matches(prefix)
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        let tps = field("tps = ").context("pgbench printed no tps")?;
        let latency = field("latency average = ");
        let transactions = field("number of transactions actually processed: ").unwrap_or(0.0);
        Ok(Row {
            source: "pgbench".into(),
            mode: match (batch == 1, like_txinbox) {
                (true, false) => "per_message",
                (false, false) => "batched",
                (true, true) => "per_message_like",
                (false, true) => "batched_like",
            },
            messages: transactions as u64 * batch as u64,
            msgs_per_sec: tps * batch as f64,
            p50_ms: None,
            p99_ms: None,
            peak_rss_mb: None,
            cpu,
            note: format!(
                "{batch} inbox + {batch} effect rows per transaction{}, -c {clients} -j 2 -M prepared, {}s; latency avg {} ms",
                if like_txinbox { ", txinbox's statements (claim, effect, check before COMMIT)" } else { "" },
                self.args.pgbench_seconds,
                latency.map_or("?".into(), |l| format!("{l:.2}"))
            ),
        })
    }
}

/// The consumer's claim, as `PostgresInbox` sends it for one message (`$1`..`$8`).
const CLAIM: &str = "\
INSERT INTO txinbox.inbox AS i
    (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at,
     source_system, destination, source_partition, source_offset)
VALUES ($1, $2, $3, $4, 'processed', 1, now(), $5, $6, $7, $8)
ON CONFLICT (consumer, message_id) DO UPDATE
    SET status = 'processed', attempts = i.attempts + 1, processed_at = now()
    WHERE i.status = 'retrying' AND i.fingerprint = EXCLUDED.fingerprint
RETURNING i.attempts";

/// The consumer's claim for a batch, as `PostgresInbox` sends it (`$1` consumer, `$2`..`$8`
/// arrays).
const CLAIM_BATCH: &str = "\
INSERT INTO txinbox.inbox AS i
    (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at,
     source_system, destination, source_partition, source_offset)
SELECT $1, t.message_id, t.id_strategy, t.fingerprint, 'processed', 1, now(),
       t.source_system, t.destination, t.source_partition, t.source_offset
FROM UNNEST($2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[], $7::int4[], $8::int8[])
    AS t(message_id, id_strategy, fingerprint, source_system, destination, source_partition, source_offset)
ORDER BY t.message_id
ON CONFLICT (consumer, message_id) DO UPDATE
    SET status = 'processed', attempts = i.attempts + 1, processed_at = now()
    WHERE i.status = 'retrying' AND i.fingerprint = EXCLUDED.fingerprint
RETURNING i.message_id, i.attempts";

/// The check before COMMIT, as `PostgresInbox::confirm` sends it.
const CONFIRM: &str = "SELECT status FROM txinbox.inbox WHERE consumer = $1 AND message_id = $2";

impl Bench {
    /// The consumer's own transactions written by hand with sqlx, no txinbox in between:
    /// `concurrency` tasks for `pgbench_seconds`, each transaction BEGIN, the claim with its
    /// values bound (arrays for a batch), the effect (the benchmark handler's statement), the
    /// check before COMMIT, COMMIT. Against `pgbench … _like` (the same statements through
    /// libpq, values generated on the server) this row is what the client library and the
    /// bound values cost; against memory's row, what the runtime adds to them.
    pub(crate) async fn sqlx_like(&self, batch: usize) -> anyhow::Result<Row> {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        use txinbox::sqlx;

        let consumer = format!("sqlx-{batch}-{}", self.run_id);
        let committed = Arc::new(AtomicU64::new(0));
        let until = Instant::now() + Duration::from_secs(self.args.pgbench_seconds.into());
        let fingerprint = vec![0u8; 32];
        let meter = CpuMeter::start();
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..self.args.concurrency {
            let (pool, consumer, committed, fingerprint) = (
                self.pool.clone(),
                consumer.clone(),
                committed.clone(),
                fingerprint.clone(),
            );
            tasks.spawn(async move {
                let mut n = 0u64;
                while Instant::now() < until {
                    let ids: Vec<String> = (0..batch).map(|i| format!("s-{task}-{n}-{i}")).collect();
                    n += 1;
                    let mut tx = pool.begin().await?;
                    if batch == 1 {
                        sqlx::query(CLAIM)
                            .bind(&consumer)
                            .bind(&ids[0])
                            .bind("native")
                            .bind(&fingerprint[..])
                            .bind("memory")
                            .bind("bench")
                            .bind(None::<i32>)
                            .bind(None::<i64>)
                            .fetch_optional(&mut *tx)
                            .await?;
                        sqlx::query("INSERT INTO bench_effects (message_id, bytes) VALUES ($1, $2)")
                            .bind(&ids[0])
                            .bind(64_i64)
                            .execute(&mut *tx)
                            .await?;
                    } else {
                        let same = |s: &'static str| vec![s; batch];
                        sqlx::query(CLAIM_BATCH)
                            .bind(&consumer)
                            .bind(&ids)
                            .bind(same("native"))
                            .bind(vec![fingerprint.clone(); batch])
                            .bind(same("memory"))
                            .bind(same("bench"))
                            .bind(vec![None::<i32>; batch])
                            .bind(vec![None::<i64>; batch])
                            .fetch_all(&mut *tx)
                            .await?;
                        sqlx::query(
                            "INSERT INTO bench_effects (message_id, bytes) SELECT * FROM UNNEST($1::text[], $2::int8[])",
                        )
                        .bind(&ids)
                        .bind(vec![64_i64; batch])
                        .execute(&mut *tx)
                        .await?;
                    }
                    let status: Option<String> = sqlx::query_scalar(CONFIRM)
                        .bind(&consumer)
                        .bind(&ids[0])
                        .fetch_optional(&mut *tx)
                        .await?;
                    anyhow::ensure!(status.as_deref() == Some("processed"), "the claim is not held");
                    tx.commit().await?;
                    committed.fetch_add(1, Ordering::Relaxed);
                }
                anyhow::Ok(())
            });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        let seconds = started.elapsed().as_secs_f64();
        let cpu = meter.and_then(CpuMeter::since);
        let transactions = committed.load(Ordering::Relaxed);
        Ok(Row {
            source: "sqlx".into(),
            mode: if batch == 1 { "per_message_like" } else { "batched_like" },
            messages: transactions * batch as u64,
            msgs_per_sec: (transactions * batch as u64) as f64 / seconds,
            p50_ms: None,
            p99_ms: None,
            peak_rss_mb: None,
            cpu,
            note: format!(
                "{batch} inbox + {batch} effect rows per transaction, txinbox's statements with bound values, by hand through sqlx from {} tasks, {}s",
                self.args.concurrency, self.args.pgbench_seconds
            ),
        })
    }
}
