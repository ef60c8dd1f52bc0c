//! The connection flags the `ledger`, the `observability` example and the crash matrix
//! (`tools/chaos`) share, each one struct to `#[command(flatten)]` into a program's own flags:
//! same names, environment variables, defaults and help text everywhere. Three structs rather
//! than one, so that a program takes only the flags it uses (the observability example has no
//! RabbitMQ).

/// `--database-url` / `DATABASE_URL`.
#[derive(Debug, Clone, clap::Args)]
pub struct Postgres {
    /// PostgreSQL: where the balances, the ledger entries and the inbox live. Its value is never
    /// printed.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
}

/// `--brokers` / `KAFKA_BROKERS`.
#[derive(Debug, Clone, clap::Args)]
pub struct Kafka {
    /// Kafka: bootstrap brokers, comma-separated host:port (use 127.0.0.1 rather than localhost for
    /// brokers that listen on IPv4 only).
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
}

/// `--amqp-url` / `AMQP_URL`.
#[derive(Debug, Clone, clap::Args)]
pub struct Amqp {
    /// AMQP: the broker URI (`amqps://` for TLS). Its value is never printed.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
}
