mod array;
mod base;
mod slice;
mod tensor_map;
mod view;
mod virtual_tensor;
mod virtual_view;

pub use base::*;
pub use virtual_view::*;
