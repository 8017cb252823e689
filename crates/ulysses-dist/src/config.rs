//! Settings of a distributed job, each overridable from the environment so a launch script
//! can change them without rebuilding. A plain serde struct with Burn-style `with_*` builders:
//! this crate serves every Burn version, so it derives no version's `Config`.

use std::time::Duration;

use crate::DistError;

/// Environment variables that override [`DistributedConfig`] fields.
pub const ENV_SP_SIZE: &str = "ULYSSES_SP_SIZE";

/// `ULYSSES_SP_SIZE`'s `value` (the process's: `std::env::var(ENV_SP_SIZE).ok()`), trimmed,
/// where it says another SP degree than `sp` (or no number): for jobs that take their degree
/// elsewhere (the trainer's `--sp`, a 0.21 job's layout) and refuse a launch script's that
/// would be ignored.
pub fn sp_size_variable_other_than(sp: usize, value: Option<String>) -> Option<String> {
    value.map(|value| value.trim().to_string()).filter(|value| value.parse::<usize>().ok() != Some(sp))
}
pub const ENV_RENDEZVOUS_TIMEOUT: &str = "ULYSSES_RENDEZVOUS_TIMEOUT";
pub const ENV_COLLECTIVE_TIMEOUT: &str = "ULYSSES_COLLECTIVE_TIMEOUT";
pub const ENV_MAX_MESSAGE_BYTES: &str = "ULYSSES_MAX_MESSAGE_BYTES";
pub const ENV_TOKEN: &str = "ULYSSES_RENDEZVOUS_TOKEN";
pub const ENV_TCP_MAX_MESSAGE_BYTES: &str = "ULYSSES_TCP_MAX_MESSAGE_BYTES";
pub const ENV_TCP_ADDR: &str = "ULYSSES_TCP_ADDR";

/// The longest timeout taken (about 31 years).
pub const MAX_TIMEOUT_SECS: f64 = 1e9;

#[derive(Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct DistributedConfig {
    /// Ranks per sequence-parallel group; the data-parallel size is `world / sp_size`.
    /// Consecutive ranks form an SP group, so keep `sp_size` within a node. Default 1. Read by
    /// the burn 0.22 crate's jobs; burn-ulysses' (burn 0.21) take the degree from their
    /// `ParallelLayout` and refuse another here.
    pub sp_size: usize,
    /// How long a rank waits for rank 0's rendezvous and for the other ranks to join. Default 300.
    pub rendezvous_timeout_secs: f64,
    /// How long a collective may take before the communicator is aborted. Default 600.
    pub collective_timeout_secs: f64,
    /// Largest rendezvous message accepted; larger ones close the connection. Default 64 KiB.
    pub max_message_bytes: usize,
    /// The job's shared secret; `None` reads `ULYSSES_RENDEZVOUS_TOKEN`. Never written out: a
    /// serialised config and its `Debug` leave it out (one `?config` in a log line would have
    /// put it in the job's output).
    #[serde(skip_serializing)]
    pub token: Option<String>,
    /// Largest message a rank accepts from a peer over the TCP transport (one rank's part of
    /// one collective); a larger one is a protocol error that names the limit. Default 8 GiB.
    pub tcp_max_message_bytes: u64,
    /// Address the TCP transport listens on and advertises to the other ranks; `None` uses
    /// the address that reaches rank 0.
    pub tcp_address: Option<String>,
}

impl std::fmt::Debug for DistributedConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedConfig")
            .field("sp_size", &self.sp_size)
            .field("rendezvous_timeout_secs", &self.rendezvous_timeout_secs)
            .field("collective_timeout_secs", &self.collective_timeout_secs)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tcp_max_message_bytes", &self.tcp_max_message_bytes)
            .field("tcp_address", &self.tcp_address)
            .finish()
    }
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            sp_size: 1,
            rendezvous_timeout_secs: 300.0,
            collective_timeout_secs: 600.0,
            max_message_bytes: 65536,
            token: None,
            tcp_max_message_bytes: 8 << 30,
            tcp_address: None,
        }
    }
}

impl DistributedConfig {
    pub fn new() -> Self {
        Self::default()
    }

    // `with_<field>` builders, as Burn's `Config` derives them.
    pub fn with_sp_size(mut self, sp_size: usize) -> Self {
        self.sp_size = sp_size;
        self
    }

    pub fn with_rendezvous_timeout_secs(mut self, rendezvous_timeout_secs: f64) -> Self {
        self.rendezvous_timeout_secs = rendezvous_timeout_secs;
        self
    }

    pub fn with_collective_timeout_secs(mut self, collective_timeout_secs: f64) -> Self {
        self.collective_timeout_secs = collective_timeout_secs;
        self
    }

    pub fn with_max_message_bytes(mut self, max_message_bytes: usize) -> Self {
        self.max_message_bytes = max_message_bytes;
        self
    }

    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    pub fn with_tcp_max_message_bytes(mut self, tcp_max_message_bytes: u64) -> Self {
        self.tcp_max_message_bytes = tcp_max_message_bytes;
        self
    }

    pub fn with_tcp_address(mut self, tcp_address: Option<String>) -> Self {
        self.tcp_address = tcp_address;
        self
    }

    /// Applies the `ULYSSES_*` variables of the process environment.
    pub fn with_env_overrides(self) -> Result<Self, DistError> {
        self.with_overrides(|name| std::env::var(name).ok())
    }

