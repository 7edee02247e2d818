//! Complex values as pairs of reals (for a backend without complex types, Triton): every
//! pointwise node that moves complex values is rewritten to address complex buffers as arrays
//! of their real component type, element `i` being components `2i` (real) and `2i + 1`
//! (imaginary). A node writing a complex buffer gains an innermost loop variable `p` over the
//! two components and stores component `p` at `2i + p` (loop simplification then merges `p`
//! into a contiguous copy's index). The buffers keep their complex dtype: the wrapper allocates
//! them and hands them to library calls as complex tensors, and passes kernels their real view.
//!
//! Kernels only move complex values (copies, conversions, pads, `cat`, conjugation, real and
//! imaginary parts), as in the C++ backend; a node computing on them stays as it is and the
//! backend reports it unsupported.

use crate::graph::DType;
use crate::loop_ir::*;
use crate::symbolic::{IndexExpr, Var};
use std::collections::HashMap;

/// The real type of one component of a complex type.
pub fn component_type(dt: DType) -> Option<DType> {
    match dt {
        DType::C32 => Some(DType::F16),
        DType::C64 => Some(DType::F32),
        DType::C128 => Some(DType::F64),
        _ => None,
    }
}

/// Rewrites every node it can; returns one decision per rewritten node.
pub fn complex_as_real(p: &mut LoopProgram) -> Vec<String> {
    let mut decisions = Vec::new();
    for n in 0..p.nodes.len() {
        let node = &p.nodes[n];
        let out_dt = p.buffer(node.output).layout.dtype;
        let touches = out_dt.is_complex() || node.body.dtypes.iter().any(|d| d.is_complex());
        if !touches {
            continue;
        }
        if let Some(rewritten) = rewrite(node, out_dt.is_complex()) {
            decisions.push(format!(
                "complex: {} moves complex values as pairs of {}",
                p.buffer(node.output).name,
                component_type(out_dt).unwrap_or(out_dt).torch_name()
            ));
            p.nodes[n] = rewritten;
        }
    }
    decisions
}

/// Which component of a complex value: a fixed one, or the node's component variable `p`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Part {
    Re,
    Im,
    P,
}

struct Rewriter<'a> {
    old: &'a LoopBody,
    new: LoopBody,
    p: Option<IndexExpr>,
    reals: HashMap<ValueId, ValueId>,
    parts: HashMap<(ValueId, Part), ValueId>,
}

fn rewrite(node: &LoopNode, complex_out: bool) -> Option<LoopNode> {
    if !node.reduction_ranges.is_empty() {
        return None;
    }
    let store = node.body.store.as_ref()?;
    if store.is_scatter() && (complex_out || node.body.dtype(store.value).is_complex()) {
        return None;
    }
    let mut ranges = node.ranges.clone();
    let p = complex_out.then(|| IndexExpr::var(Var(node.ranges.len() as u32)));
    if complex_out {
        ranges.push(2);
    }
    let mut rw = Rewriter { old: &node.body, new: LoopBody::default(), p: p.clone(), reals: HashMap::new(), parts: HashMap::new() };
    let (index, value) = if complex_out {
        let v = rw.part(store.value, Part::P)?;
        (store.index.scale(2).add(p.as_ref()?), v)
    } else {
        (store.index.clone(), rw.real(store.value)?)
    };
    let terms: Option<Vec<(ValueId, i64)>> = store.terms.iter().map(|(v, c)| rw.real(*v).map(|r| (r, *c))).collect();
    let terms = terms?;
    let mut body = rw.new;
    if store.is_scatter() {
        body.set_scatter_store(index, terms, value, store.mode);
    } else {
        body.set_store(index, value);
    }
    Some(LoopNode { output: node.output, ranges, reduction_ranges: Vec::new(), body, origins: node.origins.clone(), template: None })
}

