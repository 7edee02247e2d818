//! A joint training graph (forward and backward traced as one graph) cut in two: which forward
//! values the forward saves for the backward, and so which ones the backward recomputes.
//! `python/ferrocore/joint_split.py` cuts the FX graph where this module says.
//!
//! The saved values are a minimum cut of a flow network over the values the forward can
//! compute. Each value is an edge `in -> out` whose capacity is what saving it costs: its
//! bytes, twice that where its users would otherwise fuse it away. The source feeds the values
//! the forward must compute and the backward may not recompute: the inputs, values that do not
//! fuse (`lowering::fusion_of`: library calls such as matmuls and convolutions, seeded random
//! ops), reductions that shrink their input, values a backward op that does not fuse reads, and
//! one value in every hundred of a long fusible chain. The sink takes every value the backward
//! reads. Saving costs more the farther a value lies from the backward, so of two equal cuts the
//! one the backward reads directly wins. Cheap values on the sink's side (pointwise chains,
//! views, gathers) are recomputed in the backward, where they fuse into its kernels.

use crate::graph::{Arg, Graph, Meta, NodeId, NodeKind, Target};
use crate::lowering::{collect_refs, fusion_of, Fusion};
use crate::min_cut;
use serde::Deserialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::fmt;

/// What the graph's text does not say about its parts.
#[derive(Clone, Debug, Deserialize)]
pub struct JointFacts {
    /// Inputs `0..primals` are the forward's, the next `tangents` the backward's incoming
    /// gradients; any after them are lifted constants.
    pub primals: usize,
    pub tangents: usize,
    /// Outputs `0..user_outputs` are the forward's results, the rest the primals' gradients.
    pub user_outputs: usize,
    /// Primal positions that cost nothing to save (parameters and buffers, alive anyway).
    pub free_inputs: Vec<usize>,
    /// Primal positions the forward writes into (the backward cannot read their old value).
    pub written: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum JointError {
    /// The backward reads the old value of an input the forward writes into.
    ReadsWrittenInput(String),
    /// The facts do not fit the graph.
    Malformed(String),
}

impl fmt::Display for JointError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            JointError::ReadsWrittenInput(name) => write!(f, "the backward reads input {name}, which the forward writes into"),
            JointError::Malformed(why) => write!(f, "malformed joint graph: {why}"),
        }
    }
}

/// A chain of fusible forward values longer than this (in forward order) is cut by a saved value:
/// the backward would otherwise recompute a model-long chain (a residual stream, a post-norm
/// model's normalized activations) from the values beside it, in one huge kernel.
const LONGEST_CHAIN: usize = 100;
/// Saving a value costs this factor more per step it lies from the backward (up to `FARTHEST`
/// steps), so that of two equal cuts the one the backward reads directly wins.
const DISTANCE_COST: f64 = 1.1;
const FARTHEST: usize = 100;

/// The graph's structure as the cut needs it.
struct Joint<'g> {
    graph: &'g Graph,
    users: Vec<Vec<NodeId>>,
    /// Read by the graph's outputs.
    returned: Vec<bool>,
    /// Needed to compute the forward's results and input writes.
    forward_needs: Vec<bool>,
    /// Lifted constants (inputs after the tangents).
    constant: Vec<bool>,
}

