//! An attention bias rewritten for the kernel's base-2 online softmax: the part that reads the
//! query alone (`q`) taken out of the scores, and the rest scaled by log2(e).
//!
//! A softmax row is unchanged by a term constant along it, so a bias `q(query) + e(query, key)`
//! gives the same probabilities as `e` alone; the query part is needed only in the row's
//! log-sum-exp (added to the forward's, taken from the backward's once per row). A linear
//! position bias (ALiBi: `slope · (key - query)`) then costs one fused multiply-add per score
//! instead of a subtraction, a conversion, a product and an addition. Positions are split
//! about the program's first row (`reference`), so both parts stay as small as the bias is near
//! the diagonal, and as exact.

use crate::graph::DType;
use crate::loop_ir::*;
use crate::symbolic::{Atom, IndexExpr, Var};

/// log2(e): scores in base 2 are exponentiated by one `exp2` each.
pub(super) const LOG2E: f64 = std::f64::consts::LOG2_E;

/// The bias as the kernel computes it: `scores` (base 2, added to the scaled products) and,
/// where one splits off, the query part in natural units: small, or -inf (a closed row), +inf
/// or NaN, which the kernels test per row.
pub(super) struct SplitBias {
    pub body: LoopBody,
    pub scores: ValueId,
    pub query: Option<ValueId>,
}

const QUERY: u8 = 1;
const KEY: u8 = 2;

struct Splitter<'a> {
    src: &'a LoopBody,
    query: Var,
    key: Var,
    reference: Var,
    extent: i64,
    ranges: &'a [i64],
    src_dep: Vec<u8>,
    out: LoopBody,
    out_dep: Vec<u8>,
    copied: Vec<Option<ValueId>>,
}

/// `body`'s stored value split over the variables `query` and `key` (`reference`: a further
/// variable, uniform over the program, near its rows); `ranges`: every variable's extent.
pub(super) fn split_bias(body: &LoopBody, [query, key, reference]: [Var; 3], ranges: &[i64]) -> Option<SplitBias> {
    let extent = ranges.iter().copied().max().unwrap_or(0);
    let root = body.store.as_ref()?.value;
    let mut s = Splitter {
        src: body,
        query,
        key,
        reference,
        extent,
        ranges,
        src_dep: Vec::with_capacity(body.exprs.len()),
        out: LoopBody::default(),
        out_dep: Vec::new(),
        copied: vec![None; body.exprs.len()],
    };
    for i in 0..body.exprs.len() {
        let d = s.dep_of(&body.exprs[i], &s.src_dep);
        s.src_dep.push(d);
    }
    let dt = body.dtype(root);
    let (query_part, rest) = if dt == DType::F32 { s.split(root) } else { (None, Some(s.copy(root))) };
    let query_part = query_part.filter(|q| s.out.expr(*q) != &Expr::Constant(Scalar::Float(0.0)));
    let rest = match rest {
        Some(r) => r,
        None => s.out.constant(Scalar::Float(0.0), dt),
    };
    let scores = s.scale(rest);
    // (the split leaves values no part reads: the unscaled rest)
    let roots: Vec<ValueId> = std::iter::once(scores).chain(query_part).collect();
    let mut live = vec![false; s.out.exprs.len()];
    for root in &roots {
        for (i, l) in s.out.live_from(*root, &|_| None).into_iter().enumerate() {
            live[i] |= l;
        }
    }
    let mut out = LoopBody::default();
    let mut new_id: Vec<Option<ValueId>> = Vec::with_capacity(live.len());
    for (i, e) in s.out.exprs.iter().enumerate() {
        let id = if live[i] { out.push_copy(e, s.out.dtypes[i], &|v| new_id[v.0 as usize]) } else { None };
        new_id.push(id);
    }
    let id = |v: ValueId| new_id[v.0 as usize].expect("a root is live");
    out.set_store(IndexExpr::zero(), id(scores));
    Some(SplitBias { body: out, scores: id(scores), query: query_part.map(id) })
}

