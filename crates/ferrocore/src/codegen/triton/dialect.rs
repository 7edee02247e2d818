//! Triton rendering of loop-body expressions through the ops-handler interface. Each value is a
//! block: `[XBLOCK]` in flat pointwise kernels, `[XBLOCK, RBLOCK]` (or a broadcastable part of
//! it) in kernels with loop groups. Values are placed in sections: before a group's reduction
//! loop (they depend on `x0` only), inside it, or after it (they depend on a reduction result).
//! Half types are loaded and stored in their dtype and computed in float32.

use crate::graph::DType;
use crate::loop_ir::*;
use crate::symbolic::{Atom, IndexExpr, Var};
use std::collections::{HashMap, HashSet};
use std::fmt::Write;

#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
pub enum Section {
    Pre,
    Inner,
    Post,
}

/// The Triton type a value of `dt` is computed in (None: not supported by this backend).
pub fn compute_type(dt: DType) -> Option<&'static str> {
    match dt {
        DType::Bool => Some("tl.int1"),
        DType::U8 => Some("tl.uint8"),
        DType::I8 => Some("tl.int8"),
        DType::I16 => Some("tl.int16"),
        DType::I32 => Some("tl.int32"),
        DType::I64 => Some("tl.int64"),
        DType::F16 | DType::BF16 | DType::F32 => Some("tl.float32"),
        DType::F64 => Some("tl.float64"),
        DType::C32 | DType::C64 | DType::C128 | DType::Float8(_) | DType::U16 | DType::U32 | DType::U64 => None,
    }
}

/// The pointer type of a `dt` buffer in a Triton signature.
pub fn signature_type(dt: DType) -> Option<&'static str> {
    match dt {
        DType::Bool => Some("*i1"),
        DType::U8 => Some("*u8"),
        DType::I8 => Some("*i8"),
        DType::I16 => Some("*i16"),
        DType::I32 => Some("*i32"),
        DType::I64 => Some("*i64"),
        DType::F16 => Some("*fp16"),
        DType::BF16 => Some("*bf16"),
        DType::F32 => Some("*fp32"),
        DType::F64 => Some("*fp64"),
        DType::C32 | DType::C64 | DType::C128 | DType::Float8(_) | DType::U16 | DType::U32 | DType::U64 => None,
    }
}

fn ty(dt: DType) -> &'static str {
    compute_type(dt).unwrap_or("tl.float32")
}

/// `v` (computed as `from`) as a value of `to`: half types are rounded to their precision and
/// computed on in float32. Floats into int8/int16 keep the low bits of the int32 conversion and
/// into uint8 those of the int64 one, as ATen's casts do (c10 casts to uint8 through int64): on
/// the GPU the wide conversion saturates (PTX `cvt.rzi`, as CUDA eager), where a direct narrow
/// one would saturate to the narrow range; the interpreter (numpy) gives x86's minimum instead.
pub fn cast_expr(v: &str, from: DType, to: DType) -> String {
    if from == to {
        return v.to_string();
    }
    if from.is_float() {
        match to {
            DType::I16 | DType::I8 => return format!("{v}.to(tl.int32).to({})", ty(to)),
            DType::U8 => return format!("{v}.to(tl.int64).to(tl.uint8)"),
            _ => {}
        }
    }
    match to {
        DType::Bool => format!("({v} != 0)"),
        DType::F16 => format!("{v}.to(tl.float16).to(tl.float32)"),
        DType::BF16 => format!("ferro_round_bf16({v})"),
        DType::F32 if matches!(from, DType::F16 | DType::BF16) => v.to_string(),
        _ => format!("{v}.to({})", ty(to)),
    }
}

/// A value computed as `dt` converted to what a `dt` buffer stores.
pub fn store_conv(v: &str, dt: DType) -> String {
    match dt {
        DType::F16 => format!("{v}.to(tl.float16)"),
        DType::BF16 => format!("ferro_store_bf16({v})"),
        _ => v.to_string(),
    }
}

pub fn float_lit(f: f64) -> String {
    crate::codegen::literal::py_float(f)
}

