//! Pass `order`: steps whose results are read much later run later. A GEMM's result exists from
//! its call on; when its operands stay alive until some later step anyway, running it right after
//! that step leaves the steps in between the memory of its result. GPT-2's backward computed the
//! LM head's weight gradient (73.6 MB, read only at the end, where the tied embedding's gradient
//! joins it) before the input gradient's padded weight copy (73.6 MB), so both were live at the
//! backward's peak. Kernels whose results only the graph returns (parameter gradients) sink the
//! same way. A kernel whose result a later step reads runs just before that step: a training
//! graph's backward recomputes forward values (a group norm's output from its saved input) at
//! its start, and the UNet level's backward held 70 MB of them until the convolutions that read
//! them, far down.

use super::{buffer_bytes, returned_buffers, Item};
use crate::loop_ir::*;
use std::collections::{BTreeSet, HashSet};

/// The buffers a step reads and those it writes.
fn touches(p: &LoopProgram, it: &Item) -> (Vec<BufferId>, Vec<BufferId>) {
    match it {
        Item::Extern(e) => (p.externs[*e].input_buffers(), p.externs[*e].outputs.clone()),
        Item::Kernel(k) => (
            k.plan.nodes.iter().flat_map(|kn| p.nodes[kn.node].reads().into_iter().map(|(b, _)| b)).collect(),
            k.plan.nodes.iter().map(|kn| p.nodes[kn.node].output).collect(),
        ),
    }
}

/// How far a step sinks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Sink {
    /// To just after the last later step that reads one of its operands (those live until then
    /// anyway).
    AfterOperands,
    /// To just before the first step that reads its result.
    BeforeReader,
}

/// The results a step allocates when it may sink, and how far, else None: a library call (not
/// an ATen fallback) whose results the graph does not return; a kernel whose results no other
/// step reads and of which the graph returns some (a parameter's gradient summed early in the
/// backward: BERT's decoder bias gradient sat beside its weight gradient's GEMM, the backward's
/// peak; the others live in its registers); a kernel whose results later steps read.
/// `steps_reading` counts, per buffer, the steps that read it.
fn sinking_results(
    p: &LoopProgram,
    item: &Item,
    (reads, writes): &(Vec<BufferId>, Vec<BufferId>),
    returned: &[bool],
    steps_reading: &[usize],
) -> Option<(Vec<BufferId>, Sink)> {
    let mut outs = writes.clone();
    outs.sort_by_key(|b| b.0);
    outs.dedup();
    match item {
        Item::Extern(e) if !p.externs[*e].fallback && !outs.iter().any(|b| returned[b.0 as usize]) => Some((outs, Sink::AfterOperands)),
        Item::Extern(_) => None,
        Item::Kernel(_) => {
            let read_here: HashSet<BufferId> = reads.iter().copied().collect();
            let read_elsewhere = |b: &BufferId| steps_reading[b.0 as usize] > usize::from(read_here.contains(b));
            if outs.iter().any(read_elsewhere) {
                return Some((outs, Sink::BeforeReader));
            }
            let kept: Vec<BufferId> = outs.into_iter().filter(|b| returned[b.0 as usize]).collect();
            (!kept.is_empty()).then_some((kept, Sink::AfterOperands))
        }
    }
}

