//! Side-by-side throughput benchmark (`cargo run --release --example bench`), one process, one table: for each source (the in-memory
//! broker, Kafka, RabbitMQ) raw consumption without an inbox (the ceiling), one transaction per
//! message, and micro-batched transactions; for each broker also the peer txinbox has to beat,
//! a consumer written by hand the way users write one without it (rdkafka `StreamConsumer` or
//! lapin `basic_consume`, plus sqlx: one transaction per message inserting a `processed_ids`
//! row and the effect, the offset stored or the message acked after COMMIT); plus `pgbench`
//! doing the same inserts at the same batch sizes on the same database, so "batched vs. what
//! PostgreSQL can commit" is visible; and beside each pgbench row that runs the consumer's
//! statements (`_like`), the same transactions written by hand on sqlx with the store's own
//! calls and no runtime (source `sqlx`), which splits the gap between the consumer and pgbench
//! into the client library's and the runtime's.
//!
//! ```sh
//! cargo run --release --example bench -- [--messages N] [--per-message N] [--sources memory,kafka,amqp]
//!     [--batch-size N] [--linger-ms N] [--concurrency N] [--json PATH]
//!     [--prefill-rows N] [--memory-run N] [--no-pgbench]
//! ```
//!
//! The effect is the issue's "insert an inbox row + insert an effect row": one `INSERT` into
//! `bench_effects` per message (per-message handler), or one `INSERT … SELECT FROM UNNEST` per
//! batch (the batch handler). End-to-end latency is publish time (carried in the payload) to the
//! moment the broker settlement returned, after COMMIT. Peak RSS is the process's high-water
//! mark, reset before each row (`/proc/self/clear_refs`). A publisher keeps at most a window of
//! messages published and not yet settled, so latency measures the pipeline, not a backlog.
//!
//! The window must not be what a row measures: with a broker whose produce-to-consume latency
//! is L, a window W caps every row at W / L messages per second. Unless `--window N` fixes it,
//! each broker's window is searched first: raw rows at 2,000, 4,000, 8,000, … unsettled
//! messages, doubling while the raw rate still grows by 10% or more; the window found is used for
//! all of that broker's rows and printed in their notes. (The memory source has no such latency:
//! it uses 2,000.)
//!
//! Needs PostgreSQL at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`, a
//! role that may create databases: the bench works in a scratch database it drops at the end).
//! Its sessions use TLS as the URL says; without `sslmode` (`prefer`) they are encrypted when the
//! server offers TLS, as pgbench's (libpq's) are: add `?sslmode=disable` to measure plaintext.
//! Kafka rows use `KAFKA_BROKERS` (default `127.0.0.1:9092`, e.g. tansu: `source
//! scripts/lib/tansu.sh && ensure_tansu`), RabbitMQ rows `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). A source whose broker is unreachable is skipped
//! with a message. pgbench rows need `pgbench` on the PATH.
//!
//! Every source also gets two fixed-rate rows (`raw@50%`, `batched@50%`): publishing at half
//! the batched rate the saturated row reached, for `--paced-seconds` (10; 0 turns them off), to
//! show the latency batching costs when traffic is light. The `cpu %` column is the CPU used
//! over a row in percent of one core: this process / the whole machine (broker and PostgreSQL
//! included). A machine near `cores × 100` is saturated, and a row's limit is then CPU shared by
//! everything on it.
//!
//! Long modes for the README's growth figures (not for CI): `--prefill-rows 10000000` fills the
//! inbox with that many rows (`generate_series`) and runs the batched memory row again beside the
//! empty-table one; `--memory-run 1000000` consumes that many messages batched from the memory
//! source and prints the RSS every tenth of the way.

mod amqp;
mod args;
mod bench;
mod effects;
mod kafka;
mod measure;
mod memory;
mod peers;
mod pgbench;
mod publish;
mod report;
mod timed;

use anyhow::Context as _;
use txinbox::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use txinbox::sqlx::{self, Executor};
use txinbox::PostgresInbox;