/// The identity of a reduction for values of `dt`, as a Python literal.
pub fn reduction_init(op: ReduceOp, dt: DType) -> String {
    let (lo, hi): (i128, i128) = match dt {
        DType::Bool => (0, 1),
        DType::U8 => (0, 255),
        DType::I8 => (-128, 127),
        DType::I16 => (i16::MIN as i128, i16::MAX as i128),
        DType::I32 => (i32::MIN as i128, i32::MAX as i128),
        _ => (i64::MIN as i128, i64::MAX as i128),
    };
    match op {
        ReduceOp::Sum | ReduceOp::Any | ReduceOp::WelfordM2 => "0".into(),
        ReduceOp::Prod => "1".into(),
        ReduceOp::Max | ReduceOp::ArgMax if dt.is_float() => "float(\"-inf\")".into(),
        ReduceOp::Min | ReduceOp::ArgMin if dt.is_float() => "float(\"inf\")".into(),
        ReduceOp::Max | ReduceOp::ArgMax => lo.to_string(),
        ReduceOp::Min | ReduceOp::ArgMin => hi.to_string(),
    }
}

fn combine_fn(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "ferro_sum",
        ReduceOp::Prod => "ferro_prod",
        ReduceOp::Max => "ferro_max",
        ReduceOp::Min => "ferro_min",
        ReduceOp::Any => "ferro_any",
        ReduceOp::ArgMax => "ferro_argmax",
        ReduceOp::ArgMin => "ferro_argmin",
        ReduceOp::WelfordM2 => "ferro_welford",
    }
}

/// Renders index expressions with Triton integer semantics (`//` and `%` truncate, so they are
/// used only on operands proven non-negative; the floor helpers otherwise).
pub struct IndexPrinter<'a> {
    pub var_name: &'a dyn Fn(Var) -> String,
    pub ranges: &'a [i64],
}

impl IndexPrinter<'_> {
    pub fn expr(&self, e: &IndexExpr) -> String {
        let mut parts: Vec<String> = Vec::new();
        for (a, c) in &e.terms {
            let atom = match a {
                Atom::Var(v) => (self.var_name)(*v),
                Atom::FloorDiv(inner, d) => {
                    if inner.bounds(self.ranges).0 >= 0 {
                        format!("({} // {d})", self.expr(inner))
                    } else {
                        format!("ferro_floordiv_pos({}, {d})", self.expr(inner))
                    }
                }
                Atom::Mod(inner, d) => {
                    if inner.bounds(self.ranges).0 >= 0 {
                        format!("({} % {d})", self.expr(inner))
                    } else {
                        format!("ferro_mod_pos({}, {d})", self.expr(inner))
                    }
                }
            };
            parts.push(match *c {
                1 => atom,
                -1 => format!("-{atom}"),
                c => format!("{c}*{atom}"),
            });
        }
        if e.constant != 0 || parts.is_empty() {
            parts.push(e.constant.to_string());
        }
        let s = parts.join(" + ").replace("+ -", "- ");
        if parts.len() > 1 {
            format!("({s})")
        } else {
            s
        }
    }
}

/// Whether every partial value of `e` (each term, each nested operand, the sum) fits in int32.
pub fn fits_i32(e: &IndexExpr, ranges: &[i64]) -> bool {
    let lim = i32::MAX as i128 / 2;
    let ok = |(lo, hi): (i128, i128)| lo > -lim && hi < lim;
    if !ok(e.bounds(ranges)) {
        return false;
    }
    e.terms.iter().all(|(a, c)| {
        let (lo, hi) = a.bounds(ranges);
        let c = *c as i128;
        let term = (lo.min(hi) * c).min(hi.max(lo) * c);
        let term_hi = (lo.min(hi) * c).max(hi.max(lo) * c);
        ok((term, term_hi))
            && match a {
                Atom::Var(_) => true,
                Atom::FloorDiv(inner, _) | Atom::Mod(inner, _) => fits_i32(inner, ranges),
            }
    })
}

/// One reduction accumulator of a looped group.
#[derive(Clone, Debug)]
pub struct Acc {
    pub name: String,
    pub op: ReduceOp,
    pub dtype: DType,
    /// Arg reductions also carry the running best value (`{name}_val`) of this dtype.
    pub value_dtype: Option<DType>,
    /// A scan's carry between loop steps: one value per row (`[XBLOCK, 1]`).
    pub carry: bool,
    /// Held in float64 (`wide_sum`): a float sum or running sum over a looped row.
    pub wide: bool,
}

/// Terms each lane of a looped float sum adds one after another (a scan's carry: the steps)
/// from which it is held in float64: float32 loses digits with every addition (a running sum
/// over 10^7 elements had 4-6x CUDA eager's error, a variance's sum 3x), and float64 costs
/// nothing where the loads set the pace.
const WIDE_SUM_TERMS: i64 = 32;