/// The forward values the backward loads, in graph order.
pub fn saved_values(graph: &Graph, facts: &JointFacts) -> Result<Vec<NodeId>, JointError> {
    let inputs = &graph.inputs;
    if facts.primals + facts.tangents > inputs.len() || facts.user_outputs > graph.outputs.len() {
        return Err(JointError::Malformed(format!(
            "{} primals and {} tangents of {} inputs, {} user outputs of {}",
            facts.primals,
            facts.tangents,
            inputs.len(),
            facts.user_outputs,
            graph.outputs.len()
        )));
    }
    let primal =
        |i: &usize| inputs.get(*i).copied().filter(|_| *i < facts.primals).ok_or_else(|| JointError::Malformed(format!("no primal {i}")));
    let free: HashSet<NodeId> = facts.free_inputs.iter().map(primal).collect::<Result<_, _>>()?;
    let written: HashSet<NodeId> = facts.written.iter().map(primal).collect::<Result<_, _>>()?;
    let j = Joint::new(graph, facts);
    let n = graph.nodes.len();
    let tangents = &inputs[facts.primals..facts.primals + facts.tangents];
    let backward = j.descendants(tangents);
    let computable: Vec<NodeId> = graph
        .ids()
        .filter(|id| !backward[id.0 as usize] && !matches!(j.target(*id), Some(Target::Aten(crate::graph::AtenOp::CopyInto))))
        .collect();
    let mut index = vec![usize::MAX; n];
    for (i, id) in computable.iter().enumerate() {
        index[id.0 as usize] = i;
    }
    let mut read_by_backward = vec![false; n];
    for id in graph.ids().filter(|id| backward[id.0 as usize]) {
        for a in j.inputs_of(id) {
            read_by_backward[a.0 as usize] |= index[a.0 as usize] != usize::MAX;
        }
    }
    for g in refs(&graph.outputs[facts.user_outputs..]) {
        read_by_backward[g.0 as usize] |= index[g.0 as usize] != usize::MAX;
    }
    if let Some(w) = written.iter().find(|w| read_by_backward[w.0 as usize]) {
        return Err(JointError::ReadsWrittenInput(graph.node(*w).name.clone()));
    }
    let banned = j.banned(&computable);
    let distance = j.distances();
    let (source, sink) = (0u32, 1u32);
    let vin = |id: NodeId| 2 + 2 * index[id.0 as usize] as u32;
    let vout = |id: NodeId| 3 + 2 * index[id.0 as usize] as u32;
    let mut edges = Vec::new();
    for &id in &computable {
        let weight = if written.contains(&id) {
            min_cut::INFINITE
        } else if free.contains(&id) {
            0
        } else {
            j.weight(id, distance[id.0 as usize])
        };
        edges.push((vin(id), vout(id), weight));
        for a in j.inputs_of(id) {
            if index[a.0 as usize] != usize::MAX {
                edges.push((vout(a), vin(id), min_cut::INFINITE));
            }
        }
        if matches!(graph.node(id).kind, NodeKind::Placeholder) || banned[id.0 as usize] {
            edges.push((source, vin(id), min_cut::INFINITE));
        }
        if read_by_backward[id.0 as usize] {
            edges.push((vout(id), sink, min_cut::INFINITE));
        }
    }
    let side = min_cut::source_side(2 + 2 * computable.len(), &edges, source as usize, sink as usize).map_err(JointError::Malformed)?;
    Ok(computable.into_iter().filter(|&id| side[vin(id) as usize] && !side[vout(id) as usize]).collect())
}

fn refs(args: &[Arg]) -> Vec<NodeId> {
    let mut out = Vec::new();
    args.iter().for_each(|a| collect_refs(a, &mut out));
    out
}

impl<'g> Joint<'g> {
    fn new(graph: &'g Graph, facts: &JointFacts) -> Joint<'g> {
        let n = graph.nodes.len();
        let mut returned = vec![false; n];
        for r in refs(&graph.outputs) {
            returned[r.0 as usize] = true;
        }
        let mut constant = vec![false; n];
        for id in &graph.inputs[facts.primals + facts.tangents..] {
            constant[id.0 as usize] = true;
        }
        let mut j = Joint { graph, users: graph.users(), returned, forward_needs: vec![false; n], constant };
        let copies = graph.ids().filter(|id| matches!(j.target(*id), Some(Target::Aten(crate::graph::AtenOp::CopyInto))));
        let roots: Vec<NodeId> = refs(&graph.outputs[..facts.user_outputs]).into_iter().chain(copies).collect();
        j.forward_needs = j.ancestors(&roots);
        j
    }

    fn target(&self, id: NodeId) -> Option<&'g Target> {
        match &self.graph.node(id).kind {
            NodeKind::Call { target, .. } => Some(target),
            NodeKind::Placeholder => None,
        }
    }

    /// The nodes `id` reads, each once.
    fn inputs_of(&self, id: NodeId) -> Vec<NodeId> {
        let mut out = Vec::new();
        if let NodeKind::Call { args, kwargs, .. } = &self.graph.node(id).kind {
            args.iter().chain(kwargs.iter().map(|(_, a)| a)).for_each(|a| collect_refs(a, &mut out));
        }
        let mut seen = HashSet::new();
        out.retain(|r| seen.insert(*r));
        out
    }

    fn descendants(&self, roots: &[NodeId]) -> Vec<bool> {
        let mut found = vec![false; self.graph.nodes.len()];
        roots.iter().for_each(|r| found[r.0 as usize] = true);
        for id in self.graph.ids() {
            if !found[id.0 as usize] && self.inputs_of(id).iter().any(|a| found[a.0 as usize]) {
                found[id.0 as usize] = true;
            }
        }
        found
    }

    fn ancestors(&self, roots: &[NodeId]) -> Vec<bool> {
        let mut found = vec![false; self.graph.nodes.len()];
        let mut stack = roots.to_vec();
        while let Some(id) = stack.pop() {
            if !std::mem::replace(&mut found[id.0 as usize], true) {
                stack.extend(self.inputs_of(id));
            }
        }
        found
    }

