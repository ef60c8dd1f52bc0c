//! The Rust snippets of the README, the guide, BENCHMARKS.md and the adapters' READMEs, compiled
//! (and, unless `no_run`, run) by `cargo test` as doctests: one item per file below. A new
//! chapter goes on this list.

#[cfg(doctest)]
mod readmes {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../BENCHMARKS.md")]
    struct Benchmarks;
    #[doc = include_str!("../adapters/kafka/README.md")]
    struct KafkaReadme;
    #[doc = include_str!("../adapters/amqp/README.md")]
    struct AmqpReadme;
    #[doc = include_str!("../adapters/http/README.md")]
    struct HttpReadme;
    #[doc = include_str!("../testing/README.md")]
    struct TestingReadme;
}

#[cfg(doctest)]
mod guide {
    #[doc = include_str!("README.md")]
    struct Contents;
    #[doc = include_str!("processing.md")]
    struct Processing;
    #[doc = include_str!("kafka.md")]
    struct Kafka;
    #[doc = include_str!("connecting.md")]
    struct Connecting;
    #[doc = include_str!("throughput.md")]
    struct Throughput;
    #[doc = include_str!("database.md")]
    struct Database;
    #[doc = include_str!("outbox.md")]
    struct Outbox;
    #[doc = include_str!("http.md")]
    struct Http;
    #[doc = include_str!("operations.md")]
    struct Operations;
    #[doc = include_str!("observability.md")]
    struct Observability;
    #[doc = include_str!("crash-matrix.md")]
    struct CrashMatrix;
    #[doc = include_str!("adapters.md")]
    struct Adapters;
    #[doc = include_str!("architecture.md")]
    struct Architecture;
}

/// Every chapter of the guide is on the list above: a new one cannot slip past the compiler.
#[cfg(test)]
mod tests {
    #[test]
    fn every_chapter_is_compiled() {
        let listed = include_str!("lib.rs");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut missing = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".md") && !listed.contains(&format!("include_str!(\"{name}\")")) {
                missing.push(name);
            }
        }
        assert!(missing.is_empty(), "add these to docs/lib.rs: {missing:?}");
    }
}
