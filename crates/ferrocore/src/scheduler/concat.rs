//! A concatenation's one pointwise reader, computed where its pieces are: a pointwise node that
//! is the only reader of a buffer written in pieces along one dim (a `cat`: one writer per
//! input) is merged into the writers, each computing the reader's result over its own piece
//! and storing that; the concatenation is never stored (a masked fill over a concatenated
//! gradient: Mixtral's expert backward read and wrote 117 MB more per layer). Runs before loops
//! are simplified, while nodes still loop over their buffers' dims.

use crate::loop_ir::*;
use crate::lowering::is_dense;
use crate::symbolic::{IndexExpr, Var};
use std::collections::{HashMap, HashSet};

/// One writer's part of a buffer written in pieces: `[offset, offset + len)` along `dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    dim: usize,
    offset: i64,
    len: i64,
}

/// Merges each such reader into the writers of the concatenation it reads; returns the
/// decisions.
pub fn inline_concat_readers(p: &mut LoopProgram) -> Vec<String> {
    let mut decisions = Vec::new();
    let mut uses = Uses::of(p);
    let mut i = 0;
    while i < p.steps.len() {
        if let Step::Node(n) = p.steps[i] {
            if let Some((buf, writers)) = merged_writers(p, &uses, n, i) {
                decisions.push(format!(
                    "cat read in place: {} is computed by the {} writers of {} (its only reader); {} is not stored",
                    p.buffer(p.nodes[n].output).name,
                    writers.len(),
                    p.buffer(buf).name,
                    p.buffer(buf).name
                ));
                let mut merged = vec![false; p.nodes.len()];
                writers.iter().for_each(|(w, _)| merged[*w] = true);
                let mut steps = Vec::with_capacity(p.steps.len());
                for (j, &step) in p.steps.iter().enumerate() {
                    match step {
                        Step::Node(m) if merged[m] => {}
                        _ if j == i => steps.extend(writers.iter().map(|(w, _)| Step::Node(*w))),
                        _ => steps.push(step),
                    }
                }
                let first = steps.iter().position(|s| *s == Step::Node(writers[0].0)).unwrap_or(i);
                for (w, node) in writers {
                    p.nodes[w] = node;
                }
                p.steps = steps;
                uses = Uses::of(p);
                i = first; // the merged writers may be the pieces of a later reader's concatenation
                continue;
            }
        }
        i += 1;
    }
    decisions
}

/// Who writes and reads each buffer, over the program's steps (nodes no step runs are dead).
struct Uses {
    writers: Vec<Vec<usize>>,
    readers: Vec<Vec<usize>>,
    /// read by a library call or returned
    escapes: Vec<bool>,
}

impl Uses {
    fn of(p: &LoopProgram) -> Uses {
        let n = p.buffers.len();
        let mut u = Uses { writers: vec![Vec::new(); n], readers: vec![Vec::new(); n], escapes: vec![false; n] };
        for s in &p.steps {
            match *s {
                Step::Node(m) => {
                    u.writers[p.nodes[m].output.0 as usize].push(m);
                    for (b, _) in p.nodes[m].reads() {
                        u.readers[b.0 as usize].push(m);
                    }
                }
                Step::Extern(e) => p.externs[e].input_buffers().iter().for_each(|b| u.escapes[b.0 as usize] = true),
            }
        }
        for o in &p.outputs {
            if let OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } = o {
                u.escapes[b.0 as usize] = true;
            }
        }
        u
    }
}

/// For node `n` (at step `at`): the concatenation it alone reads and, per writer, the node
/// computing `n`'s result over that writer's piece; None unless `n` is pointwise, reads the
/// concatenation element for element (each of its variables a distinct dim of it), and nothing
/// between the writers and `n` writes what the writers read.
fn merged_writers(p: &LoopProgram, uses: &Uses, n: usize, at: usize) -> Option<(BufferId, Vec<(usize, LoopNode)>)> {
    let node = &p.nodes[n];
    if node.kind() != NodeKind::Pointwise || !node.reduction_ranges.is_empty() || node.is_scatter() {
        return None;
    }
    let reads = node.reads();
    let mut times_read: HashMap<BufferId, usize> = HashMap::new();
    reads.iter().for_each(|(b, _)| *times_read.entry(*b).or_default() += 1);
    // the largest concatenation `n` alone reads, element for element (rotary embeddings read
    // their `cos` table, a cat many nodes read, beside the rotated half)
    let best = reads
        .iter()
        .filter_map(|(buf, index)| {
            let only_reader = uses.readers[buf.0 as usize].iter().all(|&m| m == n) && !uses.escapes[buf.0 as usize];
            if *buf == node.output || !only_reader || times_read[buf] > 1 {
                return None;
            }
            let pieces = pieces_of(p, uses, *buf)?;
            // which dim of the concatenation each of `n`'s variables steps along
            Some((*buf, pieces, dims_of(index, &node.ranges, &p.buffer(*buf).layout)?))
        })
        .max_by_key(|(buf, _, _)| p.buffer(*buf).layout.size.iter().product::<i64>())?;
    let (buf, pieces, dims) = best;
    let mut writes_buf = vec![false; p.nodes.len()];
    uses.writers[buf.0 as usize].iter().for_each(|&m| writes_buf[m] = true);
    let first = p.steps.iter().position(|s| matches!(s, Step::Node(m) if writes_buf[*m]))?;
    let written: HashSet<BufferId> = p.steps[first..at]
        .iter()
        .flat_map(|s| match *s {
            Step::Node(m) => vec![p.nodes[m].output],
            Step::Extern(e) => p.externs[e].outputs.clone(),
        })
        .filter(|b| *b != buf)
        .collect();
    let mut merged = Vec::new();
    for (w, piece) in pieces {
        let writer = &p.nodes[w];
        if writer.reads().iter().any(|(b, _)| written.contains(b)) {
            return None;
        }
        merged.push((w, merge(writer, node, buf, &dims, piece)?));
    }
    Some((buf, merged))
}

