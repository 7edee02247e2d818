//! Exchange-format JSON -> `Graph`. Every failure names the node it happened at.

use super::*;
use serde_json::Value;
use std::collections::HashMap;

fn err(node: Option<&str>, message: impl Into<String>) -> ImportError {
    ImportError { node: node.map(str::to_string), message: message.into() }
}

pub fn parse_graph(text: &str) -> Result<Graph, ImportError> {
    let doc: Value = serde_json::from_str(text).map_err(|e| err(None, format!("invalid JSON: {e}")))?;
    if doc.get("format").and_then(Value::as_str) != Some("ferrocore.graph") {
        return Err(err(None, "not a ferrocore.graph document"));
    }
    match doc.get("version").and_then(Value::as_i64) {
        Some(1) => {}
        v => return Err(err(None, format!("unsupported format version {v:?}"))),
    }
    let name = doc.get("name").and_then(Value::as_str).unwrap_or("graph").to_string();
    let raw_nodes = doc.get("nodes").and_then(Value::as_array).ok_or_else(|| err(None, "missing 'nodes' list"))?;

    let mut g = Graph {
        name,
        nodes: Vec::new(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        free_layout_outputs: Vec::new(),
        padded_matmuls: HashMap::new(),
        template_matmuls: HashMap::new(),
        donated_inputs: Vec::new(),
        sources: HashMap::new(),
    };
    let mut by_name: HashMap<String, NodeId> = HashMap::new();
    let mut saw_output = false;
    for raw in raw_nodes {
        let nname = raw.get("name").and_then(Value::as_str).ok_or_else(|| err(None, "node without a name"))?;
        let here = Some(nname);
        if saw_output {
            return Err(err(here, "node after the output node"));
        }
        let kind = raw.get("kind").and_then(Value::as_str).ok_or_else(|| err(here, "missing 'kind'"))?;
        match kind {
            "output" => {
                let args = raw.get("args").and_then(Value::as_array).ok_or_else(|| err(here, "output without 'args'"))?;
                g.outputs = args.iter().map(|a| parse_arg(a, &by_name, nname)).collect::<Result<_, _>>()?;
                saw_output = true;
                continue;
            }
            "placeholder" | "call_function" => {}
            k => return Err(err(here, format!("unknown node kind '{k}'"))),
        }
        if by_name.contains_key(nname) {
            return Err(err(here, "duplicate node name"));
        }
        let meta = parse_meta(raw.get("meta").unwrap_or(&Value::Null), nname)?;
        let node_kind = if kind == "placeholder" {
            if meta.tensor().is_none() {
                return Err(err(here, "placeholder must carry tensor metadata"));
            }
            NodeKind::Placeholder
        } else {
            let tname = raw.get("target").and_then(Value::as_str).ok_or_else(|| err(here, "missing 'target'"))?;
            let args: Vec<Arg> = match raw.get("args") {
                Some(Value::Array(a)) => a.iter().map(|x| parse_arg(x, &by_name, nname)).collect::<Result<_, _>>()?,
                None | Some(Value::Null) => Vec::new(),
                Some(_) => return Err(err(here, "'args' must be a list")),
            };
            let mut kwargs = Vec::new();
            match raw.get("kwargs") {
                Some(Value::Object(m)) => {
                    for (k, v) in m {
                        kwargs.push((k.clone(), parse_arg(v, &by_name, nname)?));
                    }
                }
                None | Some(Value::Null) => {}
                Some(_) => return Err(err(here, "'kwargs' must be an object")),
            }
            let target = Target::from_name(tname)
                .ok_or_else(|| err(here, format!("target '{tname}' is not an operator name (namespace.op.overload)")))?;
            match target {
                Target::GetItem if args.len() != 2 || !matches!(args[0], Arg::Node(_)) || !matches!(args[1], Arg::Int(_)) => {
                    return Err(err(here, "getitem takes (node, int)"));
                }
                Target::Aten(op) => {
                    let (lo, hi) = op.arity();
                    if args.len() < lo.min(1) || args.len() > hi {
                        return Err(err(here, format!("{tname} takes {lo}..={hi} positional arguments, got {}", args.len())));
                    }
                }
                _ => {}
            }
            NodeKind::Call { target, args, kwargs }
        };
        let id = NodeId(g.nodes.len() as u32);
        if matches!(node_kind, NodeKind::Placeholder) {
            g.inputs.push(id);
        }
        by_name.insert(nname.to_string(), id);
        g.nodes.push(Node { name: nname.to_string(), kind: node_kind, meta });
    }
    if !saw_output {
        return Err(err(None, "graph has no output node"));
    }
    g.free_layout_outputs = positions(&doc, "free_layout_outputs", g.outputs.len(), Some("output"), "output")?;
    g.donated_inputs = positions(&doc, "donated_inputs", g.inputs.len(), None, "input")?;
    g.padded_matmuls = named_nodes(&doc, "padded_matmuls", &by_name)?;
    g.template_matmuls = named_nodes(&doc, "template_matmuls", &by_name)?;
    match doc.get("sources") {
        None | Some(Value::Null) => {}
        Some(Value::Object(items)) => {
            for (name, line) in items {
                let Some(line) = line.as_str() else { return Err(err(Some(name), "a source line must be a string")) };
                if !by_name.contains_key(name) {
                    return Err(err(Some(name), "sources names no node of the graph"));
                }
                g.sources.insert(name.clone(), line.to_string());
            }
        }
        Some(_) => return Err(err(None, "sources must map node names to source lines")),
    }
    super::names::check_names(&g)?;
    super::validate::check_metadata(&g)?;
    Ok(g)
}

/// A side table naming graph nodes, each with why (`padded_matmuls`, `template_matmuls`).
fn named_nodes(doc: &Value, key: &str, by_name: &HashMap<String, NodeId>) -> Result<HashMap<String, String>, ImportError> {
    let mut out = HashMap::new();
    match doc.get(key) {
        None | Some(Value::Null) => {}
        Some(Value::Object(items)) => {
            for (name, why) in items {
                if !by_name.contains_key(name) {
                    return Err(err(Some(name), format!("{key} names no node of the graph")));
                }
                out.insert(name.clone(), why.as_str().unwrap_or("measured").to_string());
            }
        }
        Some(_) => return Err(err(None, format!("{key} must map node names to reasons"))),
    }
    Ok(out)
}

/// The list of positions below `count` under `key` (absent: none).
fn positions(doc: &Value, key: &str, count: usize, node: Option<&str>, what: &str) -> Result<Vec<usize>, ImportError> {
    match doc.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|it| match it.as_u64() {
                Some(i) if (i as usize) < count => Ok(i as usize),
                _ => Err(err(node, format!("{key}: {it} is not an {what} position"))),
            })
            .collect(),
        Some(_) => Err(err(node, format!("{key} must be a list of {what} positions"))),
    }
}