impl Splitter<'_> {
    fn var_bits(&self, e: &IndexExpr) -> u8 {
        let mut vs = Vec::new();
        e.vars(&mut vs);
        vs.iter()
            .map(|v| {
                if *v == self.query {
                    QUERY
                } else if *v == self.key {
                    KEY
                } else {
                    0
                }
            })
            .fold(0, |a, b| a | b)
    }

    /// Which of the query and key an expression reads (the batch, head and reference are
    /// uniform over a program's tile).
    fn dep_of(&self, e: &Expr, dep: &[u8]) -> u8 {
        let ops = e.operands().iter().map(|v| dep[v.0 as usize]).fold(0, |a, b| a | b);
        match e {
            Expr::Index(ix) | Expr::Load { index: ix, .. } | Expr::LoadIndirect { index: ix, .. } => ops | self.var_bits(ix),
            _ => ops,
        }
    }

    /// Keeps `out_dep` as long as the output body (after pushes).
    fn sync(&mut self) {
        while self.out_dep.len() < self.out.exprs.len() {
            let i = self.out_dep.len();
            let d = self.dep_of(&self.out.exprs[i], &self.out_dep);
            self.out_dep.push(d);
        }
    }

    fn made(&mut self, v: ValueId) -> ValueId {
        self.sync();
        v
    }

    /// The source value `v` in the output body, as it is.
    fn copy(&mut self, v: ValueId) -> ValueId {
        if let Some(c) = self.copied[v.0 as usize] {
            return c;
        }
        let e = &self.src.exprs[v.0 as usize];
        for op in e.operands() {
            self.copy(op);
        }
        let copied = &self.copied;
        let c = self.out.push_copy(e, self.src.dtype(v), &|x| copied[x.0 as usize]).expect("operands copied first");
        self.sync();
        self.copied[v.0 as usize] = Some(c);
        c
    }

    /// Whether a source value is small or infinite wherever it is computed: built from
    /// positions and constants, not read from memory. Only such a value leaves the scores: eager
    /// adds a huge finite one to each score, where the rounding erases the rest of the bias
    /// (float32's least value on a row averages its keys).
    fn bounded(&self, v: ValueId) -> bool {
        let src = self.src;
        match src.expr(v) {
            Expr::Index(_) | Expr::Constant(Scalar::Int(_) | Scalar::Bool(_)) => true,
            Expr::Constant(Scalar::Float(c)) => !c.is_finite() || c.abs() <= (1 << 24) as f64,
            Expr::Cast(x) | Expr::Unary(_, x) => self.bounded(*x),
            Expr::Binary(_, x, y) => self.bounded(*x) && self.bounded(*y),
            Expr::Where(_, x, y) => self.bounded(*x) && self.bounded(*y),
            _ => false,
        }
    }

    fn binary(&mut self, op: BinaryOp, a: Option<ValueId>, b: Option<ValueId>) -> Option<ValueId> {
        let v = match (a, b) {
            (None, None) => return None,
            (Some(a), None) => a,
            (None, Some(b)) if op == BinaryOp::Sub => self.out.unary(UnaryOp::Neg, b),
            (None, Some(b)) => b,
            (Some(a), Some(b)) => self.out.binary(op, a, b),
        };
        Some(self.made(v))
    }

    /// `v` as (query part, the rest), either absent where it is zero.
    fn split(&mut self, v: ValueId) -> (Option<ValueId>, Option<ValueId>) {
        let dep = self.src_dep[v.0 as usize];
        if dep & KEY == 0 && self.bounded(v) {
            return (Some(self.copy(v)), None);
        }
        let src = self.src;
        let uniform = |x: ValueId, s: &Self| s.src_dep[x.0 as usize] == 0 && s.bounded(x);
        match src.expr(v).clone() {
            Expr::Binary(op @ (BinaryOp::Add | BinaryOp::Sub), x, y) => {
                let ((qx, ex), (qy, ey)) = (self.split(x), self.split(y));
                (self.binary(op, qx, qy), self.binary(op, ex, ey))
            }
            Expr::Unary(UnaryOp::Neg, x) => {
                let (q, e) = self.split(x);
                (self.binary(BinaryOp::Sub, None, q), self.binary(BinaryOp::Sub, None, e))
            }
            Expr::Binary(BinaryOp::Mul, x, u) | Expr::Binary(BinaryOp::Mul, u, x) if uniform(u, self) => {
                let (q, e) = self.split(x);
                let u = self.copy(u);
                (q.map(|p| self.mul(p, u)), e.map(|p| self.mul(p, u)))
            }
            Expr::Cast(x) if !src.dtype(x).is_float() => match self.affine(x).filter(|a| self.fits(*a)) {
                Some(a) => self.split_position(a, src.dtype(x), src.dtype(v)),
                None => (None, Some(self.copy(v))),
            },
            Expr::Where(c, x, y) if is_neg_inf(src, y) || is_neg_inf(src, x) => {
                let open_is_x = is_neg_inf(src, y);
                let (q, e) = self.split(if open_is_x { x } else { y });
                let c = self.copy(c);
                let closed = self.out.constant(Scalar::Float(f64::NEG_INFINITY), src.dtype(v));
                let e = match e {
                    Some(e) => e,
                    None => self.out.constant(Scalar::Float(0.0), src.dtype(v)),
                };
                let w = if open_is_x { self.out.where_(c, e, closed) } else { self.out.where_(c, closed, e) };
                (q, Some(self.made(w)))
            }
            _ => (None, Some(self.copy(v))),
        }
    }

    fn mul(&mut self, a: ValueId, b: ValueId) -> ValueId {
        let v = self.out.binary(BinaryOp::Mul, a, b);
        self.made(v)
    }

    /// An integer of the source as `c + a·query + b·key`.
    fn affine(&self, v: ValueId) -> Option<(i64, i64, i64)> {
        let src = self.src;
        if !matches!(src.dtype(v), DType::I32 | DType::I64) {
            return None;
        }
        let add = |p: (i64, i64, i64), q: (i64, i64, i64), s: i64| (p.0 + s * q.0, p.1 + s * q.1, p.2 + s * q.2);
        match src.expr(v) {
            Expr::Index(ix) => {
                let mut vs = Vec::new();
                ix.vars(&mut vs);
                let plain = ix.terms.iter().all(|(a, _)| matches!(a, Atom::Var(_)));
                let only = vs.iter().all(|x| *x == self.query || *x == self.key);
                (plain && only).then(|| (ix.constant, ix.affine_coeff(self.query).unwrap_or(0), ix.affine_coeff(self.key).unwrap_or(0)))
            }
            Expr::Constant(Scalar::Int(c)) => Some((*c, 0, 0)),
            Expr::Cast(x) => self.affine(*x),
            Expr::Binary(BinaryOp::Add, x, y) => Some(add(self.affine(*x)?, self.affine(*y)?, 1)),
            Expr::Binary(BinaryOp::Sub, x, y) => Some(add(self.affine(*x)?, self.affine(*y)?, -1)),
            Expr::Binary(BinaryOp::Mul, x, y) => match (self.affine(*x)?, self.affine(*y)?) {
                (p, (c, 0, 0)) | ((c, 0, 0), p) => Some((p.0 * c, p.1 * c, p.2 * c)),
                _ => None,
            },
            _ => None,
        }
        .filter(|(c, a, b)| c.abs() < 1 << 40 && a.abs() < 1 << 20 && b.abs() < 1 << 20)
    }

    /// Whether the split's integers stay in int32 (the kernel's positions may be int32 where
    /// the source's sum was int64).
    fn fits(&self, (c, a, b): (i64, i64, i64)) -> bool {
        let most = c.abs() as i128 + (a.abs() as i128 + 2 * b.abs() as i128) * self.extent as i128;
        most < i32::MAX as i128
    }

    /// `float(c + a·query + b·key)` as `float(c + a·query + b·reference)` and
    /// `float(b·(key - reference))`: exact integers, each small near the diagonal.
    fn split_position(&mut self, (c, a, b): (i64, i64, i64), int: DType, float: DType) -> (Option<ValueId>, Option<ValueId>) {
        let var = |v: Var| IndexExpr::var(v);
        let query = var(self.query).scale(a).add(&var(self.reference).scale(b)).add_const(c);
        let key = var(self.key).sub(&var(self.reference)).scale(b);
        let q = self.out.index(query, int);
        let q = self.out.cast(q, float);
        let q = self.made(q);
        if b == 0 {
            return (Some(q), None);
        }
        let k = self.out.index(key, int);
        let k = self.out.cast(k, float);
        (Some(q), Some(self.made(k)))
    }

    /// `v · log2(e)` (an output value), the product taken where it is cheapest: into a
    /// selection's branches, not once per score where avoidable. A finite value stays finite:
    /// a mask of float32's least value (Hugging Face's) must not become -inf, which would
    /// close a row that eager averages over.
    fn scale(&mut self, v: ValueId) -> ValueId {
        let dt = self.out.dtype(v);
        let most = f32::MAX as f64;
        let scaled = match self.out.expr(v).clone() {
            Expr::Constant(Scalar::Float(c)) if c.is_finite() => self.out.constant(Scalar::Float((c * LOG2E).clamp(-most, most)), dt),
            Expr::Constant(Scalar::Float(_)) => v,
            Expr::Where(c, x, y) => {
                let (x, y) = (self.scale(x), self.scale(y));
                self.out.where_(c, x, y)
            }
            Expr::Unary(UnaryOp::Neg, x) => {
                let x = self.scale(x);
                self.out.unary(UnaryOp::Neg, x)
            }
            // (a value known to stay far from float32's bounds: the product alone)
            _ if self.range(v).is_some_and(|(lo, hi)| lo.abs().max(hi.abs()) * LOG2E < most / 2.0) => {
                let l = self.out.constant(Scalar::Float(LOG2E), dt);
                self.out.binary(BinaryOp::Mul, v, l)
            }
            _ => {
                // where(isinf(v), v·L, clamp(v·L)): saturated where only the product overflows
                let l = self.out.constant(Scalar::Float(LOG2E), dt);
                let t = self.out.binary(BinaryOp::Mul, v, l);
                let [lo, hi] = [-most, most].map(|b| self.out.constant(Scalar::Float(b), dt));
                let above = self.out.binary(BinaryOp::Maximum, t, lo);
                let clamped = self.out.binary(BinaryOp::Minimum, above, hi);
                let inf = self.out.unary(UnaryOp::IsInf, v);
                self.out.where_(inf, t, clamped)
            }
        };
        self.made(scaled)
    }
}

