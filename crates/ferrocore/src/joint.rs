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

use crate::graph::{AtenOp, Target};
use crate::lowering::{fusion_of, Fusion};
use crate::min_cut;
use serde::Deserialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::fmt;

/// A joint graph as the cut sees it: each value's op, what it reads and its bytes, in graph
/// order (the front writes it from the FX graph: `joint_split.py`).
#[derive(Clone, Debug, Deserialize)]
pub struct JointGraph {
    pub nodes: Vec<JointNode>,
    /// The graph's outputs, the forward's results then the primals' gradients (None where an
    /// output is no value).
    pub outputs: Vec<Option<usize>>,
    /// Outputs `0..user_outputs` are the forward's results.
    pub user_outputs: usize,
    /// Inputs `0..primals` (in graph order, lifted constants aside) are the forward's, the
    /// rest the backward's incoming gradients (tangents).
    pub primals: usize,
    /// Primal positions that cost nothing to save (parameters and buffers, alive anyway).
    pub free_inputs: Vec<usize>,
    /// Primal positions the forward writes into (the backward cannot read their old value).
    pub written: Vec<usize>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct JointNode {
    /// The op (`aten.add.Tensor`, `getitem`); None for an input.
    pub target: Option<String>,
    /// The values it reads (positions in `JointGraph::nodes`), each once.
    pub inputs: Vec<usize>,
    /// Its tensor's bytes; None where it is no tensor.
    pub bytes: Option<i64>,
    /// A lifted constant: an input that is neither a primal nor a tangent.
    #[serde(default)]
    pub constant: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum JointError {
    /// The backward reads the old value of an input the forward writes into (its position).
    ReadsWrittenInput(usize),
    /// The description does not hold together.
    Malformed(String),
}

impl fmt::Display for JointError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            JointError::ReadsWrittenInput(i) => write!(f, "the backward reads input {i}, which the forward writes into"),
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
const NONE: usize = usize::MAX;

/// The graph's structure as the cut needs it (nodes by position).
struct Joint<'g> {
    nodes: &'g [JointNode],
    /// Each node's op (None for inputs), parsed once.
    targets: Vec<Option<Target>>,
    users: Vec<Vec<usize>>,
    /// Read by the graph's outputs.
    returned: Vec<bool>,
    /// Needed to compute the forward's results and input writes.
    forward_needs: Vec<bool>,
}

/// The forward values the backward loads (positions, in graph order).
pub fn saved_values(g: &JointGraph) -> Result<Vec<usize>, JointError> {
    let j = Joint::new(g)?;
    let n = g.nodes.len();
    let inputs: Vec<usize> = (0..n).filter(|&i| g.nodes[i].target.is_none() && !g.nodes[i].constant).collect();
    if g.primals > inputs.len() || g.user_outputs > g.outputs.len() {
        return Err(JointError::Malformed(format!(
            "{} primals of {} inputs, {} user outputs of {}",
            g.primals,
            inputs.len(),
            g.user_outputs,
            g.outputs.len()
        )));
    }
    let primal =
        |i: &usize| inputs.get(*i).copied().filter(|_| *i < g.primals).ok_or_else(|| JointError::Malformed(format!("no primal {i}")));
    let free: HashSet<usize> = g.free_inputs.iter().map(primal).collect::<Result<_, _>>()?;
    let written: HashSet<usize> = g.written.iter().map(primal).collect::<Result<_, _>>()?;
    let backward = j.descendants(&inputs[g.primals..]);
    let computable: Vec<usize> = (0..n).filter(|&i| !backward[i] && !j.is_copy_into(i)).collect();
    let mut index = vec![NONE; n];
    for (k, &i) in computable.iter().enumerate() {
        index[i] = k;
    }
    let mut read_by_backward = vec![false; n];
    for i in (0..n).filter(|&i| backward[i]) {
        for &a in &g.nodes[i].inputs {
            read_by_backward[a] |= index[a] != NONE;
        }
    }
    for &grad in g.outputs[g.user_outputs..].iter().flatten() {
        read_by_backward[grad] |= index[grad] != NONE;
    }
    if let Some(w) = g.written.iter().find(|&&w| read_by_backward[inputs[w]]) {
        return Err(JointError::ReadsWrittenInput(*w));
    }
    let banned = j.banned(&computable);
    let distance = j.distances();
    let (source, sink) = (0u32, 1u32);
    let vin = |i: usize| 2 + 2 * index[i] as u32;
    let vout = |i: usize| 3 + 2 * index[i] as u32;
    let mut edges = Vec::new();
    for &i in &computable {
        let weight = if written.contains(&i) {
            min_cut::INFINITE
        } else if free.contains(&i) {
            0
        } else {
            j.weight(i, distance[i])
        };
        edges.push((vin(i), vout(i), weight));
        for &a in &g.nodes[i].inputs {
            if index[a] != NONE {
                edges.push((vout(a), vin(i), min_cut::INFINITE));
            }
        }
        if g.nodes[i].target.is_none() || banned[i] {
            edges.push((source, vin(i), min_cut::INFINITE));
        }
        if read_by_backward[i] {
            edges.push((vout(i), sink, min_cut::INFINITE));
        }
    }
    let side = min_cut::source_side(2 + 2 * computable.len(), &edges, source as usize, sink as usize).map_err(JointError::Malformed)?;
    Ok(computable.into_iter().filter(|&i| side[vin(i) as usize] && !side[vout(i) as usize]).collect())
}

impl<'g> Joint<'g> {
    fn new(g: &'g JointGraph) -> Result<Joint<'g>, JointError> {
        let n = g.nodes.len();
        let targets = g
            .nodes
            .iter()
            .map(|node| {
                node.target
                    .as_deref()
                    .map(|t| Target::from_name(t).ok_or_else(|| JointError::Malformed(format!("target '{t}' is not an operator name"))))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut users = vec![Vec::new(); n];
        for (i, node) in g.nodes.iter().enumerate() {
            for &a in &node.inputs {
                if a >= i {
                    return Err(JointError::Malformed(format!("node {i} reads node {a}, not an earlier one")));
                }
                users[a].push(i);
            }
        }
        let mut returned = vec![false; n];
        for &o in g.outputs.iter().flatten() {
            *returned.get_mut(o).ok_or_else(|| JointError::Malformed(format!("no node {o} to return")))? = true;
        }
        let mut j = Joint { nodes: &g.nodes, targets, users, returned, forward_needs: vec![false; n] };
        let copies = (0..n).filter(|&i| j.is_copy_into(i));
        let roots: Vec<usize> = g.outputs[..g.user_outputs.min(g.outputs.len())].iter().flatten().copied().chain(copies).collect();
        j.forward_needs = j.ancestors(&roots);
        Ok(j)
    }

    fn is_copy_into(&self, i: usize) -> bool {
        matches!(self.targets[i], Some(Target::Aten(AtenOp::CopyInto)))
    }

    fn descendants(&self, roots: &[usize]) -> Vec<bool> {
        let mut found = vec![false; self.nodes.len()];
        roots.iter().for_each(|&r| found[r] = true);
        for i in 0..self.nodes.len() {
            if !found[i] && self.nodes[i].inputs.iter().any(|&a| found[a]) {
                found[i] = true;
            }
        }
        found
    }

    fn ancestors(&self, roots: &[usize]) -> Vec<bool> {
        let mut found = vec![false; self.nodes.len()];
        let mut stack = roots.to_vec();
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut found[i], true) {
                stack.extend(&self.nodes[i].inputs);
            }
        }
        found
    }

    fn fusion(&self, i: usize) -> Option<Fusion> {
        self.targets[i].as_ref().map(fusion_of)
    }

    /// Whether the kernels fuse the value with its neighbours (inputs do not).
    fn fusible(&self, i: usize) -> bool {
        self.fusion(i).is_some_and(Fusion::fuses)
    }

    fn is_view(&self, i: usize) -> bool {
        self.fusion(i) == Some(Fusion::View)
    }

    fn bytes(&self, i: usize) -> i64 {
        self.nodes[i].bytes.unwrap_or(0)
    }

    /// Whether the backward may recompute the value instead of loading it: a lifted constant or
    /// a fusible value, but a reduction only where it does not shrink its input much.
    fn recomputable(&self, i: usize) -> bool {
        match self.fusion(i) {
            None => self.nodes[i].constant,
            Some(Fusion::Reduction) => 4 * self.bytes(i) >= self.nodes[i].inputs.iter().map(|&a| self.bytes(a)).sum::<i64>(),
            Some(f) => f.fuses(),
        }
    }

    /// Whether a backward op that does not fuse it (a matmul, a convolution, the graph's output)
    /// reads the value, directly or through views (a template computes what it reads inline).
    fn materialized_in_backward(&self, i: usize) -> bool {
        if self.is_view(i) {
            return false;
        }
        let mut frontier = vec![i];
        let mut seen = HashSet::from([i]);
        while let Some(cur) = frontier.pop() {
            if self.returned[cur] {
                return true;
            }
            for &u in &self.users[cur] {
                if !self.forward_needs[u] && !self.fusible(u) && self.fusion(u) != Some(Fusion::Template) {
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
    fn banned(&self, computable: &[usize]) -> Vec<bool> {
        let n = self.nodes.len();
        let mut banned = vec![false; n];
        let needed: Vec<usize> = computable.iter().copied().filter(|&i| self.forward_needs[i]).collect();
        for &i in &needed {
            banned[i] = !self.recomputable(i) || self.materialized_in_backward(i);
        }
        let mut order = vec![NONE; n];
        for (k, &i) in needed.iter().enumerate() {
            order[i] = k;
        }
        let mut visited = vec![false; n];
        for &start in &needed {
            // walk the fusible values downstream of `start` in forward order; where the walk has
            // narrowed to one value LONGEST_CHAIN past the start, that value is saved
            let first = order[start];
            let mut frontier = BinaryHeap::from([Reverse((first, start))]);
            while let Some(Reverse((at, cur))) = frontier.pop() {
                if std::mem::replace(&mut visited[cur], true) {
                    continue;
                }
                if at > first + LONGEST_CHAIN && frontier.is_empty() {
                    if !self.is_view(cur) {
                        banned[cur] = true;
                    }
                    break;
                }
                if !self.fusible(cur) {
                    continue;
                }
                for &u in &self.users[cur] {
                    if order[u] != NONE && !banned[u] && self.fusible(u) {
                        frontier.push(Reverse((order[u], u)));
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
        let mut distance = vec![0; self.nodes.len()];
        for i in (0..self.nodes.len()).rev() {
            if self.forward_needs[i] {
                let nearest = self.users[i].iter().map(|&u| distance[u] + 1).min();
                let returned = self.returned[i].then_some(FAR + 1);
                distance[i] = nearest.into_iter().chain(returned).min().unwrap_or(FAR);
            }
        }
        distance
    }

    /// What saving the value costs: its bytes, doubled where its users would fuse it away (it
    /// would not be written to memory otherwise), and more the farther it lies from the backward;
    /// views and non-tensors are never saved.
    fn weight(&self, i: usize, distance: usize) -> i64 {
        let Some(bytes) = self.nodes[i].bytes else { return min_cut::INFINITE };
        if self.is_view(i) {
            return min_cut::INFINITE;
        }
        let steps = distance.clamp(1, FARTHEST) as f64;
        let size = (bytes.max(1) as f64 * DISTANCE_COST.powf(steps)) as i64;
        let input = self.nodes[i].target.is_none() && !self.nodes[i].constant;
        let materialized = input || !self.recomputable(i) || self.returned[i] || self.users[i].iter().any(|&u| !self.fusible(u));
        (if materialized { size } else { 2 * size }).min(min_cut::INFINITE / 1024)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node: `target` (None: an input), the nodes it reads, its bytes.
    fn node(target: Option<&str>, inputs: &[usize], bytes: i64) -> JointNode {
        JointNode { target: target.map(str::to_string), inputs: inputs.to_vec(), bytes: Some(bytes), constant: false }
    }

    fn joint(nodes: Vec<JointNode>, outputs: &[usize], user_outputs: usize, primals: usize) -> JointGraph {
        JointGraph {
            nodes,
            outputs: outputs.iter().map(|&o| Some(o)).collect(),
            user_outputs,
            primals,
            free_inputs: vec![],
            written: vec![],
        }
    }

    /// y = exp(x) * exp(x); the backward reads exp(x): 0 x, 1 t, 2 e, 3 y, 4 g0, 5 g.
    fn exp_square() -> JointGraph {
        let b = 64 * 64 * 4;
        let nodes = vec![
            node(None, &[], b),
            node(None, &[], b),
            node(Some("aten.exp.default"), &[0], b),
            node(Some("aten.mul.Tensor"), &[2], b),
            node(Some("aten.mul.Tensor"), &[1, 2], b),
            node(Some("aten.mul.Tensor"), &[4, 2], b),
        ];
        joint(nodes, &[3, 5], 1, 1)
    }

    #[test]
    fn a_pointwise_value_is_recomputed_from_the_input_it_fuses_from() {
        // saving x costs its bytes; saving e twice that (its users would fuse it away)
        assert_eq!(saved_values(&exp_square()), Ok(vec![0]));
    }

    #[test]
    fn a_user_output_is_saved_only_where_the_backward_reads_it() {
        assert!(!saved_values(&exp_square()).unwrap().contains(&3));
    }

    /// 0 x, 1 w, 2 t, 3 mm, 4 relu(mm), 5 t * mm.
    fn matmul() -> JointGraph {
        let b = 64 * 64 * 4;
        let nodes = vec![
            node(None, &[], b),
            node(None, &[], b),
            node(None, &[], b),
            node(Some("aten.mm.default"), &[0, 1], b),
            node(Some("aten.relu.default"), &[3], b),
            node(Some("aten.mul.Tensor"), &[2, 3], b),
        ];
        joint(nodes, &[4, 5], 1, 2)
    }

    #[test]
    fn a_matmul_result_the_backward_reads_is_saved_not_recomputed() {
        assert_eq!(saved_values(&matmul()), Ok(vec![3]));
        // parameters cost nothing to save: the cut takes them too, at no cost
        let free = JointGraph { free_inputs: vec![0, 1], ..matmul() };
        assert_eq!(saved_values(&free), Ok(vec![0, 1, 3]));
    }

    #[test]
    fn an_attention_bias_from_positions_is_recomputed_for_the_backward_kernels() {
        // 0 q, 1 t, 2 arange, 3 bias = where(..) over [N, N], 4 the fused call, 5 its output,
        // 6 its log-sum-exp, 7 the backward, 8 dq: the kernels compute the bias inline, so the
        // backward recomputes it from the positions, not a saved [N, N] tensor
        let (q, scores) = (1024 * 64 * 2, 1024 * 1024 * 4);
        let nodes = vec![
            node(None, &[], q),
            node(None, &[], q),
            node(Some("aten.arange.default"), &[], 1024 * 8),
            node(Some("aten.where.self"), &[2], scores),
            node(Some("aten._scaled_dot_product_fused_attention_overrideable.default"), &[0, 3], q),
            node(Some("getitem"), &[4], q),
            node(Some("getitem"), &[4], 1024 * 4),
            node(Some("aten._scaled_dot_product_fused_attention_overrideable_backward.default"), &[1, 0, 3, 5, 6], q),
            node(Some("getitem"), &[7], q),
        ];
        let saved = saved_values(&joint(nodes, &[5, 8], 1, 1)).unwrap();
        assert!(!saved.contains(&3), "{saved:?}");
        assert!(saved.contains(&5) && saved.contains(&6), "{saved:?}");
    }

    #[test]
    fn a_backward_reading_an_input_the_forward_writes_into_is_an_error() {
        // 0 x, 1 t, 2 sin(x), 3 x.copy_(sin), 4 t * x
        let nodes = vec![
            node(None, &[], 32),
            node(None, &[], 32),
            node(Some("aten.sin.default"), &[0], 32),
            node(Some("aten.copy_.default"), &[0, 2], 32),
            node(Some("aten.mul.Tensor"), &[1, 0], 32),
        ];
        let g = JointGraph { written: vec![0], ..joint(nodes, &[2, 4], 1, 1) };
        assert_eq!(saved_values(&g), Err(JointError::ReadsWrittenInput(0)));
    }

    #[test]
    fn a_description_that_does_not_hold_together_is_an_error() {
        let malformed = |g: JointGraph| matches!(saved_values(&g), Err(JointError::Malformed(_)));
        assert!(malformed(JointGraph { primals: 3, ..exp_square() }));
        assert!(malformed(JointGraph { free_inputs: vec![1], ..exp_square() }));
        let mut forward_read = exp_square();
        forward_read.nodes[2].inputs = vec![4];
        assert!(malformed(forward_read));
        let mut bad_target = exp_square();
        bad_target.nodes[2].target = Some("exp".into());
        assert!(malformed(bad_target));
    }
}
