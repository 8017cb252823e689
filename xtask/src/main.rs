//! `cargo run -p xtask -- gen-forwarding` writes the op-forwarding impls of `UlyssesBackend`.
//! `cargo run -p xtask -- check-forwarding` fails when the committed files are stale.
//!
//! `UlyssesBackend<Inner>` must forward every op of burn's backend traits to `Inner`, the
//! provided (default) methods included, so that the inner backend's specialised kernels
//! still run. That is ~430 methods. Instead of writing them by hand, this tool reads the
//! trait definitions from the burn-backend sources that cargo resolved for this workspace
//! and emits one forwarding impl per trait. Re-run it after changing the burn pin; CI runs
//! the check so the generated code cannot drift from the pinned version.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use proc_macro2::{Ident, Span, TokenStream};
use quote::{ToTokens, quote};
use syn::{FnArg, Pat, ReturnType, Signature, TraitItem, Type, visit::Visit, visit_mut::VisitMut};

/// (source file inside burn-backend, trait, generated file).
const TRAITS: &[(&str, &str, &str)] = &[
    ("src/backend/ops/tensor.rs", "FloatTensorOps", "float_ops.rs"),
    ("src/backend/ops/int_tensor.rs", "IntTensorOps", "int_ops.rs"),
    ("src/backend/ops/bool_tensor.rs", "BoolTensorOps", "bool_ops.rs"),
    ("src/backend/ops/modules/base.rs", "ModuleOps", "module_ops.rs"),
    ("src/backend/ops/activation.rs", "ActivationOps", "activation_ops.rs"),
    ("src/backend/ops/qtensor.rs", "QTensorOps", "qtensor_ops.rs"),
    ("src/backend/ops/transaction.rs", "TransactionOps", "transaction_ops.rs"),
];

