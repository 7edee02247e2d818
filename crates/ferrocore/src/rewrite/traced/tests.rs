use super::*;
use crate::graph::build::*;
use crate::graph::parse_graph;

/// `softmax(q @ k^T * 0.125 + bias) @ v` as a training trace records it in bfloat16 on `device`:
/// the softmax written out in float32 (amax, sub, exp, sum, div) between casts; the graph
/// returns the second matmul's 4-D view (the matmul's own result).
fn traced_attention(device: &str, amax_dim: i64) -> String {
    let [b, h, m, d] = [2, 4, 64, 16];
    let bf = |s: &[i64]| meta(s, "bfloat16");
    let text = GraphBuilder::new()
        .input("q", &[b, h, m, d], "bfloat16")
        .input("k", &[b, h, m, d], "bfloat16")
        .input("v", &[b, h, m, d], "bfloat16")
        .input("bias", &[b, 1, 1, m], "bfloat16")
        .call("q3", "aten.view.default", &[node("q"), ints(&[b * h, m, d])], &bf(&[b * h, m, d]))
        .call(
            "kt",
            "aten.permute.default",
            &[node("k"), ints(&[0, 1, 3, 2])],
            &strided_meta(&[b, h, d, m], Some(&[h * m * d, m * d, 1, d]), "bfloat16"),
        )
        .call_kw(
            "kt_dense",
            "aten.clone.default",
            &[node("kt")],
            r#""memory_format":{"memory_format":"contiguous_format"}"#,
            &bf(&[b, h, d, m]),
        )
        .call("kt3", "aten.view.default", &[node("kt_dense"), ints(&[b * h, d, m])], &bf(&[b * h, d, m]))
        .call("scores", "aten.bmm.default", &[node("q3"), node("kt3")], &bf(&[b * h, m, m]))
        .call("scores4", "aten.view.default", &[node("scores"), ints(&[b, h, m, m])], &bf(&[b, h, m, m]))
        .call("scaled", "aten.mul.Tensor", &[node("scores4"), float(0.125)], &bf(&[b, h, m, m]))
        .call("masked", "aten.add.Tensor", &[node("scaled"), node("bias")], &bf(&[b, h, m, m]))
        .call_kw("up", "aten._to_copy.default", &[node("masked")], r#""dtype":{"dtype":"float32"}"#, &f32(&[b, h, m, m]))
        .call("max", "aten.amax.default", &[node("up"), ints(&[amax_dim]), boolean(true)], &f32(&[b, h, m, 1]))
        .call("shifted", "aten.sub.Tensor", &[node("up"), node("max")], &f32(&[b, h, m, m]))
        .call("e", "aten.exp.default", &[node("shifted")], &f32(&[b, h, m, m]))
        .call("total", "aten.sum.dim_IntList", &[node("e"), ints(&[-1]), boolean(true)], &f32(&[b, h, m, 1]))
        .call("p", "aten.div.Tensor", &[node("e"), node("total")], &f32(&[b, h, m, m]))
        .call_kw("p_bf", "aten._to_copy.default", &[node("p")], r#""dtype":{"dtype":"bfloat16"}"#, &bf(&[b, h, m, m]))
        .call("p3", "aten.view.default", &[node("p_bf"), ints(&[b * h, m, m])], &bf(&[b * h, m, m]))
        .call("v3", "aten.view.default", &[node("v"), ints(&[b * h, m, d])], &bf(&[b * h, m, d]))
        .call("out3", "aten.bmm.default", &[node("p3"), node("v3")], &bf(&[b * h, m, d]))
        .call("out", "aten._unsafe_view.default", &[node("out3"), ints(&[b, h, m, d])], &bf(&[b, h, m, d]))
        .output(&["out"]);
    text.replace(r#""device":"cpu""#, &format!(r#""device":"{device}""#))
}

fn graph(text: &str) -> Graph {
    parse_graph(text).expect("the test graph parses")
}

#[test]
fn a_written_out_softmax_is_folded_back() {
    let g = fold_softmax(graph(&traced_attention("cuda:0", -1)));
    let t = call_targets(&g);
    assert!(t.contains(&"aten._softmax.default") && !t.contains(&"aten.amax.default") && !t.contains(&"aten.exp.default"), "{g}");
    // over another dim than the sum's it is no softmax
    let g = fold_softmax(graph(&traced_attention("cuda:0", 2)));
    assert!(!call_targets(&g).contains(&"aten._softmax.default"), "{g}");
}

#[test]
fn traced_attention_is_computed_by_a_fused_call_that_keeps_its_log_sum_exp() {
    let (replacement, decisions) = attention_in_trace(graph(&traced_attention("cuda:0", -1)), 90, true);
    let r = replacement.unwrap_or_else(|| panic!("not replaced: {decisions:?}"));
    let targets: Vec<&str> = r.nodes.iter().filter_map(|n| n["target"].as_str()).collect();
    assert!(targets.contains(&"aten._scaled_dot_product_cudnn_attention.default"), "{targets:?}");
    let call = r.nodes.iter().find(|n| n["target"] == "aten._scaled_dot_product_cudnn_attention.default").unwrap();
    // compute_log_sumexp: the backward reads it
    assert_eq!(call["args"][4], json!({ "bool": true }), "{call}");
    assert_eq!(call["args"][0], json!({ "node": "q" }), "{call}");
    assert_eq!(call["kwargs"]["scale"], json!({ "float": 0.125 }), "{call}");
    // the output is one of the new nodes, and every node read is old or new before it
    let mut known: HashSet<String> = ["q", "k", "v", "bias"].iter().map(|s| s.to_string()).collect();
    for n in &r.nodes {
        for a in n["args"].as_array().unwrap() {
            if let Some(name) = a["node"].as_str() {
                assert!(known.contains(name), "{name} read before it is made: {n}");
            }
        }
        known.insert(n["name"].as_str().unwrap().to_string());
    }
    assert!(known.contains(&r.output));
}

#[test]
fn a_matmul_that_is_no_attention_is_left_alone() {
    let text = GraphBuilder::new()
        .input("a", &[4, 8, 8], "float32")
        .input("b", &[4, 8, 8], "float32")
        .call("c", "aten.bmm.default", &[node("a"), node("b")], &f32(&[4, 8, 8]))
        .output(&["c"]);
    let (replacement, _) = attention_in_trace(graph(&text), 90, true);
    assert!(replacement.is_none());
}
