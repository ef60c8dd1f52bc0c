//! Side-by-side throughput benchmark, one process, one table: for each source (the in-memory
//! broker, Kafka, RabbitMQ) raw consumption without an inbox (the ceiling), one transaction per
//! message, and micro-batched transactions; for each broker also the peer txinbox has to beat,
//! a consumer written by hand the way users write one without it (rdkafka `StreamConsumer` or
//! lapin `basic_consume`, plus sqlx: one transaction per message inserting a `processed_ids`
//! row and the effect, the offset stored or the message acked after COMMIT); plus `pgbench`
//! doing the same inserts at the same batch sizes on the same database, so "batched vs. what
//! PostgreSQL can commit" is visible.
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use txinbox::memory::MemoryBroker;
use txinbox::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use txinbox::sqlx::{self, ConnectOptions, Executor, Postgres};
use txinbox::{
    async_trait, handler::BatchContext, handler::BatchHandler, handler::BatchMessage, source::Capabilities,
    source::Lane, source::SettleError, source::Settlement, source::SourceError, Consumer, Context, Delivery,
    Handler, HandlerError, IdStrategy, Message, MessageSource, Position, PostgresInbox,
};

/// The memory source's window: it has no broker latency to cover.
const MEMORY_WINDOW: u64 = 2_000;

#[derive(Debug, Clone)]
struct Args {
    messages: u64,
    per_message: u64,
    sources: Vec<String>,
    batch_size: usize,
    linger_ms: u64,
    concurrency: usize,
    max_in_flight: usize,
    /// `None`: searched per broker (see `Bench::window_for`).
    window: Option<u64>,
    partitions: i32,
    json: Option<String>,
    prefill_rows: u64,
    memory_run: u64,
    pgbench: bool,
    pgbench_seconds: u32,
    /// How long each fixed-rate row publishes (0: no fixed-rate rows).
    paced_seconds: u64,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        messages: 50_000,
        per_message: 0,
        sources: vec!["memory".into(), "kafka".into(), "amqp".into()],
        batch_size: txinbox::consumer::DEFAULT_BATCH_SIZE,
        linger_ms: txinbox::consumer::DEFAULT_BATCH_LINGER.as_millis() as u64,
        concurrency: txinbox::consumer::DEFAULT_CONCURRENCY,
        max_in_flight: txinbox::consumer::DEFAULT_MAX_IN_FLIGHT,
        window: None,
        partitions: 8,
        json: None,
        prefill_rows: 0,
        memory_run: 0,
        pgbench: true,
        pgbench_seconds: 5,
        paced_seconds: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--messages" => a.messages = value()?.parse()?,
            "--per-message" => a.per_message = value()?.parse()?,
            "--sources" => a.sources = value()?.split(',').map(str::to_owned).collect(),
            "--batch-size" => a.batch_size = value()?.parse()?,
            "--linger-ms" => a.linger_ms = value()?.parse()?,
            "--concurrency" => a.concurrency = value()?.parse()?,
            "--max-in-flight" => a.max_in_flight = value()?.parse()?,
            "--window" => a.window = Some(value()?.parse()?),
            "--partitions" => a.partitions = value()?.parse()?,
            "--json" => a.json = Some(value()?),
            "--prefill-rows" => a.prefill_rows = value()?.parse()?,
            "--memory-run" => a.memory_run = value()?.parse()?,
            "--pgbench-seconds" => a.pgbench_seconds = value()?.parse()?,
            "--no-pgbench" => a.pgbench = false,
            "--paced-seconds" => a.paced_seconds = value()?.parse()?,
            "--help" | "-h" => {
                println!(
                    "cargo run --release --example bench -- [--messages N (50000)] [--per-message N (min(messages, 10000))]\n  \
                     [--sources memory,kafka,amqp] [--batch-size N (100)] [--linger-ms N (0)] [--concurrency N (8)]\n  \
                     [--max-in-flight N (2048)] \
                     [--window N (searched per broker; memory 2000)] [--partitions N (8)] [--json PATH] [--prefill-rows N] [--memory-run N]\n  \
                     [--no-pgbench] [--pgbench-seconds N (5)] [--paced-seconds N (10; 0: no fixed-rate rows)]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}; see --help"),
        }
    }
    if a.per_message == 0 {
        a.per_message = a.messages.min(10_000);
    }
    if let Some(bad) = a
        .sources
        .iter()
        .find(|s| !["memory", "kafka", "amqp"].contains(&s.as_str()))
    {
        bail!("unknown source {bad:?}: use memory, kafka, amqp");
    }
    Ok(a)
}

// ---------------------------------------------------------------------------------------------
// Measuring: a latency histogram of fixed size (memory does not grow with the message count) and
// a source wrapper that records every acknowledged settlement.

/// Log-scale buckets of 2% from 1 µs to about 30 minutes.
struct Histogram {
    buckets: Vec<AtomicU64>,
}

const GROWTH: f64 = 1.02;

impl Histogram {
    fn new() -> Self {
        Histogram {
            buckets: (0..1100).map(|_| AtomicU64::new(0)).collect(),
        }
    }
    fn record(&self, micros: u64) {
        let i = ((micros.max(1) as f64).ln() / GROWTH.ln()) as usize;
        self.buckets[i.min(self.buckets.len() - 1)].fetch_add(1, Ordering::Relaxed);
    }
    fn quantile_ms(&self, q: f64) -> Option<f64> {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = (q * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(GROWTH.powf(i as f64 + 0.5) / 1000.0);
            }
        }
        None
    }
}

