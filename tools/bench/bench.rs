//! How one row is measured: a source consumed raw or through a consumer, or a hand-written
//! peer, under a publisher's load; the window search; a broker's saturated and fixed-rate rows.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use txinbox::position::ConsumerPositions;
use txinbox::sqlx::postgres::PgPool;
use txinbox::sqlx::Executor;
use txinbox::{source::Settlement, Consumer, Delivery as _, IdStrategy, MessageSource, PostgresInbox};

use crate::args::Args;
use crate::effects::{slow_transactions, Effects, Sleepy, HANDLED, HANDLER_CALLS};
use crate::measure::{reset_peak_rss, rss_mb, Probe};
use crate::publish::{publish_loop, Load, Publisher};
use crate::report::{paced_mode, print_row, Mode, Row};
use crate::timed::Timed;

/// How a row's consumer differs from the standard one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Variant {
    /// A per-message handler that sleeps this long (waiting on slow I/O) instead of [`Effects`].
    pub(crate) sleep: Option<Duration>,
    /// [`ConsumerBuilder::batch_max_duration`](txinbox::ConsumerBuilder::batch_max_duration).
    pub(crate) batch_max_duration: Option<Duration>,
    /// Lane health tracking (on in every consumer but the health cost row's "off").
    pub(crate) track_lanes: bool,
    /// The consumer's `concurrency` when not `--concurrency`.
    pub(crate) concurrency: Option<usize>,
}

impl Default for Variant {
    fn default() -> Self {
        Variant {
            sleep: None,
            batch_max_duration: None,
            track_lanes: true,
            concurrency: None,
        }
    }
}

