//! The Grafana dashboard and the Prometheus alert rules in `deploy/` use only metric names
//! that exist: those of `txinbox::telemetry` and the adapters' metric constants. A renamed
//! metric fails here rather than as an empty panel or an alert that never fires.

use std::collections::BTreeSet;
use std::path::Path;

/// Every metric name txinbox and its adapters record.
fn known() -> BTreeSet<&'static str> {
    use txinbox::telemetry as t;
    use txinbox_amqp::telemetry as a;
    use txinbox_kafka::telemetry as k;
    [
        t::PROCESSED,
        t::DUPLICATES,
        t::CONFLICTS,
        t::RETRIES,
        t::CONTENTION_RETRIES,
        t::DEAD_LETTERS,
        t::ACK_FAILURES,
        t::STORE_ERRORS,
        t::HANDLER_DURATION,
        t::COMMIT_DURATION,
        t::IN_FLIGHT,
        t::LANE_OLDEST_UNSETTLED_AGE,
        t::CONTENDED,
        t::OUTBOX_PENDING,
        t::OUTBOX_OLDEST_PENDING_AGE,
        t::OUTBOX_PUBLISHED,
        t::OUTBOX_PUBLISH_FAILURES,
        t::OUTBOX_DEAD_LETTERS,
        k::REBALANCES,
        k::PAUSES,
        k::DEAD_LETTERS_PRODUCED,
        k::DEAD_LETTERS_REDUCED,
        k::DEAD_LETTERS_REFUSED,
        k::DEAD_LETTERS_WAITING,
        k::PARTITIONS_BLOCKED,
        k::LAG,
        a::RECONNECTS,
        a::CONNECTED,
        a::QUEUE_DEPTH,
        a::ACK_NOT_SENT,
        a::PUBLISH_FAILURES,
        a::PUBLISHED,
        a::REQUEUED,
        a::STALE_DROPPED,
    ]
    .into_iter()
    .collect()
}

/// The `txinbox_…` identifiers in `text` (crate paths such as `txinbox_kafka::` excepted).
fn names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("txinbox_") {
        let start = i + at;
        let boundary = start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = text[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(text.len(), |n| start + n);
        // `txinbox_kafka::telemetry` in a comment is a crate path, not a metric.
        let path = text[end..].starts_with("::");
        if boundary && !path {
            names.insert(text[start..end].to_owned());
        }
        i = end;
    }
    names
}

/// A name as Prometheus shows it may carry a suffix the exporter adds to a summary or
/// histogram: `_sum`, `_count`, `_bucket`.
fn exists(name: &str, known: &BTreeSet<&str>) -> bool {
    known.contains(name)
        || ["_sum", "_count", "_bucket"]
            .iter()
            .any(|s| name.strip_suffix(s).is_some_and(|base| known.contains(base)))
}

fn deploy(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_use_exists() {
    let known = known();
    let dashboard = deploy("grafana/txinbox.json");
    let json: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is valid JSON");
    let panels = json["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "a panel per concern");
    for panel in panels {
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {} queries something", panel["title"]);
    }
    let alerts = deploy("prometheus/alerts.yml");
    for (file, text) in [
        ("grafana/txinbox.json", &dashboard),
        ("prometheus/alerts.yml", &alerts),
    ] {
        let used = names_in(text);
        assert!(!used.is_empty(), "{file} uses txinbox metrics");
        let unknown: Vec<_> = used.iter().filter(|n| !exists(n, &known)).collect();
        assert!(
            unknown.is_empty(),
            "{file} uses metrics that do not exist: {unknown:?}"
        );
    }
    // What the issue asks the alerts to cover.
    for name in [
        "txinbox_kafka_lag",
        "txinbox_dead_letters_total",
        "txinbox_store_errors_total",
        "txinbox_lane_oldest_unsettled_age_seconds",
        "txinbox_outbox_oldest_pending_age_seconds",
    ] {
        assert!(names_in(&alerts).contains(name), "an alert on {name}");
    }
}

#[test]
fn the_name_scanner_finds_names_and_rejects_unknown_ones() {
    let found =
        names_in("rate(txinbox_processed_total[1m]) + txinbox_nope and my_txinbox_x, see txinbox_kafka::LAG");
    assert_eq!(
        found,
        ["txinbox_nope", "txinbox_processed_total"]
            .map(String::from)
            .into()
    );
    let known = known();
    assert!(exists("txinbox_handler_duration_seconds_count", &known));
    assert!(!exists("txinbox_nope", &known));
}
