//! [`AmqpSource`] and the supervisor task that owns the connection.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};
use txinbox::{
    async_trait, source::Capabilities, source::RetryMode, source::SourceError, IdStrategy, MessageSource,
};

use crate::acks::{self, Ending};
use crate::config::{AmqpConfig, QueueType};
use crate::delivery::AmqpDelivery;
use crate::error::AmqpError;
use crate::shared::{AmqpMonitor, Generation, Shared};
use crate::telemetry;

/// How often the supervisor checks the connection and channel state, besides watching the
/// consumer stream.
const STATUS_CHECK: Duration = Duration::from_millis(500);
/// How often the work queue's depth is read (a passive `queue.declare` on a channel of its
/// own, off the delivery path) for [`telemetry::QUEUE_DEPTH`].
const DEPTH_INTERVAL: Duration = Duration::from_secs(5);
/// Longest wait for a graceful `basic.cancel` / `channel.close` / `connection.close`.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often copy queues the broker said do not exist are looked up again.
const MISSING_QUEUE_RECHECK: Duration = Duration::from_secs(10);

/// A RabbitMQ queue consumer for a txinbox [`Consumer`](txinbox::Consumer).
///
/// - [`receive`](MessageSource::receive) is cancellation safe: deliveries arrive through a
///   channel fed by a supervisor task, and leave it only when returned.
/// - Acks are sent only when the runtime settles after its commit, and only on the channel the
///   delivery came from, coalesced: one `basic.ack(multiple = true)` for a run of settled
///   deliveries, never covering one that is not settled (see [`AmqpDelivery`]). Closing sends
///   every settled ack before the channel closes.
/// - The supervisor rebuilds connection, channel, topology, QoS and consumer with backoff after
///   any loss (connection closed or dropped, channel error, server `basic.cancel`). Deliveries
///   of the lost channel can no longer be acked: the broker redelivers them and the inbox turns
///   the redelivery into a duplicate.
/// - Errors that retrying cannot fix (refused credentials or vhost, a missing queue when the
///   topology is not declared, a queue declared with other arguments) end the reconnect loop:
///   `receive` returns a fatal [`SourceError`] and the consumer stops.
/// - A delivery dropped without being settled sends nothing; the broker redelivers it when the
///   channel closes (at the latest at [`close`](MessageSource::close) or on a reconnect).
///
/// Capabilities: `system = "rabbitmq"`, [`RetryMode::Redeliver`] (retry queue),
/// [`IdStrategy::Native`] (the `message_id` property).
#[derive(Debug)]
pub struct AmqpSource {
    rx: mpsc::UnboundedReceiver<Result<AmqpDelivery, SourceError>>,
    shutdown: CancellationToken,
    _stop_on_drop: DropGuard,
    supervisor: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

static TAGS: AtomicU64 = AtomicU64::new(0);

impl AmqpSource {
    /// Validates `config`, connects, declares the topology (if configured), applies QoS and
    /// starts consuming; from then on a supervisor task keeps the subscription alive.
    ///
    /// The first connection must succeed (so bad credentials or an unreachable broker show
    /// up at startup); later losses are recovered without a restart. Must be called within a
    /// Tokio runtime.
    pub async fn connect(config: AmqpConfig) -> Result<AmqpSource, AmqpError> {
        config.validate()?;
        telemetry::describe();
        let shared = Arc::new(Shared {
            queue: config.queue.as_str().into(),
            retry_queue: ShortString::from(config.retry_queue_name()),
            dead_letter_queue: ShortString::from(config.dead_letter_queue_name()),
            lane_header: config.lane_header.clone(),
            publish_timeout: config.publish_timeout,
            requeue_delay: config.requeue_delay,
            monitor: AmqpMonitor::default(),
            health: std::sync::OnceLock::new(),
            missing_queues: std::sync::Mutex::new(Vec::new()),
            delivery_limit: config.delivery_limit_or_default(),
        });
        let tag = config.consumer_tag.clone().unwrap_or_else(|| {
            format!(
                "txinbox-{}-{}",
                std::process::id(),
                TAGS.fetch_add(1, Ordering::Relaxed)
            )
        });
        let mut supervisor = Supervisor {
            config,
            tag,
            shared: shared.clone(),
            tx: None,
            shutdown: CancellationToken::new(),
        };
        let session = supervisor.setup(1).await?;
        supervisor.went_up(&session, None);
        let (tx, rx) = mpsc::unbounded_channel();
        supervisor.tx = Some(tx);
        let shutdown = supervisor.shutdown.clone();
        let handle = tokio::spawn(supervisor.run(session));
        Ok(AmqpSource {
            rx,
            _stop_on_drop: shutdown.clone().drop_guard(),
            shutdown,
            supervisor: Some(handle),
            shared,
        })
    }

