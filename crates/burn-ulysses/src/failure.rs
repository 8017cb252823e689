//! A failure of burn-ulysses' own ops inside a model, kept beside its panic: backend ops
//! (attention, the exchange's backward, the ring's) return no errors, so they panic, and a
//! caller that catches the panic (the training step) takes the error as it was (a peer's loss
//! stays `UlyssesError::Comm`) rather than its message.

use std::cell::RefCell;

use ulysses_core::error::UlyssesError;

thread_local! {
    static FAILURE: RefCell<Option<UlyssesError>> = const { RefCell::new(None) };
}

/// Panics with `error`'s message, keeping `error` for [`take_failure`].
pub(crate) fn fail(error: UlyssesError) -> ! {
    let message = error.to_string();
    FAILURE.with_borrow_mut(|failure| *failure = Some(error));
    panic!("{message}")
}

/// Forgets this thread's last [`fail`]'s error (before a run whose panics are caught: one a
/// caller that caught it left is not that run's).
pub fn clear_failure() {
    FAILURE.with_borrow_mut(|failure| *failure = None);
}

/// The error of this thread's last [`fail`], taken, where its message is `message` (the
/// panic a caller caught was that failure's, not another's).
pub fn take_failure(message: &str) -> Option<UlyssesError> {
    FAILURE.with_borrow_mut(Option::take).filter(|error| error.to_string() == message)
}
