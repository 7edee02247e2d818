//! Rewrites taken while the front traces a training graph (`python/ferrocore/traced_attention.py`).
//! A training graph's backward is traced from the ops its forward ran, so a forward pattern
//! replaced after the trace would keep the backward of what it replaced: written-out
//! attention's saved probabilities and its softmax backward. Before the trace goes past a
//! matmul, the front hands over the ops that computed its result (a graph returning it); when
//! they are attention (`attention`, after the decomposed softmax is folded back), the answer is
//! the new ops that compute the same value with the fused call. The front runs them in place of
//! the matmul's result, so autograd records the fused call and its backward; the ops they
//! replace are left unread and dropped.

use super::*;
use serde_json::{json, Value};

/// The new ops that compute a graph's output with a fused call, in order, and the one whose
/// value is the output (exchange-format names and arguments; old nodes are named as in the
/// graph given).
#[derive(Debug)]
pub struct Replacement {
    pub nodes: Vec<Value>,
    pub output: String,
}

/// The replacement for the value `g` returns (its one output) when it is written-out attention
/// the `attention` pass fuses, with the pass's lines; None when it is not. `triton_kernels`: the
/// graph's loops are Triton kernels (ferrocore's attention kernel, forward and backward, may run
/// it).
pub fn attention_in_trace(g: Graph, cuda_arch: u32, triton_kernels: bool) -> (Option<Replacement>, Vec<String>) {
    let old: HashSet<String> = g.nodes.iter().map(|n| n.name.clone()).collect();
    let g = fold_softmax(g);
    let [Arg::Node(root)] = g.outputs.as_slice() else { return (None, vec!["the graph returns no one value".into()]) };
    let root = *root;
    // only the attention that computes the output: one earlier in the graph was decided when
    // its own matmul was traced
    let Some(softmax) = nearest_softmax(&g, root) else { return (None, Vec::new()) };
    let options = PassOptions { cuda_arch, differentiable: true, triton_kernels, ..Default::default() };
    let (fused, decisions) = attention::fuse_attention_at(g, &options, Some((softmax, root)));
    let [Arg::Node(out)] = fused.outputs.as_slice() else { return (None, decisions) };
    if old.contains(&fused.node(*out).name) {
        return (None, decisions);
    }
    let nodes = fused.nodes.iter().filter(|n| !old.contains(&n.name)).map(|n| node_json(&fused, n)).collect();
    (Some(Replacement { nodes, output: fused.node(*out).name.clone() }), decisions)
}

/// The softmax fewest ops before `root` (reading back through every argument), if any.
fn nearest_softmax(g: &Graph, root: NodeId) -> Option<NodeId> {
    let mut seen = HashSet::from([root]);
    let mut level = vec![root];
    while !level.is_empty() {
        if let Some(&s) = level.iter().find(|&&id| matches!(call(g, id), Some((AtenOp::Softmax, _, _)))) {
            return Some(s);
        }
        let mut next = Vec::new();
        for id in level {
            let Some((_, args, _)) = call(g, id) else { continue };
            for a in args {
                if let Arg::Node(n) = a {
                    if seen.insert(*n) {
                        next.push(*n);
                    }
                }
            }
        }
        level = next;
    }
    None
}

/// The graph with softmaxes that the decomposition table wrote out (`div(exp(x - amax(x, d)),
/// sum(exp(..), d))`, each over one dim with kept dims) as `_softmax` again.
pub fn fold_softmax(g: Graph) -> Graph {
    let uses = g.use_counts();
    let mut edit = GraphEdit::new(&g);
    for id in g.ids() {
        let Some((AtenOp::DivTensor, args, _)) = call(&g, id) else { continue };
        let (Some(Arg::Node(e)), Some(Arg::Node(s))) = (args.first(), args.get(1)) else { continue };
        let Some((x, dim, dead)) = softmax_parts(&g, *e, *s) else { continue };
        if dead.iter().any(|d| uses[d.0 as usize] != if *d == *e { 2 } else { 1 }) {
            continue;
        }
        let first = edit.mark();
        let node = Node {
            name: "softmax".into(),
            kind: NodeKind::Call {
                target: Target::Aten(AtenOp::Softmax),
                args: vec![Arg::Node(x), Arg::Int(dim), Arg::Bool(false)],
                kwargs: vec![],
            },
            meta: g.node(id).meta.clone(),
        };
        let by = edit.push(&g, id, node);
        edit.replace(id, first, by, dead);
    }
    edit.finish(g, Vec::new()).0
}

