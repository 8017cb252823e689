//! Shared helpers of the integration tests and benches (the `ulysses-suite` library).