impl Rewriter<'_> {
    /// The component selector as an index expression (for addresses).
    fn offset(&self, part: Part) -> Option<IndexExpr> {
        match part {
            Part::Re => Some(IndexExpr::zero()),
            Part::Im => Some(IndexExpr::constant(1)),
            Part::P => self.p.clone(),
        }
    }

    /// `v` for component 0 and `zero` for component 1.
    fn real_part_only(&mut self, part: Part, v: ValueId) -> Option<ValueId> {
        let dt = self.new.dtype(v);
        match part {
            Part::Re => Some(v),
            Part::Im => Some(self.new.constant(Scalar::Int(0), dt)),
            Part::P => {
                let first = self.is_first()?;
                let zero = self.new.constant(Scalar::Int(0), dt);
                Some(self.new.where_(first, v, zero))
            }
        }
    }

    fn is_first(&mut self) -> Option<ValueId> {
        let p = self.p.clone()?;
        let pv = self.new.index(p, DType::I64);
        let zero = self.new.constant(Scalar::Int(0), DType::I64);
        Some(self.new.binary(BinaryOp::Eq, pv, zero))
    }

    /// One component of the complex value `v`, as a real value.
    fn part(&mut self, v: ValueId, part: Part) -> Option<ValueId> {
        if let Some(r) = self.parts.get(&(v, part)) {
            return Some(*r);
        }
        let dt = self.old.dtype(v);
        let comp = component_type(dt)?;
        let r = match self.old.expr(v).clone() {
            Expr::Load { buf, index } => {
                let at = index.scale(2).add(&self.offset(part)?);
                self.new.load(buf, at, comp)
            }
            Expr::LoadIndirect { buf, index, terms } => {
                let at = index.scale(2).add(&self.offset(part)?);
                let terms: Option<Vec<(ValueId, i64)>> = terms.iter().map(|(t, c)| self.real(*t).map(|r| (r, 2 * c))).collect();
                self.new.load_indirect(buf, at, terms?, comp)
            }
            Expr::Constant(s) => {
                let c = self.new.constant(s, comp);
                self.real_part_only(part, c)?
            }
            Expr::Cast(x) => {
                let from = self.old.dtype(x);
                if from.is_complex() {
                    let xp = self.part(x, part)?;
                    self.new.cast(xp, comp)
                } else {
                    let xr = self.real(x)?;
                    let xr = self.new.cast(xr, comp);
                    self.real_part_only(part, xr)?
                }
            }
            Expr::Unary(UnaryOp::Conj, x) => {
                let xp = self.part(x, part)?;
                match part {
                    Part::Re => xp,
                    Part::Im => self.new.unary(UnaryOp::Neg, xp),
                    Part::P => {
                        let first = self.is_first()?;
                        let neg = self.new.unary(UnaryOp::Neg, xp);
                        self.new.where_(first, xp, neg)
                    }
                }
            }
            Expr::Where(c, a, b) => {
                let c = self.real(c)?;
                let a = self.part(a, part)?;
                let b = self.part(b, part)?;
                self.new.where_(c, a, b)
            }
            _ => return None, // arithmetic on complex values: not moved by kernels
        };
        self.parts.insert((v, part), r);
        Some(r)
    }

    /// The real value `v`, its complex operands read by component.
    fn real(&mut self, v: ValueId) -> Option<ValueId> {
        if let Some(r) = self.reals.get(&v) {
            return Some(*r);
        }
        let dt = self.old.dtype(v);
        if dt.is_complex() {
            return None;
        }
        let old = self.old;
        let operand_complex = |x: &ValueId| old.dtype(*x).is_complex();
        let r = match old.expr(v).clone() {
            Expr::Unary(UnaryOp::Real, x) => self.part(x, Part::Re)?,
            Expr::Unary(UnaryOp::Imag, x) => self.part(x, Part::Im)?,
            // ATen's complex -> real conversion keeps the real part
            Expr::Cast(x) if operand_complex(&x) => {
                let re = self.part(x, Part::Re)?;
                self.new.cast(re, dt)
            }
            e if e.operands().iter().any(operand_complex) => return None,
            Expr::Reduce(..) | Expr::ArgReduce(..) | Expr::Scan(..) => return None,
            e => {
                for x in e.operands() {
                    self.real(x)?;
                }
                let reals = &self.reals;
                self.new.push_copy(&e, dt, &|x| reals.get(&x).copied())?
            }
        };
        self.reals.insert(v, r);
        Some(r)
    }
}
