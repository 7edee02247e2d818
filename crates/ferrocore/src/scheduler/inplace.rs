//! In-place results: a kernel output takes over the storage of a buffer that dies in the same
//! kernel, when the one node that reads it does so at exactly the element it writes (a
//! gradient summed into a dying partial sum, a pointwise chain over a dying activation). The
//! output is renamed to the dying buffer everywhere, so the wrapper allocates nothing for it and
//! the peak holds one buffer where it held two.

use super::{Item, Schedule, Storage};
use crate::loop_ir::*;
use crate::symbolic::IndexExpr;

/// Renames each in-place output to the buffer whose storage it takes; returns the decisions.
pub(super) fn reuse_dying_buffers(s: &mut Schedule) -> Vec<String> {
    let mut decisions = Vec::new();
    let n = s.program.buffers.len();
    let (mut last_use, writers, pinned) = uses(s);
    let mut written_here = vec![None; n];
    for i in 0..s.items.len() {
        let Item::Kernel(k) = &s.items[i] else { continue };
        for kn in &k.plan.nodes {
            written_here[s.program.nodes[kn.node].output.0 as usize] = Some(i);
        }
        let mut renames: Vec<(BufferId, BufferId)> = Vec::new();
        for (pos, kn) in k.plan.nodes.iter().enumerate() {
            let out = s.program.nodes[kn.node].output;
            let Some(store) = kn.body.store.as_ref().filter(|st| !st.is_scatter()) else { continue };
            let p = &s.program;
            let owned = |b: BufferId| p.buffer(b).source == BufferSource::Computed && s.storage[b.0 as usize] == Storage::Allocated;
            if !owned(out) || writers[out.0 as usize].len() != 1 || renames.iter().any(|(_, x)| *x == out) {
                continue;
            }
            let dying = p.nodes[kn.node].reads().into_iter().map(|(b, _)| b).find(|&x| {
                owned(x)
                    && x != out
                    && !pinned[x.0 as usize]
                    && last_use[x.0 as usize] == Some(i)
                    && written_here[x.0 as usize] != Some(i)
                    && writers[x.0 as usize].iter().all(|&w| w < i)
                    && p.buffer(x).layout == p.buffer(out).layout
                    && !renames.iter().any(|(_, y)| *y == x)
                    && reads_only_at(&kn.body, x, &store.index)
                    && k.plan.nodes.iter().enumerate().all(|(q, other)| q == pos || !reads(&other.body, x))
            });
            if let Some(x) = dying {
                renames.push((out, x));
            }
        }
        for (out, x) in renames {
            decisions.push(format!(
                "in place: {} is written into {} (its last reader, element for element)",
                s.program.buffer(out).name,
                s.program.buffer(x).name
            ));
            last_use[x.0 as usize] = last_use[out.0 as usize].max(Some(i));
            rename(s, out, x);
        }
    }
    decisions
}

/// Per buffer: the last item that reads or writes it, the items that write it, and whether the
/// graph returns it or takes it as input (then its storage is never taken).
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
                // a library call may return a view of what it is given: that storage stays its own
                for b in p.externs[*e].input_buffers().into_iter().chain(p.externs[*e].outputs.iter().copied()) {
                    last[b.0 as usize] = Some(i);
                    pinned[b.0 as usize] = true;
                }
            }
        }
    }
    for o in &p.outputs {
        if let OutputValue::Buffer(b) | OutputValue::View { buf: b, .. } = o {
            pinned[b.0 as usize] = true;
        }
    }
    for b in &p.inputs {
        pinned[b.0 as usize] = true;
    }
    (last, writers, pinned)
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
