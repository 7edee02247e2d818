use super::*;
use crate::graph::build::*;
use crate::graph::parse_graph;

fn i64s(shape: &[i64]) -> String {
    meta(shape, "int64")
}

fn bools(shape: &[i64]) -> String {
    meta(shape, "bool")
}

/// Hugging Face's causal mask for decoders, as its graph spells it for `s` positions and batch
/// 2: positions `arange(s)`, packed sequences detected from their steps (`cumsum(diff != 1)`,
/// all in one sequence here), keys open where `position[kv] <= position[q]` and the sequence
/// ids are equal. `last` names the node the caller reads.
fn hf_decoder_mask(s: i64) -> GraphBuilder {
    GraphBuilder::new()
        .call("arange", "aten.arange.start_step", &[int(0), int(s)], &i64s(&[s]))
        .call("add", "aten.add.Tensor", &[node("arange"), int(0)], &i64s(&[s]))
        .call("unsqueeze", "aten.unsqueeze.default", &[node("add"), int(0)], &i64s(&[1, s]))
        .call("expand", "aten.expand.default", &[node("unsqueeze"), ints(&[2, -1])], &i64s(&[2, s]))
        .call("slice_1", "aten.slice.Tensor", &[node("expand"), int(1), int(0), int(1)], &i64s(&[2, 1]))
        .call("sub", "aten.sub.Tensor", &[node("slice_1"), int(1)], &i64s(&[2, 1]))
        .call("cat", "aten.cat.default", &[format!("{{\"list\":[{},{}]}}", node("sub"), node("expand")), int(-1)], &i64s(&[2, s + 1]))
        .call("slice_2", "aten.slice.Tensor", &[node("cat"), int(-1), int(0), int(s)], &i64s(&[2, s]))
        .call("slice_3", "aten.slice.Tensor", &[node("cat"), int(-1), int(1), int(s + 1)], &i64s(&[2, s]))
        .call("sub_1", "aten.sub.Tensor", &[node("slice_3"), node("slice_2")], &i64s(&[2, s]))
        .call("ne", "aten.ne.Scalar", &[node("sub_1"), int(1)], &bools(&[2, s]))
        .call("cumsum", "aten.cumsum.default", &[node("ne"), int(-1)], &i64s(&[2, s]))
        .call("batch", "aten.arange.start_step", &[int(0), int(2)], &i64s(&[2]))
        .call("b1", "aten.unsqueeze.default", &[node("batch"), int(1)], &i64s(&[2, 1]))
        .call("b2", "aten.unsqueeze.default", &[node("b1"), int(2)], &i64s(&[2, 1, 1]))
        .call("b3", "aten.unsqueeze.default", &[node("b2"), int(3)], &i64s(&[2, 1, 1, 1]))
        .call("qpos", "aten.arange.start_step", &[int(0), int(s)], &i64s(&[s]))
        .call("q1", "aten.unsqueeze.default", &[node("qpos"), int(0)], &i64s(&[1, s]))
        .call("q2", "aten.unsqueeze.default", &[node("q1"), int(1)], &i64s(&[1, 1, s]))
        .call("q3", "aten.unsqueeze.default", &[node("q2"), int(3)], &i64s(&[1, 1, s, 1]))
        .call("kpos", "aten.arange.start_step", &[int(0), int(s)], &i64s(&[s]))
        .call("k1", "aten.unsqueeze.default", &[node("kpos"), int(0)], &i64s(&[1, s]))
        .call("k2", "aten.unsqueeze.default", &[node("k1"), int(1)], &i64s(&[1, 1, s]))
        .call("k3", "aten.unsqueeze.default", &[node("k2"), int(2)], &i64s(&[1, 1, 1, s]))
        .call_kw("all", "aten.full.default", &[ints(&[]), boolean(true)], r#""dtype":{"dtype":"bool"}"#, &bools(&[]))
        .call("pq", "aten.index.Tensor", &[node("expand"), format!("{{\"list\":[{},{}]}}", node("b3"), node("q3"))], &i64s(&[2, 1, s, 1]))
        .call("pk", "aten.index.Tensor", &[node("expand"), format!("{{\"list\":[{},{}]}}", node("b3"), node("k3"))], &i64s(&[2, 1, 1, s]))
        .call("le", "aten.le.Tensor", &[node("pk"), node("pq")], &bools(&[2, 1, s, s]))
        .call("and", "aten.bitwise_and.Tensor", &[node("all"), node("le")], &bools(&[2, 1, s, s]))
        .call("sq", "aten.index.Tensor", &[node("cumsum"), format!("{{\"list\":[{},{}]}}", node("b3"), node("q3"))], &i64s(&[2, 1, s, 1]))
        .call("sk", "aten.index.Tensor", &[node("cumsum"), format!("{{\"list\":[{},{}]}}", node("b3"), node("k3"))], &i64s(&[2, 1, 1, s]))
        .call("same_seq", "aten.eq.Tensor", &[node("sq"), node("sk")], &bools(&[2, 1, s, s]))
        .call("mask", "aten.bitwise_and.Tensor", &[node("and"), node("same_seq")], &bools(&[2, 1, s, s]))
}

fn form_of(text: &str, name: &str) -> Option<Form> {
    let g = parse_graph(text).expect("the test graph parses");
    let id = g.ids().find(|&i| g.node(i).name == name).expect("the node");
    Forms::new(&g).of(id)
}

#[test]
fn hugging_face_decoder_mask_is_causal() {
    let text = hf_decoder_mask(32).output(&["mask"]);
    // one packed sequence: every sequence id is 0
    assert_eq!(form_of(&text, "same_seq"), Some(Form::Bool(true)));
    assert_eq!(form_of(&text, "cumsum"), Some(Form::Int(Affine { constant: 0, coef: vec![0, 0] })));
    let mask = form_of(&text, "mask").expect("a form");
    assert_eq!(causal_offset(&mask), Some(0));
}

#[test]
fn tril_spelled_by_torch_is_causal_and_its_negation_is_not() {
    let s = 16;
    let text = GraphBuilder::new()
        .call("j", "aten.arange.start_step", &[int(0), int(s)], &i64s(&[s]))
        .call("j2", "aten.unsqueeze.default", &[node("j"), int(-2)], &i64s(&[1, s]))
        .call("i", "aten.arange.start_step", &[int(0), int(s)], &i64s(&[s]))
        .call("i2", "aten.unsqueeze.default", &[node("i"), int(-1)], &i64s(&[s, 1]))
        .call("sub", "aten.sub.Tensor", &[node("j2"), node("i2")], &i64s(&[s, s]))
        .call("le", "aten.le.Scalar", &[node("sub"), int(0)], &bools(&[s, s]))
        .call("above", "aten.le.Scalar", &[node("sub"), int(1)], &bools(&[s, s]))
        .call("not", "aten.bitwise_not.default", &[node("le")], &bools(&[s, s]))
        .output(&["le", "above", "not"]);
    assert_eq!(causal_offset(&form_of(&text, "le").unwrap()), Some(0));
    assert_eq!(causal_offset(&form_of(&text, "above").unwrap()), Some(1));
    assert_eq!(causal_offset(&form_of(&text, "not").unwrap()), None);
}

#[test]
fn a_mask_read_from_an_input_has_no_form() {
    let s = 8;
    let text = GraphBuilder::new()
        .input("pos", &[s], "int64")
        .call("q", "aten.unsqueeze.default", &[node("pos"), int(1)], &i64s(&[s, 1]))
        .call("k", "aten.unsqueeze.default", &[node("pos"), int(0)], &i64s(&[1, s]))
        .call("le", "aten.le.Tensor", &[node("k"), node("q")], &bools(&[s, s]))
        .output(&["le"]);
    assert_eq!(form_of(&text, "le"), None);
}

#[test]
fn a_position_step_other_than_one_starts_new_sequences() {
    // positions 0, 2, 4, ..: every step differs from 1, so each token is its own sequence
    let s = 8;
    let text = GraphBuilder::new()
        .call("pos", "aten.arange.start_step", &[int(0), int(2 * s), int(2)], &i64s(&[s]))
        .call("first", "aten.slice.Tensor", &[node("pos"), int(0), int(0), int(1)], &i64s(&[1]))
        .call("before", "aten.sub.Tensor", &[node("first"), int(1)], &i64s(&[1]))
        .call("cat", "aten.cat.default", &[format!("{{\"list\":[{},{}]}}", node("before"), node("pos"))], &i64s(&[s + 1]))
        .output(&["cat"]);
    // -1, 0, 2, 4, ..: not one affine run
    assert_eq!(form_of(&text, "cat"), None);
}
