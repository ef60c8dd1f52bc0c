//! The harness's flags, and the brokers and phases they choose.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use txinbox_demos::flags;

/// Runs the ledger under a crash matrix and checks that nothing was lost or doubled.
#[derive(Debug, Parser)]
#[command(name = "chaos")]
#[command(mut_arg("database_url", |a| a.help(
    "PostgreSQL URL of a role that may create databases; each broker's run gets its own"
)))]
pub(crate) struct Args {
    /// Which broker(s) to run against.
    #[arg(long, value_enum, default_value = "all", env = "CHAOS_SOURCE")]
    pub(crate) source: Which,
    /// Unique payment events to publish per broker.
    #[arg(long, default_value_t = 2000, env = "CHAOS_EVENTS", value_parser = clap::value_parser!(u32).range(10..))]
    pub(crate) events: u32,
    /// Percentage of the events published twice.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub(crate) duplicate_percent: u32,
    /// Malformed payloads to publish per broker (each must end as a dead letter).
    #[arg(long, default_value_t = 4)]
    pub(crate) malformed: usize,
    /// SIGKILLs at random moments per broker (fewer if the time budget runs out).
    #[arg(long, default_value_t = 4)]
    pub(crate) random_kills: u32,
    /// Seconds for the whole run, all brokers together; the crash points always run, random
    /// kills fill the rest.
    #[arg(long, default_value_t = 120, env = "CHAOS_TIME_BUDGET")]
    pub(crate) time_budget: u64,
    #[command(flatten)]
    pub(crate) kafka: flags::Kafka,
    /// The ledger's Kafka `session.timeout.ms`: how long the group waits for a killed member
    /// before a restarted one gets its partitions. Apache Kafka refuses less than its
    /// `group.min.session.timeout.ms` (6000 by default).
    #[arg(long, default_value_t = 6000)]
    pub(crate) kafka_session_timeout_ms: u32,
    /// Extra librdkafka properties for every Kafka ledger, KEY=VALUE (repeatable), e.g.
    /// `debug=cgrp` with `CHAOS_LEDGER_LOG=info,librdkafka=debug` to see the group protocol in
    /// the ledgers' logs.
    #[arg(long)]
    pub(crate) ledger_kafka_property: Vec<String>,
    /// The Kafka ledgers' `--kafka-ordering`, comma-separated: each ledger started takes the
    /// next one in turn, so one run crashes and restarts ledgers of every ordering given, and
    /// the storm's members differ (`partition,key`: a rolling change of ordering under crashes).
    #[arg(long, value_delimiter = ',', default_value = "partition")]
    pub(crate) kafka_ordering: Vec<txinbox_kafka::Ordering>,
    #[command(flatten)]
    pub(crate) amqp: flags::Amqp,
    #[command(flatten)]
    pub(crate) postgres: flags::Postgres,
    /// The ledger binary (built with `--features crash-points`). Default: `ledger` next to
    /// this program.
    #[arg(long, env = "CHAOS_LEDGER")]
    pub(crate) ledger: Option<PathBuf>,
    /// Crash points that may go unreached without failing the run (comma-separated; none by
    /// default: every point applies to the ledger on the default batching configuration).
    #[arg(long, value_delimiter = ',')]
    pub(crate) allow_unreached: Vec<String>,
    /// Seed for every random choice (printed at the start of each run).
    #[arg(long, env = "CHAOS_SEED")]
    pub(crate) seed: Option<u64>,
    /// Keep the databases, topics and queues even after a clean run.
    #[arg(long)]
    pub(crate) keep: bool,
    /// Matrix and storm: run each ledger under a new consumer name, so the inbox cannot
    /// deduplicate across restarts and the run must FAIL with doubled payments. Outage: every
    /// ledger acknowledges each delivery before its transaction, so the run must FAIL with
    /// acknowledgements during the outage (and lost payments). Proves the checks can fail.
    #[arg(long)]
    pub(crate) sabotage: bool,
    /// What to run (comma-separated): `matrix` (per broker: crash points, random kills, a final
    /// run; bounded by --time-budget), `storm` (Kafka: a rebalance storm of three members on
    /// six partitions), `outage` (PostgreSQL crashed and restarted under both brokers).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "matrix")]
    pub(crate) phases: Vec<Phase>,
    /// Storm: unique payment events, published while the members churn.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(10..))]
    pub(crate) storm_events: u32,
    /// Storm: seconds of kills, graceful stops and restarts (then every member drains).
    #[arg(long, default_value_t = 40)]
    pub(crate) storm_seconds: u64,
    /// Outage: unique payment events per broker.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(10..))]
    pub(crate) outage_events: u32,
    /// Outage: seconds PostgreSQL stays down at least: more than librdkafka's 5 s auto-commit
    /// interval, so that an offset stored without a commit would reach the group meanwhile.
    /// Longer if the group has not yet begun to hand the killed Kafka member's partitions over.
    #[arg(long, default_value_t = 10)]
    pub(crate) outage_seconds: u64,
    /// Outage: the directory of PostgreSQL's server programs (initdb, pg_ctl) for the private
    /// cluster the outage stops and starts. Default: the newest /usr/lib/postgresql/*/bin.
    #[arg(long, env = "TXINBOX_PG_BIN")]
    pub(crate) pg_bin: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Which {
    All,
    Kafka,
    Amqp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Phase {
    Matrix,
    Storm,
    Outage,
}

impl Phase {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Phase::Matrix => "matrix",
            Phase::Storm => "storm",
            Phase::Outage => "outage",
        }
    }
}
