mod base;
mod dequantize;
pub mod view;

pub use base::*;
pub use dequantize::*;