fn parse_meta(v: &Value, node: &str) -> Result<Meta, ImportError> {
    let here = Some(node);
    if v.is_null() {
        return Ok(Meta::None);
    }
    if let Some(t) = v.get("tensor") {
        let ints = |key: &str| -> Result<Vec<i64>, ImportError> {
            t.get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| err(here, format!("tensor meta missing '{key}'")))?
                .iter()
                .map(|x| x.as_i64().ok_or_else(|| err(here, format!("tensor meta '{key}' must hold integers"))))
                .collect()
        };
        let shape = ints("shape")?;
        let stride = ints("stride")?;
        if shape.len() != stride.len() {
            return Err(err(here, format!("shape {shape:?} and stride {stride:?} differ in rank")));
        }
        if shape.iter().any(|&s| s < 0) {
            return Err(err(here, format!("negative size in shape {shape:?}")));
        }
        let dname = t.get("dtype").and_then(Value::as_str).ok_or_else(|| err(here, "tensor meta missing 'dtype'"))?;
        let dtype = DType::parse(dname).ok_or_else(|| err(here, format!("unknown dtype '{dname}'")))?;
        let dev = t.get("device").and_then(Value::as_str).unwrap_or("cpu");
        let device = Device::parse(dev).ok_or_else(|| err(here, format!("unknown device '{dev}'")))?;
        let storage_offset = t.get("storage_offset").and_then(Value::as_i64).unwrap_or(0);
        return Ok(Meta::Tensor(TensorMeta { shape, stride, storage_offset, dtype, device }));
    }
    if let Some(items) = v.get("tuple").and_then(Value::as_array) {
        let metas = items.iter().map(|m| if m.is_null() { Ok(None) } else { parse_meta(m, node).map(Some) }).collect::<Result<_, _>>()?;
        return Ok(Meta::Tuple(metas));
    }
    if let Some(s) = v.get("scalar").and_then(Value::as_str) {
        return Ok(Meta::Scalar(match s {
            "int" => ScalarKind::Int,
            "float" => ScalarKind::Float,
            "bool" => ScalarKind::Bool,
            other => return Err(err(here, format!("unknown scalar kind '{other}'"))),
        }));
    }
    Err(err(here, format!("unrecognised meta {v}")))
}

