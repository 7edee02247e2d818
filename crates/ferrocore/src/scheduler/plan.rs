//! The iteration plan of a fused kernel: one flattened outer loop `x0` (parallel) and, per loop
//! group, nested inner loops over kernel variables `v1..`. Every node's variables are rewritten
//! over these; the plan exists only if every in-kernel read is legal (see `KernelPlan::build`).

use crate::loop_ir::*;
use crate::symbolic::{IndexExpr, Var};
use std::cell::Cell;
use std::collections::HashMap;

#[derive(Clone, Debug)]
pub struct LoopGroup {
    pub inner: Vec<i64>,
    pub reduction: bool,
    pub nodes: Vec<usize>,
}

/// How a kernel reads a buffer that another node of the same kernel writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalRead {
    /// The producer is a reduction of an earlier group: its result is a scalar per `x0`.
    Scalar,
    /// Same group, same index: the value is forwarded in a register.
    Forwarded,
    /// An earlier group stored it at exactly this element in the same `x0` iteration.
    Stored,
}

#[derive(Clone, Debug)]
pub struct KernelNode {
    pub node: usize,
    pub group: usize,
    /// The node rewritten over kernel variables (x0 = Var(0), inner = Var(1..)).
    pub body: LoopBody,
    /// Sizes of kernel variables for this node's group: [N, inner...].
    pub ranges: Vec<i64>,
}

#[derive(Clone, Debug)]
pub struct KernelPlan {
    pub outer: i64,
    pub groups: Vec<LoopGroup>,
    pub nodes: Vec<KernelNode>,
    /// (reader node position, buffer) -> kind, for reads of in-kernel buffers.
    pub local_reads: Vec<(usize, BufferId, LocalRead)>,
}

/// A kernel with a reduction runs one program per outer index, or per few of them where its loops
/// are long (the split pass's count); with fewer programs than this a GPU's multiprocessors
/// mostly idle.
const FEW_PROGRAMS: i64 = 128;
/// Elements a pointwise node may loop over in each program of such a kernel: a loss's scalar
/// reduction once took in Llama's 4M-element embedding output, one program for 4 ms.
const SERIAL_ELEMENTS: i64 = 4096;

/// Where a loop nest splits into outer and inner pieces: the outer pieces, the inner pieces, and
/// per dim (dim, outer part, inner part).
type SplitPoint = (Vec<i64>, Vec<i64>, Vec<(usize, i64, i64)>);

fn split_point(dims: &[i64], n: i64) -> Option<SplitPoint> {
    let mut outer = Vec::new();
    let mut inner = Vec::new();
    let mut parts = Vec::new();
    let mut acc = 1i64;
    if n <= 0 || dims.iter().any(|&d| d <= 0) {
        return None;
    }
    for (j, &d) in dims.iter().enumerate() {
        if d == 1 {
            parts.push((j, 1, 1));
        } else if acc == n {
            inner.push(d);
            parts.push((j, 1, d));
        } else if n % (acc * d) == 0 {
            outer.push(d);
            acc *= d;
            parts.push((j, d, 1));
        } else if n % acc == 0 && (acc * d) % n == 0 {
            let a = n / acc;
            outer.push(a);
            inner.push(d / a);
            acc = n;
            parts.push((j, a, d / a));
        } else {
            return None;
        }
    }
    if acc != n {
        return None;
    }
    Some((outer, inner, parts))
}

/// Substitution for a node with `dims` (its vars 0..) split at `n`, plus its inner sizes.
fn node_subst(dims: &[i64], n: i64, first_inner_var: u32) -> Option<(Vec<Option<IndexExpr>>, Vec<i64>)> {
    let (outer, inner, parts) = split_point(dims, n)?;
    let x0 = IndexExpr::var(Var(0));
    let kranges: Vec<i64> = std::iter::once(n).chain(inner.iter().copied()).collect();
    let (mut outer_pos, mut inner_pos) = (0usize, 0u32);
    let mut subst = vec![None; dims.len()];
    for (j, a, b) in parts {
        let mut e = IndexExpr::zero();
        if a > 1 {
            let stride: i64 = outer[outer_pos + 1..].iter().product();
            let piece = x0.floordiv(stride, &kranges).modulo(a, &kranges);
            outer_pos += 1;
            e = e.add(&piece.scale(b));
        }
        if b > 1 {
            e = e.add(&IndexExpr::var(Var(first_inner_var + inner_pos)));
            inner_pos += 1;
        }
        subst[j] = Some(e);
    }
    Some((subst, inner))
}

