//! Gathers at loop positions as plain loads (`LoopBody::with_direct_reads`), and dead values
//! dropped from a body.

use super::bounds::{type_range, value_ranges, Range};
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
        let affine = self.positions(ranges);
        let of = |v: &ValueId| affine[v.0 as usize].as_ref();
        let changed = self.exprs.iter().enumerate().any(|(i, e)| match e {
            Expr::CheckIndex { .. } => affine[i].is_some(),
            Expr::LoadIndirect { terms, .. } => terms.iter().all(|(v, _)| of(v).is_some()),
            _ => false,
        });
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

    /// Per value, the integer it equals as an index expression in the loop variables, where
    /// it is one: an `arange` through casts, sums and constant products, a float that is exactly
    /// `a / 2^k` truncated (nearest upsampling's `(i * 0.5).to(int64)`, `a >= 0`), and a
    /// `CheckIndex` whose value provably lies in its dim. One pass computes these and the exact
    /// fractions (`a / d`) of float values, each step reading the other's earlier values.
    pub fn positions(&self, ranges: &[i64]) -> Vec<Option<IndexExpr>> {
        let values = value_ranges(self, ranges);
        let mut affine: Vec<Option<IndexExpr>> = Vec::with_capacity(self.exprs.len());
        let mut fractions: Vec<Option<(IndexExpr, i64)>> = Vec::with_capacity(self.exprs.len());
        for i in 0..self.exprs.len() {
            let a = self.integer_position(i, &affine, &fractions, &values, ranges);
            affine.push(a);
            let f = self.exact_fraction(i, &affine, &fractions, ranges);
            fractions.push(f);
        }
        affine
    }

    /// Value `i` as an integer index expression, given those of the values before it.
    fn integer_position(
        &self,
        i: usize,
        affine: &[Option<IndexExpr>],
        fractions: &[Option<(IndexExpr, i64)>],
        values: &[Range],
        ranges: &[i64],
    ) -> Option<IndexExpr> {
        let of = |v: &ValueId| affine[v.0 as usize].clone();
        let dt = self.dtypes[i];
        let fits = |(lo, hi): (i128, i128)| {
            let (min, max) = type_range(dt);
            lo >= min && hi <= max
        };
        match &self.exprs[i] {
            _ if !matches!(dt, DType::I32 | DType::I64) => None,
            Expr::Cast(x) if self.dtypes[x.0 as usize].is_float() => fractions[x.0 as usize]
                .as_ref()
                .filter(|(a, _)| a.bounds(ranges).0 >= 0)
                .map(|(a, den)| a.floordiv(*den, ranges))
                .filter(|a| fits(a.bounds(ranges))),
            Expr::Index(ix) => Some(ix.clone()),
            Expr::Constant(Scalar::Int(c)) => Some(IndexExpr::constant(*c)),
            // (a value that fits the narrower type: the cast keeps it)
            Expr::Cast(x) => of(x).filter(|_| fits(values[x.0 as usize])),
            Expr::Binary(BinaryOp::Add, x, y) => of(x).zip(of(y)).map(|(p, q)| p.add(&q)),
            Expr::Binary(BinaryOp::Sub, x, y) => of(x).zip(of(y)).map(|(p, q)| p.sub(&q)),
            Expr::Binary(BinaryOp::Mul, x, y) => match (of(x), of(y)) {
                (Some(p), Some(q)) if q.terms.is_empty() => Some(p.scale(q.constant)),
                (Some(p), Some(q)) if p.terms.is_empty() => Some(q.scale(p.constant)),
                _ => None,
            },
            Expr::CheckIndex { value, size, .. } => of(value).filter(|a| {
                let (lo, hi) = a.bounds(ranges);
                let (vlo, vhi) = values[value.0 as usize];
                lo.max(vlo) >= 0 && hi.min(vhi) < *size as i128
            }),
            _ => None,
        }
    }

    /// Value `i` as `(a, d)` where it is a float exactly equal to `a / d` (`a` affine in the
    /// loop variables, `d` a power of two): an integer position cast to a float, sums of such,
    /// products with powers of two and small integers, casts that keep every value. Each step is
    /// exact where `|a|` stays below 2^(mantissa bits) of its type, which is checked.
    fn exact_fraction(
        &self,
        i: usize,
        affine: &[Option<IndexExpr>],
        fractions: &[Option<(IndexExpr, i64)>],
        ranges: &[i64],
    ) -> Option<(IndexExpr, i64)> {
        let dt = self.dtypes[i];
        let frac = |v: &ValueId| fractions[v.0 as usize].clone();
        let constant = |v: &ValueId| match self.exprs[v.0 as usize] {
            Expr::Constant(Scalar::Float(c)) => Some(c),
            Expr::Constant(Scalar::Int(c)) => Some(c as f64),
            _ => None,
        };
        let f = match &self.exprs[i] {
            _ if !dt.is_float() => None,
            Expr::Constant(Scalar::Float(c)) if c.fract() == 0.0 && c.abs() < 1e15 => Some((IndexExpr::constant(*c as i64), 1)),
            Expr::Cast(x) if self.dtypes[x.0 as usize].is_integral() => affine[x.0 as usize].clone().map(|a| (a, 1)),
            Expr::Cast(x) => frac(x),
            Expr::Binary(op @ (BinaryOp::Add | BinaryOp::Sub), x, y) => frac(x).zip(frac(y)).map(|((a, da), (b, db))| {
                let d = da.max(db);
                let (a, b) = (a.scale(d / da), b.scale(d / db));
                (if *op == BinaryOp::Add { a.add(&b) } else { a.sub(&b) }, d)
            }),
            Expr::Binary(BinaryOp::Mul, x, y) => {
                let (v, c) = match (constant(x), constant(y)) {
                    (_, Some(c)) => (x, c),
                    (Some(c), None) => (y, c),
                    _ => (x, f64::NAN),
                };
                frac(v).and_then(|(a, d)| scaled_fraction(a, d, c))
            }
            _ => None,
        };
        // exact only while every value fits the type's mantissa
        let mantissa = match dt {
            DType::F64 => 53,
            DType::F32 => 24,
            DType::F16 => 11,
            DType::BF16 => 8,
            _ => 0,
        };
        f.filter(|(a, _)| {
            let (lo, hi) = a.bounds(ranges);
            lo.abs().max(hi.abs()) < 1i128 << mantissa
        })
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

/// `(a / d) * c` as an exact fraction: `c` a power of two (2^-k or 2^k) or a small integer.
fn scaled_fraction(a: IndexExpr, d: i64, c: f64) -> Option<(IndexExpr, i64)> {
    if !c.is_finite() || c <= 0.0 {
        return None;
    }
    if c.fract() == 0.0 && c <= (1 << 20) as f64 {
        return Some((a.scale(c as i64), d));
    }
    let inverse = 1.0 / c;
    let k = inverse as i64;
    (inverse.fract() == 0.0 && k > 0 && (k as u64).is_power_of_two() && d.checked_mul(k)? <= 1 << 40).then(|| (a, d * k))
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

    /// Nearest upsampling's source row, `((float64(v0) * 1.0 + 0.0) as float32 * scale) as
    /// int64`, gathered from a table of 32 rows, 8 wide.
    fn nearest(scale: f64) -> LoopBody {
        let mut body = LoopBody::default();
        let pos = body.index(IndexExpr::var(Var(0)), DType::I64);
        let x = body.cast(pos, DType::F64);
        let one = body.constant(Scalar::Float(1.0), DType::F64);
        let zero = body.constant(Scalar::Float(0.0), DType::F64);
        let x = body.binary(BinaryOp::Mul, x, one);
        let x = body.binary(BinaryOp::Add, x, zero);
        let x = body.cast(x, DType::F32);
        let s = body.constant(Scalar::Float(scale), DType::F32);
        let x = body.binary(BinaryOp::Mul, x, s);
        let row = body.cast(x, DType::I64);
        let row = body.check_index(row, 32, true);
        let v = body.load_indirect(BufferId(0), IndexExpr::var(Var(1)), vec![(row, 8)], DType::F32);
        body.set_store(IndexExpr::var(Var(0)).scale(8).add(&IndexExpr::var(Var(1))), v);
        body
    }

    #[test]
    fn nearest_upsampling_reads_its_source_at_a_floor_division() {
        let ranges = [64, 8];
        let body = nearest(0.5).with_direct_reads(&ranges).expect("rows v0 // 2 < 32 are proven");
        assert_eq!(body.exprs.len(), 1, "{:?}", body.exprs);
        let Expr::Load { index, .. } = &body.exprs[0] else { panic!("{:?}", body.exprs) };
        assert_eq!(*index, IndexExpr::var(Var(0)).floordiv(2, &ranges).scale(8).add(&IndexExpr::var(Var(1))));
        // 65 rows reach row 32: checked
        assert!(nearest(0.5).with_direct_reads(&[65, 8]).is_none());
        // a scale that is no power of two (0.75 = 3/4) is no exact floor division: checked
        assert!(nearest(0.75).with_direct_reads(&[32, 8]).is_none());
    }

    #[test]
    fn a_position_that_may_leave_its_dim_keeps_its_check() {
        // rows 10..20 of 16: the check reports the bad ones
        assert!(gather(10).with_direct_reads(&[10, 8]).is_none());
    }
}
