//! What the inbox's retention costs on PostgreSQL (`cargo run --release --example
//! retention_bench`): an inbox of 10 M rows spread over 8 days, so with a 7-day window one day's
//! worth (1/8) is due; then consuming at full rate, rounds with the janitor off and on
//! alternating, side by side; then the janitor alone; then the table and index sizes and dead
//! tuples, before and after a VACUUM.
//!
//! ```text
//! createdb -h 127.0.0.1 -U postgres txinbox_retention_bench
//! cargo run --release --example retention_bench -- --rows 10000000 --fill-only
//! cargo run --release --example retention_bench -- --reuse --messages 150000
//! dropdb -h 127.0.0.1 -U postgres txinbox_retention_bench
//! ```
//!
//! The janitor is the consumer's own ([`txinbox::janitor::Janitor`] over
//! [`InboxSweep`](txinbox::ops::retention::InboxSweep), what `.retention(…)` builds), with the
//! default schedule unless told otherwise, wrapped to time each `DELETE`. Figures depend on the
//! machine and on what else it runs: compare rows of one run, not runs.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Executor, Postgres};
use txinbox::janitor::{Janitor, Schedule, Sweep};
use txinbox::memory::MemoryBroker;
use txinbox::ops::retention::InboxSweep;
use txinbox::ops::DbPool;
use txinbox::{async_trait, sqlx, Consumer, Context, Handler, HandlerError, Message};

#[derive(Parser, Debug)]
struct Args {
    /// A database of its own: it is filled and emptied.
    #[arg(
        long,
        env = "RETENTION_BENCH_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/txinbox_retention_bench"
    )]
    url: String,
    /// Inbox rows before the run, spread evenly over 8 days (1/8 older than the 7-day window).
    #[arg(long, default_value_t = 10_000_000)]
    rows: i64,
    /// Messages consumed per round.
    #[arg(long, default_value_t = 100_000)]
    messages: usize,
    /// Rounds per setting (off, on, off, on, …).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// How long the janitor runs alone at the end, in seconds (0: skip).
    #[arg(long, default_value_t = 20)]
    alone_secs: u64,
    /// Rows per DELETE.
    #[arg(long, default_value_t = txinbox::janitor::DEFAULT_BATCH)]
    batch: u32,
    /// Pause between DELETEs, in ms.
    #[arg(long, default_value_t = txinbox::janitor::DEFAULT_PAUSE.as_millis() as u64)]
    pause_ms: u64,
    /// Keep the rows already there (filled by `--fill-only`; after a measuring run fewer are due).
    #[arg(long)]
    reuse: bool,
    /// Fill the inbox and stop: the fill is long, the measurement needs the machine quiet.
    #[arg(long)]
    fill_only: bool,
}

const CONSUMER: &str = "bench";
const WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

/// One effect row per message, in the inbox's transaction.
struct Effects;

#[async_trait]
impl Handler<Postgres> for Effects {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let id = cx.message_id().as_str().to_owned();
        sqlx::query("INSERT INTO bench_effects (message_id, bytes) VALUES ($1, $2)")
            .bind(id)
            .bind(msg.payload().len() as i64)
            .execute(cx.db())
            .await?;
        Ok(())
    }
}

/// The inbox sweep, timing each DELETE.
struct Timed {
    inner: InboxSweep,
    batches: Arc<Mutex<Vec<Duration>>>,
}

#[async_trait]
impl Sweep for Timed {
    async fn start_pass(&self) -> Result<(), sqlx::Error> {
        self.inner.start_pass().await
    }
    async fn delete_batch(&self, batch: u32) -> Result<u64, sqlx::Error> {
        let started = Instant::now();
        let n = self.inner.delete_batch(batch).await?;
        self.batches.lock().unwrap().push(started.elapsed());
        Ok(n)
    }
    async fn oldest_age(&self) -> Result<Option<Duration>, sqlx::Error> {
        self.inner.oldest_age().await
    }
}

struct Bench {
    args: Args,
    pool: PgPool,
    batches: Arc<Mutex<Vec<Duration>>>,
}

impl Bench {
    fn janitor(&self) -> Janitor {
        let schedule = Schedule {
            batch: self.args.batch,
            pause: Duration::from_millis(self.args.pause_ms),
            ..Schedule::default()
        };
        let sweep = Timed {
            inner: InboxSweep::new(DbPool::Postgres(self.pool.clone()), CONSUMER, WINDOW)
                .expect("7 days passes the guard"),
            batches: self.batches.clone(),
        };
        Janitor::new(sweep, schedule, "inbox", Some(("consumer", CONSUMER))).expect("a valid schedule")
    }