impl Splitter<'_> {
    /// The least and greatest values an output value takes, where its expression bounds them
    /// (positions over their ranges, constants, sums, products, exponentials).
    fn range(&self, v: ValueId) -> Option<(f64, f64)> {
        let out = &self.out;
        let finite = |(lo, hi): (f64, f64)| (lo.is_finite() && hi.is_finite()).then_some((lo, hi));
        let r = match out.expr(v) {
            Expr::Index(ix) => {
                let (lo, hi) = ix.bounds(self.ranges);
                (lo as f64, hi as f64)
            }
            Expr::Constant(Scalar::Float(c)) => (*c, *c),
            Expr::Constant(Scalar::Int(c)) => (*c as f64, *c as f64),
            Expr::Cast(x) => self.range(*x)?,
            Expr::Unary(UnaryOp::Neg, x) => {
                let (lo, hi) = self.range(*x)?;
                (-hi, -lo)
            }
            Expr::Unary(UnaryOp::Exp2, x) => {
                let (lo, hi) = self.range(*x)?;
                (lo.exp2(), hi.exp2())
            }
            Expr::Unary(UnaryOp::Exp, x) => {
                let (lo, hi) = self.range(*x)?;
                (lo.exp(), hi.exp())
            }
            Expr::Binary(op @ (BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul), x, y) => {
                let ((a, b), (c, d)) = (self.range(*x)?, self.range(*y)?);
                match op {
                    BinaryOp::Add => (a + c, b + d),
                    BinaryOp::Sub => (a - d, b - c),
                    _ => {
                        let p = [a * c, a * d, b * c, b * d];
                        (p.iter().copied().fold(f64::INFINITY, f64::min), p.iter().copied().fold(f64::NEG_INFINITY, f64::max))
                    }
                }
            }
            _ => return None,
        };
        finite(r)
    }
}