    fn fusion(&self, id: NodeId) -> Option<Fusion> {
        self.target(id).map(fusion_of)
    }

    /// Whether the kernels fuse the value with its neighbours (placeholders do not).
    fn fusible(&self, id: NodeId) -> bool {
        self.fusion(id).is_some_and(Fusion::fuses)
    }

    fn is_view(&self, id: NodeId) -> bool {
        self.fusion(id) == Some(Fusion::View)
    }

    fn bytes(&self, id: NodeId) -> i64 {
        match &self.graph.node(id).meta {
            Meta::Tensor(t) => t.numel() * t.dtype.itemsize() as i64,
            _ => 0,
        }
    }

    /// Whether the backward may recompute the value instead of loading it: a lifted constant or
    /// a fusible value, but a reduction only where it does not shrink its input much.
    fn recomputable(&self, id: NodeId) -> bool {
        match self.fusion(id) {
            None => self.constant[id.0 as usize],
            Some(Fusion::Reduction) => 4 * self.bytes(id) >= self.inputs_of(id).iter().map(|a| self.bytes(*a)).sum::<i64>(),
            Some(f) => f.fuses(),
        }
    }

    /// Whether a backward op that does not fuse it (a matmul, a convolution, the graph's output)
    /// reads the value, directly or through views.
    fn materialized_in_backward(&self, id: NodeId) -> bool {
        if self.is_view(id) {
            return false;
        }
        let mut frontier = vec![id];
        let mut seen = HashSet::from([id]);
        while let Some(cur) = frontier.pop() {
            if self.returned[cur.0 as usize] {
                return true;
            }
            for &u in &self.users[cur.0 as usize] {
                if !self.forward_needs[u.0 as usize] && !self.fusible(u) {
                    return true;
                }
                if self.is_view(u) && seen.insert(u) {
                    frontier.push(u);
                }
            }
        }
        false
    }

    /// Forward values the backward may not recompute: those dearer to recompute than to load,
    /// those the backward must write to memory anyway (an op there that does not fuse reads
    /// them, so recomputing adds a write and a read), and breaks in long fusible chains.
    fn banned(&self, computable: &[NodeId]) -> Vec<bool> {
        let n = self.graph.nodes.len();
        let mut banned = vec![false; n];
        let needed: Vec<NodeId> = computable.iter().copied().filter(|id| self.forward_needs[id.0 as usize]).collect();
        for &id in &needed {
            banned[id.0 as usize] = !self.recomputable(id) || self.materialized_in_backward(id);
        }
        let mut order = vec![usize::MAX; n];
        for (i, id) in needed.iter().enumerate() {
            order[id.0 as usize] = i;
        }
        let mut visited = vec![false; n];
        for &start in &needed {
            // walk the fusible values downstream of `start` in forward order; where the walk has
            // narrowed to one value LONGEST_CHAIN past the start, that value is saved
            let first = order[start.0 as usize];
            let mut frontier = BinaryHeap::from([Reverse((first, start))]);
            while let Some(Reverse((at, cur))) = frontier.pop() {
                if std::mem::replace(&mut visited[cur.0 as usize], true) {
                    continue;
                }
                if at > first + LONGEST_CHAIN && frontier.is_empty() {
                    if !self.is_view(cur) {
                        banned[cur.0 as usize] = true;
                    }
                    break;
                }
                if !self.fusible(cur) {
                    continue;
                }
                for &u in &self.users[cur.0 as usize] {
                    if order[u.0 as usize] != usize::MAX && !banned[u.0 as usize] && self.fusible(u) {
                        frontier.push(Reverse((order[u.0 as usize], u)));
                    }
                }
            }
        }
        banned
    }

    /// Per node, how many steps its nearest backward reader lies ahead (0 for values the
    /// forward does not need).
    fn distances(&self) -> Vec<usize> {
        const FAR: usize = 1_000_000_000;
        let mut distance = vec![0; self.graph.nodes.len()];
        for id in self.graph.ids().rev() {
            if self.forward_needs[id.0 as usize] {
                let nearest = self.users[id.0 as usize].iter().map(|u| distance[u.0 as usize] + 1).min();
                let returned = self.returned[id.0 as usize].then_some(FAR + 1);
                distance[id.0 as usize] = nearest.into_iter().chain(returned).min().unwrap_or(FAR);
            }
        }
        distance
    }

