//! The imported ATen-level graph: an arena of nodes with typed ids, parsed from the exchange
//! format (docs/exchange_format.md), with a text printer and a verifier. It knows nothing about
//! loops or kernels; malformed input is an `ImportError` naming the node, never a panic.

pub mod dtype;
pub mod names;
pub mod ops;
pub mod parse;
mod schema;
pub mod validate;

pub use dtype::{promote_types, result_type, Category, DType, Device, Operand};
pub use ops::AtenOp;
pub use parse::parse_graph;

use std::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct NodeId(pub u32);

#[derive(Clone, Debug, PartialEq)]
pub struct TensorMeta {
    pub shape: Vec<i64>,
    pub stride: Vec<i64>,
    pub storage_offset: i64,
    pub dtype: DType,
    pub device: Device,
}

impl TensorMeta {
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalarKind {
    Int,
    Float,
    Bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    Tensor(TensorMeta),
    Tuple(Vec<Option<Meta>>),
    Scalar(ScalarKind),
    None,
}

impl Meta {
    pub fn tensor(&self) -> Option<&TensorMeta> {
        match self {
            Meta::Tensor(t) => Some(t),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    None,
    Node(NodeId),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    List(Vec<Arg>),
    DType(DType),
    Device(Device),
    Layout(String),
    MemoryFormat(String),
}

#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    Aten(AtenOp),
    GetItem,
    /// An overload ferrocore has no lowering for: kept by name for the ATen fallback.
    Unknown(String),
}

impl Target {
    pub fn name(&self) -> &str {
        match self {
            Target::Aten(op) => op.name(),
            Target::GetItem => "getitem",
            Target::Unknown(s) => s,
        }
    }
}

#[derive(Clone, Debug)]
pub enum NodeKind {
    Placeholder,
    Call { target: Target, args: Vec<Arg>, kwargs: Vec<(String, Arg)> },
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub kind: NodeKind,
    pub meta: Meta,
}

impl Node {
    pub fn kwarg(&self, key: &str) -> Option<&Arg> {
        match &self.kind {
            NodeKind::Call { kwargs, .. } => kwargs.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            NodeKind::Placeholder => None,
        }
    }
    /// Positional argument `i`, or the keyword `key` when it was passed by name.
    pub fn arg(&self, i: usize, key: &str) -> Option<&Arg> {
        match &self.kind {
            NodeKind::Call { args, .. } => args.get(i).or_else(|| self.kwarg(key)),
            NodeKind::Placeholder => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    pub inputs: Vec<NodeId>,
    pub outputs: Vec<Arg>,
    /// Output positions whose layout the compiler chooses (a forward graph's saved activations:
    /// the caller compiles their consumer for the strides reported back); every other output
    /// has its metadata's strides.
    pub free_layout_outputs: Vec<usize>,
    /// GEMM nodes the front measured faster on padded operands, with what it measured.
    pub padded_matmuls: std::collections::HashMap<String, String>,
    /// Input positions the caller hands over (a backward's saved activations, which AOT autograd
    /// drops as it calls): their storage may hold a result once they are read for the last time.
    pub donated_inputs: Vec<usize>,
    /// Node name -> the model source line it came from (`File "m.py", line 42, in forward: ...`),
    /// for the generated module's comments; untrusted text, escaped wherever it is written.
    pub sources: std::collections::HashMap<String, String>,
}

impl Graph {
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0 as usize]
    }
    pub fn ids(&self) -> impl Iterator<Item = NodeId> {
        (0..self.nodes.len() as u32).map(NodeId)
    }
    /// The calls that take each node as an argument (once per call).
    pub fn users(&self) -> Vec<Vec<NodeId>> {
        let mut users: Vec<Vec<NodeId>> = vec![Vec::new(); self.nodes.len()];
        fn visit(a: &Arg, user: NodeId, users: &mut [Vec<NodeId>]) {
            match a {
                Arg::Node(n) if users[n.0 as usize].last() != Some(&user) => users[n.0 as usize].push(user),
                Arg::List(items) => items.iter().for_each(|i| visit(i, user, users)),
                _ => {}
            }
        }
        for id in self.ids() {
            if let NodeKind::Call { args, kwargs, .. } = &self.node(id).kind {
                args.iter().chain(kwargs.iter().map(|(_, a)| a)).for_each(|a| visit(a, id, &mut users));
            }
        }
        users
    }
    /// Number of uses of each node by other nodes and by the outputs.
    pub fn use_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.nodes.len()];
        fn visit(a: &Arg, counts: &mut [usize]) {
            match a {
                Arg::Node(n) => counts[n.0 as usize] += 1,
                Arg::List(items) => items.iter().for_each(|i| visit(i, counts)),
                _ => {}
            }
        }
        for n in &self.nodes {
            if let NodeKind::Call { args, kwargs, .. } = &n.kind {
                args.iter().for_each(|a| visit(a, &mut counts));
                kwargs.iter().for_each(|(_, a)| visit(a, &mut counts));
            }
        }
        self.outputs.iter().for_each(|a| visit(a, &mut counts));
        counts
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ImportError {
    pub node: Option<String>,
    pub message: String,
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // the graph's own text, quoted in a message, must not break or disguise the line
        let shown = names::printable;
        match &self.node {
            Some(n) => write!(f, "graph import: node '{}': {}", shown(n), shown(&self.message)),
            None => write!(f, "graph import: {}", shown(&self.message)),
        }
    }
}

impl std::error::Error for ImportError {}

/// An argument as the graph's text shows it.
pub fn fmt_arg(g: &Graph, a: &Arg) -> String {
    match a {
        Arg::None => "None".into(),
        Arg::Node(n) => g.node(*n).name.clone(),
        Arg::Int(i) => i.to_string(),
        Arg::Float(x) => format!("{x:?}"),
        Arg::Bool(b) => {
            if *b {
                "True".into()
            } else {
                "False".into()
            }
        }
        Arg::Str(s) => format!("{s:?}"),
        Arg::List(items) => format!("[{}]", items.iter().map(|i| fmt_arg(g, i)).collect::<Vec<_>>().join(", ")),
        Arg::DType(d) => format!("torch.{d}"),
        Arg::Device(d) => format!("{d}"),
        Arg::Layout(l) => format!("torch.{l}"),
        Arg::MemoryFormat(m) => format!("torch.{m}"),
    }
}

/// A node's metadata as the graph's text shows it (`dtype[shape]/[stride]`).
pub fn fmt_meta(m: &Meta) -> String {
    match m {
        Meta::Tensor(t) => format!("{}{:?}/{:?}", t.dtype, t.shape, t.stride),
        Meta::Tuple(items) => {
            format!("({})", items.iter().map(|i| i.as_ref().map_or("None".into(), fmt_meta)).collect::<Vec<_>>().join(", "))
        }
        Meta::Scalar(k) => format!("{k:?}"),
        Meta::None => "None".into(),
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "graph {}:", self.name)?;
        for n in &self.nodes {
            match &n.kind {
                NodeKind::Placeholder => writeln!(f, "  {}: {} = input", n.name, fmt_meta(&n.meta))?,
                NodeKind::Call { target, args, kwargs } => {
                    let mut parts: Vec<String> = args.iter().map(|a| fmt_arg(self, a)).collect();
                    parts.extend(kwargs.iter().map(|(k, v)| format!("{k}={}", fmt_arg(self, v))));
                    writeln!(f, "  {}: {} = {}({})", n.name, fmt_meta(&n.meta), target.name(), parts.join(", "))?
                }
            }
        }
        let outs: Vec<String> = self.outputs.iter().map(|a| fmt_arg(self, a)).collect();
        writeln!(f, "  return ({})", outs.join(", "))
    }
}

#[cfg(test)]
mod tests;
