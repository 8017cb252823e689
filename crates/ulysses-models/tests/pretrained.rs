//! Checkpoints transformers wrote, loaded here and run against transformers' own outputs.
//!
//! `scripts/hf-fixtures.py` made, for Llama (tied embeddings), Llama with llama3 RoPE, Llama
//! with `attention_bias` (q, k, v and output biases), Mistral, Mistral with a head dim of its
//! own and no window (Mistral-Nemo's kind), Qwen2 (q/k/v biases, tied) and
//! Qwen3 (q/k norms, head dim 32), a tiny model with random weights (q and k scaled up, so
//! attention is peaked; the biases random too, where transformers' init zeroes them) in
//! `model.safetensors`, and
//! transformers' logits and loss for two plain rows and a row packing three documents in
//! `expected.safetensors`, and the gradients of that loss in `gradients.safetensors`. Each
//! loads with `from_pretrained` and gives the same logits (within 1e-4, at SP=1 and SP=2), loss
//! (within 1e-5) and gradients (within 1e-4 relative), f32 on the CPU; six AdamW steps train
//! it as PyTorch's AdamW does (`training.safetensors`); saved back with `save_pretrained`, it
//! is the file transformers wrote; what does not fit is refused by name.

use std::{
    collections::HashMap,
    io::Write,
    path::{Path, PathBuf},
};

use burn::{
    backend::NdArray,
    tensor::{Int, Tensor, TensorData, backend::Backend},
};
use burn_ulysses::{data::{ShardCut, ShardPositions}, visibility::PositionIds};
use ulysses_training::lm_loss_sum_inference;
use ulysses_models::from_pretrained;

type Cpu = NdArray<f32>;

const LOGITS_TOLERANCE: f64 = 1e-4;
const LOSS_TOLERANCE: f64 = 1e-5;

fn model_fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut folders: Vec<PathBuf> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.join("expected.safetensors").exists()).collect();
    folders.sort();
    assert_eq!(folders.len(), 7, "the model fixtures of scripts/hf-fixtures.py in {}", root.display());
    folders
}

/// A tensor of `expected.safetensors`: its shape and values.
struct Expected {
    shape: Vec<usize>,
    values: Vec<f64>,
}

fn expected(folder: &Path) -> HashMap<String, Expected> {
    outputs(&folder.join("expected.safetensors"))
}

/// Every tensor of one of transformers' output files.
fn outputs(file: &Path) -> HashMap<String, Expected> {
    let bytes = std::fs::read(file).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view.data();
            let values = match view.dtype() {
                safetensors::Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect(),
                safetensors::Dtype::F64 => data.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap())).collect(),
                safetensors::Dtype::I64 => data.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64).collect(),
                other => panic!("{name}: unexpected dtype {other:?}"),
            };
            (name, Expected { shape: view.shape().to_vec(), values })
        })
        .collect()
}

fn tokens<B: Backend>(expected: &Expected) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = expected.values.iter().map(|&v| v as i64).collect();
    Tensor::from_data(TensorData::new(ids, [expected.shape[0], expected.shape[1]]), &Default::default())
}

/// The largest absolute difference; NaN or infinity anywhere is infinite.
fn largest_difference(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, |a, d| if d.is_finite() && a.is_finite() { a.max(d) } else { f64::INFINITY })
}

#[test]
fn every_family_gives_transformers_logits_and_loss() {
    for folder in model_fixtures() {
        let name = folder.file_name().unwrap().to_string_lossy().into_owned();
        let want = expected(&folder);
        let model = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap_or_else(|e| panic!("{name}: {e}")).model;

        // Two plain rows.
        let input = tokens::<Cpu>(&want["input_ids"]);
        let [batch, seq] = input.dims();
        let positions = ShardPositions::consecutive(batch, seq);
        let logits = model.forward(input.clone(), &positions).into_data().to_vec::<f32>().unwrap();
        let plain = largest_difference(&logits, &want["logits"].values);

        // The loss as the trainer computes it: labels shifted, the last one ignored, from the
        // hidden states and the output head a chunk at a time.
        let ignore = -100;
        let labels = Tensor::cat(vec![input.clone().slice([0..batch, 1..seq]), Tensor::full([batch, 1], ignore, &Default::default())], 1);
        let loss_sum = lm_loss_sum_inference(model.lm_output(input, &positions), labels, ignore).into_scalar() as f64;
        let loss = loss_sum / (batch * (seq - 1)) as f64;
        let loss_difference = (loss - want["loss"].values[0]).abs();

        // One row packing three documents: positions restart at each.
        let packed_input = tokens::<Cpu>(&want["packed_input_ids"]);
        let ids: Vec<u64> = want["packed_position_ids"].values.iter().map(|&v| v as u64).collect();
        let packed_positions = ShardPositions { ids: PositionIds::new(ids, 1, packed_input.dims()[1]).unwrap(), packed: true, cut: ShardCut::WHOLE };
        let packed_logits = model.forward(packed_input, &packed_positions).into_data().to_vec::<f32>().unwrap();
        let packed = largest_difference(&packed_logits, &want["packed_logits"].values);

        println!("{name}: logits {plain:.1e} plain, {packed:.1e} packed; loss {loss:.6} ({loss_difference:.1e} from transformers')");
        assert!(plain <= LOGITS_TOLERANCE, "{name}: plain logits differ from transformers' by {plain:e}");
        assert!(packed <= LOGITS_TOLERANCE, "{name}: packed logits differ from transformers' by {packed:e}");
        assert!(loss_difference <= LOSS_TOLERANCE, "{name}: loss {loss} against transformers' {}", want["loss"].values[0]);
    }
}

/// Rows `rank`'s shard of `[batch, seq, vocab]` values: its `seq / size` tokens of each row.
fn shard_of(values: &[f64], shape: &[usize], rank: usize, size: usize) -> Vec<f64> {
    let (seq, vocab) = (shape[1], shape[2]);
    let local = seq / size;
    values.chunks(seq * vocab).flat_map(|row| row[rank * local * vocab..(rank + 1) * local * vocab].to_vec()).collect()
}

/// Under `UlyssesBackend` with two in-process ranks, each holding half of every row, the
/// loaded checkpoints give transformers' logits for their halves, plain and packed.
#[test]
fn every_family_gives_transformers_logits_at_sp_2() {
    for folder in model_fixtures() {
        let name = folder.file_name().unwrap().to_string_lossy().into_owned();
        check_logits_at_sp(&folder, &expected(&folder), 2, &name);
    }
}

/// Runs the checkpoint in `folder` under `UlyssesBackend` with `sp` in-process ranks, each
/// holding its shard of every row of `want`'s plain and packed inputs, and checks each rank's
/// logits against transformers' for its shard.
fn check_logits_at_sp(folder: &Path, want: &HashMap<String, Expected>, sp: usize, name: &str) {
    use burn_ulysses::{UlyssesBackend, comm::ThreadGroup};
    type Sp = UlyssesBackend<Cpu>;
    let ranks = ThreadGroup::new(sp).run(|rank| {
        let _sp = Sp::enter_thread(rank.communicator());
        let (r, device) = (rank.rank(), Default::default());
        let model = from_pretrained::<Sp>(folder, &device).unwrap_or_else(|e| panic!("{name}: {e}")).model;
        let logits_of = |input: &Expected, ids: Option<&Expected>| {
            let all = tokens::<Sp>(input);
            let [batch, seq] = all.dims();
            let local = seq / sp;
            let shard = all.slice([0..batch, r * local..(r + 1) * local]);
            let positions = match ids {
                None => ShardPositions::contiguous_shard(batch, local, r, sp),
                Some(ids) => {
                    let ids: Vec<u64> = ids.values[r * local..(r + 1) * local].iter().map(|&v| v as u64).collect();
                    ShardPositions { ids: PositionIds::new(ids, 1, local).unwrap(), packed: true, cut: ShardCut { of: sp, index: r, runs: 1 } }
                }
            };
            model.forward(shard, &positions).into_data().to_vec::<f32>().unwrap()
        };
        (logits_of(&want["input_ids"], None), logits_of(&want["packed_input_ids"], Some(&want["packed_position_ids"])))
    });
    for (r, result) in ranks.into_iter().enumerate() {
        let (plain, packed) = result.unwrap_or_else(|panic| panic!("{name}: rank {r}: {panic}"));
        let plain = largest_difference(&plain, &shard_of(&want["logits"].values, &want["logits"].shape, r, sp));
        let packed = largest_difference(&packed, &shard_of(&want["packed_logits"].values, &want["packed_logits"].shape, r, sp));
        println!("{name}, SP={sp}, rank {r}: logits {plain:.1e} plain, {packed:.1e} packed");
        assert!(plain <= LOGITS_TOLERANCE, "{name}: rank {r}'s plain logits differ from transformers' by {plain:e}");
        assert!(packed <= LOGITS_TOLERANCE, "{name}: rank {r}'s packed logits differ from transformers' by {packed:e}");
    }
}

