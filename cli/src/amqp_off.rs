//! Stand-in for the RabbitMQ client when the `amqp` feature is off: connecting fails with a
//! clear message, so nothing else is ever called.

use crate::error::CliError;

/// No RabbitMQ client in this build (uninhabited).
pub enum Amqp {}

impl Amqp {
    pub async fn connect(_url: &str, _tls: &crate::AmqpTlsFiles) -> Result<Amqp, CliError> {
        Err(CliError::BadArgs(
            "this txinbox was built without the `amqp` feature; rebuild with it to requeue RabbitMQ dead letters".into(),
        ))
    }

    pub async fn publish(
        &self,
        _: &str,
        _: &[u8],
        _: &[(String, Vec<u8>)],
        _: Option<&str>,
    ) -> Result<(), String> {
        match *self {}
    }
}

pub fn is_bookkeeping(_: &str) -> bool {
    false
}
