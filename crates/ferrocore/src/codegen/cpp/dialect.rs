//! C++ rendering of loop-body expressions through the ops-handler interface. Values that depend
//! on a reduction result are emitted after the loop ("post"), everything else inside it.

use crate::graph::DType;
use crate::loop_ir::*;
use crate::symbolic::{IndexExpr, Printer, Var};
use std::collections::HashMap;

/// Where a value is computed: once per kernel call, before every loop (it reads no loop
/// variable and only buffers the kernel does not write: Adam's bias corrections, two `pow`s of
/// the step count, ran per element before), before the group's loops (it depends on `x0` at
/// most), inside them, or after them (it depends on a reduction result).
#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
pub enum Section {
    Kernel,
    Pre,
    Inner,
    Post,
}

/// The C++ type a value of `dt` is computed in.
pub fn c_type(dt: DType) -> &'static str {
    match dt {
        DType::Bool => "bool",
        DType::U8 => "uint8_t",
        DType::I8 => "int8_t",
        DType::I16 => "int16_t",
        DType::I32 => "int32_t",
        DType::I64 => "int64_t",
        DType::F16 | DType::BF16 | DType::F32 => "float",
        DType::F64 => "double",
        DType::C32 | DType::C64 => "std::complex<float>",
        DType::C128 => "std::complex<double>",
        // never reaches codegen: lowering falls back first
        DType::Float8(_) | DType::U16 | DType::U32 | DType::U64 => "void",
    }
}

/// The C++ type a buffer of `dt` is stored as.
pub fn storage_type(dt: DType) -> &'static str {
    match dt {
        DType::F16 | DType::BF16 => "uint16_t",
        DType::C32 => "ferro_chalf",
        // bytes, not `bool`: GCC does not vectorize loops that load `bool` values
        DType::Bool => "uint8_t",
        d => c_type(d),
    }
}

pub fn cast_expr(v: &str, from: DType, to: DType) -> String {
    if from == to {
        return v.to_string();
    }
    if from.is_complex() && !to.is_complex() {
        // complex -> real keeps the real part, as ATen's copy does
        if to == DType::Bool {
            return format!("({v} != {}(0))", c_type(from));
        }
        return cast_expr(&format!("std::real({v})"), if from == DType::C128 { DType::F64 } else { DType::F32 }, to);
    }
    if to == DType::C32 {
        return format!("ferro_round_chalf(static_cast<std::complex<float>>({v}))");
    }
    if from.is_float() {
        // x86 CPU eager: int32 and int64 saturate to the minimum; int8/int16 keep the low bits
        // of the int32 conversion and uint8 those of the int64 one (c10 casts to uint8 through
        // int64)
        match to {
            DType::I64 => return format!("ferro_f2i<int64_t>({v})"),
            DType::I32 => return format!("ferro_f2i<int32_t>({v})"),
            DType::I16 | DType::I8 => return format!("static_cast<{}>(ferro_f2i<int32_t>({v}))", c_type(to)),
            DType::U8 => return format!("static_cast<uint8_t>(ferro_f2i<int64_t>({v}))"),
            _ => {}
        }
    }
    if from.is_integral() && from != DType::Bool && to.is_float() {
        // + a zero g++ cannot see (the prelude's weak `ferro_zero_*`): without trapping math it
        // folds `(float)(int)x` into `trunc(x)`, which keeps the sign of a negative x truncated
        // to zero (a literal `+ 0.0f` it drops first, knowing an integer is never -0.0)
        let zero = if to == DType::F64 { "ferro_zero_d" } else { "ferro_zero_f" };
        let wide = if to == DType::F64 { "double" } else { "float" };
        let v = format!("(static_cast<{wide}>({v}) + {zero})");
        return match to {
            DType::F16 => format!("ferro_round_half({v})"),
            DType::BF16 => format!("ferro_round_bf16({v})"),
            _ => v,
        };
    }
    match to {
        DType::Bool => format!("({v} != 0)"),
        DType::F16 => format!("ferro_round_half(static_cast<float>({v}))"),
        DType::BF16 => format!("ferro_round_bf16(static_cast<float>({v}))"),
        DType::F32 if matches!(from, DType::F16 | DType::BF16) => v.to_string(),
        _ => format!("static_cast<{}>({v})", c_type(to)),
    }
}

