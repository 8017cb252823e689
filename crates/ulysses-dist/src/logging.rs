//! Logs of the binaries: `RUST_LOG` (default level as given) to stderr, coloured only on a
//! terminal (a launcher's pipe or a log file gets plain text).

/// Installs the subscriber; `default` is the filter when `RUST_LOG` is unset.
pub fn init(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
