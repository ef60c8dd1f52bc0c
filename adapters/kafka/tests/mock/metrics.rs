//! The metrics this crate records, read through a debugging recorder installed once for this
//! test binary (tests run concurrently: read by a label of the test's own, e.g. its topic).

use std::sync::{Mutex, OnceLock};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

fn snapshotter() -> &'static Snapshotter {
    static S: OnceLock<Snapshotter> = OnceLock::new();
    S.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let s = recorder.snapshotter();
        recorder.install().expect("the only recorder in this test binary");
        s
    })
}

/// Installs the recorder (call before the code under test records anything).
pub(crate) fn install() {
    snapshotter();
}

type Labels = Vec<(String, String)>;

/// The recorder resets counters *and gauges* on each snapshot: keep totals here. This crate
/// moves its gauges only with `increment`/`decrement`, so a gauge's value is the sum of what
/// the snapshots saw.
#[derive(Default)]
struct Seen {
    counters: Vec<(String, Labels, u64)>,
    gauges: Vec<(String, Labels, f64)>,
}

fn read() -> std::sync::MutexGuard<'static, Seen> {
    static SEEN: Mutex<Seen> = Mutex::new(Seen {
        counters: Vec::new(),
        gauges: Vec::new(),
    });
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let name = key.key().name().to_owned();
        let labels: Labels = key
            .key()
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        match value {
            DebugValue::Counter(c) => seen.counters.push((name, labels, c)),
            DebugValue::Gauge(g) => seen.gauges.push((name, labels, g.into_inner())),
            DebugValue::Histogram(_) => {}
        }
    }
    seen
}

fn has(labels: &Labels, (k, v): (&str, &str)) -> bool {
    labels.iter().any(|(lk, lv)| lk == k && lv == v)
}

/// The total of counter `name` over the series carrying label `label`.
pub(crate) fn counter(name: &str, label: (&str, &str)) -> u64 {
    read()
        .counters
        .iter()
        .filter(|(n, l, _)| n == name && has(l, label))
        .map(|(.., c)| c)
        .sum()
}

/// The sum of gauge `name` over the series carrying label `label` (0 if never set).
pub(crate) fn gauge(name: &str, label: (&str, &str)) -> f64 {
    read()
        .gauges
        .iter()
        .filter(|(n, l, _)| n == name && has(l, label))
        .map(|(.., g)| g)
        .sum()
}

/// Where the record of gauge values stands now (see [`gauge_values`]).
pub(crate) fn gauge_mark() -> usize {
    read().gauges.len()
}

/// The values of gauge `name` on the series carrying every label of `labels`, seen since
/// `mark`. The recorder resets a gauge to 0 when it is read, so for gauges this crate `set`s
/// (the lag) a snapshot shows the value set since the previous snapshot, or 0.
pub(crate) fn gauge_values(name: &str, labels: &[(&str, &str)], mark: usize) -> Vec<f64> {
    read().gauges[mark..]
        .iter()
        .filter(|(n, l, _)| n == name && labels.iter().all(|label| has(l, *label)))
        .map(|(.., g)| *g)
        .collect()
}
