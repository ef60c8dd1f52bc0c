//! Kafka source adapter for txinbox (rdkafka).
//!
//! Not built yet: this crate reserves the name and the place in the workspace. The adapter itself
//! (ordered offsets, rebalances, database positions) is the Kafka issue's work. Until then use
//! [`txinbox::MessageSource`] to see the contract it will implement.
