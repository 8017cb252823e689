#!/usr/bin/env python3
"""Fixtures for crates/ulysses-models from the real reference, transformers.

Writes, for each family (llama, mistral, qwen2, qwen3), a tiny config as transformers saves it
(`config.json`, from the family's own config class) and what transformers makes of it
(`resolved.json`: head_dim, kv heads, RoPE theta and type, biases, the rotary embedding's
inverse frequencies as its model holds them), plus RoPE variants (linear, llama3) on Llama, and each family's config.json with its sizes
alone (`NAME-minimal`: transformers' defaults for every other key);
and a small byte-level BPE `tokenizer/tokenizer.json` with the `tokenizers` package's ids for a
few texts (`encodings.json`), and which tokenizer class transformers' AutoTokenizer picks for the
byte-level file of `tokenizer-bos` and the sentencepiece-style one under each family's model type and seventeen tokenizer
configs, with its ids (`tokenizer-classes`; `--tokenizer-classes-only` writes just that). For the four families (and Llama with llama3 RoPE), also a tiny
model with random weights (`model.safetensors`, f32, q and k projections scaled up so that
attention is peaked: transformers' default init makes it nearly uniform, which would hide a
wrong RoPE or a missing document mask) and transformers' outputs for it: logits and loss of a
batch of two plain rows, and logits of a row packing three documents (positions restart at
each; transformers derives the document mask from them) in `expected.safetensors`; the
gradients of that loss with respect to every parameter in `gradients.safetensors` (Hugging
Face's names and shapes). Two cases add a key to config.json beside what the class wrote (a
context beside the RoPE scaling, as Phi-3 writes it), and the reference is transformers' reading
of that file. For Mistral, also transformers' logits where its sliding window
(64) matters, over 150 tokens plain and packed (`window.safetensors`; `--window-only` writes
just that). For Llama, Qwen2 and Qwen3, six steps of PyTorch's AdamW on the two plain rows, as
Hugging Face's Trainer takes them (`training.safetensors`: losses, gradient norms, the trained
parameters; `--training-only` writes just those). For Qwen3, transformers' own Trainer
fine-tuning it four steps of two micro-batches (`trainer.safetensors`; `--trainer-only`;
needs `accelerate` beside transformers).
The tests in crates/ulysses-models/tests/ (and crates/ulysses-trainer/tests/hf_trainer.rs) read
them; CI never runs this.

    python3 -m venv /var/tmp/hf-venv && /var/tmp/hf-venv/bin/pip install torch transformers accelerate
    /var/tmp/hf-venv/bin/python scripts/hf-fixtures.py crates/ulysses-models/tests/fixtures
"""
import json
import os
import sys

import torch
import transformers
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}

