//! Measuring: a latency histogram of fixed size (memory does not grow with the message count),
//! the probe every acknowledged settlement reports to, the publish time carried in a payload, and
//! the CPU and RSS readings from `/proc`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use txinbox::Message;

/// Log-scale buckets of 2% from 1 µs to about 30 minutes.
pub(crate) struct Histogram {
    pub(crate) buckets: Vec<AtomicU64>,
}

pub(crate) const GROWTH: f64 = 1.02;

impl Histogram {
    pub(crate) fn new() -> Self {
        Histogram {
            buckets: (0..1100).map(|_| AtomicU64::new(0)).collect(),
        }
    }
    pub(crate) fn record(&self, micros: u64) {
        let i = ((micros.max(1) as f64).ln() / GROWTH.ln()) as usize;
        self.buckets[i.min(self.buckets.len() - 1)].fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn quantile_ms(&self, q: f64) -> Option<f64> {
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
pub(crate) struct Probe {
    pub(crate) target: u64,
    pub(crate) settled: AtomicU64,
    pub(crate) latency: Histogram,
    /// When the warm-up message had been settled and the measured messages began.
    pub(crate) started_at: OnceLock<Instant>,
    pub(crate) done_at: OnceLock<Instant>,
    /// The CPU reading taken with `started_at`, and the use from it to `done_at`.
    pub(crate) cpu_at_start: OnceLock<Option<CpuMeter>>,
    pub(crate) cpu: OnceLock<Option<CpuUse>>,
    pub(crate) done: tokio::sync::Notify,
}

impl Probe {
    pub(crate) fn new(target: u64) -> Arc<Self> {
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
    pub(crate) fn settled(&self) -> u64 {
        self.settled.load(Ordering::Relaxed)
    }
    /// The elapsed time of the measured messages (after the warm-up).
    pub(crate) fn elapsed(&self) -> Duration {
        let end = self.done_at.get().copied().unwrap_or_else(Instant::now);
        end - self.started_at.get().copied().unwrap_or(end)
    }
    /// Starts the clock (and the CPU reading) of the measured messages.
    pub(crate) fn start(&self) {
        let _ = self.cpu_at_start.set(CpuMeter::start());
        let _ = self.started_at.set(Instant::now());
    }
    /// CPU use over the measured messages, once they are all settled.
    pub(crate) fn cpu(&self) -> Option<CpuUse> {
        self.cpu.get().copied().flatten()
    }
    /// One settled message; `sent`: its publish time, if its payload carries one.
    pub(crate) fn record(&self, sent: Option<u64>) {
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
    pub(crate) async fn wait_done(&self) {
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

pub(crate) fn now_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

pub(crate) fn published_at(message: &Message) -> Option<u64> {
    sent_at(message.payload())
}

pub(crate) fn sent_at(payload: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(payload).ok()?;
    text.split(' ').next()?.parse().ok()
}

/// CPU used over an interval, in percent of one core (so up to `cores × 100`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuUse {
    /// This process: the consumer, the publisher and the client libraries' threads.
    pub(crate) process: f64,
    /// PostgreSQL's processes (`postgres`, backends included; a backend that exits within the
    /// row, as pgbench's do, counts through its parent's reaped-children time). `None` when no
    /// such process is visible (a remote server, another PID namespace).
    pub(crate) postgres: Option<f64>,
    /// The brokers' processes (`tansu`, RabbitMQ's `beam.smp`); `None` when none is visible.
    pub(crate) broker: Option<f64>,
    /// The whole machine: this process plus the broker, PostgreSQL and anything else.
    pub(crate) machine: f64,
}

/// A reading of `/proc` to difference against a later one: (this process's CPU ticks, the
/// machine's busy ticks, the machine's total ticks).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuMeter {
    pub(crate) process: u64,
    pub(crate) postgres: Option<u64>,
    pub(crate) broker: Option<u64>,
    pub(crate) busy: u64,
    pub(crate) total: u64,
    pub(crate) at: Instant,
}

impl CpuMeter {
    /// `None` where `/proc` cannot be read (not Linux).
    pub(crate) fn start() -> Option<CpuMeter> {
        // /proc/self/stat: utime, stime, cutime and cstime are the 14th to 17th fields (the
        // children's once waited for: pgbench's). The 2nd, the command name in parentheses, may
        // contain spaces, so count from after its closing ')'.
        let process = process_ticks(&std::fs::read_to_string("/proc/self/stat").ok()?)?.1;
        let (mut postgres, mut broker) = (None, None);
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Some((comm, ticks)) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| process_ticks(&stat))
            else {
                continue;
            };
            match comm.as_str() {
                "postgres" => *postgres.get_or_insert(0) += ticks,
                "tansu" | "beam.smp" => *broker.get_or_insert(0) += ticks,
                _ => {}
            }
        }
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
            postgres,
            broker,
            busy: total - idle,
            total,
            at: Instant::now(),
        })
    }

    /// CPU use from this reading to now.
    pub(crate) fn since(self) -> Option<CpuUse> {
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
            postgres: now
                .postgres
                .zip(self.postgres)
                .map(|(now, then)| now.saturating_sub(then) as f64 / seconds),
            broker: now
                .broker
                .zip(self.broker)
                .map(|(now, then)| now.saturating_sub(then) as f64 / seconds),
            machine: 100.0 * cores * now.busy.saturating_sub(self.busy) as f64 / total,
        })
    }
}

/// A `/proc/PID/stat` line's command name and CPU ticks: utime, stime, cutime and cstime, the
/// 14th to 17th fields (the children's once waited for: pgbench's, or a postmaster's exited
/// backends). The 2nd, the command name in parentheses, may contain spaces, so the fields are
/// counted from after its closing ')'.
fn process_ticks(stat: &str) -> Option<(String, u64)> {
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields
        .get(11..15)?
        .iter()
        .map(|f| f.parse::<u64>().ok())
        .sum::<Option<u64>>()?;
    Some((comm, ticks))
}

/// Resets the process's peak RSS (VmHWM) so the next reading covers one row only.
pub(crate) fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// `VmHWM` or `VmRSS` from /proc/self/status, in MiB.
pub(crate) fn rss_mb(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
