//! Rows: what each one measured, and the table and JSON they are printed as.

use crate::measure::CpuUse;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Raw,
    PerMessage,
    Batched,
}

impl Mode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Raw => "raw",
            Mode::PerMessage => "per_message",
            Mode::Batched => "batched",
        }
    }
}

/// A fixed-rate row's mode: its saturated mode at half the batched rate.
pub(crate) fn paced_mode(mode: Mode) -> &'static str {
    match mode {
        Mode::Raw => "raw@50%",
        Mode::PerMessage => "per_msg@50%",
        Mode::Batched => "batched@50%",
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) source: String,
    pub(crate) mode: &'static str,
    pub(crate) messages: u64,
    pub(crate) msgs_per_sec: f64,
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    pub(crate) peak_rss_mb: Option<f64>,
    /// CPU used over the row, in percent of one core: this process, PostgreSQL, the broker,
    /// and the whole machine (all of them and anything else). A machine near `cores × 100` is saturated: what limits the
    /// row is CPU, shared by everything on it.
    pub(crate) cpu: Option<CpuUse>,
    pub(crate) note: String,
}

impl Row {
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "source": self.source,
            "mode": self.mode,
            "messages": self.messages,
            "msgs_per_sec": (self.msgs_per_sec * 10.0).round() / 10.0,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "peak_rss_mb": self.peak_rss_mb,
            "cpu_process_pct": self.cpu.map(|c| c.process.round()),
            "cpu_postgres_pct": self.cpu.and_then(|c| c.postgres).map(f64::round),
            "cpu_broker_pct": self.cpu.and_then(|c| c.broker).map(f64::round),
            "cpu_machine_pct": self.cpu.map(|c| c.machine.round()),
            "note": self.note,
        })
    }
}

pub(crate) fn fmt_opt(v: Option<f64>, width: usize) -> String {
    match v {
        Some(v) if v >= 100.0 => format!("{v:>width$.0}"),
        Some(v) => format!("{v:>width$.2}"),
        None => format!("{:>width$}", "-"),
    }
}

pub(crate) fn header() {
    println!(
        "{:<18} {:<12} {:>9} {:>10} {:>9} {:>9} {:>10} {:>16}  note",
        "source", "mode", "messages", "msg/s", "p50 ms", "p99 ms", "peak MiB", "cpu % p/pg/b/all"
    );
}

pub(crate) fn print_row(r: &Row) {
    println!(
        "{:<18} {:<12} {:>9} {:>10.0} {} {} {} {:>16}  {}",
        r.source,
        r.mode,
        r.messages,
        r.msgs_per_sec,
        fmt_opt(r.p50_ms, 9),
        fmt_opt(r.p99_ms, 9),
        fmt_opt(r.peak_rss_mb, 10),
        r.cpu.map_or("-".into(), |c| {
            let or_dash = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
            format!(
                "{:.0}/{}/{}/{:.0}",
                c.process,
                or_dash(c.postgres),
                or_dash(c.broker),
                c.machine
            )
        }),
        r.note
    );
}