CASES = {
    "llama": (LlamaConfig, dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "llama-linear": (LlamaConfig, dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-llama3": (LlamaConfig, dict(rope_theta=500000.0, rope_scaling=LLAMA3, head_dim=32)),
    # Llama's attention_bias: biases on q, k, v and the output projection.
    "llama-attention-bias": (LlamaConfig, dict(rope_theta=10000.0, attention_bias=True)),
    "mistral": (MistralConfig, dict(sliding_window=64, rope_theta=1e6)),
    # Mistral-Nemo's kind: a head dim of its own (not hidden / heads), no window.
    "mistral-head-dim": (MistralConfig, dict(sliding_window=None, rope_theta=1e6, head_dim=32)),
    "qwen2": (Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, dict(head_dim=32, rope_theta=1e6)),
    # YaRN as Qwen's guides add it; the context lengths agree with the factor (4096 = 4 × 1024),
    # so that every transformers version reads it alike.
    "qwen3-yarn": (Qwen3Config, dict(head_dim=32, rope_theta=1e6,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})),
    # A context beside the scaling (as Phi-3 writes it), which transformers 5 takes over the
    # scaling's own: written into config.json below (the config classes drop it).
    "qwen3-yarn-original-outside": (Qwen3Config, dict(head_dim=32, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048})),
    "llama-llama3-original-outside": (LlamaConfig, dict(rope_theta=500000.0, head_dim=32, rope_scaling={
        k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"})),
}

# Each family's config.json with its sizes alone (every other key left to the family's
# defaults): transformers' reading of that file is the reference for what a key left out means.
MINIMAL_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads")
for family, cls in (("llama", LlamaConfig), ("mistral", MistralConfig), ("qwen2", Qwen2Config), ("qwen3", Qwen3Config)):
    # 32 heads: the defaults of Mistral's (8) and Qwen's (32) kv heads divide them.
    CASES[f"{family}-minimal"] = (cls, dict(hidden_size=256, num_attention_heads=32))

# Keys added to a case's config.json beside what its config class writes; transformers' reading
# of the file is then the reference.
FILE_KEYS = {
    "qwen3-yarn-original-outside": {"original_max_position_embeddings": 1024},
    "llama-llama3-original-outside": {"original_max_position_embeddings": 256},
}


def rotary(config):
    """The inverse frequencies the family's model holds for this config."""
    modeling = sys.modules[type(config).__module__.replace("configuration_", "modeling_")]
    name = type(config).__name__.replace("Config", "RotaryEmbedding")
    embedding = getattr(modeling, name)(config=config)
    return embedding.inv_freq.double().tolist(), float(getattr(embedding, "attention_scaling", 1.0))


TEXTS = [
    "Sequence parallelism splits a sequence across the GPUs of a group.",
    "  Leading spaces, tabs\tand\nnew lines  ",
    "Unicode: naïve café, 東京, emoji 🙂, and numbers 1234567890.",
    "<|endoftext|>A special token inside the text<|endoftext|>",
    "",
]


def tokenizer(out):
    """A small byte-level BPE, as Llama 3 and Qwen use, trained on the texts above, and its
    ids for them (special tokens parsed, none added)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXTS * 20, trainer)
    folder = os.path.join(out, "tokenizer")
    os.makedirs(folder, exist_ok=True)
    bpe.save(os.path.join(folder, "tokenizer.json"))
    encodings = [{"text": t, "ids": bpe.encode(t, add_special_tokens=False).ids} for t in TEXTS]
    import tokenizers
    with open(os.path.join(folder, "encodings.json"), "w") as f:
        json.dump({"tokenizers": tokenizers.__version__, "encodings": encodings}, f, indent=1, ensure_ascii=False)
    print(f"tokenizer: {bpe.get_vocab_size()} tokens, tokenizers {tokenizers.__version__}")
    tokenizer_with_bos(out, bpe)
    tokenizer_sentencepiece(out)
    tokenizer_classes(out)


def tokenizer_with_bos(out, bpe):
    """That tokenizer with a BOS of its own (`<|begin_of_text|>`) and a post-processor that adds
    it before each text (as Llama 3's does), saved beside a tokenizer_config.json that says
    `add_bos_token: false`, and the ids transformers' `tokenizer(text)` gives for the texts and
    one that begins with the BOS (`tokenizer-bos/encodings.json`): which of the two it follows.
    Each tokenizer class the config may name adds the BOS alike (checked here, the classes
    recorded; Qwen2Tokenizer splits digits by its own pattern, so its ids are not the file's)."""
    from tokenizers import processors
    bos, eos = "<|begin_of_text|>", "<|endoftext|>"
    bpe.add_special_tokens([bos])
    bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))])
    folder = os.path.join(out, "tokenizer-bos")
    os.makedirs(folder, exist_ok=True)
    bpe.save(os.path.join(folder, "tokenizer.json"))
    texts = TEXTS + [f"{bos}A text that begins with the BOS"]
    classes = ["PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2Tokenizer"]
    results = []
    for cls in classes:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": cls, "bos_token": bos, "eos_token": eos, "add_bos_token": False}, f, indent=1)
        loaded = transformers.AutoTokenizer.from_pretrained(folder)
        results.append([loaded(t)["input_ids"] for t in texts])
    bos_id = bpe.token_to_id(bos)
    for cls, ids in zip(classes, results):
        assert all(row[0] == bos_id for row in ids), f"{cls} adds no BOS: {ids}"
    assert results[1] == results[0], f"{classes[1]} and {classes[0]} disagree: {results[:2]}"
    # The folder as the ids kept were made: the first class's config.
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": classes[0], "bos_token": bos, "eos_token": eos, "add_bos_token": False}, f, indent=1)
    encodings = [{"text": t, "ids": ids} for t, ids in zip(texts, results[0])]
    with open(os.path.join(folder, "encodings.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "tokenizer_classes": classes, "encodings": encodings}, f, indent=1, ensure_ascii=False)
    print(f"tokenizer-bos: transformers gives {encodings[0]['ids'][:2]}... for the first text, with each of {classes}")


def tokenizer_sentencepiece(out):
    """A sentencepiece-style BPE as Llama 2 and Mistral ship it in tokenizer.json (byte fallback,
    a normalizer that prepends "▁" and replaces spaces, no pre-tokenizer, a BOS added), with chat
    markers as special tokens; and what transformers' `tokenizer(text)` gives for a few texts
    under configs that name LlamaTokenizerFast (`tokenizer-sentencepiece/encodings.json`):
    transformers 5 rebuilds such a tokenizer (a Metaspace pre-tokenizer, prepending "first",
    "always" or "never" by `legacy` and `add_prefix_space`) for a Llama model, and reads the
    file as it is for a Mistral one."""
    import tempfile
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    bpe.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=600, special_tokens=special))
    bpe.add_special_tokens(["[INST]", "[/INST]"])
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    folder = os.path.join(out, "tokenizer-sentencepiece")
    os.makedirs(folder, exist_ok=True)
    bpe.save(os.path.join(folder, "tokenizer.json"))
    texts = ["Sequence parallelism", " a leading space", "  two", "[INST] What splits a sequence? [/INST] Ulysses.", "x[INST]y", "naïve 東京 🙂", "line\nbreak", ""]
    base = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    variants = []
    for model_type, extra in [("llama", {"legacy": False}), ("llama", {}), ("llama", {"legacy": True}), ("llama", {"add_prefix_space": False}), ("mistral", {"legacy": False})]:
        with tempfile.TemporaryDirectory() as scratch:
            bpe.save(os.path.join(scratch, "tokenizer.json"))
            tokenizer_config = {**base, **extra}
            with open(os.path.join(scratch, "tokenizer_config.json"), "w") as f:
                json.dump(tokenizer_config, f)
            with open(os.path.join(scratch, "config.json"), "w") as f:
                json.dump({"model_type": model_type}, f)
            loaded = transformers.AutoTokenizer.from_pretrained(scratch)
            ids = [loaded(t)["input_ids"] for t in texts]
        from_file = [bpe.encode(t).ids for t in texts]
        variants.append({"model_type": model_type, "tokenizer_config": tokenizer_config, "class": type(loaded).__name__,
                         "differs_from_the_file": ids != from_file, "encodings": [{"text": t, "ids": i} for t, i in zip(texts, ids)]})
        print(f"tokenizer-sentencepiece, {model_type} {extra}: {type(loaded).__name__}, {'the file' if ids == from_file else 'not the file'}'s ids")
    with open(os.path.join(folder, "encodings.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "variants": variants}, f, indent=1, ensure_ascii=False)


CLASS_TEXTS = ["Sequence parallelism splits 12345 tokens", "cafe\u0301 and \ufb01ne", "  two spaces\n\nand lines ", "don't WE'LL",
               "[INST] Why? [/INST] Ulysses.", "<|begin_of_text|>hi<|endoftext|>x", "hi <|endoftext|> there [INST] x"]
CLASS_SPECIAL_TOKENS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]
CLASS_MODEL_TYPES = [None, "llama", "mistral", "qwen2", "qwen3"]
CLASS_CONFIGS = [None, {}, {"tokenizer_class": "PreTrainedTokenizerFast"}, {"tokenizer_class": "TokenizersBackend"},
                 {"tokenizer_class": "LlamaTokenizerFast"}, {"tokenizer_class": "LlamaTokenizer", "legacy": True},
                 {"tokenizer_class": "Qwen2Tokenizer"}, {"tokenizer_class": "Qwen2TokenizerFast", "add_prefix_space": True},
                 {"tokenizer_class": "GPT2TokenizerFast"},
                 # A special token that is a word of the text: transformers makes it special (split out).
                 {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "parallelism"},
                 # Every named special token, a model's own (`image_token`) and one with its flags
                 # (written as transformers before 4.34 wrote them) become special tokens too.
                 {"tokenizer_class": "PreTrainedTokenizerFast", "mask_token": "tokens", "sep_token": "lines", "image_token": "WE",
                  "cls_token": {"__type": "AddedToken", "content": "two", "lstrip": True, "rstrip": False, "normalized": False, "single_word": False}},
                 # Extra special tokens, one of them the byte-level file's BOS (an added token there already).
                 {"additional_special_tokens": ["spaces", "<|begin_of_text|>"]},
                 # add_bos_token and add_eos_token (transformers 5 keeps the file's post-processor), and
                 # special tokens written in a text read as its characters.
                 {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": False, "add_eos_token": True, "split_special_tokens": True},
                 # The added tokens as a config saved by transformers 4.34 or later lists them: one the
                 # file lacks is added; a class that rebuilds the file takes these alone.
                 {"added_tokens_decoder": {"500": {"content": "WE", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": False}}},
                 # A listed token's flags (as listed) replace the file's.
                 {"added_tokens_decoder": {"0": {"content": "<|endoftext|>", "lstrip": True, "normalized": False, "rstrip": True, "single_word": False, "special": True}}},
                 # Before 4.34 with extra special tokens in both files (the config's are taken) and
                 # the map's EOS a dict that says nothing of normalizing (special: not normalized).
                 ({"tokenizer_class": "PreTrainedTokenizerFast", "additional_special_tokens": ["spaces"]},
                  {"special_tokens_map.json": {"additional_special_tokens": ["lines"],
                                               "eos_token": {"content": "tokens", "lstrip": False, "rstrip": False, "single_word": False}}}),
                 # A config saved before 4.34: special_tokens_map.json over it, and added_tokens.json.
                 ({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"},
                  {"special_tokens_map.json": {"bos_token": "<|begin_of_text|>", "additional_special_tokens": ["spaces"],
                                               "mask_token": {"content": "tokens", "lstrip": True, "rstrip": False, "normalized": False, "single_word": False}},
                   "added_tokens.json": {"WE": 301}})]


def tokenizer_classes(out):
    """Which tokenizer class transformers 5's AutoTokenizer reads a folder through, and the ids it
    gives (`tokenizer-classes/encodings.json`) with its special tokens, for the two tokenizer files above (byte-level
    from `tokenizer-bos`, sentencepiece-style from `tokenizer-sentencepiece`) under each
    config.json model type of the four families (or none) and each tokenizer_config.json (or
    none). Qwen2's and Qwen3's model types make it Qwen2Tokenizer, which rebuilds the tokenizer
    with Qwen's own pre-tokenizer and NFC whatever the file says (Qwen2's whatever class the
    config names: its Hub configs are listed as unreliable)."""
    import shutil
    import tempfile
    files = {"byte-level": os.path.join(out, "tokenizer-bos", "tokenizer.json"),
             "sentencepiece": os.path.join(out, "tokenizer-sentencepiece", "tokenizer.json")}
    cases = []
    for file_name, file in files.items():
        for model_type in CLASS_MODEL_TYPES:
            for tokenizer_config in CLASS_CONFIGS:
                tokenizer_config, files = tokenizer_config if isinstance(tokenizer_config, tuple) else (tokenizer_config, {})
                with tempfile.TemporaryDirectory() as scratch:
                    shutil.copy(file, os.path.join(scratch, "tokenizer.json"))
                    if model_type is not None:
                        files = {**files, "config.json": {"model_type": model_type}}
                    if tokenizer_config is not None:
                        files = {**files, "tokenizer_config.json": tokenizer_config}
                    for name, content in files.items():
                        with open(os.path.join(scratch, name), "w") as f:
                            json.dump(content, f)
                    loaded = transformers.AutoTokenizer.from_pretrained(scratch)
                    ids = [loaded(t, add_special_tokens=False)["input_ids"] for t in CLASS_TEXTS]
                    # `tokenizer(text)`: with what the post-processor adds.
                    document_ids = [loaded(t)["input_ids"] for t in CLASS_TEXTS]
                    # The special tokens as the class resolves them (the config's, else its
                    # defaults): `tokenizer.eos_token` is what TRL ends documents with.
                    special = {name: getattr(loaded, name) for name in CLASS_SPECIAL_TOKENS}
                cases.append({"file": file_name, "model_type": model_type, "tokenizer_config": tokenizer_config,
                              "other_files": {name: content for name, content in files.items() if name not in ("config.json", "tokenizer_config.json")},
                              "class": type(loaded).__name__, "ids": ids, "document_ids": document_ids, "special_tokens": special})
    folder = os.path.join(out, "tokenizer-classes")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "encodings.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "texts": CLASS_TEXTS, "cases": cases}, f, indent=None, ensure_ascii=False)
        f.write("\n")
    classes = sorted({c["class"] for c in cases})
    print(f"tokenizer-classes: {len(cases)} folders, read through {classes}")


MODELS = ("llama", "llama-llama3", "llama-attention-bias", "mistral", "mistral-head-dim", "qwen2", "qwen3")
DOCUMENTS = (7, 10, 7)


def model_outputs(config, folder):
    """A random model of `config` saved in f32, and its logits and loss."""
    from safetensors.torch import save_file
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
        # Biases (Qwen2's q/k/v, Llama's attention_bias) random too: transformers' init zeroes
        # them, which would hide a bias applied in the wrong place (after RoPE, say).
        biases = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=biases) * 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    outputs, plain = plain_and_packed(model, 2, DOCUMENTS, torch.Generator().manual_seed(1))
    tokens = outputs["input_ids"]
    model.zero_grad()
    model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
    # Tied weights are one parameter (listed once, as the embedding), as in the files.
    save_file({name: p.grad.float().contiguous() for name, p in model.named_parameters()},
              os.path.join(folder, "gradients.safetensors"), metadata={"transformers": transformers.__version__})
    save_file(outputs, os.path.join(folder, "expected.safetensors"), metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    return plain.loss.item()


TRAINED = ("llama", "qwen2", "qwen3")
TRAINING_RATES = (2.5e-4, 5e-4, 1e-3, 1e-3, 7.5e-4, 5e-4)


def training_steps(folder):
    """Steps of PyTorch's AdamW on the saved model (f32, eager attention) over its two plain rows,
    as the Trainer takes them: weight decay 0.01 on the matrices (the Trainer's own spares the
    biases and the norms), betas (0.9, 0.999), eps 1e-8, the gradient clipped to norm 1, the
    learning rate of each step given. Each step's loss and gradient norm (before clipping) and
    the parameters after the last step, in `training.safetensors`."""
    from safetensors.torch import load_file, save_file
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).train()
    tokens = load_file(os.path.join(folder, "expected.safetensors"))["input_ids"]
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=TRAINING_RATES[0], betas=(0.9, 0.999), eps=1e-8)
    losses, norms = [], []
    for rate in TRAINING_RATES:
        for group in optimizer.param_groups:
            group["lr"] = rate
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        losses.append(loss.item())
    outputs = {"learning_rates": torch.tensor(TRAINING_RATES, dtype=torch.float64),
               "losses": torch.tensor(losses, dtype=torch.float64), "grad_norms": torch.tensor(norms, dtype=torch.float64)}
    # Tied weights are one parameter (listed once, as the embedding), as in the files.
    outputs.update({f"trained.{name}": p.detach().float().contiguous() for name, p in named})
    save_file(outputs, os.path.join(folder, "training.safetensors"), metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{os.path.basename(folder)}: {len(losses)} AdamW steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")


TRAINER_STEPS, TRAINER_ROWS, TRAINER_LEN = 4, 16, 48


def trainer_steps(folder):
    """transformers' own Trainer fine-tuning the saved model (f32, eager attention) for four
    optimizer steps of two micro-batches of two rows each (seeded random ids, taken in order),
    each row's first tokens labelled -100 (a prompt: 0 to 22 of them, so the micro-batches of a
    step count different numbers of targets, which the Trainer averages over the step's), as
    its users run it: AdamW with weight decay 0.01 (not on biases and norms), the cosine
    schedule from 1e-3 without warm-up, gradients clipped to norm 1. Per step the rows and their
    labels, the learning rate the step took, the loss of the step's four rows before it (all
    their targets averaged), the gradient norm the Trainer logs (before clipping); the
    parameters after the last step (`trainer.safetensors`)."""
    from safetensors.torch import save_file
    from torch.utils.data import Dataset, SequentialSampler
    config = transformers.AutoConfig.from_pretrained(folder)
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, config.vocab_size, (TRAINER_ROWS, TRAINER_LEN), generator=generator)
    labels = input_ids.clone()
    for row in range(TRAINER_ROWS):
        labels[row, :(row * 7) % 23] = -100

    class Rows(Dataset):
        def __len__(self):
            return TRAINER_ROWS

        def __getitem__(self, i):
            return {"input_ids": input_ids[i], "labels": labels[i]}

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    rates, losses = [], []
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            rates.append(optimizer.param_groups[0]["lr"])
            rows = slice(4 * state.global_step, 4 * state.global_step + 4)
            with torch.no_grad():
                losses.append(model(input_ids=input_ids[rows], labels=labels[rows], use_cache=False).loss.item())

    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        arguments = transformers.TrainingArguments(
            output_dir=scratch, max_steps=TRAINER_STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.01, adam_beta1=0.9,
            adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_drop_last=False)
        trainer = InOrder(model=model, args=arguments, train_dataset=Rows(), callbacks=[Record()])
        trainer.train()
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(norms) == len(rates) == len(losses) == TRAINER_STEPS, (norms, rates, losses)
    outputs = {"input_ids": input_ids, "labels": labels, "learning_rates": torch.tensor(rates, dtype=torch.float64),
               "losses": torch.tensor(losses, dtype=torch.float64), "grad_norms": torch.tensor(norms, dtype=torch.float64)}
    outputs.update({f"trained.{name}": p.detach().float().contiguous() for name, p in model.named_parameters()})
    save_file(outputs, os.path.join(folder, "trainer.safetensors"), metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{os.path.basename(folder)}: {TRAINER_STEPS} Trainer steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, learning rates {rates}")


def plain_and_packed(model, rows, documents, generator):
    """Random tokens: `rows` plain rows and one row packing `documents`, as long as their sum;
    transformers' logits (and loss, for the plain rows) for them, as saved; and the plain output."""
    seq = sum(documents)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (rows, seq), generator=generator)
    packed = torch.randint(0, vocab, (1, seq), generator=generator)
    positions = torch.cat([torch.arange(n) for n in documents]).unsqueeze(0)
    with torch.no_grad():
        # No cache: transformers derives the document mask from restarting positions only then.
        plain = model(input_ids=tokens, labels=tokens, use_cache=False)
        packed_logits = model(input_ids=packed, position_ids=positions, use_cache=False).logits
        # The same documents one at a time: what the packed row must equal.
        alone = torch.cat([model(input_ids=d, use_cache=False).logits for d in packed.split(list(documents), dim=1)], dim=1)
    assert (packed_logits - alone).abs().max() < 1e-4, "transformers did not keep the packed documents apart"
    return {
        "input_ids": tokens.to(torch.int64).contiguous(),
        "logits": plain.logits.float().contiguous(),
        "loss": plain.loss.float().reshape(1),
        "packed_input_ids": packed.to(torch.int64).contiguous(),
        "packed_position_ids": positions.to(torch.int64).contiguous(),
        "packed_logits": packed_logits.float().contiguous(),
    }, plain


WINDOW_DOCUMENTS = (100, 50)


def window_outputs(folder):
    """Mistral's sliding window (64 in the fixture) where it matters: transformers' logits for
    a row of 150 tokens and for a row packing documents of WINDOW_DOCUMENTS, both longer than
    the window, from the fixture model already in `folder` (`window.safetensors`)."""
    from safetensors.torch import save_file
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    assert model.config.sliding_window == 64, model.config.sliding_window
    outputs, plain = plain_and_packed(model, 1, WINDOW_DOCUMENTS, torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.config.sliding_window = None
        unwindowed = model(input_ids=outputs["input_ids"], use_cache=False).logits
    effect = (plain.logits - unwindowed).abs().max().item()
    assert effect > 1e-2, f"the window changes the logits by {effect} only: the test would not see it"
    save_file(outputs, os.path.join(folder, "window.safetensors"), metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"mistral: sliding-window logits over {sum(WINDOW_DOCUMENTS)} tokens (the window changes them by up to {effect:.2f})")


def main(out):
    import importlib
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for name, (cls, extra) in CASES.items():
        config = cls(**{**SHAPE, **extra})
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        config.save_pretrained(folder)
        if name in FILE_KEYS or name.endswith("-minimal"):
            path = os.path.join(folder, "config.json")
            with open(path) as f:
                written = json.load(f)
            if name.endswith("-minimal"):
                written = {key: value for key, value in written.items() if key in MINIMAL_KEYS}
            written.update(FILE_KEYS.get(name, {}))
            with open(path, "w") as f:
                json.dump(written, f, indent=2, sort_keys=True)
            config = transformers.AutoConfig.from_pretrained(folder)
        inv_freq, attention_scaling = rotary(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        resolved = {
            "transformers": transformers.__version__,
            "model_type": config.model_type,
            "head_dim": head_dim,
            "num_key_value_heads": config.num_key_value_heads,
            "rms_norm_eps": config.rms_norm_eps,
            "tie_word_embeddings": config.tie_word_embeddings,
            # Mistral's window applies; Qwen's only under use_sliding_window (refused here).
            "sliding_window": getattr(config, "sliding_window", None) if config.model_type == "mistral" else None,
            "inv_freq": inv_freq,
            "attention_scaling": attention_scaling,
        }
        with open(os.path.join(folder, "resolved.json"), "w") as f:
            json.dump(resolved, f, indent=1)
        print(f"{name}: head_dim {head_dim}, {len(inv_freq)} frequencies, transformers {transformers.__version__}")
        if name in MODELS:
            torch.manual_seed(0)
            loss = model_outputs(config, folder)
            print(f"{name}: a model of {os.path.getsize(os.path.join(folder, 'model.safetensors'))} bytes, loss {loss:.4f}")
        if name == "mistral":
            window_outputs(folder)
        if name in TRAINED:
            training_steps(folder)
        if name == "qwen3":
            trainer_steps(folder)
    tokenizer(out)


if __name__ == "__main__":
    torch.manual_seed(0)
    if sys.argv[1:2] == ["--training-only"]:
        # The training steps alone, from the models already written.
        for name in TRAINED:
            training_steps(os.path.join(sys.argv[2] if len(sys.argv) > 2 else "crates/ulysses-models/tests/fixtures", name))
    elif sys.argv[1:2] == ["--trainer-only"]:
        # The Trainer's steps alone, from the Qwen3 model already written.
        trainer_steps(os.path.join(sys.argv[2] if len(sys.argv) > 2 else "crates/ulysses-models/tests/fixtures", "qwen3"))
    elif sys.argv[1:2] == ["--tokenizer-classes-only"]:
        # The tokenizer classes alone, from the tokenizer files already written.
        tokenizer_classes(sys.argv[2] if len(sys.argv) > 2 else "crates/ulysses-models/tests/fixtures")
    elif sys.argv[1:2] == ["--window-only"]:
        # The sliding-window outputs alone, from the Mistral fixture already written.
        window_outputs(os.path.join(sys.argv[2] if len(sys.argv) > 2 else "crates/ulysses-models/tests/fixtures", "mistral"))
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "crates/ulysses-models/tests/fixtures")