    pub fn with_overrides(mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        fn parse<T: std::str::FromStr>(name: &str, value: String) -> Result<T, DistError> {
            value.trim().parse().map_err(|_| DistError::Env(format!("{name}={value:?} is not a valid value")))
        }
        if let Some(value) = lookup(ENV_SP_SIZE) {
            self.sp_size = parse(ENV_SP_SIZE, value)?;
        }
        if let Some(value) = lookup(ENV_RENDEZVOUS_TIMEOUT) {
            self.rendezvous_timeout_secs = parse(ENV_RENDEZVOUS_TIMEOUT, value)?;
        }
        if let Some(value) = lookup(ENV_COLLECTIVE_TIMEOUT) {
            self.collective_timeout_secs = parse(ENV_COLLECTIVE_TIMEOUT, value)?;
        }
        if let Some(value) = lookup(ENV_MAX_MESSAGE_BYTES) {
            self.max_message_bytes = parse(ENV_MAX_MESSAGE_BYTES, value)?;
        }
        if let Some(value) = lookup(ENV_TCP_MAX_MESSAGE_BYTES) {
            self.tcp_max_message_bytes = parse(ENV_TCP_MAX_MESSAGE_BYTES, value)?;
        }
        if let Some(value) = lookup(ENV_TCP_ADDR).filter(|a| !a.trim().is_empty()) {
            self.tcp_address = Some(value.trim().to_string());
        }
        if self.token.is_none() {
            self.token = lookup(ENV_TOKEN).filter(|t| !t.is_empty());
        }
        self.validate()?;
        Ok(self)
    }

    pub fn validate(&self) -> Result<(), DistError> {
        // At most a billion seconds: a deadline past the clock's range would panic.
        let seconds = |name: &str, variable: &str, value: f64| match value > 0.0 && value <= MAX_TIMEOUT_SECS {
            true => Ok(()),
            false => Err(DistError::Env(format!("{name} ({variable}) must be positive, at most {MAX_TIMEOUT_SECS:e} seconds, got {value}"))),
        };
        seconds("rendezvous_timeout_secs", ENV_RENDEZVOUS_TIMEOUT, self.rendezvous_timeout_secs)?;
        seconds("collective_timeout_secs", ENV_COLLECTIVE_TIMEOUT, self.collective_timeout_secs)?;
        if self.sp_size == 0 {
            return Err(DistError::Env(format!("sp_size ({ENV_SP_SIZE}) must be at least 1")));
        }
        // Below it, the first collective's messages are over the limit, blamed on a peer.
        for (name, variable, value) in [
            ("max_message_bytes", ENV_MAX_MESSAGE_BYTES, self.max_message_bytes as u64),
            ("tcp_max_message_bytes", ENV_TCP_MAX_MESSAGE_BYTES, self.tcp_max_message_bytes),
        ] {
            if value < 1024 {
                return Err(DistError::Env(format!("{name} ({variable}) must be at least 1024, got {value}")));
            }
        }
        Ok(())
    }

    pub fn rendezvous_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.rendezvous_timeout_secs)
    }

    pub fn collective_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.collective_timeout_secs)
    }

    /// The token, or the error that says how to provide one.
    pub fn require_token(&self) -> Result<&str, DistError> {
        self.token.as_deref().ok_or(DistError::NoToken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_overrides_fields() {
        let config = DistributedConfig::new()
            .with_overrides(|name| match name {
                ENV_SP_SIZE => Some("4".into()),
                ENV_COLLECTIVE_TIMEOUT => Some("30".into()),
                ENV_TOKEN => Some("secret".into()),
                _ => None,
            })
            .unwrap();
        assert_eq!(config.sp_size, 4);
        assert_eq!(config.collective_timeout(), Duration::from_secs(30));
        assert_eq!(config.rendezvous_timeout(), Duration::from_secs(300));
        assert_eq!(config.require_token().unwrap(), "secret");
    }

    #[test]
    fn the_token_is_never_written_out() {
        let config = DistributedConfig::default().with_token(Some("job-secret-1234".into()));
        for written in [format!("{config:?}"), serde_json::to_string(&config).unwrap()] {
            assert!(!written.contains("job-secret-1234"), "{written}");
        }
        assert!(format!("{config:?}").contains("token: Some(\"<redacted>\")"));
    }

    #[test]
    fn bad_overrides_and_a_missing_token_are_explained() {
        let err = DistributedConfig::new().with_overrides(|n| (n == ENV_SP_SIZE).then(|| "two".into())).unwrap_err();
        assert!(err.to_string().contains("ULYSSES_SP_SIZE=\"two\""), "{err}");
        let err = DistributedConfig::new().with_overrides(|n| (n == ENV_RENDEZVOUS_TIMEOUT).then(|| "0".into())).unwrap_err();
        assert!(err.to_string().contains("rendezvous_timeout_secs (ULYSSES_RENDEZVOUS_TIMEOUT) must be positive"), "{err}");
        // Past what a deadline holds (a panic before), NaN: named.
        for value in ["1e300", "NaN", "inf"] {
            let err = DistributedConfig::new().with_overrides(|n| (n == ENV_COLLECTIVE_TIMEOUT).then(|| value.into())).unwrap_err();
            assert!(err.to_string().contains("ULYSSES_COLLECTIVE_TIMEOUT"), "{value}: {err}");
        }
        // A message limit that every collective's first message would pass.
        for variable in [ENV_MAX_MESSAGE_BYTES, ENV_TCP_MAX_MESSAGE_BYTES] {
            let err = DistributedConfig::new().with_overrides(|n| (n == variable).then(|| "0".into())).unwrap_err();
            assert!(err.to_string().contains(&format!("({variable}) must be at least 1024, got 0")), "{err}");
        }
        let config = DistributedConfig::new().with_overrides(|_| None).unwrap();
        assert!(config.require_token().unwrap_err().to_string().contains("ULYSSES_RENDEZVOUS_TOKEN"));
    }
}
