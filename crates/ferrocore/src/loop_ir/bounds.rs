//! Every load and store stays inside its buffer, whatever the graph's metadata said: the range
//! of each address is computed from the loop variables' ranges (and, for indirect addresses,
//! from the ranges of the index values: a `CheckIndex` is clamped into its dim) and compared
//! with the elements the buffer's layout holds. A lowering that trusted metadata the inputs do
//! not give (an output size overstated) is caught here instead of reading past a buffer. Inputs
//! read through `as_strided` views are checked against their storage at run time instead.

use super::*;
use crate::graph::DType;
use std::collections::HashSet;

/// An access `check_bounds` found: the graph node it computes and a sentence naming the buffer;
/// `proven` where the address range certainly leaves the buffer (metadata the inputs do not
/// give), not where the analysis could not bound an index value (what a lowering computes from
/// data behind a condition it does not follow).
#[derive(Debug, Clone)]
pub struct OutOfBounds {
    pub node: String,
    pub why: String,
    pub proven: bool,
}

/// Inclusive range of an integer value; `UNBOUNDED` ends where nothing bounds it.
pub(super) type Range = (i128, i128);
const LOW: i128 = i128::MIN / 4;
const HIGH: i128 = i128::MAX / 4;
const UNBOUNDED: Range = (LOW, HIGH);

/// One load or store of a node: its buffer, index, indirect terms, the loop ranges it runs
/// over, and "reads" or "writes".
type Access<'a> = (BufferId, &'a IndexExpr, &'a [(ValueId, i64)], &'a [i64], &'static str);

impl LoopProgram {
    /// The first load or store that may address an element outside its buffer; Ok where every
    /// address is in range.
    pub fn check_bounds(&self) -> Result<(), OutOfBounds> {
        let unchecked: HashSet<BufferId> = self.input_storage_views.iter().map(|v| v.input).collect();
        for (ni, n) in self.nodes.iter().enumerate() {
            let ranges = n.var_ranges();
            if ranges.contains(&0) {
                continue; // no iteration runs
            }
            let values = value_ranges(&n.body, &ranges);
            let mut accesses: Vec<Access> = Vec::new();
            for e in &n.body.exprs {
                match e {
                    Expr::Load { buf, index } => accesses.push((*buf, index, &[], &ranges, "reads")),
                    Expr::LoadIndirect { buf, index, terms } => accesses.push((*buf, index, terms, &ranges, "reads")),
                    _ => {}
                }
            }
            if let Some(st) = &n.body.store {
                // a scan stores at every step of its scan variable, other nodes once per output
                let store_ranges = if n.kind() == NodeKind::Scan { &ranges[..] } else { &n.ranges[..] };
                accesses.push((n.output, &st.index, &st.terms, store_ranges, "writes"));
            }
            for (buf, index, terms, at, what) in accesses {
                if unchecked.contains(&buf) {
                    continue;
                }
                let b = self.buffer(buf);
                let node = n.origins.first().cloned().unwrap_or_else(|| self.buffer(n.output).name.clone());
                let holds = b.layout.storage_numel() as i128;
                let Some((lo, hi)) = address_range(index, terms, at, &values) else {
                    let why = format!("{what} {} at an index this check cannot bound:\n{}", b.name, self.node_text(ni));
                    return Err(OutOfBounds { node, why, proven: false });
                };
                if lo < 0 || hi >= holds {
                    let why = format!(
                        "{what} {} at elements {lo}..={hi}, but its layout (shape {:?}, stride {:?}) holds {holds}: \
                         the graph's metadata is not what its inputs give",
                        b.name, b.layout.size, b.layout.stride
                    );
                    return Err(OutOfBounds { node, why, proven: true });
                }
            }
        }
        Ok(())
    }
}

/// The inclusive range of `index + Σ coeff·value` over the variables' ranges; None where a
/// value is unbounded.
fn address_range(index: &IndexExpr, terms: &[(ValueId, i64)], ranges: &[i64], values: &[Range]) -> Option<Range> {
    let (mut lo, mut hi) = index.bounds(ranges);
    for (v, c) in terms {
        let (vlo, vhi) = values.get(v.0 as usize).copied().unwrap_or(UNBOUNDED);
        if vlo <= LOW || vhi >= HIGH {
            return None;
        }
        let c = *c as i128;
        lo += if c >= 0 { c * vlo } else { c * vhi };
        hi += if c >= 0 { c * vhi } else { c * vlo };
    }
    Some((lo, hi))
}