use crate::args::parse_args;
use crate::bench::Bench;
use crate::measure::now_micros;
use crate::report::{header, print_row, Row};

/// The median of `values` (the mean of the middle two for an even count); `None` if empty.
fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let admin: PgConnectOptions = database_url
        .parse()
        .context("DATABASE_URL does not parse; expected postgres://user@host:port/database")?;
    let run_id = format!("{}-{}", std::process::id(), now_micros() % 1_000_000);
    let db_name = format!("txinbox_bench_{}", run_id.replace('-', "_"));
    // TLS as DATABASE_URL says (sslmode, sslrootcert, …); a refused connection says what to
    // change.
    let conn = PostgresInbox::connect(&database_url, 1)
        .await
        .context("connecting to PostgreSQL at DATABASE_URL (is it running?)")?
        .pool()
        .clone();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db_name}")))
        .await?;
    let drop_database = format!("DROP DATABASE IF EXISTS {db_name} WITH (FORCE)");
    let options = admin.clone().database(&db_name);
    // pgbench takes a libpq URI: the scratch database on the same server.
    let url = txinbox_demos::with_database(&database_url, &db_name);
    let setup = async {
        let pool = PgPoolOptions::new()
            .max_connections(args.concurrency as u32 + 2)
            .connect_with(PostgresInbox::connect_options(options))
            .await?;
        txinbox::postgres::migrate(&pool).await?;
        pool.execute(
            "CREATE TABLE bench_effects (id bigserial PRIMARY KEY, message_id text NOT NULL, bytes bigint NOT NULL);
             CREATE SEQUENCE bench_pgb_seq;
             CREATE TABLE bench_processed_ids (consumer text NOT NULL, id text NOT NULL, PRIMARY KEY (consumer, id));",
        )
        .await?;
        anyhow::Ok(pool)
    }
    .await;
    let pool = match setup {
        Ok(pool) => pool,
        Err(e) => {
            // The scratch database is dropped on every way out, not left behind.
            let _ = conn.execute(sqlx::AssertSqlSafe(drop_database)).await;
            return Err(e);
        }
    };
    let bench = Bench {
        args: args.clone(),
        pool: pool.clone(),
        url,
        run_id,
    };

    println!(
        "txinbox bench: {} messages per row ({} for per_message), {} cores, scratch database {db_name}\n",
        args.messages,
        args.per_message,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    header();
    let mut rows = Vec::new();
    let result = async {
        for source in &args.sources {
            match source.as_str() {
                "memory" => bench.memory_rows(&mut rows).await?,
                "kafka" => bench.kafka_rows(&mut rows).await?,
                "amqp" => bench.amqp_rows(&mut rows).await?,
                _ => unreachable!("validated"),
            }
        }
        if args.pgbench {
            for (batch, like_txinbox) in [
                (1, false),
                (1, true),
                (args.batch_size, false),
                (args.batch_size, true),
            ] {
                bench.checkpoint().await;
                match bench.pgbench(batch, like_txinbox) {
                    Ok(row) => {
                        print_row(&row);
                        rows.push(row);
                    }
                    Err(e) => println!("pgbench: SKIPPED, {e:#}"),
                }
                if like_txinbox {
                    // The same transactions by hand through sqlx: where the gap between the
                    // consumer and pgbench lies, in the client library or in the runtime.
                    bench.checkpoint().await;
                    let row = bench.sqlx_like(batch).await?;
                    print_row(&row);
                    rows.push(row);
                }
            }
        }
        if args.prefill_rows > 0 {
            bench.prefilled_row(&mut rows).await?;
        }
        anyhow::Ok(())
    }
    .await;

    if result.is_ok() {
        println!();
        let rate = |source: &str, mode: &str| {
            rows.iter()
                .find(|r| r.source == source && r.mode == mode)
                .map(|r| r.msgs_per_sec)
        };
        for source in ["memory", "kafka", "amqp"] {
            if let (Some(b), Some(p)) = (rate(source, "batched"), rate(source, "per_message")) {
                println!("{source}: batched / per_message = {:.1}x", b / p);
            }
            for mode in ["per_message", "batched"] {
                let like = format!("{mode}_like");
                if let (Some(b), Some(g)) = (rate(source, mode), rate("pgbench", mode)) {
                    // (Only memory's transactions are pgbench's `_like` statements: a broker's
                    // also store positions, or ack.)
                    let mut as_txinbox = rate("pgbench", &like)
                        .filter(|_| source == "memory")
                        .map_or(String::new(), |l| {
                            format!(", / pgbench {like} (the same statements) = {:.0}%", 100.0 * b / l)
                        });
                    if let Some(s) = rate("sqlx", &like).filter(|_| source == "memory") {
                        as_txinbox += &format!(
                            ", / sqlx {like} (the same statements by hand) = {:.0}%",
                            100.0 * b / s
                        );
                    }
                    println!(
                        "{source}: {mode} / pgbench {mode} = {:.0}%{as_txinbox}",
                        100.0 * b / g
                    );
                }
            }
            if let (Some(b), Some(m)) = (rate(source, "batched"), rate("memory", "batched")) {
                if source != "memory" {
                    println!("{source}: batched / memory batched = {:.0}%", 100.0 * b / m);
                }
            }
            if let (Some(b), Some(r)) = (rate(source, "batched"), rate(source, "raw")) {
                println!("{source}: batched / raw = {:.0}%", 100.0 * b / r);
            }
            if let (Some(b), Some(p)) = (rate(source, "batched"), rate(source, "peer")) {
                println!("{source}: batched / hand-written peer = {:.1}x", b / p);
            }
            let p99 = |mode: &str| {
                rows.iter()
                    .find(|r| r.source == source && r.mode == mode)
                    .and_then(|r| r.p99_ms)
            };
            if let (Some(b), Some(r)) = (p99("batched@50%"), p99("raw@50%")) {
                let linger = args.linger_ms as f64;
                println!(
                    "{source}: p99 at half the batched rate: batched {b:.1} ms, raw {r:.1} ms (raw + 2 x linger = {:.1} ms)",
                    r + 2.0 * linger
                );
            }
        }
        let rates = |mode: &str| -> Vec<f64> {
            rows.iter()
                .filter(|r| r.source == "memory" && r.mode == mode)
                .map(|r| r.msgs_per_sec)
                .collect()
        };
        let (ons, offs) = (rates("health_on"), rates("health_off"));
        if let (Some(on), Some(off)) = (median(&ons), median(&offs)) {
            println!(
                "memory: lane health tracking costs {:.1}% (medians of {} pairs: on {on:.0}, off {off:.0} msg/s)",
                100.0 * (off - on) / off,
                ons.len().min(offs.len())
            );
        }
        if let (Some(plain), Some(bound)) = (rate("memory", "sleep"), rate("memory", "sleep+bound")) {
            println!(
                "memory: sleeping handler, with batch_max_duration / without = {:.0}%",
                100.0 * bound / plain
            );
        }
        if let (Some(p), Some(e)) = (
            rows.iter()
                .find(|r| r.source.starts_with("memory+"))
                .map(|r| r.msgs_per_sec),
            rate("memory", "batched"),
        ) {
            println!(
                "memory: batched with prefilled inbox / empty = {:.0}%",
                100.0 * p / e
            );
        }
        if let Some(path) = &args.json {
            let json = serde_json::Value::Array(rows.iter().map(Row::json).collect());
            std::fs::write(path, serde_json::to_string_pretty(&json)?)
                .with_context(|| format!("writing {path}"))?;
            println!("wrote {} rows to {path}", rows.len());
        }
    }
    let long = if result.is_ok() && args.memory_run > 0 {
        bench.memory_run().await
    } else {
        Ok(())
    };

    pool.close().await;
    conn.execute(sqlx::AssertSqlSafe(drop_database)).await?;
    result?;
    long
}