fn is_neg_inf(body: &LoopBody, v: ValueId) -> bool {
    matches!(body.expr(v), Expr::Constant(Scalar::Float(c)) if *c == f64::NEG_INFINITY)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value of `body` as nested text; `scale`'s saturated product `v·log2(e)` as `log2e(v)`
    /// (`full`: written out).
    fn show_as(body: &LoopBody, v: ValueId, full: bool) -> String {
        let s = |x: &ValueId| show_as(body, *x, full);
        if let Expr::Where(c, t, _) = body.expr(v) {
            if let (Expr::Unary(UnaryOp::IsInf, x), Expr::Binary(BinaryOp::Mul, y, _)) = (body.expr(*c), body.expr(*t)) {
                if x == y && !full {
                    return format!("log2e({})", s(x));
                }
            }
        }
        match body.expr(v) {
            Expr::Load { index, .. } => format!("load[{index}]"),
            Expr::Constant(Scalar::Float(c)) if c.abs() == f32::MAX as f64 => format!("{}MAX", if *c < 0.0 { "-" } else { "" }),
            Expr::Constant(Scalar::Float(c)) => format!("{c:.4}"),
            Expr::Constant(Scalar::Int(c)) => c.to_string(),
            Expr::Constant(c) => format!("{c:?}"),
            Expr::Index(ix) => format!("({ix})"),
            Expr::Unary(op, x) => format!("{op:?}({})", s(x)).to_lowercase(),
            Expr::Binary(op, a, b) => format!("{}({}, {})", format!("{op:?}").to_lowercase(), s(a), s(b)),
            Expr::Where(c, a, b) => format!("where({}, {}, {})", s(c), s(a), s(b)),
            Expr::Cast(x) => format!("{:?}({})", body.dtype(v), s(x)).to_lowercase(),
            e => format!("{e:?}"),
        }
    }

    fn show(body: &LoopBody, v: ValueId) -> String {
        show_as(body, v, false)
    }

    /// ALiBi over (query v0, batch v1, head v2, key v3): exp2(-(h + 1) / 2) · float(key - query),
    /// closed where `closed(body, query, key)` is true.
    fn alibi(closed: Option<fn(&mut LoopBody, ValueId, ValueId) -> ValueId>) -> LoopBody {
        let mut body = LoopBody::default();
        let h = body.index(IndexExpr::var(Var(2)).add_const(1), DType::I32);
        let h = body.cast(h, DType::F32);
        let half = body.constant(Scalar::Float(-0.5), DType::F32);
        let e = body.binary(BinaryOp::Mul, h, half);
        let slope = body.unary(UnaryOp::Exp2, e);
        let m = body.index(IndexExpr::var(Var(0)), DType::I32);
        let n = body.index(IndexExpr::var(Var(3)), DType::I32);
        let d = body.binary(BinaryOp::Sub, n, m);
        let d = body.cast(d, DType::F32);
        let mut bias = body.binary(BinaryOp::Mul, slope, d);
        if let Some(closed) = closed {
            let c = closed(&mut body, m, n);
            let inf = body.constant(Scalar::Float(f64::NEG_INFINITY), DType::F32);
            bias = body.where_(c, inf, bias);
        }
        body.set_store(IndexExpr::zero(), bias);
        body
    }

    fn split(body: &LoopBody) -> (String, Option<String>) {
        let s = split_bias(body, [Var(0), Var(3), Var(4)], &[8192, 2, 16, 8192, 8192]).unwrap();
        assert_eq!(s.body.store.as_ref().unwrap().value, s.scores);
        (show(&s.body, s.scores), s.query.map(|q| show(&s.body, q)))
    }

    #[test]
    fn a_linear_position_bias_leaves_a_vector_of_keys_in_the_scores() {
        let (scores, query) = split(&alibi(None));
        let slope = "exp2(mul(f32((v2 + 1)), -0.5000))";
        // (the key vector scaled once per tile, not per score; its range bounded, so the product
        // alone: no saturation)
        assert_eq!(scores, format!("mul(mul(f32((v3 - v4)), {slope}), 1.4427)"));
        assert_eq!(query.unwrap(), format!("mul(f32((-v0 + v4)), {slope})"));
    }

    #[test]
    fn a_mask_stays_on_each_score_and_the_query_part_still_splits() {
        // causal: closed where key > query
        let (scores, query) = split(&alibi(Some(|b, m, n| b.binary(BinaryOp::Gt, n, m))));
        let slope = "exp2(mul(f32((v2 + 1)), -0.5000))";
        assert_eq!(scores, format!("where(gt((v3), (v0)), -inf, mul(mul(f32((v3 - v4)), {slope}), 1.4427))"));
        assert_eq!(query.unwrap(), format!("mul(f32((-v0 + v4)), {slope})"));
    }

    #[test]
    fn a_bias_read_from_memory_stays_in_the_scores() {
        // a learned [query, key] bias plus a per-query one: what memory holds may be float32's
        // least value, which eager's rounding makes erase the rest of the row's bias
        let mut body = LoopBody::default();
        let learned = body.load(BufferId(0), IndexExpr::var(Var(0)).scale(64).add(&IndexExpr::var(Var(3))), DType::F32);
        let per_query = body.load(BufferId(1), IndexExpr::var(Var(0)), DType::F32);
        let bias = body.binary(BinaryOp::Add, learned, per_query);
        body.set_store(IndexExpr::zero(), bias);
        let s = split_bias(&body, [Var(0), Var(3), Var(4)], &[64, 2, 16, 64, 64]).unwrap();
        // (a finite value stays finite: only an infinite one scales to infinity)
        let v = "add(load[64*v0 + v3], load[v0])";
        let full = format!("where(isinf({v}), mul({v}, 1.4427), minimum(maximum(mul({v}, 1.4427), -MAX), MAX))");
        assert_eq!(show_as(&s.body, s.scores, true), full);
        assert_eq!(s.query, None);
    }

    #[test]
    fn a_row_closed_by_the_query_alone_is_the_query_part() {
        // where(query < 4, -inf, 0) + ALiBi: the -inf leaves the scores with the query's
        // position (the kernels give such a row 0, as a closed one)
        let mut body = alibi(None);
        let bias = body.store.as_ref().unwrap().value;
        let m = body.index(IndexExpr::var(Var(0)), DType::I32);
        let four = body.constant(Scalar::Int(4), DType::I32);
        let first = body.binary(BinaryOp::Lt, m, four);
        let inf = body.constant(Scalar::Float(f64::NEG_INFINITY), DType::F32);
        let zero = body.constant(Scalar::Float(0.0), DType::F32);
        let closed = body.where_(first, inf, zero);
        let bias = body.binary(BinaryOp::Add, bias, closed);
        body.set_store(IndexExpr::zero(), bias);
        let (scores, query) = split(&body);
        let slope = "exp2(mul(f32((v2 + 1)), -0.5000))";
        assert_eq!(scores, format!("mul(mul(f32((v3 - v4)), {slope}), 1.4427)"));
        assert_eq!(query.unwrap(), format!("add(mul(f32((-v0 + v4)), {slope}), where(lt((v0), 4), -inf, 0.0000))"));
    }

    #[test]
    fn a_mask_of_the_least_float_stays_finite_in_base_2() {
        // Hugging Face's masks add float32's least value: scaled, it saturates there rather
        // than becoming -inf (a row closed everywhere is averaged over, as eager does)
        let mut body = LoopBody::default();
        let m = body.index(IndexExpr::var(Var(0)), DType::I32);
        let n = body.index(IndexExpr::var(Var(3)), DType::I32);
        let c = body.binary(BinaryOp::Le, n, m);
        let zero = body.constant(Scalar::Float(0.0), DType::F32);
        let least = body.constant(Scalar::Float(f32::MIN as f64), DType::F32);
        let bias = body.where_(c, zero, least);
        body.set_store(IndexExpr::zero(), bias);
        let (scores, query) = split(&body);
        assert_eq!(scores, "where(le((v3), (v0)), 0.0000, -MAX)");
        assert_eq!(query, None);
    }
}
