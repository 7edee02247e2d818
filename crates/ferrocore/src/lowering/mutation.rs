//! Input mutations kept in the graph: `aten.copy_(input, value)`, which AOT autograd appends
//! after everything else for a mutated graph input (a batch norm's running statistics, an
//! in-place op on an argument). The value is written straight into the input's memory by a
//! loop node, which the scheduler fuses like any other (a running-mean update joins the kernel
//! that computes the batch mean), instead of a fresh buffer that Python copies back afterwards.
//!
//! The writes are lowered last, after the graph outputs, so that every value that reads an
//! input's old contents is already in a buffer or a kernel placed before them; the scheduler
//! keeps each write after every kernel that reads the input (`scheduler::choose_kernel`).

use super::*;

/// One `copy_` into a graph input, waiting for the end of lowering. Nodes that read the
/// `copy_`'s result (views of the updated input) read `value`, the new contents.
pub(super) struct Mutation {
    node: NodeId,
    /// Position among the graph inputs.
    input: usize,
    pub(super) value: TensorValue,
}

impl<'g> Ctx<'g> {
    /// Records `copy_(dst, src)` for `lower_mutations`, or says why it cannot be a kernel's
    /// write (then it is an ATen call at the end of the graph).
    pub(super) fn defer_mutation(&mut self, id: NodeId) -> LResult<Mutation> {
        self.current = id;
        let Some(Arg::Node(dst)) = self.arg(0, "self") else { return malformed("copy_ writes into a tensor") };
        let Some(input) = self.graph.inputs.iter().position(|i| i == dst) else {
            return unsupported("copy_ into a value that is not a graph input");
        };
        let layout = self.prog.buffer(self.prog.inputs[input]).layout.clone();
        // (an input without elements is written by a loop of no iteration, whatever its strides)
        if layout.numel() != 0 && !is_dense(&layout.size, &layout.stride) {
            return unsupported("copy_ into an input whose elements overlap or leave gaps");
        }
        let value = self.lower_copy(AtenOp::Copy)?;
        if value.size != layout.size || value.dtype != layout.dtype || value.device != layout.device {
            return malformed(format!("copy_ of {:?} {:?} into {:?} {:?}", value.size, value.dtype, layout.size, layout.dtype));
        }
        Ok(Mutation { node: id, input, value })
    }

    /// Emits the deferred input writes. A write that reads another written input comes before
    /// that input's write (the scheduler keeps each write after the kernels reading its input,
    /// and lets it join the last of them only where those reads are of the element it
    /// overwrites, `PlanBuilder::place`): Adam's parameter update reads the old moments and runs
    /// in one loop with their writes. A value read from inputs that are written in a cycle
    /// (`a, b = b, a`), or from its own input anywhere but at the element it replaces, is first
    /// put in a buffer of its own, before any input is written.
    pub(super) fn lower_mutations(&mut self, mutations: Vec<Mutation>) {
        let written: Vec<BufferId> = mutations.iter().map(|m| self.prog.inputs[m.input]).collect();
        let mut writes = Vec::with_capacity(mutations.len());
        // per write, the other writes whose inputs it reads (they must come after it)
        let mut reads_written: Vec<Vec<usize>> = Vec::with_capacity(mutations.len());
        for (i, m) in mutations.iter().enumerate() {
            let (write, others) = self.write_of(m, i, &written);
            writes.push(Some(write));
            reads_written.push(others);
        }
        // Kahn's order over "i reads j's input": a write goes once no pending write reads its input
        let mut pending_readers = vec![0usize; writes.len()];
        for others in &reads_written {
            others.iter().for_each(|&j| pending_readers[j] += 1);
        }
        let mut ready: std::collections::BTreeSet<usize> = (0..writes.len()).filter(|&i| pending_readers[i] == 0).collect();
        let mut release = |reads: Vec<usize>, ready: &mut std::collections::BTreeSet<usize>| {
            for j in reads {
                pending_readers[j] -= 1;
                if pending_readers[j] == 0 {
                    ready.insert(j);
                }
            }
        };
        let mut left = writes.len();
        while left > 0 {
            let Some(i) = ready.pop_first() else {
                // a cycle: the first write on it reads a copy of its value instead
                let i = (0..writes.len()).find(|&i| writes[i].is_some() && !reads_written[i].is_empty()).expect("a cycle has a reader");
                let layout = self.prog.buffer(written[i]).layout.clone();
                let w = writes[i].as_mut().expect("pending");
                (w.body, w.ranges) = self.copied_write_body(&mutations[i], &layout);
                release(std::mem::take(&mut reads_written[i]), &mut ready);
                continue;
            };
            release(std::mem::take(&mut reads_written[i]), &mut ready);
            self.push_node(writes[i].take().expect("each write goes once"));
            left -= 1;
        }
    }

    /// The loop node of write `i` (of `m`'s value into `written[i]`), and the other writes whose
    /// inputs it reads; a value reading its own input elsewhere than where it stores is copied.
    fn write_of(&mut self, m: &Mutation, i: usize, written: &[BufferId]) -> (LoopNode, Vec<usize>) {
        let dst = written[i];
        let layout = self.prog.buffer(dst).layout.clone();
        let (mut body, mut ranges) = write_body(&m.value, &layout);
        let store = body.store.as_ref().expect("a write stores").index.clone();
        let mut others = Vec::new();
        let mut own_safe = true;
        for e in &body.exprs {
            let (buf, at_store) = match e {
                Expr::Load { buf, index } => (buf, *index == store),
                Expr::LoadIndirect { buf, .. } => (buf, false),
                _ => continue,
            };
            match written.iter().position(|w| w == buf) {
                Some(j) if j == i => own_safe &= at_store,
                Some(j) if !others.contains(&j) => others.push(j),
                _ => {}
            }
        }
        if !own_safe {
            (body, ranges) = self.copied_write_body(m, &layout);
            others.clear();
        }
        let origins = vec![self.graph.node(m.node).name.clone()];
        (LoopNode { output: dst, ranges, reduction_ranges: vec![], body, origins, template: None }, others)
    }

    /// The write of `m`'s value from a copy of it made now, before any input is written.
    fn copied_write_body(&mut self, m: &Mutation, layout: &Layout) -> (LoopBody, Vec<i64>) {
        let copy = self.as_node(m.node, |cx| {
            let fresh = cx.fresh_layout(&m.value.size, m.value.dtype, m.value.device);
            cx.realize_into(&m.value, fresh)
        });
        write_body(&copy, layout)
    }
}
