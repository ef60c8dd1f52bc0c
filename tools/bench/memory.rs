//! The memory source's rows: raw, per message and batched, the fixed-rate rows, the batched row
//! over a prefilled inbox, and the long run that prints the RSS as it goes.

use std::time::{Duration, Instant};

use txinbox::memory::MemoryBroker;
use txinbox::sqlx::{self, Executor};
use txinbox::Consumer;

use crate::bench::{Bench, Variant};
use crate::effects::Effects;
use crate::measure::{reset_peak_rss, rss_mb, Probe};
use crate::publish::{publish_loop, Load, Publisher};
use crate::report::{paced_mode, print_row, Mode, Row};
use crate::timed::Timed;

/// The memory source's window: it has no broker latency to cover.
pub(crate) const MEMORY_WINDOW: u64 = 2_000;

impl Bench {
    pub(crate) async fn memory_rows(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
        for mode in [Mode::Raw, Mode::PerMessage, Mode::Batched] {
            if !self.args.runs(mode.as_str()) {
                continue;
            }
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
        self.sleeping_rows(rows).await?;
        self.health_rows(rows).await
    }

    /// A handler waiting on slow I/O (it sleeps `--sleep-ms`), batched without and with
    /// `batch_max_duration` (`--batch-max-ms`): what the bound does to the rate, the
    /// transactions and the latency.
    async fn sleeping_rows(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
        if self.args.sleep_messages == 0 || !self.args.runs("sleep") {
            return Ok(());
        }
        let sleep = Duration::from_millis(self.args.sleep_ms);
        for (mode, bound) in [
            ("sleep", None),
            ("sleep+bound", Some(Duration::from_millis(self.args.batch_max_ms))),
        ] {
            let broker = MemoryBroker::new("bench");
            let name = format!("bench-memory-{}-{}", mode.replace('+', "-"), self.run_id);
            let load = Load::saturated(
                self.args.sleep_messages,
                self.args.window.unwrap_or(MEMORY_WINDOW),
            );
            let variant = Variant {
                sleep: Some(sleep),
                batch_max_duration: bound,
                ..Variant::default()
            };
            rows.push(self.variant_row(mode, &name, broker, load, variant).await?);
        }
        Ok(())
    }

    /// The cost of lane health tracking: the batched memory row with it on and off, in
    /// alternating pairs (`--health-pairs`), so that drift in the machine's speed hits both.
    async fn health_rows(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
        let pairs = if self.args.runs("health") {
            self.args.health_pairs
        } else {
            0
        };
        for pair in 0..pairs {
            for (mode, track_lanes) in [("health_on", true), ("health_off", false)] {
                let broker = MemoryBroker::new("bench");
                let name = format!("bench-memory-{mode}-{pair}-{}", self.run_id);
                let load = Load::saturated(
                    self.count(Mode::Batched),
                    self.args.window.unwrap_or(MEMORY_WINDOW),
                );
                let variant = Variant {
                    track_lanes,
                    ..Variant::default()
                };
                rows.push(self.variant_row(mode, &name, broker, load, variant).await?);
            }
        }
        Ok(())
    }

    /// One batched memory row under `variant`, printed, named `mode` in the table.
    async fn variant_row(
        &self,
        mode: &'static str,
        name: &str,
        broker: MemoryBroker,
        load: Load,
        variant: Variant,
    ) -> anyhow::Result<Row> {
        let publisher = Publisher::Memory(broker.clone());
        let mut row = self
            .row_with(
                "memory",
                Mode::Batched,
                name,
                broker.source(),
                publisher,
                None,
                load,
                variant,
            )
            .await?;
        row.mode = mode;
        print_row(&row);
        Ok(row)
    }

    pub(crate) async fn prefilled_row(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
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

    pub(crate) async fn memory_run(&self) -> anyhow::Result<()> {
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