/// Ops that UlyssesBackend handles itself: (trait, method, hand-written function).
const INTERCEPTED: &[(&str, &str, &str)] = &[
    ("ModuleOps", "attention", "crate::attention::sequence_parallel_attention"),
    // Refuses attention done by hand under SP (scores of a shard against itself).
    ("FloatTensorOps", "float_matmul", "crate::attention_guard::guarded_matmul"),
    ("QTensorOps", "q_matmul", "crate::attention_guard::guarded_q_matmul"),
    ("IntTensorOps", "int_matmul", "crate::attention_guard::guarded_int_matmul"),
    // Refuse attention weights normalised by hand (no matmul made the scores) and scans
    // along the shard (positions from a mask's cumsum) under SP.
    ("ActivationOps", "softmax", "crate::attention_guard::guarded_softmax"),
    ("ActivationOps", "log_softmax", "crate::attention_guard::guarded_log_softmax"),
    ("ActivationOps", "softmin", "crate::attention_guard::guarded_softmin"),
    ("FloatTensorOps", "float_cumsum", "crate::attention_guard::guarded_float_cumsum"),
    ("FloatTensorOps", "float_cumprod", "crate::attention_guard::guarded_float_cumprod"),
    ("FloatTensorOps", "float_cummin", "crate::attention_guard::guarded_float_cummin"),
    ("FloatTensorOps", "float_cummax", "crate::attention_guard::guarded_float_cummax"),
    ("IntTensorOps", "int_cumsum", "crate::attention_guard::guarded_int_cumsum"),
    ("IntTensorOps", "int_cumprod", "crate::attention_guard::guarded_int_cumprod"),
    ("IntTensorOps", "int_cummin", "crate::attention_guard::guarded_int_cummin"),
    ("IntTensorOps", "int_cummax", "crate::attention_guard::guarded_int_cummax"),
    ("QTensorOps", "q_cumsum", "crate::attention_guard::guarded_q_cumsum"),
    ("QTensorOps", "q_cumprod", "crate::attention_guard::guarded_q_cumprod"),
    ("QTensorOps", "q_cummin", "crate::attention_guard::guarded_q_cummin"),
    ("QTensorOps", "q_cummax", "crate::attention_guard::guarded_q_cummax"),
    // Refuse ops that mix the shard's neighbouring tokens or reverse it under SP:
    // convolutions and pooling along the length, flips and unfolds of the sequence dim.
    ("FloatTensorOps", "float_flip", "crate::attention_guard::guarded_float_flip"),
    ("IntTensorOps", "int_flip", "crate::attention_guard::guarded_int_flip"),
    ("BoolTensorOps", "bool_flip", "crate::attention_guard::guarded_bool_flip"),
    ("QTensorOps", "q_flip", "crate::attention_guard::guarded_q_flip"),
    ("FloatTensorOps", "float_unfold", "crate::attention_guard::guarded_float_unfold"),
    ("IntTensorOps", "int_unfold", "crate::attention_guard::guarded_int_unfold"),
    ("BoolTensorOps", "bool_unfold", "crate::attention_guard::guarded_bool_unfold"),
    ("ModuleOps", "conv1d", "crate::attention_guard::guarded_conv1d"),
    ("ModuleOps", "conv_transpose1d", "crate::attention_guard::guarded_conv_transpose1d"),
    ("ModuleOps", "avg_pool1d", "crate::attention_guard::guarded_avg_pool1d"),
    ("ModuleOps", "max_pool1d", "crate::attention_guard::guarded_max_pool1d"),
    ("ModuleOps", "max_pool1d_with_indices", "crate::attention_guard::guarded_max_pool1d_with_indices"),
    ("ModuleOps", "adaptive_avg_pool1d", "crate::attention_guard::guarded_adaptive_avg_pool1d"),
    // Refuse a CTC loss under SP: it aligns a shard's frames to the whole transcript.
    ("ModuleOps", "ctc_loss", "crate::attention_guard::guarded_ctc_loss"),
    // Refuse a real FFT along the sequence (FNet's mixing, a long convolution by FFT) under SP.
    ("ModuleOps", "rfft", "crate::attention_guard::guarded_rfft"),
    ("ModuleOps", "irfft", "crate::attention_guard::guarded_irfft"),
    // Refuse positions counted from another shard's first token under SP: a table of
    // positions sliced (RoPE's frequencies, sinusoids from 0) or an arange over the shard.
    ("FloatTensorOps", "float_slice", "crate::attention_guard::guarded_float_slice"),
    ("IntTensorOps", "int_slice", "crate::attention_guard::guarded_int_slice"),
    // Refuse a single token picked from the shard (a reward head's last token) by its index.
    ("FloatTensorOps", "float_select", "crate::attention_guard::guarded_float_select"),
    ("IntTensorOps", "int_select", "crate::attention_guard::guarded_int_select"),
    ("FloatTensorOps", "float_gather", "crate::attention_guard::guarded_float_gather"),
    ("IntTensorOps", "int_gather", "crate::attention_guard::guarded_int_gather"),
    // Note where the shard's tokens go in a tensor a few tokens longer (a pad, a cat), for the
    // rule on crops that shift them.
    ("FloatTensorOps", "float_slice_assign", "crate::attention_guard::guarded_float_slice_assign"),
    ("IntTensorOps", "int_slice_assign", "crate::attention_guard::guarded_int_slice_assign"),
    ("FloatTensorOps", "float_cat", "crate::attention_guard::guarded_float_cat"),
    ("IntTensorOps", "int_cat", "crate::attention_guard::guarded_int_cat"),
    // Positions counted on the host: ids or a ramp uploaded, a table of sinusoids from 0 (the
    // uploads then counted by crate::device_io).
    ("FloatTensorOps", "float_from_data", "crate::attention_guard::guarded_float_from_data"),
    ("IntTensorOps", "int_from_data", "crate::attention_guard::guarded_int_from_data"),
    ("IntTensorOps", "int_arange", "crate::attention_guard::guarded_int_arange"),
    ("IntTensorOps", "int_arange_step", "crate::attention_guard::guarded_int_arange_step"),
    // Refuse reductions and rankings over the shard's tokens inside a forward whose positions
    // are noted (a mean or max pooled over the sequence, a top-k of its tokens).
    ("FloatTensorOps", "float_sum_dim", "crate::attention_guard::guarded_float_sum_dim"),
    ("FloatTensorOps", "float_mean_dim", "crate::attention_guard::guarded_float_mean_dim"),
    ("FloatTensorOps", "float_prod_dim", "crate::attention_guard::guarded_float_prod_dim"),
    ("FloatTensorOps", "float_max_dim", "crate::attention_guard::guarded_float_max_dim"),
    ("FloatTensorOps", "float_min_dim", "crate::attention_guard::guarded_float_min_dim"),
    ("FloatTensorOps", "float_max_abs_dim", "crate::attention_guard::guarded_float_max_abs_dim"),
    ("FloatTensorOps", "float_max_dim_with_indices", "crate::attention_guard::guarded_float_max_dim_with_indices"),
    ("FloatTensorOps", "float_min_dim_with_indices", "crate::attention_guard::guarded_float_min_dim_with_indices"),
    ("FloatTensorOps", "float_argmax", "crate::attention_guard::guarded_float_argmax"),
    ("FloatTensorOps", "float_argmin", "crate::attention_guard::guarded_float_argmin"),
    ("FloatTensorOps", "float_sort", "crate::attention_guard::guarded_float_sort"),
    ("FloatTensorOps", "float_sort_with_indices", "crate::attention_guard::guarded_float_sort_with_indices"),
    ("FloatTensorOps", "float_argsort", "crate::attention_guard::guarded_float_argsort"),
    ("FloatTensorOps", "float_topk", "crate::attention_guard::guarded_float_topk"),
    ("FloatTensorOps", "float_argtopk", "crate::attention_guard::guarded_float_argtopk"),
    ("FloatTensorOps", "float_any_dim", "crate::attention_guard::guarded_float_any_dim"),
    ("FloatTensorOps", "float_all_dim", "crate::attention_guard::guarded_float_all_dim"),
    // The same of integers, booleans and quantized tensors: a mask's count of tokens, where its
    // first padding lies.
    ("IntTensorOps", "int_sum_dim", "crate::attention_guard::guarded_int_sum_dim"),
    ("IntTensorOps", "int_mean_dim", "crate::attention_guard::guarded_int_mean_dim"),
    ("IntTensorOps", "int_prod_dim", "crate::attention_guard::guarded_int_prod_dim"),
    ("IntTensorOps", "int_max_dim", "crate::attention_guard::guarded_int_max_dim"),
    ("IntTensorOps", "int_min_dim", "crate::attention_guard::guarded_int_min_dim"),
    ("IntTensorOps", "int_max_abs_dim", "crate::attention_guard::guarded_int_max_abs_dim"),
    ("IntTensorOps", "int_any_dim", "crate::attention_guard::guarded_int_any_dim"),
    ("IntTensorOps", "int_all_dim", "crate::attention_guard::guarded_int_all_dim"),
    ("IntTensorOps", "int_max_dim_with_indices", "crate::attention_guard::guarded_int_max_dim_with_indices"),
    ("IntTensorOps", "int_min_dim_with_indices", "crate::attention_guard::guarded_int_min_dim_with_indices"),
    ("IntTensorOps", "int_argmax", "crate::attention_guard::guarded_int_argmax"),
    ("IntTensorOps", "int_argmin", "crate::attention_guard::guarded_int_argmin"),
    ("IntTensorOps", "int_sort", "crate::attention_guard::guarded_int_sort"),
    ("IntTensorOps", "int_sort_with_indices", "crate::attention_guard::guarded_int_sort_with_indices"),
    ("IntTensorOps", "int_argsort", "crate::attention_guard::guarded_int_argsort"),
    ("IntTensorOps", "int_topk", "crate::attention_guard::guarded_int_topk"),
    ("IntTensorOps", "int_argtopk", "crate::attention_guard::guarded_int_argtopk"),
    ("BoolTensorOps", "bool_any_dim", "crate::attention_guard::guarded_bool_any_dim"),
    ("BoolTensorOps", "bool_all_dim", "crate::attention_guard::guarded_bool_all_dim"),
    ("QTensorOps", "q_sum_dim", "crate::attention_guard::guarded_q_sum_dim"),
    ("QTensorOps", "q_mean_dim", "crate::attention_guard::guarded_q_mean_dim"),
    ("QTensorOps", "q_prod_dim", "crate::attention_guard::guarded_q_prod_dim"),
    ("QTensorOps", "q_max_dim", "crate::attention_guard::guarded_q_max_dim"),
    ("QTensorOps", "q_min_dim", "crate::attention_guard::guarded_q_min_dim"),
    ("QTensorOps", "q_max_abs_dim", "crate::attention_guard::guarded_q_max_abs_dim"),
    ("QTensorOps", "q_any_dim", "crate::attention_guard::guarded_q_any_dim"),
    ("QTensorOps", "q_all_dim", "crate::attention_guard::guarded_q_all_dim"),
    ("QTensorOps", "q_max_dim_with_indices", "crate::attention_guard::guarded_q_max_dim_with_indices"),
    ("QTensorOps", "q_min_dim_with_indices", "crate::attention_guard::guarded_q_min_dim_with_indices"),
    ("QTensorOps", "q_argmax", "crate::attention_guard::guarded_q_argmax"),
    ("QTensorOps", "q_argmin", "crate::attention_guard::guarded_q_argmin"),
    ("QTensorOps", "q_sort", "crate::attention_guard::guarded_q_sort"),
    ("QTensorOps", "q_sort_with_indices", "crate::attention_guard::guarded_q_sort_with_indices"),
    ("QTensorOps", "q_argsort", "crate::attention_guard::guarded_q_argsort"),
    ("QTensorOps", "q_topk", "crate::attention_guard::guarded_q_topk"),
    ("QTensorOps", "q_argtopk", "crate::attention_guard::guarded_q_argtopk"),
    // Notes the token ids' length (a rank's shard) for the guard's folded query heads.
    ("ModuleOps", "embedding", "crate::attention_guard::embedding_noting_length"),
    // Count what the host waits on the device for (reads, uploads): crate::device_io.
    ("FloatTensorOps", "float_into_data", "crate::device_io::float_into_data"),
    ("IntTensorOps", "int_into_data", "crate::device_io::int_into_data"),
    ("BoolTensorOps", "bool_into_data", "crate::device_io::bool_into_data"),
    ("TransactionOps", "tr_execute", "crate::device_io::tr_execute"),
    ("BoolTensorOps", "bool_from_data", "crate::device_io::bool_from_data"),
];

