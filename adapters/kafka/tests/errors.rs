//! `KafkaError` has the shape of txinbox's other errors: it says whether a retry can help, and
//! `?` turns it into `txinbox::Error` with the cause chain intact (the `KafkaError`, then
//! librdkafka's error with secrets masked).

use txinbox::source::SourceError;
use txinbox_kafka::{KafkaConfig, KafkaError, KafkaPublisher, KafkaSource};

/// The chain under `e`, outermost first.
fn chain<'a>(e: &'a (dyn std::error::Error + 'static)) -> Vec<&'a (dyn std::error::Error + 'static)> {
    let mut out = vec![e];
    let mut at = e;
    while let Some(next) = at.source() {
        out.push(next);
        at = next;
    }
    out
}

/// `KafkaSource::new` and `KafkaPublisher::build` behind `?` in a function returning
/// `txinbox::Error`.
fn source(config: KafkaConfig) -> Result<(), txinbox::Error> {
    KafkaSource::new(config)?;
    Ok(())
}

fn publisher(property: (&str, &str)) -> Result<(), txinbox::Error> {
    KafkaPublisher::builder("127.0.0.1:9092")
        .set(property.0, property.1)
        .build()?;
    Ok(())
}

#[tokio::test]
async fn question_mark_keeps_the_kafka_error_and_librdkafkas_cause() {
    let refused = KafkaConfig::new("127.0.0.1:9092", "g")
        .topic("t")
        .set("session.timeout.ms", "not-a-number");
    let direct = KafkaSource::new(refused.clone()).unwrap_err();
    assert!(
        matches!(direct, KafkaError::Client { .. }) && direct.is_fatal() && !direct.is_transient(),
        "{direct:?}"
    );
    for e in [
        source(refused).unwrap_err(),
        publisher(("message.max.bytes", "not-a-number")).unwrap_err(),
    ] {
        let links = chain(&e);
        let texts: Vec<String> = links.iter().map(|l| l.to_string()).collect();
        assert!(links[1].is::<SourceError>(), "{texts:#?}");
        let kafka = links[2]
            .downcast_ref::<KafkaError>()
            .unwrap_or_else(|| panic!("{texts:#?}"));
        assert!(kafka.is_fatal(), "{kafka:?}");
        assert!(
            links.len() == 4 && texts[3].contains("not-a-number"),
            "librdkafka's error comes after the KafkaError: {texts:#?}"
        );
        let txinbox::Error::Source(source) = &e else {
            panic!("{e:?}")
        };
        assert!(!source.is_transient(), "a refused property is fatal");
    }

    // An invalid configuration: no cause of its own, still a KafkaError in the chain.
    let e = source(KafkaConfig::new("127.0.0.1:9092", "g")).unwrap_err();
    let links = chain(&e);
    assert!(
        matches!(links[2].downcast_ref::<KafkaError>(), Some(KafkaError::Config(_))),
        "{e:?}"
    );
    assert!(links[2].source().is_none());
}
