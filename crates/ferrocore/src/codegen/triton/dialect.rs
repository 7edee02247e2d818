//! The Triton dialect of the kernel writer. Each value is a block: `[XBLOCK]` in flat pointwise
//! kernels, `[XBLOCK, RBLOCK]` (or a broadcastable part of it) in kernels with loop groups.
//! Values are placed in sections: before a group's reduction loop (they depend on `x0` only),
//! inside it, or after it (they depend on a reduction result). Half types are loaded and stored
//! in their dtype and computed in float32.

use super::super::writer::{
    cast, math_name, Accumulator, Assign, CastRules, Dialect, IndexPrinter, IndexSyntax, NodeValue, Section, Values,
};
use super::super::CodegenError;
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::Storage;
use crate::symbolic::{Atom, IndexExpr, Var};
use std::collections::{HashMap, HashSet};
use std::fmt::Write;

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

/// Triton's conversions (see `writer::cast`): half types are rounded to their precision and
/// computed on in float32. Floats into int8/int16 keep the low bits of the int32 conversion and
/// into uint8 those of the int64 one, as ATen's casts do (c10 casts to uint8 through int64): on
/// the GPU the wide conversion saturates (PTX `cvt.rzi`, as CUDA eager), where a direct narrow
/// one would saturate to the narrow range; the interpreter (numpy) gives x86's minimum instead.
pub struct TritonCasts;

impl CastRules for TritonCasts {
    fn special(v: &str, from: DType, to: DType) -> Option<String> {
        match to {
            DType::I16 | DType::I8 if from.is_float() => Some(format!("{v}.to(tl.int32).to({})", ty(to))),
            DType::U8 if from.is_float() => Some(format!("{v}.to(tl.int64).to(tl.uint8)")),
            _ => None,
        }
    }

    fn plain(v: &str, to: DType) -> String {
        format!("{v}.to({})", ty(to))
    }