/// Whether a looped float sum adding `terms` per lane is held in float64 (see WIDE_SUM_TERMS).
fn wide_sum(op: ReduceOp, dtype: DType, terms: i64) -> bool {
    op == ReduceOp::Sum && matches!(dtype, DType::F32 | DType::F16 | DType::BF16) && terms >= WIDE_SUM_TERMS
}

/// An integer constant of `dtype` as the conversion to `dtype` leaves it: wrapped into the type's
/// range (Triton's compiler rejects -7 as a uint8 constant; its interpreter wraps it).
fn int_literal(v: i64, dtype: DType) -> String {
    let (lo, hi) = dtype.int_range();
    if !dtype.is_integral() || dtype == DType::Bool || (lo..=hi).contains(&v) {
        return v.to_string();
    }
    let span = hi as i128 - lo as i128 + 1;
    ((v as i128 - lo as i128).rem_euclid(span) + lo as i128).to_string()
}

pub struct BodyEmitter<'a> {
    pub ptr: &'a HashMap<BufferId, String>,
    pub replace: &'a HashMap<BufferId, (String, Section)>,
    pub ranges: &'a [i64],
    pub var_name: &'a dyn Fn(Var) -> String,
    pub tmp: &'a mut usize,
    /// `[XBLOCK, RBLOCK]` values (else `[XBLOCK]`).
    pub two_d: bool,
    /// The group's reductions accumulate over a loop of `rblock`-wide steps.
    pub looped: bool,
    /// Steps of the group's loop: the terms each lane of a looped reduction adds in turn.
    pub terms_per_lane: i64,
    pub rblock: i64,
    /// The mask of a value that varies over the group's inner loops.
    pub full_mask: String,
    pub err_ptr: Option<&'a str>,
    /// Buffers without elements: a load from one is never used (every access is masked) and
    /// its pointer may point nowhere, so it is not issued.
    pub empty: HashSet<BufferId>,
    /// Expressions already computed in this loop group (shared by its nodes): text -> value.
    cse: &'a mut HashMap<String, (String, Section)>,
    sections: HashMap<String, Section>,
    pub pre: String,
    pub inner: String,
    pub post: String,
    pub accs: Vec<Acc>,
    /// Why this body cannot be rendered (the first reason).
    pub unsupported: Option<String>,
}

