//! The broker under test, Kafka or RabbitMQ, behind one set of questions.

use txinbox::crash;
use txinbox::sqlx::PgPool;

use crate::brokers::{Amqp, Kafka};
use crate::events::Outgoing;

/// The broker under test.
pub(crate) enum Side {
    Kafka(Kafka),
    Amqp(Box<Amqp>),
}

impl Side {
    pub(crate) fn ledger_args(&self) -> Vec<String> {
        match self {
            Side::Kafka(k) => k.ledger_args(),
            Side::Amqp(a) => a.ledger_args(),
        }
    }

    pub(crate) fn name(&self) -> String {
        match self {
            Side::Kafka(k) => format!("topic {}", k.topic()),
            Side::Amqp(a) => format!("{} queue {}", a.queue_type(), a.queue()),
        }
    }

    pub(crate) async fn publish(&self, messages: &[Outgoing]) -> anyhow::Result<()> {
        match self {
            Side::Kafka(k) => k.publish(messages).await,
            Side::Amqp(a) => a.publish(messages).await,
        }
    }

    pub(crate) async fn consumed(&self, pool: &PgPool) -> anyhow::Result<bool> {
        match self {
            Side::Kafka(k) => k.consumed(pool).await,
            Side::Amqp(a) => a.consumed().await,
        }
    }

    pub(crate) async fn unacknowledged(&self, pool: &PgPool) -> anyhow::Result<(u64, Vec<String>)> {
        match self {
            Side::Kafka(k) => k.unacknowledged(pool).await,
            Side::Amqp(a) => a.unacknowledged().await,
        }
    }

    pub(crate) async fn delete(&self) -> anyhow::Result<()> {
        match self {
            Side::Kafka(k) => k.delete().await,
            Side::Amqp(a) => a.delete().await,
        }
    }

    /// The points in the order they are run, each on its own share of the first wave:
    /// `rebalance` first (a revocation while a second member joins), then the message path.
    pub(crate) fn points(&self) -> Vec<&'static str> {
        let mut points = Vec::new();
        if matches!(self, Side::Kafka(_)) {
            points.push(crash::REBALANCE);
        }
        points.extend([
            crash::AFTER_CLAIM,
            crash::AFTER_HANDLER,
            crash::AFTER_COMMIT,
            crash::BATCH_OPEN,
        ]);
        points
    }
}
