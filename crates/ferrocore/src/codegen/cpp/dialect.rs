//! The C++ dialect of the kernel writer: C++ types, casts, math, accumulators and stores of
//! one loop group. Values that depend on a reduction result go after the group's loops,
//! loop-invariant ones before every loop (`Section::Kernel`), everything else inside.

use super::super::writer::{cast, math_name, Accumulator, CastRules, Dialect, IndexPrinter, IndexSyntax, NodeValue, Section, Values};
use super::super::CodegenError;
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::Storage;
use crate::symbolic::{IndexExpr, Var};
use std::collections::{HashMap, HashSet};

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

/// C++'s conversions (see `writer::cast`).
pub struct CppCasts;

impl CastRules for CppCasts {
    fn special(v: &str, from: DType, to: DType) -> Option<String> {
        if from.is_complex() && !to.is_complex() {
            // complex -> real keeps the real part, as ATen's copy does
            if to == DType::Bool {
                return Some(format!("({v} != {}(0))", c_type(from)));
            }
            return Some(cast::<CppCasts>(&format!("std::real({v})"), if from == DType::C128 { DType::F64 } else { DType::F32 }, to));
        }
        if to == DType::C32 {
            return Some(format!("ferro_round_chalf(static_cast<std::complex<float>>({v}))"));
        }
        if from.is_float() {
            // x86 CPU eager: int32 and int64 saturate to the minimum; int8/int16 keep the low bits
            // of the int32 conversion and uint8 those of the int64 one (c10 casts to uint8 through
            // int64)
            match to {
                DType::I64 => return Some(format!("ferro_f2i<int64_t>({v})")),
                DType::I32 => return Some(format!("ferro_f2i<int32_t>({v})")),
                DType::I16 | DType::I8 => return Some(format!("static_cast<{}>(ferro_f2i<int32_t>({v}))", c_type(to))),
                DType::U8 => return Some(format!("static_cast<uint8_t>(ferro_f2i<int64_t>({v}))")),
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
            return Some(match to {
                DType::F16 => format!("ferro_round_half({v})"),
                DType::BF16 => format!("ferro_round_bf16({v})"),
                _ => v,
            });
        }
        None
    }

    fn plain(v: &str, to: DType) -> String {
        format!("static_cast<{}>({v})", c_type(to))
    }

    fn round_half(v: &str, to: DType) -> String {
        let f = if to == DType::F16 { "ferro_round_half" } else { "ferro_round_bf16" };
        format!("{f}(static_cast<float>({v}))")
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

pub(super) fn float_lit(f: f64, dt: DType) -> String {
    crate::codegen::literal::cpp_float(f, c_type(dt))
}

/// One accumulator of a reduction loop; arg reductions also carry the running best value.
#[derive(Clone, Debug)]
pub struct Acc {
    pub acc: Accumulator,
    /// An "any index out of range" flag rather than a value of the body.
    pub index_check: bool,
    /// A running scan value: the loop carries a dependence and must stay sequential.
    pub scan: bool,
    /// A float sum of a long reduction: the loop adds into `<name>_part`, a partial sum of one
    /// chunk in the vector lanes, and each chunk's partial is added into the total `<name>_w`,
    /// which is double for float and half types and compensated (`<name>_c`) for double.
    pub chunked: bool,
}

impl std::ops::Deref for Acc {
    type Target = Accumulator;
    fn deref(&self) -> &Accumulator {
        &self.acc
    }
}

impl Acc {
    pub fn new(name: String, op: ReduceOp, dtype: DType) -> Acc {
        Acc::of(Accumulator::new(name, op, dtype))
    }

    pub fn of(acc: Accumulator) -> Acc {
        Acc { acc, index_check: false, scan: false, chunked: false }
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

/// C++'s integer index syntax (64-bit literals; the prelude's floor helpers).
const CPP_INDEX: IndexSyntax =
    IndexSyntax { int_suffix: "LL", div: "/", rem: "%", paren_dividend: true, floor_div_helper: "ferro_floordiv", mod_helper: "ferro_mod" };

/// An index expression in C++ over the loop variables `x0, x1, ...`.
pub fn index(e: &IndexExpr, ranges: &[i64]) -> String {
    let names = |v: Var| format!("x{}", v.0);
    IndexPrinter { syntax: &CPP_INDEX, var_name: &names, ranges }.expr(e)
}

/// The chunk length of a float sum of one dtype (`Acc::chunked`).
pub type ChunkLen = fn(DType) -> i64;

/// One loop group of a C++ kernel, as the kernel writer's dialect.
pub struct CppGroup<'a> {
    pub program: &'a LoopProgram,
    pub storage: &'a [Storage],
    /// Each buffer's pointer (or scratch row) in the kernel.
    pub ptr: &'a HashMap<BufferId, String>,
    /// Accumulate into thread-local copies (`<acc>_local`) of the accumulators.
    pub split: bool,
    /// The group's reduction length and the chunk length per dtype: a float sum longer than
    /// its chunk accumulates per chunk (`Acc::chunked`).
    pub chunk_sums_above: Option<(i64, ChunkLen)>,
    /// Buffers in the kernel's scratch rows, and the current element's position in a row.
    pub rows: &'a HashSet<BufferId>,
    pub row_position: String,
    /// Buffers the kernel only reads: a load of one at a fixed index is loop-invariant.
    pub read_only: &'a HashSet<BufferId>,
    pub accs: Vec<Acc>,
}

impl<'a> CppGroup<'a> {
    /// A template kernel's group (a matrix product's epilogue, an attention's bias): no scratch
    /// rows (`no_rows` is empty), no split accumulators.
    pub fn of_template(
        program: &'a LoopProgram,
        storage: &'a [Storage],
        ptr: &'a HashMap<BufferId, String>,
        read_only: &'a HashSet<BufferId>,
        no_rows: &'a HashSet<BufferId>,
    ) -> CppGroup<'a> {
        CppGroup {
            program,
            storage,
            ptr,
            split: false,
            chunk_sums_above: None,
            rows: no_rows,
            row_position: "0".into(),
            read_only,
            accs: Vec::new(),
        }
    }
}

impl CppGroup<'_> {
    /// The double total of a chunked float sum named `v`, where `op` may read it in place of
    /// the sum rounded to float (infix arithmetic, which C++ computes in double).
    fn wide_total(&self, v: &str, op: BinaryOp) -> Option<String> {
        let infix = matches!(op, BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::TrueDiv);
        let acc = self.accs.iter().find(|a| a.name == v)?;
        (infix && acc.chunked && acc.dtype != DType::F64).then(|| format!("{v}_w"))
    }

    fn pointer(&self, buf: BufferId) -> String {
        self.ptr.get(&buf).cloned().unwrap_or_else(|| format!("/*missing {}*/nullptr", self.program.buffer(buf).name))
    }

    /// Where a load of `buf` at `index` may be computed: a buffer the kernel writes may change
    /// between iterations, so it is read in the loops.
    fn load_section(&self, v: &Values, buf: BufferId, index: &IndexExpr) -> Section {
        v.index_section(index).max(if self.read_only.contains(&buf) { Section::Kernel } else { Section::Pre })
    }

    /// An empty buffer is never read (its loop runs no iteration), but a load hoisted before
    /// that loop would still run: it reads nothing.
    fn empty_load(&self, v: &mut Values, buf: BufferId, dtype: DType) -> Option<String> {
        (self.program.buffer(buf).layout.numel() == 0)
            .then(|| v.emit_in(Section::Kernel, dtype, format!("static_cast<{}>(0)", c_type(dtype)), &[]))
    }
}

fn assign(name: &str, dtype: DType, expr: &str) -> String {
    format!("{} {name} = {expr};\n", c_type(dtype))
}

impl Dialect for CppGroup<'_> {
    const ASSIGN: super::super::writer::Assign = assign;
    const LOGICAL: [&'static str; 3] = ["&&", "||", "!="];
    const KERNEL_SECTION: bool = true;

    fn index(&self, e: &IndexExpr, ranges: &[i64]) -> String {
        index(e, ranges)
    }

    fn load(&mut self, v: &mut Values, buf: BufferId, ix: &IndexExpr, dtype: DType) -> String {
        if let Some(nothing) = self.empty_load(v, buf, dtype) {
            return nothing;
        }
        let at = if self.rows.contains(&buf) { self.row_position.clone() } else { index(ix, v.ranges) };
        let e = load_conv(&format!("{}[{at}]", self.pointer(buf)), dtype);
        let section = self.load_section(v, buf, ix);
        v.emit_in(section, dtype, e, &[])
    }

    fn load_indirect(&mut self, v: &mut Values, buf: BufferId, ix: &IndexExpr, terms: &[(String, i64)], dtype: DType) -> String {
        if let Some(nothing) = self.empty_load(v, buf, dtype) {
            return nothing;
        }
        let mut addr = index(ix, v.ranges);
        for (t, c) in terms {
            addr.push_str(&format!(" + {c}LL*{t}"));
        }
        let e = load_conv(&format!("{}[{addr}]", self.pointer(buf)), dtype);
        let section = self.load_section(v, buf, ix);
        let ops: Vec<&String> = terms.iter().map(|(t, _)| t).collect();
        v.emit_in(section, dtype, e, &ops)
    }

    fn constant(&self, value: Scalar, dtype: DType) -> String {
        match value {
            Scalar::Bool(b) => b.to_string(),
            Scalar::Int(i) => crate::codegen::literal::cpp_int(i, c_type(dtype)),
            Scalar::Float(f) => float_lit(f, dtype),
        }
    }

    fn index_value(&self, v: &Values, e: &IndexExpr, dtype: DType) -> String {
        format!("static_cast<{}>({})", c_type(dtype), index(e, v.ranges))
    }

    fn unary(&self, op: UnaryOp, x: &str, xd: DType, dtype: DType) -> Result<String, String> {
        let ty = c_type(dtype);
        let m = math_namespace(xd);
        let fast_float = ty == "float";
        Ok(match op {
            UnaryOp::Abs if !xd.is_float() => format!("static_cast<{ty}>({x} < 0 ? -{x} : {x})"),
            UnaryOp::IsNan | UnaryOp::IsInf if !xd.is_float() => "false".into(),
            UnaryOp::Neg => format!("static_cast<{ty}>(-{x})"),
            UnaryOp::Exp if fast_float => format!("ferro_expf({x})"),
            UnaryOp::Sigmoid if fast_float => format!("1.0f / (1.0f + ferro_expf(-{x}))"),
            UnaryOp::Sigmoid => format!("static_cast<{ty}>(1) / (static_cast<{ty}>(1) + {m}::exp(-{x}))"),
            UnaryOp::Rsqrt => format!("static_cast<{ty}>(1) / {m}::sqrt({x})"),
            UnaryOp::Reciprocal => format!("static_cast<{ty}>(1) / {x}"),
            UnaryOp::Relu => format!("({x} < 0 ? static_cast<{ty}>(0) : {x})"),
            UnaryOp::Erfcx => format!("static_cast<{ty}>(ferro_erfcx(static_cast<double>({x})))"),
            UnaryOp::Sign => format!("ferro_sign({x})"),
            UnaryOp::BitwiseNot => format!("static_cast<{ty}>(~{x})"),
            UnaryOp::LogicalNot => format!("!{x}"),
            UnaryOp::Conj => format!("std::conj({x})"),
            UnaryOp::Real => format!("std::real({x})"),
            UnaryOp::Imag => format!("std::imag({x})"),
            _ => format!("{m}::{}({x})", math_name(op).ok_or_else(|| format!("{op:?}"))?),
        })
    }

    fn binary(&self, op: BinaryOp, a: &str, b: &str, od: DType, dtype: DType) -> String {
        let fl = od.is_float();
        let m = math_namespace(od);
        // a long float sum's mean (or any +-*/ of it) reads the double total: one rounding
        let (wa, wb) = (self.wide_total(a, op), self.wide_total(b, op));
        let (a, b) = (wa.as_deref().unwrap_or(a), wb.as_deref().unwrap_or(b));
        let helper = |f: &str| format!("{f}({a}, {b})");
        match op {
            BinaryOp::Add => format!("{a} + {b}"),
            BinaryOp::Sub => format!("{a} - {b}"),
            BinaryOp::Mul if od == DType::Bool => format!("{a} && {b}"),
            BinaryOp::Mul => format!("{a} * {b}"),
            BinaryOp::TrueDiv => format!("{a} / {b}"),
            BinaryOp::TruncDiv if fl => format!("{m}::trunc({a} / {b})"),
            BinaryOp::Pow if !fl => format!("ferro_ipow<{}>({a}, {b})", c_type(dtype)),
            BinaryOp::Pow if fl => format!("{m}::pow({a}, {b})"),
            BinaryOp::Fmod if fl => format!("{m}::fmod({a}, {b})"),
            BinaryOp::Atan2 => format!("{m}::atan2({a}, {b})"),
            BinaryOp::Remainder if fl => helper("ferro_remainder"),
            BinaryOp::Maximum if !fl => helper("ferro::max"),
            BinaryOp::Minimum if !fl => helper("ferro::min"),
            _ => helper(&prelude_helper(op, fl)),
        }
    }

    fn truth(&self, x: &str) -> String {
        format!("static_cast<bool>({x})")
    }

    fn convert(&self, e: &str, dtype: DType) -> String {
        format!("static_cast<{}>({e})", c_type(dtype))
    }

    fn select(&self, c: &str, a: &str, b: &str) -> String {
        format!("{c} ? {a} : {b}")
    }

    fn cast(&self, x: &str, from: DType, to: DType) -> Option<String> {
        Some(cast::<CppCasts>(x, from, to))
    }

    fn random(&self, normal: bool, seed: &str, offset: &str) -> String {
        let f = if normal { "ferro_randn" } else { "ferro_rand" };
        format!("{f}(static_cast<uint64_t>({seed}), static_cast<uint64_t>({offset}))")
    }

    fn reduce(&mut self, v: &mut Values, op: ReduceOp, x: &str, dtype: DType) -> String {
        let acc = v.fresh("acc");
        let mut a = Acc::new(acc.clone(), op, dtype);
        a.chunked = op == ReduceOp::Sum && dtype.is_float() && self.chunk_sums_above.is_some_and(|(len, chunk)| len > chunk(dtype));
        let target = a.target(self.split);
        v.push(Section::Inner, &format!("{target} = {};\n", combine(op, dtype, &target, x)));
        self.accs.push(a);
        v.place(&acc, Section::Post);
        acc
    }

    fn arg_reduce(&mut self, v: &mut Values, op: ReduceOp, value: &str, index: &str, vd: DType) -> String {
        let acc = v.fresh("acc");
        let t = if self.split { format!("{acc}_local") } else { acc.clone() };
        let better = if op == ReduceOp::ArgMax { ">" } else { "<" };
        let nan = if vd.is_float() { format!(" || ({value} != {value} && {t}_v == {t}_v)") } else { String::new() };
        v.push(Section::Inner, &format!("if (({value} {better} {t}_v){nan} || {t} == INT64_MAX) {{ {t}_v = {value}; {t} = {index}; }}\n"));
        self.accs.push(Acc::of(Accumulator::arg(acc.clone(), op, vd)));
        v.place(&acc, Section::Post);
        acc
    }

    fn scan(&mut self, v: &mut Values, op: ReduceOp, x: &str, dtype: DType) -> String {
        let acc = v.fresh("acc");
        v.push(Section::Inner, &format!("{acc} = {};\n", combine(op, dtype, &acc, x)));
        self.accs.push(Acc { scan: true, ..Acc::new(acc.clone(), op, dtype) });
        let x = x.to_string();
        v.emit_in(Section::Inner, dtype, acc, &[&x])
    }

    fn check_index(&mut self, v: &mut Values, value: &str, size: i64, wrap: bool) -> String {
        let value = value.to_string();
        let w = if wrap { format!("({value} < 0 ? {value} + {size}LL : {value})") } else { value.clone() };
        let wrapped = v.emit(DType::I64, w, &[&value]);
        let flag = v.fresh("bad");
        let target = if self.split { format!("{flag}_local") } else { flag.clone() };
        let line = format!("{target} = {target} || ({wrapped} < 0) || ({wrapped} >= {size}LL);\n");
        // an index fixed across the inner loop (an embedding row) is checked once, before it:
        // an `||` accumulated in the loop kept GCC from vectorizing GPT-2's embedding + LayerNorm
        let once = v.section_of(&wrapped) <= Section::Pre && !self.split;
        v.push(if once { Section::Pre } else { Section::Inner }, &line);
        self.accs.push(Acc { index_check: true, ..Acc::new(flag, ReduceOp::Any, DType::Bool) });
        // clamped, so that the load stays inside the buffer whatever the input
        let clamped = format!("({wrapped} < 0 ? 0LL : ({wrapped} >= {size}LL ? {}LL : {wrapped}))", size - 1);
        v.emit(DType::I64, clamped, &[&wrapped])
    }

    fn local_name(&self, pos: usize) -> String {
        format!("loc_{pos}")
    }

    fn node_section(&self, n: &NodeValue, v: &Values) -> Section {
        if n.node.kind() == NodeKind::Reduction || v.section_of(&n.value) == Section::Post {
            Section::Post
        } else {
            Section::Inner
        }
    }

    fn store(&mut self, n: &NodeValue, v: &Values) -> Result<String, CodegenError> {
        let out = n.node.output;
        if !matches!(self.storage[out.0 as usize], Storage::Allocated | Storage::Row) {
            return Ok(String::new());
        }
        let mut idx = if self.rows.contains(&out) { self.row_position.clone() } else { index(&n.store.index, v.ranges) };
        for (t, c) in n.store_terms() {
            idx = format!("{idx} + {c}LL * {t}");
        }
        let dst = self.ptr.get(&out).ok_or_else(|| CodegenError::internal(n.kernel, "output without a pointer"))?;
        let odt = n.out_dtype;
        let local = &n.local;
        Ok(match n.store.mode {
            StoreMode::Set => format!("{dst}[{idx}] = {};\n", store_conv(local, odt)),
            StoreMode::Combine(op) if super::atomic_scatter(op, odt) => format!("#pragma omp atomic\n{dst}[{idx}] += {local};\n"),
            StoreMode::Combine(op) => {
                // a read-modify-write; the kernel runs sequentially (see `scatter_parallel`)
                let old = load_conv(&format!("{dst}[{idx}]"), odt);
                let new = if odt == DType::Bool {
                    let c = if matches!(op, ReduceOp::Sum | ReduceOp::Max) { "||" } else { "&&" };
                    format!("({old} {c} {local})")
                } else {
                    combine(op, odt, &old, local)
                };
                format!("{dst}[{idx}] = {};\n", store_conv(&new, odt))
            }
        })
    }
}

/// The prelude's helper for a binary operation C++ has no operator for (`ferro_<op>_f` on
/// floats, `ferro_<op>_i` on integers, where the two differ).
fn prelude_helper(op: BinaryOp, fl: bool) -> String {
    let (name, typed) = match op {
        BinaryOp::FloorDiv => ("floordiv", true),
        BinaryOp::TruncDiv => ("truncdiv", true),
        BinaryOp::Remainder => ("mod", true),
        BinaryOp::Fmod => ("fmod", true),
        BinaryOp::Maximum => ("max", false),
        BinaryOp::Minimum => ("min", false),
        BinaryOp::LShift => ("lshift", false),
        BinaryOp::RShift => ("rshift", false),
        _ => ("unreachable", false),
    };
    match (typed, fl) {
        (false, _) => format!("ferro_{name}"),
        (true, true) => format!("ferro_{name}_f"),
        (true, false) => format!("ferro_{name}_i"),
    }
}
