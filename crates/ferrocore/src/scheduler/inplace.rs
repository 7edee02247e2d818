//! In-place results: a kernel output takes over the storage of a buffer that dies in the same
//! kernel, when every node that reads it does so at exactly the element it writes (a gradient
//! summed into a dying partial sum, a pointwise chain over a dying activation, a relu over the
//! GEMM result it reads last). Other readers of the dying buffer in the same loop are emitted
//! before the writer (moved ahead of it when they do not depend on what they pass: the saved
//! `relu <= 0` mask beside the relu). The output is renamed to the dying buffer everywhere, so
//! the wrapper allocates nothing for it and the peak holds one buffer where it held two.

use super::plan::KernelPlan;
use super::{Item, Schedule, Storage};
use crate::loop_ir::*;
use crate::symbolic::IndexExpr;

/// Renames each in-place output to the buffer whose storage it takes; returns the decisions.
pub(super) fn reuse_dying_buffers(s: &mut Schedule) -> Vec<String> {
    let mut decisions = Vec::new();
    let n = s.program.buffers.len();
    let (mut last_use, writers, mut pinned) = uses(s);
    // per buffer, the program's nodes that write it (kept up to date through renames)
    let mut node_writers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (j, node) in s.program.nodes.iter().enumerate() {
        node_writers[node.output.0 as usize].push(j);
    }
    let mut written_here = vec![None; n];
    for i in 0..s.items.len() {
        let Item::Kernel(k) = &s.items[i] else { continue };
        for kn in &k.plan.nodes {
            written_here[s.program.nodes[kn.node].output.0 as usize] = Some(i);
        }
        let mut renames: Vec<(BufferId, BufferId, Fit, usize)> = Vec::new();
        // a group's emission order with readers moved ahead of an in-place writer (one per kernel)
        let mut reorder: Option<(usize, Vec<usize>)> = None;
        for (pos, kn) in k.plan.nodes.iter().enumerate() {
            if s.program.nodes[kn.node].is_attention_part() {
                continue; // (its body is a stand-in: which element it reads where is the template's)
            }
            let out = s.program.nodes[kn.node].output;
            let Some(store) = kn.body.store.as_ref().filter(|st| !st.is_scatter()) else { continue };
            let p = &s.program;
            let owned = |b: BufferId| {
                let ours = match p.buffer(b).source {
                    BufferSource::Computed => true,
                    BufferSource::Extern { call, .. } => p.externs[call].returns_new_storage(),
                    BufferSource::Input(_) => false,
                };
                ours && s.storage[b.0 as usize] == Storage::Allocated
            };
            // other writers of `out`: only fills of a padded result's padding may stay (below)
            let fills = || -> Vec<usize> { node_writers[out.0 as usize].iter().copied().filter(|&j| j != kn.node).collect() };
            // (the node itself is one of the writers)
            let fill_count = node_writers[out.0 as usize].len().saturating_sub(1);
            if !owned(out) || writers[out.0 as usize].len() != 1 + fill_count || renames.iter().any(|(_, x, _, _)| *x == out) {
                continue;
            }
            let dying = p.nodes[kn.node].reads().into_iter().map(|(b, _)| b).find_map(|x| {
                let candidate = (owned(x) || p.donated.contains(&x))
                    && x != out
                    && !pinned[x.0 as usize]
                    && last_use[x.0 as usize] == Some(i)
                    && written_here[x.0 as usize] != Some(i)
                    && writers[x.0 as usize].iter().all(|&w| w < i)
                    && !renames.iter().any(|(_, y, _, _)| *y == x)
                    && reads_only_at(&kn.body, x, &store.index);
                let order = if candidate { readers_first(p, &k.plan, pos, x, &store.index) } else { None };
                let order = order.filter(|o| o.is_none() || reorder.is_none())?;
                let fit = storage_fits(p, x, out, &fills());
                (fit != Fit::No).then_some((x, fit, order))
            });
            if let Some((x, fit, order)) = dying {
                if order.is_some() {
                    reorder = order;
                }
                renames.push((out, x, fit, pos));
            }
        }
        if let Some((g, order)) = reorder {
            let Item::Kernel(k) = &mut s.items[i] else { unreachable!() };
            k.plan.groups[g].nodes = order;
        }
        // moving readers ahead of one writer may have moved another writer ahead of its readers
        let Item::Kernel(k) = &s.items[i] else { unreachable!() };
        renames.retain(|&(_, x, _, pos)| others_read_first(&k.plan, pos, x));
        for (out, x, fit, _) in renames {
            if fit == Fit::Reshaped {
                // whole-tensor uses of `out` keep its shape: views of `x`'s storage
                let layout = s.program.buffer(out).layout.clone();
                view_whole_uses(&mut s.program, out, &layout);
            }
            decisions.push(format!(
                "in place: {} is written into {} (its last reader, element for element)",
                s.program.buffer(out).name,
                s.program.buffer(x).name
            ));
            last_use[x.0 as usize] = last_use[out.0 as usize].max(Some(i));
            // `x` now holds what `out` held: a graph output's storage is never taken again
            let escapes = pinned[out.0 as usize];
            pinned[x.0 as usize] |= escapes;
            if s.program.donated.contains(&x) {
                let extent = s.program.buffer(out).layout.storage_numel().max(s.program.buffer(x).layout.storage_numel());
                match s.program.donated_writes.iter_mut().find(|w| w.buffer == x) {
                    Some(w) => {
                        w.extent = w.extent.max(extent);
                        w.escapes |= escapes;
                    }
                    None => s.program.donated_writes.push(DonatedWrite { buffer: x, extent, escapes }),
                }
            }
            rename(s, out, x);
            let moved = std::mem::take(&mut node_writers[out.0 as usize]);
            node_writers[x.0 as usize].extend(moved);
            node_writers[x.0 as usize].sort_unstable();
        }
    }
    decisions
}

