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
                 SELECT status = 'processed' AND xmin = pg_current_xact_id_if_assigned()::xid FROM txinbox.inbox WHERE consumer = 'pgbench' AND message_id = (SELECT 'pgb-' || currval('bench_pgb_seq'));\n\
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

impl Bench {
    /// The consumer's own transactions written by hand, no runtime in between:
    /// `concurrency` tasks for `pgbench_seconds`, each transaction the store's `begin`, its
    /// claim (`claim` or `claim_batch`: the values bound, arrays for a batch), the effect (the
    /// benchmark handler's statement), its check before COMMIT (`confirm_batch`) and `commit`,
    /// on the run's pool. Against `pgbench … _like` (the same statements through libpq, values
    /// generated on the server) this row is what sqlx and bound values cost; against memory's
    /// row, what the runtime adds to them.
    pub(crate) async fn sqlx_like(&self, batch: usize) -> anyhow::Result<Row> {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        use txinbox::store::{Entry, InboxStore};
        use txinbox::{sqlx, IdStrategy, Message, MessageId};

        let consumer: Arc<str> = format!("sqlx-{batch}-{}", self.run_id).into();
        let committed = Arc::new(AtomicU64::new(0));
        let until = Instant::now() + Duration::from_secs(self.args.pgbench_seconds.into());
        let meter = CpuMeter::start();
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..self.args.concurrency {
            let (inbox, consumer, committed) = (self.inbox(), consumer.clone(), committed.clone());
            tasks.spawn(async move {
                let mut n = 0u64;
                while Instant::now() < until {
                    // What the runtime derives for each delivery: the ID and the payload's
                    // fingerprint (a SHA-256), built before the transaction as it builds them.
                    let messages: Vec<(Message, MessageId, [u8; 32])> = (0..batch)
                        .map(|i| {
                            let msg = Message::new(
                                crate::publish::payload(n * batch as u64 + i as u64),
                                txinbox::message::Origin::new("memory", "bench"),
                            )
                            .with_native_id(format!("s-{task}-{n}-{i}"));
                            let id = IdStrategy::Native.derive(&msg).expect("a native ID");
                            let fingerprint = txinbox::message::Fingerprint::PayloadBytes.of(&msg);
                            (msg, id, fingerprint)
                        })
                        .collect();
                    n += 1;
                    let entries: Vec<Entry<'_>> = messages
                        .iter()
                        .map(|(msg, id, fingerprint)| Entry {
                            consumer: &consumer,
                            id,
                            fingerprint,
                            origin: msg.origin(),
                        })
                        .collect();
                    let mut tx = inbox.begin().await?;
                    if batch == 1 {
                        inbox.claim(&mut tx, &entries[0]).await?;
                        sqlx::query("INSERT INTO bench_effects (message_id, bytes) VALUES ($1, $2)")
                            .bind(entries[0].id.as_str())
                            .bind(messages[0].0.payload().len() as i64)
                            .execute(&mut *tx)
                            .await?;
                    } else {
                        inbox.claim_batch(&mut tx, &entries).await?;
                        let ids: Vec<&str> = entries.iter().map(|e| e.id.as_str()).collect();
                        let sizes: Vec<i64> =
                            messages.iter().map(|(m, ..)| m.payload().len() as i64).collect();
                        sqlx::query(
                            "INSERT INTO bench_effects (message_id, bytes) SELECT * FROM UNNEST($1::text[], $2::int8[])",
                        )
                        .bind(ids)
                        .bind(sizes)
                        .execute(&mut *tx)
                        .await?;
                    }
                    anyhow::ensure!(inbox.confirm_batch(&mut tx, &entries).await?, "the claim is not held");
                    inbox.commit(tx).await?;
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
                "{batch} inbox + {batch} effect rows per transaction, txinbox's statements by hand (the store's calls, no runtime) from {} tasks, {}s",
                self.args.concurrency, self.args.pgbench_seconds
            ),
        })
    }
}