impl<'a> BodyEmitter<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ptr: &'a HashMap<BufferId, String>,
        replace: &'a HashMap<BufferId, (String, Section)>,
        ranges: &'a [i64],
        var_name: &'a dyn Fn(Var) -> String,
        tmp: &'a mut usize,
        two_d: bool,
        looped: bool,
        rblock: i64,
        full_mask: String,
        err_ptr: Option<&'a str>,
        cse: &'a mut HashMap<String, (String, Section)>,
    ) -> Self {
        BodyEmitter {
            ptr,
            replace,
            ranges,
            var_name,
            tmp,
            two_d,
            looped,
            terms_per_lane: 1,
            rblock,
            full_mask,
            err_ptr,
            empty: HashSet::new(),
            cse,
            sections: HashMap::new(),
            pre: String::new(),
            inner: String::new(),
            post: String::new(),
            accs: Vec::new(),
            unsupported: None,
        }
    }

    fn unsupported(&mut self, why: String) -> String {
        if self.unsupported.is_none() {
            self.unsupported = Some(why);
        }
        "None".into()
    }

    pub fn section_of(&self, name: &str) -> Section {
        self.sections.get(name).copied().unwrap_or(Section::Pre)
    }

    /// Inner when the index uses an inner loop variable, else computable before the loops.
    pub fn index_section(e: &IndexExpr) -> Section {
        let mut vs = Vec::new();
        e.vars(&mut vs);
        if vs.iter().any(|v| v.0 != 0) {
            Section::Inner
        } else {
            Section::Pre
        }
    }

    /// The mask of a value in `section`.
    pub fn mask(&self, section: Section) -> &str {
        match section {
            Section::Inner => &self.full_mask,
            Section::Pre | Section::Post => "xmask",
        }
    }

    /// What a masked load of an empty buffer gives: `other`, 0 (16-bit floats load as float32).
    fn nothing_loaded(&mut self, dtype: DType) -> String {
        let t = match dtype {
            DType::F16 | DType::BF16 => "tl.float32",
            d => ty(d),
        };
        let e = format!("tl.full({}, 0, {t})", self.shape1());
        self.emit_in(Section::Pre, e, &[])
    }

    pub fn index(&self, e: &IndexExpr) -> String {
        IndexPrinter { var_name: self.var_name, ranges: self.ranges }.expr(e)
    }

    /// A pointer expression `ptr + index`; a constant index is broadcast over the block (a
    /// masked access needs a block of pointers).
    pub fn address(&self, ptr: &str, e: &IndexExpr) -> String {
        if e.terms.is_empty() {
            format!("{ptr} + ({} + xzero)", e.constant)
        } else {
            format!("{ptr} + {}", self.index(e))
        }
    }

    fn shape1(&self) -> &'static str {
        if self.two_d {
            "[1, 1]"
        } else {
            "[1]"
        }
    }

    fn fresh(&mut self, prefix: &str) -> String {
        let n = format!("{prefix}{}", *self.tmp);
        *self.tmp += 1;
        n
    }

    fn push_line(&mut self, section: Section, line: &str) {
        let s = match section {
            Section::Pre => &mut self.pre,
            Section::Inner => &mut self.inner,
            Section::Post => &mut self.post,
        };
        s.push_str(line);
        s.push('\n');
    }

    /// Emits `tmpN = expr` in the latest of `at_least` and the operands' sections.
    /// Emits `tmpN = expr` in the latest of `at_least` and the operands' sections, or returns
    /// the value of the same expression computed earlier in the group.
    fn emit_in(&mut self, at_least: Section, expr: String, operands: &[&String]) -> String {
        if let Some((name, section)) = self.cse.get(&expr).cloned() {
            self.sections.insert(name.clone(), section);
            return name;
        }
        let section = operands.iter().map(|o| self.section_of(o)).fold(at_least, Section::max);
        let name = self.fresh("tmp");
        self.push_line(section, &format!("{name} = {expr}"));
        self.sections.insert(name.clone(), section);
        self.cse.insert(expr, (name.clone(), section));
        name
    }

    fn emit(&mut self, expr: String, operands: &[&String]) -> String {
        self.emit_in(Section::Pre, expr, operands)
    }

    /// Σ(x - mean)² of a row. Looped: per lane a running mean, M2 and count (Welford's
    /// update), merged across lanes by `ferro_welford` after the loop; persistent: the row is
    /// in registers, so the exact two-pass form.
    fn welford(&mut self, x: &str, dtype: DType) -> String {
        let t = ty(dtype);
        let name = self.fresh("red");
        let shape = format!("[XBLOCK, {}]", self.rblock);
        let m = self.full_mask.clone();
        let v = format!("tl.broadcast_to({x}, {shape})");
        let one = format!("tl.where({m}, 1.0, 0.0).to({t})");
        if self.looped {
            let acc = format!("{name}_acc");
            self.inner.push_str(&format!(
                "{name}_w = {acc}_w + {one}\n{name}_d = {v} - {acc}_mean\n\
                 {acc}_mean = tl.where({m}, {acc}_mean + {name}_d / {name}_w, {acc}_mean)\n\
                 {acc}_m2 = tl.where({m}, {acc}_m2 + {name}_d * ({v} - {acc}_mean), {acc}_m2)\n{acc}_w = {name}_w\n"
            ));
            self.accs.push(Acc { name: acc.clone(), op: ReduceOp::WelfordM2, dtype, value_dtype: None, carry: false, wide: false });
            self.post.push_str(&format!(
                "{name}_mean, {name}, {name}_w = tl.reduce(({acc}_mean, {acc}_m2, {acc}_w), 1, ferro_welford)\n{name} = {name}[:, None].to({t})\n"
            ));
        } else {
            let section = self.section_of(x).max(Section::Inner);
            let line = format!(
                "{name}_n = tl.sum({one} + tl.zeros({shape}, {t}), 1)[:, None]\n\
                 {name}_mean = tl.sum(tl.where({m}, {v}, 0.0), 1)[:, None] / {name}_n\n\
                 {name}_d = tl.where({m}, {v} - {name}_mean, 0.0)\n\
                 {name} = tl.sum({name}_d * {name}_d, 1)[:, None].to({t})"
            );
            self.push_line(section, &line);
        }
        self.sections.insert(name.clone(), Section::Post);
        name
    }

    /// A value broadcast to the full `[XBLOCK, RBLOCK]` block and masked with `init`.
    /// The identity is a typed constant: a bare literal would promote bool and narrow integer
    /// values to int32 (and a looped accumulator must keep its type).
    fn masked_full(&self, v: &str, init: &str, dtype: DType) -> String {
        format!("tl.where({}, {v}, tl.full({}, {init}, {}))", self.full_mask, self.shape1(), ty(dtype))
    }
}