impl KernelPlan {
    /// Plans `nodes` (indices into the program, in execution order) as one kernel, or says why
    /// not: iteration spaces that do not line up, or an in-kernel read that would be illegal.
    pub fn build(p: &LoopProgram, nodes: &[usize]) -> Result<KernelPlan, String> {
        PlanBuilder::build(p, nodes, &Cell::new(0)).map(|b| b.plan)
    }
}

/// A kernel plan grown one node at a time. Placing a node costs time in that node's body, not in
/// the kernel's size (a graph of 10,000 small outputs fuses into one kernel, node by node), and
/// the plan built node by node is the plan `KernelPlan::build` makes of the same nodes.
#[derive(Clone, Debug)]
pub(super) struct PlanBuilder {
    plan: KernelPlan,
    /// Per buffer, the positions (in `plan.nodes`) of the nodes that write it.
    writers: HashMap<BufferId, Vec<usize>>,
    /// Per graph input, the positions of the nodes that load it (a later node may write it:
    /// `check_overwrite`).
    readers: HashMap<BufferId, Vec<usize>>,
    /// Whether some node reduces (the outer size is then the reductions' output count).
    reduces: bool,
}

/// One node placed after a plan's nodes, not yet added (`PlanBuilder::push`).
#[derive(Clone, Debug)]
pub(super) struct Placement {
    node: KernelNode,
    inner: Vec<i64>,
    is_red: bool,
    needs_new_group: bool,
    reads_here: Vec<(BufferId, LocalRead)>,
}

/// A plan with one more node: that node's placement, or (when the node changes the kernel's outer
/// loop: the first reduction of a pointwise kernel) a plan rebuilt over all the nodes.
#[derive(Clone, Debug)]
pub(super) enum Joined {
    Appended(Placement),
    Rebuilt(PlanBuilder),
}

impl PlanBuilder {
    /// Plans `nodes`; `placed` counts the nodes placed (the scheduler's measure of its work).
    pub(super) fn build(p: &LoopProgram, nodes: &[usize], placed: &Cell<usize>) -> Result<PlanBuilder, String> {
        let first = &p.nodes[*nodes.first().ok_or("no nodes")?];
        let reduction_n =
            nodes.iter().find(|&&i| !p.nodes[i].reduction_ranges.is_empty()).map(|&i| p.nodes[i].ranges.iter().product::<i64>());
        let outer = match reduction_n {
            Some(n) => n,
            None => {
                let r = &first.ranges;
                if r.len() >= 2 {
                    r[..r.len() - 1].iter().product()
                } else {
                    r.iter().product()
                }
            }
        };
        let plan = KernelPlan { outer, groups: Vec::new(), nodes: Vec::new(), local_reads: Vec::new() };
        let mut b = PlanBuilder { plan, writers: HashMap::new(), readers: HashMap::new(), reduces: reduction_n.is_some() };
        for &i in nodes {
            let node = b.place(p, i, first.output, placed)?;
            b.push(p, node);
        }
        Ok(b)
    }

    pub(super) fn into_plan(self) -> KernelPlan {
        self.plan
    }

    /// Adds node `n`, a further result of the template that heads the plan, beside its head (in
    /// its group): the template writes it; its body is a stand-in that reads nothing.
    pub(super) fn attach(&mut self, p: &LoopProgram, n: usize) {
        let node = &p.nodes[n];
        let group = self.plan.nodes.first().map_or(0, |h| h.group);
        let pos = self.plan.nodes.len();
        self.writers.entry(node.output).or_default().push(pos);
        self.plan.nodes.push(KernelNode { node: n, group, body: node.body.clone(), ranges: node.var_ranges() });
        if let Some(g) = self.plan.groups.get_mut(group) {
            g.nodes.push(pos);
        }
    }

    /// How many of the plan's nodes write `b`.
    pub(super) fn writer_count(&self, b: BufferId) -> usize {
        self.writers.get(&b).map_or(0, Vec::len)
    }

