//! Rewrites of the imported ATen graph before lowering. Each is a named pass (the name serves
//! timings, `FERROCORE_LOGS` and the `graph_after_<name>` dump) that returns the graph and one
//! line per decision, taken or refused with the reason; `PassOptions` is what they know of
//! the target. `GraphEdit` is how a pass replaces a node
//! by new nodes computed just before it.

pub mod affine;
pub mod attention;
pub mod causal;
pub mod epilogue;
pub mod traced;

use crate::graph::*;
use crate::loop_ir::contiguous_strides;
use std::collections::{HashMap, HashSet};

pub struct GraphPass {
    pub name: &'static str,
    pub run: fn(Graph, &PassOptions) -> (Graph, Vec<String>),
}

/// What the graph passes are told of the target.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassOptions {
    /// The GPU's compute capability (major * 10 + minor), 0 when not known.
    pub cuda_arch: u32,
    /// The graph is a forward being traced for training (`traced`): the calls a pass writes
    /// are differentiated, so fused attention computes the log-sum-exp its backward reads.
    pub differentiable: bool,
    /// Every GEMM becomes a matrix-product kernel that fuses its epilogue itself
    /// (`gemm_template = always`): no library epilogue is asked for (nor for the GEMMs the graph
    /// names in `template_matmuls`).
    pub gemm_templates: bool,
    /// The graph's loops run in Triton kernels (CUDA, or CPU tensors under Triton's interpreter).
    pub triton_kernels: bool,
}

/// The graph passes, in the order they run.
pub const GRAPH_PASSES: &[GraphPass] = &[
    GraphPass { name: "attention", run: attention::fuse_attention },
    GraphPass { name: "causal_mask", run: causal::use_causal_kernels },
    GraphPass { name: "gemm_epilogue", run: epilogue::fuse_gemm_epilogues },
];

/// Replacements of single nodes by new nodes, applied together: a new node's arguments name
/// existing nodes or earlier new ones (by the ids `push` returned).
pub struct GraphEdit {
    base: usize,
    new_nodes: Vec<Node>,
    /// root -> (the new nodes computed just before it, in order; the one that replaces it)
    replacements: HashMap<NodeId, (Vec<usize>, NodeId)>,
    /// Nodes only the replaced patterns read: dropped.
    dead: HashSet<NodeId>,
    names: HashSet<String>,
    /// New node name -> the source line it inherits.
    sources: Vec<(String, String)>,
}

impl GraphEdit {
    pub fn new(g: &Graph) -> GraphEdit {
        GraphEdit {
            base: g.nodes.len(),
            new_nodes: Vec::new(),
            replacements: HashMap::new(),
            dead: HashSet::new(),
            names: g.nodes.iter().map(|n| n.name.clone()).collect(),
            sources: Vec::new(),
        }
    }

    /// Adds `node` (its name made fresh with a number), inheriting `like`'s source line.
    pub fn push(&mut self, g: &Graph, like: NodeId, mut node: Node) -> NodeId {
        let stem = std::mem::take(&mut node.name);
        node.name = stem.clone();
        let mut i = 1;
        while !self.names.insert(node.name.clone()) {
            node.name = format!("{stem}_{i}");
            i += 1;
        }
        if let Some(src) = g.sources.get(&g.node(like).name) {
            self.sources.push((node.name.clone(), src.clone()));
        }
        self.new_nodes.push(node);
        NodeId((self.base + self.new_nodes.len() - 1) as u32)
    }

    /// The node `root` is replaced by `by` (a node pushed since `first`, the id of the first new
    /// node of this replacement); `dead` are dropped.
    pub fn replace(&mut self, root: NodeId, first: usize, by: NodeId, dead: impl IntoIterator<Item = NodeId>) {
        let new: Vec<usize> = (first..self.new_nodes.len()).collect();
        self.replacements.insert(root, (new, by));
        self.dead.extend(dead);
    }

    /// A node's metadata, new or old.
    pub fn meta<'a>(&'a self, g: &'a Graph, id: NodeId) -> &'a Meta {
        match (id.0 as usize).checked_sub(self.base) {
            Some(k) => &self.new_nodes[k].meta,
            None => &g.node(id).meta,
        }
    }

    /// The number of new nodes so far (the `first` of the next replacement).
    pub fn mark(&self) -> usize {
        self.new_nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.replacements.is_empty()
    }