fn parse_arg(v: &Value, by_name: &HashMap<String, NodeId>, node: &str) -> Result<Arg, ImportError> {
    let here = Some(node);
    let obj = match v {
        Value::Null => return Ok(Arg::None),
        Value::Object(o) if o.len() == 1 => o,
        other => return Err(err(here, format!("malformed argument {other}"))),
    };
    let (tag, val) = obj.iter().next().ok_or_else(|| err(here, "empty argument"))?;
    let s = || val.as_str().ok_or_else(|| err(here, format!("argument '{tag}' must be a string")));
    Ok(match tag.as_str() {
        "node" => {
            let n = s()?;
            Arg::Node(*by_name.get(n).ok_or_else(|| err(here, format!("reference to unknown node '{n}'")))?)
        }
        "int" => Arg::Int(val.as_i64().ok_or_else(|| err(here, format!("bad int {val}")))?),
        "float" => Arg::Float(match val {
            Value::String(x) if x == "inf" => f64::INFINITY,
            Value::String(x) if x == "-inf" => f64::NEG_INFINITY,
            Value::String(x) if x == "nan" => f64::NAN,
            _ => val.as_f64().ok_or_else(|| err(here, format!("bad float {val}")))?,
        }),
        "bool" => Arg::Bool(val.as_bool().ok_or_else(|| err(here, format!("bad bool {val}")))?),
        "str" => Arg::Str(s()?.to_string()),
        "list" => Arg::List(
            val.as_array()
                .ok_or_else(|| err(here, "'list' must hold an array"))?
                .iter()
                .map(|x| parse_arg(x, by_name, node))
                .collect::<Result<_, _>>()?,
        ),
        "dtype" => {
            let d = s()?;
            Arg::DType(DType::parse(d).ok_or_else(|| err(here, format!("unknown dtype '{d}'")))?)
        }
        "device" => {
            let d = s()?;
            Arg::Device(Device::parse(d).ok_or_else(|| err(here, format!("unknown device '{d}'")))?)
        }
        "layout" => Arg::Layout(s()?.to_string()),
        "memory_format" => Arg::MemoryFormat(s()?.to_string()),
        other => return Err(err(here, format!("unknown argument tag '{other}'"))),
    })
}

/// `namespace.op.overload`, each part an identifier: what `torch.ops.<name>` can resolve.
pub fn is_op_name(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    // a keyword cannot follow a `.` in Python source
    parts.len() == 3 && parts.iter().all(|p| super::names::is_identifier(p) && !super::names::is_python_keyword(p))
}