    /// The plan of its nodes (`members`, in order) and `i` after them, or why not.
    pub(super) fn join(&self, p: &LoopProgram, members: &[usize], i: usize, placed: &Cell<usize>) -> Result<Joined, String> {
        if !self.reduces && !p.nodes[i].reduction_ranges.is_empty() {
            let mut all = members.to_vec();
            all.push(i);
            return PlanBuilder::build(p, &all, placed).map(Joined::Rebuilt);
        }
        let first = self.plan.nodes.first().ok_or("no nodes")?.node;
        self.place(p, i, p.nodes[first].output, placed).map(Joined::Appended)
    }

    /// Adds a joined node (or takes the rebuilt plan).
    pub(super) fn apply(&mut self, p: &LoopProgram, joined: Joined) {
        match joined {
            Joined::Appended(placed) => self.push(p, placed),
            Joined::Rebuilt(b) => *self = b,
        }
    }

    /// Node `i` rewritten over the kernel's variables after the plan's nodes, with the kinds of
    /// its reads of buffers they write; `first_output` names the kernel's device.
    fn place(&self, p: &LoopProgram, i: usize, first_output: BufferId, placed: &Cell<usize>) -> Result<Placement, String> {
        placed.set(placed.get() + 1);
        let outer = self.plan.outer;
        let device = &p.buffer(first_output).layout.device;
        let n = &p.nodes[i];
        let name = &p.buffer(n.output).name;
        if &p.buffer(n.output).layout.device != device {
            return Err(format!("{name} is on another device"));
        }
        let (subst, inner, is_red) = if n.reduction_ranges.is_empty() {
            let (s, inner) = node_subst(&n.ranges, outer, 1)
                .ok_or_else(|| format!("{name}'s ranges {:?} do not split at the kernel's outer size {outer}", n.ranges))?;
            let work: i64 = inner.iter().product();
            let split = &super::GPU_SPLIT;
            let programs = if work > split.persistent_max {
                (outer + split.looped_rows_per_program - 1) / split.looped_rows_per_program
            } else {
                outer
            };
            if self.reduces && programs < FEW_PROGRAMS && work > SERIAL_ELEMENTS {
                return Err(format!("{name} would loop over {work} elements in each of the kernel's {programs} programs"));
            }
            (s, inner, false)
        } else {
            if n.ranges.iter().product::<i64>() != outer {
                return Err(format!(
                    "reduction {name} has {} outputs, the kernel's outer size is {outer}",
                    n.ranges.iter().product::<i64>()
                ));
            }
            let (mut s, _) = node_subst(&n.ranges, outer, 1).ok_or_else(|| format!("{name}'s ranges do not split"))?;
            for j in 0..n.reduction_ranges.len() {
                s.push(Some(IndexExpr::var(Var(1 + j as u32))));
            }
            (s, n.reduction_ranges.clone(), true)
        };
        if let Some(first) = self.plan.nodes.first() {
            if n.template.is_some() {
                return Err(format!("{name} is a template: it heads a kernel of its own"));
            }
            if p.nodes[first.node].attention().is_some() {
                return Err(format!("nothing joins a fused attention's kernel ({name})"));
            }
            if p.nodes[first.node].is_matrix_product() && (is_red || !inner.is_empty()) {
                return Err(format!("only pointwise nodes over a matrix product's outputs join its kernel; {name} loops over {inner:?}"));
            }
        }
        let kranges: Vec<i64> = std::iter::once(outer).chain(inner.iter().copied()).collect();
        let body = n.body.rewrite_indices(&|e: &IndexExpr| e.substitute(&subst, &kranges));
        let groups = &self.plan.groups;
        // reads of buffers written earlier in this kernel
        let mut needs_new_group = false;
        let mut reads_here = Vec::new();
        for e in &body.exprs {
            if let Expr::LoadIndirect { buf, .. } = e {
                if self.writers.contains_key(buf) {
                    return Err(format!("{name} gathers from {}, written in this kernel", p.buffer(*buf).name));
                }
                continue;
            }
            let Expr::Load { buf, index } = e else { continue };
            let writers = self.writers.get(buf).map_or(&[][..], Vec::as_slice);
            if writers.is_empty() {
                continue;
            }
            let bname = &p.buffer(*buf).name;
            if writers.len() > 1 {
                return Err(format!("{name} reads {bname}, which several nodes of the kernel write"));
            }
            let w = &self.plan.nodes[writers[0]];
            let st = &w.body.store.as_ref().ok_or("writer without a store")?.index;
            if st != index {
                return Err(format!("{name} reads {bname} at {index}, which is written at {st}"));
            }
            if p.nodes[w.node].kind() == NodeKind::Scan {
                return Err(format!("{name} reads scan output {bname}, written step by step"));
            }
            let wg = &groups[w.group];
            let w_red = !p.nodes[w.node].reduction_ranges.is_empty();
            let kind = if w_red {
                let mut vs = Vec::new();
                index.vars(&mut vs);
                if vs.iter().any(|v| v.0 != 0) {
                    return Err(format!("{name} reads reduction result {bname} inside its reduction loop"));
                }
                // the result exists only after its group's loop: read it from a later group
                needs_new_group |= w.group + 1 == groups.len();
                LocalRead::Scalar
            } else if w.group + 1 == groups.len() && wg.inner == inner {
                LocalRead::Forwarded
            } else if wg.inner == inner {
                LocalRead::Stored
            } else {
                return Err(format!("{name} reads {bname} over inner loops {inner:?}, written over {:?}", wg.inner));
            };
            reads_here.push((*buf, kind));
        }
        let joins_last = groups.last().is_some_and(|g| g.inner == inner && !needs_new_group);
        self.check_overwrite(p, i, &body, is_red, joins_last)?;
        let node = KernelNode { node: i, group: 0, body, ranges: kranges };
        Ok(Placement { node, inner, is_red, needs_new_group, reads_here })
    }

