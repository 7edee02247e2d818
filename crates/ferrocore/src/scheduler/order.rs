//! Pass `order`: library calls whose results are read much later run later. A GEMM's result
//! exists from its call on; when its operands stay alive until some later step anyway, running
//! it right after that step leaves the steps in between the memory of its result.
//! GPT-2's backward computed the LM head's weight gradient (73.6 MB, read only at the end, where
//! the tied embedding's gradient joins it) before the input gradient's padded weight copy (73.6
//! MB), so both were live at the backward's peak.

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

/// Moves each library call (not an ATen fallback) to just after the last later step that reads
/// one of its operands, when no step in between touches its result or writes what it reads, and
/// its result outweighs the operands that then live longer (the input gradient's GEMM stays
/// before the weight gradient's: its padded weight copy dies with it). Returns the decisions.
pub fn sink_library_calls(p: &LoopProgram, items: &mut Vec<Item>) -> Vec<String> {
    let mut decisions = Vec::new();
    let returned = returned_buffers(p);
    // (reads, writes) per step, moved with its step
    let mut touched: Vec<(Vec<BufferId>, Vec<BufferId>)> = items.iter().map(|it| touches(p, it)).collect();
    // a call that has moved is a barrier to the others (two GEMMs reading one large operand
    // would otherwise trade places forever)
    let mut moved: Vec<usize> = Vec::new();
    let mut i = 0;
    while i < items.len() {
        let Item::Extern(e) = items[i] else {
            i += 1;
            continue;
        };
        let call = &p.externs[e];
        let outs = &call.outputs;
        if call.fallback || moved.contains(&e) || outs.iter().any(|b| returned[b.0 as usize]) {
            i += 1;
            continue;
        }
        let operands = &touched[i].0;
        // the last later step that reads one of its operands (those live until then anyway), up
        // to the first that touches the result or writes an operand
        let mut target = i;
        for (j, (r, w)) in touched.iter().enumerate().skip(i + 1) {
            let barrier = matches!(items[j], Item::Extern(x) if moved.contains(&x));
            if barrier || r.iter().chain(w).any(|b| outs.contains(b)) || w.iter().any(|b| operands.contains(b)) {
                break;
            }
            if r.iter().any(|b| operands.contains(b)) {
                target = j;
            }
        }
        let result: i64 = outs.iter().map(|b| buffer_bytes(p, *b)).sum();
        // operands read by no step up to the target would now live until the call
        let mut longer_ops: Vec<BufferId> = operands.iter().copied().filter(|b| !touched[i + 1..=target].iter().any(|(r, _)| r.contains(b))).collect();
        longer_ops.sort_by_key(|b| b.0);
        longer_ops.dedup();
        let longer: i64 = longer_ops.iter().map(|b| buffer_bytes(p, *b)).sum();
        if target > i && result > longer {
            let item = items.remove(i);
            items.insert(target, item);
            let t = touched.remove(i);
            touched.insert(target, t);
            moved.push(e);
            let name = &p.buffer(outs[0]).name;
            decisions.push(format!("order: {name} ({} by {}) runs {} steps later, after the last step that reads its operands", call.callee, call.origin, target - i));
            continue; // items[i] is now the step that followed
        }
        i += 1;
    }
    decisions
}