/// The range of each value of a body: exact for index arithmetic (constants, loop indices,
/// checked indices, `+ - * // %`, max/min, selects), the type's range for loaded data.
pub(super) fn value_ranges(body: &LoopBody, ranges: &[i64]) -> Vec<Range> {
    let mut out: Vec<Range> = Vec::with_capacity(body.exprs.len());
    for (i, e) in body.exprs.iter().enumerate() {
        let r = |v: &ValueId| out.get(v.0 as usize).copied().unwrap_or(UNBOUNDED);
        let dt = body.dtypes.get(i).copied().unwrap_or(DType::F32);
        let range = match e {
            _ if !dt.is_integral() => UNBOUNDED,
            Expr::Constant(Scalar::Int(c)) => (*c as i128, *c as i128),
            Expr::Constant(Scalar::Bool(b)) => (*b as i128, *b as i128),
            Expr::Index(ix) => ix.bounds(ranges),
            Expr::CheckIndex { size, .. } => (0, *size as i128 - 1),
            Expr::Cast(x) => {
                let (lo, hi) = r(x);
                let (min, max) = type_range(dt);
                if lo >= min && hi <= max {
                    (lo, hi)
                } else {
                    (min, max)
                }
            }
            Expr::Where(_, a, b) => union(r(a), r(b)),
            Expr::Binary(op, a, b) if op.is_comparison() => (0, 1),
            Expr::Binary(op, a, b) => clamp(binary_range(*op, r(a), r(b)).unwrap_or_else(|| type_range(dt)), dt),
            Expr::Unary(UnaryOp::Neg, x) => clamp((-r(x).1, -r(x).0), dt),
            Expr::Unary(UnaryOp::Abs, x) => {
                let (lo, hi) = r(x);
                clamp(
                    if lo >= 0 {
                        (lo, hi)
                    } else if hi <= 0 {
                        (-hi, -lo)
                    } else {
                        (0, hi.max(-lo))
                    },
                    dt,
                )
            }
            _ => type_range(dt),
        };
        out.push(range);
    }
    out
}

fn union(a: Range, b: Range) -> Range {
    (a.0.min(b.0), a.1.max(b.1))
}

/// `r` within the range of `dt` (an operation whose result would not fit wraps: any value).
fn clamp(r: Range, dt: DType) -> Range {
    let (min, max) = type_range(dt);
    if r.0 >= min && r.1 <= max {
        (r.0.max(LOW), r.1.min(HIGH))
    } else {
        (min, max)
    }
}

fn binary_range(op: BinaryOp, (a0, a1): Range, (b0, b1): Range) -> Option<Range> {
    let sat = |x: i128| x.clamp(LOW, HIGH);
    Some(match op {
        BinaryOp::Add => (sat(a0.saturating_add(b0)), sat(a1.saturating_add(b1))),
        BinaryOp::Sub => (sat(a0.saturating_sub(b1)), sat(a1.saturating_sub(b0))),
        BinaryOp::Mul => {
            let p = [a0.saturating_mul(b0), a0.saturating_mul(b1), a1.saturating_mul(b0), a1.saturating_mul(b1)];
            (sat(*p.iter().min()?), sat(*p.iter().max()?))
        }
        BinaryOp::Maximum => (a0.max(b0), a1.max(b1)),
        BinaryOp::Minimum => (a0.min(b0), a1.min(b1)),
        // a positive divisor: the quotient is monotone in the dividend
        BinaryOp::FloorDiv if b0 > 0 && b1 < HIGH => {
            let q = |a: i128, b: i128| if a <= LOW || a >= HIGH { a } else { a.div_euclid(b) };
            (q(a0, b0).min(q(a0, b1)), q(a1, b0).max(q(a1, b1)))
        }
        BinaryOp::Remainder if b0 > 0 && b1 < HIGH => (0, b1 - 1),
        BinaryOp::LogicalAnd | BinaryOp::LogicalOr | BinaryOp::LogicalXor => (0, 1),
        _ => return None,
    })
}

/// The values a `dt` holds (floats: unbounded).
pub(super) fn type_range(dt: DType) -> Range {
    match dt {
        DType::Bool => (0, 1),
        DType::U8 => (0, u8::MAX as i128),
        DType::I8 => (i8::MIN as i128, i8::MAX as i128),
        DType::I16 => (i16::MIN as i128, i16::MAX as i128),
        DType::I32 => (i32::MIN as i128, i32::MAX as i128),
        _ => UNBOUNDED,
    }
}
