//! Failures inside the model become errors. Backend ops return no errors, so a collective
//! that fails inside attention (a peer died) or a layout refused there can only panic; the
//! training step catches the panic and reports it like every other error of the step. Printed
//! as well, by Rust's panic hook and with a backtrace on every surviving rank, it would bury
//! the one line that names what happened: [`quiet_caught_panics`] keeps those quiet.

use std::{
    cell::Cell,
    panic::{AssertUnwindSafe, catch_unwind},
    sync::Once,
};

use ulysses_core::comm::panic_message;

thread_local! {
    /// How many [`catch_model_failure`] calls this thread is inside.
    static CATCHING: Cell<u32> = const { Cell::new(0) };
}

/// Runs `run`, catching a panic as its message.
pub fn catch_model_failure<T>(run: impl FnOnce() -> T) -> Result<T, String> {
    CATCHING.with(|depth| depth.set(depth.get() + 1));
    let result = catch_unwind(AssertUnwindSafe(run)).map_err(|payload| panic_message(payload.as_ref()));
    CATCHING.with(|depth| depth.set(depth.get() - 1));
    result
}

/// Installs (once per process) a panic hook that prints nothing for a panic that
/// [`catch_model_failure`] turns into an error (it is logged at debug level, with where it
/// happened), and hands every other panic to the hook installed before. For a program's
/// `main`: a library leaves the hook alone.
pub fn quiet_caught_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let earlier = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CATCHING.with(Cell::get) > 0 {
                let location = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
                tracing::debug!(%location, "caught in the model, reported as an error: {}", panic_message(info.payload()));
            } else {
                earlier(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caught_panic_is_its_message_and_the_thread_is_outside_afterwards() {
        let caught = catch_model_failure(|| -> u32 { panic!("peer 3 is gone") });
        assert_eq!(caught, Err("peer 3 is gone".to_string()));
        assert_eq!(CATCHING.with(Cell::get), 0);
        assert_eq!(catch_model_failure(|| 7), Ok(7));
    }
}