/// Counts settled messages, records their latency, notes when the target was reached.
struct Probe {
    target: u64,
    settled: AtomicU64,
    latency: Histogram,
    /// When the warm-up message had been settled and the measured messages began.
    started_at: OnceLock<Instant>,
    done_at: OnceLock<Instant>,
    /// The CPU reading taken with `started_at`, and the use from it to `done_at`.
    cpu_at_start: OnceLock<Option<CpuMeter>>,
    cpu: OnceLock<Option<CpuUse>>,
    done: tokio::sync::Notify,
}

impl Probe {
    fn new(target: u64) -> Arc<Self> {
        Arc::new(Probe {
            target,
            settled: AtomicU64::new(0),
            latency: Histogram::new(),
            started_at: OnceLock::new(),
            done_at: OnceLock::new(),
            cpu_at_start: OnceLock::new(),
            cpu: OnceLock::new(),
            done: tokio::sync::Notify::new(),
        })
    }
    fn settled(&self) -> u64 {
        self.settled.load(Ordering::Relaxed)
    }
    /// The elapsed time of the measured messages (after the warm-up).
    fn elapsed(&self) -> Duration {
        let end = self.done_at.get().copied().unwrap_or_else(Instant::now);
        end - self.started_at.get().copied().unwrap_or(end)
    }
    /// Starts the clock (and the CPU reading) of the measured messages.
    fn start(&self) {
        let _ = self.cpu_at_start.set(CpuMeter::start());
        let _ = self.started_at.set(Instant::now());
    }
    /// CPU use over the measured messages, once they are all settled.
    fn cpu(&self) -> Option<CpuUse> {
        self.cpu.get().copied().flatten()
    }
    /// One settled message; `sent`: its publish time, if its payload carries one.
    fn record(&self, sent: Option<u64>) {
        let warm = self.started_at.get().is_some();
        if let (true, Some(sent)) = (warm, sent) {
            self.latency.record(now_micros().saturating_sub(sent));
        }
        if self.settled.fetch_add(1, Ordering::Relaxed) + 1 >= self.target {
            let _ = self.done_at.set(Instant::now());
            let _ = self.cpu.set(
                self.cpu_at_start
                    .get()
                    .copied()
                    .flatten()
                    .and_then(CpuMeter::since),
            );
            self.done.notify_waiters();
        }
    }
    async fn wait_done(&self) {
        loop {
            let notified = self.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.settled() >= self.target {
                return;
            }
            notified.await;
        }
    }
}

fn now_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

/// Payloads are `"<publish time in µs> <sequence number>"`.
fn payload(seq: u64) -> String {
    format!("{} {seq}", now_micros())
}

fn published_at(message: &Message) -> Option<u64> {
    sent_at(message.payload())
}

fn sent_at(payload: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(payload).ok()?;
    text.split(' ').next()?.parse().ok()
}

/// A source whose deliveries report their acknowledgement to a [`Probe`].
struct Timed<S> {
    inner: S,
    probe: Arc<Probe>,
}

struct TimedDelivery<D> {
    inner: D,
    probe: Arc<Probe>,
}

#[async_trait]
impl<S: MessageSource> MessageSource for Timed<S> {
    type Delivery = TimedDelivery<S::Delivery>;
    async fn receive(&mut self) -> Result<Option<Self::Delivery>, SourceError> {
        Ok(self.inner.receive().await?.map(|inner| TimedDelivery {
            inner,
            probe: self.probe.clone(),
        }))
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn positions_consumer(&self) -> Option<&str> {
        self.inner.positions_consumer()
    }
    async fn close(self) -> Result<(), SourceError> {
        self.inner.close().await
    }
}

#[async_trait]
impl<D: Delivery> Delivery for TimedDelivery<D> {
    fn message(&self) -> &Message {
        self.inner.message()
    }
    fn lane(&self) -> Lane {
        self.inner.lane()
    }
    fn position(&self) -> Option<Position> {
        self.inner.position()
    }
    async fn settle(self, settlement: Settlement) -> Result<(), SettleError> {
        let ack = settlement == Settlement::Ack;
        let sent = published_at(self.inner.message());
        let result = self.inner.settle(settlement).await;
        if ack && result.is_ok() {
            self.probe.record(sent);
        }
        result
    }
}

/// CPU used over an interval, in percent of one core (so up to `cores × 100`).
#[derive(Debug, Clone, Copy)]
struct CpuUse {
    /// This process: the consumer, the publisher and the client libraries' threads.
    process: f64,
    /// The whole machine: this process plus the broker, PostgreSQL and anything else.
    machine: f64,
}

/// A reading of `/proc` to difference against a later one: (this process's CPU ticks, the
/// machine's busy ticks, the machine's total ticks).
#[derive(Debug, Clone, Copy)]
struct CpuMeter {
    process: u64,
    busy: u64,
    total: u64,
    at: Instant,
}

impl CpuMeter {
    /// `None` where `/proc` cannot be read (not Linux).
    fn start() -> Option<CpuMeter> {
        // /proc/self/stat: utime, stime, cutime and cstime are the 14th to 17th fields (the
        // children's once waited for: pgbench's). The 2nd, the command name in parentheses, may
        // contain spaces, so count from after its closing ')'.
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let process = fields
            .get(11..15)?
            .iter()
            .map(|f| f.parse::<u64>().ok())
            .sum::<Option<u64>>()?;
        // /proc/stat's first line: user nice system idle iowait irq softirq steal, in ticks.
        let machine = std::fs::read_to_string("/proc/stat").ok()?;
        let ticks: Vec<u64> = machine
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|t| t.parse().ok())
            .collect::<Option<_>>()?;
        let total: u64 = ticks.iter().sum();
        let idle = ticks.get(3)? + ticks.get(4)?;
        Some(CpuMeter {
            process,
            busy: total - idle,
            total,
            at: Instant::now(),
        })
    }

