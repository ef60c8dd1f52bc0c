//! What a run found: each crash point's result, each broker's report per phase, and the summary
//! table they are printed as.

use std::collections::BTreeMap;
use std::time::Duration;

use txinbox::crash;

use crate::args::Phase;

/// What happened at one named crash point.
#[derive(Debug, Clone)]
pub(crate) enum PointResult {
    /// The ledger aborted by itself at the point's `nth` hit, `applied` events after it started.
    Aborted { nth: u32, applied: u64 },
    /// The ledger applied `applied` events and never reached the point.
    NotReached { applied: u64 },
    /// Something else ended the run.
    Failed(String),
    /// The point does not exist for this broker.
    NotApplicable,
}

impl std::fmt::Display for PointResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PointResult::Aborted { nth, applied } => write!(f, "aborted (hit {nth}, {applied} applied)"),
            PointResult::NotReached { applied } => write!(f, "not reached ({applied} applied)"),
            PointResult::Failed(_) => write!(f, "FAILED"),
            PointResult::NotApplicable => write!(f, "n/a"),
        }
    }
}

/// One broker's results in one phase.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub(crate) source: &'static str,
    pub(crate) phase: &'static str,
    pub(crate) resources: String,
    pub(crate) runs: u32,
    pub(crate) kills: u32,
    pub(crate) aborts: u32,
    pub(crate) messages: u64,
    pub(crate) absorbed: u64,
    pub(crate) lost: u64,
    pub(crate) doubled: u64,
    pub(crate) unacked: u64,
    pub(crate) points: BTreeMap<&'static str, PointResult>,
    pub(crate) failures: Vec<String>,
    pub(crate) elapsed: Duration,
    /// The phase's own figures, printed under the summary.
    pub(crate) figures: Vec<String>,
}

pub(crate) fn print_summary(reports: &[Report]) {
    println!(
        "\n{:<6} {:<6} {:>5} {:>6} {:>7} {:>9} {:>20} {:>5} {:>8} {:>8} {:>8}  result",
        "source",
        "phase",
        "runs",
        "kills",
        "aborts",
        "messages",
        "duplicates absorbed",
        "lost",
        "doubled",
        "unacked",
        "time"
    );
    for r in reports {
        println!(
            "{:<6} {:<6} {:>5} {:>6} {:>7} {:>9} {:>20} {:>5} {:>8} {:>8} {:>7.0}s  {}",
            r.source,
            r.phase,
            r.runs,
            r.kills,
            r.aborts,
            r.messages,
            r.absorbed,
            r.lost,
            r.doubled,
            r.unacked,
            r.elapsed.as_secs_f64(),
            if r.failures.is_empty() { "ok" } else { "FAILED" }
        );
    }
    let matrix: Vec<&Report> = reports
        .iter()
        .filter(|r| r.phase == Phase::Matrix.name())
        .collect();
    if !matrix.is_empty() {
        println!(
            "\n{:<14} {}",
            "crash point",
            matrix
                .iter()
                .map(|r| format!("{:<36}", r.source))
                .collect::<String>()
        );
        for point in crash::POINTS {
            let cells: String = matrix
                .iter()
                .map(|r| {
                    format!(
                        "{:<36}",
                        r.points.get(point).map(|p| p.to_string()).unwrap_or_default()
                    )
                })
                .collect();
            println!("{point:<14} {cells}");
        }
    }
    for r in reports.iter().filter(|r| !r.figures.is_empty()) {
        println!("\n{} {}:", r.source, r.phase);
        for line in &r.figures {
            println!("  {line}");
        }
    }
    println!("(duplicates absorbed: published copies beyond the first that left no second entry; the redeliveries caused by the kills are absorbed too but not counted)");
}