/// `(x, dim, the nodes between)` when `exp` is `exp(x - amax(x, [dim], true))` and `sum` is
/// `sum(exp, [dim], true)`.
fn softmax_parts(g: &Graph, exp: NodeId, sum: NodeId) -> Option<(NodeId, i64, Vec<NodeId>)> {
    let one_dim = |a: Option<&Arg>| match a {
        Some(Arg::List(d)) if d.len() == 1 => match d[0] {
            Arg::Int(i) => Some(i),
            _ => None,
        },
        _ => None,
    };
    let (AtenOp::Exp, ea, _) = call(g, exp)? else { return None };
    let Some(Arg::Node(sub)) = ea.first() else { return None };
    let (AtenOp::SubTensor, sa, skw) = call(g, *sub)? else { return None };
    let (Some(Arg::Node(x)), Some(Arg::Node(max))) = (sa.first(), sa.get(1)) else { return None };
    if !skw.is_empty() {
        return None;
    }
    let (AtenOp::Amax, ma, _) = call(g, *max)? else { return None };
    let (AtenOp::SumDimIntList, ra, rkw) = call(g, sum)? else { return None };
    let rank = g.node(*x).meta.tensor()?.shape.len() as i64;
    let dim = one_dim(ma.get(1))?.rem_euclid(rank.max(1));
    let kept = |a: Option<&Arg>| matches!(a, Some(Arg::Bool(true)));
    let same_dtype = rkw.iter().all(|(_, a)| matches!(a, Arg::None));
    let ok = ma.first() == Some(&Arg::Node(*x))
        && kept(ma.get(2))
        && ra.first() == Some(&Arg::Node(exp))
        && one_dim(ra.get(1)).map(|d| d.rem_euclid(rank.max(1))) == Some(dim)
        && kept(ra.get(2))
        && same_dtype;
    ok.then(|| (*x, dim, vec![exp, *sub, *max, sum]))
}

fn node_json(g: &Graph, n: &Node) -> Value {
    let NodeKind::Call { target, args, kwargs } = &n.kind else { return json!({ "name": n.name }) };
    let kwargs: serde_json::Map<String, Value> = kwargs.iter().map(|(k, a)| (k.clone(), arg_json(g, a))).collect();
    json!({
        "name": n.name,
        "target": target.name(),
        "args": args.iter().map(|a| arg_json(g, a)).collect::<Vec<_>>(),
        "kwargs": kwargs,
    })
}

/// An argument in the exchange format (`python/ferrocore/serialize.py` writes the same).
fn arg_json(g: &Graph, a: &Arg) -> Value {
    match a {
        Arg::None => Value::Null,
        Arg::Node(id) => json!({ "node": g.node(*id).name }),
        Arg::Int(i) => json!({ "int": i }),
        Arg::Float(x) if x.is_nan() => json!({ "float": "nan" }),
        Arg::Float(x) if x.is_infinite() => json!({ "float": if *x > 0.0 { "inf" } else { "-inf" } }),
        Arg::Float(x) => json!({ "float": x }),
        Arg::Bool(b) => json!({ "bool": b }),
        Arg::Str(s) => json!({ "str": s }),
        Arg::List(items) => json!({ "list": items.iter().map(|x| arg_json(g, x)).collect::<Vec<_>>() }),
        Arg::DType(d) => json!({ "dtype": d.torch_name() }),
        Arg::Device(d) => json!({ "device": d.to_string() }),
        Arg::Layout(l) => json!({ "layout": l }),
        Arg::MemoryFormat(f) => json!({ "memory_format": f }),
    }
}

#[cfg(test)]
mod tests;
