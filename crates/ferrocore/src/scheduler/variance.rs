//! The one-pass form of a variance, which both rewrites of a long variance use. Lowering writes
//! a variance as two reductions (a mean node, then `Σ(x - mean)²` reading it). A GPU backend
//! rewrites a long one (more than its `welford_min_len` elements) so that it no longer reads the
//! mean and fuses with it: the `split` pass takes those it splits in two stages (each chunk's
//! Welford M2 and sum, combined after), the `welford` pass the others (one pass, Welford's
//! running mean and M2; `welford::takes_one_pass` decides, deferring to `SplitConfig::splits`).

use crate::loop_ir::*;
use crate::symbolic::IndexExpr;

/// The mean buffer the node stops reading, the index it read it at, its new body and the shift
/// its Welford reduction subtracts (the row's first element, a value of the new body that reads
/// only the kept variables), when node `n` is a variance's second pass `Σ(a - mean[kept])²`
/// whose mean node computes `Σa' / c` (or `Σa' · (1/c)`) with `a'` the same expression as `a`,
/// over the same loops.
pub(super) fn one_pass_form(p: &LoopProgram, n: usize) -> Option<(BufferId, IndexExpr, LoopBody, Option<ValueId>)> {
    let node = &p.nodes[n];
    let body = &node.body;
    let store = body.store.as_ref().filter(|s| !s.is_scatter())?;
    let mut reduces = body.exprs.iter().enumerate().filter(|(_, e)| matches!(e, Expr::Reduce(..) | Expr::ArgReduce(..) | Expr::Scan(..)));
    let (rid, Expr::Reduce(ReduceOp::Sum, sq)) = reduces.next()? else { return None };
    if reduces.next().is_some() {
        return None;
    }
    let Expr::Binary(BinaryOp::Mul, d1, d2) = body.expr(*sq) else { return None };
    if d1 != d2 {
        return None;
    }
    let Expr::Binary(BinaryOp::Sub, a, mu) = body.expr(*d1) else { return None };
    let Expr::Load { buf: mean_buf, index: mean_index } = body.expr(*mu) else { return None };
    if mean_index.uses_vars_from(node.ranges.len()) {
        return None;
    }
    // the mean node: the only writer of the buffer, over the same loops, storing Σa' / c there
    let writers: Vec<&LoopNode> = p.nodes.iter().filter(|m| m.output == *mean_buf).collect();
    let [mean] = writers.as_slice() else { return None };
    if mean.ranges != node.ranges || mean.reduction_ranges != node.reduction_ranges {
        return None;
    }
    let mst = mean.body.store.as_ref().filter(|s| !s.is_scatter() && s.index == *mean_index)?;
    // Σa' / c, or Σa' · (1/c) where c is a power of two
    let s = match mean.body.expr(mst.value) {
        Expr::Binary(BinaryOp::TrueDiv | BinaryOp::Mul, s, c) if matches!(mean.body.expr(*c), Expr::Constant(_)) => *s,
        Expr::Binary(BinaryOp::Mul, c, s) if matches!(mean.body.expr(*c), Expr::Constant(_)) => *s,
        _ => return None,
    };
    let Expr::Reduce(ReduceOp::Sum, a2) = mean.body.expr(s) else { return None };
    if !same(&mean.body, *a2, body, *a) {
        return None;
    }

    // the new body: what the store needs, with Σ(a - mean)² replaced by WelfordM2(a)
    let rid = ValueId(rid as u32);
    let live = body.live_from(store.value, &|v| (v == rid).then(|| vec![*a]));
    let mut out = LoopBody::default();
    let mut shift = None;
    let mut map: Vec<Option<ValueId>> = vec![None; body.exprs.len()];
    for (i, e) in body.exprs.iter().enumerate() {
        if !live[i] {
            continue;
        }
        map[i] = if i == rid.0 as usize {
            let x = map[a.0 as usize]?;
            shift = row_first(body, *a, node.ranges.len(), &node.var_ranges(), &mut out);
            let shifted = match shift {
                Some(first) => out.binary(BinaryOp::Sub, x, first),
                None => x,
            };
            Some(out.reduce(ReduceOp::WelfordM2, shifted))
        } else {
            Some(out.push_copy(e, body.dtypes[i], &|v| map[v.0 as usize])?)
        };
    }
    out.set_store(store.index.clone(), map[store.value.0 as usize]?);
    Some((*mean_buf, mean_index.clone(), out, shift))
}

/// `v` of `body` recomputed into `out` at the row's first element (every reduction variable,
/// from `kept` on, at 0); None where it reads what cannot be recomputed there (a reduction, a
/// random number, an index check).
pub(super) fn row_first(body: &LoopBody, v: ValueId, kept: usize, ranges: &[i64], out: &mut LoopBody) -> Option<ValueId> {
    let subst: Vec<Option<IndexExpr>> = (0..ranges.len()).map(|i| (i >= kept).then(IndexExpr::zero)).collect();
    let mut memo: Vec<Option<ValueId>> = vec![None; body.exprs.len()];
    copy_at(body, v, &subst, ranges, out, &mut memo)
}

fn copy_at(
    body: &LoopBody,
    v: ValueId,
    subst: &[Option<IndexExpr>],
    ranges: &[i64],
    out: &mut LoopBody,
    memo: &mut Vec<Option<ValueId>>,
) -> Option<ValueId> {
    if let Some(done) = memo[v.0 as usize] {
        return Some(done);
    }
    let e = body.expr(v);
    let dtype = body.dtype(v);
    let made = match e {
        Expr::Load { buf, index } => out.load(*buf, index.substitute(subst, ranges), dtype),
        Expr::Index(ix) => out.index(ix.substitute(subst, ranges), dtype),
        Expr::LoadIndirect { .. }
        | Expr::Reduce(..)
        | Expr::ArgReduce(..)
        | Expr::Scan(..)
        | Expr::Random { .. }
        | Expr::CheckIndex { .. } => return None,
        _ => {
            let mut operands = Vec::new();
            for x in e.operands() {
                operands.push((x, copy_at(body, x, subst, ranges, out, memo)?));
            }
            out.push_copy(e, dtype, &|x| operands.iter().find(|(o, _)| *o == x).map(|(_, m)| *m))?
        }
    };
    memo[v.0 as usize] = Some(made);
    Some(made)
}

/// Whether `x` of `b1` and `y` of `b2` compute the same value (the same expression tree).
fn same(b1: &LoopBody, x: ValueId, b2: &LoopBody, y: ValueId) -> bool {
    if b1.dtype(x) != b2.dtype(y) {
        return false;
    }
    match (b1.expr(x), b2.expr(y)) {
        (Expr::Load { buf: p, index: i }, Expr::Load { buf: q, index: j }) => p == q && i == j,
        (Expr::Constant(c), Expr::Constant(d)) => c == d,
        (Expr::Index(i), Expr::Index(j)) => i == j,
        (Expr::Unary(o, a), Expr::Unary(p, b)) => o == p && same(b1, *a, b2, *b),
        (Expr::Cast(a), Expr::Cast(b)) => same(b1, *a, b2, *b),
        (Expr::Binary(o, a, c), Expr::Binary(p, b, d)) => o == p && same(b1, *a, b2, *b) && same(b1, *c, b2, *d),
        (Expr::Where(c, a, e), Expr::Where(d, b, f)) => same(b1, *c, b2, *d) && same(b1, *a, b2, *b) && same(b1, *e, b2, *f),
        _ => false,
    }
}