    /// A handle on the connection's health.
    pub fn monitor(&self) -> AmqpMonitor {
        self.shared.monitor.clone()
    }
}

#[async_trait]
impl MessageSource for AmqpSource {
    type Delivery = AmqpDelivery;

    /// Cancellation safe (an mpsc receive). Deliveries whose channel was lost while they waited
    /// here are dropped: the broker has already requeued them.
    async fn receive(&mut self) -> Result<Option<AmqpDelivery>, SourceError> {
        loop {
            match self.rx.recv().await {
                Some(Ok(d)) if !d.generation_alive() => {
                    self.shared.counter(telemetry::STALE_DROPPED, &[]).increment(1);
                    continue;
                }
                Some(Ok(d)) => return Ok(Some(d)),
                Some(Err(e)) => return Err(e),
                None => return Ok(None),
            }
        }
    }

    /// Reports the connection: connected while a consumer is registered on a live channel.
    fn attach_health(&mut self, health: txinbox::health::SourceHealth) {
        health.set_connected(self.shared.monitor.is_connected());
        let _ = self.shared.health.set(health);
        self.shared.report_missing_queues();
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            system: "rabbitmq",
            retry: RetryMode::Redeliver,
            default_id_strategy: IdStrategy::Native,
        }
    }

    /// Cancels the consumer and closes channel and connection. Deliveries still buffered (not
    /// returned by `receive`) are requeued by the broker when the channel closes.
    async fn close(mut self) -> Result<(), SourceError> {
        self.shutdown.cancel();
        self.rx.close();
        if let Some(handle) = self.supervisor.take() {
            match tokio::time::timeout(3 * CLOSE_TIMEOUT, handle).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(SourceError::fatal(format!("AMQP supervisor task failed: {e}"))),
                Err(_) => return Err(SourceError::fatal("closing the AMQP connection timed out")),
            }
        }
        Ok(())
    }
}

struct Session {
    conn: Arc<Connection>,
    /// The task sending the generation's coalesced acks ([`acks::flush`]).
    flusher: JoinHandle<()>,
    /// A channel of its own for reading the queue depth: a failed passive declare closes its
    /// channel, which must not be the consuming one.
    depth: Channel,
    consumer: lapin::Consumer,
    generation: Arc<Generation>,
}

enum End {
    Shutdown,
    Lost(String),
}

struct Supervisor {
    config: AmqpConfig,
    tag: String,
    shared: Arc<Shared>,
    tx: Option<mpsc::UnboundedSender<Result<AmqpDelivery, SourceError>>>,
    shutdown: CancellationToken,
}

