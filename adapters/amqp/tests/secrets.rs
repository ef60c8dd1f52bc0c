//! No password reaches a log line, an error or a `Debug` dump: every configuration and error
//! type of the adapter is formatted (Debug and Display) with a known password in the URI, in
//! the shapes operators really paste: unencoded `/`, `?`, `#` and `@` included. Needs RabbitMQ
//! at `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`) for the wrong-credentials
//! cases.

use std::time::Duration;

use txinbox_amqp::{AmqpConfig, AmqpPublisher, AmqpSource};

const SECRET: &str = "S3cr3t-canary";

/// Passwords as operators paste them, each holding [`SECRET`].
fn passwords() -> Vec<String> {
    ["", "/with/slashes", "?q=1", "#frag", "@at@", ":colon"]
        .iter()
        .map(|tail| format!("{SECRET}{tail}"))
        .collect()
}

fn broker_host() -> String {
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let rest = url.split_once('@').map_or(url.as_str(), |(_, r)| r);
    rest.split('/').next().unwrap_or("127.0.0.1:5672").to_owned()
}

fn assert_hidden(what: &str, text: &str) {
    assert!(!text.contains(SECRET), "{what} shows the password: {text}");
}

#[test]
fn configuration_never_shows_the_password() {
    for pw in passwords() {
        let config = AmqpConfig::new(format!("amqp://guest:{pw}@127.0.0.1:5672/%2f"), "q");
        assert_hidden("AmqpConfig Debug", &format!("{config:?}"));
        assert_hidden("AmqpConfig::redacted_uri", &config.redacted_uri());
        if let Err(e) = config.validate() {
            assert_hidden("AmqpConfig::validate Display", &e.to_string());
            assert_hidden("AmqpConfig::validate Debug", &format!("{e:?}"));
        }
        let malformed = AmqpConfig::new(format!("amqp://guest:{pw}@host:notaport/%2f"), "q");
        let e = malformed.validate().unwrap_err();
        assert_hidden("malformed validate Display", &e.to_string());
        assert_hidden("malformed validate Debug", &format!("{e:?}"));
    }
}

#[tokio::test]
async fn connection_errors_never_show_the_password() {
    let host = broker_host();
    for pw in passwords() {
        for uri in [
            // Wrong credentials on the real broker.
            format!("amqp://guest:{pw}@{host}/%2f"),
            // Nothing listens there.
            format!("amqp://guest:{pw}@127.0.0.1:1/%2f"),
            // Does not parse as a URI.
            format!("amqp://guest:{pw}@host:notaport/%2f"),
        ] {
            let config = AmqpConfig::new(uri.clone(), "secrets-test")
                .connect_timeout(Duration::from_secs(3))
                .declare_topology(false);
            match AmqpSource::connect(config).await {
                Ok(_) => panic!("{uri}: connected with a wrong password"),
                Err(e) => {
                    assert_hidden("AmqpSource::connect Display", &e.to_string());
                    assert_hidden("AmqpSource::connect Debug", &format!("{e:?}"));
                }
            }
            match AmqpPublisher::connect(uri.clone()).await {
                Ok(p) => panic!("{uri}: publisher connected with a wrong password: {p:?}"),
                Err(e) => {
                    assert_hidden("AmqpPublisher::connect Display", &e.to_string());
                    assert_hidden("AmqpPublisher::connect Debug", &format!("{e:?}"));
                }
            }
        }
    }
}

#[tokio::test]
async fn a_connected_publisher_never_shows_the_password() {
    // The broker's own account, with a password that holds the canary: create it for the test.
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let publisher = AmqpPublisher::connect(url.clone())
        .await
        .expect("RabbitMQ at AMQP_URL");
    let shown = format!("{publisher:?}");
    if let Some((_, pw)) = url
        .split_once("://")
        .and_then(|(_, r)| r.rsplit_once('@'))
        .and_then(|(u, _)| u.split_once(':'))
    {
        assert!(!shown.contains(&format!(":{pw}@")), "{shown}");
    }
    assert!(shown.contains("***"), "{shown}");
}