/// Per buffer: the last item that reads or writes it, the items that write it, and whether the
/// graph returns it or takes it as input (then its storage is never taken; a donated input's may
/// be, after its last read).
fn uses(s: &Schedule) -> (Vec<Option<usize>>, Vec<Vec<usize>>, Vec<bool>) {
    let p = &s.program;
    let n = p.buffers.len();
    let mut last = vec![None; n];
    let mut writers: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut pinned = vec![false; n];
    for (i, it) in s.items.iter().enumerate() {
        match it {
            Item::Kernel(k) => {
                for kn in &k.plan.nodes {
                    let out = p.nodes[kn.node].output;
                    writers[out.0 as usize].push(i);
                    last[out.0 as usize] = Some(i);
                    for (b, _) in p.nodes[kn.node].reads() {
                        last[b.0 as usize] = Some(i);
                    }
                }
            }
            Item::Extern(e) => {
                // a library call may return a view of what it is given: that storage stays its
                // own, unless the call always returns new tensors (a GEMM's result may then
                // take the relu after it in place)
                let fresh = p.externs[*e].returns_new_storage();
                for b in p.externs[*e].input_buffers().into_iter().chain(p.externs[*e].outputs.iter().copied()) {
                    last[b.0 as usize] = Some(i);
                    pinned[b.0 as usize] |= !fresh;
                }
            }
        }
    }
    for o in &p.outputs {
        if let OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } = o {
            pinned[b.0 as usize] = true;
        }
    }
    for b in p.inputs.iter().filter(|b| !p.donated.contains(b)) {
        pinned[b.0 as usize] = true;
    }
    (last, writers, pinned)
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Fit {
    No,
    /// `out` is `x`'s layout (or, for a donated input, its padded rows around `x`)
    Same,
    /// `out` has another shape over the same storage (a relu's [B, T, F] over the GEMM result
    /// [B·T, F] it reads element for element): its whole-tensor uses become views of `x`
    Reshaped,
}

/// Whether `out` (and the fills of its padding, `fills`) can live in `x`'s storage: the same
/// layout, the same bytes in another shape, or for a donated input the unpadded corner of
/// `out`'s padded rows.
fn storage_fits(p: &LoopProgram, x: BufferId, out: BufferId, fills: &[usize]) -> Fit {
    let (xl, ol) = (&p.buffer(x).layout, &p.buffer(out).layout);
    if fills.is_empty() && xl == ol {
        return Fit::Same;
    }
    if fills.is_empty() && reshaped(xl, ol) {
        return Fit::Reshaped;
    }
    let corner = p.donated.contains(&x)
        && corner_of(xl, ol)
        && !used_whole(p, out)
        && fills.iter().all(|&j| !reads(&p.nodes[j].body, x) && writes_outside(&p.nodes[j], xl, ol));
    if corner {
        Fit::Same
    } else {
        Fit::No
    }
}

