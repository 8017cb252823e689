//! Logs of the binaries: `RUST_LOG` (default level as given) to stderr, coloured only on a
//! terminal (a launcher's pipe or a log file gets plain text).

use tracing_subscriber::{Layer, Registry, layer::{Identity, SubscriberExt}, util::SubscriberInitExt};

/// Installs the subscriber; `default` is the filter when `RUST_LOG` is unset.
pub fn init(default: &str) {
    init_with(default, Identity::new());
}

/// [`init`], with `extra` beside the logs: a layer that sees what its own filter lets through
/// (a counter of trace spans, say), whatever `RUST_LOG` says, since the logs' filter is theirs
/// alone.
pub fn init_with<L: Layer<Registry> + Send + Sync + 'static>(default: &str, extra: L) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(filter);
    tracing_subscriber::registry().with(extra).with(logs).init();
}
