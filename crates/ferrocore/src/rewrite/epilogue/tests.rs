use super::*;
use crate::graph::build::*;
use crate::graph::parse_graph;

/// `act(addmm(bias, x, w.t()))` for a linear layer of `dtype` on `device`; `gelu`: the
/// activation's `approximate` (None: ReLU); `reuse`: the product is also returned.
fn linear(dtype: &str, device: &str, gelu: Option<&str>, reuse: bool) -> String {
    let (m, k, n) = (64, 32, 128);
    let mut b = GraphBuilder::new()
        .input("x", &[m, k], dtype)
        .input("w", &[n, k], dtype)
        .input("bias", &[n], dtype)
        .call("wt", "aten.permute.default", &[node("w"), ints(&[1, 0])], &strided_meta(&[k, n], Some(&[1, k]), dtype))
        .call("addmm", "aten.addmm.default", &[node("bias"), node("x"), node("wt")], &meta(&[m, n], dtype));
    b = match gelu {
        Some(a) => {
            b.call_kw("act", "aten.gelu.default", &[node("addmm")], &format!(r#""approximate":{{"str":"{a}"}}"#), &meta(&[m, n], dtype))
        }
        None => b.call("act", "aten.relu.default", &[node("addmm")], &meta(&[m, n], dtype)),
    };
    let text = b.output(if reuse { &["act", "addmm"] } else { &["act"] });
    text.replace(r#""device":"cpu""#, &format!(r#""device":"{device}""#))
}

fn run(text: &str) -> (Graph, Vec<String>) {
    fuse_gemm_epilogues(parse_graph(text).expect("the test graph parses"), &PassOptions { cuda_arch: 90, ..Default::default() })
}

#[test]
fn tanh_gelu_and_relu_after_a_half_precision_addmm_join_its_epilogue() {
    for (gelu, flag) in [(Some("tanh"), true), (None, false)] {
        let (g, decisions) = run(&linear("bfloat16", "cuda:0", gelu, false));
        assert_eq!(call_targets(&g), ["aten.permute.default", "aten._addmm_activation.default"], "{decisions:?}");
        let call = g.nodes.last().unwrap();
        assert_eq!(call.arg(5, "use_gelu"), Some(&Arg::Bool(flag)));
        assert!(decisions[0].contains("in the epilogue of addmm"), "{decisions:?}");
    }
}

#[test]
fn what_the_epilogue_cannot_take_stays_apart() {
    let cases = [
        (linear("bfloat16", "cuda:0", Some("none"), false), "aten.gelu.default"),
        (linear("bfloat16", "cpu", None, false), "not on a GPU"),
        (linear("float32", "cuda:0", None, false), "half precision only"),
        (linear("float16", "cuda:0", None, true), "addmm is read elsewhere"),
    ];
    for (text, why) in cases {
        let (g, decisions) = run(&text);
        assert!(call_targets(&g).contains(&"aten.addmm.default"), "{why}: {:?}", call_targets(&g));
        assert!(decisions.is_empty() || decisions[0].contains(why), "{why}: {decisions:?}");
    }
}