    /// What saving the value costs: its bytes, doubled where its users would fuse it away (it
    /// would not be written to memory otherwise), and more the farther it lies from the backward;
    /// views and non-tensors are never saved.
    fn weight(&self, id: NodeId, distance: usize) -> i64 {
        if !matches!(self.graph.node(id).meta, Meta::Tensor(_)) || self.is_view(id) {
            return min_cut::INFINITE;
        }
        let steps = distance.clamp(1, FARTHEST) as f64;
        let size = (self.bytes(id).max(1) as f64 * DISTANCE_COST.powf(steps)) as i64;
        let placeholder = matches!(self.graph.node(id).kind, NodeKind::Placeholder) && !self.constant[id.0 as usize];
        let materialized = placeholder
            || !self.recomputable(id)
            || self.returned[id.0 as usize]
            || self.users[id.0 as usize].iter().any(|u| !self.fusible(*u));
        (if materialized { size } else { 2 * size }).min(min_cut::INFINITE / 1024)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::build::{f32, node, GraphBuilder};
    use crate::graph::parse_graph;

    fn facts(primals: usize, tangents: usize, user_outputs: usize) -> JointFacts {
        JointFacts { primals, tangents, user_outputs, free_inputs: vec![], written: vec![] }
    }

    fn saved(doc: &str, facts: &JointFacts) -> Vec<String> {
        let g = parse_graph(doc).unwrap();
        saved_values(&g, facts).unwrap().into_iter().map(|id| g.node(id).name.clone()).collect()
    }

    /// y = exp(x) * exp(x); the backward reads exp(x).
    fn exp_square() -> String {
        GraphBuilder::new()
            .input("x", &[64, 64], "float32")
            .input("t", &[64, 64], "float32")
            .call("e", "aten.exp.default", &[node("x")], &f32(&[64, 64]))
            .call("y", "aten.mul.Tensor", &[node("e"), node("e")], &f32(&[64, 64]))
            .call("g0", "aten.mul.Tensor", &[node("t"), node("e")], &f32(&[64, 64]))
            .call("g", "aten.mul.Tensor", &[node("g0"), node("e")], &f32(&[64, 64]))
            .output(&["y", "g"])
    }

    #[test]
    fn a_pointwise_value_is_recomputed_from_the_input_it_fuses_from() {
        // saving x costs its bytes; saving e twice that (its users would fuse it away)
        assert_eq!(saved(&exp_square(), &facts(1, 1, 1)), ["x"]);
    }

    #[test]
    fn a_user_output_is_saved_only_where_the_backward_reads_it() {
        let s = saved(&exp_square(), &facts(1, 1, 1));
        assert!(!s.contains(&"y".to_string()), "{s:?}");
    }

    #[test]
    fn a_matmul_result_the_backward_reads_is_saved_not_recomputed() {
        let doc = GraphBuilder::new()
            .input("x", &[64, 64], "float32")
            .input("w", &[64, 64], "float32")
            .input("t", &[64, 64], "float32")
            .call("mm", "aten.mm.default", &[node("x"), node("w")], &f32(&[64, 64]))
            .call("r", "aten.relu.default", &[node("mm")], &f32(&[64, 64]))
            .call("g", "aten.mul.Tensor", &[node("t"), node("mm")], &f32(&[64, 64]))
            .output(&["r", "g"]);
        assert_eq!(saved(&doc, &facts(2, 1, 1)), ["mm"]);
        // parameters cost nothing to save: the cut takes them too, at no cost
        let free = JointFacts { free_inputs: vec![0, 1], ..facts(2, 1, 1) };
        assert_eq!(saved(&doc, &free), ["x", "w", "mm"]);
    }

    #[test]
    fn a_backward_reading_an_input_the_forward_writes_into_is_an_error() {
        let doc = GraphBuilder::new()
            .input("x", &[8], "float32")
            .input("t", &[8], "float32")
            .call("s", "aten.sin.default", &[node("x")], &f32(&[8]))
            .call("c", "aten.copy_.default", &[node("x"), node("s")], &f32(&[8]))
            .call("g", "aten.mul.Tensor", &[node("t"), node("x")], &f32(&[8]))
            .output(&["s", "g"]);
        let g = parse_graph(&doc).unwrap();
        let written = JointFacts { written: vec![0], ..facts(1, 1, 1) };
        assert_eq!(saved_values(&g, &written), Err(JointError::ReadsWrittenInput("x".into())));
    }

    #[test]
    fn facts_that_do_not_fit_the_graph_are_an_error() {
        let g = parse_graph(&exp_square()).unwrap();
        assert!(matches!(saved_values(&g, &facts(2, 1, 1)), Err(JointError::Malformed(_))));
        let bad_free = JointFacts { free_inputs: vec![1], ..facts(1, 1, 1) };
        assert!(matches!(saved_values(&g, &bad_free), Err(JointError::Malformed(_))));
    }
}
