use super::*;
use crate::graph::build::*;
use crate::graph::parse_graph;

const DIMS: [i64; 4] = [2, 4, 256, 16];

/// `softmax(where(mask, q @ k^T * 0.25, fill)) @ v` over `keys` keys, as ATen spells it, on
/// `device`; `fill` is -inf unless given.
fn causal_graph(keys: i64, fill: f64, device: &str) -> String {
    let [b, h, m, d] = DIMS;
    let n = keys;
    let text = GraphBuilder::new()
        .input("q", &[b, h, m, d], "float32")
        .input("k", &[b, h, n, d], "float32")
        .input("v", &[b, h, n, d], "float32")
        .input("mask", &[m, n], "bool")
        .call("q3", "aten.view.default", &[node("q"), ints(&[b * h, m, d])], &f32(&[b * h, m, d]))
        .call(
            "kt",
            "aten.permute.default",
            &[node("k"), ints(&[0, 1, 3, 2])],
            &strided_meta(&[b, h, d, n], Some(&[h * n * d, n * d, 1, d]), "float32"),
        )
        .call_kw(
            "kt_dense",
            "aten.clone.default",
            &[node("kt")],
            r#""memory_format":{"memory_format":"contiguous_format"}"#,
            &f32(&[b, h, d, n]),
        )
        .call("kt3", "aten.view.default", &[node("kt_dense"), ints(&[b * h, d, n])], &f32(&[b * h, d, n]))
        .call("scores", "aten.bmm.default", &[node("q3"), node("kt3")], &f32(&[b * h, m, n]))
        .call("scores4", "aten.view.default", &[node("scores"), ints(&[b, h, m, n])], &f32(&[b, h, m, n]))
        .call("scaled", "aten.mul.Tensor", &[node("scores4"), float(0.25)], &f32(&[b, h, m, n]))
        .call_kw("fill", "aten.scalar_tensor.default", &[float(fill)], r#""dtype":{"dtype":"float32"}"#, &f32(&[]))
        .call("masked", "aten.where.self", &[node("mask"), node("scaled"), node("fill")], &f32(&[b, h, m, n]))
        .call("probs", "aten._softmax.default", &[node("masked"), int(-1), boolean(false)], &f32(&[b, h, m, n]))
        .call("probs3", "aten.view.default", &[node("probs"), ints(&[b * h, m, n])], &f32(&[b * h, m, n]))
        .call("v3", "aten.view.default", &[node("v"), ints(&[b * h, n, d])], &f32(&[b * h, n, d]))
        .call("out3", "aten.bmm.default", &[node("probs3"), node("v3")], &f32(&[b * h, m, d]))
        .call("out", "aten.view.default", &[node("out3"), ints(&[b, h, m, d])], &f32(&[b, h, m, d]))
        .call(
            "out_heads",
            "aten.permute.default",
            &[node("out"), ints(&[0, 2, 1, 3])],
            &strided_meta(&[b, m, h, d], Some(&[h * m * d, d, m * d, 1]), "float32"),
        )
        .call_kw(
            "result",
            "aten.clone.default",
            &[node("out_heads")],
            r#""memory_format":{"memory_format":"contiguous_format"}"#,
            &f32(&[b, m, h, d]),
        )
        .output(&["result"]);
    text.replace(r#""device":"cpu""#, &format!(r#""device":"{device}""#))
}

/// The pass on a Hopper GPU (or the CPU).
fn fused(text: &str) -> (Graph, Vec<String>) {
    fuse_attention(parse_graph(text).expect("the test graph parses"), &PassOptions { cuda_arch: 90, ..Default::default() })
}

#[test]
fn a_masked_attention_becomes_one_cpu_call() {
    let (g, decisions) = fused(&causal_graph(256, f64::NEG_INFINITY, "cpu"));
    assert!(
        decisions[0].starts_with("softmax probs: fused: scores .. out -> aten._scaled_dot_product_flash_attention_for_cpu"),
        "{decisions:?}"
    );
    let t = call_targets(&g);
    assert!(t.contains(&"aten._scaled_dot_product_flash_attention_for_cpu.default") && !t.contains(&"aten.bmm.default"), "{g}");
    // the mask's rows: NaN where every key is masked, as after eager's softmax
    let text = g.to_string();
    assert!(text.contains("scalar_tensor.default(NaN") && text.contains("scale=0.25"), "{text}");
    // the key is read in place (no permute back), the call's inputs are the graph's own
    assert!(text.contains("(q, k, v, 0.0, False, attn_mask="), "{text}");
}

#[test]
fn on_cuda_float32_the_mask_is_broadcast_to_the_scores_shape() {
    let (g, decisions) = fused(&causal_graph(256, f64::NEG_INFINITY, "cuda:0"));
    assert!(decisions[0].contains("aten._scaled_dot_product_efficient_attention"), "{decisions:?}");
    let text = g.to_string();
    assert!(text.contains("= aten.expand.default(") && text.contains("/[0, 0, 256, 1] = aten.expand"), "{text}");
    // and the whole pipeline writes the call with the zero-stride bias
    let options = crate::driver::Options { cuda_arch: 90, ..Default::default() };
    let module = match crate::driver::generate(&causal_graph(256, f64::NEG_INFINITY, "cuda:0"), &options) {
        Ok(crate::driver::Generation::Code(c)) => c.module,
        _ => panic!("the graph compiles"),
    };
    assert!(module.contains("_scaled_dot_product_efficient_attention") && !module.contains("aten.bmm"), "{module}");
}

#[test]
fn what_is_refused_and_why() {
    let (g, decisions) = fused(&causal_graph(256, -1e9, "cpu"));
    assert_eq!(decisions, ["softmax probs: not fused: masked fills with a value other than -inf"]);
    assert!(call_targets(&g).contains(&"aten.bmm.default"));
    let (_, decisions) = fused(&causal_graph(20, f64::NEG_INFINITY, "cuda:0"));
    assert_eq!(decisions, ["softmax probs: not fused: a float32 mask over 20 keys (the CUDA kernel wants rows of a multiple of 16)"]);
}

#[test]
fn on_cuda_half_precision_goes_to_cudnn_with_any_key_count() {
    let text = causal_graph(20, f64::NEG_INFINITY, "cuda:0").replace("float32", "bfloat16");
    let (g, decisions) = fused(&text);
    assert!(decisions[0].contains("aten._scaled_dot_product_cudnn_attention"), "{decisions:?}");
    let text = g.to_string();
    // no expand: cuDNN broadcasts the [1, 1, M, N] mask itself; its output follows the query's
    // dim order (contiguous here)
    assert!(!text.contains("aten.expand") && text.contains("bfloat16[2, 4, 256, 16]/[16384, 4096, 16, 1] = getitem"), "{text}");
}

/// `causal_graph` with its mask computed as `arange(keys) + offset >= 0`.
fn open_mask_graph(offset: i64) -> String {
    let text = causal_graph(256, f64::NEG_INFINITY, "cpu");
    let mask = format!(
        r#"{{"name":"mask","kind":"call_function","target":"aten.ge.Scalar","args":[{},{}],"kwargs":{{}},"meta":{}}}"#,
        node("keys_shifted"),
        int(0),
        meta(&[256], "bool")
    );
    let keys = format!(
        r#"{{"name":"keys","kind":"call_function","target":"aten.arange.start_step","args":[{},{}],"kwargs":{{}},"meta":{}}},{{"name":"keys_shifted","kind":"call_function","target":"aten.add.Tensor","args":[{},{}],"kwargs":{{}},"meta":{}}},{mask}"#,
        int(0),
        int(256),
        meta(&[256], "int64"),
        node("keys"),
        int(offset),
        meta(&[256], "int64")
    );
    let placeholder = format!(r#"{{"name":"mask","kind":"placeholder","meta":{}}}"#, meta(&[256, 256], "bool"));
    assert!(text.contains(&placeholder));
    text.replace(&placeholder, &keys)
}

#[test]
fn a_mask_open_everywhere_is_no_mask() {
    let (g, decisions) = fused(&open_mask_graph(0));
    assert!(decisions[0].contains("no mask"), "{decisions:?}");
    assert!(!g.to_string().contains("attn_mask=mask"), "{g}");
    // arange(256) - 1 >= 0 fails at key 0: a real mask
    let (_, decisions) = fused(&open_mask_graph(-1));
    assert!(decisions[0].contains("masked"), "{decisions:?}");
}

#[test]
fn an_added_mask_of_zeros_is_no_mask() {
    // Hugging Face's vision models add where(arange(keys) >= 0, 0, -inf): zero everywhere
    let text = open_mask_graph(0);
    let zeros = format!(
        r#"{{"name":"zero","kind":"call_function","target":"aten.scalar_tensor.default","args":[{}],"kwargs":{{}},"meta":{}}},{{"name":"open_bias","kind":"call_function","target":"aten.where.self","args":[{},{},{}],"kwargs":{{}},"meta":{}}},"#,
        float(0.0),
        f32(&[]),
        node("mask"),
        node("zero"),
        node("fill"),
        f32(&[256])
    );
    let masked = r#"{"name":"masked","kind":"call_function","target":"aten.where.self""#;
    let added = format!(
        r#"{{"name":"masked","kind":"call_function","target":"aten.add.Tensor","args":[{},{}],"kwargs":{{}},"meta":{}}}"#,
        node("scaled"),
        node("open_bias"),
        f32(&[2, 4, 256, 256])
    );
    let start = text.find(masked).expect("the where node");
    let end = start + text[start..].find("}}},").expect("its end") + 3;
    let text = format!("{}{zeros}{added}{}", &text[..start], &text[end..]);
    let (_, decisions) = fused(&text);
    assert!(decisions[0].contains("no mask"), "{decisions:?}");
}

#[test]
fn small_cpu_attention_stays_matmuls() {
    // 2 x 4 x 256 x 20 scores (40960): below the CPU's threshold
    let (g, decisions) = fused(&causal_graph(20, f64::NEG_INFINITY, "cpu"));
    assert!(decisions[0].contains("scores: the CPU's generated kernels are faster"), "{decisions:?}");
    assert!(call_targets(&g).contains(&"aten.bmm.default"));
}

#[test]
fn probabilities_the_graph_returns_are_no_attention() {
    let text = causal_graph(256, f64::NEG_INFINITY, "cpu");
    let start = text.find(r#"{"name":"probs3""#).expect("probs3");
    let text = format!(r#"{}{{"name":"output","kind":"output","args":[{}]}}]}}"#, &text[..start], node("probs"));
    let (g, decisions) = fused(&text);
    assert_eq!(decisions, ["softmax probs: not fused: the graph returns probs"]);
    assert!(call_targets(&g).contains(&"aten.bmm.default"));
}

#[test]
fn a_gpu_not_known_to_be_hopper_gets_the_memory_efficient_kernel() {
    let text = causal_graph(256, f64::NEG_INFINITY, "cuda:0").replace("float32", "bfloat16");
    let (_, decisions) = fuse_attention(parse_graph(&text).expect("parses"), &PassOptions { cuda_arch: 0, ..Default::default() });
    assert!(decisions[0].contains("aten._scaled_dot_product_efficient_attention"), "{decisions:?}");
}

/// bfloat16 attention on CUDA whose scores get `bias` (a `[M, N]` input of `bias_dtype`,
/// through a `_to_copy` to float32 when `cast`) added in float32, as FlexAttention's dense form
/// adds a score_mod's values.
fn biased_half_graph(bias_dtype: &str, cast: bool) -> String {
    let [b, h, m, d] = DIMS;
    let n = m;
    let bf = |s: &[i64]| meta(s, "bfloat16");
    let builder = GraphBuilder::new()
        .input("q", &[b, h, m, d], "bfloat16")
        .input("kt", &[b, h, d, n], "bfloat16")
        .input("v", &[b, h, n, d], "bfloat16")
        .input("bias", &[m, n], bias_dtype)
        .call("q3", "aten.view.default", &[node("q"), ints(&[b * h, m, d])], &bf(&[b * h, m, d]))
        .call("kt3", "aten.view.default", &[node("kt"), ints(&[b * h, d, n])], &bf(&[b * h, d, n]))
        .call("v3", "aten.view.default", &[node("v"), ints(&[b * h, n, d])], &bf(&[b * h, n, d]))
        .call("scores", "aten.bmm.default", &[node("q3"), node("kt3")], &bf(&[b * h, m, n]))
        .call("scores4", "aten.view.default", &[node("scores"), ints(&[b, h, m, n])], &bf(&[b, h, m, n]))
        .call("scaled", "aten.mul.Tensor", &[node("scores4"), float(0.25)], &bf(&[b, h, m, n]));
    let builder = if cast {
        builder.call_kw("wide", "aten._to_copy.default", &[node("bias")], r#""dtype":{"dtype":"float32"}"#, &f32(&[m, n]))
    } else {
        builder.call("wide", "aten.alias.default", &[node("bias")], &f32(&[m, n]))
    };
    builder
        .call("biased", "aten.add.Tensor", &[node("scaled"), node("wide")], &f32(&[b, h, m, n]))
        .call("probs", "aten._softmax.default", &[node("biased"), int(-1), boolean(false)], &f32(&[b, h, m, n]))
        .call_kw("probs_half", "aten._to_copy.default", &[node("probs")], r#""dtype":{"dtype":"bfloat16"}"#, &bf(&[b, h, m, n]))
        .call("probs3", "aten.view.default", &[node("probs_half"), ints(&[b * h, m, n])], &bf(&[b * h, m, n]))
        .call("out3", "aten.bmm.default", &[node("probs3"), node("v3")], &bf(&[b * h, m, d]))
        .call("out", "aten.view.default", &[node("out3"), ints(&[b, h, m, d])], &bf(&[b, h, m, d]))
        .output(&["out"])
        .replace(r#""device":"cpu""#, r#""device":"cuda:0""#)
}

#[test]
fn a_float32_bias_is_not_rounded_into_a_half_precision_call() {
    // a score_mod's float32 values (ALiBi's slope x distance) would be rounded to bfloat16
    let (g, decisions) = fused(&biased_half_graph("float32", false));
    assert_eq!(decisions.len(), 1);
    assert!(
        decisions[0].starts_with("softmax probs: not fused: wide adds float32 values that bfloat16 would round, and no attention template"),
        "{decisions:?}"
    );
    assert!(call_targets(&g).contains(&"aten.bmm.default"));
    // bfloat16 values widened to float32 lose nothing there
    let (_, decisions) = fused(&biased_half_graph("bfloat16", true));
    assert!(decisions[0].contains("aten._scaled_dot_product_cudnn_attention"), "{decisions:?}");
}

#[test]
fn half_types_hold_what_they_hold() {
    assert!(holds(DType::BF16, 256.0) && holds(DType::BF16, -0.5) && holds(DType::BF16, f64::NEG_INFINITY));
    assert!(!holds(DType::BF16, 256.5) && !holds(DType::BF16, 0.1));
    assert!(holds(DType::F16, 2048.0) && holds(DType::F16, 2f64.powi(-24)) && holds(DType::F16, 65504.0));
    assert!(!holds(DType::F16, 2049.0) && !holds(DType::F16, 65536.0) && !holds(DType::F16, 0.1));
}

#[test]
fn a_float32_bias_goes_to_the_attention_template_in_triton_graphs() {
    let text = biased_half_graph("float32", false);
    let triton = PassOptions { cuda_arch: 90, triton_kernels: true, ..Default::default() };
    let (g, decisions) = fuse_attention(parse_graph(&text).expect("parses"), &triton);
    assert!(decisions[0].contains("aten._scaled_dot_product_fused_attention_overrideable"), "{decisions:?}");
    assert!(!call_targets(&g).contains(&"aten.bmm.default"));
    // the bias reaches the call in float32, unrounded
    assert!(!call_targets(&g).contains(&"aten._to_copy.default"), "{:?}", call_targets(&g));
    // a differentiated graph's call also computes each row's log-sum-exp, which the backward
    // (ferrocore's attention kernels too) reads
    let training = PassOptions { differentiable: true, ..triton };
    let (g, decisions) = fuse_attention(parse_graph(&text).expect("parses"), &training);
    assert!(decisions[0].contains("aten._scaled_dot_product_fused_attention_overrideable"), "{decisions:?}");
    let call =
        g.nodes.iter().find(|n| matches!(&n.kind, NodeKind::Call { target: Target::Aten(AtenOp::FusedAttention), .. })).expect("a call");
    let Meta::Tuple(items) = &call.meta else { panic!("{:?}", call.meta) };
    let lse = items[1].as_ref().and_then(Meta::tensor).expect("a log-sum-exp");
    assert_eq!((lse.dtype, lse.shape.len()), (DType::F32, 3));
}