/// A stored element of a `dt` buffer as the value it computes with.
pub fn load_conv(raw: &str, dt: DType) -> String {
    match dt {
        DType::F16 => format!("ferro_h2f({raw})"),
        DType::C32 => format!("ferro_chalf2c({raw})"),
        DType::BF16 => format!("ferro_bf2f({raw})"),
        DType::Bool => format!("({raw} != 0)"),
        _ => raw.to_string(),
    }
}

pub fn store_conv(v: &str, dt: DType) -> String {
    match dt {
        DType::Bool => format!("static_cast<uint8_t>({v})"),
        DType::F16 => format!("ferro_f2h({v})"),
        DType::BF16 => format!("ferro_f2bf({v})"),
        DType::C32 => format!("ferro_c2chalf({v})"),
        _ => v.to_string(),
    }
}

fn float_lit(f: f64, dt: DType) -> String {
    crate::codegen::literal::cpp_float(f, c_type(dt))
}

/// One accumulator of a reduction loop; arg reductions also carry the running best value.
#[derive(Clone, Debug)]
pub struct Acc {
    pub name: String,
    pub op: ReduceOp,
    pub dtype: DType,
    pub value_dtype: Option<DType>,
    /// An "any index out of range" flag rather than a value of the body.
    pub index_check: bool,
    /// A running scan value: the loop carries a dependence and must stay sequential.
    pub scan: bool,
    /// A float sum of a long reduction: the loop adds into `<name>_part`, a partial sum of one
    /// chunk in the vector lanes, and each chunk's partial is added into the total `<name>_w`,
    /// which is double for float and half types and compensated (`<name>_c`) for double.
    pub chunked: bool,
}

impl Acc {
    pub fn new(name: String, op: ReduceOp, dtype: DType) -> Acc {
        Acc { name, op, dtype, value_dtype: None, index_check: false, scan: false, chunked: false }
    }

    /// The variable the loop body accumulates into.
    pub fn target(&self, split: bool) -> String {
        if self.chunked {
            format!("{}_part", self.name)
        } else if split {
            format!("{}_local", self.name)
        } else {
            self.name.clone()
        }
    }

    /// The variable a `reduction` clause names on the innermost loop.
    pub fn simd_var(&self, suffix: &str) -> String {
        if self.chunked {
            format!("{}_part", self.name)
        } else {
            format!("{}{suffix}", self.name)
        }
    }