    /// CPU use from this reading to now.
    fn since(self) -> Option<CpuUse> {
        let now = CpuMeter::start()?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        // Ticks are USER_HZ, 100 per second on every Linux architecture txinbox runs on.
        let seconds = now.at.duration_since(self.at).as_secs_f64();
        let total = now.total.saturating_sub(self.total) as f64;
        if seconds <= 0.0 || total <= 0.0 {
            return None;
        }
        Some(CpuUse {
            process: now.process.saturating_sub(self.process) as f64 / seconds,
            machine: 100.0 * cores * now.busy.saturating_sub(self.busy) as f64 / total,
        })
    }
}

/// Resets the process's peak RSS (VmHWM) so the next reading covers one row only.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// `VmHWM` or `VmRSS` from /proc/self/status, in MiB.
fn rss_mb(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

// ---------------------------------------------------------------------------------------------
// The effect: one effect row per message, or one UNNEST insert per batch.

struct Effects;

/// Handler calls and the messages they handled, for the batched rows' average batch fill (a
/// message that runs alone, on a lane with nothing else queued, is a call of one). Reset before
/// each row; rows run one at a time.
static HANDLER_CALLS: AtomicU64 = AtomicU64::new(0);
static HANDLED: AtomicU64 = AtomicU64::new(0);

fn count_call(messages: usize) {
    HANDLER_CALLS.fetch_add(1, Ordering::Relaxed);
    HANDLED.fetch_add(messages as u64, Ordering::Relaxed);
}

#[async_trait]
impl Handler<Postgres> for Effects {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        count_call(1);
        let id = cx.message_id().as_str().to_owned();
        sqlx::query("INSERT INTO bench_effects (message_id, bytes) VALUES ($1, $2)")
            .bind(id)
            .bind(msg.payload().len() as i64)
            .execute(cx.db())
            .await?;
        Ok(())
    }
    fn batch(&self) -> Option<&dyn BatchHandler<Postgres>> {
        Some(self)
    }
}

#[async_trait]
impl BatchHandler<Postgres> for Effects {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, Postgres>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        count_call(batch.len());
        let ids: Vec<&str> = batch.iter().map(|m| m.id().as_str()).collect();
        let sizes: Vec<i64> = batch.iter().map(|m| m.message().payload().len() as i64).collect();
        sqlx::query(
            "INSERT INTO bench_effects (message_id, bytes) SELECT * FROM UNNEST($1::text[], $2::int8[])",
        )
        .bind(ids)
        .bind(sizes)
        .execute(cx.db())
        .await?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Publishers, one per source kind.

enum Publisher {
    Memory(MemoryBroker),
    Kafka {
        producer: rdkafka::producer::FutureProducer,
        topic: String,
        partitions: i32,
    },
    Amqp {
        channel: lapin::Channel,
        queue: String,
    },
}

impl Publisher {
    async fn publish(&self, seq: u64) -> anyhow::Result<()> {
        let body = payload(seq);
        match self {
            Publisher::Memory(broker) => broker.publish(format!("m-{seq}"), body),
            Publisher::Kafka {
                producer,
                topic,
                partitions,
            } => {
                let key = seq.to_string();
                let mut record = rdkafka::producer::FutureRecord::to(topic)
                    .key(&key)
                    .payload(&body)
                    .partition((seq % *partitions as u64) as i32);
                loop {
                    match producer.send_result(record) {
                        Ok(_delivery) => break, // the delivery report is not awaited; flushed at the end
                        Err((
                            rdkafka::error::KafkaError::MessageProduction(
                                rdkafka::types::RDKafkaErrorCode::QueueFull,
                            ),
                            r,
                        )) => {
                            record = r;
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        Err((e, _)) => bail!("producing to Kafka failed: {e}"),
                    }
                }
            }
            Publisher::Amqp { channel, queue } => {
                let props = lapin::BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(format!("m-{seq}").into());
                channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        lapin::options::BasicPublishOptions::default(),
                        body.as_bytes(),
                        props,
                    )
                    .await
                    .context("publishing to RabbitMQ")?;
            }
        }
        Ok(())
    }

    async fn finish(&self) {
        if let Publisher::Kafka { producer, .. } = self {
            use rdkafka::producer::Producer as _;
            let _ = producer.flush(Duration::from_secs(30));
        }
    }
}

/// How a row's publisher loads its source.
#[derive(Debug, Clone, Copy)]
struct Load {
    /// Messages measured (after the warm-up one).
    n: u64,
    /// At most this many published and not yet settled.
    window: u64,
    /// Messages per second; `None`: as fast as the window allows (saturation).
    rate: Option<f64>,
}

impl Load {
    fn saturated(n: u64, window: u64) -> Load {
        Load {
            n,
            window,
            rate: None,
        }
    }

