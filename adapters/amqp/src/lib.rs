//! AMQP / RabbitMQ source adapter for txinbox (lapin).
//!
//! Not built yet: this crate reserves the name and the place in the workspace. The adapter itself
//! (manual acks after commit, retry queue, dead-letter exchange, supervisor) is the AMQP issue's
//! work. Until then use [`txinbox::MessageSource`] to see the contract it will implement.