/// Types named after a backend (`TensorPrimitive<B>`, ...). `TensorPrimitive<Inner>` and
/// `TensorPrimitive<UlyssesBackend<Inner>>` are different types with the same fields, so the
/// generated code converts them with the hand-written `ConvertPrimitives` trait.
const BACKEND_NAMED: &[&str] = &[
    "TensorPrimitive",
    "TransactionPrimitive",
    "MaxPool1dWithIndices",
    "MaxPool2dWithIndices",
    "MaxPool1dBackward",
    "MaxPool2dBackward",
    "DeformConv2dBackward",
    "Conv2dBackward",
    "Conv3dBackward",
    "QuantizationParametersPrimitive",
];

const OUT_DIR: &str = "crates/burn-ulysses/src/backend/forward";
const BURN_BACKEND_VERSION: &str = "0.21.0";

fn main() -> ExitCode {
    let command = std::env::args().nth(1).unwrap_or_default();
    let result = match command.as_str() {
        "gen-forwarding" => generate().and_then(|files| write(&files)),
        "check-forwarding" => generate().and_then(|files| check(&files)),
        _ => Err("usage: cargo run -p xtask -- <gen-forwarding|check-forwarding>".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Locates the burn-backend sources through `cargo metadata`, so the generator reads exactly
/// the version the workspace builds against.
fn burn_backend_dir() -> Result<PathBuf, String> {
    // The cargo running this task (`cargo run` says which), not the one that built it: a
    // build kept from a toolchain since removed would name a cargo that no longer exists.
    let output = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["metadata", "--format-version", "1"])
        .current_dir(workspace_root())
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| e.to_string())?;
    let packages = metadata["packages"].as_array().ok_or("no packages in metadata")?;
    let backend = packages
        .iter()
        .find(|p| p["name"] == "burn-backend")
        .ok_or("burn-backend is not in the dependency graph")?;
    if backend["version"] != BURN_BACKEND_VERSION {
        return Err(format!(
            "burn-backend {} resolved, the generator was written for {BURN_BACKEND_VERSION}: \
             review INTERCEPTED/BACKEND_NAMED, then update BURN_BACKEND_VERSION",
            backend["version"]
        ));
    }
    let manifest = backend["manifest_path"].as_str().ok_or("no manifest path")?;
    Ok(Path::new(manifest).parent().unwrap().to_path_buf())
}

fn generate() -> Result<Vec<(String, String)>, String> {
    let source_dir = burn_backend_dir()?;
    let mut files = Vec::new();
    let mut module_lines = Vec::new();
    for (source, trait_name, out_file) in TRAITS {
        let path = source_dir.join(source);
        let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let file = syn::parse_file(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let item = file
            .items
            .iter()
            .find_map(|item| match item {
                syn::Item::Trait(t) if t.ident == trait_name => Some(t),
                _ => None,
            })
            .ok_or_else(|| format!("trait {trait_name} not found in {}", path.display()))?;
        for (intercepted_trait, method, _) in INTERCEPTED.iter().filter(|(t, _, _)| t == trait_name) {
            let found = item.items.iter().any(|i| matches!(i, TraitItem::Fn(f) if f.sig.ident == method));
            if !found {
                return Err(format!(
                    "{intercepted_trait}::{method} is listed in INTERCEPTED but burn-backend has no \
                     such method: the interception would silently disappear"
                ));
            }
        }
        let tokens = forwarding_impl(item)?;
        files.push((out_file.to_string(), render(tokens)?));
        module_lines.push(format!("mod {};", out_file.trim_end_matches(".rs")));
    }
    let module = format!(
        "{}\n{}\n",
        header(),
        module_lines.join("\n")
    );
    files.push(("mod.rs".to_string(), module));
    Ok(files)
}

fn header() -> String {
    format!(
        "// @generated by `cargo run -p xtask -- gen-forwarding` from burn-backend \
         {BURN_BACKEND_VERSION}.\n// Do not edit: change xtask/src/main.rs and regenerate.\n"
    )
}

fn forwarding_impl(item: &syn::ItemTrait) -> Result<TokenStream, String> {
    let trait_ident = &item.ident;
    let mut methods = Vec::new();
    for trait_item in &item.items {
        let TraitItem::Fn(method) = trait_item else {
            return Err(format!("{trait_ident}: unexpected non-fn item"));
        };
        methods.push(forwarding_method(trait_ident, &method.sig)?);
    }
    Ok(quote! {
        use super::super::prelude::*;

        impl<Inner: ExchangeBackend> #trait_ident<Self> for UlyssesBackend<Inner> {
            #(#methods)*
        }
    })
}

fn forwarding_method(trait_ident: &Ident, sig: &Signature) -> Result<TokenStream, String> {
    let name = sig.ident.to_string();
    let mut impl_sig = sig.clone();
    ReplaceBackendParam.visit_signature_mut(&mut impl_sig);
    if !impl_sig.generics.params.is_empty() {
        return Err(format!("{trait_ident}::{name}: generic methods are not supported"));
    }

    let mut args = Vec::new();
    for input in impl_sig.inputs.iter_mut() {
        let FnArg::Typed(arg) = input else {
            return Err(format!("{trait_ident}::{name}: methods with self are not supported"));
        };
        let ident = match arg.pat.as_mut() {
            Pat::Ident(pat) => {
                // `mut` belongs to the trait's default body, not to a forwarding call.
                pat.mutability = None;
                pat.ident.clone()
            }
            _ => return Err(format!("{trait_ident}::{name}: unsupported argument pattern")),
        };
        if names_a_backend(&arg.ty) {
            args.push(quote!(ConvertPrimitives::convert(#ident)));
        } else {
            args.push(quote!(#ident));
        }
    }

    let method_ident = &sig.ident;
    let call = match INTERCEPTED
        .iter()
        .find(|(t, m, _)| trait_ident == t && name == *m)
    {
        Some((_, _, handler)) => {
            let handler: syn::Path = syn::parse_str(handler).unwrap();
            quote!(#handler::<Inner>(#(#args),*))
        }
        None => quote!(<Inner as #trait_ident<Inner>>::#method_ident(#(#args),*)),
    };
    let body = match &impl_sig.output {
        ReturnType::Type(_, ty) if names_a_backend(ty) => {
            if matches!(ty.as_ref(), Type::ImplTrait(_)) {
                return Err(format!("{trait_ident}::{name}: cannot convert an impl Trait return"));
            }
            quote!(ConvertPrimitives::convert(#call))
        }
        _ => call,
    };
    Ok(quote! {
        #impl_sig {
            #body
        }
    })
}

/// Rewrites the trait's backend parameter `B` into `Self` (`FloatTensor<B>` becomes
/// `FloatTensor<Self>`, `B::IntElem` becomes `Self::IntElem`), and burn-backend's
/// crate-relative paths (`crate::tensor::IndexingUpdateOp`) into the bare name, which the
/// hand-written prelude imports.
struct ReplaceBackendParam;

impl VisitMut for ReplaceBackendParam {
    fn visit_path_mut(&mut self, path: &mut syn::Path) {
        if path.segments.first().is_some_and(|first| first.ident == "crate") {
            let last = path.segments.pop().unwrap().into_value();
            path.segments.clear();
            path.segments.push(last);
        }
        if path.leading_colon.is_none()
            && let Some(first) = path.segments.first_mut()
            && first.ident == "B"
        {
            first.ident = Ident::new("Self", Span::call_site());
        }
        syn::visit_mut::visit_path_mut(self, path);
    }
}

fn names_a_backend(ty: &Type) -> bool {
    struct Finder(bool);
    impl<'a> Visit<'a> for Finder {
        fn visit_path_segment(&mut self, segment: &'a syn::PathSegment) {
            if BACKEND_NAMED.iter().any(|name| segment.ident == name) {
                self.0 = true;
            }
            syn::visit::visit_path_segment(self, segment);
        }
    }
    let mut finder = Finder(false);
    finder.visit_type(ty);
    finder.0
}

fn render(tokens: TokenStream) -> Result<String, String> {
    let file: syn::File = syn::parse2(tokens.into_token_stream()).map_err(|e| e.to_string())?;
    Ok(format!("{}\n{}", header(), prettyplease::unparse(&file)))
}

fn write(files: &[(String, String)]) -> Result<(), String> {
    let dir = workspace_root().join(OUT_DIR);
    fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    for (name, content) in files {
        fs::write(dir.join(name), content).map_err(|e| e.to_string())?;
    }
    println!("wrote {} files to {OUT_DIR}", files.len());
    Ok(())
}

fn check(files: &[(String, String)]) -> Result<(), String> {
    let dir = workspace_root().join(OUT_DIR);
    let mut stale: Vec<String> = files
        .iter()
        .filter(|(name, content)| fs::read_to_string(dir.join(name)).ok().as_ref() != Some(content))
        .map(|(name, _)| name.clone())
        .collect();
    let entries = fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let name = entry.map_err(|e| e.to_string())?.file_name().to_string_lossy().into_owned();
        if !files.iter().any(|(generated, _)| *generated == name) {
            stale.push(format!("{name} (not generated)"));
        }
    }
    if stale.is_empty() {
        println!("forwarding impls are up to date with burn-backend {BURN_BACKEND_VERSION}");
        Ok(())
    } else {
        Err(format!(
            "stale generated files in {OUT_DIR}: {stale:?}; run `cargo run -p xtask -- gen-forwarding`"
        ))
    }
}