impl Supervisor {
    async fn run(self, mut session: Session) {
        // Losses right after a reconnect (a poison frame lapin cannot parse, a queue deleted
        // again and again) back off across losses instead of reconnecting at handshake speed.
        let mut up_since = Instant::now();
        let mut quick_losses = 0u32;
        loop {
            let end = self.serve(&mut session).await;
            if let End::Shutdown = end {
                // Every settled ack goes out before the channel closes.
                session.generation.acks.end(Ending::Drain);
                if tokio::time::timeout(CLOSE_TIMEOUT, &mut session.flusher)
                    .await
                    .is_err()
                {
                    tracing::warn!(queue = %self.shared.queue, "sending the last acks timed out; those messages will be redelivered and deduplicated");
                }
            }
            self.went_down(&session);
            let reason = match end {
                End::Shutdown => {
                    self.close_gracefully(session).await;
                    return;
                }
                End::Lost(reason) => reason,
            };
            let lost_gen = session.generation.id;
            tracing::warn!(
                queue = %self.shared.queue,
                generation = lost_gen,
                %reason,
                "AMQP consumer lost; reconnecting (unacknowledged deliveries will be redelivered and deduplicated)"
            );
            abandon(session).await;
            let lost_at = Instant::now();
            quick_losses = if up_since.elapsed() < self.config.reconnect_max {
                quick_losses + 1
            } else {
                0
            };
            if quick_losses > 1 {
                let delay = self.backoff(quick_losses);
                tracing::warn!(queue = %self.shared.queue, quick_losses, ?delay, "AMQP consumer lost again soon after reconnecting; backing off");
                tokio::select! {
                    _ = self.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            let mut attempt = 0u32;
            session = loop {
                attempt += 1;
                let setup = tokio::select! {
                    _ = self.shutdown.cancelled() => return,
                    s = self.setup(lost_gen + 1) => s,
                };
                match setup {
                    Ok(s) => break s,
                    Err(e) => {
                        // Never fatal here: the first connect already proved the configuration,
                        // and conditions like a node or vhost down, or a queue re-created by an
                        // operator, pass. Fatal-looking errors are logged as errors.
                        let delay = self.backoff(attempt);
                        if e.is_fatal() {
                            tracing::error!(queue = %self.shared.queue, attempt, error = %e, ?delay, "AMQP reconnect refused; retrying with backoff");
                        } else {
                            tracing::warn!(queue = %self.shared.queue, attempt, error = %e, ?delay, "AMQP reconnect failed; retrying");
                        }
                        tokio::select! {
                            _ = self.shutdown.cancelled() => return,
                            _ = tokio::time::sleep(delay) => {}
                        }
                    }
                }
            };
            self.went_up(&session, Some(lost_at.elapsed()));
            up_since = Instant::now();
        }
    }

    /// Forwards deliveries until shutdown or a loss.
    async fn serve(&self, session: &mut Session) -> End {
        let Some(tx) = &self.tx else {
            return End::Shutdown;
        };
        let mut check = tokio::time::interval(STATUS_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut queues_checked: Option<Instant> = None;
        loop {
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => return End::Shutdown,
                next = session.consumer.next() => match next {
                    Some(Ok(d)) => {
                        let delivery = AmqpDelivery::new(d, session.generation.clone(), self.shared.clone());
                        if delivery.near_delivery_limit() {
                            tokio::spawn(replace_with_fresh_copy(delivery, tx.clone()));
                        } else if tx.send(Ok(delivery)).is_err() {
                            return End::Shutdown;
                        }
                    }
                    Some(Err(e)) => return End::Lost(format!("consumer error: {e}")),
                    None => {
                        return End::Lost(
                            "the broker cancelled the consumer (basic.cancel: queue deleted, or a failover)".into(),
                        )
                    }
                },
                _ = check.tick() => {
                    if !session.conn.status().connected() {
                        return End::Lost("connection closed".into());
                    }
                    if !session.generation.channel.status().connected() {
                        return End::Lost("channel closed".into());
                    }
                    // Once per connection, then while one is missing.
                    let due = queues_checked.is_none_or(|at| {
                        at.elapsed() >= MISSING_QUEUE_RECHECK && !self.shared.missing_queues().is_empty()
                    });
                    if !self.config.declare_topology && due {
                        self.check_copy_queues(&session.conn).await;
                        queues_checked = Some(Instant::now());
                    }
                }
            }
        }
    }

    fn went_up(&self, session: &Session, downtime: Option<Duration>) {
        let m = &self.shared.monitor.inner;
        m.generation.store(session.generation.id, Ordering::SeqCst);
        m.connected.store(true, Ordering::SeqCst);
        metrics::gauge!(telemetry::CONNECTED, "queue" => self.shared.queue.to_string()).set(1.0);
        if let Some(health) = self.shared.health.get() {
            health.set_connected(true);
        }
        tokio::spawn(report_depth(
            session.depth.clone(),
            session.generation.clone(),
            self.shared.queue.clone(),
            self.shutdown.clone(),
        ));
        if let Some(downtime) = downtime {
            m.reconnects.fetch_add(1, Ordering::SeqCst);
            self.shared.counter(telemetry::RECONNECTS, &[]).increment(1);
            tracing::info!(
                queue = %self.shared.queue,
                generation = session.generation.id,
                ?downtime,
                "AMQP consumer reconnected; QoS re-applied, consuming again"
            );
        } else {
            tracing::info!(queue = %self.shared.queue, uri = %self.config.redacted_uri(), "AMQP consumer started");
        }
    }

    fn went_down(&self, session: &Session) {
        session.generation.alive.store(false, Ordering::SeqCst);
        // Acks settled and not yet sent are lost with the channel: those messages are
        // redelivered and the inbox skips them as duplicates.
        session.generation.acks.end(Ending::Lost);
        self.shared.monitor.inner.connected.store(false, Ordering::SeqCst);
        metrics::gauge!(telemetry::CONNECTED, "queue" => self.shared.queue.to_string()).set(0.0);
        if let Some(health) = self.shared.health.get() {
            health.set_connected(false);
        }
    }

    /// `reconnect_min` doubling to `reconnect_max`, 50–100 % jitter.
    fn backoff(&self, attempt: u32) -> Duration {
        txinbox::retry::Backoff::new(self.config.reconnect_min, self.config.reconnect_max)
            .half_jitter(attempt)
    }

    /// Connects and subscribes: connection, channel, topology, confirms, QoS, consume.
    async fn setup(&self, generation: u64) -> Result<Session, AmqpError> {
        let c = &self.config;
        let props =
            ConnectionProperties::default().with_connection_name(c.connection_name_or_default().into());
        let conn = match tokio::time::timeout(c.connect_timeout, c.tls.connect(&c.uri, props)).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(AmqpError::Broker {
                    context: "connect".into(),
                    fatal: false,
                    source: format!("no connection within {:?} (connect_timeout)", c.connect_timeout).into(),
                })
            }
        };
        let subscribed = tokio::time::timeout(c.connect_timeout, self.subscribe(&conn)).await;
        let (channel, consumer) = match subscribed {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                let _ = tokio::time::timeout(Duration::from_secs(1), conn.close(200, "setup failed".into()))
                    .await;
                return Err(e);
            }
            Err(_) => {
                let _ =
                    tokio::time::timeout(Duration::from_secs(1), conn.close(200, "setup timed out".into()))
                        .await;
                return Err(AmqpError::Broker {
                    context: "channel setup".into(),
                    fatal: false,
                    source: format!("not done within {:?} (connect_timeout)", c.connect_timeout).into(),
                });
            }
        };
        let depth = match conn.create_channel().await {
            Ok(depth) => depth,
            Err(e) => {
                let _ = tokio::time::timeout(Duration::from_secs(1), conn.close(200, "setup failed".into()))
                    .await;
                return Err(classify("channel.open (queue depth)", e));
            }
        };
        let conn = Arc::new(conn);
        let generation = Arc::new(Generation::new(generation, &conn, channel));
        let flusher = tokio::spawn(acks::flush(
            generation.acks.clone(),
            generation.channel.clone(),
            c.publish_timeout,
        ));
        Ok(Session {
            generation,
            flusher,
            conn,
            depth,
            consumer,
        })
    }

    /// With `declare_topology(false)` the queues copies go to (dead letters, retries) are
    /// declared elsewhere. A passive declare of each asks the broker whether it exists: a
    /// missing one is an ERROR and a problem in the consumer's health (not ready), because a
    /// message whose copy must go there is unroutable, so it is not acknowledged and comes back
    /// until the queue exists. A queue that could not be asked keeps what was said of it.
    async fn check_copy_queues(&self, conn: &Connection) {
        let before = self.shared.missing_queues();
        let mut lines = Vec::new();
        for (queue, what) in [
            (&self.shared.dead_letter_queue, "dead-letter"),
            (&self.shared.retry_queue, "retry"),
        ] {
            let line = format!(
                "{what} queue {queue:?} (for messages of {}) does not exist, says the broker, and declare_topology is off: a message whose {what} copy must go there is not acknowledged and comes back until it does; declare it, or turn declare_topology on",
                self.shared.queue
            );
            match queue_exists(conn, queue).await {
                Some(true) => {}
                Some(false) => {
                    if !before.contains(&line) {
                        tracing::error!(queue = %queue, "{line}");
                    }
                    lines.push(line);
                }
                None if before.contains(&line) => lines.push(line),
                None => {}
            }
        }
        if !before.is_empty() && lines.is_empty() {
            tracing::info!(queue = %self.shared.queue, "the copy queues exist now");
        }
        self.shared.set_missing_queues(lines);
    }

    async fn subscribe(&self, conn: &Connection) -> Result<(Channel, lapin::Consumer), AmqpError> {
        let c = &self.config;
        let channel = conn
            .create_channel()
            .await
            .map_err(|e| classify("channel.open", e))?;
        if c.declare_topology {
            let durable = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            for (name, args) in c.topology() {
                let declared = channel
                    .queue_declare(name.as_str().into(), durable, args.clone())
                    .await;
                if let Err(e) = declared {
                    // The broker's text names the first argument that differs
                    // (`inequivalent arg 'x-queue-type' … received none but current is …`).
                    let advice = differing_queue_advice(c, &name, &args, &e);
                    let context = format!("queue.declare {name}");
                    return Err(match advice {
                        Some(advice) => AmqpError::Broker {
                            context,
                            fatal: true,
                            source: Box::new(crate::error::Advised::new(e, advice)),
                        },
                        None => classify(&context, e),
                    });
                }
            }
        }
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| classify("confirm.select", e))?;
        // QoS before consume, on every new channel (lapin < 4.12.1 dropped it on recovery; we
        // never rely on lapin's recovery anyway).
        channel
            .basic_qos(c.prefetch, BasicQosOptions { global: false })
            .await
            .map_err(|e| classify("basic.qos", e))?;
        let consumer = channel
            .basic_consume(
                c.queue.as_str().into(),
                self.tag.as_str().into(),
                BasicConsumeOptions {
                    no_ack: false,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| classify(&format!("basic.consume on {}", c.queue), e))?;
        Ok((channel, consumer))
    }

    async fn close_gracefully(&self, session: Session) {
        let channel = &session.generation.channel;
        let steps = async {
            let _ = channel
                .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
                .await;
            let _ = channel.close(200, "consumer closed".into()).await;
            let _ = session.conn.close(200, "consumer closed".into()).await;
        };
        if tokio::time::timeout(CLOSE_TIMEOUT, steps).await.is_err() {
            tracing::warn!(queue = %self.shared.queue, "closing the AMQP connection timed out");
        }
        tracing::info!(queue = %self.shared.queue, "AMQP consumer closed");
    }
}

