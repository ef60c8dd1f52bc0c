//! Stand-in for the Kafka client when the `kafka` feature is off: connecting fails with a
//! clear message, so nothing else is ever called.

use crate::error::CliError;

/// No Kafka client in this build (uninhabited).
pub enum Kafka {}

/// What the broker says about one partition (never built without the `kafka` feature).
#[derive(Debug, Clone, Copy)]
pub struct BrokerPartition {
    pub partition: i32,
    pub low: i64,
    pub high: i64,
    pub group_offset: Option<i64>,
}

/// `KEY=VALUE` pairs (the Kafka client that would read them is not in this build).
pub fn parse_properties(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split_once('=')
        .map(|(k, v)| vec![(k.trim().to_owned(), v.to_owned())])
        .ok_or_else(|| "expected KEY=VALUE".to_owned())
}

/// No producer in this build (uninhabited).
pub enum Producer {}

impl Kafka {
    pub fn connect(_brokers: &str, _properties: &[(String, String)]) -> Result<Kafka, CliError> {
        Err(CliError::BadArgs(
            "this txinbox was built without the `kafka` feature; rebuild with it for Kafka operations".into(),
        ))
    }

    pub fn view(&self, _: &str, _: Option<&str>, _: &[i32]) -> Result<Vec<BrokerPartition>, CliError> {
        match *self {}
    }

    pub fn producer(&self) -> Result<Producer, CliError> {
        match *self {}
    }
}

pub async fn produce(
    producer: &Producer,
    _: &str,
    _: Option<i32>,
    _: &[u8],
    _: &[(String, Vec<u8>)],
) -> Result<(i32, i64), String> {
    match *producer {}
}
