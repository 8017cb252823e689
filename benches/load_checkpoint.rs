//! Reading a Hugging Face checkpoint folder into the decoder's f32 master weights:
//! ulysses-models' loader (`from_pretrained`, and `from_pretrained_lazily`, whose parameters
//! read their tensors when first used, as ZeRO-3's cut uses them one at a time) against
//! burn-store's `SafetensorsStore` with its PyTorch adapter (the loader before it, the
//! baseline), on the Llama-3.2-1B shape's first `--layers` layers with random weights, the
//! files in the page cache (written just before). Each load is timed with every parameter then
//! visited once (`float_parameters`, which builds a lazy one), the mean of `--runs`; every
//! parameter is compared with burn-store's, bit for bit. In bf16, ulysses-models' loader alone
//! (burn-store keeps bf16 tensors bf16), compared with the f32 values rounded to bf16.
//!
//!     cargo bench -p ulysses-suite --bench load_checkpoint [-- --layers 4 --runs 3]

use std::{path::Path, time::Instant};

use burn::{
    backend::NdArray,
    module::Module,
    tensor::{DType, backend::Backend, bf16},
};
use burn_store::{ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use ulysses_models::{Decoder, DecoderConfig, HF_TO_DECODER, HfConfig, from_pretrained, from_pretrained_lazily, save_pretrained};
use ulysses_training::float_parameters;

type B = NdArray<f32>;

/// Each float parameter's values as bits, in module order.
fn bits(model: &Decoder<B>) -> Vec<Vec<u32>> {
    float_parameters(model).into_iter().map(|p| p.values.into_data().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()).collect()
}

/// burn-store's load of an f32 folder: the decoder built from its config, the file applied
/// through the PyTorch adapter and the renames ulysses-models uses.
fn burn_store_load(folder: &Path, config: &HfConfig) -> Decoder<B> {
    let mut model = DecoderConfig::from_hf(config).init::<B>(&Default::default());
    let mut store = SafetensorsStore::from_file(folder.join("model.safetensors")).with_from_adapter(PyTorchToBurnAdapter).allow_partial(true);
    for (from, to) in HF_TO_DECODER {
        store = store.with_key_remapping(from, to);
    }
    let result = model.load_from(&mut store).unwrap();
    assert!(result.errors.is_empty() && result.missing.is_empty(), "burn-store's load: {result:?}");
    model
}

/// Every parameter visited once: a lazy one read.
fn built(model: Decoder<B>) -> Decoder<B> {
    let _ = float_parameters(&model);
    model
}

/// The mean seconds of `runs` calls of `load`, and the last model.
fn timed(runs: usize, mut load: impl FnMut() -> Decoder<B>) -> (f64, Decoder<B>) {
    let began = Instant::now();
    let mut model = load();
    for _ in 1..runs {
        drop(model);
        model = load();
    }
    (began.elapsed().as_secs_f64() / runs as f64, model)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str, default: usize| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(default);
    let (layers, runs) = (flag("--layers", 4), flag("--runs", 3));
    let shape = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/hf-shapes/llama-3.2-1b.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&shape).unwrap()).unwrap();
    json["num_hidden_layers"] = layers.into();
    let config = HfConfig::from_hf_json(&json.to_string(), "llama-3.2-1b.json").unwrap();
    let device = Default::default();
    B::seed(&device, 3);
    let model = DecoderConfig::from_hf(&config).init::<B>(&device).fork(&device);
    let root = std::env::temp_dir().join(format!("ulysses-load-checkpoint-{}", std::process::id()));
    let (f32_folder, bf16_folder) = (root.join("f32"), root.join("bf16"));
    save_pretrained(&model, &config, &f32_folder, DType::F32).unwrap();
    save_pretrained(&model, &config, &bf16_folder, DType::BF16).unwrap();
    let want = bits(&model);
    drop(model);
    let parameters: usize = want.iter().map(Vec::len).sum();
    let bytes = |folder: &Path| std::fs::metadata(folder.join("model.safetensors")).unwrap().len() as f64;

    println!("Llama-3.2-1B's shape, {layers} layer(s): {parameters} parameters; the mean of {runs} loads, each parameter then visited, the files in the page cache");
    println!("{:<48} {:>6} {:>10} {:>10} {:>14} {:>14}", "loader", "file", "s / load", "GB/s", "vs burn-store", "bit for bit");
    let (baseline, reference) = timed(runs, || built(burn_store_load(&f32_folder, &config)));
    let row = |name: &str, dtype: &str, folder: &Path, seconds: f64, equal: bool| {
        println!("{name:<48} {dtype:>6} {seconds:>10.3} {:>10.2} {:>14.2} {:>14}", bytes(folder) / seconds / 1e9, baseline / seconds, if equal { "yes" } else { "NO" });
    };
    row("burn-store (SafetensorsStore, PyTorch adapter)", "f32", &f32_folder, baseline, bits(&reference) == want);
    drop(reference);
    let (seconds, loaded) = timed(runs, || built(from_pretrained::<B>(&f32_folder, &device).unwrap().model));
    row("from_pretrained", "f32", &f32_folder, seconds, bits(&loaded) == want);
    drop(loaded);
    let (seconds, loaded) = timed(runs, || built(from_pretrained_lazily::<B>(&f32_folder, &device).unwrap().model));
    row("from_pretrained_lazily", "f32", &f32_folder, seconds, bits(&loaded) == want);
    drop(loaded);
    let rounded: Vec<Vec<u32>> = want.iter().map(|p| p.iter().map(|&b| bf16::from_f32(f32::from_bits(b)).to_f32().to_bits()).collect()).collect();
    let (seconds, loaded) = timed(runs, || built(from_pretrained::<B>(&bf16_folder, &device).unwrap().model));
    row("from_pretrained", "bf16", &bf16_folder, seconds, bits(&loaded) == rounded);
    drop(loaded);
    let (seconds, loaded) = timed(runs, || built(from_pretrained_lazily::<B>(&bf16_folder, &device).unwrap().model));
    row("from_pretrained_lazily", "bf16", &bf16_folder, seconds, bits(&loaded) == rounded);
    std::fs::remove_dir_all(root).unwrap();
}