/// `reader`'s body over `writer`'s piece, in the writer's variables, with the writer's value in
/// place of the load of `buf`: a node storing the reader's result over that piece.
fn merge(writer: &LoopNode, reader: &LoopNode, buf: BufferId, dims: &[Option<usize>], piece: Piece) -> Option<LoopNode> {
    let stored = writer.body.store.as_ref()?;
    // the reader's variable i is the writer's variable dims[i] (shifted along the pieces' dim)
    let subst: Vec<Option<IndexExpr>> = dims
        .iter()
        .map(|d| {
            Some(match d {
                Some(d) if *d == piece.dim => IndexExpr::var(Var(*d as u32)).add_const(piece.offset),
                Some(d) => IndexExpr::var(Var(*d as u32)),
                None => IndexExpr::zero(), // a variable of one value
            })
        })
        .collect();
    let ranges = &writer.ranges;
    let rbody = reader.body.rewrite_indices(&|e: &IndexExpr| e.substitute(&subst, ranges));
    let mut body = writer.body.clone();
    body.store = None;
    let mut map: Vec<Option<ValueId>> = Vec::with_capacity(rbody.exprs.len());
    for (k, e) in rbody.exprs.iter().enumerate() {
        let v = match e {
            Expr::Load { buf: b, .. } if *b == buf => (writer.body.dtype(stored.value) == rbody.dtypes[k]).then_some(stored.value)?,
            _ => body.push_copy(e, rbody.dtypes[k], &|x| map[x.0 as usize])?,
        };
        map.push(Some(v));
    }
    let store = rbody.store.as_ref()?;
    let value = map[store.value.0 as usize]?;
    body.set_store(store.index.clone(), value);
    Some(LoopNode {
        output: reader.output,
        ranges: writer.ranges.clone(),
        reduction_ranges: vec![],
        body,
        origins: [writer.origins.clone(), reader.origins.clone()].concat(),
        template: None,
    })
}

/// The writers of a computed buffer and the piece each fills, sorted by offset, when two or
/// more pointwise writers store into disjoint slices along one dim that together cover it.
fn pieces_of(p: &LoopProgram, uses: &Uses, b: BufferId) -> Option<Vec<(usize, Piece)>> {
    let layout = &p.buffer(b).layout;
    if p.buffer(b).source != BufferSource::Computed || !is_dense(&layout.size, &layout.stride) {
        return None;
    }
    let mut pieces = Vec::new();
    for &m in &uses.writers[b.0 as usize] {
        let node = &p.nodes[m];
        let store = node.body.store.as_ref()?;
        if store.is_scatter() || !node.reduction_ranges.is_empty() || node.ranges.len() != layout.size.len() {
            return None;
        }
        pieces.push((m, piece_of(&node.ranges, &store.index, layout)?));
    }
    if pieces.len() < 2 || pieces.iter().any(|(_, q)| q.dim != pieces[0].1.dim) {
        return None;
    }
    pieces.sort_by_key(|(_, q)| q.offset);
    let mut end = 0;
    for (_, q) in &pieces {
        if q.offset != end {
            return None;
        }
        end += q.len;
    }
    (end == layout.size[pieces[0].1.dim]).then_some(pieces)
}

/// Which slice a writer looping over `ranges` and storing at `index` fills: the same shape as
/// the buffer but along one dim, stored where that slice lives.
fn piece_of(ranges: &[i64], index: &IndexExpr, layout: &Layout) -> Option<Piece> {
    let mut differ = (0..ranges.len()).filter(|&d| ranges[d] != layout.size[d]);
    let dim = differ.next()?;
    if differ.next().is_some() || ranges[dim] == 0 || layout.stride[dim] == 0 {
        return None;
    }
    let vars: Vec<IndexExpr> = (0..ranges.len()).map(|i| IndexExpr::var(Var(i as u32))).collect();
    let shift = index.sub(&layout.index_of(&vars)).as_constant()?;
    let offset = (shift % layout.stride[dim] == 0).then_some(shift / layout.stride[dim])?;
    (offset >= 0 && offset + ranges[dim] <= layout.size[dim]).then_some(Piece { dim, offset, len: ranges[dim] })
}

/// For a node looping over `ranges` that reads `layout` at `index`: the dim each variable steps
/// along (None for a variable of one value). Every variable of more than one value must step
/// along a distinct dim of the same size at that dim's stride, and the index have no other terms.
fn dims_of(index: &IndexExpr, ranges: &[i64], layout: &Layout) -> Option<Vec<Option<usize>>> {
    let mut used = vec![false; layout.size.len()];
    let mut rest = index.clone();
    let mut dims = Vec::with_capacity(ranges.len());
    for (i, &n) in ranges.iter().enumerate() {
        let v = Var(i as u32);
        let c = index.affine_coeff(v)?;
        rest = rest.sub(&IndexExpr::var(v).scale(c));
        if n == 1 {
            dims.push(None);
            continue;
        }
        let d = (0..layout.size.len()).find(|&d| !used[d] && layout.stride[d] == c && layout.size[d] == n)?;
        used[d] = true;
        dims.push(Some(d));
    }
    // every dim of more than one element is read: the reader covers the whole buffer once
    let covers = (0..layout.size.len()).all(|d| used[d] || layout.size[d] == 1);
    (covers && rest.as_constant() == Some(layout.offset)).then_some(dims)
}
