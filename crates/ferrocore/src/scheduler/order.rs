//! Pass `order`: steps whose results are read much later run later. A GEMM's result exists from
//! its call on; when its operands stay alive until some later step anyway, running it right after
//! that step leaves the steps in between the memory of its result. GPT-2's backward computed the
//! LM head's weight gradient (73.6 MB, read only at the end, where the tied embedding's gradient
//! joins it) before the input gradient's padded weight copy (73.6 MB), so both were live at the
//! backward's peak. Kernels whose results only the graph returns (parameter gradients) sink the
//! same way.

use super::{buffer_bytes, returned_buffers, Item};
use crate::loop_ir::*;

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

/// The results a step allocates when it may sink, else None: a library call (not an ATen
/// fallback) whose results the graph does not return, or a kernel whose results no other step
/// reads and of which the graph returns some (a parameter's gradient summed early in the
/// backward: BERT's decoder bias gradient sat beside its weight gradient's GEMM, the backward's
/// peak); the others live in its registers. `steps_reading` counts, per buffer, the steps that
/// read it.
fn sinking_results(p: &LoopProgram, item: &Item, (reads, writes): &(Vec<BufferId>, Vec<BufferId>), returned: &[bool], steps_reading: &[usize]) -> Option<Vec<BufferId>> {
    let mut outs = writes.clone();
    outs.sort_by_key(|b| b.0);
    outs.dedup();
    match item {
        Item::Extern(e) if !p.externs[*e].fallback && !outs.iter().any(|b| returned[b.0 as usize]) => Some(outs),
        Item::Extern(_) => None,
        Item::Kernel(_) => {
            let read_elsewhere = |b: &BufferId| steps_reading[b.0 as usize] > usize::from(reads.contains(b));
            if outs.iter().any(read_elsewhere) {
                return None;
            }
            let kept: Vec<BufferId> = outs.into_iter().filter(|b| returned[b.0 as usize]).collect();
            (!kept.is_empty()).then_some(kept)
        }
    }
}

/// Moves each step that may sink to just after the last later step that reads one of its
/// operands, when no step in between touches its result or writes what it reads, and its result
/// outweighs the operands that then live longer (the input gradient's GEMM stays before the
/// weight gradient's: its padded weight copy dies with it). Returns the decisions.
pub fn sink_steps(p: &LoopProgram, items: &mut Vec<Item>) -> Vec<String> {
    let mut decisions = Vec::new();
    let returned = returned_buffers(p);
    // (reads, writes) per step, moved with its step
    let mut touched: Vec<(Vec<BufferId>, Vec<BufferId>)> = items.iter().map(|it| touches(p, it)).collect();
    // a step that has moved is a barrier to the others (two GEMMs reading one large operand
    // would otherwise trade places forever)
    let mut moved: Vec<bool> = vec![false; items.len()];
    // what each step allocates if it may sink; a kernel of returned results does not hold a GEMM
    // back: it sinks after the GEMM, not the GEMM after it
    let mut steps_reading = vec![0usize; p.buffers.len()];
    for (reads, _) in &touched {
        let mut seen = reads.clone();
        seen.sort_by_key(|b| b.0);
        seen.dedup();
        seen.iter().for_each(|b| steps_reading[b.0 as usize] += 1);
    }
    let mut sinking: Vec<Option<Vec<BufferId>>> = items.iter().zip(&touched).map(|(it, t)| sinking_results(p, it, t, &returned, &steps_reading)).collect();
    let gradient_kernel = |items: &[Item], sinking: &[Option<Vec<BufferId>>], j: usize| matches!(items[j], Item::Kernel(_)) && sinking[j].is_some();
    let mut i = 0;
    while i < items.len() {
        let results = if moved[i] { None } else { sinking[i].clone() };
        let Some(results) = results else {
            i += 1;
            continue;
        };
        let outs = &touched[i].1;
        let operands: Vec<BufferId> = touched[i].0.iter().copied().filter(|b| !outs.contains(b)).collect();
        // the last later step that reads one of its operands (those live until then anyway), up
        // to the first that touches the result or writes an operand
        let mut target = i;
        for (j, (r, w)) in touched.iter().enumerate().skip(i + 1) {
            if moved[j] || r.iter().chain(w).any(|b| outs.contains(b)) || w.iter().any(|b| operands.contains(b)) {
                break;
            }
            if r.iter().any(|b| operands.contains(b)) && !gradient_kernel(items, &sinking, j) {
                target = j;
            }
        }
        let result: i64 = results.iter().map(|b| buffer_bytes(p, *b)).sum();
        // operands read by no step up to the target would now live until the step
        let mut longer_ops: Vec<BufferId> = operands.iter().copied().filter(|b| !touched[i + 1..=target].iter().any(|(r, _)| r.contains(b))).collect();
        longer_ops.sort_by_key(|b| b.0);
        longer_ops.dedup();
        let longer: i64 = longer_ops.iter().map(|b| buffer_bytes(p, *b)).sum();
        if target > i && result > longer {
            let what = match &items[i] {
                Item::Extern(e) => format!("{} by {}", p.externs[*e].callee, p.externs[*e].origin),
                Item::Kernel(_) => "a kernel".to_string(),
            };
            let item = items.remove(i);
            items.insert(target, item);
            let t = touched.remove(i);
            touched.insert(target, t);
            moved.remove(i);
            moved.insert(target, true);
            let r = sinking.remove(i);
            sinking.insert(target, r);
            let name = &p.buffer(results[0]).name;
            decisions.push(format!("order: {name} ({what}) runs {} steps later, after the last step that reads its operands", target - i));
            continue; // items[i] is now the step that followed
        }
        i += 1;
    }
    decisions
}