/// A copy of fixture `name` in a fresh folder, with `edit` applied to its config.json.
fn edited_copy(name: &str, case: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let to = std::env::temp_dir().join(format!("ulysses-models-{}-{name}-{case}", std::process::id()));
    let _ = std::fs::remove_dir_all(&to);
    std::fs::create_dir_all(&to).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(from.join(file), to.join(file)).unwrap();
    }
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(to.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(to.join("config.json"), config.to_string()).unwrap();
    to
}

fn load_error(dir: &Path) -> String {
    match from_pretrained::<Cpu>(dir, &Default::default()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(error) => error.to_string(),
    }
}

/// A folder that holds both the single weights file and an index (here a stale one, naming a
/// shard that is gone) loads the single file, as transformers does.
#[test]
fn the_single_weights_file_takes_priority_over_an_index_as_in_transformers() {
    let both = edited_copy("llama", "both", |_| {});
    let index = serde_json::json!({"metadata": {"total_size": 4}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}});
    std::fs::write(both.join("model.safetensors.index.json"), index.to_string()).unwrap();
    if let Err(error) = from_pretrained::<Cpu>(&both, &Default::default()) {
        panic!("a folder with model.safetensors and a stale index did not load: {error}");
    }
    std::fs::remove_dir_all(both).unwrap();
}