/// Sets [`telemetry::QUEUE_DEPTH`] every [`DEPTH_INTERVAL`] from a passive `queue.declare`
/// (the broker's count of ready messages) while `generation` lives; a failure ends it quietly
/// (the supervisor notices a lost connection by itself and starts a new one).
async fn report_depth(
    channel: Channel,
    generation: Arc<Generation>,
    queue: Arc<str>,
    shutdown: CancellationToken,
) {
    let gauge = metrics::gauge!(telemetry::QUEUE_DEPTH, "queue" => queue.to_string());
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let mut tick = tokio::time::interval(DEPTH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if !generation.alive() {
            return;
        }
        let declared = tokio::time::timeout(
            DEPTH_INTERVAL,
            channel.queue_declare(queue.as_ref().into(), passive, FieldTable::default()),
        )
        .await;
        match declared {
            Ok(Ok(q)) => gauge.set(f64::from(q.message_count())),
            Ok(Err(e)) => {
                tracing::debug!(%queue, error = %e, "reading the queue depth failed");
                return;
            }
            Err(_) => tracing::debug!(%queue, "reading the queue depth timed out"),
        }
    }
}

/// Whether `queue` exists, by a passive `queue.declare` on a channel of its own (a missing
/// queue closes the channel); `None` when the broker could not be asked.
async fn queue_exists(conn: &Connection, queue: &ShortString) -> Option<bool> {
    let channel = conn.create_channel().await.ok()?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = tokio::time::timeout(
        CLOSE_TIMEOUT,
        channel.queue_declare(queue.clone(), passive, FieldTable::default()),
    )
    .await
    .ok()?;
    match declared {
        Ok(_) => {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, channel.close(200, "checked".into())).await;
            Some(true)
        }
        Err(e) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp)
                if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)) =>
            {
                Some(false)
            }
            _ => None,
        },
    }
}

