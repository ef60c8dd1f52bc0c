//! [`Router`]: several handlers in one consumer, chosen by message type or destination.

use std::fmt;

use async_trait::async_trait;
use tracing::Instrument;

use crate::dead_letter::DeadLetterReason;
use crate::handler::{BatchContext, BatchHandler, BatchMessage, Context, Handler, HandlerError};
use crate::message::Message;

/// A [`Handler`] that passes each message to the first route that matches it.
///
/// Routes match on the [message type](Message::message_type) (CloudEvents `type`, or a `type`
/// header) or on the destination (topic or queue). A message no route matches goes to the
/// fallback; without one it is dead-lettered with reason `no_handler`, so an unknown message
/// type never wedges its lane. The chosen handler runs in the same inbox transaction as any
/// other handler.
///
/// Batch handlers are kept: when a route's handler has a [`BatchHandler`] form, the router has
/// one too. It splits a micro-batch into runs of consecutive messages that go to the same
/// handler, in lane order, and gives each run of two or more to that handler's
/// [`BatchHandler::handle_batch`] (the rest to [`Handler::handle`], in the message's span), so
/// the effects are those of each message handled in order.
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

/// Which handler of a [`Router`] a message goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Route(usize),
    Fallback,
    Nowhere,
}

impl<DB: sqlx::Database> Router<DB> {
    fn target(&self, msg: &Message) -> Target {
        match self.routes.iter().position(|(route, _)| route.matches(msg)) {
            Some(i) => Target::Route(i),
            None if self.fallback.is_some() => Target::Fallback,
            None => Target::Nowhere,
        }
    }

    fn handler(&self, target: Target) -> Option<&dyn Handler<DB>> {
        match target {
            Target::Route(i) => Some(&*self.routes[i].1),
            Target::Fallback => self.fallback.as_deref(),
            Target::Nowhere => None,
        }
    }
}

/// The dead letter of a message no route matches.
fn no_route(msg: &Message) -> HandlerError {
    HandlerError::permanent(format!(
        "no route for message type {:?} from {:?}; add one with Router::on_type or Router::fallback",
        msg.message_type(),
        msg.origin().destination
    ))
    .with_reason(DeadLetterReason::NoHandler)
}

#[async_trait]
impl<DB: sqlx::Database> Handler<DB> for Router<DB> {
    async fn handle(&self, cx: &mut Context<'_, DB>, msg: &Message) -> Result<(), HandlerError> {
        match self.handler(self.target(msg)) {
            Some(h) => h.handle(cx, msg).await,
            None => Err(no_route(msg)),
        }
    }

    /// `Some` when any route's handler (or the fallback) has a batch form.
    fn batch(&self) -> Option<&dyn BatchHandler<DB>> {
        let batched = self
            .routes
            .iter()
            .map(|(_, h)| h)
            .chain(self.fallback.as_ref())
            .any(|h| h.batch().is_some());
        batched.then_some(self as &dyn BatchHandler<DB>)
    }
}

#[async_trait]
impl<DB: sqlx::Database> BatchHandler<DB> for Router<DB> {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, DB>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        let mut rest = batch;
        while let Some(first) = rest.first() {
            let target = self.target(first.message());
            let len = rest
                .iter()
                .take_while(|m| self.target(m.message()) == target)
                .count();
            let (run, after) = rest.split_at(len);
            rest = after;
            let Some(handler) = self.handler(target) else {
                return Err(no_route(first.message()));
            };
            match handler.batch() {
                Some(batched) if run.len() > 1 => batched.handle_batch(cx, run).await?,
                _ => {
                    for m in run {
                        let mut one = Context {
                            conn: &mut *cx.conn,
                            consumer: cx.consumer,
                            id: m.id(),
                            attempt: m.attempt(),
                        };
                        handler
                            .handle(&mut one, m.message())
                            .instrument(m.span().clone())
                            .await?;
                    }
                }
            }
        }
        Ok(())
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
