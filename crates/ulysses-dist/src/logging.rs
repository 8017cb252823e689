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
    init_with_directives(default, &[], extra);
}

/// [`init_with`], the logs' filter (`RUST_LOG`'s or `default`) with `also` added: directives a
/// command-line flag asks for (`"ulysses_training::progress=debug"`), whatever `RUST_LOG` says.
pub fn init_with_directives<L: Layer<Registry> + Send + Sync + 'static>(default: &str, also: &[&str], extra: L) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    for directive in also {
        match directive.parse() {
            Ok(directive) => filter = filter.add_directive(directive),
            Err(error) => eprintln!("warning: the log directive {directive:?} is not one ({error}); left out"),
        }
    }
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(filter);
    tracing_subscriber::registry().with(extra).with(logs).init();
}
