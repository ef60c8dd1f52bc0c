//! One classification of produce errors, for the outbox publisher and the dead-letter producer.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// What a failed produce means for a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The record is too large for the producer or the topic: the same record never fits; a
    /// smaller one may.
    TooLarge,
    /// The topic refuses the record for good (authorization, invalid topic or record, a
    /// producer configuration the broker rejects): no retry and no smaller record helps.
    Refused,
    /// Broker down, leader moving, unknown topic (it may be being created), timeout, queue
    /// full, …: a retry may succeed.
    Transient,
}

impl Failure {
    /// Whether no retry of the same record can succeed.
    pub(crate) fn is_permanent(self) -> bool {
        self != Failure::Transient
    }
}

/// Classifies a librdkafka error code returned by a produce or a delivery report.
pub(crate) fn classify_code(code: RDKafkaErrorCode) -> Failure {
    use RDKafkaErrorCode as C;
    match code {
        C::MessageSizeTooLarge | C::InvalidMessageSize => Failure::TooLarge,
        C::InvalidRecord
        | C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::InvalidTopic
        | C::InvalidRequiredAcks => Failure::Refused,
        _ => Failure::Transient,
    }
}

/// Classifies a produce error; errors without a code (a dropped producer, a canceled
/// delivery) are transient.
pub(crate) fn classify(e: &KafkaError) -> Failure {
    e.rdkafka_error_code().map_or(Failure::Transient, classify_code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_refusal_and_broker_trouble_are_told_apart() {
        let produce = KafkaError::MessageProduction;
        assert_eq!(
            classify(&produce(RDKafkaErrorCode::MessageSizeTooLarge)),
            Failure::TooLarge
        );
        assert_eq!(
            classify(&produce(RDKafkaErrorCode::TopicAuthorizationFailed)),
            Failure::Refused
        );
        assert_eq!(
            classify(&produce(RDKafkaErrorCode::InvalidTopic)),
            Failure::Refused
        );
        for transient in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::QueueFull,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::NotLeaderForPartition,
        ] {
            assert_eq!(classify(&produce(transient)), Failure::Transient, "{transient:?}");
        }
        assert_eq!(classify(&KafkaError::Canceled), Failure::Transient);
    }
}
