//! Gathers at loop positions as plain loads (`LoopBody::with_direct_reads`), and dead values
//! dropped from a body.

use super::bounds::{type_range, value_ranges};
use super::*;
use crate::graph::DType;
use crate::symbolic::IndexExpr;

impl LoopBody {
    /// The body with gathers whose positions are loop indices made plain loads: a `CheckIndex`
    /// whose value provably lies in its dim becomes that value, and a `LoadIndirect` whose terms
    /// are affine in the loop variables (an `arange` through casts, sums and constant products)
    /// becomes a `Load` at their sum. A position read by `index` with `arange` (FlexAttention's
    /// `document[kv]`, a position embedding) is then a strided read the backend vectorizes, with
    /// no check per element. None where nothing changes.
    pub fn with_direct_reads(&self, ranges: &[i64]) -> Option<LoopBody> {
        let values = value_ranges(self, ranges);
        let mut affine: Vec<Option<IndexExpr>> = Vec::with_capacity(self.exprs.len());
        let mut changed = false;
        for (i, e) in self.exprs.iter().enumerate() {
            let of = |v: &ValueId| affine[v.0 as usize].clone();
            let dt = self.dtypes[i];
            let a = match e {
                _ if !matches!(dt, DType::I32 | DType::I64) => None,
                Expr::Index(ix) => Some(ix.clone()),
                Expr::Constant(Scalar::Int(c)) => Some(IndexExpr::constant(*c)),
                // (a value that fits the narrower type: the cast keeps it)
                Expr::Cast(x) => of(x).filter(|_| {
                    let (lo, hi) = values[x.0 as usize];
                    let (min, max) = type_range(dt);
                    lo >= min && hi <= max
                }),
                Expr::Binary(BinaryOp::Add, x, y) => of(x).zip(of(y)).map(|(p, q)| p.add(&q)),
                Expr::Binary(BinaryOp::Sub, x, y) => of(x).zip(of(y)).map(|(p, q)| p.sub(&q)),
                Expr::Binary(BinaryOp::Mul, x, y) => match (of(x), of(y)) {
                    (Some(p), Some(q)) if q.terms.is_empty() => Some(p.scale(q.constant)),
                    (Some(p), Some(q)) if p.terms.is_empty() => Some(q.scale(p.constant)),
                    _ => None,
                },
                Expr::CheckIndex { value, size, .. } => {
                    let (lo, hi) = values[value.0 as usize];
                    of(value).filter(|_| lo >= 0 && hi < *size as i128)
                }
                _ => None,
            };
            changed |= matches!(e, Expr::CheckIndex { .. }) && a.is_some();
            changed |= matches!(e, Expr::LoadIndirect { terms, .. } if terms.iter().all(|(v, _)| of(v).is_some()));
            affine.push(a);
        }
        if !changed {
            return None;
        }
        let mut out = LoopBody::default();
        out.inlined = self.inlined.clone();
        let mut new_id: Vec<ValueId> = Vec::with_capacity(self.exprs.len());
        for (i, e) in self.exprs.iter().enumerate() {
            let map = |v: ValueId| Some(new_id[v.0 as usize]);
            let id = match e {
                Expr::CheckIndex { value, .. } if affine[i].is_some() => out.cast(new_id[value.0 as usize], DType::I64),
                Expr::LoadIndirect { buf, index, terms } if terms.iter().all(|(v, _)| affine[v.0 as usize].is_some()) => {
                    let at = terms
                        .iter()
                        .fold(index.clone(), |acc, (v, c)| acc.add(&affine[v.0 as usize].clone().unwrap_or_default().scale(*c)));
                    out.load(*buf, at, self.dtypes[i])
                }
                _ => out.push_copy(e, self.dtypes[i], &map).expect("operands are mapped"),
            };
            new_id.push(id);
        }
        out.store = self.store.as_ref().map(|st| Store {
            value: new_id[st.value.0 as usize],
            terms: st.terms.iter().map(|(v, c)| (new_id[v.0 as usize], *c)).collect(),
            ..st.clone()
        });
        Some(out.without_dead_values())
    }