/// Both layouts are dense row-major orders of the same number of elements of one dtype and
/// device (so an element's storage position is its flat index in either).
fn reshaped(x: &Layout, out: &Layout) -> bool {
    let dense = |l: &Layout| l.offset == 0 && l.stride == contiguous_strides(&l.size);
    x.dtype == out.dtype
        && x.device == out.device
        && dense(x)
        && dense(out)
        && x.size.iter().product::<i64>() == out.size.iter().product::<i64>()
}

/// Library-call arguments and graph outputs that take `b` whole now take a view of it with
/// `layout` (still naming `b`; the rename that follows points them at the new storage).
fn view_whole_uses(p: &mut LoopProgram, b: BufferId, layout: &Layout) {
    let view = || ExternArg::View { buf: b, size: layout.size.clone(), stride: layout.stride.clone(), offset: layout.offset };
    fn walk(a: &mut ExternArg, b: BufferId, view: &dyn Fn() -> ExternArg) {
        match a {
            ExternArg::Buffer(x) if *x == b => *a = view(),
            ExternArg::List(items) => items.iter_mut().for_each(|i| walk(i, b, view)),
            _ => {}
        }
    }
    for x in p.externs.iter_mut() {
        x.args.iter_mut().chain(x.kwargs.iter_mut().map(|(_, a)| a)).for_each(|a| walk(a, b, &view));
    }
    for o in p.outputs.iter_mut() {
        if matches!(o, OutputValue::Buffer(x) if *x == b) {
            *o = OutputValue::View { buf: b, size: layout.size.clone(), stride: layout.stride.clone(), offset: layout.offset };
        }
    }
}

/// `x` is the leading corner of `out` (same strides, no larger): the unpadded view of padded
/// rows, which a donated input's storage holds when the padded result it was read from had them.
fn corner_of(x: &Layout, out: &Layout) -> bool {
    x.dtype == out.dtype
        && x.device == out.device
        && x.offset == 0
        && out.offset == 0
        && x.stride == out.stride
        && x.size.len() == out.size.len()
        && x.size.iter().zip(&out.size).all(|(a, b)| a <= b)
}

/// Every element `node` stores into `out`'s storage lies outside the view `x` (padding), checked
/// point by point over loops of at most 2^20 iterations.
fn writes_outside(node: &LoopNode, x: &Layout, out: &Layout) -> bool {
    let Some(store) = node.body.store.as_ref().filter(|st| !st.is_scatter()) else { return false };
    let points: i64 = node.ranges.iter().product();
    if points > 1 << 20 || node.ranges.iter().any(|&r| r <= 0) {
        return false;
    }
    let mut dims: Vec<usize> = (0..out.size.len()).collect();
    dims.sort_by_key(|&d| std::cmp::Reverse(out.stride[d]));
    let mut at = vec![0i64; node.ranges.len()];
    for _ in 0..points {
        let mut flat = store.index.eval(&at) - out.offset as i128;
        let mut inside = true;
        for &d in &dims {
            let i = flat.div_euclid(out.stride[d].max(1) as i128);
            flat = flat.rem_euclid(out.stride[d].max(1) as i128);
            inside &= i < x.size[d] as i128;
        }
        if inside {
            return false;
        }
        for k in (0..at.len()).rev() {
            at[k] += 1;
            if at[k] < node.ranges[k] {
                break;
            }
            at[k] = 0;
        }
    }
    true
}

/// Whether a library call or the graph's outputs take buffer `b` as a whole tensor (its own
/// layout): renamed to a smaller view, it would arrive with that view's size.
fn used_whole(p: &LoopProgram, b: BufferId) -> bool {
    fn whole(a: &ExternArg, b: BufferId) -> bool {
        match a {
            ExternArg::Buffer(x) => *x == b,
            ExternArg::List(items) => items.iter().any(|i| whole(i, b)),
            _ => false,
        }
    }
    p.externs.iter().any(|x| x.args.iter().chain(x.kwargs.iter().map(|(_, a)| a)).any(|a| whole(a, b)))
        || p.outputs.iter().any(|o| matches!(o, OutputValue::Buffer(x) if *x == b))
}

