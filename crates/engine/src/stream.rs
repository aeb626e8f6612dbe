//! [`RequestStream`]: the events of one request, as the worker produces
//! them. Dropping the stream cancels the request.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use crate::sampler::TokenLogprob;
use crate::types::Completion;
use crate::EngineError;

/// What a request reports, in order: tokens of each sample as they come,
/// then one `Done` per sample (or one `Error`, after which nothing follows).
#[derive(Debug)]
pub enum Event {
    /// A generated token and the text it completes: valid UTF-8, possibly
    /// empty while a character or a possible stop string is held back.
    Token {
        index: usize,
        id: u32,
        text: String,
        /// When the request asked for log-probabilities.
        logprob: Option<Box<TokenLogprob>>,
    },
    /// A sample finished: its text, tokens, finish reason, usage, timings.
    Done(Box<Completion>),
    /// The request failed; what it computed stays cached.
    Error(EngineError),
}

/// The events of a request. An iterator that ends after the last sample is
/// done or after an error.
pub struct RequestStream {
    rx: mpsc::Receiver<Event>,
    cancel: Arc<AtomicBool>,
    /// Token events sent and not yet read (the worker pauses the request
    /// past [`MAX_BACKLOG`]).
    backlog: Arc<AtomicUsize>,
    open: usize,
}

/// Token events a request may have waiting for its reader: past this many
/// the engine pauses it (it computes nothing and keeps its blocks) until
/// the reader has caught up by half, so a client that reads slowly, or not
/// at all, costs bounded memory and no compute.
pub const MAX_BACKLOG: usize = 1024;

impl RequestStream {
    pub(crate) fn new(
        rx: mpsc::Receiver<Event>,
        cancel: Arc<AtomicBool>,
        backlog: Arc<AtomicUsize>,
        n: usize,
    ) -> Self {
        RequestStream {
            rx,
            cancel,
            backlog,
            open: n,
        }
    }

    /// Stops the request at the next step; each open sample then ends with
    /// [`FinishReason::Cancelled`](crate::FinishReason::Cancelled).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// A handle that cancels this request from elsewhere (another thread,
    /// a guard dropped when a client hangs up), queued or running; after
    /// the request ended it does nothing.
    pub fn canceller(&self) -> Canceller {
        Canceller(self.cancel.clone())
    }
}

/// Cancels one request: see [`RequestStream::canceller`].
#[derive(Debug, Clone)]
pub struct Canceller(Arc<AtomicBool>);

impl Canceller {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl Iterator for RequestStream {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        if self.open == 0 {
            return None;
        }
        let ev = self.rx.recv().ok();
        match &ev {
            Some(Event::Done(_)) => self.open -= 1,
            Some(Event::Error(_)) | None => self.open = 0,
            Some(Event::Token { .. }) => {
                self.backlog.fetch_sub(1, Ordering::Relaxed);
            }
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.open > 0 {
            self.cancel();
        }
    }
}
