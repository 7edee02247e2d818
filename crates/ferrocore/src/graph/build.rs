//! Exchange-format graphs written by hand: a builder of the JSON text `parse_graph` reads, and
//! the argument and metadata values it is made of. The unit tests, the stage tests and small
//! Rust programs build their graphs with it.

use crate::loop_ir::contiguous_strides;

/// Metadata of a CPU tensor with `stride` (contiguous when None).
pub fn strided_meta(shape: &[i64], stride: Option<&[i64]>, dtype: &str) -> String {
    let stride = stride.map(<[i64]>::to_vec).unwrap_or_else(|| contiguous_strides(shape));
    format!(r#"{{"tensor":{{"shape":{shape:?},"stride":{stride:?},"storage_offset":0,"dtype":"{dtype}","device":"cpu"}}}}"#)
}

/// Metadata of a contiguous CPU tensor.
pub fn meta(shape: &[i64], dtype: &str) -> String {
    strided_meta(shape, None, dtype)
}

/// Metadata of a contiguous CPU float32 tensor.
pub fn f32(shape: &[i64]) -> String {
    meta(shape, "float32")
}

/// A tuple of metadata (a node with several results).
pub fn tuple(items: &[String]) -> String {
    format!(r#"{{"tuple":[{}]}}"#, items.join(","))
}

/// A reference to node `name`.
pub fn node(name: &str) -> String {
    format!(r#"{{"node":"{}"}}"#, json_text(name))
}

pub fn int(i: i64) -> String {
    format!(r#"{{"int":{i}}}"#)
}

pub fn ints(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(|&i| int(i)).collect();
    format!(r#"{{"list":[{}]}}"#, items.join(","))
}

pub fn boolean(b: bool) -> String {
    format!(r#"{{"bool":{b}}}"#)
}

pub fn float(x: f64) -> String {
    match x {
        f64::INFINITY => r#"{"float":"inf"}"#.to_string(),
        f64::NEG_INFINITY => r#"{"float":"-inf"}"#.to_string(),
        x if x.is_nan() => r#"{"float":"nan"}"#.to_string(),
        x => format!(r#"{{"float":{x:?}}}"#),
    }
}

/// `s` as the inside of a JSON string.
fn json_text(s: &str) -> String {
    let quoted = serde_json::to_string(s).expect("a string serializes");
    quoted[1..quoted.len() - 1].to_string()
}

/// Positional arguments: a list of argument values, or their text already joined by commas.
pub trait Args {
    fn joined(&self) -> String;
}

impl Args for str {
    fn joined(&self) -> String {
        self.to_string()
    }
}

impl Args for String {
    fn joined(&self) -> String {
        self.clone()
    }
}

impl Args for [String] {
    fn joined(&self) -> String {
        self.join(",")
    }
}

impl<const N: usize> Args for [String; N] {
    fn joined(&self) -> String {
        self.join(",")
    }
}

/// Inputs, calls and outputs, in order; `output` finishes the graph's text.
#[derive(Default)]
pub struct GraphBuilder {
    nodes: Vec<String>,
}

impl GraphBuilder {
    pub fn new() -> GraphBuilder {
        GraphBuilder::default()
    }

    pub fn input(self, name: &str, shape: &[i64], dtype: &str) -> GraphBuilder {
        self.input_meta(name, &meta(shape, dtype))
    }

    pub fn input_meta(mut self, name: &str, meta: &str) -> GraphBuilder {
        self.nodes.push(format!(r#"{{"name":"{}","kind":"placeholder","meta":{meta}}}"#, json_text(name)));
        self
    }

    pub fn call(self, name: &str, target: &str, args: &(impl Args + ?Sized), out_meta: &str) -> GraphBuilder {
        self.call_kw(name, target, args, "", out_meta)
    }

    /// `kwargs`: the inside of the kwargs object (`"dtype":{"dtype":"float32"}`).
    pub fn call_kw(mut self, name: &str, target: &str, args: &(impl Args + ?Sized), kwargs: &str, out_meta: &str) -> GraphBuilder {
        self.nodes.push(format!(
            r#"{{"name":"{}","kind":"call_function","target":"{}","args":[{}],"kwargs":{{{kwargs}}},"meta":{out_meta}}}"#,
            json_text(name),
            json_text(target),
            args.joined()
        ));
        self
    }

    /// The graph's text, returning nodes `names`.
    pub fn output(mut self, names: &[&str]) -> String {
        let outs: Vec<String> = names.iter().map(|name| node(name)).collect();
        self.nodes.push(format!(r#"{{"name":"output","kind":"output","args":[{}]}}"#, outs.join(",")));
        format!(r#"{{"format":"ferrocore.graph","version":1,"name":"g","nodes":[{}]}}"#, self.nodes.join(","))
    }
}
