use super::*;
use crate::driver::{generate, Generation, Options};

/// softmax over rows of an input, and a gather by an index input: two kernels, one checking
/// its indices.
fn graph(device: &str) -> String {
    let meta = |shape: &str, stride: &str, dtype: &str| {
        format!(r#"{{"tensor":{{"shape":{shape},"stride":{stride},"storage_offset":0,"dtype":"{dtype}","device":"{device}"}}}}"#)
    };
    let nodes = [
        format!(r#"{{"name":"x","kind":"placeholder","meta":{}}}"#, meta("[4,8]", "[8,1]", "float32")),
        format!(r#"{{"name":"i","kind":"placeholder","meta":{}}}"#, meta("[3]", "[1]", "int64")),
        format!(
            r#"{{"name":"s","kind":"call_function","target":"aten._softmax.default","args":[{{"node":"x"}},{{"int":1}},{{"bool":false}}],"kwargs":{{}},"meta":{}}}"#,
            meta("[4,8]", "[8,1]", "float32")
        ),
        format!(
            r#"{{"name":"g","kind":"call_function","target":"aten.index.Tensor","args":[{{"node":"s"}},{{"list":[{{"node":"i"}}]}}],"kwargs":{{}},"meta":{}}}"#,
            meta("[3,8]", "[8,1]", "float32")
        ),
        r#"{"name":"output","kind":"output","args":[{"node":"g"},{"node":"s"}]}"#.to_string(),
    ];
    format!(r#"{{"format":"ferrocore.graph","version":1,"name":"g","nodes":[{}]}}"#, nodes.join(","))
}

fn compiled(device: &str) -> CompiledGraph {
    let options = Options { skip_native_compile: true, ..Options::default() };
    match generate(&graph(device), &options).unwrap() {
        Generation::Code(g) => g.artifact,
        Generation::Eager { reason, .. } => panic!("runs eagerly: {reason}"),
    }
}

#[test]
fn a_compiled_graph_reads_back_as_written() {
    for device in ["cpu", "cuda:0"] {
        let g = compiled(device);
        assert_eq!(CompiledGraph::from_json(&g.to_json()).unwrap(), g);
    }
}

#[test]
fn each_kernel_spans_its_own_definition_after_the_prelude() {
    for device in ["cpu", "cuda:0"] {
        let g = compiled(device);
        let unit = g.unit.as_ref().unwrap();
        assert!(!g.kernels.is_empty());
        for (i, k) in g.kernels.iter().enumerate() {
            assert!(k.definition.start >= unit.prelude.end, "{device}: {} starts in the prelude", k.name);
            assert!(g.kernel_text(i).contains(&k.name), "{device}: {}'s text is not its definition", k.name);
        }
        let steps = g.steps.iter().filter(|s| matches!(s, Step::Launch { .. })).count();
        assert_eq!(steps, g.kernels.len(), "{device}: every kernel is launched once");
    }
}

#[test]
fn the_index_check_is_data() {
    // a Triton gather reports through a flag buffer on its device; a C++ one by its return value
    assert_eq!(compiled("cuda:0").index_check, Some(IndexCheck { device: "cuda:0".into() }));
    assert_eq!(compiled("cpu").index_check, None);
    assert!(compiled("cpu").kernels.iter().any(|k| k.checks_indices));
}

#[test]
fn another_format_or_version_is_refused() {
    let g = compiled("cpu");
    let newer = CompiledGraph { version: VERSION + 1, ..g.clone() };
    assert!(CompiledGraph::from_json(&newer.to_json()).unwrap_err().contains("version"));
    assert!(CompiledGraph::from_json("{}").is_err());
}

#[test]
fn floats_json_has_no_number_for_read_back() {
    let call = |v: f64| Arg::List(vec![Arg::Float(v), Arg::Float(-0.5)]);
    for v in [f64::INFINITY, f64::NEG_INFINITY, 1e300] {
        let text = serde_json::to_string(&call(v)).unwrap();
        assert_eq!(serde_json::from_str::<Arg>(&text).unwrap(), call(v), "{text}");
    }
    let nan = serde_json::to_string(&Arg::Float(f64::NAN)).unwrap();
    assert!(matches!(serde_json::from_str::<Arg>(&nan).unwrap(), Arg::Float(v) if v.is_nan()), "{nan}");
}
