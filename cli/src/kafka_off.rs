//! Stand-in for the Kafka client when the `kafka` feature is off: connecting fails with a
//! clear message, so nothing else is ever called.

use std::collections::HashMap;

use crate::error::CliError;

/// No Kafka client in this build (uninhabited).
pub enum Kafka {}

/// No producer in this build (uninhabited).
pub enum Producer {}

impl Kafka {
    pub fn connect(_brokers: &str) -> Result<Kafka, CliError> {
        Err(CliError::BadArgs(
            "this txinbox was built without the `kafka` feature; rebuild with it for Kafka operations".into(),
        ))
    }

    pub fn partitions(&self, _: &str) -> Result<Vec<i32>, CliError> {
        match *self {}
    }

    pub fn watermarks(&self, _: &str, _: i32) -> Result<(i64, i64), CliError> {
        match *self {}
    }

    pub fn committed(&self, _: &str, _: &str, _: &[i32]) -> Result<HashMap<i32, Option<i64>>, CliError> {
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