impl OpsHandler for BodyEmitter<'_> {
    type V = String;

    fn load(&mut self, buf: BufferId, index: &IndexExpr, dtype: DType) -> String {
        if let Some((name, section)) = self.replace.get(&buf) {
            self.sections.insert(name.clone(), *section);
            return name.clone();
        }
        if self.empty.contains(&buf) {
            return self.nothing_loaded(dtype);
        }
        let Some(p) = self.ptr.get(&buf).cloned() else {
            return self.unsupported(format!("no pointer for buffer {}", buf.0));
        };
        let section = Self::index_section(index);
        let raw = format!("tl.load({}, {}, other=0)", self.address(&p, index), self.mask(section));
        let e = match dtype {
            DType::F16 | DType::BF16 => format!("{raw}.to(tl.float32)"),
            _ => raw,
        };
        self.emit_in(section, e, &[])
    }

    fn constant(&mut self, value: Scalar, dtype: DType) -> String {
        let lit = match value {
            Scalar::Bool(b) => (b as i64).to_string(),
            Scalar::Int(i) => int_literal(i, dtype),
            Scalar::Float(f) => float_lit(f),
        };
        let e = format!("tl.full({}, {lit}, {})", self.shape1(), ty(dtype));
        self.emit(e, &[])
    }

    fn index_expr(&mut self, e: &IndexExpr, dtype: DType) -> String {
        let section = Self::index_section(e);
        let ix = if e.terms.is_empty() { format!("tl.full({}, {}, tl.int64)", self.shape1(), e.constant) } else { self.index(e) };
        let v = if dtype == DType::Bool { format!("({ix} != 0)") } else { format!("({ix}).to({})", ty(dtype)) };
        self.emit_in(section, v, &[])
    }

    fn unary(&mut self, op: UnaryOp, x: &String, xd: DType, dtype: DType) -> String {
        let fl = xd.is_float();
        let t = ty(dtype);
        let e = match op {
            UnaryOp::Abs => {
                if fl {
                    format!("tl.math.abs({x})")
                } else if xd == DType::Bool {
                    x.clone()
                } else {
                    format!("tl.where({x} < 0, -{x}, {x})")
                }
            }
            UnaryOp::Neg => format!("-{x}"),
            UnaryOp::Exp => format!("ferro_exp({x})"),
            UnaryOp::Exp2 => format!("tl.math.exp2({x})"),
            UnaryOp::Expm1 => format!("ferro_expm1({x})"),
            UnaryOp::Log => format!("tl.math.log({x})"),
            UnaryOp::Log2 => format!("tl.math.log2({x})"),
            UnaryOp::Log10 => format!("ferro_log10({x})"),
            UnaryOp::Log1p => format!("ferro_log1p({x})"),
            UnaryOp::Sqrt => format!("ferro_sqrt({x})"),
            UnaryOp::Rsqrt => format!("ferro_rsqrt({x})"),
            UnaryOp::Sin => format!("tl.math.sin({x})"),
            UnaryOp::Cos => format!("tl.math.cos({x})"),
            UnaryOp::Tan => format!("ferro_tan({x})"),
            UnaryOp::Asin => format!("ferro_asin({x})"),
            UnaryOp::Acos => format!("ferro_acos({x})"),
            UnaryOp::Atan => format!("ferro_atan({x})"),
            UnaryOp::Sinh => format!("ferro_sinh({x})"),
            UnaryOp::Cosh => format!("ferro_cosh({x})"),
            UnaryOp::Tanh => format!("ferro_tanh({x})"),
            UnaryOp::Asinh => format!("ferro_asinh({x})"),
            UnaryOp::Acosh => format!("ferro_acosh({x})"),
            UnaryOp::Atanh => format!("ferro_atanh({x})"),
            UnaryOp::Sigmoid => format!("1.0 / (1.0 + ferro_exp(-{x}))"),
            UnaryOp::Relu => format!("tl.where({x} < 0, tl.zeros_like({x}), {x})"),
            UnaryOp::Erf => format!("tl.math.erf({x})"),
            UnaryOp::Erfc => format!("ferro_erfc({x})"),
            UnaryOp::Lgamma => format!("ferro_lgamma({x})"),
            UnaryOp::Conj | UnaryOp::Real | UnaryOp::Imag => return self.unsupported(format!("{op:?} of complex values")),
            UnaryOp::Erfcx => format!("ferro_erfcx({x})"),
            UnaryOp::Floor => {
                if fl {
                    format!("tl.math.floor({x})")
                } else {
                    x.clone()
                }
            }
            UnaryOp::Ceil => {
                if fl {
                    format!("tl.math.ceil({x})")
                } else {
                    x.clone()
                }
            }
            UnaryOp::Round => {
                if fl {
                    format!("ferro_nearbyint({x})")
                } else {
                    x.clone()
                }
            }
            UnaryOp::Trunc => {
                if fl {
                    format!("ferro_trunc({x})")
                } else {
                    x.clone()
                }
            }
            UnaryOp::Sign => {
                if xd == DType::Bool {
                    x.clone()
                } else {
                    // NaN -> 0, as eager's CPU kernels and the C++ backend
                    format!("(({x} > 0).to({t}) - ({x} < 0).to({t}))")
                }
            }
            UnaryOp::Reciprocal => format!("ferro_div(tl.zeros_like({x}) + 1, {x})"),
            UnaryOp::BitwiseNot => {
                if xd == DType::Bool {
                    format!("({x} == 0)")
                } else {
                    format!("~{x}")
                }
            }
            UnaryOp::LogicalNot => format!("({x} == 0)"),
            UnaryOp::IsNan => format!("({x} != {x})"),
            UnaryOp::IsInf => {
                if fl {
                    format!("(tl.math.abs({x}) == float(\"inf\"))")
                } else {
                    format!("({x} != {x})")
                }
            }
        };
        let e = if dtype == DType::Bool || !matches!(op, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Reciprocal | UnaryOp::Sigmoid) {
            e
        } else {
            format!("({e}).to({t})")
        };
        self.emit(e, &[x])
    }

    fn binary(&mut self, op: BinaryOp, a: &String, b: &String, od: DType, dtype: DType) -> String {
        let fl = od.is_float();
        let boolean = od == DType::Bool;
        let t = ty(dtype);
        let bits = od.itemsize() * 8;
        let e = match op {
            BinaryOp::Add => {
                if boolean {
                    format!("{a} | {b}")
                } else {
                    format!("{a} + {b}")
                }
            }
            BinaryOp::Sub => {
                if boolean {
                    format!("{a} ^ {b}")
                } else {
                    format!("{a} - {b}")
                }
            }
            BinaryOp::Mul => {
                if boolean {
                    format!("{a} & {b}")
                } else {
                    format!("{a} * {b}")
                }
            }
            BinaryOp::TrueDiv => {
                if fl {
                    format!("ferro_div({a}, {b})")
                } else {
                    format!("{a} / {b}")
                }
            }
            BinaryOp::FloorDiv => {
                if fl {
                    format!("ferro_floordiv_f({a}, {b})")
                } else {
                    format!("ferro_floordiv_i({a}, {b})")
                }
            }
            BinaryOp::TruncDiv => {
                if fl {
                    format!("ferro_trunc(ferro_div({a}, {b}))")
                } else {
                    format!("ferro_truncdiv_i({a}, {b})")
                }
            }
            BinaryOp::Remainder => {
                if fl {
                    format!("ferro_remainder_f({a}, {b})")
                } else {
                    format!("ferro_mod_i({a}, {b})")
                }
            }
            BinaryOp::Fmod => {
                if fl {
                    format!("ferro_fmod_f({a}, {b})")
                } else {
                    format!("ferro_fmod_i({a}, {b})")
                }
            }
            BinaryOp::Pow => {
                if fl {
                    format!("ferro_pow({a}, {b})")
                } else {
                    format!("ferro_ipow({a}, {b})")
                }
            }
            BinaryOp::Maximum => {
                if boolean {
                    format!("{a} | {b}")
                } else {
                    format!("ferro_max({a}, {b})")
                }
            }
            BinaryOp::Minimum => {
                if boolean {
                    format!("{a} & {b}")
                } else {
                    format!("ferro_min({a}, {b})")
                }
            }
            BinaryOp::Atan2 => format!("ferro_atan2({a}, {b})"),
            BinaryOp::Eq => format!("{a} == {b}"),
            BinaryOp::Ne => format!("{a} != {b}"),
            BinaryOp::Lt => format!("{a} < {b}"),
            BinaryOp::Le => format!("{a} <= {b}"),
            BinaryOp::Gt => format!("{a} > {b}"),
            BinaryOp::Ge => format!("{a} >= {b}"),
            BinaryOp::LogicalAnd => format!("({a} != 0) & ({b} != 0)"),
            BinaryOp::LogicalOr => format!("({a} != 0) | ({b} != 0)"),
            BinaryOp::LogicalXor => format!("({a} != 0) ^ ({b} != 0)"),
            BinaryOp::BitAnd => format!("{a} & {b}"),
            BinaryOp::BitOr => format!("{a} | {b}"),
            BinaryOp::BitXor => format!("{a} ^ {b}"),
            BinaryOp::LShift => {
                format!("tl.where(({b} < 0) | ({b} >= {bits}), tl.zeros_like({a}), {a} << tl.where(({b} < 0) | ({b} >= {bits}), tl.zeros_like({b}), {b}))")
            }
            BinaryOp::RShift => {
                let all_ones = int_literal(-1, dtype);
                format!("tl.where(({b} < 0) | ({b} >= {bits}), tl.where({a} < 0, tl.full({}, {all_ones}, {t}), tl.zeros_like({a})), {a} >> tl.where(({b} < 0) | ({b} >= {bits}), tl.zeros_like({b}), {b}))", self.shape1())
            }
        };
        let e = if dtype == DType::Bool || op.is_comparison() { e } else { format!("({e}).to({t})") };
        self.emit(e, &[a, b])
    }

    fn where_(&mut self, c: &String, a: &String, b: &String, _dtype: DType) -> String {
        self.emit(format!("tl.where({c}, {a}, {b})"), &[c, a, b])
    }

    fn cast(&mut self, x: &String, from: DType, to: DType) -> String {
        let e = cast_expr(x, from, to);
        if e == *x {
            // half -> float: the value is already computed in float32
            return e;
        }
        self.emit(e, &[x])
    }

    fn reduce(&mut self, op: ReduceOp, x: &String, dtype: DType, _id: ValueId) -> String {
        if op == ReduceOp::WelfordM2 {
            return self.welford(x, dtype);
        }
        let t = ty(dtype);
        let init = reduction_init(op, dtype);
        let f = combine_fn(op);
        let name = self.fresh("red");
        if self.looped {
            let acc = format!("{name}_acc");
            let wide = wide_sum(op, dtype, self.terms_per_lane);
            let v = self.masked_full(x, &init, dtype);
            let v = if wide { format!("{v}.to(tl.float64)") } else { v };
            self.inner.push_str(&format!("{acc} = tl.where({}, {f}({acc}, {v}), {acc})\n", self.full_mask));
            self.accs.push(Acc { name: acc.clone(), op, dtype, value_dtype: None, carry: false, wide });
            self.post.push_str(&format!("{name} = tl.reduce({acc}, 1, {f})[:, None].to({t})\n"));
        } else {
            let v = self.masked_full(x, &init, dtype);
            // the operand's section: it is inside the (persistent) group, after its operands
            let line = format!("{name} = tl.reduce({v}, 1, {f})[:, None].to({t})");
            let section = self.section_of(x).max(Section::Inner);
            self.push_line(section, &line);
        }
        self.sections.insert(name.clone(), Section::Post);
        name
    }

    fn arg_reduce(&mut self, op: ReduceOp, value: &String, index: &String, vd: DType) -> String {
        let init = reduction_init(op, vd);
        let f = combine_fn(op);
        let name = self.fresh("red");
        let shape = format!("[XBLOCK, {}]", self.rblock);
        let v = format!("tl.broadcast_to({}, {shape})", self.masked_full(value, &init, vd));
        let i = format!("tl.broadcast_to({}, {shape})", self.masked_full(index, &i64::MAX.to_string(), DType::I64));
        if self.looped {
            let acc = format!("{name}_acc");
            self.inner.push_str(&format!(
                "{name}_nv, {name}_ni = {f}({acc}_val, {acc}, {v}, {i})\n{acc}_val = tl.where({m}, {name}_nv, {acc}_val)\n{acc} = tl.where({m}, {name}_ni, {acc})\n",
                m = self.full_mask
            ));
            self.accs.push(Acc { name: acc.clone(), op, dtype: DType::I64, value_dtype: Some(vd), carry: false, wide: false });
            self.post.push_str(&format!("{name}_v, {name} = tl.reduce(({acc}_val, {acc}), 1, {f})\n{name} = {name}[:, None]\n"));
        } else {
            let section = self.section_of(value).max(self.section_of(index)).max(Section::Inner);
            let line = format!("{name}_v, {name} = tl.reduce(({v}, {i}), 1, {f})\n{name} = {name}[:, None]");
            self.push_line(section, &line);
        }
        self.sections.insert(name.clone(), Section::Post);
        name
    }

    fn scan(&mut self, op: ReduceOp, x: &String, dtype: DType) -> String {
        if !self.two_d {
            return self.unsupported("a scan in a flat kernel".into());
        }
        // masked lanes hold the identity, so they never reach a valid lane's prefix
        let init = reduction_init(op, dtype);
        let f = combine_fn(op);
        let t = ty(dtype);
        let v = format!("tl.broadcast_to({}, [XBLOCK, {}])", self.masked_full(x, &init, dtype), self.rblock);
        let name = self.fresh("scan");
        let section = self.section_of(x).max(Section::Inner);
        if self.looped {
            // each step scans its block, offset by the carry of the steps before
            let carry = format!("{name}_carry");
            let wide = wide_sum(op, dtype, self.terms_per_lane);
            let ct = if wide { "tl.float64" } else { t };
            self.inner.push_str(&format!("{name}_v = {v}\n"));
            self.inner.push_str(&format!("{name} = {f}({carry}, tl.associative_scan({name}_v, 1, {f})).to({t})\n"));
            self.inner.push_str(&format!("{carry} = {f}({carry}, tl.reduce({name}_v, 1, {f})[:, None]).to({ct})\n"));
            self.accs.push(Acc { name: carry, op, dtype, value_dtype: None, carry: true, wide });
        } else {
            self.push_line(section, &format!("{name} = tl.associative_scan({v}, 1, {f}).to({t})"));
        }
        self.sections.insert(name.clone(), section);
        name
    }

    fn random(&mut self, normal: bool, seed: &String, offset: &String) -> String {
        let f = if normal { "ferro_randn" } else { "ferro_rand" };
        self.emit(format!("{f}({seed}, {offset})"), &[seed, offset])
    }

    fn load_indirect(&mut self, buf: BufferId, index: &IndexExpr, terms: &[(String, i64)], dtype: DType) -> String {
        if self.empty.contains(&buf) {
            return self.nothing_loaded(dtype);
        }
        let Some(p) = self.ptr.get(&buf).cloned() else {
            return self.unsupported(format!("no pointer for buffer {}", buf.0));
        };
        let mut addr = self.address(&p, index);
        for (v, c) in terms {
            let _ = write!(addr, " + {c}*{v}");
        }
        let section = terms.iter().map(|(v, _)| self.section_of(v)).fold(Self::index_section(index), Section::max);
        let raw = format!("tl.load({addr}, {}, other=0)", self.mask(section));
        let e = match dtype {
            DType::F16 | DType::BF16 => format!("{raw}.to(tl.float32)"),
            _ => raw,
        };
        let ops: Vec<&String> = terms.iter().map(|(v, _)| v).collect();
        self.emit_in(section, e, &ops)
    }

    fn check_index(&mut self, value: &String, size: i64, wrap: bool) -> String {
        let w = if wrap { format!("tl.where({value} < 0, {value} + {size}, {value})") } else { value.clone() };
        let wrapped = self.emit(w, &[value]);
        let bad = self.emit(format!("({wrapped} < 0) | ({wrapped} >= {size})"), &[&wrapped]);
        let section = self.section_of(&bad);
        let mask = self.mask(section).to_string();
        // one flag store per checked value: a later reader in this group (or a later group
        // reusing the value) is covered by the first
        let flagged = format!("flag stored for {bad}");
        match self.err_ptr {
            Some(_) if self.cse.contains_key(&flagged) => {}
            Some(err) => {
                // pointer, value and mask all shaped like the masked flag: a flag of one axis
                // (a reduction index) under a 2-D mask would leave the pointer narrower
                let hit = format!("({bad} & {mask})");
                let zero = format!("{hit}.to(tl.int32) * 0");
                self.push_line(section, &format!("tl.store({err} + {zero}, {zero} + 1, {hit})"));
                self.cse.insert(flagged, (bad.clone(), section));
            }
            None => return self.unsupported("index check without an error flag".into()),
        }
        // clamped, so that the load stays inside the buffer whatever the input
        self.emit(format!("tl.minimum(tl.maximum({wrapped}, 0), {})", size - 1), &[&wrapped])
    }

    fn store(&mut self, _index: &IndexExpr, _terms: &[(String, i64)], _mode: StoreMode, _value: &String, _dtype: DType) {
        // the kernel writer places the store: it knows the buffer's storage and local name
    }
}
