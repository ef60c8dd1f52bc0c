//! No secret reaches a log through this crate's types: every configuration, builder, publisher,
//! source and error formats (`{:?}` and `{}`) with secret property values masked.
//!
//! Needs no broker and no database: nothing connects.

use txinbox_kafka::{KafkaConfig, KafkaPublisher, KafkaSource};

const SECRET: &str = "s3cr3t-XYZ";

/// Every librdkafka property that holds a secret or key material, as users set them.
const SECRET_KEYS: &[&str] = &[
    "sasl.password",
    "ssl.key.password",
    "ssl.keystore.password",
    "sasl.oauthbearer.client.secret",
    "ssl.key.pem",
    "sasl.oauthbearer.config",
    "sasl.jaas.config",
];

fn assert_hidden(what: &str, shown: &str) {
    assert!(!shown.contains(SECRET), "{what} shows the secret: {shown}");
}

fn config_with_secrets() -> KafkaConfig {
    let mut config = KafkaConfig::new("127.0.0.1:9092", "payments").topic("deposits");
    for key in SECRET_KEYS {
        config = config.set(*key, SECRET).set_producer(*key, SECRET);
    }
    config
}

#[test]
fn kafka_config_debug_masks_secret_properties() {
    let config = config_with_secrets().set("session.timeout.ms", "6000");
    let shown = format!("{config:?}");
    assert_hidden("KafkaConfig {:?}", &shown);
    assert_hidden("KafkaConfig {:#?}", &format!("{config:#?}"));
    // Everything else is still there to debug with.
    assert!(shown.contains("session.timeout.ms"), "{shown}");
    assert!(shown.contains("6000"), "{shown}");
    assert!(shown.contains("sasl.password"), "the key stays visible: {shown}");
}

#[test]
fn publisher_builder_debug_masks_secret_properties() {
    let mut builder = KafkaPublisher::builder("127.0.0.1:9092");
    for key in SECRET_KEYS {
        builder = builder.set(*key, SECRET);
    }
    let shown = format!("{builder:?}");
    assert_hidden("KafkaPublisherBuilder {:?}", &shown);
    assert!(shown.contains("sasl.password"), "{shown}");
}

#[test]
fn publisher_and_its_errors_mask_secrets() {
    // SASL/PLAIN needs no TLS: this one builds, and its Debug must not show the password.
    let publisher = KafkaPublisher::builder("127.0.0.1:9092")
        .set("sasl.mechanism", "PLAIN")
        .set("sasl.username", "app")
        .set("sasl.password", SECRET)
        .build()
        .expect("a SASL/PLAIN publisher builds");
    assert_hidden("KafkaPublisher {:?}", &format!("{publisher:?}"));
    drop(publisher);

    // Properties librdkafka refuses (TLS key material in a build without OpenSSL): rdkafka's
    // creation error quotes the property and its value.
    let mut refused = 0;
    for key in SECRET_KEYS {
        let result = KafkaPublisher::builder("127.0.0.1:9092")
            .set(*key, SECRET)
            .build();
        if let Err(e) = result {
            refused += 1;
            assert_hidden(&format!("publisher error {{}} ({key})"), &e.to_string());
            assert_hidden(&format!("publisher error {{:?}} ({key})"), &format!("{e:?}"));
        }
    }
    assert!(
        refused > 0,
        "some configuration was refused, so an error was checked"
    );
}

#[test]
fn raw_librdkafka_errors_quote_the_value_so_the_wrapping_must_mask_it() {
    // The premise of the tests of errors: rdkafka's own error shows the value. `sasl.jaas.config`
    // (the Java client's) is unknown to librdkafka in every build; with the `ssl` feature the
    // TLS properties are accepted, so they no longer make an error.
    let e = rdkafka::ClientConfig::new()
        .set("sasl.jaas.config", SECRET)
        .create::<rdkafka::producer::BaseProducer>()
        .err()
        .expect("librdkafka refuses a property it does not know");
    assert!(e.to_string().contains(SECRET), "{e}");
}

#[tokio::test]
async fn source_creation_errors_mask_secrets() {
    let mut checked = 0;
    for key in SECRET_KEYS {
        // Consumer side, then dead-letter producer side.
        for config in [
            KafkaConfig::new("127.0.0.1:9092", "g")
                .topic("t")
                .set(*key, SECRET),
            KafkaConfig::new("127.0.0.1:9092", "g")
                .topic("t")
                .set_producer(*key, SECRET),
        ] {
            assert_hidden("KafkaConfig {:?}", &format!("{config:?}"));
            match KafkaSource::new(config) {
                Ok(source) => {
                    assert_hidden("KafkaSource {:?}", &format!("{source:?}"));
                    drop(source);
                }
                Err(e) => {
                    checked += 1;
                    assert_hidden(&format!("source error {{}} ({key})"), &e.to_string());
                    assert_hidden(&format!("source error {{:?}} ({key})"), &format!("{e:?}"));
                }
            }
        }
    }
    assert!(
        checked > 0,
        "some configuration was refused, so an error was checked"
    );
}