/// Whether the other nodes of `pos`'s kernel that read `x` can all be emitted before it, each
/// reading `x` at `index` in the same pointwise loop: None when not; Some(None) when they already
/// are; Some((group, order)) with the group's emission order that moves the later ones ahead of
/// `pos` (each may move when it reads nothing that `pos` or the nodes it passes write, and they
/// read nothing it writes).
fn readers_first(p: &LoopProgram, plan: &KernelPlan, pos: usize, x: BufferId, index: &IndexExpr) -> Option<Option<(usize, Vec<usize>)>> {
    let g = plan.nodes[pos].group;
    let readers: Vec<usize> = (0..plan.nodes.len()).filter(|&q| q != pos && reads(&plan.nodes[q].body, x)).collect();
    if readers.is_empty() {
        return Some(None);
    }
    let pointwise = !plan.groups[g].reduction;
    let same_loop = |q: usize| plan.nodes[q].group == g && plan.nodes[q].ranges == plan.nodes[pos].ranges;
    if !pointwise || !readers.iter().all(|&q| same_loop(q) && reads_only_at(&plan.nodes[q].body, x, index)) {
        return None;
    }
    let order = &plan.groups[g].nodes;
    let at = order.iter().position(|&q| q == pos)?;
    let (moving, staying): (Vec<usize>, Vec<usize>) = order[at..].iter().partition(|q| readers.contains(q));
    if moving.is_empty() {
        return Some(None);
    }
    let output = |q: usize| p.nodes[plan.nodes[q].node].output;
    for &m in &moving {
        let passed = order[at..].iter().take_while(|&&q| q != m).filter(|q| !moving.contains(q));
        for &q in passed {
            if reads(&plan.nodes[m].body, output(q)) || reads(&plan.nodes[q].body, output(m)) || output(q) == output(m) {
                return None;
            }
        }
    }
    let mut new_order = order[..at].to_vec();
    new_order.extend(moving);
    new_order.extend(staying);
    Some(Some((g, new_order)))
}

/// Every other node of the kernel that reads `x` is emitted before `pos`, in its group.
fn others_read_first(plan: &KernelPlan, pos: usize, x: BufferId) -> bool {
    let order = &plan.groups[plan.nodes[pos].group].nodes;
    let at = order.iter().position(|&q| q == pos);
    (0..plan.nodes.len())
        .filter(|&q| q != pos && reads(&plan.nodes[q].body, x))
        .all(|q| plan.nodes[q].group == plan.nodes[pos].group && order.iter().position(|&r| r == q) < at)
}

fn reads(body: &LoopBody, x: BufferId) -> bool {
    body.exprs.iter().any(|e| matches!(e, Expr::Load { buf, .. } | Expr::LoadIndirect { buf, .. } if *buf == x))
}

/// Every read of `x` in `body` is a direct load at `index`.
fn reads_only_at(body: &LoopBody, x: BufferId, index: &IndexExpr) -> bool {
    body.exprs.iter().all(|e| match e {
        Expr::Load { buf, index: i } if *buf == x => i == index,
        Expr::LoadIndirect { buf, .. } => *buf != x,
        _ => true,
    })
}

/// Every reference to buffer `from` (writers, loads, library-call arguments, graph outputs)
/// now names `to`.
fn rename(s: &mut Schedule, from: BufferId, to: BufferId) {
    let swap = |b: &mut BufferId| {
        if *b == from {
            *b = to;
        }
    };
    let rename_body = |body: &mut LoopBody| {
        for e in body.exprs.iter_mut() {
            if let Expr::Load { buf, .. } | Expr::LoadIndirect { buf, .. } = e {
                swap(buf);
            }
        }
    };
    let p = &mut s.program;
    for node in p.nodes.iter_mut() {
        swap(&mut node.output);
        rename_body(&mut node.body);
    }
    for it in s.items.iter_mut() {
        if let Item::Kernel(k) = it {
            for kn in k.plan.nodes.iter_mut() {
                rename_body(&mut kn.body);
            }
            for (_, b, _) in k.plan.local_reads.iter_mut() {
                swap(b);
            }
        }
    }
    fn rename_arg(a: &mut ExternArg, from: BufferId, to: BufferId) {
        match a {
            ExternArg::Buffer(b) | ExternArg::View { buf: b, .. } if *b == from => *b = to,
            ExternArg::List(items) => items.iter_mut().for_each(|i| rename_arg(i, from, to)),
            _ => {}
        }
    }
    for x in p.externs.iter_mut() {
        x.args.iter_mut().chain(x.kwargs.iter_mut().map(|(_, a)| a)).for_each(|a| rename_arg(a, from, to));
    }
    for o in p.outputs.iter_mut() {
        if let OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } = o {
            swap(b);
        }
    }
}