    /// The variables holding the accumulated value across the loop: (C type, name, initial
    /// value). A chunked sum's total (and compensation); a float scan's double running value.
    pub fn totals(&self, suffix: &str) -> Vec<(String, String, String)> {
        let n = &self.name;
        if self.chunked {
            let mut v = vec![("double".to_string(), format!("{n}_w{suffix}"), "0.0".to_string())];
            if self.dtype == DType::F64 {
                v.push(("double".to_string(), format!("{n}_c{suffix}"), "0.0".to_string()));
            }
            return v;
        }
        let float = matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16);
        if self.scan && float && matches!(self.op, ReduceOp::Sum | ReduceOp::Prod) {
            // a float running sum or product carries a double total, as ATen's CPU scans do
            let init = if self.op == ReduceOp::Sum { "0.0" } else { "1.0" };
            return vec![("double".to_string(), format!("{n}{suffix}"), init.to_string())];
        }
        let mut v = vec![(c_type(self.dtype).to_string(), format!("{n}{suffix}"), reduce_init(self.op, self.dtype))];
        if let Some(vd) = self.value_dtype {
            let init = reduce_init(if self.op == ReduceOp::ArgMax { ReduceOp::Max } else { ReduceOp::Min }, vd);
            v.push((c_type(vd).to_string(), format!("{n}{suffix}_v"), init));
        }
        v
    }

    pub fn declare(&self, suffix: &str) -> String {
        let decls: Vec<String> = self.totals(suffix).into_iter().map(|(ty, name, init)| format!("{ty} {name} = {init};")).collect();
        decls.join(" ")
    }

    /// The chunk's partial sum: (C type, name, initial value).
    pub fn part(&self) -> (String, String, String) {
        (c_type(self.dtype).to_string(), format!("{}_part", self.name), reduce_init(self.op, self.dtype))
    }

    /// The partial sum of one chunk, declared before the chunk's loop.
    pub fn declare_part(&self) -> String {
        let (ty, name, init) = self.part();
        format!("{ty} {name} = {init};")
    }

    /// Adds the chunk's partial sum into the total (`<name>_w<suffix>`).
    pub fn absorb_part(&self, suffix: &str) -> String {
        let n = &self.name;
        if self.dtype == DType::F64 {
            format!("ferro_sum2({n}_w{suffix}, {n}_c{suffix}, {n}_part);")
        } else {
            format!("{n}_w{suffix} += static_cast<double>({n}_part);")
        }
    }

    /// The accumulated value under the name the code after the loops reads.
    pub fn finish(&self) -> Option<String> {
        let n = &self.name;
        if !self.chunked {
            return None;
        }
        Some(if self.dtype == DType::F64 {
            format!("double {n} = {n}_w + {n}_c;")
        } else {
            format!("{} {n} = static_cast<{}>({n}_w);", c_type(self.dtype), c_type(self.dtype))
        })
    }

    /// Merges `<name><from>` into `<name><into>` (thread-local partial results).
    pub fn merge(&self, into: &str, from: &str) -> String {
        if self.chunked {
            let n = &self.name;
            return if self.dtype == DType::F64 {
                format!("ferro_sum2({n}_w{into}, {n}_c{into}, {n}_w{from}); {n}_c{into} += {n}_c{from};")
            } else {
                format!("{n}_w{into} += {n}_w{from};")
            };
        }
        let (a, b) = (format!("{}{into}", self.name), format!("{}{from}", self.name));
        match self.value_dtype {
            None => format!("{a} = {};", combine(self.op, self.dtype, &a, &b)),
            Some(_) => {
                let better = if self.op == ReduceOp::ArgMax { ">" } else { "<" };
                format!(
                    "if (({b}_v {better} {a}_v) || ({b}_v != {b}_v && {a}_v == {a}_v) || ((({b}_v == {a}_v) || ({b}_v != {b}_v && {a}_v != {a}_v)) && {b} < {a})) {{ {a}_v = {b}_v; {a} = {b}; }}"
                )
            }
        }
    }
}

/// Where a math function of values of `dt` lives: the prelude's `ferro` (real types: builtins,
/// without <cmath>'s 0.2 s of parsing per compile), or <complex>'s `std`.
fn math_namespace(dt: DType) -> &'static str {
    if dt.is_complex() {
        "std"
    } else {
        "ferro"
    }
}

pub fn reduce_init(op: ReduceOp, dt: DType) -> String {
    let ty = c_type(dt);
    match op {
        // no index yet: the first element is taken whatever its value (a window of -inf)
        ReduceOp::ArgMax | ReduceOp::ArgMin => "INT64_MAX".into(),
        // never scheduled for this backend (`CppBackend::render` refuses it)
        ReduceOp::WelfordM2 => format!("static_cast<{ty}>(0)"),
        ReduceOp::Sum => format!("static_cast<{ty}>(0)"),
        ReduceOp::Prod => format!("static_cast<{ty}>(1)"),
        ReduceOp::Any => "false".into(),
        ReduceOp::Max if dt.is_float() => format!("-std::numeric_limits<{ty}>::infinity()"),
        ReduceOp::Min if dt.is_float() => format!("std::numeric_limits<{ty}>::infinity()"),
        ReduceOp::Max => format!("std::numeric_limits<{ty}>::lowest()"),
        ReduceOp::Min => format!("std::numeric_limits<{ty}>::max()"),
    }
}