/// Closes what is left of a lost session, briefly; errors are expected and ignored.
async fn abandon(session: Session) {
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        session.conn.close(200, "reconnecting".into()),
    )
    .await;
}

/// What to do about a queue that exists with other arguments than txinbox declares it with
/// (`PRECONDITION_FAILED`); `None` for any other error.
fn differing_queue_advice(c: &AmqpConfig, name: &str, args: &FieldTable, e: &lapin::Error) -> Option<String> {
    let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
        return None;
    };
    if !matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    ) {
        return None;
    }
    let mut sent: Vec<String> = args
        .inner()
        .iter()
        .map(|(k, v)| match v {
            lapin::types::AMQPValue::LongString(s) => format!("{k}={s}"),
            lapin::types::AMQPValue::LongLongInt(i) => format!("{k}={i}"),
            other => format!("{k}={other:?}"),
        })
        .collect();
    sent.sort();
    let sent = if sent.is_empty() {
        "no arguments (a classic queue)".to_owned()
    } else {
        sent.join(", ")
    };
    let what = if name == c.retry_queue_name() {
        "; the retry queue must have txinbox_amqp::retry_queue_arguments (at-least-once dead-lettering back to the work queue): point retry_queue at a new name, or move its messages and declare it again"
    } else if c.queue_type == QueueType::Classic {
        "; if it is a quorum queue, set the queue type to quorum (AmqpConfig::queue_type(QueueType::Quorum), --amqp-queue-type quorum)"
    } else {
        "; set the queue type (AmqpConfig::queue_type, --amqp-queue-type) and delivery limit (AmqpConfig::delivery_limit) it was declared with"
    };
    Some(format!(
        "queue {name} exists with other arguments than txinbox declares it with ({sent}){what}; or turn declare_topology off to use the queues as they are"
    ))
}

