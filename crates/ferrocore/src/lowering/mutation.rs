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

    /// Emits the deferred input writes. A value that reads a mutated input anywhere but at the
    /// element its own write replaces is first put in a buffer of its own, before any input is
    /// written, so that no write is seen by a read meant for the old contents.
    pub(super) fn lower_mutations(&mut self, mutations: Vec<Mutation>) {
        let written: Vec<BufferId> = mutations.iter().map(|m| self.prog.inputs[m.input]).collect();
        let mut writes = Vec::with_capacity(mutations.len());
        for m in &mutations {
            let dst = self.prog.inputs[m.input];
            let layout = self.prog.buffer(dst).layout.clone();
            let (body, ranges) = write_body(&m.value, &layout);
            let store = &body.store.as_ref().expect("a write stores").index;
            let safe = body.exprs.iter().all(|e| match e {
                Expr::Load { buf, index } => !written.contains(buf) || (*buf == dst && index == store),
                Expr::LoadIndirect { buf, .. } => !written.contains(buf),
                _ => true,
            });
            let (body, ranges) = if safe {
                (body, ranges)
            } else {
                let copy = self.as_node(m.node, |cx| cx.realize(&m.value));
                write_body(&copy, &layout)
            };
            writes.push(LoopNode { output: dst, ranges, reduction_ranges: vec![], body, origins: vec![self.graph.node(m.node).name.clone()] });
        }
        for w in writes {
            self.push_node(w);
        }
    }
}