    /// What a row's note says about its load.
    fn describe(&self) -> String {
        match self.rate {
            None => format!("window {}", self.window),
            Some(rate) => format!("paced at {rate:.0} msg/s, window {}", self.window),
        }
    }
}

/// Publishes a warm-up message and waits until it is settled (a Kafka consumer first joins its
/// group, which takes seconds), starts the clock, then publishes `load.n` more, keeping at most
/// `load.window` published and not yet settled, and no faster than `load.rate`. The probe's
/// target must be `load.n + 1`.
async fn publish_loop(publisher: Publisher, load: Load, probe: Arc<Probe>) -> anyhow::Result<()> {
    publisher.publish(0).await?;
    publisher.finish().await;
    while probe.settled() < 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    probe.start();
    let start = tokio::time::Instant::now();
    for seq in 1..=load.n {
        if let Some(rate) = load.rate {
            // Each message at its own time: the timer's millisecond resolution sends them in
            // bursts of up to rate / 1000, never ahead of the schedule.
            let due = start + Duration::from_secs_f64((seq - 1) as f64 / rate);
            if due > tokio::time::Instant::now() {
                tokio::time::sleep_until(due).await;
            }
        }
        while seq.saturating_sub(probe.settled()) >= load.window {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        publisher.publish(seq).await?;
    }
    publisher.finish().await;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Rows.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Raw,
    PerMessage,
    Batched,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Raw => "raw",
            Mode::PerMessage => "per_message",
            Mode::Batched => "batched",
        }
    }
}

/// A fixed-rate row's mode: its saturated mode at half the batched rate.
fn paced_mode(mode: Mode) -> &'static str {
    match mode {
        Mode::Raw => "raw@50%",
        Mode::PerMessage => "per_msg@50%",
        Mode::Batched => "batched@50%",
    }
}

#[derive(Debug, Clone)]
struct Row {
    source: String,
    mode: &'static str,
    messages: u64,
    msgs_per_sec: f64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    peak_rss_mb: Option<f64>,
    /// CPU used over the row, in percent of one core: this process, and the whole machine
    /// (broker, PostgreSQL and all). A machine near `cores × 100` is saturated: what limits the
    /// row is CPU, shared by everything on it.
    cpu: Option<CpuUse>,
    note: String,
}

impl Row {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "source": self.source,
            "mode": self.mode,
            "messages": self.messages,
            "msgs_per_sec": (self.msgs_per_sec * 10.0).round() / 10.0,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "peak_rss_mb": self.peak_rss_mb,
            "cpu_process_pct": self.cpu.map(|c| c.process.round()),
            "cpu_machine_pct": self.cpu.map(|c| c.machine.round()),
            "note": self.note,
        })
    }
}

struct Bench {
    args: Args,
    pool: PgPool,
    url: String,
    run_id: String,
}

impl Bench {
    fn inbox(&self) -> PostgresInbox {
        PostgresInbox::new(self.pool.clone())
    }

    /// Consumes `n` messages from `source` (fed by `publisher`) in `mode`, as consumer `name`.
    #[allow(clippy::too_many_arguments)]
    async fn row<Src: MessageSource>(
        &self,
        label: &str,
        mode: Mode,
        name: &str,
        source: Src,
        publisher: Publisher,
        id_strategy: Option<IdStrategy>,
        load: Load,
    ) -> anyhow::Result<Row> {
        let n = load.n;
        self.checkpoint().await;
        reset_peak_rss();
        let probe = Probe::new(n + 1);
        let timed = Timed {
            inner: source,
            probe: probe.clone(),
        };
        HANDLER_CALLS.store(0, Ordering::Relaxed);
        HANDLED.store(0, Ordering::Relaxed);
        let publishing = tokio::spawn(publish_loop(publisher, load, probe.clone()));
        match mode {
            Mode::Raw => {
                let mut source = timed;
                // Until the probe has every message (the warm-up one included): the loop ends
                // through `wait_done`, never on a count that could miss the last delivery.
                loop {
                    let received = tokio::select! {
                        r = source.receive() => r?,
                        _ = probe.wait_done() => break,
                    };
                    let Some(delivery) = received else { break };
                    tokio::spawn(delivery.settle(Settlement::Ack));
                }
                probe.wait_done().await;
                source.close().await?;
            }
            Mode::PerMessage | Mode::Batched => {
                let batch_size = if mode == Mode::Batched {
                    self.args.batch_size
                } else {
                    1
                };
                let mut builder = Consumer::builder(name)
                    .source(timed)
                    .inbox(self.inbox())
                    .handler(Effects)
                    .concurrency(self.args.concurrency)
                    .max_in_flight(self.args.max_in_flight)
                    .batch_size(batch_size)
                    .batch_linger(Duration::from_millis(self.args.linger_ms));
                if let Some(s) = id_strategy {
                    builder = builder.id_strategy(s);
                }
                let probe_done = probe.clone();
                // Spawned, as the README advises: `main`'s own future runs outside the worker
                // threads, and every wake-up between it and them crosses threads.
                let consumer = builder.build()?;
                tokio::spawn(consumer.run_until(async move { probe_done.wait_done().await })).await??;
            }
        }
        publishing.await??;
        let elapsed = probe.elapsed();
        let note = match mode {
            Mode::Raw => format!("no inbox: receive + ack; {}", load.describe()),
            Mode::PerMessage => format!(
                "batch_size 1, concurrency {}; {}",
                self.args.concurrency,
                load.describe()
            ),
            Mode::Batched => format!(
                "batch_size {}, linger {} ms, concurrency {}, max_in_flight {}; {}; {:.0} messages per transaction",
                self.args.batch_size,
                self.args.linger_ms,
                self.args.concurrency,
                self.args.max_in_flight,
                load.describe(),
                HANDLED.load(Ordering::Relaxed) as f64 / HANDLER_CALLS.load(Ordering::Relaxed).max(1) as f64
            ),
        };
        Ok(Row {
            source: label.to_owned(),
            mode: mode.as_str(),
            messages: n,
            msgs_per_sec: n as f64 / elapsed.as_secs_f64(),
            p50_ms: probe.latency.quantile_ms(0.50),
            p99_ms: probe.latency.quantile_ms(0.99),
            peak_rss_mb: rss_mb("VmHWM:"),
            cpu: probe.cpu(),
            note,
        })
    }