    /// A node writing a buffer that earlier nodes of the kernel read (a write into a graph input
    /// after its readers) may join only where each of those reads is of the element it
    /// overwrites, in the same pointwise loop it joins: there every read of an element comes
    /// before its store, whatever the order of iterations, threads or vector lanes.
    fn check_overwrite(&self, p: &LoopProgram, i: usize, body: &LoopBody, is_red: bool, joins_last: bool) -> Result<(), String> {
        let out = p.nodes[i].output;
        let Some(readers) = self.readers.get(&out) else { return Ok(()) };
        let name = &p.buffer(out).name;
        let store = body.store.as_ref().ok_or("a node without a store")?;
        if is_red || !joins_last || !store.terms.is_empty() || store.mode != StoreMode::Set {
            return Err(format!("{name} overwrites a buffer that the kernel reads in another loop"));
        }
        let last = self.plan.groups.len() - 1;
        for &r in readers {
            let kn = &self.plan.nodes[r];
            let reader = &p.nodes[kn.node];
            let same_loop = kn.group == last
                && !self.plan.groups[last].reduction
                && reader.reduction_ranges.is_empty()
                && reader.kind() != NodeKind::Scan;
            let at_store = kn.body.exprs.iter().all(|e| match e {
                Expr::Load { buf, index } if *buf == out => *index == store.index,
                Expr::LoadIndirect { buf, .. } => *buf != out,
                _ => true,
            });
            if !same_loop || !at_store {
                let rname = &p.buffer(reader.output).name;
                return Err(format!("{name} overwrites elements that {rname} reads elsewhere in the kernel"));
            }
        }
        Ok(())
    }

    fn push(&mut self, p: &LoopProgram, placed: Placement) {
        let Placement { mut node, inner, is_red, needs_new_group, reads_here } = placed;
        let plan = &mut self.plan;
        let pos = plan.nodes.len();
        let join = match plan.groups.last() {
            Some(g) => g.inner == inner && !needs_new_group,
            None => false,
        };
        if !join {
            plan.groups.push(LoopGroup { inner, reduction: is_red, nodes: Vec::new() });
        }
        let gi = plan.groups.len() - 1;
        plan.groups[gi].reduction |= is_red;
        plan.groups[gi].nodes.push(pos);
        // a forwarded read must come from this same group
        for (buf, kind) in reads_here {
            let kind = match kind {
                LocalRead::Forwarded if !join => LocalRead::Stored,
                k => k,
            };
            plan.local_reads.push((pos, buf, kind));
        }
        node.group = gi;
        self.writers.entry(p.nodes[node.node].output).or_default().push(pos);
        for e in &node.body.exprs {
            if let Expr::Load { buf, .. } | Expr::LoadIndirect { buf, .. } = e {
                if !matches!(p.buffer(*buf).source, BufferSource::Input(_)) {
                    continue; // only inputs are written after their readers
                }
                let list = self.readers.entry(*buf).or_default();
                if list.last() != Some(&pos) {
                    list.push(pos);
                }
            }
        }
        self.reduces |= is_red;
        plan.nodes.push(node);
    }
}
