pub mod quantized;
