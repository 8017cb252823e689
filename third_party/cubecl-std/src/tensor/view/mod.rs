mod as_view;
mod base;
mod idx;
pub mod launch;
mod operations;

pub use as_view::*;
pub use base::*;
pub use operations::*;