    /// The pass's result: the edited graph, or `g` unchanged (with a line saying so) when the
    /// edit does not hold together; `decisions` are the pass's lines.
    pub fn finish(&self, g: Graph, mut decisions: Vec<String>) -> (Graph, Vec<String>) {
        if self.is_empty() {
            return (g, decisions);
        }
        match self.apply(&g) {
            Some(edited) => (edited, decisions),
            None => {
                decisions.push("the edit does not hold together; the graph is left as it was".into());
                (g, decisions)
            }
        }
    }

    /// The edited graph: nodes in the old order, each replacement's new nodes in its root's
    /// place; None when a kept node reads a dropped one (the edit does not hold together).
    pub fn apply(&self, g: &Graph) -> Option<Graph> {
        let mut map: Vec<Option<NodeId>> = vec![None; self.base + self.new_nodes.len()];
        let mut out: Vec<Node> = Vec::with_capacity(map.len());
        let mut emit = |n: &Node, map: &mut Vec<Option<NodeId>>, slot: usize| -> Option<()> {
            out.push(remap_node(n, map)?);
            map[slot] = Some(NodeId(out.len() as u32 - 1));
            Some(())
        };
        for (i, node) in g.nodes.iter().enumerate() {
            let id = NodeId(i as u32);
            if self.dead.contains(&id) {
                continue;
            }
            match self.replacements.get(&id) {
                Some((nodes, by)) => {
                    for &k in nodes {
                        emit(&self.new_nodes[k], &mut map, self.base + k)?;
                    }
                    map[i] = map[by.0 as usize];
                }
                None => emit(node, &mut map, i)?,
            }
        }
        let mut edited = Graph { nodes: out, ..g.clone_without_nodes() };
        edited.inputs = g.inputs.iter().map(|id| map[id.0 as usize]).collect::<Option<_>>()?;
        edited.outputs = g.outputs.iter().map(|a| remap_arg(a, &map)).collect::<Option<_>>()?;
        edited.sources.extend(self.sources.iter().cloned());
        Some(edited)
    }
}

fn remap_arg(a: &Arg, map: &[Option<NodeId>]) -> Option<Arg> {
    Some(match a {
        Arg::Node(n) => Arg::Node((*map.get(n.0 as usize)?)?),
        Arg::List(items) => Arg::List(items.iter().map(|i| remap_arg(i, map)).collect::<Option<_>>()?),
        other => other.clone(),
    })
}

fn remap_node(n: &Node, map: &[Option<NodeId>]) -> Option<Node> {
    let kind = match &n.kind {
        NodeKind::Placeholder => NodeKind::Placeholder,
        NodeKind::Call { target, args, kwargs } => NodeKind::Call {
            target: target.clone(),
            args: args.iter().map(|a| remap_arg(a, map)).collect::<Option<_>>()?,
            kwargs: kwargs.iter().map(|(k, a)| Some((k.clone(), remap_arg(a, map)?))).collect::<Option<_>>()?,
        },
    };
    Some(Node { name: n.name.clone(), kind, meta: n.meta.clone() })
}

/// An ATen call's op, arguments and keyword arguments.
pub type Call<'g> = (AtenOp, &'g [Arg], &'g [(String, Arg)]);

/// The op and arguments of an ATen call node; None for anything else.
pub fn call(g: &Graph, id: NodeId) -> Option<Call<'_>> {
    match &g.node(id).kind {
        NodeKind::Call { target: Target::Aten(op), args, kwargs } => Some((*op, args.as_slice(), kwargs.as_slice())),
        _ => None,
    }
}

/// The targets of a graph's calls, in order (the passes' unit tests read them).
#[cfg(test)]
pub fn call_targets(g: &Graph) -> Vec<&str> {
    g.nodes
        .iter()
        .filter_map(|n| match &n.kind {
            NodeKind::Call { target, .. } => Some(target.name()),
            NodeKind::Placeholder => None,
        })
        .collect()
}

/// Contiguous tensor metadata.
pub fn dense_meta(shape: &[i64], dtype: DType, device: Device) -> Meta {
    Meta::Tensor(TensorMeta { shape: shape.to_vec(), stride: contiguous_strides(shape), storage_offset: 0, dtype, device })
}

/// The shape two shapes broadcast to, or None.
pub fn broadcast(a: &[i64], b: &[i64]) -> Option<Vec<i64>> {
    let n = a.len().max(b.len());
    let at = |s: &[i64], i: usize| if i + s.len() >= n { s[i + s.len() - n] } else { 1 };
    (0..n)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}