    fn round_half(v: &str, to: DType) -> String {
        if to == DType::F16 {
            format!("{v}.to(tl.float16).to(tl.float32)")
        } else {
            format!("ferro_round_bf16({v})")
        }
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

/// A value computed as `dt` converted to what a `dt` buffer stores.
pub fn store_conv(v: &str, dt: DType) -> String {
    match dt {
        DType::F16 => format!("{v}.to(tl.float16)"),
        DType::BF16 => format!("ferro_store_bf16({v})"),
        _ => v.to_string(),
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
    /// (An arg reduction's best value is `{name}_val`.)
    pub acc: Accumulator,
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

/// Triton's integer index syntax (`//` and `%` truncate; the prelude's floor helpers).
const TRITON_INDEX: IndexSyntax = IndexSyntax {
    int_suffix: "",
    div: "//",
    rem: "%",
    paren_dividend: false,
    floor_div_helper: "ferro_floordiv_pos",
    mod_helper: "ferro_mod_pos",
};

/// Math functions taken from Triton's `tl.math` (libdevice); the others are the prelude's
/// `ferro_<name>`, written for eager's accuracy.
const TL_MATH: &[UnaryOp] =
    &[UnaryOp::Abs, UnaryOp::Exp2, UnaryOp::Log, UnaryOp::Log2, UnaryOp::Sin, UnaryOp::Cos, UnaryOp::Erf, UnaryOp::Floor, UnaryOp::Ceil];

/// One loop group of a Triton kernel, as the kernel writer's dialect.
pub struct TritonGroup<'a> {
    pub storage: &'a [Storage],
    pub ptr: &'a HashMap<BufferId, String>,
    /// How the group names loop variable `i`.
    pub var_name: &'a dyn Fn(Var) -> String,
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
    /// (the rows' variable, a mask over one row of the block): an inner load whose index does
    /// not read the rows' variable takes this mask, so it loads one row, not the whole block
    /// (an attention kernel's key-side reads: a document id per key).
    pub row_free_mask: Option<(Var, String)>,
    pub accs: Vec<Acc>,
}

fn assign(name: &str, _dtype: DType, expr: &str) -> String {
    format!("{name} = {expr}\n")
}

impl TritonGroup<'_> {
    /// The mask of a value in `section`.
    pub fn mask(&self, section: Section) -> &str {
        match section {
            Section::Inner => &self.full_mask,
            Section::Kernel | Section::Pre | Section::Post => "xmask",
        }
    }

    /// A pointer expression `ptr + index`; a constant index is broadcast over the block (a
    /// masked access needs a block of pointers).
    pub fn address(&self, ptr: &str, e: &IndexExpr, ranges: &[i64]) -> String {
        if e.terms.is_empty() {
            format!("{ptr} + ({} + xzero)", e.constant)
        } else {
            format!("{ptr} + {}", self.index(e, ranges))
        }
    }

    fn shape1(&self) -> &'static str {
        if self.two_d {
            "[1, 1]"
        } else {
            "[1]"
        }
    }

    /// What a masked load of an empty buffer gives: `other`, 0 (16-bit floats load as float32).
    fn nothing_loaded(&self, v: &mut Values, dtype: DType) -> String {
        let t = match dtype {
            DType::F16 | DType::BF16 => "tl.float32",
            d => ty(d),
        };
        v.emit_in(Section::Pre, dtype, format!("tl.full({}, 0, {t})", self.shape1()), &[])
    }

    /// A masked load at `address` (of `index`, where it is direct) in `section`, as the value
    /// it computes with.
    fn masked_load(&self, address: &str, index: Option<&IndexExpr>, section: Section, dtype: DType) -> String {
        let mask = match (&self.row_free_mask, index) {
            (Some((row, mask)), Some(ix)) if section == Section::Inner && !ix.uses(*row) => mask.as_str(),
            _ => self.mask(section),
        };
        let raw = format!("tl.load({address}, {mask}, other=0)");
        match dtype {
            DType::F16 | DType::BF16 => format!("{raw}.to(tl.float32)"),
            _ => raw,
        }
    }

    /// A value broadcast to the full `[XBLOCK, RBLOCK]` block and masked with `init`.
    /// The identity is a typed constant: a bare literal would promote bool and narrow integer
    /// values to int32 (and a looped accumulator must keep its type).
    fn masked_full(&self, v: &str, init: &str, dtype: DType) -> String {
        format!("tl.where({}, {v}, tl.full({}, {init}, {}))", self.full_mask, self.shape1(), ty(dtype))
    }

    /// Σ(x - mean)² of a row. Looped: per lane a running mean, M2 and count (Welford's
    /// update), merged across lanes by `ferro_welford` after the loop; persistent: the row is
    /// in registers, so the exact two-pass form.
    fn welford(&mut self, v: &mut Values, x: &str, dtype: DType) -> String {
        let t = ty(dtype);
        let name = v.fresh("red");
        let shape = format!("[XBLOCK, {}]", self.rblock);
        let m = self.full_mask.clone();
        let xb = format!("tl.broadcast_to({x}, {shape})");
        let one = format!("tl.where({m}, 1.0, 0.0).to({t})");
        if self.looped {
            let acc = format!("{name}_acc");
            v.push(
                Section::Inner,
                &format!(
                    "{name}_w = {acc}_w + {one}\n{name}_d = {xb} - {acc}_mean\n\
                     {acc}_mean = tl.where({m}, {acc}_mean + {name}_d / {name}_w, {acc}_mean)\n\
                     {acc}_m2 = tl.where({m}, {acc}_m2 + {name}_d * ({xb} - {acc}_mean), {acc}_m2)\n{acc}_w = {name}_w\n"
                ),
            );
            self.accs.push(Acc { acc: Accumulator::new(acc.clone(), ReduceOp::WelfordM2, dtype), carry: false, wide: false });
            v.push(
                Section::Post,
                &format!(
                    "{name}_mean, {name}, {name}_w = tl.reduce(({acc}_mean, {acc}_m2, {acc}_w), 1, ferro_welford)\n{name} = {name}[:, None].to({t})\n"
                ),
            );
        } else {
            let section = v.section_of(x).max(Section::Inner);
            let line = format!(
                "{name}_n = tl.sum({one} + tl.zeros({shape}, {t}), 1)[:, None]\n\
                 {name}_mean = tl.sum(tl.where({m}, {xb}, 0.0), 1)[:, None] / {name}_n\n\
                 {name}_d = tl.where({m}, {xb} - {name}_mean, 0.0)\n\
                 {name} = tl.sum({name}_d * {name}_d, 1)[:, None].to({t})\n"
            );
            v.push(section, &line);
        }
        v.place(&name, Section::Post);
        name
    }

    /// `a << b` and `a >> b` with the shift count checked: out of range gives zero (or all
    /// ones, a negative value shifted right), as ATen's shifts.
    fn shift(&self, op: BinaryOp, a: &str, b: &str, od: DType, dtype: DType) -> String {
        let bits = od.itemsize() * 8;
        let outside = format!("({b} < 0) | ({b} >= {bits})");
        let count = format!("tl.where({outside}, tl.zeros_like({b}), {b})");
        if op == BinaryOp::LShift {
            return format!("tl.where({outside}, tl.zeros_like({a}), {a} << {count})");
        }
        let all_ones = int_literal(-1, dtype);
        let filled = format!("tl.where({a} < 0, tl.full({}, {all_ones}, {}), tl.zeros_like({a}))", self.shape1(), ty(dtype));
        format!("tl.where({outside}, {filled}, {a} >> {count})")
    }
}

impl Dialect for TritonGroup<'_> {
    const ASSIGN: Assign = assign;
    const LOGICAL: [&'static str; 3] = ["&", "|", "^"];
    const KERNEL_SECTION: bool = false;

    fn element_type(&self, dt: DType) -> DType {
        super::element_type(dt)
    }

    fn index(&self, e: &IndexExpr, ranges: &[i64]) -> String {
        IndexPrinter { syntax: &TRITON_INDEX, var_name: self.var_name, ranges }.expr(e)
    }

    fn load(&mut self, v: &mut Values, buf: BufferId, index: &IndexExpr, dtype: DType) -> String {
        if self.empty.contains(&buf) {
            return self.nothing_loaded(v, dtype);
        }
        let Some(p) = self.ptr.get(&buf) else {
            return v.unsupported(format!("no pointer for buffer {}", buf.0));
        };
        let section = v.index_section(index);
        let e = self.masked_load(&self.address(p, index, v.ranges), Some(index), section, dtype);
        v.emit_in(section, dtype, e, &[])
    }

    fn load_indirect(&mut self, v: &mut Values, buf: BufferId, index: &IndexExpr, terms: &[(String, i64)], dtype: DType) -> String {
        if self.empty.contains(&buf) {
            return self.nothing_loaded(v, dtype);
        }
        let Some(p) = self.ptr.get(&buf) else {
            return v.unsupported(format!("no pointer for buffer {}", buf.0));
        };
        let mut addr = self.address(p, index, v.ranges);
        for (t, c) in terms {
            let _ = write!(addr, " + {c}*{t}");
        }
        let section = terms.iter().map(|(t, _)| v.section_of(t)).fold(v.index_section(index), Section::max);
        let e = self.masked_load(&addr, None, section, dtype);
        let ops: Vec<&String> = terms.iter().map(|(t, _)| t).collect();
        v.emit_in(section, dtype, e, &ops)
    }

    fn constant(&self, value: Scalar, dtype: DType) -> String {
        let lit = match value {
            Scalar::Bool(b) => (b as i64).to_string(),
            Scalar::Int(i) => int_literal(i, dtype),
            Scalar::Float(f) => float_lit(f),
        };
        format!("tl.full({}, {lit}, {})", self.shape1(), ty(dtype))
    }

    fn index_value(&self, v: &Values, e: &IndexExpr, dtype: DType) -> String {
        let ix = if e.terms.is_empty() { format!("tl.full({}, {}, tl.int64)", self.shape1(), e.constant) } else { self.index(e, v.ranges) };
        if dtype == DType::Bool {
            format!("({ix} != 0)")
        } else {
            format!("({ix}).to({})", ty(dtype))
        }
    }

    fn unary(&self, op: UnaryOp, x: &str, xd: DType, dtype: DType) -> Result<String, String> {
        let t = ty(dtype);
        let e = match op {
            UnaryOp::Conj | UnaryOp::Real | UnaryOp::Imag => return Err(format!("{op:?} of complex values")),
            UnaryOp::Abs if !xd.is_float() => format!("tl.where({x} < 0, -{x}, {x})"),
            UnaryOp::IsInf if xd.is_float() => format!("(tl.math.abs({x}) == float(\"inf\"))"),
            UnaryOp::IsNan | UnaryOp::IsInf => format!("({x} != {x})"),
            UnaryOp::Neg => format!("-{x}"),
            UnaryOp::Sigmoid => format!("1.0 / (1.0 + ferro_exp(-{x}))"),
            UnaryOp::Relu => format!("tl.where({x} < 0, tl.zeros_like({x}), {x})"),
            UnaryOp::Rsqrt => format!("ferro_rsqrt({x})"),
            UnaryOp::Erfcx => format!("ferro_erfcx({x})"),
            // NaN -> 0, as eager's CPU kernels and the C++ backend
            UnaryOp::Sign => format!("(({x} > 0).to({t}) - ({x} < 0).to({t}))"),
            UnaryOp::Reciprocal => format!("ferro_div(tl.zeros_like({x}) + 1, {x})"),
            UnaryOp::BitwiseNot => format!("~{x}"),
            UnaryOp::LogicalNot => format!("({x} == 0)"),
            _ => {
                let f = math_name(op).ok_or_else(|| format!("{op:?}"))?;
                let lib = if TL_MATH.contains(&op) { "tl.math." } else { "ferro_" };
                format!("{lib}{f}({x})")
            }
        };
        // these keep their operand's type; the result's may be narrower
        let converted = matches!(op, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Reciprocal | UnaryOp::Sigmoid);
        Ok(if dtype == DType::Bool || !converted { e } else { format!("({e}).to({t})") })
    }

    fn binary(&self, op: BinaryOp, a: &str, b: &str, od: DType, dtype: DType) -> String {
        let fl = od.is_float();
        let boolean = od == DType::Bool;
        let call = |f: &str| format!("{f}({a}, {b})");
        match op {
            // booleans: + is or, - is xor, * and min are and, max is or
            BinaryOp::Add | BinaryOp::Maximum if boolean => format!("{a} | {b}"),
            BinaryOp::Mul | BinaryOp::Minimum if boolean => format!("{a} & {b}"),
            BinaryOp::Sub if boolean => format!("{a} ^ {b}"),
            BinaryOp::Add => format!("{a} + {b}"),
            BinaryOp::Sub => format!("{a} - {b}"),
            BinaryOp::Mul => format!("{a} * {b}"),
            BinaryOp::TrueDiv if fl => call("ferro_div"),
            BinaryOp::TrueDiv => format!("{a} / {b}"),
            BinaryOp::TruncDiv if fl => format!("ferro_trunc(ferro_div({a}, {b}))"),
            BinaryOp::LShift | BinaryOp::RShift => self.shift(op, a, b, od, dtype),
            _ => call(&binary_helper(op, fl)),
        }
    }

    fn cast(&self, x: &str, from: DType, to: DType) -> Option<String> {
        // half -> float: the value is already computed in float32
        let e = cast::<TritonCasts>(x, from, to);
        (e != x).then_some(e)
    }

    fn random(&self, normal: bool, seed: &str, offset: &str) -> String {
        let f = if normal { "ferro_randn" } else { "ferro_rand" };
        format!("{f}({seed}, {offset})")
    }

    fn select(&self, c: &str, a: &str, b: &str) -> String {
        format!("tl.where({c}, {a}, {b})")
    }

    fn convert(&self, e: &str, dtype: DType) -> String {
        format!("({e}).to({})", ty(dtype))
    }

    fn truth(&self, x: &str) -> String {
        format!("({x} != 0)")
    }

    fn reduce(&mut self, v: &mut Values, op: ReduceOp, x: &str, dtype: DType) -> String {
        if op == ReduceOp::WelfordM2 {
            return self.welford(v, x, dtype);
        }
        let t = ty(dtype);
        let init = reduction_init(op, dtype);
        let f = combine_fn(op);
        let name = v.fresh("red");
        let masked = self.masked_full(x, &init, dtype);
        if self.looped {
            let acc = format!("{name}_acc");
            let wide = wide_sum(op, dtype, self.terms_per_lane);
            let masked = if wide { format!("{masked}.to(tl.float64)") } else { masked };
            v.push(Section::Inner, &format!("{acc} = tl.where({}, {f}({acc}, {masked}), {acc})\n", self.full_mask));
            self.accs.push(Acc { acc: Accumulator::new(acc.clone(), op, dtype), carry: false, wide });
            v.push(Section::Post, &format!("{name} = tl.reduce({acc}, 1, {f})[:, None].to({t})\n"));
        } else {
            // the operand's section: it is inside the (persistent) group, after its operands
            let section = v.section_of(x).max(Section::Inner);
            v.push(section, &format!("{name} = tl.reduce({masked}, 1, {f})[:, None].to({t})\n"));
        }
        v.place(&name, Section::Post);
        name
    }

    fn arg_reduce(&mut self, v: &mut Values, op: ReduceOp, value: &str, index: &str, vd: DType) -> String {
        let init = reduction_init(op, vd);
        let f = combine_fn(op);
        let name = v.fresh("red");
        let shape = format!("[XBLOCK, {}]", self.rblock);
        let vb = format!("tl.broadcast_to({}, {shape})", self.masked_full(value, &init, vd));
        let ib = format!("tl.broadcast_to({}, {shape})", self.masked_full(index, &i64::MAX.to_string(), DType::I64));
        if self.looped {
            let acc = format!("{name}_acc");
            let m = &self.full_mask;
            v.push(
                Section::Inner,
                &format!(
                    "{name}_nv, {name}_ni = {f}({acc}_val, {acc}, {vb}, {ib})\n{acc}_val = tl.where({m}, {name}_nv, {acc}_val)\n{acc} = tl.where({m}, {name}_ni, {acc})\n"
                ),
            );
            self.accs.push(Acc { acc: Accumulator::arg(acc.clone(), op, vd), carry: false, wide: false });
            v.push(Section::Post, &format!("{name}_v, {name} = tl.reduce(({acc}_val, {acc}), 1, {f})\n{name} = {name}[:, None]\n"));
        } else {
            let section = v.section_of(value).max(v.section_of(index)).max(Section::Inner);
            v.push(section, &format!("{name}_v, {name} = tl.reduce(({vb}, {ib}), 1, {f})\n{name} = {name}[:, None]\n"));
        }
        v.place(&name, Section::Post);
        name
    }

    fn scan(&mut self, v: &mut Values, op: ReduceOp, x: &str, dtype: DType) -> String {
        if !self.two_d {
            return v.unsupported("a scan in a flat kernel".into());
        }
        // masked lanes hold the identity, so they never reach a valid lane's prefix
        let init = reduction_init(op, dtype);
        let f = combine_fn(op);
        let t = ty(dtype);
        let xb = format!("tl.broadcast_to({}, [XBLOCK, {}])", self.masked_full(x, &init, dtype), self.rblock);
        let name = v.fresh("scan");
        let section = v.section_of(x).max(Section::Inner);
        if self.looped {
            // each step scans its block, offset by the carry of the steps before
            let carry = format!("{name}_carry");
            let wide = wide_sum(op, dtype, self.terms_per_lane);
            let ct = if wide { "tl.float64" } else { t };
            v.push(Section::Inner, &format!("{name}_v = {xb}\n"));
            v.push(Section::Inner, &format!("{name} = {f}({carry}, tl.associative_scan({name}_v, 1, {f})).to({t})\n"));
            v.push(Section::Inner, &format!("{carry} = {f}({carry}, tl.reduce({name}_v, 1, {f})[:, None]).to({ct})\n"));
            self.accs.push(Acc { acc: Accumulator::new(carry, op, dtype), carry: true, wide });
        } else {
            v.push(section, &format!("{name} = tl.associative_scan({xb}, 1, {f}).to({t})\n"));
        }
        v.place(&name, section);
        name
    }

    fn check_index(&mut self, v: &mut Values, value: &str, size: i64, wrap: bool) -> String {
        let value = value.to_string();
        let w = if wrap { format!("tl.where({value} < 0, {value} + {size}, {value})") } else { value.clone() };
        let wrapped = v.emit(DType::I64, w, &[&value]);
        let bad = v.emit(DType::Bool, format!("({wrapped} < 0) | ({wrapped} >= {size})"), &[&wrapped]);
        let section = v.section_of(&bad);
        let mask = self.mask(section).to_string();
        // one flag store per checked value: a later reader in this group (or a later group
        // reusing the value) is covered by the first
        let flagged = format!("flag stored for {bad}");
        match self.err_ptr {
            Some(_) if v.was_computed(&flagged) => {}
            Some(err) => {
                // pointer, value and mask all shaped like the masked flag: a flag of one axis
                // (a reduction index) under a 2-D mask would leave the pointer narrower
                let hit = format!("({bad} & {mask})");
                let zero = format!("{hit}.to(tl.int32) * 0");
                v.push(section, &format!("tl.store({err} + {zero}, {zero} + 1, {hit})\n"));
                v.record(flagged, bad.clone(), section);
            }
            None => return v.unsupported("index check without an error flag".into()),
        }
        // clamped, so that the load stays inside the buffer whatever the input
        v.emit(DType::I64, format!("tl.minimum(tl.maximum({wrapped}, 0), {})", size - 1), &[&wrapped])
    }

    fn local_name(&self, pos: usize) -> String {
        format!("loc{pos}")
    }

    fn node_section(&self, n: &NodeValue, v: &Values) -> Section {
        if n.node.kind() == NodeKind::Reduction {
            return Section::Post;
        }
        let terms = n.store_terms().map(|(t, _)| v.section_of(t));
        terms.fold(v.section_of(&n.value).max(v.index_section(&n.store.index)), Section::max)
    }

    fn store(&mut self, n: &NodeValue, v: &Values) -> Result<String, CodegenError> {
        let out = n.node.output;
        if self.storage[out.0 as usize] != Storage::Allocated {
            return Ok(String::new());
        }
        let dst = self.ptr.get(&out).ok_or_else(|| CodegenError::internal(n.kernel, "output without a pointer"))?;
        let odt = n.out_dtype;
        let body = &n.kernel_node.body;
        let vdt = n.value_dtype;
        // a float32 value stored to a half buffer is rounded once, by the store (rounding to the
        // half type first, in the body or for the local, gives the same bits)
        let half = matches!(odt, DType::F16 | DType::BF16);
        let unrounded = match body.expr(n.store.value) {
            Expr::Cast(x) if half && vdt == odt && body.dtype(*x) == DType::F32 => Some(n.vals[x.0 as usize].clone()),
            _ if half && matches!(vdt, DType::F32 | DType::F16 | DType::BF16) => Some(n.value.clone()),
            _ => None,
        };
        let stored = store_conv(unrounded.as_ref().unwrap_or(&n.local), odt);
        let mut address = self.address(dst, &n.store.index, v.ranges);
        for (t, c) in n.store_terms() {
            let _ = write!(address, " + {c}*{t}");
        }
        let mask = self.mask(self.node_section(n, v));
        Ok(match n.store.mode {
            StoreMode::Set => format!("tl.store({address}, {stored}, {mask})\n"),
            StoreMode::Combine(op) if super::cas_combine(op, odt) => {
                let bits = match odt.itemsize() {
                    8 => "tl.int64",
                    2 => "tl.int16",
                    _ => "tl.int32",
                };
                let code = match op {
                    ReduceOp::Max => 1,
                    ReduceOp::Min => 2,
                    _ => 0,
                };
                format!("ferro_atomic_combine({dst}, {address}, {stored}, {mask}, {bits}, {code})\n")
            }
            StoreMode::Combine(op) => {
                // `check_supported` admits only these, of atomic types
                let f = match op {
                    ReduceOp::Max => "tl.atomic_max",
                    ReduceOp::Min => "tl.atomic_min",
                    _ => "tl.atomic_add",
                };
                format!("{f}({address}, {stored}, {mask})\n")
            }
        })
    }
}

/// The prelude's helper for a binary operation Triton has no operator for.
fn binary_helper(op: BinaryOp, fl: bool) -> String {
    let name = match op {
        BinaryOp::FloorDiv => "floordiv",
        BinaryOp::TruncDiv => "truncdiv",
        BinaryOp::Remainder if fl => "remainder",
        BinaryOp::Remainder => "mod",
        BinaryOp::Fmod => "fmod",
        BinaryOp::Pow if fl => return "ferro_pow".into(),
        BinaryOp::Pow => return "ferro_ipow".into(),
        BinaryOp::Maximum => return "ferro_max".into(),
        BinaryOp::Minimum => return "ferro_min".into(),
        BinaryOp::Atan2 => return "ferro_atan2".into(),
        _ => "unreachable",
    };
    format!("ferro_{name}_{}", if fl { 'f' } else { 'i' })
}
