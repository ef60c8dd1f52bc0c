//! The RabbitMQ rows, on queues declared for each row and deleted after it.

use std::time::Duration;

use crate::bench::Bench;
use crate::peers::amqp_peer;
use crate::publish::{Load, Publisher};
use crate::report::{print_row, Mode, Row};

impl Bench {
    pub(crate) async fn amqp_rows(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
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
                let why = "no RabbitMQ at AMQP_URL (default 127.0.0.1:5672)";
                if self.args.require_brokers {
                    anyhow::bail!("amqp: {why}; --require-brokers makes that an error");
                }
                println!("amqp: SKIPPED, {why}");
                return Ok(());
            }
        };
        let channel = conn.create_channel().await?;
        let amqp_row = |mode: Mode, label: String, load: Load| {
            let (channel, url) = (&channel, &url);
            async move {
                let queue = format!("bench-{label}-{}", self.run_id);
                declare_queue(channel, &queue).await?;
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
        let window = self.source_rows("amqp", rows, amqp_row).await?;
        if !self.args.runs("peer") {
            return Ok(());
        }

        let queue = format!("bench-peer-{}", self.run_id);
        declare_queue(&channel, &queue).await?;
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
}

/// Declares `queue` before anything is published to it, as the adapter declares it: durable, no
/// arguments.
async fn declare_queue(channel: &lapin::Channel, queue: &str) -> anyhow::Result<()> {
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await?;
    Ok(())
}