/// Whether retrying cannot help: refused credentials or vhost, unknown queue, a queue declared
/// with other arguments, an unsupported protocol or refused authentication.
pub(crate) fn is_fatal(e: &lapin::Error) -> bool {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => matches!(
            amqp.kind(),
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                | AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
                | AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
                | AMQPErrorKind::Hard(AMQPHardError::INVALIDPATH)
                | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
        ),
        lapin::ErrorKind::InvalidProtocolVersion(_) | lapin::ErrorKind::AuthProviderError(_) => true,
        _ => false,
    }
}

/// `e` in `context`, fatal as [`is_fatal`] says; everything else (I/O, connection forced,
/// timeouts) can pass.
fn classify(context: &str, e: lapin::Error) -> AmqpError {
    let fatal = is_fatal(&e);
    AmqpError::Broker {
        context: context.to_owned(),
        fatal,
        source: Box::new(e),
    }
}

/// Takes a delivery of a quorum queue near its delivery limit out of the broker's count: a
/// fresh copy goes to the work queue ([`AmqpDelivery::replace_with_fresh_copy`]). If the copy is
/// not confirmed the delivery is processed as it is (nothing better is left: giving it back
/// would count once more).
async fn replace_with_fresh_copy(
    delivery: AmqpDelivery,
    tx: mpsc::UnboundedSender<Result<AmqpDelivery, SourceError>>,
) {
    if let Err(delivery) = delivery.replace_with_fresh_copy().await {
        let _ = tx.send(Ok(delivery));
    }
}