    async fn purged(&self) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar::<_, i64>(
            "SELECT coalesce((SELECT rows_purged FROM txinbox.retention WHERE consumer = $1), 0)",
        )
        .bind(CONSUMER)
        .fetch_one(&self.pool)
        .await?)
    }

    /// Consumes `messages` at full rate, with or without the janitor beside it; returns
    /// (msg/s, rows deleted meanwhile, seconds).
    async fn round(&self, tag: &str, janitor: bool) -> anyhow::Result<(f64, i64, f64)> {
        let broker = MemoryBroker::new("bench");
        for i in 0..self.args.messages {
            broker.publish(format!("{tag}-{i}"), "{\"amount\":1}");
        }
        broker.close();
        let consumer = Consumer::builder(CONSUMER)
            .source(broker.source())
            .inbox(txinbox::PostgresInbox::new(self.pool.clone()))
            .handler(Effects)
            .concurrency(8)
            .build()?;
        let before = self.purged().await?;
        let started = Instant::now();
        let running = janitor.then(|| Arc::new(self.janitor()).spawn());
        tokio::spawn(consumer.run()).await??;
        let secs = started.elapsed().as_secs_f64();
        if let Some(running) = running {
            running.stop().await;
        }
        let deleted = self.purged().await? - before;
        Ok((self.args.messages as f64 / secs, deleted, secs))
    }

    async fn sizes(&self, when: &str) -> anyhow::Result<()> {
        // Statistics from other backends reach pg_stat_user_tables within about a second.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (table, pkey, by_age, live, dead): (i64, i64, i64, i64, i64) = sqlx::query_as(
            "SELECT pg_relation_size('txinbox.inbox'), pg_relation_size('txinbox.inbox_pkey'),
                    pg_relation_size('txinbox.inbox_processed_at_idx'),
                    (SELECT reltuples::bigint FROM pg_class WHERE oid = 'txinbox.inbox'::regclass), n_dead_tup
             FROM pg_stat_user_tables WHERE relid = 'txinbox.inbox'::regclass",
        )
        .fetch_one(&self.pool)
        .await?;
        let mb = |b: i64| b as f64 / (1024.0 * 1024.0);
        println!(
            "{when:<20} table {:>6.0} MB  pkey {:>5.0} MB  processed_at idx {:>5.0} MB  rows (estimate) {:>10}  dead {:>9}",
            mb(table),
            mb(pkey),
            mb(by_age),
            live,
            dead
        );
        Ok(())
    }

    fn batch_stats(&self) -> String {
        let mut b = std::mem::take(&mut *self.batches.lock().unwrap());
        if b.is_empty() {
            return "no batches".into();
        }
        b.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let mean = b.iter().map(|d| ms(*d)).sum::<f64>() / b.len() as f64;
        format!(
            "{} DELETEs: mean {:.1} ms, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            b.len(),
            mean,
            ms(b[b.len() / 2]),
            ms(b[(b.len() * 99 / 100).min(b.len() - 1)]),
            ms(b[b.len() - 1])
        )
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pool = PgPoolOptions::new()
        .max_connections(12)
        .connect_with(txinbox::PostgresInbox::connect_options(args.url.parse()?))
        .await?;
    txinbox::postgres::migrate(&pool).await?;
    pool.execute(
        "CREATE TABLE IF NOT EXISTS bench_effects (message_id text NOT NULL, bytes bigint NOT NULL)",
    )
    .await?;
    let bench = Bench {
        args,
        pool,
        batches: Arc::default(),
    };
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&bench.pool)
        .await?;
    println!(
        "retention bench: {} rows over 8 days, window 7d, {} messages per round, janitor batch {} pause {} ms (autovacuum {autovacuum})",
        bench.args.rows, bench.args.messages, bench.args.batch, bench.args.pause_ms
    );
    if !bench.args.reuse {
        bench
            .pool
            .execute("TRUNCATE txinbox.inbox, txinbox.retention, bench_effects")
            .await?;
        let started = Instant::now();
        sqlx::query(
            "INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at, source_system, destination)
             SELECT $1, 'pre-' || g, 'native', decode(md5(g::text) || md5(g::text), 'hex'), 'processed', 1,
                    now() - (g::float8 / $2::float8) * interval '8 days', 'memory', 'bench'
             FROM generate_series(1, $2::bigint) g",
        )
        .bind(CONSUMER)
        .bind(bench.args.rows)
        .execute(&bench.pool)
        .await?;
        bench.pool.execute("VACUUM ANALYZE txinbox.inbox").await?;
        println!("filled in {:.0} s", started.elapsed().as_secs_f64());
        if bench.args.fill_only {
            return Ok(());
        }
    }
    let due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM txinbox.inbox WHERE consumer = $1 AND processed_at < now() - interval '7 days'",
    )
    .bind(CONSUMER)
    .fetch_one(&bench.pool)
    .await?;
    println!("rows older than the window: {due}");
    bench.sizes("before").await?;

    println!(
        "\n{:<10} {:>10} {:>10} {:>14} {:>12}",
        "janitor", "msg/s", "seconds", "rows deleted", "deleted/s"
    );
    let mut by_setting: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for r in 0..bench.args.rounds {
        for on in [false, true] {
            let tag = format!("r{r}-{}", if on { "on" } else { "off" });
            let (rate, deleted, secs) = bench.round(&tag, on).await?;
            by_setting[usize::from(on)].push(rate);
            println!(
                "{:<10} {:>10.0} {:>10.1} {:>14} {:>12.0}",
                if on { "on" } else { "off" },
                rate,
                secs,
                deleted,
                deleted as f64 / secs
            );
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (off, on) = (mean(&by_setting[0]), mean(&by_setting[1]));
    println!(
        "mean: off {off:.0} msg/s, on {on:.0} msg/s ({:+.1} %)",
        (on / off - 1.0) * 100.0
    );
    println!("janitor beside the consumer: {}", bench.batch_stats());

    if bench.args.alone_secs > 0 {
        let before = bench.purged().await?;
        let started = Instant::now();
        let running = Arc::new(bench.janitor()).spawn();
        tokio::time::sleep(Duration::from_secs(bench.args.alone_secs)).await;
        running.stop().await;
        let secs = started.elapsed().as_secs_f64();
        let deleted = bench.purged().await? - before;
        println!(
            "janitor alone: {deleted} rows in {secs:.1} s = {:.0} rows/s; {}",
            deleted as f64 / secs,
            bench.batch_stats()
        );
    }
    bench.sizes("after the deletes").await?;
    let started = Instant::now();
    bench.pool.execute("VACUUM txinbox.inbox").await?;
    println!("VACUUM took {:.1} s", started.elapsed().as_secs_f64());
    bench.sizes("after VACUUM").await?;
    Ok(())
}
