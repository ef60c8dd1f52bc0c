//! The bench's flags: what each row measures and how hard it pushes.

use anyhow::{bail, Context as _};

#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub(crate) messages: u64,
    pub(crate) per_message: u64,
    pub(crate) sources: Vec<String>,
    pub(crate) batch_size: usize,
    pub(crate) linger_ms: u64,
    pub(crate) concurrency: usize,
    pub(crate) max_in_flight: usize,
    /// `None`: searched per broker (see `Bench::window_for`).
    pub(crate) window: Option<u64>,
    pub(crate) partitions: i32,
    pub(crate) json: Option<String>,
    pub(crate) prefill_rows: u64,
    pub(crate) memory_run: u64,
    pub(crate) pgbench: bool,
    pub(crate) pgbench_seconds: u32,
    /// How long each fixed-rate row publishes (0: no fixed-rate rows).
    pub(crate) paced_seconds: u64,
    /// A broker that cannot be reached fails the run instead of being skipped.
    pub(crate) require_brokers: bool,
    /// Messages of each sleeping-handler row (0: none).
    pub(crate) sleep_messages: u64,
    /// The sleeping handler's sleep, and the bound its second row sets.
    pub(crate) sleep_ms: u64,
    pub(crate) batch_max_ms: u64,
    /// Pairs of health cost rows (tracking on, then off; 0: none).
    pub(crate) health_pairs: u32,
    /// The kinds of rows to run (`None`: all of [`MODES`]).
    pub(crate) modes: Option<Vec<String>>,
    /// Messages of each key-ordering row (Kafka; 0: none), their handler's sleep, the keys,
    /// and the consumer's concurrency in those rows.
    pub(crate) key_messages: u64,
    pub(crate) key_sleep_ms: u64,
    pub(crate) key_keys: u64,
    pub(crate) key_concurrency: usize,
    /// The Kafka consumer's ordering in the Kafka rows other than `keys` (partition by default).
    pub(crate) kafka_ordering: txinbox_kafka::Ordering,
}

/// The kinds of rows `--modes` selects from: `paced` is the fixed-rate rows, `sleep` the
/// sleeping handler's (memory), `health` the health cost pairs (memory), `keys` partition
/// against key ordering with a slow handler (Kafka).
pub(crate) const MODES: [&str; 8] = [
    "raw",
    "per_message",
    "batched",
    "paced",
    "peer",
    "sleep",
    "health",
    "keys",
];

impl Args {
    /// Whether rows of kind `mode` (one of [`MODES`]) run.
    pub(crate) fn runs(&self, mode: &str) -> bool {
        self.modes.as_ref().is_none_or(|m| m.iter().any(|x| x == mode))
    }
}

pub(crate) fn parse_args() -> anyhow::Result<Args> {
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
        require_brokers: false,
        sleep_messages: 0,
        sleep_ms: 5,
        batch_max_ms: 50,
        health_pairs: 5,
        modes: None,
        key_messages: 8000,
        key_sleep_ms: 20,
        key_keys: 10_000,
        key_concurrency: 64,
        kafka_ordering: txinbox_kafka::Ordering::Partition,
    };
    let mut sleep_messages_set = false;
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
            "--require-brokers" => a.require_brokers = true,
            "--sleep-messages" => {
                a.sleep_messages = value()?.parse()?;
                sleep_messages_set = true;
            }
            "--sleep-ms" => a.sleep_ms = value()?.parse()?,
            "--batch-max-ms" => a.batch_max_ms = value()?.parse()?,
            "--health-pairs" => a.health_pairs = value()?.parse()?,
            "--modes" => a.modes = Some(value()?.split(',').map(str::to_owned).collect()),
            "--key-messages" => a.key_messages = value()?.parse()?,
            "--key-sleep-ms" => a.key_sleep_ms = value()?.parse()?,
            "--key-keys" => a.key_keys = value()?.parse()?,
            "--key-concurrency" => a.key_concurrency = value()?.parse()?,
            "--kafka-ordering" => a.kafka_ordering = value()?.parse().map_err(anyhow::Error::msg)?,
            "--help" | "-h" => {
                println!(
                    "cargo run --release --example bench -- [--messages N (50000)] [--per-message N (min(messages, 10000))]\n  \
                     [--sources memory,kafka,amqp] [--batch-size N (100)] [--linger-ms N (0)] [--concurrency N (8)]\n  \
                     [--max-in-flight N (2048)] \
                     [--window N (searched per broker; memory 2000)] [--partitions N (8)] [--json PATH] [--prefill-rows N] [--memory-run N]\n  \
                     [--no-pgbench] [--pgbench-seconds N (5)] [--paced-seconds N (10; 0: no fixed-rate rows)]\n  \
                     [--require-brokers (an unreachable broker fails the run)]\n  \
                     [--sleep-messages N (min(messages, 4000); 0: no sleeping-handler rows)] [--sleep-ms N (5)] [--batch-max-ms N (50)]\n  \
                     [--health-pairs N (5; 0: no health cost rows)]\n  \
                     [--key-messages N (8000; 0: no key-ordering rows)] [--key-sleep-ms N (20)] [--key-keys N (10000)] [--key-concurrency N (64)]\n  \
                     [--kafka-ordering partition|key|key-or-unordered|unordered (partition; the Kafka rows but keys)]\n  \
                     [--modes raw,per_message,batched,paced,peer,sleep,health,keys (all)]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}; see --help"),
        }
    }
    if a.per_message == 0 {
        a.per_message = a.messages.min(10_000);
    }
    if !sleep_messages_set {
        a.sleep_messages = a.messages.min(4_000);
    }
    if let Some(bad) = a
        .sources
        .iter()
        .find(|s| !["memory", "kafka", "amqp"].contains(&s.as_str()))
    {
        bail!("unknown source {bad:?}: use memory, kafka, amqp");
    }
    if let Some(bad) = a.modes.iter().flatten().find(|m| !MODES.contains(&m.as_str())) {
        bail!("unknown mode {bad:?}: use {}", MODES.join(", "));
    }
    Ok(a)
}