    /// The peer txinbox has to beat: a consumer written by hand the way users write one
    /// without it. `consume` runs one transaction per message (a `bench_processed_ids` insert
    /// and, when new, the effect), acknowledges after COMMIT, and reports each message to the
    /// probe; it runs until the probe has them all.
    async fn peer_row<F, Fut>(
        &self,
        label: &str,
        publisher: Publisher,
        window: u64,
        note: &str,
        consume: F,
    ) -> anyhow::Result<Row>
    where
        F: FnOnce(Arc<Probe>) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let n = self.args.per_message;
        self.checkpoint().await;
        reset_peak_rss();
        let probe = Probe::new(n + 1);
        let publishing = tokio::spawn(publish_loop(publisher, Load::saturated(n, window), probe.clone()));
        let mut consuming = tokio::spawn(consume(probe.clone()));
        tokio::select! {
            () = probe.wait_done() => consuming.abort(),
            r = &mut consuming => {
                r??;
                bail!("the hand-written {label} consumer stopped early");
            }
        }
        publishing.await??;
        let elapsed = probe.elapsed();
        Ok(Row {
            source: label.to_owned(),
            mode: "peer",
            messages: n,
            msgs_per_sec: n as f64 / elapsed.as_secs_f64(),
            p50_ms: probe.latency.quantile_ms(0.50),
            p99_ms: probe.latency.quantile_ms(0.99),
            peak_rss_mb: rss_mb("VmHWM:"),
            cpu: probe.cpu(),
            note: format!("{note}; window {window}"),
        })
    }

    fn count(&self, mode: Mode) -> u64 {
        if mode == Mode::PerMessage {
            self.args.per_message
        } else {
            self.args.messages
        }
    }

    /// The publisher's window for a broker: `--window`, or the smallest of 2,000, 4,000, 8,000,
    /// … (up to 65,535, AMQP's largest prefetch, and the row's message count) past which the raw
    /// rate grows by less than 10%. `raw(n, window)` measures one raw row; the search rows are
    /// printed (mode `raw?`), not kept.
    async fn window_for<F, Fut>(&self, label: &str, mut raw: F) -> anyhow::Result<u64>
    where
        F: FnMut(u64, u64) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<Row>>,
    {
        if let Some(w) = self.args.window {
            return Ok(w);
        }
        let limit = self.args.messages.min(u16::MAX as u64);
        let mut window = 2_000.min(limit);
        let mut best: Option<(u64, f64)> = None;
        loop {
            // Enough messages that the window fills many times over.
            let n = self.args.messages.min((window * 8).max(20_000));
            let mut row = raw(n, window).await?;
            row.mode = "raw?";
            print_row(&row);
            if let Some((previous, rate)) = best {
                if row.msgs_per_sec < rate * 1.10 {
                    println!("{label}: window {previous} (a larger one gained less than 10%)");
                    return Ok(previous);
                }
            }
            best = Some((window, row.msgs_per_sec));
            if window >= limit {
                println!("{label}: window {window} (the largest tried)");
                return Ok(window);
            }
            window = (window * 2).min(limit);
        }
    }

    async fn memory_rows(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
        for mode in [Mode::Raw, Mode::PerMessage, Mode::Batched] {
            let broker = MemoryBroker::new("bench");
            let name = format!("bench-memory-{}-{}", mode.as_str(), self.run_id);
            let row = self
                .row(
                    "memory",
                    mode,
                    &name,
                    broker.source(),
                    Publisher::Memory(broker.clone()),
                    None,
                    Load::saturated(self.count(mode), self.args.window.unwrap_or(MEMORY_WINDOW)),
                )
                .await?;
            print_row(&row);
            rows.push(row);
        }
        let window = self.args.window.unwrap_or(MEMORY_WINDOW);
        for (mode, load) in self.paced(rows, "memory", window) {
            let broker = MemoryBroker::new("bench");
            let name = format!("bench-memory-{}-paced-{}", mode.as_str(), self.run_id);
            let publisher = Publisher::Memory(broker.clone());
            let mut row = self
                .row("memory", mode, &name, broker.source(), publisher, None, load)
                .await?;
            row.mode = paced_mode(mode);
            print_row(&row);
            rows.push(row);
        }
        Ok(())
    }

    /// A broker's rows: raw, per_message and batched at saturation, then the fixed-rate rows.
    /// `row(mode, label, load)` measures one row (`label` names its topic or queue).
    async fn source_rows<F, Fut>(
        &self,
        source: &str,
        window: u64,
        rows: &mut Vec<Row>,
        mut row: F,
    ) -> anyhow::Result<()>
    where
        F: FnMut(Mode, String, Load) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<Row>>,
    {
        for mode in [Mode::Raw, Mode::PerMessage, Mode::Batched] {
            let r = row(
                mode,
                mode.as_str().to_owned(),
                Load::saturated(self.count(mode), window),
            )
            .await?;
            print_row(&r);
            rows.push(r);
        }
        for (mode, load) in self.paced(rows, source, window) {
            let mut r = row(mode, format!("{}-paced", mode.as_str()), load).await?;
            r.mode = paced_mode(mode);
            print_row(&r);
            rows.push(r);
        }
        Ok(())
    }

    /// The fixed-rate rows of a source whose saturated rows are in `rows`: raw and batched,
    /// each at half the batched rate, for `--paced-seconds` (none if that is 0 or the source
    /// has no batched row).
    fn paced(&self, rows: &[Row], source: &str, window: u64) -> Vec<(Mode, Load)> {
        let Some(batched) = rows
            .iter()
            .find(|r| r.source == source && r.mode == "batched")
            .map(|r| r.msgs_per_sec)
        else {
            return Vec::new();
        };
        let rate = (batched / 2.0).max(1.0);
        let n = ((rate * self.args.paced_seconds as f64) as u64).min(self.args.messages);
        if n == 0 {
            return Vec::new();
        }
        let load = Load {
            n,
            window,
            rate: Some(rate),
        };
        vec![(Mode::Raw, load), (Mode::Batched, load)]
    }

    async fn kafka_rows(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
        use rdkafka::admin::{AdminClient, AdminOptions};
        use rdkafka::client::DefaultClientContext;
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
        if !reachable(&brokers).await {
            println!("kafka: SKIPPED, no broker at {brokers} (set KAFKA_BROKERS; tansu: source scripts/lib/tansu.sh && ensure_tansu)");
            return Ok(());
        }
        let topics = std::sync::Mutex::new(Vec::new());
        let result = self.kafka_rows_on(&brokers, &topics, rows).await;
        // NOTE: the topics are deleted at the end, by a client that never produced to them or
        // cached their metadata. Deleting each after its row, while the publisher's producer
        // was alive, crashed librdkafka 2.12 now and then (SIGSEGV in its metadata cache,
        // `rd_kafka_metadata_cache_find` from `rd_kafka_metadata_update_op`, a known class of
        // bugs with deleted topics: librdkafka #4964, #5051).
        let topics = topics.into_inner().unwrap_or_else(|e| e.into_inner());
        if !topics.is_empty() {
            let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .create()?;
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            let _ = admin.delete_topics(&names, &AdminOptions::new()).await;
        }
        result
    }

    /// The Kafka rows; each topic created is added to `topics`.
    async fn kafka_rows_on(
        &self,
        brokers: &str,
        topics: &std::sync::Mutex<Vec<String>>,
        rows: &mut Vec<Row>,
    ) -> anyhow::Result<()> {
        use rdkafka::admin::AdminClient;
        use rdkafka::client::DefaultClientContext;
        let brokers = brokers.to_owned();
        let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()?;
        let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("linger.ms", "5")
            .set("queue.buffering.max.messages", "1000000")
            .create()?;
        let kafka_row = |mode: Mode, label: String, load: Load| {
            let (admin, producer, brokers) = (&admin, &producer, &brokers);
            async move {
                let topic = format!("bench-{label}-{}", self.run_id);
                create_topic(admin, &topic, self.args.partitions).await?;
                topics.lock().unwrap().push(topic.clone());
                let name = format!("bench-kafka-{label}-{}", self.run_id);
                let config =
                    txinbox_kafka::KafkaConfig::new(brokers.clone(), format!("g-{name}"), name.clone())
                        .topic(topic.clone())
                        .max_buffered_per_partition(load.window as usize);
                let source = txinbox_kafka::KafkaSource::new(config, self.inbox())?;
                let publisher = Publisher::Kafka {
                    producer: producer.clone(),
                    topic: topic.clone(),
                    partitions: self.args.partitions,
                };
                let row = self
                    .row(
                        "kafka",
                        mode,
                        &name,
                        source,
                        publisher,
                        Some(IdStrategy::Offset),
                        load,
                    )
                    .await;
                row
            }
        };
        let window = self
            .window_for("kafka", |n, w| {
                kafka_row(Mode::Raw, format!("window-{w}"), Load::saturated(n, w))
            })
            .await?;
        self.source_rows("kafka", window, rows, kafka_row).await?;

        let topic = format!("bench-peer-{}", self.run_id);
        create_topic(&admin, &topic, self.args.partitions).await?;
        topics.lock().unwrap().push(topic.clone());
        let publisher = Publisher::Kafka {
            producer: producer.clone(),
            topic: topic.clone(),
            partitions: self.args.partitions,
        };
        let (pool, brokers_, topic_, group) = (
            self.pool.clone(),
            brokers.clone(),
            topic.clone(),
            format!("g-bench-peer-{}", self.run_id),
        );
        let row = self
            .peer_row(
                "kafka",
                publisher,
                window,
                "hand-written: rdkafka StreamConsumer + sqlx, a transaction per message, offset stored after COMMIT",
                move |probe| kafka_peer(pool, brokers_, topic_, group, probe),
            )
            .await;
        let row = row?;
        print_row(&row);
        rows.push(row);
        Ok(())
    }

    async fn amqp_rows(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
        let url =
            std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let conn = match tokio::time::timeout(
            Duration::from_secs(5),
            lapin::Connection::connect(&url, lapin::ConnectionProperties::default()),
        )
        .await
        {
            Ok(Ok(conn)) => conn,
            _ => {
                println!("amqp: SKIPPED, no RabbitMQ at AMQP_URL (default 127.0.0.1:5672)");
                return Ok(());
            }
        };
        let channel = conn.create_channel().await?;
        let amqp_row = |mode: Mode, label: String, load: Load| {
            let (channel, url) = (&channel, &url);
            async move {
                let queue = format!("bench-{label}-{}", self.run_id);
                // Declared before publishing (as the adapter declares it: durable, no arguments).
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        lapin::options::QueueDeclareOptions {
                            durable: true,
                            ..Default::default()
                        },
                        lapin::types::FieldTable::default(),
                    )
                    .await?;
                let name = format!("bench-amqp-{label}-{}", self.run_id);
                let prefetch = (load.window.min(u16::MAX as u64)) as u16;
                let config = txinbox_amqp::AmqpConfig::new(url.clone(), queue.clone()).prefetch(prefetch);
                let source = txinbox_amqp::AmqpSource::connect(config).await?;
                let publisher = Publisher::Amqp {
                    channel: channel.clone(),
                    queue: queue.clone(),
                };
                let row = self.row("amqp", mode, &name, source, publisher, None, load).await;
                for q in [queue.clone(), format!("{queue}.retry"), format!("{queue}.dlq")] {
                    let _ = channel
                        .queue_delete(q.as_str().into(), lapin::options::QueueDeleteOptions::default())
                        .await;
                }
                row
            }
        };
        let window = self
            .window_for("amqp", |n, w| {
                amqp_row(Mode::Raw, format!("window-{w}"), Load::saturated(n, w))
            })
            .await?;
        self.source_rows("amqp", window, rows, amqp_row).await?;

        let queue = format!("bench-peer-{}", self.run_id);
        channel
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await?;
        let publisher = Publisher::Amqp {
            channel: channel.clone(),
            queue: queue.clone(),
        };
        let (pool, url_, queue_) = (self.pool.clone(), url.clone(), queue.clone());
        let prefetch = (window.min(u16::MAX as u64)) as u16;
        let row = self
            .peer_row(
                "amqp",
                publisher,
                window,
                "hand-written: lapin basic_consume + sqlx, a transaction per message, ack after COMMIT",
                move |probe| amqp_peer(pool, url_, queue_, prefetch, probe),
            )
            .await;
        let _ = channel
            .queue_delete(
                queue.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await;
        let row = row?;
        print_row(&row);
        rows.push(row);
        Ok(())
    }

    /// Starts a row on a clean slate: a CHECKPOINT, so that no row pays for the WAL another
    /// row wrote (a checkpoint forced by `max_wal_size` in the middle of a row slows it by
    /// tens of percent). Best effort: without the privilege (PostgreSQL 15: superuser or
    /// `pg_checkpoint`) the rows run as they are.
    async fn checkpoint(&self) {
        if let Err(e) = self.pool.execute("CHECKPOINT").await {
            tracing::debug!(error = %e, "CHECKPOINT before a row failed; rows may share checkpoints");
        }
    }

    /// pgbench, `clients` connections for `seconds`, each transaction inserting `batch` inbox
    /// rows and `batch` effect rows: what PostgreSQL itself commits on this machine.
    fn pgbench(&self, batch: usize) -> anyhow::Result<Row> {
        let script = format!(
            "BEGIN;\n\
             INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at, source_system, destination) SELECT 'pgbench', 'pgb-' || nextval('bench_pgb_seq'), 'native', decode(repeat('00', 32), 'hex'), 'processed', 1, now(), 'memory', 'bench' FROM generate_series(1, {batch}) ON CONFLICT (consumer, message_id) DO NOTHING;\n\
             INSERT INTO bench_effects (message_id, bytes) SELECT 'pgb', g FROM generate_series(1, {batch}) g;\n\
             COMMIT;\n"
        );
        let path = std::env::temp_dir().join(format!("txinbox-bench-{}-{batch}.sql", self.run_id));
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
            mode: if batch == 1 { "per_message" } else { "batched" },
            messages: transactions as u64 * batch as u64,
            msgs_per_sec: tps * batch as f64,
            p50_ms: None,
            p99_ms: None,
            peak_rss_mb: None,
            cpu,
            note: format!(
                "{batch} inbox + {batch} effect rows per transaction, -c {clients} -j 2 -M prepared, {}s; latency avg {} ms",
                self.args.pgbench_seconds,
                latency.map_or("?".into(), |l| format!("{l:.2}"))
            ),
        })
    }

    async fn prefilled_row(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
        let n = self.args.prefill_rows;
        let name = format!("bench-prefilled-{}", self.run_id);
        println!("prefilling the inbox with {n} rows (generate_series)...");
        let started = Instant::now();
        sqlx::query(
            "INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at, source_system, destination)
             SELECT $1, 'pre-' || g, 'native', decode(repeat('00', 32), 'hex'), 'processed', 1, now(), 'memory', 'bench'
             FROM generate_series(1, $2::bigint) g",
        )
        .bind(&name)
        .bind(n as i64)
        .execute(&self.pool)
        .await?;
        self.pool.execute("VACUUM ANALYZE txinbox.inbox").await?;
        println!("prefilled in {:.0}s", started.elapsed().as_secs_f64());
        let broker = MemoryBroker::new("bench");
        let mut row = self
            .row(
                "memory",
                Mode::Batched,
                &name,
                broker.source(),
                Publisher::Memory(broker.clone()),
                None,
                Load::saturated(
                    self.count(Mode::Batched),
                    self.args.window.unwrap_or(MEMORY_WINDOW),
                ),
            )
            .await?;
        row.source = format!("memory+{}M rows", n as f64 / 1e6);
        print_row(&row);
        rows.push(row);
        Ok(())
    }

    async fn memory_run(&self) -> anyhow::Result<()> {
        let n = self.args.memory_run;
        println!(
            "\nlong run: {n} messages, memory source, batched; RSS every {}:",
            n / 10
        );
        reset_peak_rss();
        let broker = MemoryBroker::new("bench");
        let probe = Probe::new(n + 1);
        let sampler = {
            let probe = probe.clone();
            tokio::spawn(async move {
                let step = (n / 10).max(1);
                let mut next = step;
                while next <= n {
                    if probe.settled() >= next {
                        println!(
                            "  {:>9} settled  RSS {:>6.1} MiB  peak {:>6.1} MiB",
                            next,
                            rss_mb("VmRSS:").unwrap_or(f64::NAN),
                            rss_mb("VmHWM:").unwrap_or(f64::NAN)
                        );
                        next += step;
                    } else {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        };
        let publishing = tokio::spawn(publish_loop(
            Publisher::Memory(broker.clone()),
            Load::saturated(n, self.args.window.unwrap_or(MEMORY_WINDOW)),
            probe.clone(),
        ));
        let done = probe.clone();
        let consumer = Consumer::builder(format!("bench-long-{}", self.run_id))
            .source(Timed {
                inner: broker.source(),
                probe: probe.clone(),
            })
            .inbox(self.inbox())
            .handler(Effects)
            .concurrency(self.args.concurrency)
            .max_in_flight(self.args.max_in_flight)
            .batch_size(self.args.batch_size)
            .build()?;
        tokio::spawn(consumer.run_until(async move { done.wait_done().await })).await??;
        publishing.await??;
        sampler.await?;
        println!(
            "  {n} messages in {:.1}s ({:.0} msg/s)",
            probe.elapsed().as_secs_f64(),
            n as f64 / probe.elapsed().as_secs_f64()
        );
        Ok(())
    }
}

async fn reachable(brokers: &str) -> bool {
    let first = brokers.split(',').next().unwrap_or_default().to_owned();
    matches!(
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(first)).await,
        Ok(Ok(_))
    )
}

fn fmt_opt(v: Option<f64>, width: usize) -> String {
    match v {
        Some(v) if v >= 100.0 => format!("{v:>width$.0}"),
        Some(v) => format!("{v:>width$.2}"),
        None => format!("{:>width$}", "-"),
    }
}

async fn create_topic(
    admin: &rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>,
    topic: &str,
    partitions: i32,
) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?;
    for r in results {
        r.map_err(|(t, e)| anyhow::anyhow!("creating topic {t}: {e}"))?;
    }
    Ok(())
}

/// One message the hand-written way: a `processed_ids` row and, if it is new, the effect, in one
/// transaction. Returns once it has committed.
async fn apply_once(pool: &PgPool, consumer: &str, id: &str, bytes: usize) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let fresh =
        sqlx::query("INSERT INTO bench_processed_ids (consumer, id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(consumer)
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
    if fresh {
        sqlx::query("INSERT INTO bench_effects (message_id, bytes) VALUES ($1, $2)")
            .bind(id)
            .bind(bytes as i64)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The Kafka consumer users write without txinbox: `StreamConsumer`, one message at a time,
/// its offset stored for the auto-commit only after the transaction committed.
async fn kafka_peer(
    pool: PgPool,
    brokers: String,
    topic: String,
    group: String,
    probe: Arc<Probe>,
) -> anyhow::Result<()> {
    use rdkafka::consumer::{Consumer as _, StreamConsumer};
    use rdkafka::Message as _;
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&topic])?;
    loop {
        let m = consumer.recv().await?;
        let id = format!("{}-{}-{}", m.topic(), m.partition(), m.offset());
        let payload = m.payload().unwrap_or_default();
        apply_once(&pool, &group, &id, payload.len()).await?;
        consumer.store_offset_from_message(&m)?;
        probe.record(sent_at(payload));
    }
}

/// The RabbitMQ consumer users write without txinbox: `basic_consume` with a prefetch, one
/// delivery at a time, acknowledged after the transaction committed.
async fn amqp_peer(
    pool: PgPool,
    url: String,
    queue: String,
    prefetch: u16,
    probe: Arc<Probe>,
) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    let conn = lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(prefetch, lapin::options::BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "bench-peer".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await?;
    while let Some(delivery) = deliveries.next().await {
        let delivery = delivery?;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .context("a message without message_id")?;
        apply_once(&pool, "bench-peer", &id, delivery.data.len()).await?;
        delivery.ack(lapin::options::BasicAckOptions::default()).await?;
        probe.record(sent_at(&delivery.data));
    }
    bail!("the RabbitMQ consumer ended")
}

fn header() {
    println!(
        "{:<18} {:<12} {:>9} {:>10} {:>9} {:>9} {:>10} {:>9}  note",
        "source", "mode", "messages", "msg/s", "p50 ms", "p99 ms", "peak MiB", "cpu %"
    );
}

fn print_row(r: &Row) {
    println!(
        "{:<18} {:<12} {:>9} {:>10.0} {} {} {} {:>9}  {}",
        r.source,
        r.mode,
        r.messages,
        r.msgs_per_sec,
        fmt_opt(r.p50_ms, 9),
        fmt_opt(r.p99_ms, 9),
        fmt_opt(r.peak_rss_mb, 10),
        r.cpu
            .map_or("-".into(), |c| format!("{:.0}/{:.0}", c.process, c.machine)),
        r.note
    );
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
    let mut conn = admin
        .connect()
        .await
        .context("connecting to PostgreSQL at DATABASE_URL (is it running?)")?;
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
            for batch in [1, args.batch_size] {
                bench.checkpoint().await;
                match bench.pgbench(batch) {
                    Ok(row) => {
                        print_row(&row);
                        rows.push(row);
                    }
                    Err(e) => println!("pgbench: SKIPPED, {e:#}"),
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
            if let (Some(b), Some(g)) = (rate(source, "batched"), rate("pgbench", "batched")) {
                println!("{source}: batched / pgbench batched = {:.0}%", 100.0 * b / g);
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