pub fn combine(op: ReduceOp, dt: DType, acc: &str, v: &str) -> String {
    match op {
        // arg reductions are merged by `Acc::merge`, never through this
        ReduceOp::ArgMax | ReduceOp::ArgMin | ReduceOp::WelfordM2 => acc.to_string(),
        ReduceOp::Sum => format!("{acc} + {v}"),
        ReduceOp::Prod => format!("{acc} * {v}"),
        ReduceOp::Any => format!("{acc} || {v}"),
        ReduceOp::Max if dt.is_float() => format!("ferro_max({acc}, {v})"),
        ReduceOp::Min if dt.is_float() => format!("ferro_min({acc}, {v})"),
        ReduceOp::Max => format!("ferro::max({acc}, {v})"),
        ReduceOp::Min => format!("ferro::min({acc}, {v})"),
    }
}

/// The chunk length of a float sum of one dtype (`Acc::chunked`).
pub type ChunkLen = fn(DType) -> i64;

pub struct BodyEmitter<'a> {
    program: &'a LoopProgram,
    ptr: &'a HashMap<BufferId, String>,
    replace: &'a HashMap<BufferId, (String, Section)>,
    ranges: &'a [i64],
    tmp: &'a mut usize,
    /// Accumulate into thread-local copies (`<acc>_local`) of the accumulators.
    split: bool,
    /// The group's reduction length and the chunk length per dtype: a float sum longer than
    /// its chunk accumulates per chunk (`Acc::chunked`).
    pub chunk_sums_above: Option<(i64, ChunkLen)>,
    /// Buffers in the kernel's scratch rows, and the current element's position in a row.
    pub rows: Option<(&'a std::collections::HashSet<BufferId>, String)>,
    /// Buffers the kernel only reads: a load of one at a fixed index is loop-invariant.
    pub read_only: Option<&'a std::collections::HashSet<BufferId>>,
    sections: HashMap<String, Section>,
    pub kernel: String,
    pub pre: String,
    pub inner: String,
    pub post: String,
    pub accs: Vec<Acc>,
}

impl<'a> BodyEmitter<'a> {
    pub fn new(
        program: &'a LoopProgram,
        _body: &LoopBody,
        ptr: &'a HashMap<BufferId, String>,
        replace: &'a HashMap<BufferId, (String, Section)>,
        ranges: &'a [i64],
        tmp: &'a mut usize,
        split: bool,
    ) -> Self {
        BodyEmitter {
            program,
            ptr,
            replace,
            ranges,
            tmp,
            split,
            chunk_sums_above: None,
            rows: None,
            read_only: None,
            sections: HashMap::new(),
            kernel: String::new(),
            pre: String::new(),
            inner: String::new(),
            post: String::new(),
            accs: Vec::new(),
        }
    }

    /// The section of a value this emitter returned (names it did not make were computed
    /// before this group: scalar locals of earlier groups).
    pub fn section_of(&self, name: &str) -> Section {
        self.sections.get(name).copied().unwrap_or(Section::Pre)
    }

    /// Inner when the index uses an inner loop variable, Kernel when it uses none, else
    /// computable before the group's loops.
    fn index_section(e: &IndexExpr) -> Section {
        let mut vs = Vec::new();
        e.vars(&mut vs);
        if vs.iter().any(|v| v.0 != 0) {
            Section::Inner
        } else if vs.is_empty() {
            Section::Kernel
        } else {
            Section::Pre
        }
    }

    pub fn index(&self, e: &IndexExpr) -> String {
        let names = |v: Var| format!("x{}", v.0);
        Printer { var_name: &names, ranges: self.ranges }.c_expr(e)
    }

    fn fresh(&mut self) -> String {
        let n = format!("tmp{}", *self.tmp);
        *self.tmp += 1;
        n
    }

    /// Emits `T tmpN = expr;` in the latest section of `at_least` and the operands' sections.
    fn emit_in(&mut self, at_least: Section, dt: DType, expr: String, operands: &[&String]) -> String {
        let section = operands.iter().map(|o| self.section_of(o)).fold(at_least, Section::max);
        let name = self.fresh();
        let line = format!("{} {name} = {expr};\n", c_type(dt));
        match section {
            Section::Kernel => self.kernel.push_str(&line),
            Section::Pre => self.pre.push_str(&line),
            Section::Inner => self.inner.push_str(&line),
            Section::Post => self.post.push_str(&line),
        }
        self.sections.insert(name.clone(), section);
        name
    }