/// Weights the configuration does not describe are refused, naming the tensor and the file.
#[test]
fn weights_that_do_not_fit_the_config_are_refused_by_name() {
    // Llama's fixture ties its embeddings (no lm_head.weight in the file): untied, the head is missing.
    let untied = edited_copy("llama", "untied", |c| c["tie_word_embeddings"] = false.into());
    let error = load_error(&untied);
    assert!(error.contains("`lm_head.weight` is missing"), "{error}");

    // Mistral's has its own head: tied, it loads untied (see
    // `a_tied_config_reads_its_weights_as_transformers_5_does`). RoPE's frequencies that old
    // conversions kept are skipped as transformers skips them; a tensor the decoder has no
    // place for is refused.
    let tied = edited_copy("mistral", "tied", |c| c["tie_word_embeddings"] = true.into());
    if let Err(error) = from_pretrained::<Cpu>(&tied, &Default::default()) {
        panic!("a tied model with a saved head did not load: {error}");
    }
    let with_extra = |name: &str| {
        edit_weights(&tied, |tensors| {
            tensors.insert(name.to_string(), (safetensors::Dtype::F32, vec![2], vec![0; 8]));
        })
    };
    with_extra("model.layers.0.self_attn.rotary_emb.inv_freq");
    if let Err(error) = from_pretrained::<Cpu>(&tied, &Default::default()) {
        panic!("RoPE's saved frequencies were not skipped: {error}");
    }
    with_extra("model.layers.0.self_attn.k_scale");
    let error = load_error(&tied);
    assert!(error.contains("model.safetensors: tensor `model.layers.0.self_attn.k_scale` is not used: this decoder has no such tensor"), "{error}");

    // A wider MLP than the file's.
    let wider = edited_copy("qwen2", "wider", |c| c["intermediate_size"] = 128.into());
    let error = load_error(&wider);
    assert!(error.contains("model.safetensors: tensor `model.layers.") && error.contains("_proj.weight` has shape"), "{error}");

    // Qwen3's q/k norms on a model without them.
    let no_norms = edited_copy("qwen3", "llama", |c| {
        c["model_type"] = "llama".into();
        c["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    });
    let error = load_error(&no_norms);
    assert!(error.contains("_norm.weight` is not used"), "{error}");

    // A download cut short: the header whole, the weights not; then the header cut too. Each
    // names the file, both sizes and the fix.
    let cut = edited_copy("llama", "cut", |_| {});
    let weights = cut.join("model.safetensors");
    let whole = std::fs::metadata(&weights).unwrap().len();
    for (keep, places) in [(whole - 1, format!("places {whole}")), (20, "places ".to_string())] {
        std::fs::OpenOptions::new().write(true).open(&weights).unwrap().set_len(keep).unwrap();
        let error = load_error(&cut);
        for needle in ["model.safetensors: is cut short", &format!("{keep} bytes"), &places, "fetch it again"] {
            assert!(error.contains(needle), "cut to {keep} of {whole} bytes: `{needle}` missing from: {error}");
        }
    }
    // Longer than its header says.
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/model.safetensors"), &weights).unwrap();
    std::fs::OpenOptions::new().append(true).open(&weights).unwrap().write_all(b"trailing").unwrap();
    let error = load_error(&cut);
    assert!(error.contains(&format!("has 8 bytes past the {whole} its header places")), "{error}");
    // A quantized tensor (int8): named with its dtype, not a panic deep in the load.
    let original = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&original[8..8 + header_len]).unwrap();
    header["model.norm.weight"]["dtype"] = "I8".into();
    let header = serde_json::to_vec(&header).unwrap();
    let mut quantized = (header.len() as u64).to_le_bytes().to_vec();
    quantized.extend(&header);
    quantized.extend(&original[8 + header_len..]);
    std::fs::write(&weights, quantized).unwrap();
    let error = load_error(&cut);
    assert!(error.contains("tensor `model.norm.weight` is I8, not a float") && error.contains("quantized checkpoint"), "{error}");
    // Not safetensors at all.
    std::fs::write(&weights, b"<!DOCTYPE html><html>an error page saved as the weights</html>").unwrap();
    let error = load_error(&cut);
    assert!(error.contains("model.safetensors: is not a safetensors file"), "{error}");
    // A clone without git-lfs: the weights and the tokenizer are pointers, named as such.
    let pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1234\n";
    std::fs::write(&weights, pointer).unwrap();
    let error = load_error(&cut);
    assert!(error.contains("model.safetensors: is a Git LFS pointer") && error.contains("git lfs pull"), "{error}");
    std::fs::write(cut.join("tokenizer.json"), pointer).unwrap();
    let error = ulysses_models::tokenizer::TextTokenizer::from_file(&cut).map(|_| ()).unwrap_err().to_string();
    assert!(error.contains("tokenizer.json: is a Git LFS pointer") && error.contains("huggingface-cli download"), "{error}");
    std::fs::remove_dir_all(cut).unwrap();

    // No weights at all.
    std::fs::remove_file(wider.join("model.safetensors")).unwrap();
    let error = load_error(&wider);
    assert!(error.contains("holds neither model.safetensors nor model.safetensors.index.json"), "{error}");

    for dir in [untied, tied, wider, no_norms] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// A model built from a config.json's shape alone (the trainer's `--hf-config`) starts as
/// transformers' does: weights of standard deviation `initializer_range`, so its first loss is
/// about ln(vocabulary). burn's unit-variance embeddings, tied to the head, would start at
/// logits of size √hidden_size (a loss of hundreds at Qwen3-0.6B's width).
#[test]
fn a_model_from_a_config_alone_starts_at_transformers_initialisation() {
    let mut with_biases = 0;
    for folder in model_fixtures() {
        let name = folder.file_name().unwrap().to_string_lossy().into_owned();
        let config = ulysses_models::HfConfig::from_hf(&folder).unwrap();
        let model = ulysses_models::DecoderConfig::from_hf(&config).init::<Cpu>(&Default::default());
        let std_of = |values: Vec<f32>| {
            let mean = values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64;
            (values.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / values.len() as f64).sqrt()
        };
        let embedding = std_of(model.embedding.weight.val().into_data().to_vec::<f32>().unwrap());
        let query = std_of(model.blocks[0].attention.wq.weight.val().into_data().to_vec::<f32>().unwrap());
        for (what, std) in [("embedding", embedding), ("q projection", query)] {
            assert!((std / config.initializer_range - 1.0).abs() < 0.1, "{name}: {what} std {std}, initializer_range {}", config.initializer_range);
        }
        // Biases (Qwen2's q, k, v) start at zero, as transformers' `_init_weights` sets them,
        // and still train.
        let trained = ulysses_models::DecoderConfig::from_hf(&config).init::<burn::backend::Autodiff<Cpu>>(&Default::default());
        let bias = &trained.blocks[0].attention.wq.bias;
        assert_eq!(bias.is_some(), config.qkv_bias, "{name}: a q bias where the config asks for one");
        if let Some(bias) = bias {
            with_biases += 1;
            let values = bias.val().into_data().to_vec::<f32>().unwrap();
            assert!(values.iter().all(|&v| v == 0.0), "{name}: a q bias starts at {:?}", values.iter().find(|&&v| v != 0.0));
            assert!(bias.val().is_require_grad(), "{name}: the q bias takes no gradient");
        }
        // Random tokens: the loss of near-uniform predictions.
        let (batch, seq) = (2, 32);
        let ids: Vec<i64> = (0..batch * seq).map(|i| ((i * 7919) % config.vocab_size) as i64).collect();
        let input = Tensor::<Cpu, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &Default::default());
        let positions = ShardPositions::consecutive(batch, seq);
        let ignore = -100;
        let labels = Tensor::cat(vec![input.clone().slice([0..batch, 1..seq]), Tensor::full([batch, 1], ignore, &Default::default())], 1);
        let loss = lm_loss_sum_inference(model.lm_output(input, &positions), labels, ignore).into_scalar() as f64 / (batch * (seq - 1)) as f64;
        let uniform = (config.vocab_size as f64).ln();
        println!("{name}: first loss {loss:.3}, ln(vocabulary) {uniform:.3}");
        assert!(loss.is_finite() && (loss - uniform).abs() < 0.5, "{name}: first loss {loss} against ln(vocabulary) {uniform}");
    }
    assert!(with_biases > 0, "no fixture has q, k, v biases (Qwen2's): their initialisation went unchecked");
}

/// Mistral's sliding window (64 in the fixture) where it matters: over 150 tokens, plain and
/// packing documents of 100 and 50, the logits and loss equal transformers' on one device
/// (burn's attention with the window as a mask) and at SP=2 and 3 (the window over the whole
/// sequence, across shard edges; 3 ranks split 4 heads unevenly). transformers' window changes
/// these logits by up to 0.19 (`scripts/hf-fixtures.py` checks it does), far above the
/// tolerance.
#[test]
fn mistral_gives_transformers_logits_past_its_sliding_window() {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mistral");
    let want = outputs(&folder.join("window.safetensors"));
    let model = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap().model;
    let input = tokens::<Cpu>(&want["input_ids"]);
    let [batch, seq] = input.dims();
    assert!(seq > 2 * 64, "the fixture's rows ({seq} tokens) must pass the window");
    let positions = ShardPositions::consecutive(batch, seq);
    let plain = largest_difference(&model.forward(input.clone(), &positions).into_data().to_vec::<f32>().unwrap(), &want["logits"].values);
    let labels = Tensor::cat(vec![input.clone().slice([0..batch, 1..seq]), Tensor::full([batch, 1], -100, &Default::default())], 1);
    let loss = lm_loss_sum_inference(model.lm_output(input, &positions), labels, -100).into_scalar() as f64 / (batch * (seq - 1)) as f64;
    let packed_input = tokens::<Cpu>(&want["packed_input_ids"]);
    let ids: Vec<u64> = want["packed_position_ids"].values.iter().map(|&v| v as u64).collect();
    let packed_positions = ShardPositions { ids: PositionIds::new(ids, 1, seq).unwrap(), packed: true, cut: ShardCut::WHOLE };
    let packed = largest_difference(&model.forward(packed_input, &packed_positions).into_data().to_vec::<f32>().unwrap(), &want["packed_logits"].values);
    let loss_difference = (loss - want["loss"].values[0]).abs();
    println!("mistral past its window: logits {plain:.1e} plain, {packed:.1e} packed; loss {loss:.6} ({loss_difference:.1e} from transformers')");
    assert!(plain <= LOGITS_TOLERANCE, "plain logits differ from transformers' by {plain:e}");
    assert!(packed <= LOGITS_TOLERANCE, "packed logits differ from transformers' by {packed:e}");
    assert!(loss_difference <= LOSS_TOLERANCE, "loss {loss} against transformers' {}", want["loss"].values[0]);
    for sp in [2, 3] {
        check_logits_at_sp(&folder, &want, sp, "mistral past its window");
    }
}

/// The largest difference of `folder`'s model's logits for the fixture's two plain rows from
/// `want`'s (transformers'), and whether its config ties the head.
fn plain_logits_difference(folder: &Path, want: &HashMap<String, Expected>) -> (f64, bool) {
    let pretrained = from_pretrained::<Cpu>(folder, &Default::default()).unwrap_or_else(|e| panic!("{}: {e}", folder.display()));
    let input = tokens::<Cpu>(&want["input_ids"]);
    let [batch, seq] = input.dims();
    let logits = pretrained.model.forward(input, &ShardPositions::consecutive(batch, seq)).into_data().to_vec::<f32>().unwrap();
    (largest_difference(&logits, &want["logits"].values), pretrained.config.tie_word_embeddings)
}

/// `folder`'s model.safetensors with `edit` applied to its tensors (name → dtype, shape, bytes).
fn edit_weights(folder: &Path, edit: impl FnOnce(&mut std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let weights = folder.join("model.safetensors");
    let mut tensors = tensors_of(&weights);
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        tensors.iter().map(|(name, (dtype, shape, data))| (name.clone(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap())).collect();
    std::fs::write(&weights, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// A weight past f16's largest value is refused by a save in f16 (which would write infinity),
/// naming it and bf16; bf16 saves it.
#[test]
fn a_save_in_f16_refuses_a_weight_it_would_write_as_infinity() {
    use burn::tensor::DType;
    use ulysses_models::save_pretrained;
    let folder = edited_copy("llama", "past-f16", |_| {});
    edit_weights(&folder, |t| {
        let (dtype, _, bytes) = t.get_mut("model.norm.weight").unwrap();
        assert_eq!(*dtype, safetensors::Dtype::F32, "the fixture's weights are f32");
        bytes[..4].copy_from_slice(&1e5f32.to_le_bytes());
    });
    let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
    let out = folder.join("saved");
    let error = save_pretrained(&pretrained.model, &pretrained.config, &out, DType::F16).unwrap_err().to_string();
    assert!(error.contains("`norm.") && error.contains("past f16's largest (65504)") && error.contains("--save-hf-dtype bf16"), "{error}");
    save_pretrained(&pretrained.model, &pretrained.config, &out, DType::BF16).unwrap();
    std::fs::remove_dir_all(folder).unwrap();
}

/// A save whose config describes another model than the one saved is refused, naming the
/// parameter, and writes nothing: an untied model under a tied config wrote a head the config
/// says is the embeddings (transformers drops it: other logits), a tied one under an untied
/// config left `lm_head.weight` out (transformers fills it with random values, warning alone).
#[test]
fn a_save_with_the_config_of_another_model_is_refused() {
    use burn::tensor::DType;
    use ulysses_models::{DecoderConfig, HfCheckpointSnapshot, SaveOptions, save_pretrained};
    let folder = edited_copy("llama", "other-config", |_| {});
    let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
    assert!(pretrained.config.tie_word_embeddings, "the fixture's head is its embeddings");
    let untied = DecoderConfig::from_hf(&pretrained.config).with_tie_embeddings(false).init::<Cpu>(&Default::default());
    let out = folder.join("saved");
    let error = save_pretrained(&untied, &pretrained.config, &out, DType::F32).unwrap_err().to_string();
    assert!(error.contains("the model has `lm_head.weight`") && error.contains("describes another model"), "{error}");
    let untied_config = ulysses_models::HfConfig { tie_word_embeddings: false, ..pretrained.config.clone() };
    let error = save_pretrained(&pretrained.model, &untied_config, &out, DType::F32).unwrap_err().to_string();
    assert!(error.contains("config.json's model has `lm_head.weight`"), "{error}");
    let fewer_layers = ulysses_models::HfConfig { num_hidden_layers: pretrained.config.num_hidden_layers - 1, ..pretrained.config.clone() };
    let error = HfCheckpointSnapshot::take(&pretrained.model, &fewer_layers, &out, SaveOptions::new(DType::F32), &[]).err().expect("refused").to_string();
    assert!(error.contains(&format!("the model has `blocks.{}.", fewer_layers.num_hidden_layers)), "{error}");
    assert!(!out.exists(), "a refused save wrote {}", out.display());
    save_pretrained(&pretrained.model, &pretrained.config, &out, DType::F32).unwrap();
    std::fs::remove_dir_all(folder).unwrap();
}

/// A config that ties the head to the embeddings, with weights that say otherwise, loads as
/// transformers 5 loads it (5.17 and 5.24 checked): Mistral's own head beside its embeddings,
/// differing, is kept (untied: transformers' logits for the untied fixture, and the config says
/// so); Llama's embeddings beside a head equal to them, or a head alone, are the tied weight
/// (transformers' logits, tied).
#[test]
fn a_tied_config_reads_its_weights_as_transformers_5_does() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let tied = edited_copy("mistral", "tied-differing", |c| c["tie_word_embeddings"] = true.into());
    let (difference, ties) = plain_logits_difference(&tied, &expected(&fixtures.join("mistral")));
    println!("mistral tied, its head differing: logits {difference:.1e} from transformers' (untied)");
    assert!(difference <= LOGITS_TOLERANCE && !ties, "a differing head: logits {difference:e} from transformers', tied {ties}");
    assert!(!ulysses_models::checkpoint_config(&tied).unwrap().tie_word_embeddings, "the config alone says untied too");

    let llama = expected(&fixtures.join("llama"));
    for (case, edit) in [
        ("beside-equal", (|t: &mut std::collections::BTreeMap<_, _>| {
            let embeddings = t["model.embed_tokens.weight"].clone();
            t.insert("lm_head.weight".to_string(), embeddings);
        }) as fn(&mut std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>)),
        ("head-alone", |t| {
            let embeddings = t.remove("model.embed_tokens.weight").unwrap();
            t.insert("lm_head.weight".to_string(), embeddings);
        }),
    ] {
        let folder = edited_copy("llama", case, |_| {});
        edit_weights(&folder, edit);
        let (difference, ties) = plain_logits_difference(&folder, &llama);
        println!("llama tied, {case}: logits {difference:.1e} from transformers'");
        assert!(difference <= LOGITS_TOLERANCE && ties, "{case}: logits {difference:e} from transformers', tied {ties}");
        assert!(ulysses_models::checkpoint_config(&folder).unwrap().tie_word_embeddings, "{case}: the config alone says tied too");
        std::fs::remove_dir_all(folder).unwrap();
    }
    std::fs::remove_dir_all(tied).unwrap();
}

/// Fine-tuning a checkpoint here follows PyTorch step by step: from each of Llama's (tied head),
/// Qwen2's (biases) and Qwen3's (q/k norms) fixtures, six steps at SP=2 of the library's
/// replicated AdamW (`MatrixDecayAdamW`: decay on the matrices, betas 0.9/0.999, eps 1e-8, the
/// gradient clipped to norm 1) on the fixture's two plain rows, at the learning rates the
/// fixture gives, against `torch.optim.AdamW` with the Trainer's parameter groups over
/// transformers' model (`scripts/hf-fixtures.py`, `training.safetensors`): each step's loss
/// within 1e-5 and gradient norm within 1e-4 relative, and every trained parameter within 1e-4
/// of its tensor's largest value (f32 sums in another order, through six Adam steps), but the
/// key biases', whose gradient is rounding alone.
#[test]
fn fine_tuning_follows_pytorchs_adamw_step_by_step() {
    use burn::{backend::Autodiff, optim::AdamWConfig, tensor::DType};
    use burn_ulysses::{ParallelGroups, ParallelLayout, RankScope, UlyssesBackend, UlyssesConfig, comm::ThreadGroup, data::SequenceSharder};
    use ulysses_training::{MatrixDecayAdamW, StepInput, apply_step, backward_step};
    type Sp = UlyssesBackend<Autodiff<Cpu>>;
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for name in ["llama", "qwen2", "qwen3"] {
        let folder = fixtures.join(name);
        let want = outputs(&folder.join("training.safetensors"));
        let rows: Vec<Vec<i64>> = {
            let ids = &expected(&folder)["input_ids"];
            ids.values.chunks(ids.shape[1]).map(|row| row.iter().map(|&v| v as i64).collect()).collect()
        };
        let rates = want["learning_rates"].values.clone();
        let saved = std::env::temp_dir().join(format!("ulysses-models-{}-{name}-fine-tuned", std::process::id()));
        let per_rank = ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Cpu> = ParallelGroups::new(rank.communicator(), ParallelLayout::new().with_sp_size(2)).unwrap();
            let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
            let device = Default::default();
            let pretrained = from_pretrained::<Sp>(&folder, &device).unwrap();
            let mut model = pretrained.model;
            let adamw = AdamWConfig::new().with_weight_decay(0.01).with_beta_1(0.9).with_beta_2(0.999).with_epsilon(1e-8);
            let mut optimizer = MatrixDecayAdamW::<ulysses_models::Decoder<Sp>, Sp>::new(&adamw);
            let micro_batches = [rows.clone()];
            let mut reports = Vec::new();
            for (index, &learning_rate) in rates.iter().enumerate() {
                let step = StepInput { index, learning_rate, micro_batches: &micro_batches, documents: None, targets: None, max_grad_norm: Some(1.0) };
                let local = backward_step(&model, &step, &SequenceSharder::new(2), &groups, &device).unwrap();
                let (next, report) = apply_step(model, &mut optimizer, &step, local, &groups).unwrap();
                model = next;
                reports.push((report.loss, report.grad_norm));
            }
            if rank.rank() == 0 {
                ulysses_models::save_pretrained(&model, &pretrained.config, &saved, DType::F32).unwrap();
            }
            reports
        });
        let reports = per_rank.into_iter().next().unwrap().unwrap_or_else(|panic| panic!("{name}: {panic}"));
        let mut worst = (0.0f64, 0.0f64, 0.0f64);
        for (step, &(loss, norm)) in reports.iter().enumerate() {
            let (want_loss, want_norm) = (want["losses"].values[step], want["grad_norms"].values[step]);
            let (loss_difference, norm_difference) = ((loss - want_loss).abs(), (norm - want_norm).abs() / want_norm);
            assert!(loss_difference <= 1e-5, "{name}, step {step}: loss {loss} against PyTorch's {want_loss}");
            assert!(norm_difference <= 1e-4, "{name}, step {step}: gradient norm {norm} against PyTorch's {want_norm}");
            worst = (worst.0.max(loss_difference), worst.1.max(norm_difference), worst.2);
        }
        let trained = tensors_of(&saved.join("model.safetensors"));
        for (key, tensor) in want.iter().filter(|(key, _)| key.starts_with("trained.")) {
            let hf_name = &key["trained.".len()..];
            let got = f32_values(&trained.get(hf_name).unwrap_or_else(|| panic!("{name}: {hf_name} not saved")).2);
            if hf_name.ends_with("k_proj.bias") {
                // Its gradient is 0 but for rounding (a key bias adds the same to each score of
                // a query's row, which the softmax takes away): Adam's normalised steps turn
                // either side's rounding into steps of up to the learning rate. Finite, then.
                assert!(got.iter().all(|v| v.is_finite()), "{name}: trained {hf_name} is not finite");
                continue;
            }
            let scale = tensor.values.iter().fold(0.0f64, |a, v| a.max(v.abs()));
            let difference = largest_difference(&got, &tensor.values) / scale;
            assert!(difference <= 1e-4, "{name}: trained {hf_name} is {difference:e} (of its largest value) from PyTorch's");
            worst.2 = worst.2.max(difference);
        }
        println!(
            "{name}: {} steps, loss {:.4} -> {:.4}; largest differences from PyTorch: loss {:.1e}, gradient norm {:.1e} (relative), parameters {:.1e} (of the largest)",
            reports.len(),
            reports[0].0,
            reports[reports.len() - 1].0,
            worst.0,
            worst.1,
            worst.2
        );
        std::fs::remove_dir_all(saved).unwrap();
    }
}

/// Every tensor of a safetensors file: name → (dtype, shape, bytes).
fn tensors_of(file: &Path) -> std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(file).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors().into_iter().map(|(name, view)| (name, (view.dtype(), view.shape().to_vec(), view.data().to_vec()))).collect()
}

/// Saved with `save_pretrained`, each checkpoint holds exactly the tensors transformers wrote
/// (names, shapes, f32 values bit for bit) and reloads to identical logits; in bf16, every
/// tensor is bf16 and the config says so. Saving over an earlier folder replaces it.
/// `ULYSSES_SAVED_HF_DIR=DIR` also keeps each in `DIR/NAME` (in bf16), for
/// `scripts/hf-check-saved.py` to load in transformers.
#[test]
fn a_saved_checkpoint_is_the_one_transformers_wrote() {
    use burn::tensor::DType;
    use ulysses_models::save_pretrained;
    for folder in model_fixtures() {
        let name = folder.file_name().unwrap().to_string_lossy().into_owned();
        let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
        let out = std::env::temp_dir().join(format!("ulysses-models-{}-saved-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        save_pretrained(&pretrained.model, &pretrained.config, &out, DType::F32).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (want, got) = (tensors_of(&folder.join("model.safetensors")), tensors_of(&out.join("model.safetensors")));
        assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{name}: tensor names");
        for (tensor, (dtype, shape, bytes)) in &want {
            let (got_dtype, got_shape, got_bytes) = &got[tensor];
            assert_eq!((dtype, shape), (got_dtype, got_shape), "{name}: {tensor}");
            assert!(bytes == got_bytes, "{name}: {tensor} differs from the file transformers wrote");
        }

        let input = tokens::<Cpu>(&expected(&folder)["input_ids"]);
        let positions = ShardPositions::consecutive(input.dims()[0], input.dims()[1]);
        let logits = |model: &ulysses_models::Decoder<Cpu>| model.forward(input.clone(), &positions).into_data().to_vec::<f32>().unwrap();
        let reloaded = from_pretrained::<Cpu>(&out, &Default::default()).unwrap();
        assert_eq!(reloaded.config, pretrained.config, "{name}: config.json written back");
        assert!(logits(&reloaded.model) == logits(&pretrained.model), "{name}: reloaded logits differ");

        // bf16 over the f32 folder.
        save_pretrained(&pretrained.model, &pretrained.config, &out, DType::BF16).unwrap();
        let half = tensors_of(&out.join("model.safetensors"));
        assert_eq!(half.len(), want.len(), "{name}");
        assert!(half.values().all(|(dtype, _, _)| *dtype == safetensors::Dtype::BF16), "{name}: not all bf16");
        let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["torch_dtype"].as_str().or(config["dtype"].as_str()), Some("bfloat16"), "{name}: {config}");
        let leftovers: Vec<_> = std::fs::read_dir(std::env::temp_dir()).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(&format!(".{}.", out.file_name().unwrap().to_string_lossy()))).collect();
        assert!(leftovers.is_empty(), "{name}: {leftovers:?} left beside the folder");
        let reloaded = from_pretrained::<Cpu>(&out, &Default::default()).unwrap();
        let difference = largest_difference(&logits(&reloaded.model), &logits(&pretrained.model).iter().map(|&v| v as f64).collect::<Vec<_>>());
        println!("{name}: saved in f32, bit for bit; in bf16, logits within {difference:.1e}");
        if let Ok(keep) = std::env::var("ULYSSES_SAVED_HF_DIR") {
            save_pretrained(&pretrained.model, &pretrained.config, &Path::new(&keep).join(&name), DType::BF16).unwrap();
        }
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// Past `max_shard_bytes`, the weights are saved as transformers shards them: numbered shards
/// of at most that size, an index naming the file of every tensor and their total size, and no
/// `model.safetensors`; the shards hold, together, the tensors transformers wrote bit for bit,
/// and the folder reloads to identical logits. Saved over a single-file folder, nothing of it
/// is left. `ULYSSES_SAVED_HF_DIR=DIR` also keeps it, in bf16, in `DIR-sharded/qwen3` (for
/// `scripts/hf-check-saved.py`).
/// A save into a link to a folder writes where it leads: the link stays, and the folder it
/// leads to holds the new model (the link was replaced by a real folder, the earlier model left
/// where it leads, which anything reading that path then loaded).
#[test]
fn a_save_into_a_link_writes_where_it_leads() {
    use burn::tensor::DType;
    use ulysses_models::{check_save_destination, save_pretrained};
    let folder = model_fixtures().into_iter().find(|f| f.ends_with("qwen3")).expect("the qwen3 fixture");
    let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
    let root = std::env::temp_dir().join(format!("ulysses-models-{}-link", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let (target, link) = (root.join("scratch-tuned"), root.join("tuned"));
    save_pretrained(&pretrained.model, &pretrained.config, &target, DType::F32).unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    check_save_destination(&link).unwrap();
    save_pretrained(&pretrained.model, &pretrained.config, &link, DType::BF16).unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(target.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16", "the folder the link leads to holds the new model");
    let mut names: Vec<String> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["scratch-tuned", "tuned"], "nothing left beside them");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn weights_past_the_shard_size_are_saved_in_shards_with_their_index() {
    use burn::tensor::DType;
    use ulysses_models::{SaveOptions, save_pretrained, save_pretrained_with};
    let folder = model_fixtures().into_iter().find(|f| f.ends_with("qwen3")).expect("the qwen3 fixture");
    let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
    let out = std::env::temp_dir().join(format!("ulysses-models-{}-sharded", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    save_pretrained(&pretrained.model, &pretrained.config, &out, DType::F32).unwrap();
    let max_shard_bytes = 100_000;
    save_pretrained_with(&pretrained.model, &pretrained.config, &out, SaveOptions { dtype: DType::F32, max_shard_bytes }).unwrap();

    let want = tensors_of(&folder.join("model.safetensors"));
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    let weight_map = index["weight_map"].as_object().expect("a weight_map");
    let mut files: Vec<String> = weight_map.values().map(|v| v.as_str().unwrap().to_string()).collect();
    files.sort();
    files.dedup();
    let count = files.len();
    assert!(count > 3, "{count} shards of a {} KB model at 100 KB each", want.values().map(|t| t.2.len()).sum::<usize>() / 1000);
    let names: Vec<String> = (1..=count).map(|k| format!("model-{k:05}-of-{count:05}.safetensors")).collect();
    assert_eq!(files, names);
    let mut on_disk: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    on_disk.sort();
    let mut expected_files = names.clone();
    expected_files.extend(["config.json".to_string(), "model.safetensors.index.json".to_string()]);
    expected_files.sort();
    assert_eq!(on_disk, expected_files, "the folder holds exactly the shards, their index and config.json");

    let mut got = std::collections::BTreeMap::new();
    for name in &names {
        let shard = tensors_of(&out.join(name));
        let bytes: usize = shard.values().map(|t| t.2.len()).sum();
        assert!(bytes as u64 <= max_shard_bytes || shard.len() == 1, "{name}: {bytes} bytes in {} tensors", shard.len());
        for (tensor, value) in shard {
            assert_eq!(weight_map[&tensor].as_str(), Some(name.as_str()), "{tensor}: the index names another file");
            assert!(got.insert(tensor.clone(), value).is_none(), "{tensor} in two shards");
        }
    }
    assert!(got == want, "the shards together differ from the file transformers wrote");
    let total: usize = want.values().map(|t| t.2.len()).sum();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total as u64));

    let input = tokens::<Cpu>(&expected(&folder)["input_ids"]);
    let positions = ShardPositions::consecutive(input.dims()[0], input.dims()[1]);
    let logits = |model: &ulysses_models::Decoder<Cpu>| model.forward(input.clone(), &positions).into_data().to_vec::<f32>().unwrap();
    let reloaded = from_pretrained::<Cpu>(&out, &Default::default()).unwrap();
    assert!(logits(&reloaded.model) == logits(&pretrained.model), "reloaded logits differ");
    if let Ok(keep) = std::env::var("ULYSSES_SAVED_HF_DIR") {
        // For scripts/hf-check-saved.py: a sharded bf16 folder beside the others.
        let options = SaveOptions { dtype: DType::BF16, max_shard_bytes };
        save_pretrained_with(&pretrained.model, &pretrained.config, &Path::new(&format!("{keep}-sharded")).join("qwen3"), options).unwrap();
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// A module's parameters replaced by their gradients, so that `save_pretrained` writes the
/// gradients with Hugging Face's names and layouts.
struct GradientsAsParameters<'a, B: burn::tensor::backend::AutodiffBackend>(&'a B::Gradients);

impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleMapper<B> for GradientsAsParameters<'_, B> {
    fn map_float<const D: usize>(&mut self, param: burn::module::Param<Tensor<B, D>>) -> burn::module::Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let gradient = tensor.grad(self.0).expect("every parameter has a gradient");
        burn::module::Param::from_mapped_value(id, Tensor::from_inner(gradient), mapper)
    }
}

fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

/// The gradients of the loss (the trainer's chunked loss over two plain rows) with respect to
/// every parameter equal transformers' within 1e-4 of each tensor's largest gradient.
#[test]
fn every_family_gives_transformers_gradients() {
    use burn::{backend::Autodiff, module::{AutodiffModule, Module}, tensor::DType};
    use ulysses_training::lm_loss_sum;
    use ulysses_models::save_pretrained;
    type Train = Autodiff<Cpu>;
    const GRADIENT_TOLERANCE: f64 = 1e-4;
    for folder in model_fixtures() {
        let name = folder.file_name().unwrap().to_string_lossy().into_owned();
        let pretrained = from_pretrained::<Train>(&folder, &Default::default()).unwrap();
        let input = tokens::<Train>(&expected(&folder)["input_ids"]);
        let [batch, seq] = input.dims();
        let ignore = -100;
        let labels = Tensor::cat(vec![input.clone().slice([0..batch, 1..seq]), Tensor::full([batch, 1], ignore, &Default::default())], 1);
        let loss = lm_loss_sum(pretrained.model.lm_output(input, &ShardPositions::consecutive(batch, seq)), labels, ignore) / (batch * (seq - 1)) as f64;
        let grads = loss.backward();
        let gradients = pretrained.model.clone().map(&mut GradientsAsParameters::<Train>(&grads)).valid();
        let out = std::env::temp_dir().join(format!("ulysses-models-{}-gradients-{name}", std::process::id()));
        save_pretrained(&gradients, &pretrained.config, &out, DType::F32).unwrap();
        let (want, got) = (tensors_of(&folder.join("gradients.safetensors")), tensors_of(&out.join("model.safetensors")));
        assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{name}: gradient names");
        let mut worst = (0.0f64, String::new());
        for (tensor, (_, shape, bytes)) in &want {
            assert_eq!(shape, &got[tensor].1, "{name}: {tensor}");
            let (want_values, got_values) = (f32_values(bytes), f32_values(&got[tensor].2));
            let scale = want_values.iter().fold(0.0f64, |a, &v| a.max((v as f64).abs()));
            let relative = largest_difference(&got_values, &want_values.iter().map(|&v| v as f64).collect::<Vec<_>>()) / scale;
            assert!(relative <= GRADIENT_TOLERANCE, "{name}: the gradient of {tensor} differs from transformers' by {relative:e} of its largest value");
            if relative > worst.0 {
                worst = (relative, tensor.clone());
            }
        }
        println!("{name}: {} gradients, within {:.1e} of transformers' relative to each one's largest (worst {})", want.len(), worst.0, worst.1);
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// A save destination is checked before training without making anything: folders that do not
/// exist yet pass (the save makes them) and stay absent; a path below a file is refused naming
/// the file.
#[test]
fn a_save_destination_is_checked_without_making_folders() {
    let root = std::env::temp_dir().join(format!("ulysses-models-{}-destination", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let nested = root.join("not").join("yet").join("tuned");
    ulysses_models::check_save_destination(&nested).unwrap();
    assert!(!root.join("not").exists(), "the check made folders");
    assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0, "the check left a file behind");
    std::fs::write(root.join("a-file"), b"").unwrap();
    let error = ulysses_models::check_save_destination(&root.join("a-file").join("tuned")).unwrap_err().to_string();
    assert!(error.contains("a-file: is not a folder") && error.contains("choose a folder you can write"), "{error}");
    let error = ulysses_models::check_save_destination(&root.join("a-file")).unwrap_err().to_string();
    assert!(error.contains("exists and is not a folder"), "{error}");
    std::fs::remove_dir_all(root).unwrap();
}

/// The names in folder `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// What killed saves left beside the folder is set right by the next save: a torn folder
/// (`.NAME.partial-PID`) removed, the earlier model a save had set aside (`.NAME.earlier-PID`)
/// removed, or put back where the kill fell between the save's two renames and left no folder.
/// A live process's leftovers (pid 1's: as a save under way) are not touched.
#[test]
fn a_save_sets_right_what_killed_saves_left() {
    use burn::tensor::DType;
    use ulysses_models::{SaveOptions, save_pretrained_with};
    let folder = model_fixtures().into_iter().find(|f| f.ends_with("qwen3")).expect("the qwen3 fixture");
    let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
    let root = std::env::temp_dir().join(format!("ulysses-models-{}-killed-saves", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let out = root.join("tuned");
    let names = || names_in(&root);
    // No process has a pid above Linux's largest (2^22).
    let (dead, alive) = ("9999999", "1");
    // A kill between the renames: the earlier model aside, no folder, and a torn new one.
    std::fs::create_dir_all(root.join(format!(".tuned.earlier-{dead}"))).unwrap();
    std::fs::write(root.join(format!(".tuned.earlier-{dead}")).join("config.json"), b"the earlier model").unwrap();
    std::fs::create_dir_all(root.join(format!(".tuned.partial-{dead}"))).unwrap();
    std::fs::create_dir_all(root.join(format!(".other.partial-{dead}"))).unwrap();
    // The save's begin puts the earlier model back (a save that then failed would leave it
    // in place); this one succeeds and replaces it.
    std::fs::create_dir_all(root.join(format!(".tuned.earlier-{alive}"))).unwrap();
    save_pretrained_with(&pretrained.model, &pretrained.config, &out, SaveOptions::new(DType::BF16)).unwrap();
    assert_eq!(names(), [format!(".other.partial-{dead}"), format!(".tuned.earlier-{alive}"), "tuned".to_string()], "leftovers of tuned's killed saves");
    from_pretrained::<Cpu>(&out, &Default::default()).expect("the new model");
    // With the folder there, an earlier model set aside by a killed save is removed.
    std::fs::create_dir_all(root.join(format!(".tuned.earlier-{dead}"))).unwrap();
    save_pretrained_with(&pretrained.model, &pretrained.config, &out, SaveOptions::new(DType::BF16)).unwrap();
    assert!(!names().contains(&format!(".tuned.earlier-{dead}")), "{:?}", names());
    // A run, as it starts, puts back a model a kill left set aside (it stayed there, no folder
    // at `tuned`, until the run's own save); the check that writes nothing does not.
    std::fs::rename(&out, root.join(format!(".tuned.earlier-{dead}"))).unwrap();
    ulysses_models::check_save_destination(&out).unwrap();
    assert!(!names().contains(&"tuned".to_string()), "the check wrote: {:?}", names());
    ulysses_models::recover_killed_saves(&out).unwrap();
    assert!(names().contains(&"tuned".to_string()) && !names().contains(&format!(".tuned.earlier-{dead}")), "{:?}", names());
    from_pretrained::<Cpu>(&out, &Default::default()).expect("the model put back");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A save carries the checkpoint's tokenizer and generation settings over, byte for byte, and
/// replaces a folder an earlier save wrote; a folder that holds anything else (a run's
/// checkpoint, the fixtures' reference outputs) is refused before the save, and found at the
/// end of one too: left as it was, the new model beside it, named in the error.
#[test]
fn a_save_replaces_a_saved_folder_alone_and_carries_the_tokenizer_over() {
    use burn::tensor::DType;
    use ulysses_models::{SaveOptions, check_save_destination, save_pretrained_including};
    let folder = model_fixtures().into_iter().find(|f| f.ends_with("qwen3")).expect("the qwen3 fixture");
    let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
    let tokenizer = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/tokenizer.json");
    let companions = [(folder.join("generation_config.json"), "generation_config.json".to_string()), (tokenizer.clone(), "tokenizer.json".to_string())];
    let root = std::env::temp_dir().join(format!("ulysses-models-{}-companions", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let out = root.join("tuned");
    let save_in = |max_shard_bytes| save_pretrained_including(&pretrained.model, &pretrained.config, &out, SaveOptions { dtype: DType::BF16, max_shard_bytes }, &companions);
    let save = || save_in(ulysses_models::DEFAULT_MAX_SHARD_BYTES);
    save().unwrap();
    let names = names_in;
    assert_eq!(names(&out), ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]);
    assert_eq!(std::fs::read(out.join("tokenizer.json")).unwrap(), std::fs::read(&tokenizer).unwrap());
    check_save_destination(&out).expect("a folder an earlier save wrote");
    save().expect("replaced by the next save");

    let refused = check_save_destination(&folder).unwrap_err().to_string();
    assert!(refused.contains("expected.safetensors") && refused.contains("would delete"), "{refused}");
    // A run's checkpoint that appears in the folder while the model trains.
    std::fs::write(out.join("checkpoint.ulysses"), b"a run's state").unwrap();
    let error = save().unwrap_err().to_string();
    assert!(error.contains("checkpoint.ulysses") && error.contains("the model was written to"), "{error}");
    assert_eq!(std::fs::read(out.join("checkpoint.ulysses")).unwrap(), b"a run's state");
    let beside = root.join(names(&root).into_iter().find(|n| n.starts_with("tuned.unsaved-")).expect("the new model beside the folder"));
    assert_eq!(names(&beside), ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]);
    // Sharded, the folder left beside holds its index: a checkpoint that loads.
    std::fs::remove_dir_all(&beside).unwrap();
    save_in(100_000).unwrap_err();
    assert!(beside.join("model.safetensors.index.json").exists(), "{:?}", names(&beside));
    from_pretrained::<Cpu>(&beside, &Default::default()).expect("the model left beside loads");

    let other = save_pretrained_including(&pretrained.model, &pretrained.config, &root.join("other"), SaveOptions::new(DType::BF16), &[(folder.join("config.json"), "config.json".into())]);
    assert!(other.unwrap_err().to_string().contains("is not one of the files a save carries over"));
    // A save that fails part way (a companion it cannot read) leaves no torn folder behind.
    let missing = [(root.join("no-such-tokenizer.json"), "tokenizer.json".to_string())];
    save_pretrained_including(&pretrained.model, &pretrained.config, &root.join("other"), SaveOptions::new(DType::BF16), &missing).unwrap_err();
    assert!(!names(&root).iter().any(|n| n.starts_with(".other.partial-")), "a failed save's folder was left: {:?}", names(&root));
    std::fs::remove_dir_all(&root).unwrap();
}

/// transformers' named template for conversations given tools (`additional_chat_templates/
/// tool_use.jinja`, which `ChatTemplate` renders them with) is carried over in its folder, byte
/// for byte, and a folder so saved is replaced by the next save, not refused as holding a folder
/// a save did not write.
#[test]
fn a_save_carries_the_tool_use_template_over_in_its_folder() {
    use burn::tensor::DType;
    use ulysses_models::{SaveOptions, save_pretrained_including};
    let folder = model_fixtures().into_iter().find(|f| f.ends_with("qwen3")).expect("the qwen3 fixture");
    let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
    let root = std::env::temp_dir().join(format!("ulysses-models-{}-tool-template", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let (plain, tools) = (root.join("chat_template.jinja"), root.join("tool_use.jinja"));
    std::fs::write(&plain, "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    std::fs::write(&tools, "{{ tools | length }} tools: {% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let companions = [(plain, "chat_template.jinja".to_string()), (tools.clone(), "additional_chat_templates/tool_use.jinja".to_string())];
    let out = root.join("tuned");
    for _ in 0..2 {
        save_pretrained_including(&pretrained.model, &pretrained.config, &out, SaveOptions::new(DType::BF16), &companions).unwrap();
        assert_eq!(std::fs::read(out.join("additional_chat_templates/tool_use.jinja")).unwrap(), std::fs::read(&tools).unwrap());
    }
    // A template of one's own beside the saved one, and a file named like a shard but no
    // save's: a save would delete them, so it is refused, naming them (both were taken for the
    // save's own and deleted).
    for own in ["additional_chat_templates/rag.jinja", "model-notes.safetensors"] {
        std::fs::write(out.join(own), "mine").unwrap();
        let error = save_pretrained_including(&pretrained.model, &pretrained.config, &out, SaveOptions::new(DType::BF16), &companions).expect_err(own).to_string();
        assert!(error.contains(&format!("holds {own}, which a save would delete")), "{own}: {error}");
        assert_eq!(std::fs::read(out.join(own)).unwrap(), b"mine", "{own} was deleted");
        std::fs::remove_file(out.join(own)).unwrap();
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// A snapshot taken from a model and written later (a run writes it while it trains on) is the
/// folder a save of that model writes: the same files, each safetensors file with the same
/// tensors (names, dtypes, shapes, bytes) and metadata, sharded and whole; written after the
/// model it came from is gone.
#[test]
fn a_snapshot_written_later_is_the_folder_a_save_writes() {
    use burn::tensor::DType;
    use ulysses_models::{HfCheckpointSnapshot, SaveOptions, save_pretrained_including};
    let folder = model_fixtures().into_iter().find(|f| f.ends_with("qwen3")).expect("the qwen3 fixture");
    let companions = [(folder.join("generation_config.json"), "generation_config.json".to_string())];
    let root = std::env::temp_dir().join(format!("ulysses-models-{}-snapshot", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let tensors_of = |file: &Path| {
        let bytes = std::fs::read(file).unwrap();
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<_> = file.tensors().into_iter().map(|(name, t)| (name, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        (tensors, metadata.metadata().clone())
    };
    for max_shard_bytes in [ulysses_models::DEFAULT_MAX_SHARD_BYTES, 100_000] {
        let options = SaveOptions { dtype: DType::BF16, max_shard_bytes };
        let (saved, later) = (root.join(format!("saved-{max_shard_bytes}")), root.join(format!("later-{max_shard_bytes}")));
        let snapshot = {
            let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
            save_pretrained_including(&pretrained.model, &pretrained.config, &saved, options, &companions).unwrap();
            HfCheckpointSnapshot::take(&pretrained.model, &pretrained.config, &later, options, &companions).unwrap()
        };
        std::thread::spawn(move || snapshot.write()).join().unwrap().unwrap();
        let names = names_in(&saved);
        assert_eq!(names_in(&later), names);
        assert_eq!(names.iter().filter(|n| n.ends_with(".safetensors")).count() > 1, max_shard_bytes == 100_000, "{names:?}");
        for name in &names {
            let (a, b) = (saved.join(name), later.join(name));
            match name.ends_with(".safetensors") {
                true => assert!(tensors_of(&a) == tensors_of(&b), "{name} differs"),
                false => assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "{name} differs"),
            }
        }
        from_pretrained::<Cpu>(&later, &Default::default()).expect("the snapshot's folder loads");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// A save whose earlier folder cannot be set aside (a file of that name is in the way)
/// leaves the earlier model in place and keeps the new one beside it, named in the error: it
/// had removed the new one.
#[test]
fn a_save_that_cannot_set_the_earlier_model_aside_keeps_both() {
    use burn::tensor::DType;
    use ulysses_models::{HfCheckpointSnapshot, SaveOptions, save_pretrained_including};
    let folder = model_fixtures().into_iter().find(|f| f.ends_with("qwen3")).expect("the qwen3 fixture");
    let root = std::env::temp_dir().join(format!("ulysses-models-{}-aside", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dir = root.join("tuned");
    let options = SaveOptions { dtype: DType::BF16, max_shard_bytes: ulysses_models::DEFAULT_MAX_SHARD_BYTES };
    let pretrained = from_pretrained::<Cpu>(&folder, &Default::default()).unwrap();
    save_pretrained_including(&pretrained.model, &pretrained.config, &dir, options, &[]).unwrap();
    let earlier_config = std::fs::read(dir.join("config.json")).unwrap();
    let snapshot = HfCheckpointSnapshot::take(&pretrained.model, &pretrained.config, &dir, options, &[]).unwrap();
    // The name the save sets the earlier folder aside under, taken by a file (which the
    // cleaning of killed saves' folders cannot remove as a folder).
    std::fs::write(root.join(format!(".tuned.earlier-{}", std::process::id())), b"in the way").unwrap();
    let error = snapshot.write().map(|_| ()).unwrap_err().to_string();
    assert!(error.contains("cannot set the earlier model aside") && error.contains("the earlier one is as it was"), "{error}");
    assert_eq!(std::fs::read(dir.join("config.json")).unwrap(), earlier_config, "the earlier model moved");
    let beside = root.join(names_in(&root).into_iter().find(|n| n.starts_with("tuned.unsaved-")).expect("the new model beside the folder"));
    assert!(error.contains(&beside.display().to_string()), "{error}");
    from_pretrained::<Cpu>(&beside, &Default::default()).expect("the new model kept beside loads");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A config.json's `pad_token_id` is the embedding's padding row, as transformers'
/// `nn.Embedding(padding_idx)` makes it: the row takes no gradient from the tokens that look it
/// up, and the rest of the model computes as without it. The untied Qwen3 fixture with its pad
/// set to a token the rows read, against the fixture without: the same logits and loss, every
/// gradient the same bit for bit but the padding row's, which is zero (it is not without). A pad
/// counted from the end is that row; one outside the vocabulary is refused; a fresh model's
/// padding row starts at zero, as `_init_weights` leaves it.
#[test]
fn a_padding_token_s_embedding_row_takes_no_gradient_from_its_lookups() {
    use burn::{backend::Autodiff, module::Param};
    type Ad = Autodiff<Cpu>;
    let device = Default::default();
    let pad = 7usize;
    let vocab = ulysses_models::HfConfig::from_hf(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3")).unwrap().vocab_size;
    let padded = edited_copy("qwen3", "pad", |c| c["pad_token_id"] = (pad as i64 - vocab as i64).into());
    let run = |dir: &Path| {
        let model = from_pretrained::<Ad>(dir, &device).unwrap().model;
        let tokens: Vec<i64> = (0..12).map(|t| if t % 4 == 1 { pad as i64 } else { (t * 5 + 3) % vocab as i64 }).collect();
        let tokens = Tensor::<Ad, 2, Int>::from_data(TensorData::new(tokens, [1, 12]), &device);
        let logits = model.forward(tokens, &ShardPositions::consecutive(1, 12));
        let weights = Tensor::<Ad, 3>::from_data(TensorData::new((0..logits.shape().num_elements()).map(|i| ((i % 13) as f32 - 6.0) / 7.0).collect::<Vec<_>>(), logits.shape()), &device);
        let grads = (logits.clone() * weights).sum().backward();
        let grad = |param: &Param<Tensor<Ad, 2>>| param.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap();
        let others: Vec<Vec<f32>> = [&model.lm_head.as_ref().unwrap().weight, &model.blocks[0].attention.wq.weight, &model.blocks[0].feed_forward.gate.weight].map(grad).to_vec();
        (logits.into_data().to_vec::<f32>().unwrap(), grad(&model.embedding.weight), others)
    };
    let (plain_logits, plain_embedding, plain_others) = run(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3"));
    let (logits, embedding, others) = run(&padded);
    assert!(logits.iter().all(|v| v.is_finite()) && logits == plain_logits, "the padding row changed the forward");
    assert_eq!(others, plain_others, "the padding row changed another parameter's gradient");
    let d = embedding.len() / vocab;
    let row = |grad: &[f32], r: usize| grad[r * d..(r + 1) * d].to_vec();
    assert!(row(&plain_embedding, pad).iter().any(|g| *g != 0.0), "the test's tokens must give the row a gradient without the pad");
    assert!(row(&embedding, pad).iter().all(|g| *g == 0.0), "the padding row took a gradient from its lookups");
    for r in (0..vocab).filter(|&r| r != pad) {
        assert_eq!(row(&embedding, r), row(&plain_embedding, r), "row {r}");
    }
    // Outside the vocabulary: refused by name.
    let outside = edited_copy("qwen3", "pad-outside", |c| c["pad_token_id"] = (vocab as i64).into());
    let error = load_error(&outside);
    assert!(error.contains("pad_token_id") && error.contains("outside the vocabulary"), "{error}");
    // A fresh model's padding row is zero, the others are not.
    let config = ulysses_models::HfConfig::from_hf(&padded).unwrap();
    assert_eq!(config.pad_token_id, Some(pad as u64));
    let fresh = ulysses_models::DecoderConfig::from_hf(&config).init::<Cpu>(&device);
    let weight = fresh.embedding.weight.val().into_data().to_vec::<f32>().unwrap();
    assert!(row(&weight, pad).iter().all(|v| *v == 0.0) && row(&weight, pad + 1).iter().any(|v| *v != 0.0));
    for dir in [padded, outside] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// A decoder record written before the padding row was a setting (without its field) loads:
/// the field, like the decoder's other settings, is not part of the record's contents.
#[test]
fn a_record_without_the_padding_row_field_loads() {
    use burn::{
        module::Module,
        record::{FullPrecisionSettings, PrettyJsonFileRecorder, Recorder},
    };
    let device = Default::default();
    let model = ulysses_models::DecoderConfig::new(32).with_d_model(16).with_n_heads(2).with_n_kv_heads(1).with_ffn_hidden(32).with_n_layers(1).init::<Cpu>(&device);
    // Initialised before it is cloned (a lazy parameter would draw again in each clone).
    let expected = model.embedding.weight.val().into_data();
    let recorder = PrettyJsonFileRecorder::<FullPrecisionSettings>::new();
    let path = std::env::temp_dir().join(format!("ulysses-models-{}-old-record", std::process::id()));
    recorder.record(model.clone().into_record(), path.clone()).unwrap();
    let file = path.with_extension("json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert!(json["item"].as_object_mut().unwrap().remove("pad_token").is_some(), "the record has the field to take out: {json}");
    std::fs::write(&file, json.to_string()).unwrap();
    let record = Recorder::<Cpu>::load(&recorder, path, &device).unwrap_or_else(|e| panic!("an older record does not load: {e}"));
    let fresh = ulysses_models::DecoderConfig::new(32).with_d_model(16).with_n_heads(2).with_n_kv_heads(1).with_ffn_hidden(32).with_n_layers(1).init::<Cpu>(&device);
    assert_eq!(fresh.load_record(record).embedding.weight.val().into_data(), expected);
    std::fs::remove_file(file).unwrap();
}

/// Each float parameter of `model`: its path and its values' bits, and whether it is built yet.
fn parameter_bits<B: Backend>(model: &ulysses_models::Decoder<B>) -> Vec<(String, Vec<u32>)> {
    ulysses_training::float_parameters(model).into_iter().map(|p| (p.path, p.values.into_data().convert::<f32>().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())).collect()
}

fn built_parameters<B: Backend>(model: &ulysses_models::Decoder<B>) -> usize {
    struct Built(usize);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Built {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            self.0 += usize::from(param.is_initialized());
        }
    }
    let mut built = Built(0);
    burn::module::Module::visit(model, &mut built);
    built.0
}

/// The loader reads every fixture as burn-store's `SafetensorsStore` with its PyTorch adapter
/// reads it (the loader before it read weights itself): each parameter bit for bit, read now
/// or lazily; the lazy one builds no parameter until it is used. A bf16 copy in shards loads
/// lazily as the f32 values rounded to bf16.
#[test]
fn every_fixture_loads_as_burn_store_reads_it_read_now_or_lazily() {
    use burn::tensor::{DType, bf16};
    use burn_store::{ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
    use ulysses_models::{DecoderConfig, HF_TO_DECODER, SaveOptions, checkpoint_config, from_pretrained_lazily, save_pretrained_with};
    for folder in model_fixtures() {
        let name = folder.file_name().unwrap().to_string_lossy().into_owned();
        let config = checkpoint_config(&folder).unwrap();
        let mut reference = DecoderConfig::from_hf(&config).init::<Cpu>(&Default::default());
        let mut store = SafetensorsStore::from_file(folder.join("model.safetensors")).with_from_adapter(PyTorchToBurnAdapter).allow_partial(true);
        for (from, to) in HF_TO_DECODER {
            store = store.with_key_remapping(from, to);
        }
        let result = reference.load_from(&mut store).unwrap();
        assert!(result.errors.is_empty() && result.missing.is_empty(), "{name}: burn-store's load: {result:?}");
        let want = parameter_bits(&reference);

        assert!(parameter_bits(&from_pretrained::<Cpu>(&folder, &Default::default()).unwrap().model) == want, "{name}: read now, not as burn-store reads it");
        let lazy = from_pretrained_lazily::<Cpu>(&folder, &Default::default()).unwrap().model;
        assert_eq!(built_parameters(&lazy), 0, "{name}: a lazy load built parameters");
        assert!(parameter_bits(&lazy) == want, "{name}: read lazily, not as burn-store reads it");

        let half = std::env::temp_dir().join(format!("ulysses-models-{}-lazy-bf16-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&half);
        save_pretrained_with(&reference, &config, &half, SaveOptions { dtype: DType::BF16, max_shard_bytes: 20_000 }).unwrap();
        assert!(half.join("model.safetensors.index.json").exists(), "{name}: saved in one file");
        let rounded: Vec<(String, Vec<u32>)> = want.iter().map(|(path, bits)| (path.clone(), bits.iter().map(|&b| bf16::from_f32(f32::from_bits(b)).to_f32().to_bits()).collect())).collect();
        assert!(parameter_bits(&from_pretrained_lazily::<Cpu>(&half, &Default::default()).unwrap().model) == rounded, "{name}: bf16 shards read lazily");
        std::fs::remove_dir_all(half).unwrap();
    }
}

/// A lazily loaded model reads its files when a parameter is first used: a file that changed
/// since the load (cut short; rewritten at its size, as another revision of the model would
/// be; another file renamed into its place with the same size and time) stops that use with a
/// message naming the file and what changed, not a model of other weights.
#[test]
fn a_lazy_load_whose_file_changed_since_names_it() {
    let folder = edited_copy("qwen3", "lazy-changed", |_| {});
    let weights = folder.join("model.safetensors");
    let size = std::fs::metadata(&weights).unwrap().len();
    let rewrite_at_its_size = |weights: &Path| {
        std::fs::OpenOptions::new().write(true).open(weights).unwrap().set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(60)).unwrap();
    };
    // A copy that keeps the original's size and time (`cp -p`, `rsync -a`), renamed into place.
    let replace_keeping_its_time = |weights: &Path| {
        let modified = std::fs::metadata(weights).unwrap().modified().unwrap();
        let copy = weights.with_extension("copy");
        std::fs::copy(weights, &copy).unwrap();
        std::fs::OpenOptions::new().write(true).open(&copy).unwrap().set_modified(modified).unwrap();
        std::fs::rename(&copy, weights).unwrap();
    };
    for (change, edit) in [
        ("cut short", Box::new(|weights: &Path| std::fs::OpenOptions::new().write(true).open(weights).unwrap().set_len(size / 2).unwrap()) as Box<dyn Fn(&Path)>),
        ("rewritten at its size", Box::new(rewrite_at_its_size)),
        ("replaced by a copy keeping its time", Box::new(replace_keeping_its_time)),
    ] {
        std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3/model.safetensors"), &weights).unwrap();
        let lazy = ulysses_models::from_pretrained_lazily::<Cpu>(&folder, &Default::default()).unwrap().model;
        edit(&weights);
        let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| parameter_bits(&lazy).len())) else {
            panic!("{change}: the parameters were read from a file that changed since the load");
        };
        let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(message.contains("model.safetensors") && message.contains("changed since the folder was loaded"), "{change}: {message}");
    }
    std::fs::remove_dir_all(folder).unwrap();
}

/// Loading a checkpoint builds no parameter of the model's own initialisation (a padding row
/// zeroed, biases zeroed, which burn would build at once with `Param::map`): the lazy load and
/// the model from its config alone hold nothing until a parameter is used.
#[test]
fn a_padding_row_and_biases_leave_a_model_lazy() {
    use ulysses_models::{DecoderConfig, checkpoint_config, from_pretrained_lazily};
    let folder = edited_copy("qwen2", "lazy-pad", |c| c["pad_token_id"] = 3.into());
    let config = checkpoint_config(&folder).unwrap();
    assert!(config.pad_token_id.is_some(), "the edited config names a padding token");
    let from_config = DecoderConfig::from_hf(&config).init::<Cpu>(&Default::default());
    assert_eq!(built_parameters(&from_config), 0, "a model from its config (biases, a padding row) built parameters");
    let values = |path: &str| {
        let parameter = ulysses_training::float_parameters(&from_config).into_iter().find(|p| p.path == path).unwrap_or_else(|| panic!("no parameter {path}"));
        parameter.values.into_data().to_vec::<f32>().unwrap()
    };
    let embedding = values("embedding.weight");
    let width = embedding.len() / config.vocab_size;
    assert!(embedding[3 * width..4 * width].iter().all(|&v| v == 0.0) && embedding[..width].iter().any(|&v| v != 0.0), "the padding row alone starts at zero");
    assert!(values("blocks.0.attention.wq.bias").iter().all(|&v| v == 0.0), "biases start at zero");
    let lazy = from_pretrained_lazily::<Cpu>(&folder, &Default::default()).unwrap().model;
    assert_eq!(built_parameters(&lazy), 0, "a lazy load of a model with biases and a padding row built parameters");
    assert!(parameter_bits(&lazy) == parameter_bits(&from_pretrained::<Cpu>(&folder, &Default::default()).unwrap().model));
    std::fs::remove_dir_all(folder).unwrap();
}
