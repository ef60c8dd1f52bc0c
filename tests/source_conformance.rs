//! The `MessageSource`/`Delivery` conformance suite (`txinbox_testing::conformance::source`)
//! against the in-memory broker: one test per case.

txinbox_testing::source_conformance!(txinbox_testing::conformance::source::MemoryHarness::new);