    /// The body with only the values its store reads and its index checks (a bad index is
    /// reported even where nothing reads the gathered value), renumbered in order.
    pub fn without_dead_values(&self) -> LoopBody {
        let Some(st) = &self.store else { return self.clone() };
        let checks = self.exprs.iter().enumerate().filter(|(_, e)| matches!(e, Expr::CheckIndex { .. }));
        let roots: Vec<ValueId> =
            std::iter::once(st.value).chain(st.terms.iter().map(|(v, _)| *v)).chain(checks.map(|(i, _)| ValueId(i as u32))).collect();
        let mut live = vec![false; self.exprs.len()];
        for root in roots {
            for (i, l) in self.live_from(root, &|_| None).into_iter().enumerate() {
                live[i] |= l;
            }
        }
        let mut out = LoopBody::default();
        out.inlined = self.inlined.clone();
        let mut new_id: Vec<Option<ValueId>> = Vec::with_capacity(self.exprs.len());
        for (i, e) in self.exprs.iter().enumerate() {
            let id = if live[i] {
                let map = |v: ValueId| new_id[v.0 as usize];
                out.push_copy(e, self.dtypes[i], &map)
            } else {
                None
            };
            new_id.push(id);
        }
        let id = |v: ValueId| new_id[v.0 as usize].expect("a stored value is live");
        out.store = Some(Store { value: id(st.value), terms: st.terms.iter().map(|(v, c)| (id(*v), *c)).collect(), ..st.clone() });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbolic::Var;

    /// `table[arange(n)[v0] + shift, v1]` over a table of 16 rows, 8 wide, for v0 < `rows`.
    fn gather(shift: i64) -> LoopBody {
        let mut body = LoopBody::default();
        let pos = body.index(IndexExpr::var(Var(0)), DType::I64);
        let shift = body.constant(Scalar::Int(shift), DType::I64);
        let row = body.binary(BinaryOp::Add, pos, shift);
        let row = body.check_index(row, 16, true);
        let x = body.load_indirect(BufferId(0), IndexExpr::var(Var(1)), vec![(row, 8)], DType::F32);
        body.set_store(IndexExpr::var(Var(0)).scale(8).add(&IndexExpr::var(Var(1))), x);
        body
    }

    #[test]
    fn a_gather_at_loop_positions_is_a_plain_load() {
        let body = gather(3).with_direct_reads(&[10, 8]).expect("rows 3..13 of 16 are proven");
        assert_eq!(body.exprs.len(), 1, "{:?}", body.exprs);
        let Expr::Load { index, .. } = &body.exprs[0] else { panic!("{:?}", body.exprs) };
        assert_eq!(*index, IndexExpr::var(Var(0)).scale(8).add(&IndexExpr::var(Var(1))).add_const(24));
    }

    #[test]
    fn an_unread_check_is_kept() {
        // a second, unproven gather nothing reads: its bad indices are still reported
        let mut body = gather(3);
        let pos = body.index(IndexExpr::var(Var(0)), DType::I64);
        let shift = body.constant(Scalar::Int(10), DType::I64);
        let row = body.binary(BinaryOp::Add, pos, shift);
        body.check_index(row, 16, true);
        let body = body.with_direct_reads(&[10, 8]).expect("the first gather is proven");
        assert_eq!(body.exprs.iter().filter(|e| matches!(e, Expr::CheckIndex { .. })).count(), 1);
        assert!(!body.exprs.iter().any(|e| matches!(e, Expr::LoadIndirect { .. })));
    }

    #[test]
    fn a_position_that_may_leave_its_dim_keeps_its_check() {
        // rows 10..20 of 16: the check reports the bad ones
        assert!(gather(10).with_direct_reads(&[10, 8]).is_none());
    }
}