    /// The double total of a chunked float sum named `v`, where `op` may read it in place of
    /// the sum rounded to float (infix arithmetic, which C++ computes in double).
    fn wide_total(&self, v: &str, op: BinaryOp) -> Option<String> {
        let infix = matches!(op, BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::TrueDiv);
        let acc = self.accs.iter().find(|a| a.name == v)?;
        (infix && acc.chunked && acc.dtype != DType::F64).then(|| format!("{v}_w"))
    }

    fn emit(&mut self, dt: DType, expr: String, operands: &[&String]) -> String {
        self.emit_in(Section::Kernel, dt, expr, operands)
    }
}

impl OpsHandler for BodyEmitter<'_> {
    type V = String;

    fn load(&mut self, buf: BufferId, index: &IndexExpr, dtype: DType) -> String {
        if let Some((name, section)) = self.replace.get(&buf) {
            // a scalar of an earlier group (Pre) or a value computed in this loop (Inner)
            self.sections.insert(name.clone(), *section);
            return name.clone();
        }
        if self.program.buffer(buf).layout.numel() == 0 {
            // an empty buffer is never read (its loop runs no iteration), but a load hoisted
            // before that loop would still run: it reads nothing
            return self.emit_in(Section::Kernel, dtype, format!("static_cast<{}>(0)", c_type(dtype)), &[]);
        }
        let p = self.ptr.get(&buf).cloned().unwrap_or_else(|| format!("/*missing {}*/nullptr", self.program.buffer(buf).name));
        let at = match &self.rows {
            Some((rows, position)) if rows.contains(&buf) => position.clone(),
            _ => self.index(index),
        };
        let e = load_conv(&format!("{p}[{at}]"), dtype);
        let read_only = self.read_only.is_some_and(|r| r.contains(&buf));
        // a buffer the kernel writes may change between iterations: read it in the loops
        let section = Self::index_section(index).max(if read_only { Section::Kernel } else { Section::Pre });
        self.emit_in(section, dtype, e, &[])
    }

    fn constant(&mut self, value: Scalar, dtype: DType) -> String {
        let e = match value {
            Scalar::Bool(b) => b.to_string(),
            Scalar::Int(i) => crate::codegen::literal::cpp_int(i, c_type(dtype)),
            Scalar::Float(f) => float_lit(f, dtype),
        };
        self.emit(dtype, e, &[])
    }

    fn index_expr(&mut self, e: &IndexExpr, dtype: DType) -> String {
        let ix = self.index(e);
        self.emit_in(Self::index_section(e), dtype, format!("static_cast<{}>({ix})", c_type(dtype)), &[])
    }

    fn unary(&mut self, op: UnaryOp, x: &String, xd: DType, dtype: DType) -> String {
        let fl = xd.is_float();
        let ty = c_type(dtype);
        let m = math_namespace(xd);
        let e = match op {
            UnaryOp::Abs => {
                if fl {
                    format!("{m}::abs({x})")
                } else if xd == DType::Bool {
                    x.clone()
                } else {
                    format!("static_cast<{ty}>({x} < 0 ? -{x} : {x})")
                }
            }
            UnaryOp::Neg => format!("static_cast<{ty}>(-{x})"),
            UnaryOp::Exp if ty == "float" => format!("ferro_expf({x})"),
            UnaryOp::Exp => format!("{m}::exp({x})"),
            UnaryOp::Exp2 => format!("{m}::exp2({x})"),
            UnaryOp::Expm1 => format!("{m}::expm1({x})"),
            UnaryOp::Log => format!("{m}::log({x})"),
            UnaryOp::Log2 => format!("{m}::log2({x})"),
            UnaryOp::Log10 => format!("{m}::log10({x})"),
            UnaryOp::Log1p => format!("{m}::log1p({x})"),
            UnaryOp::Sqrt => format!("{m}::sqrt({x})"),
            UnaryOp::Rsqrt => format!("static_cast<{ty}>(1) / {m}::sqrt({x})"),
            UnaryOp::Sin => format!("{m}::sin({x})"),
            UnaryOp::Cos => format!("{m}::cos({x})"),
            UnaryOp::Tan => format!("{m}::tan({x})"),
            UnaryOp::Asin => format!("{m}::asin({x})"),
            UnaryOp::Acos => format!("{m}::acos({x})"),
            UnaryOp::Atan => format!("{m}::atan({x})"),
            UnaryOp::Sinh => format!("{m}::sinh({x})"),
            UnaryOp::Cosh => format!("{m}::cosh({x})"),
            UnaryOp::Tanh => format!("{m}::tanh({x})"),
            UnaryOp::Asinh => format!("{m}::asinh({x})"),
            UnaryOp::Acosh => format!("{m}::acosh({x})"),
            UnaryOp::Atanh => format!("{m}::atanh({x})"),
            UnaryOp::Sigmoid if ty == "float" => format!("1.0f / (1.0f + ferro_expf(-{x}))"),
            UnaryOp::Sigmoid => format!("static_cast<{ty}>(1) / (static_cast<{ty}>(1) + {m}::exp(-{x}))"),
            UnaryOp::Relu => format!("({x} < 0 ? static_cast<{ty}>(0) : {x})"),
            UnaryOp::Erf => format!("{m}::erf({x})"),
            UnaryOp::Erfc => format!("{m}::erfc({x})"),
            UnaryOp::Lgamma => format!("{m}::lgamma({x})"),
            UnaryOp::Conj => format!("std::conj({x})"),
            UnaryOp::Real => format!("std::real({x})"),
            UnaryOp::Imag => format!("std::imag({x})"),
            UnaryOp::Erfcx => format!("static_cast<{ty}>(ferro_erfcx(static_cast<double>({x})))"),
            UnaryOp::Floor => {
                if fl {
                    format!("{m}::floor({x})")
                } else {
                    x.clone()
                }
            }
            UnaryOp::Ceil => {
                if fl {
                    format!("{m}::ceil({x})")
                } else {
                    x.clone()
                }
            }
            UnaryOp::Round => {
                if fl {
                    format!("{m}::nearbyint({x})")
                } else {
                    x.clone()
                }
            }
            UnaryOp::Trunc => {
                if fl {
                    format!("{m}::trunc({x})")
                } else {
                    x.clone()
                }
            }
            UnaryOp::Sign => {
                if xd == DType::Bool {
                    x.clone()
                } else {
                    format!("ferro_sign({x})")
                }
            }
            UnaryOp::Reciprocal => format!("static_cast<{ty}>(1) / {x}"),
            UnaryOp::BitwiseNot => {
                if xd == DType::Bool {
                    format!("!{x}")
                } else {
                    format!("static_cast<{ty}>(~{x})")
                }
            }
            UnaryOp::LogicalNot => format!("!{x}"),
            UnaryOp::IsNan => {
                if fl {
                    format!("{m}::isnan({x})")
                } else {
                    "false".into()
                }
            }
            UnaryOp::IsInf => {
                if fl {
                    format!("{m}::isinf({x})")
                } else {
                    "false".into()
                }
            }
        };
        self.emit(dtype, e, &[x])
    }

    fn binary(&mut self, op: BinaryOp, a: &String, b: &String, od: DType, dtype: DType) -> String {
        let fl = od.is_float();
        let ty = c_type(dtype);
        let m = math_namespace(od);
        // a long float sum's mean (or any +-*/ of it) reads the double total: one rounding
        let operands = [a, b];
        let (wa, wb) = (self.wide_total(a, op), self.wide_total(b, op));
        let (a, b) = (wa.as_ref().unwrap_or(a), wb.as_ref().unwrap_or(b));
        let e = match op {
            BinaryOp::Add => format!("{a} + {b}"),
            BinaryOp::Sub => format!("{a} - {b}"),
            BinaryOp::Mul => {
                if od == DType::Bool {
                    format!("{a} && {b}")
                } else {
                    format!("{a} * {b}")
                }
            }
            BinaryOp::TrueDiv => format!("{a} / {b}"),
            BinaryOp::FloorDiv => {
                if fl {
                    format!("ferro_floordiv_f({a}, {b})")
                } else {
                    format!("ferro_floordiv_i({a}, {b})")
                }
            }
            BinaryOp::TruncDiv => {
                if fl {
                    format!("{m}::trunc({a} / {b})")
                } else {
                    format!("ferro_truncdiv_i({a}, {b})")
                }
            }
            BinaryOp::Remainder => {
                if fl {
                    format!("ferro_remainder({a}, {b})")
                } else {
                    format!("ferro_mod_i({a}, {b})")
                }
            }
            BinaryOp::Fmod => {
                if fl {
                    format!("{m}::fmod({a}, {b})")
                } else {
                    format!("ferro_fmod_i({a}, {b})")
                }
            }
            BinaryOp::Pow => {
                if fl {
                    format!("{m}::pow({a}, {b})")
                } else {
                    format!("ferro_ipow<{ty}>({a}, {b})")
                }
            }
            BinaryOp::Maximum => {
                if fl {
                    format!("ferro_max({a}, {b})")
                } else {
                    format!("ferro::max({a}, {b})")
                }
            }
            BinaryOp::Minimum => {
                if fl {
                    format!("ferro_min({a}, {b})")
                } else {
                    format!("ferro::min({a}, {b})")
                }
            }
            BinaryOp::Atan2 => format!("{m}::atan2({a}, {b})"),
            BinaryOp::Eq => format!("{a} == {b}"),
            BinaryOp::Ne => format!("{a} != {b}"),
            BinaryOp::Lt => format!("{a} < {b}"),
            BinaryOp::Le => format!("{a} <= {b}"),
            BinaryOp::Gt => format!("{a} > {b}"),
            BinaryOp::Ge => format!("{a} >= {b}"),
            BinaryOp::LogicalAnd => format!("static_cast<bool>({a}) && static_cast<bool>({b})"),
            BinaryOp::LogicalOr => format!("static_cast<bool>({a}) || static_cast<bool>({b})"),
            BinaryOp::LogicalXor => format!("static_cast<bool>({a}) != static_cast<bool>({b})"),
            BinaryOp::BitAnd => format!("{a} & {b}"),
            BinaryOp::BitOr => format!("{a} | {b}"),
            BinaryOp::BitXor => format!("{a} ^ {b}"),
            BinaryOp::LShift => format!("ferro_lshift({a}, {b})"),
            BinaryOp::RShift => format!("ferro_rshift({a}, {b})"),
        };
        let e = if dtype == DType::Bool || op.is_comparison() { e } else { format!("static_cast<{ty}>({e})") };
        self.emit(dtype, e, &operands)
    }

    fn where_(&mut self, c: &String, a: &String, b: &String, dtype: DType) -> String {
        self.emit(dtype, format!("{c} ? {a} : {b}"), &[c, a, b])
    }

    fn cast(&mut self, x: &String, from: DType, to: DType) -> String {
        let e = cast_expr(x, from, to);
        self.emit(to, e, &[x])
    }

    fn reduce(&mut self, op: ReduceOp, x: &String, dtype: DType, _id: ValueId) -> String {
        let acc = self.fresh().replace("tmp", "acc");
        let mut a = Acc::new(acc.clone(), op, dtype);
        a.chunked = op == ReduceOp::Sum && dtype.is_float() && self.chunk_sums_above.is_some_and(|(len, chunk)| len > chunk(dtype));
        let target = a.target(self.split);
        let line = format!("{target} = {};\n", combine(op, dtype, &target, x));
        self.inner.push_str(&line);
        self.accs.push(a);
        self.sections.insert(acc.clone(), Section::Post);
        acc
    }

    fn arg_reduce(&mut self, op: ReduceOp, value: &String, index: &String, vd: DType) -> String {
        let acc = self.fresh().replace("tmp", "acc");
        let t = if self.split { format!("{acc}_local") } else { acc.clone() };
        let better = if op == ReduceOp::ArgMax { ">" } else { "<" };
        let nan = if vd.is_float() { format!(" || ({value} != {value} && {t}_v == {t}_v)") } else { String::new() };
        self.inner.push_str(&format!("if (({value} {better} {t}_v){nan} || {t} == INT64_MAX) {{ {t}_v = {value}; {t} = {index}; }}\n"));
        self.accs.push(Acc { value_dtype: Some(vd), ..Acc::new(acc.clone(), op, DType::I64) });
        self.sections.insert(acc.clone(), Section::Post);
        acc
    }

    fn random(&mut self, normal: bool, seed: &String, offset: &String) -> String {
        let f = if normal { "ferro_randn" } else { "ferro_rand" };
        self.emit(DType::F32, format!("{f}(static_cast<uint64_t>({seed}), static_cast<uint64_t>({offset}))"), &[seed, offset])
    }

    fn scan(&mut self, op: ReduceOp, x: &String, dtype: DType) -> String {
        let acc = self.fresh().replace("tmp", "acc");
        self.inner.push_str(&format!("{acc} = {};\n", combine(op, dtype, &acc, x)));
        self.accs.push(Acc { scan: true, ..Acc::new(acc.clone(), op, dtype) });
        self.emit_in(Section::Inner, dtype, acc, &[x])
    }

    fn load_indirect(&mut self, buf: BufferId, index: &IndexExpr, terms: &[(String, i64)], dtype: DType) -> String {
        if self.program.buffer(buf).layout.numel() == 0 {
            return self.emit_in(Section::Kernel, dtype, format!("static_cast<{}>(0)", c_type(dtype)), &[]);
        }
        let p = self.ptr.get(&buf).cloned().unwrap_or_else(|| format!("/*missing {}*/nullptr", self.program.buffer(buf).name));
        let mut addr = self.index(index);
        for (v, c) in terms {
            addr.push_str(&format!(" + {c}LL*{v}"));
        }
        let raw = format!("{p}[{addr}]");
        let read_only = self.read_only.is_some_and(|r| r.contains(&buf));
        let at = Self::index_section(index).max(if read_only { Section::Kernel } else { Section::Pre });
        let e = match dtype {
            DType::F16 => format!("ferro_h2f({raw})"),
            DType::C32 => format!("ferro_chalf2c({raw})"),
            DType::BF16 => format!("ferro_bf2f({raw})"),
            DType::Bool => format!("({raw} != 0)"),
            _ => raw,
        };
        let ops: Vec<&String> = terms.iter().map(|(v, _)| v).collect();
        self.emit_in(at, dtype, e, &ops)
    }

    fn check_index(&mut self, value: &String, size: i64, wrap: bool) -> String {
        let w = if wrap { format!("({value} < 0 ? {value} + {size}LL : {value})") } else { value.clone() };
        let wrapped = self.emit(DType::I64, w, &[value]);
        let flag = self.fresh().replace("tmp", "bad");
        let target = if self.split { format!("{flag}_local") } else { flag.clone() };
        let line = format!("{target} = {target} || ({wrapped} < 0) || ({wrapped} >= {size}LL);\n");
        // an index fixed across the inner loop (an embedding row) is checked once, before it:
        // an `||` accumulated in the loop kept GCC from vectorizing GPT-2's embedding + LayerNorm
        if self.section_of(&wrapped) <= Section::Pre && !self.split {
            self.pre.push_str(&line);
        } else {
            self.inner.push_str(&line);
        }
        self.accs.push(Acc { index_check: true, ..Acc::new(flag, ReduceOp::Any, DType::Bool) });
        // clamped, so that the load stays inside the buffer whatever the input
        let clamped = format!("({wrapped} < 0 ? 0LL : ({wrapped} >= {size}LL ? {}LL : {wrapped}))", size - 1);
        self.emit(DType::I64, clamped, &[&wrapped])
    }

    fn store(&mut self, _index: &IndexExpr, _terms: &[(String, i64)], _mode: StoreMode, _value: &String, _dtype: DType) {
        // the kernel writer places the store: it knows the buffer's storage and local name
    }
}