/// Moves each step that may sink to just after the last later step that reads one of its
/// operands, when no step in between touches its result or writes what it reads, and its result
/// outweighs the operands that then live longer (the input gradient's GEMM stays before the
/// weight gradient's: its padded weight copy dies with it). Returns the decisions.
///
/// Steps are visited in order. A step that has moved is a barrier to the others (two GEMMs
/// reading one large operand would otherwise trade places forever), so the steps after the one
/// visited are, up to the first moved one, the later steps in their first order: each question
/// ("the first later step that writes an operand", "the last one that reads one") is a search
/// in per-buffer lists of steps, and the cost does not grow with the steps in between (a graph
/// returning 10,000 results has 10,000 kernels that may sink).
pub fn sink_steps(p: &LoopProgram, items: &mut Vec<Item>) -> Vec<String> {
    let mut decisions = Vec::new();
    let returned = returned_buffers(p);
    let n = items.len();
    // (reads, writes) per step, by its first position
    let touched: Vec<(Vec<BufferId>, Vec<BufferId>)> = items.iter().map(|it| touches(p, it)).collect();
    // what each step allocates if it may sink; a kernel of returned results does not hold a GEMM
    // back: it sinks after the GEMM, not the GEMM after it
    let mut steps_reading = vec![0usize; p.buffers.len()];
    for (reads, _) in &touched {
        let mut seen = reads.clone();
        seen.sort_by_key(|b| b.0);
        seen.dedup();
        seen.iter().for_each(|b| steps_reading[b.0 as usize] += 1);
    }
    let sinking: Vec<Option<(Vec<BufferId>, Sink)>> =
        items.iter().zip(&touched).map(|(it, t)| sinking_results(p, it, t, &returned, &steps_reading)).collect();
    let gradient_kernel = |j: usize| matches!(items[j], Item::Kernel(_)) && matches!(sinking[j], Some((_, Sink::AfterOperands)));
    // per buffer, the steps (first positions, ascending) that read it, that read it and are no
    // gradient kernel, that write it
    let mut read_by: Vec<Vec<usize>> = vec![Vec::new(); p.buffers.len()];
    let mut plain_read_by: Vec<Vec<usize>> = vec![Vec::new(); p.buffers.len()];
    let mut written_by: Vec<Vec<usize>> = vec![Vec::new(); p.buffers.len()];
    let push = |list: &mut Vec<usize>, j: usize| {
        if list.last() != Some(&j) {
            list.push(j);
        }
    };
    for (j, (r, w)) in touched.iter().enumerate() {
        for b in r {
            push(&mut read_by[b.0 as usize], j);
            if !gradient_kernel(j) {
                push(&mut plain_read_by[b.0 as usize], j);
            }
        }
        for b in w {
            push(&mut written_by[b.0 as usize], j);
        }
    }
    let first_after = |list: &[usize], i: usize| list.get(list.partition_point(|&j| j <= i)).copied();
    let last_up_to = |list: &[usize], limit: usize| list[..list.partition_point(|&j| j <= limit)].last().copied();
    // steps that have a moved step right after them (those never move), and the moved steps
    // after each step, in order
    let mut anchors: BTreeSet<usize> = BTreeSet::new();
    let mut after: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut moved = vec![false; n];
    for i in 0..n {
        let Some((results, sink)) = &sinking[i] else { continue };
        let outs = &touched[i].1;
        let out_set: HashSet<BufferId> = outs.iter().copied().collect();
        let operands: Vec<BufferId> = touched[i].0.iter().copied().filter(|b| !out_set.contains(b)).collect();
        // the last later step that reads one of its operands (those live until then anyway), up
        // to the first that touches the result or writes an operand, or is followed by a moved step
        let mut limit = anchors.range(i..).next().copied().unwrap_or(n - 1);
        for b in outs {
            let first = [&read_by[b.0 as usize], &written_by[b.0 as usize]].iter().filter_map(|l| first_after(l, i)).min();
            if let Some(j) = first {
                limit = limit.min(j - 1);
            }
        }
        for b in &operands {
            if let Some(j) = first_after(&written_by[b.0 as usize], i) {
                limit = limit.min(j - 1);
            }
        }
        let target = match sink {
            Sink::AfterOperands => {
                operands.iter().filter_map(|b| last_up_to(&plain_read_by[b.0 as usize], limit)).filter(|&j| j > i).max().unwrap_or(i)
            }
            Sink::BeforeReader => limit.max(i),
        };
        let result: i64 = results.iter().map(|b| buffer_bytes(p, *b)).sum();
        // operands no later step reads would now live until the step (one read later lives
        // past it anyway)
        let mut longer_ops: Vec<BufferId> = operands.iter().copied().filter(|b| first_after(&read_by[b.0 as usize], i).is_none()).collect();
        longer_ops.sort_by_key(|b| b.0);
        longer_ops.dedup();
        let longer: i64 = longer_ops.iter().map(|b| buffer_bytes(p, *b)).sum();
        if target > i && result > longer {
            let what = match &items[i] {
                Item::Extern(e) => format!("{} by {}", p.externs[*e].callee, p.externs[*e].origin),
                Item::Kernel(_) => "a kernel".to_string(),
            };
            let name = &p.buffer(results[0]).name;
            let until = match sink {
                Sink::AfterOperands => "after the last step that reads its operands",
                Sink::BeforeReader => "just before the first step that reads it",
            };
            decisions.push(format!("order: {name} ({what}) runs {} steps later, {until}", target - i));
            moved[i] = true;
            anchors.insert(target);
            after[target].push(i);
        }
    }
    let mut slots: Vec<Option<Item>> = std::mem::take(items).into_iter().map(Some).collect();
    for j in 0..n {
        if !moved[j] {
            items.extend(slots[j].take());
            // a step moved later after the same one lands before those moved earlier
            for &m in after[j].iter().rev() {
                items.extend(slots[m].take());
            }
        }
    }
    decisions
}
