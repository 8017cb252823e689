mod base;
mod launch;
mod perpendicular;

pub use base::*;
pub use launch::*;
pub use perpendicular::*;
