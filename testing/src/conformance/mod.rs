//! Conformance suites: the documented contracts of sources, deliveries and publishers as tests.
