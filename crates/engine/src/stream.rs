//! [`RequestStream`]: the events of one request, as the worker produces
//! them: a blocking iterator, and a `futures::Stream` for async callers
//! (any runtime: the worker wakes the reader's task itself). Dropping the
//! stream cancels the request.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;

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
    /// The task polling the stream, woken by every event sent.
    waker: Arc<AtomicWaker>,
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
        events: EventReceiver,
        cancel: Arc<AtomicBool>,
        backlog: Arc<AtomicUsize>,
        n: usize,
    ) -> Self {
        RequestStream {
            rx: events.rx,
            waker: events.waker,
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

    /// The same events as a `futures::Stream`, for async callers on any
    /// runtime; dropping it cancels the request too.
    pub fn into_async(self) -> EventStream {
        EventStream(self)
    }

    /// Counts a received event (`None`: the worker is gone).
    fn took(&mut self, ev: Option<Event>) -> Option<Event> {
        match &ev {
            Some(Event::Done(_)) => self.open -= 1,
            Some(Event::Error(_)) | None => self.open = 0,
            Some(Event::Token { .. }) => {
                self.backlog.fetch_sub(1, Ordering::Relaxed);
            }
        }
        ev
    }

    /// The next event if one is waiting: `Err(())` when none is yet.
    fn try_next(&mut self) -> Result<Option<Event>, ()> {
        match self.rx.try_recv() {
            Ok(ev) => Ok(self.took(Some(ev))),
            Err(TryRecvError::Disconnected) => Ok(self.took(None)),
            Err(TryRecvError::Empty) => Err(()),
        }
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
        self.took(ev)
    }
}

/// A request's events as a `futures::Stream`
/// ([`RequestStream::into_async`]): `Pending` until the worker sends the
/// next event and wakes the polling task.
pub struct EventStream(RequestStream);

impl EventStream {
    /// See [`RequestStream::canceller`].
    pub fn canceller(&self) -> Canceller {
        self.0.canceller()
    }
}

impl futures_util::Stream for EventStream {
    type Item = Event;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let this = &mut self.get_mut().0;
        if this.open == 0 {
            return Poll::Ready(None);
        }
        if let Ok(ev) = this.try_next() {
            return Poll::Ready(ev);
        }
        // Registered before looking again, so an event sent in between
        // is either seen now or wakes the task.
        this.waker.register(cx.waker());
        match this.try_next() {
            Ok(ev) => Poll::Ready(ev),
            Err(()) => Poll::Pending,
        }
    }
}

/// A request's event channel: the worker's end and the stream's.
pub(crate) fn channel() -> (EventSender, EventReceiver) {
    let (tx, rx) = mpsc::channel();
    let waker = Arc::new(AtomicWaker::new());
    (
        EventSender {
            tx: Some(tx),
            waker: waker.clone(),
        },
        EventReceiver { rx, waker },
    )
}

/// The stream's end of [`channel`].
pub(crate) struct EventReceiver {
    rx: mpsc::Receiver<Event>,
    waker: Arc<AtomicWaker>,
}

/// The worker's end of a request's events: every event sent, and every
/// sender dropped, wakes the task polling the stream, if one is.
#[derive(Clone)]
pub(crate) struct EventSender {
    /// `None` only while being dropped.
    tx: Option<mpsc::Sender<Event>>,
    waker: Arc<AtomicWaker>,
}

impl EventSender {
    /// `Err` when the stream is gone.
    pub(crate) fn send(&self, ev: Event) -> Result<(), ()> {
        let sent = match &self.tx {
            Some(tx) => tx.send(ev).map_err(|_| ()),
            None => Err(()),
        };
        self.waker.wake();
        sent
    }
}

impl Drop for EventSender {
    fn drop(&mut self) {
        // The channel closed first (when this was the last sender), so
        // that the woken stream sees it closed rather than empty.
        drop(self.tx.take());
        self.waker.wake();
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.open > 0 {
            self.cancel();
        }
    }
}
