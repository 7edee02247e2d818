//! Loop bodies: an arena of expressions with typed ids, built with hash-consing (CSE), and the
//! ops-handler interface every consumer of a body goes through.

use super::BufferId;
use crate::graph::DType;
use crate::symbolic::IndexExpr;
use std::collections::HashMap;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct ValueId(pub u32);

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl Scalar {
    fn key(self) -> (u8, u64) {
        match self {
            Scalar::Int(i) => (0, i as u64),
            Scalar::Float(f) => (1, f.to_bits()),
            Scalar::Bool(b) => (2, b as u64),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum UnaryOp {
    Abs,
    Neg,
    Exp,
    Exp2,
    Expm1,
    Log,
    Log2,
    Log10,
    Log1p,
    Sqrt,
    Rsqrt,
    Sin,
    Cos,
    Tan,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Asinh,
    Acosh,
    Atanh,
    Sigmoid,
    Relu,
    Erf,
    Erfc,
    /// log|Γ(x)|.
    Lgamma,
    /// Complex conjugate (complex operands only).
    Conj,
    /// Real / imaginary part of a complex value (the result is the matching real type).
    Real,
    Imag,
    /// exp(x²)·erfc(x), the scaled complementary error function.
    Erfcx,
    Floor,
    Ceil,
    /// Round half to even (torch.round).
    Round,
    Trunc,
    Sign,
    Reciprocal,
    BitwiseNot,
    LogicalNot,
    IsNan,
    IsInf,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    TrueDiv,
    /// Python floor division (ints and floats).
    FloorDiv,
    /// C truncating division.
    TruncDiv,
    /// Python remainder (sign of divisor).
    Remainder,
    /// C fmod (sign of dividend).
    Fmod,
    Pow,
    /// NaN-propagating maximum / minimum.
    Maximum,
    Minimum,
    Atan2,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    LogicalAnd,
    LogicalOr,
    LogicalXor,
    BitAnd,
    BitOr,
    BitXor,
    /// Shifts with torch's semantics for out-of-range counts.
    LShift,
    RShift,
}

impl BinaryOp {
    pub fn is_comparison(self) -> bool {
        matches!(self, BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ReduceOp {
    Sum,
    Prod,
    /// NaN-propagating, like torch.amax/amin.
    Max,
    Min,
    Any,
    /// Index (int64, row-major over the reduction) of the first maximum / minimum; NaN wins.
    ArgMax,
    ArgMin,
    /// Σ(x - mean(x))² over the reduction in one pass (Welford's running mean and M2): what the
    /// `welford` pass makes of a variance's second pass, for backends that ask for it.
    WelfordM2,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    Load {
        buf: BufferId,
        index: IndexExpr,
    },
    Constant(Scalar),
    Index(IndexExpr),
    Unary(UnaryOp, ValueId),
    /// Operands have equal dtype; the result dtype is the operand dtype, or bool for comparisons.
    Binary(BinaryOp, ValueId, ValueId),
    Where(ValueId, ValueId, ValueId),
    Cast(ValueId),
    /// Combines its operand over the reduction variables; valid after the reduction loop.
    Reduce(ReduceOp, ValueId),
    /// ArgMax/ArgMin of a value, given the value's reduction index (int64).
    ArgReduce(ReduceOp, ValueId, ValueId),
    /// The inclusive running combine of its operand along the (single) reduction variable,
    /// valid inside the loop: the node stores it at every step (cumsum, cumprod).
    Scan(ReduceOp, ValueId),
    /// A load at `index + Σ coeff·value`, the values being int64 indices computed in the body
    /// (gather, embedding, padding). Each value must come from `CheckIndex` or be in range.
    LoadIndirect {
        buf: BufferId,
        index: IndexExpr,
        terms: Vec<(ValueId, i64)>,
    },
    /// A counter-based random number (Philox 4x32-10) for element `offset` of the stream `seed`:
    /// uniform in [0, 1) or standard normal, as float32.
    Random {
        normal: bool,
        seed: ValueId,
        offset: ValueId,
    },
    /// An int64 index into a dim of `size`: negatives wrap when `wrap`; the result is clamped
    /// into range, and an out-of-range input makes the kernel report an error to the wrapper.
    CheckIndex {
        value: ValueId,
        size: i64,
        wrap: bool,
    },
}

impl Expr {
    /// The values this expression reads, in operand order.
    pub fn operands(&self) -> Vec<ValueId> {
        match self {
            Expr::Load { .. } | Expr::Constant(_) | Expr::Index(_) => Vec::new(),
            Expr::Unary(_, x) | Expr::Cast(x) | Expr::Reduce(_, x) | Expr::Scan(_, x) => vec![*x],
            Expr::Binary(_, a, b) | Expr::ArgReduce(_, a, b) => vec![*a, *b],
            Expr::Random { seed, offset, .. } => vec![*seed, *offset],
            Expr::Where(c, a, b) => vec![*c, *a, *b],
            Expr::LoadIndirect { terms, .. } => terms.iter().map(|(v, _)| *v).collect(),
            Expr::CheckIndex { value, .. } => vec![*value],
        }
    }
}

#[derive(Clone, Hash, PartialEq, Eq, Debug)]
enum Key {
    Load(BufferId, IndexExpr),
    Constant((u8, u64), DType),
    Index(IndexExpr, DType),
    Unary(UnaryOp, ValueId),
    Binary(BinaryOp, ValueId, ValueId),
    Where(ValueId, ValueId, ValueId),
    Cast(ValueId, DType),
    Reduce(ReduceOp, ValueId),
    ArgReduce(ReduceOp, ValueId, ValueId),
    Scan(ReduceOp, ValueId),
    Random(bool, ValueId, ValueId),
    LoadIndirect(BufferId, IndexExpr, Vec<(ValueId, i64)>),
    CheckIndex(ValueId, i64, bool),
}

/// How a store combines with what the buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreMode {
    /// `output[i] = value`.
    Set,
    /// `output[i] = op(output[i], value)` (Sum, Prod, Max, Min): accumulating scatters.
    Combine(ReduceOp),
}

/// The single store of a body: `output[index + Σ coeff·term] = value`. A store with `terms`
/// (data-dependent addresses) or a combining mode is a scatter: it updates a buffer an earlier
/// node filled, and the scheduler keeps it in a kernel of its own.
#[derive(Clone, Debug, PartialEq)]
pub struct Store {
    pub index: IndexExpr,
    pub value: ValueId,
    pub terms: Vec<(ValueId, i64)>,
    pub mode: StoreMode,
}

impl Store {
    pub fn is_scatter(&self) -> bool {
        !self.terms.is_empty() || self.mode != StoreMode::Set
    }
}

/// `exprs[i]` has type `dtypes[i]` (the compute type: half types are float32 with the rounding
/// of the half type applied by `Cast`). Expressions only refer to earlier ids.
#[derive(Clone, Debug, Default)]
pub struct LoopBody {
    pub exprs: Vec<Expr>,
    pub dtypes: Vec<DType>,
    pub store: Option<Store>,
    cse: HashMap<Key, ValueId>,
    /// Graph nodes whose lazily computed values this body evaluates, inputs first (provenance:
    /// a fused kernel's name and source lines).
    pub inlined: Vec<String>,
}

impl LoopBody {
    /// Records that this body evaluates graph node `name`'s value (once).
    pub fn note_inlined(&mut self, name: &str) {
        if !self.inlined.iter().any(|n| n == name) {
            self.inlined.push(name.to_string());
        }
    }
    pub fn dtype(&self, v: ValueId) -> DType {
        self.dtypes[v.0 as usize]
    }
    pub fn expr(&self, v: ValueId) -> &Expr {
        &self.exprs[v.0 as usize]
    }
    fn push(&mut self, key: Key, e: Expr, dtype: DType) -> ValueId {
        if let Some(v) = self.cse.get(&key) {
            return *v;
        }
        let id = ValueId(self.exprs.len() as u32);
        self.exprs.push(e);
        self.dtypes.push(dtype);
        self.cse.insert(key, id);
        id
    }
    pub fn load(&mut self, buf: BufferId, index: IndexExpr, dtype: DType) -> ValueId {
        self.push(Key::Load(buf, index.clone()), Expr::Load { buf, index }, dtype)
    }
    pub fn constant(&mut self, s: Scalar, dtype: DType) -> ValueId {
        let s = match (s, dtype.is_float(), dtype) {
            (_, _, DType::Bool) => Scalar::Bool(match s {
                Scalar::Bool(b) => b,
                Scalar::Int(i) => i != 0,
                Scalar::Float(f) => f != 0.0,
            }),
            (Scalar::Int(i), true, _) => Scalar::Float(i as f64),
            (Scalar::Bool(b), true, _) => Scalar::Float(b as i64 as f64),
            (Scalar::Float(f), false, _) => Scalar::Int(f as i64),
            (Scalar::Bool(b), false, _) => Scalar::Int(b as i64),
            (s, _, _) => s,
        };
        self.push(Key::Constant(s.key(), dtype), Expr::Constant(s), dtype)
    }
    pub fn index(&mut self, e: IndexExpr, dtype: DType) -> ValueId {
        self.push(Key::Index(e.clone(), dtype), Expr::Index(e), dtype)
    }
    pub fn unary(&mut self, op: UnaryOp, x: ValueId) -> ValueId {
        let dt = match op {
            UnaryOp::IsNan | UnaryOp::IsInf | UnaryOp::LogicalNot => DType::Bool,
            UnaryOp::Real | UnaryOp::Imag => match self.dtype(x) {
                DType::C32 => DType::F16,
                DType::C64 => DType::F32,
                DType::C128 => DType::F64,
                d => d,
            },
            _ => self.dtype(x),
        };
        self.push(Key::Unary(op, x), Expr::Unary(op, x), dt)
    }
    /// Operands are cast to a common type first (the caller chooses it by torch's rules).
    pub fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        let (da, db) = (self.dtype(a), self.dtype(b));
        let common = crate::graph::promote_types(da, db);
        let a = self.cast(a, common);
        let b = self.cast(b, common);
        let dt = match op {
            _ if op.is_comparison() => DType::Bool,
            BinaryOp::LogicalAnd | BinaryOp::LogicalOr | BinaryOp::LogicalXor => DType::Bool,
            _ => common,
        };
        if op == BinaryOp::TrueDiv {
            if let Some(r) = self.power_of_two_reciprocal(b, common) {
                // the same correctly rounded result as the division, without its cost
                let r = self.constant(Scalar::Float(r), common);
                return self.push(Key::Binary(BinaryOp::Mul, a, r), Expr::Binary(BinaryOp::Mul, a, r), dt);
            }
        }
        self.push(Key::Binary(op, a, b), Expr::Binary(op, a, b), dt)
    }
    /// 1/c when `v` is a constant power of two c whose reciprocal is a normal number of `dt`.
    fn power_of_two_reciprocal(&self, v: ValueId, dt: DType) -> Option<f64> {
        let Expr::Constant(Scalar::Float(c)) = self.expr(v) else { return None };
        let (lo, hi) = match dt {
            DType::F32 => (-126, 127),
            DType::F64 => (-1022, 1023),
            _ => return None,
        };
        let bits = c.abs().to_bits();
        let exponent = ((bits >> 52) & 0x7ff) as i64 - 1023;
        let power = bits & ((1u64 << 52) - 1) == 0 && c.is_finite() && *c != 0.0;
        (power && (lo..=hi).contains(&-exponent)).then(|| 1.0 / c)
    }

    pub fn where_(&mut self, c: ValueId, a: ValueId, b: ValueId) -> ValueId {
        let common = crate::graph::promote_types(self.dtype(a), self.dtype(b));
        let c = self.cast(c, DType::Bool);
        let a = self.cast(a, common);
        let b = self.cast(b, common);
        self.push(Key::Where(c, a, b), Expr::Where(c, a, b), common)
    }
    pub fn cast(&mut self, x: ValueId, to: DType) -> ValueId {
        if self.dtype(x) == to {
            return x;
        }
        self.push(Key::Cast(x, to), Expr::Cast(x), to)
    }
    pub fn reduce(&mut self, op: ReduceOp, x: ValueId) -> ValueId {
        let dt = if op == ReduceOp::Any { DType::Bool } else { self.dtype(x) };
        let x = if op == ReduceOp::Any { self.cast(x, DType::Bool) } else { x };
        self.push(Key::Reduce(op, x), Expr::Reduce(op, x), dt)
    }
    pub fn arg_reduce(&mut self, op: ReduceOp, value: ValueId, index: ValueId) -> ValueId {
        let index = self.cast(index, DType::I64);
        self.push(Key::ArgReduce(op, value, index), Expr::ArgReduce(op, value, index), DType::I64)
    }
    pub fn load_indirect(&mut self, buf: BufferId, index: IndexExpr, terms: Vec<(ValueId, i64)>, dtype: DType) -> ValueId {
        let terms: Vec<(ValueId, i64)> = terms.into_iter().map(|(v, c)| (self.cast(v, DType::I64), c)).collect();
        self.push(Key::LoadIndirect(buf, index.clone(), terms.clone()), Expr::LoadIndirect { buf, index, terms }, dtype)
    }
    pub fn random(&mut self, normal: bool, seed: ValueId, offset: ValueId) -> ValueId {
        let seed = self.cast(seed, DType::I64);
        let offset = self.cast(offset, DType::I64);
        self.push(Key::Random(normal, seed, offset), Expr::Random { normal, seed, offset }, DType::F32)
    }
    pub fn scan(&mut self, op: ReduceOp, x: ValueId) -> ValueId {
        self.push(Key::Scan(op, x), Expr::Scan(op, x), self.dtype(x))
    }
    pub fn check_index(&mut self, value: ValueId, size: i64, wrap: bool) -> ValueId {
        let value = self.cast(value, DType::I64);
        self.push(Key::CheckIndex(value, size, wrap), Expr::CheckIndex { value, size, wrap }, DType::I64)
    }
    pub fn set_store(&mut self, index: IndexExpr, value: ValueId) {
        self.store = Some(Store { index, value, terms: Vec::new(), mode: StoreMode::Set });
    }
    /// A scatter store: `terms` are int64 indices computed in the body (each from `CheckIndex`
    /// or clamped into range).
    pub fn set_scatter_store(&mut self, index: IndexExpr, terms: Vec<(ValueId, i64)>, value: ValueId, mode: StoreMode) {
        let terms = terms.into_iter().map(|(v, c)| (self.cast(v, DType::I64), c)).collect();
        self.store = Some(Store { index, value, terms, mode });
    }

    /// Runs the body through a handler in arena order, returning the handler's value per id.
    pub fn visit<H: OpsHandler>(&self, h: &mut H) -> Vec<H::V> {
        let mut vals: Vec<H::V> = Vec::with_capacity(self.exprs.len());
        for (i, e) in self.exprs.iter().enumerate() {
            let dt = self.dtypes[i];
            let v = match e {
                Expr::Load { buf, index } => h.load(*buf, index, dt),
                Expr::Constant(s) => h.constant(*s, dt),
                Expr::Index(ix) => h.index_expr(ix, dt),
                Expr::Unary(op, x) => h.unary(*op, &vals[x.0 as usize], self.dtype(*x), dt),
                Expr::Binary(op, a, b) => h.binary(*op, &vals[a.0 as usize], &vals[b.0 as usize], self.dtype(*a), dt),
                Expr::Where(c, a, b) => h.where_(&vals[c.0 as usize], &vals[a.0 as usize], &vals[b.0 as usize], dt),
                Expr::Cast(x) => h.cast(&vals[x.0 as usize], self.dtype(*x), dt),
                Expr::Reduce(op, x) => h.reduce(*op, &vals[x.0 as usize], dt, ValueId(i as u32)),
                Expr::Scan(op, x) => h.scan(*op, &vals[x.0 as usize], dt),
                Expr::Random { normal, seed, offset } => h.random(*normal, &vals[seed.0 as usize], &vals[offset.0 as usize]),
                Expr::ArgReduce(op, x, ix) => h.arg_reduce(*op, &vals[x.0 as usize], &vals[ix.0 as usize], self.dtype(*x)),
                Expr::LoadIndirect { buf, index, terms } => {
                    let t: Vec<(H::V, i64)> = terms.iter().map(|(v, c)| (vals[v.0 as usize].clone(), *c)).collect();
                    h.load_indirect(*buf, index, &t, dt)
                }
                Expr::CheckIndex { value, size, wrap } => h.check_index(&vals[value.0 as usize], *size, *wrap),
            };
            vals.push(v);
        }
        if let Some(st) = &self.store {
            let t: Vec<(H::V, i64)> = st.terms.iter().map(|(v, c)| (vals[v.0 as usize].clone(), *c)).collect();
            h.store(&st.index, &t, st.mode, &vals[st.value.0 as usize], self.dtype(st.value));
        }
        vals
    }
}

/// One interface over loop bodies: printers, analyses and backends implement it.
pub trait OpsHandler {
    type V: Clone;
    fn load(&mut self, buf: BufferId, index: &IndexExpr, dtype: DType) -> Self::V;
    fn constant(&mut self, value: Scalar, dtype: DType) -> Self::V;
    fn index_expr(&mut self, e: &IndexExpr, dtype: DType) -> Self::V;
    fn unary(&mut self, op: UnaryOp, x: &Self::V, x_dtype: DType, dtype: DType) -> Self::V;
    fn binary(&mut self, op: BinaryOp, a: &Self::V, b: &Self::V, operand_dtype: DType, dtype: DType) -> Self::V;
    fn where_(&mut self, c: &Self::V, a: &Self::V, b: &Self::V, dtype: DType) -> Self::V;
    fn cast(&mut self, x: &Self::V, from: DType, to: DType) -> Self::V;
    fn reduce(&mut self, op: ReduceOp, x: &Self::V, dtype: DType, id: ValueId) -> Self::V;
    fn arg_reduce(&mut self, op: ReduceOp, value: &Self::V, index: &Self::V, value_dtype: DType) -> Self::V;
    fn scan(&mut self, op: ReduceOp, x: &Self::V, dtype: DType) -> Self::V;
    fn random(&mut self, normal: bool, seed: &Self::V, offset: &Self::V) -> Self::V;
    fn load_indirect(&mut self, buf: BufferId, index: &IndexExpr, terms: &[(Self::V, i64)], dtype: DType) -> Self::V;
    fn check_index(&mut self, value: &Self::V, size: i64, wrap: bool) -> Self::V;
    fn store(&mut self, index: &IndexExpr, terms: &[(Self::V, i64)], mode: StoreMode, value: &Self::V, dtype: DType);
}

impl LoopBody {
    /// The same body with every index expression rewritten (loop-variable substitution).
    pub fn rewrite_indices(&self, f: &dyn Fn(&IndexExpr) -> IndexExpr) -> LoopBody {
        let mut out = LoopBody::default();
        for (i, e) in self.exprs.iter().enumerate() {
            let e2 = match e {
                Expr::Load { buf, index } => Expr::Load { buf: *buf, index: f(index) },
                Expr::LoadIndirect { buf, index, terms } => Expr::LoadIndirect { buf: *buf, index: f(index), terms: terms.clone() },
                Expr::Index(ix) => Expr::Index(f(ix)),
                other => other.clone(),
            };
            out.exprs.push(e2);
            out.dtypes.push(self.dtypes[i]);
        }
        out.store = self.store.as_ref().map(|s| Store { index: f(&s.index), ..s.clone() });
        out
    }

    /// Which expressions `root` depends on. `operands(i)` may give expression `i` other operands
    /// than its own (a rewrite that will replace it), or none (a leaf).
    pub fn live_from(&self, root: ValueId, operands: &dyn Fn(ValueId) -> Option<Vec<ValueId>>) -> Vec<bool> {
        let mut live = vec![false; self.exprs.len()];
        live[root.0 as usize] = true;
        for i in (0..self.exprs.len()).rev() {
            if !live[i] {
                continue;
            }
            let id = ValueId(i as u32);
            for v in operands(id).unwrap_or_else(|| self.exprs[i].operands()) {
                live[v.0 as usize] = true;
            }
        }
        live
    }

    /// A body of `root` and what it depends on alone (no store), and `root`'s id there.
    pub fn value_alone(&self, root: ValueId) -> (LoopBody, ValueId) {
        let live = self.live_from(root, &|_| None);
        let mut out = LoopBody::default();
        let mut new_id: Vec<Option<ValueId>> = Vec::with_capacity(self.exprs.len());
        for (i, e) in self.exprs.iter().enumerate() {
            let id = if live[i] { out.push_copy(e, self.dtypes[i], &|v| new_id[v.0 as usize]) } else { None };
            new_id.push(id);
        }
        let id = new_id[root.0 as usize].expect("a root is live");
        (out, id)
    }

    /// Appends a copy of `e` (of dtype `dtype`, from another body) whose operands `map` gives
    /// in this body; None when an operand has no value here.
    pub fn push_copy(&mut self, e: &Expr, dtype: DType, map: &dyn Fn(ValueId) -> Option<ValueId>) -> Option<ValueId> {
        Some(match e {
            Expr::Load { buf, index } => self.load(*buf, index.clone(), dtype),
            Expr::Constant(c) => self.constant(*c, dtype),
            Expr::Index(ix) => self.index(ix.clone(), dtype),
            Expr::Unary(op, x) => self.unary(*op, map(*x)?),
            Expr::Binary(op, a, b) => self.binary(*op, map(*a)?, map(*b)?),
            Expr::Where(c, a, b) => self.where_(map(*c)?, map(*a)?, map(*b)?),
            Expr::Cast(x) => self.cast(map(*x)?, dtype),
            Expr::Reduce(op, x) => self.reduce(*op, map(*x)?),
            Expr::ArgReduce(op, x, ix) => self.arg_reduce(*op, map(*x)?, map(*ix)?),
            Expr::Scan(op, x) => self.scan(*op, map(*x)?),
            Expr::LoadIndirect { buf, index, terms } => {
                let terms: Option<Vec<(ValueId, i64)>> = terms.iter().map(|(v, c)| map(*v).map(|m| (m, *c))).collect();
                self.load_indirect(*buf, index.clone(), terms?, dtype)
            }
            Expr::Random { normal, seed, offset } => self.random(*normal, map(*seed)?, map(*offset)?),
            Expr::CheckIndex { value, size, wrap } => self.check_index(map(*value)?, *size, *wrap),
        })
    }

    /// The body with its int64 arithmetic on loop indices and constants (index values, sums,
    /// differences, products, selections and widening casts of them) computed in int32 wherever
    /// every value it can take over `ranges` fits: the same values, at half the cost on a GPU
    /// (an int64 operation is two, an int64-to-float conversion several). A value read by
    /// anything else is widened back to int64 where it is read.
    pub fn with_narrow_index_arithmetic(&self, ranges: &[i64]) -> LoopBody {
        type Range = (i128, i128);
        let fits = |(lo, hi): Range| lo >= i32::MIN as i128 && hi <= i32::MAX as i128;
        let mut range: Vec<Option<Range>> = Vec::with_capacity(self.exprs.len());
        for (i, e) in self.exprs.iter().enumerate() {
            let of = |v: &ValueId| range[v.0 as usize];
            let r = if self.dtypes[i] != DType::I64 {
                None
            } else {
                match e {
                    Expr::Index(ix) => Some(ix.bounds(ranges)),
                    Expr::Constant(Scalar::Int(c)) => Some((*c as i128, *c as i128)),
                    Expr::Binary(op @ (BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul), a, b) => {
                        of(a).zip(of(b)).map(|((al, ah), (bl, bh))| match op {
                            BinaryOp::Add => (al + bl, ah + bh),
                            BinaryOp::Sub => (al - bh, ah - bl),
                            _ => {
                                let p = [al * bl, al * bh, ah * bl, ah * bh];
                                (*p.iter().min().unwrap(), *p.iter().max().unwrap())
                            }
                        })
                    }
                    Expr::Where(_, a, b) => of(a).zip(of(b)).map(|((al, ah), (bl, bh))| (al.min(bl), ah.max(bh))),
                    Expr::Cast(x) => match self.dtypes[x.0 as usize] {
                        DType::Bool => Some((0, 1)),
                        DType::I32 => Some((i32::MIN as i128, i32::MAX as i128)),
                        _ => None,
                    },
                    _ => None,
                }
            };
            range.push(r.filter(|r| fits(*r)));
        }
        let narrow: Vec<bool> = range.iter().map(Option::is_some).collect();
        let mut out = LoopBody { inlined: self.inlined.clone(), ..LoopBody::default() };
        let mut new_id: Vec<ValueId> = Vec::with_capacity(self.exprs.len());
        let mut wide: HashMap<u32, ValueId> = HashMap::new();
        for (i, e) in self.exprs.iter().enumerate() {
            let id = if narrow[i] {
                // (its operands are narrow too: only they give a range)
                let map = |v: ValueId| Some(new_id[v.0 as usize]);
                out.push_copy(e, DType::I32, &map).expect("operands are mapped")
            } else if reads_narrow(e, self.dtypes[i], &narrow) {
                let map = |v: ValueId| Some(new_id[v.0 as usize]);
                out.push_copy(e, self.dtypes[i], &map).expect("operands are mapped")
            } else {
                for v in e.operands() {
                    if narrow[v.0 as usize] && !wide.contains_key(&v.0) {
                        let w = out.cast(new_id[v.0 as usize], DType::I64);
                        wide.insert(v.0, w);
                    }
                }
                let map = |v: ValueId| Some(if narrow[v.0 as usize] { wide[&v.0] } else { new_id[v.0 as usize] });
                out.push_copy(e, self.dtypes[i], &map).expect("operands are mapped")
            };
            new_id.push(id);
        }
        // (a stored value and a scatter's terms are read as int64)
        let as_read = |out: &mut LoopBody, v: ValueId| {
            if narrow[v.0 as usize] {
                out.cast(new_id[v.0 as usize], DType::I64)
            } else {
                new_id[v.0 as usize]
            }
        };
        if let Some(st) = &self.store {
            let value = as_read(&mut out, st.value);
            let terms = st.terms.iter().map(|(v, c)| (as_read(&mut out, *v), *c)).collect();
            out.store = Some(Store { value, terms, ..st.clone() });
        }
        out
    }

    /// Every index expression of the body (loads, index values, the store).
    pub fn indices(&self) -> Vec<&IndexExpr> {
        let mut out: Vec<&IndexExpr> = self
            .exprs
            .iter()
            .filter_map(|e| match e {
                Expr::Load { index, .. } | Expr::LoadIndirect { index, .. } => Some(index),
                Expr::Index(ix) => Some(ix),
                _ => None,
            })
            .collect();
        if let Some(s) = &self.store {
            out.push(&s.index);
        }
        out
    }
}

/// Whether `e` (of `dtype`) gives the same value from its int operands in int32 as in int64: a
/// conversion to a float or a truth value, a comparison of two narrowed values.
fn reads_narrow(e: &Expr, dtype: DType, narrow: &[bool]) -> bool {
    use BinaryOp::*;
    match e {
        Expr::Cast(x) => narrow[x.0 as usize] && (dtype.is_float() || dtype == DType::Bool),
        Expr::Binary(Eq | Ne | Lt | Le | Gt | Ge, a, b) => narrow[a.0 as usize] && narrow[b.0 as usize],
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbolic::Var;

    #[test]
    fn index_arithmetic_that_fits_is_computed_in_int32_and_widened_where_read() {
        let mut body = LoopBody::default();
        let i = body.index(IndexExpr::var(Var(0)), DType::I64);
        let j = body.index(IndexExpr::var(Var(1)), DType::I64);
        let d = body.binary(BinaryOp::Sub, i, j);
        let far = body.constant(Scalar::Int(1 << 40), DType::I64);
        let big = body.binary(BinaryOp::Mul, d, far); // (beyond int32: stays int64)
        let f = body.cast(d, DType::F32);
        let sum = body.binary(BinaryOp::Add, big, d);
        let g = body.cast(sum, DType::F32);
        let out = body.binary(BinaryOp::Add, f, g);
        body.set_store(IndexExpr::zero(), out);
        let narrow = body.with_narrow_index_arithmetic(&[1024, 1024]);
        let dtype_of =
            |e: &dyn Fn(&Expr) -> bool| narrow.exprs.iter().zip(&narrow.dtypes).filter(|(x, _)| e(x)).map(|(_, d)| *d).collect::<Vec<_>>();
        assert_eq!(dtype_of(&|e| matches!(e, Expr::Binary(BinaryOp::Sub, ..))), [DType::I32]);
        assert_eq!(dtype_of(&|e| matches!(e, Expr::Binary(BinaryOp::Mul, ..))), [DType::I64]);
        // the difference is read as int64 by the product and the sum, as int32 by its conversion
        let widened = narrow.exprs.iter().zip(&narrow.dtypes).filter(|(e, d)| matches!(e, Expr::Cast(_)) && **d == DType::I64).count();
        assert_eq!(widened, 1);
        assert_eq!(narrow.dtype(narrow.store.as_ref().unwrap().value), DType::F32);
    }
}
