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
        import_err(&format!(r#"{X},{{"name":"y","kind":"call_function","target":"aten.relu.default","args":[{{"node":"x"}},{{"int":1}}]}}"#)),
        "graph import: node 'y': aten.relu.default takes 1..=1 positional arguments, got 2"
    );
    assert_eq!(import_err(X), "graph import: graph has no output node");
    assert!(parse_graph("{").unwrap_err().to_string().contains("invalid JSON"));
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
