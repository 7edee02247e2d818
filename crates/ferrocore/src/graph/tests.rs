use super::*;

fn doc(nodes: &str) -> String {
    format!(r#"{{"format":"ferrocore.graph","version":1,"name":"g","nodes":[{nodes}]}}"#)
}
const X: &str = r#"{"name":"x","kind":"placeholder","meta":{"tensor":{"shape":[2,3],"stride":[3,1],"storage_offset":0,"dtype":"float32","device":"cpu"}}}"#;

#[test]
fn parses_and_prints() {
    let text = doc(&format!(
        r#"{X},{{"name":"add","kind":"call_function","target":"aten.add.Tensor","args":[{{"node":"x"}},{{"float":"inf"}}],"kwargs":{{"alpha":{{"int":2}}}},"meta":{{"tensor":{{"shape":[2,3],"stride":[3,1],"storage_offset":0,"dtype":"float32","device":"cpu"}}}}}},{{"name":"output","kind":"output","args":[{{"node":"add"}}]}}"#
    ));
    let g = parse_graph(&text).unwrap();
    assert_eq!(
        g.to_string(),
        "graph g:\n  x: float32[2, 3]/[3, 1] = input\n  add: float32[2, 3]/[3, 1] = aten.add.Tensor(x, inf, alpha=2)\n  return (add)\n"
    );
}

fn import_err(nodes: &str) -> String {
    parse_graph(&doc(nodes)).unwrap_err().to_string()
}

#[test]
fn malformed_input_names_the_node() {
    assert_eq!(
        import_err(r#"{"name":"x","kind":"placeholder","meta":{"tensor":{"shape":[2],"stride":[1],"dtype":"float33"}}}"#),
        "graph import: node 'x': unknown dtype 'float33'"
    );
    assert_eq!(
        import_err(&format!(r#"{X},{{"name":"y","kind":"call_function","target":"aten.relu.default","args":[{{"node":"zz"}}]}}"#)),
        "graph import: node 'y': reference to unknown node 'zz'"
    );
    assert_eq!(
        import_err(&format!(
            r#"{X},{{"name":"y","kind":"call_function","target":"aten.relu.default","args":[{{"node":"x"}},{{"int":1}}]}}"#
        )),
        "graph import: node 'y': aten.relu.default takes 1..=1 positional arguments, got 2"
    );
    assert_eq!(import_err(X), "graph import: graph has no output node");
    assert!(parse_graph("{").unwrap_err().to_string().contains("invalid JSON"));
}

#[test]
fn source_lines_are_read_and_checked() {
    let out = r#"{"name":"output","kind":"output","args":[{"node":"x"}]}"#;
    let with_sources = |sources: &str| {
        let d = doc(&format!("{X},{out}"));
        format!(r#"{},"sources":{sources}}}"#, &d[..d.len() - 1])
    };
    let g = parse_graph(&with_sources(r#"{"x":"File \"m.py\", line 3, in f: y = x"}"#)).unwrap();
    assert_eq!(g.sources["x"], "File \"m.py\", line 3, in f: y = x");
    assert_eq!(
        parse_graph(&with_sources(r#"{"zz":"line"}"#)).unwrap_err().to_string(),
        "graph import: node 'zz': sources names no node of the graph"
    );
    assert_eq!(parse_graph(&with_sources(r#"{"x":1}"#)).unwrap_err().to_string(), "graph import: node 'x': a source line must be a string");
    assert_eq!(parse_graph(&with_sources("[]")).unwrap_err().to_string(), "graph import: sources must map node names to source lines");
}

#[test]
fn unknown_aten_ops_are_kept_for_fallback() {
    let text = doc(&format!(
        r#"{X},{{"name":"y","kind":"call_function","target":"aten.cummax.default","args":[{{"node":"x"}},{{"int":0}}],"meta":null}},{{"name":"output","kind":"output","args":[]}}"#
    ));
    let g = parse_graph(&text).unwrap();
    assert!(matches!(&g.nodes[1].kind, NodeKind::Call { target: Target::Unknown(t), .. } if t == "aten.cummax.default"));
}

#[test]
fn type_promotion_follows_torch() {
    use DType::*;
    assert_eq!(promote_types(I32, F16), F16);
    assert_eq!(promote_types(U8, I8), I16);
    assert_eq!(promote_types(F16, BF16), F32);
    assert_eq!(promote_types(Bool, I32), I32);
    let t = |d| Operand::Tensor { dtype: d, zero_dim: false };
    let z = |d| Operand::Tensor { dtype: d, zero_dim: true };
    assert_eq!(result_type(&[t(I32), Operand::Scalar(Category::Float)]), F32);
    assert_eq!(result_type(&[t(F16), Operand::Scalar(Category::Float)]), F16);
    assert_eq!(result_type(&[t(I32), z(I64)]), I32);
    assert_eq!(result_type(&[t(I32), z(F64)]), F64);
    assert_eq!(result_type(&[t(F16), z(F32)]), F16);
    assert_eq!(result_type(&[t(Bool), Operand::Scalar(Category::Int)]), I64);
}

/// A placeholder `x` with this tensor metadata, returned.
fn graph_with_input(shape: &str, stride: &str, offset: i64, dtype: &str) -> String {
    doc(&format!(
        r#"{{"name":"x","kind":"placeholder","meta":{{"tensor":{{"shape":{shape},"stride":{stride},"storage_offset":{offset},"dtype":"{dtype}","device":"cpu"}}}}}},{{"name":"output","kind":"output","args":[{{"node":"x"}}]}}"#
    ))
}

#[test]
fn impossible_tensor_metadata_is_rejected_naming_the_node() {
    let rejected = |shape: &str, stride: &str, offset: i64, why: &str| {
        let e = parse_graph(&graph_with_input(shape, stride, offset, "float32")).unwrap_err().to_string();
        assert!(e.starts_with("graph import: node 'x': ") && e.contains(why), "{shape} {stride} {offset}: {e}");
    };
    // 2^62 * 4 elements: the element count wraps in i64
    rejected("[4611686018427387904,4]", "[4,1]", 0, "more than 2^62 bytes");
    // the count fits but its bytes do not (2^61 float32 elements)
    rejected("[2305843009213693952]", "[1]", 0, "more than 2^62 bytes");
    rejected("[3,4]", "[-4,1]", 0, "negative stride");
    rejected("[3,4]", "[4,1]", -1, "negative storage offset");
    // an element offset past any index arithmetic: 2^62 * 1
    rejected("[2,4]", "[4611686018427387904,1]", 0, "2^62");
    rejected("[3,2]", "[1152921504606846976,1]", 0, "past 2^62 bytes");
    rejected("[1,4]", "[4611686018427387904,1]", 0, "stride past 2^62");
    rejected("[2]", "[1]", 4611686018427387903, "past 2^62 bytes");
}

#[test]
fn extreme_but_possible_tensor_metadata_is_accepted() {
    for (shape, stride, offset, dtype) in [
        // size-0 tensors address nothing: torch allows any strides
        ("[0,4]", "[4611686018427387904,1]", 0, "float32"),
        ("[4611686018427387904,0]", "[0,1]", 0, "bool"),
        ("[]", "[]", 7, "float64"),
        // a broadcast (stride 0) and the largest storage of bytes
        ("[1024,4]", "[0,1]", 0, "float32"),
        ("[4611686018427387904]", "[1]", 0, "uint8"),
    ] {
        assert!(parse_graph(&graph_with_input(shape, stride, offset, dtype)).is_ok(), "{shape} {stride} {offset} {dtype}");
    }
}

#[test]
fn every_dtype_reads_back_from_its_torch_name() {
    let all = DType::all();
    assert_eq!(all.len(), 21);
    for d in all {
        assert_eq!(DType::parse(d.torch_name()), Some(d), "{d:?}");
    }
}
