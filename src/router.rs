//! [`Router`]: several handlers in one consumer, chosen by message type or destination.

use std::fmt;

use async_trait::async_trait;

use crate::dead_letter::DeadLetterReason;
use crate::handler::{Context, Handler, HandlerError};
use crate::message::Message;

/// A [`Handler`] that passes each message to the first route that matches it.
///
/// Routes match on the [message type](Message::message_type) (CloudEvents `type`, or a `type`
/// header) or on the destination (topic or queue). A message no route matches goes to the
/// fallback; without one it is dead-lettered with reason `no_handler`, so an unknown message
/// type never wedges its lane. The chosen handler runs in the same inbox transaction as any
/// other handler.
///
/// ```no_run
/// # use txinbox::{Context, Handler, HandlerError, Message, Router};
/// # struct Placed; struct Cancelled;
/// # #[txinbox::async_trait] impl Handler<sqlx::Postgres> for Placed {
/// #     async fn handle(&self, _: &mut Context<'_, sqlx::Postgres>, _: &Message) -> Result<(), HandlerError> { Ok(()) } }
/// # #[txinbox::async_trait] impl Handler<sqlx::Postgres> for Cancelled {
/// #     async fn handle(&self, _: &mut Context<'_, sqlx::Postgres>, _: &Message) -> Result<(), HandlerError> { Ok(()) } }
/// let router = Router::<sqlx::Postgres>::new()
///     .on_type("com.example.order.placed", Placed)
///     .on_type("com.example.order.cancelled", Cancelled);
/// ```
pub struct Router<DB: sqlx::Database> {
    routes: Vec<(Route, Box<dyn Handler<DB>>)>,
    fallback: Option<Box<dyn Handler<DB>>>,
}

#[derive(Debug)]
enum Route {
    Type(String),
    Destination(String),
}

impl Route {
    fn matches(&self, msg: &Message) -> bool {
        match self {
            Route::Type(t) => msg.message_type() == Some(t.as_str()),
            Route::Destination(d) => &*msg.origin().destination == d.as_str(),
        }
    }
}

impl<DB: sqlx::Database> Default for Router<DB> {
    fn default() -> Self {
        Router {
            routes: Vec::new(),
            fallback: None,
        }
    }
}

impl<DB: sqlx::Database> Router<DB> {
    /// A router with no routes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes messages of type `message_type` to `handler`.
    pub fn on_type(mut self, message_type: impl Into<String>, handler: impl Handler<DB>) -> Self {
        self.routes
            .push((Route::Type(message_type.into()), Box::new(handler)));
        self
    }

    /// Routes messages from `destination` (topic or queue) to `handler`.
    pub fn on_destination(mut self, destination: impl Into<String>, handler: impl Handler<DB>) -> Self {
        self.routes
            .push((Route::Destination(destination.into()), Box::new(handler)));
        self
    }

    /// Handles messages no route matches.
    pub fn fallback(mut self, handler: impl Handler<DB>) -> Self {
        self.fallback = Some(Box::new(handler));
        self
    }
}

#[async_trait]
impl<DB: sqlx::Database> Handler<DB> for Router<DB> {
    async fn handle(&self, cx: &mut Context<'_, DB>, msg: &Message) -> Result<(), HandlerError> {
        let handler = self
            .routes
            .iter()
            .find(|(route, _)| route.matches(msg))
            .map(|(_, h)| h)
            .or(self.fallback.as_ref());
        match handler {
            Some(h) => h.handle(cx, msg).await,
            None => Err(HandlerError::permanent(format!(
                "no route for message type {:?} from {:?}; add one with Router::on_type or Router::fallback",
                msg.message_type(),
                msg.origin().destination
            ))
            .with_reason(DeadLetterReason::NoHandler)),
        }
    }
}

impl<DB: sqlx::Database> fmt::Debug for Router<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Router")
            .field("routes", &self.routes.iter().map(|(r, _)| r).collect::<Vec<_>>())
            .field("fallback", &self.fallback.is_some())
            .finish()
    }
}