impl Variant {
    /// What the row's note says about it: for a sleeping handler, how many messages its
    /// transactions held and how long they ran (from the handlers' own reports).
    fn describe(&self) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(sleep) = self.sleep {
            let txs = slow_transactions();
            let (count, handled) = (txs.len().max(1) as f64, txs.values().map(|t| t.0).sum::<u64>());
            let mean_ms = txs.values().map(|t| t.1).sum::<f64>() / count;
            let longest_ms = txs.values().map(|t| t.1).fold(0.0, f64::max);
            parts.push(format!(
                "handler sleeps {} ms, batch_max_duration {}; {:.1} messages per transaction, transactions run {mean_ms:.0} ms on average, {longest_ms:.0} ms at most (to the last handler's end)",
                sleep.as_millis(),
                self.batch_max_duration
                    .map_or("none".to_owned(), |d| format!("{} ms", d.as_millis())),
                handled as f64 / count,
            ));
        }
        if !self.track_lanes {
            parts.push("lane health tracking off".to_owned());
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

pub(crate) struct Bench {
    pub(crate) args: Args,
    pub(crate) pool: PgPool,
    pub(crate) url: String,
    pub(crate) run_id: String,
}

impl Bench {
    pub(crate) fn inbox(&self) -> PostgresInbox {
        PostgresInbox::new(self.pool.clone())
    }

    /// Consumes `n` messages from `source` (fed by `publisher`) in `mode`, as consumer `name`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn row<Src: MessageSource>(
        &self,
        label: &str,
        mode: Mode,
        name: &str,
        source: Src,
        publisher: Publisher,
        id_strategy: Option<IdStrategy>,
        load: Load,
    ) -> anyhow::Result<Row> {
        self.row_with(
            label,
            mode,
            name,
            source,
            publisher,
            id_strategy,
            load,
            Variant::default(),
        )
        .await
    }

    /// [`row`](Self::row) with a consumer set up as `variant` says (the handler, the batch
    /// duration bound, lane health tracking).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn row_with<Src: MessageSource>(
        &self,
        label: &str,
        mode: Mode,
        name: &str,
        source: Src,
        publisher: Publisher,
        id_strategy: Option<IdStrategy>,
        load: Load,
        variant: Variant,
    ) -> anyhow::Result<Row> {
        let n = load.n;
        let concurrency = variant.concurrency.unwrap_or(self.args.concurrency);
        self.checkpoint().await;
        reset_peak_rss();
        let probe = Probe::new(n + 1);
        let timed = Timed {
            inner: source,
            probe: probe.clone(),
        };
        HANDLER_CALLS.store(0, Ordering::Relaxed);
        HANDLED.store(0, Ordering::Relaxed);
        slow_transactions().clear();
        let publishing = tokio::spawn(publish_loop(publisher, load, probe.clone()));
        match mode {
            Mode::Raw => {
                let mut source = timed;
                // No consumer builds this source, so nothing hands it a consumer's positions;
                // a source that resumes from the database's positions (Kafka) refuses to read
                // without them. The row's own name has none stored: every lane starts at the
                // beginning, as a new consumer's would.
                source.attach_positions(ConsumerPositions::new(name, self.inbox()));
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
                // A row with a concurrency of its own gets a pool to match (the keys rows, 64);
                // every other row shares the run's pool of `--concurrency` + 2. One pool sized
                // for the keys rows (66) cost the one-message rows 7–20 % (alternated runs,
                // `--key-concurrency 64` against 8).
                let inbox = match variant.concurrency {
                    Some(c) if c != self.args.concurrency => PostgresInbox::new(
                        txinbox::sqlx::postgres::PgPoolOptions::new()
                            .max_connections(c as u32 + 2)
                            .connect_with((*self.pool.connect_options()).clone())
                            .await?,
                    ),
                    _ => self.inbox(),
                };
                let mut builder = Consumer::builder(name)
                    .source(timed)
                    .inbox(inbox)
                    .handler(())
                    .concurrency(concurrency)
                    .max_in_flight(self.args.max_in_flight)
                    .batch_size(batch_size)
                    .batch_linger(Duration::from_millis(self.args.linger_ms));
                if let Some(s) = id_strategy {
                    builder = builder.id_strategy(s);
                }
                if let Some(max) = variant.batch_max_duration {
                    builder = builder.batch_max_duration(max);
                }
                if !variant.track_lanes {
                    builder = builder.untracked_lanes_for_benchmarks();
                }
                let probe_done = probe.clone();
                let done = async move { probe_done.wait_done().await };
                // Spawned, as the README advises: `main`'s own future runs outside the worker
                // threads, and every wake-up between it and them crosses threads.
                match variant.sleep {
                    None => {
                        let consumer = builder.handler(Effects).build()?;
                        tokio::spawn(consumer.run_until(done)).await??;
                    }
                    Some(sleep) => {
                        let consumer = builder.handler(Sleepy(sleep)).build()?;
                        tokio::spawn(consumer.run_until(done)).await??;
                    }
                }
            }
        }
        publishing.await??;
        let elapsed = probe.elapsed();
        let note = match mode {
            Mode::Raw => format!("no inbox: receive + ack; {}", load.describe()),
            Mode::PerMessage => format!("batch_size 1, concurrency {concurrency}; {}", load.describe()),
            Mode::Batched => format!(
                "batch_size {}, linger {} ms, concurrency {}, max_in_flight {}; {}; {:.0} messages per transaction",
                self.args.batch_size,
                self.args.linger_ms,
                concurrency,
                self.args.max_in_flight,
                load.describe(),
                HANDLED.load(Ordering::Relaxed) as f64 / HANDLER_CALLS.load(Ordering::Relaxed).max(1) as f64
            ),
        };
        let note = match variant.describe() {
            Some(v) => format!("{v}; {note}"),
            None => note,
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
    pub(crate) async fn peer_row<F, Fut>(
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

    pub(crate) fn count(&self, mode: Mode) -> u64 {
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
    pub(crate) async fn window_for<F, Fut>(&self, label: &str, mut raw: F) -> anyhow::Result<u64>
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

    /// A broker's rows: its window searched with raw rows (see [`window_for`](Self::window_for)),
    /// then raw, per_message and batched at saturation, then the fixed-rate rows. `row(mode,
    /// label, load)` measures one row (`label` names its topic or queue). Returns the window.
    pub(crate) async fn source_rows<F, Fut>(
        &self,
        source: &str,
        rows: &mut Vec<Row>,
        mut row: F,
    ) -> anyhow::Result<u64>
    where
        F: FnMut(Mode, String, Load) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<Row>>,
    {
        let window = self
            .window_for(source, |n, w| {
                row(Mode::Raw, format!("window-{w}"), Load::saturated(n, w))
            })
            .await?;
        for mode in [Mode::Raw, Mode::PerMessage, Mode::Batched] {
            if !self.args.runs(mode.as_str()) {
                continue;
            }
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
        Ok(window)
    }

    /// The fixed-rate rows of a source whose saturated rows are in `rows`: raw and batched,
    /// each at half the batched rate, for `--paced-seconds` (none if that is 0 or the source
    /// has no batched row).
    pub(crate) fn paced(&self, rows: &[Row], source: &str, window: u64) -> Vec<(Mode, Load)> {
        if !self.args.runs("paced") {
            return Vec::new();
        }
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

    /// Starts a row on a clean slate: a CHECKPOINT, so that no row pays for the WAL another
    /// row wrote (a checkpoint forced by `max_wal_size` in the middle of a row slows it by
    /// tens of percent). Best effort: without the privilege (PostgreSQL 15: superuser or
    /// `pg_checkpoint`) the rows run as they are.
    pub(crate) async fn checkpoint(&self) {
        if let Err(e) = self.pool.execute("CHECKPOINT").await {
            tracing::debug!(error = %e, "CHECKPOINT before a row failed; rows may share checkpoints");
        }
    }
}
