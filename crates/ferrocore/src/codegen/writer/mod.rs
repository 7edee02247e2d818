//! The one kernel writer: a walk over a fused kernel's loop groups and their nodes (loads,
//! values, reductions, stores) that every backend shares, with the backend's language as a
//! `Dialect`. The walk decides what is computed where (`Section`), which values a node reads
//! from registers rather than memory, how a node's result is bound and when it is stored; the
//! dialect spells each value, accumulator and store, and lays the group's code out in loops.

mod index;
mod values;

pub use index::{IndexPrinter, IndexSyntax};
pub use values::{Assign, Computed, Section, SectionText, Values};

use super::CodegenError;
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, KernelNode, LocalRead, LoopGroup, Schedule};
use crate::symbolic::IndexExpr;
use std::collections::HashMap;

/// A backend's language, for one loop group of one kernel: how values, accumulators, loads and
/// stores are written. Operations every dialect writes alike (comparisons, bitwise operators,
/// identities) are written by the walk (`ops`).
pub trait Dialect {
    /// The statement binding a value (see `Assign`).
    const ASSIGN: Assign;
    /// Whether values may be computed once per kernel call (`Section::Kernel`).
    const KERNEL_SECTION: bool;

    /// The dtype a buffer of `dt` holds its elements as.
    fn element_type(&self, dt: DType) -> DType {
        dt
    }
    /// An index expression over the node's loop variables.
    fn index(&self, e: &IndexExpr, ranges: &[i64]) -> String;
    /// A value read from `buf` at `index` (not one served from registers).
    fn load(&mut self, v: &mut Values, buf: BufferId, index: &IndexExpr, dtype: DType) -> String;
    /// A value read from `buf` at `index` plus value-dependent `terms` (a gather).
    fn load_indirect(&mut self, v: &mut Values, buf: BufferId, index: &IndexExpr, terms: &[(String, i64)], dtype: DType) -> String;
    /// A constant of `dtype`.
    fn constant(&self, value: Scalar, dtype: DType) -> String;
    /// The value of an index expression as `dtype`.
    fn index_value(&self, v: &Values, e: &IndexExpr, dtype: DType) -> String;
    /// `op(x)`, or why the dialect cannot write it.
    fn unary(&self, op: UnaryOp, x: &str, xd: DType, dtype: DType) -> Result<String, String>;
    /// `a op b` for operands of `od`, before the conversion to `dtype`.
    fn binary(&self, op: BinaryOp, a: &str, b: &str, od: DType, dtype: DType) -> String;
    /// The operators combining truth values: and, or, xor.
    const LOGICAL: [&'static str; 3];
    /// `x` as a truth value.
    fn truth(&self, x: &str) -> String;
    /// `e` converted to `dtype` (the result of an arithmetic operation).
    fn convert(&self, e: &str, dtype: DType) -> String;
    fn select(&self, c: &str, a: &str, b: &str) -> String;
    /// `x` of `from` as `to`; `None`: `x` already is that value.
    fn cast(&self, x: &str, from: DType, to: DType) -> Option<String>;
    fn random(&self, normal: bool, seed: &str, offset: &str) -> String;
    fn reduce(&mut self, v: &mut Values, op: ReduceOp, x: &str, dtype: DType) -> String;
    fn arg_reduce(&mut self, v: &mut Values, op: ReduceOp, value: &str, index: &str, vd: DType) -> String;
    fn scan(&mut self, v: &mut Values, op: ReduceOp, x: &str, dtype: DType) -> String;
    fn check_index(&mut self, v: &mut Values, value: &str, size: i64, wrap: bool) -> String;

    /// The name of the node at kernel position `pos`'s result (by position, not buffer name:
    /// kernels that differ only in their buffers stay the same text).
    fn local_name(&self, pos: usize) -> String;
    /// Where the node's result is bound and stored.
    fn node_section(&self, n: &NodeValue, v: &Values) -> Section;
    /// The statements storing the node's result to memory (empty when it is not stored).
    fn store(&mut self, n: &NodeValue, v: &Values) -> Result<String, CodegenError>;
}

/// A reduction's running value: its name, how it combines, its dtype; an arg reduction also
/// carries the best value so far (of `value_dtype`). Dialects add what their loops need.
#[derive(Clone, Debug)]
pub struct Accumulator {
    pub name: String,
    pub op: ReduceOp,
    pub dtype: DType,
    pub value_dtype: Option<DType>,
}

impl Accumulator {
    pub fn new(name: String, op: ReduceOp, dtype: DType) -> Accumulator {
        Accumulator { name, op, dtype, value_dtype: None }
    }

    /// An arg reduction's accumulator: the index (int64) and the best value of `vd`.
    pub fn arg(name: String, op: ReduceOp, vd: DType) -> Accumulator {
        Accumulator { name, op, dtype: DType::I64, value_dtype: Some(vd) }
    }
}

/// The values of one node, as the walk computed them.
pub struct NodeValue<'a> {
    /// The kernel's name (for errors).
    pub kernel: &'a str,
    pub kernel_node: &'a KernelNode,
    pub node: &'a LoopNode,
    /// Every expression's value, by `ValueId`.
    pub vals: Vec<String>,
    /// The stored value and its dtype.
    pub value: String,
    pub value_dtype: DType,
    /// The dtype the node's buffer holds (the dialect's element type).
    pub out_dtype: DType,
    pub store: &'a Store,
    /// The node's result bound as the reader of its buffer sees it (rounded to its type).
    pub local: String,
}

impl NodeValue<'_> {
    /// The store's value-dependent terms, as values.
    pub fn store_terms(&self) -> impl Iterator<Item = (&String, i64)> {
        self.store.terms.iter().map(|(v, c)| (&self.vals[v.0 as usize], *c))
    }
}

/// The ops handler that writes a node body in a dialect.
pub struct Emitter<'d, 'v, D: Dialect> {
    pub d: &'d mut D,
    pub v: Values<'v>,
    /// Reads served from registers: buffer -> (value, section).
    replace: &'v HashMap<BufferId, (String, Section)>,
}

/// The in-kernel results the walk has bound: buffer -> (value, section).
pub type Locals = HashMap<BufferId, (String, Section)>;

/// Writes one loop group's nodes: returns the code of each section. `computed` carries the
/// values the group may reuse (for dialects whose compiler does not eliminate repeats).
#[allow(clippy::too_many_arguments)]
pub fn write_group<D: Dialect>(
    d: &mut D,
    s: &Schedule,
    k: &FusedKernel,
    g: &LoopGroup,
    locals: &mut Locals,
    reads_at: &HashMap<usize, Vec<(BufferId, LocalRead)>>,
    tmp: &mut usize,
    mut computed: Option<&mut Computed>,
) -> Result<SectionText, CodegenError> {
    let p = &s.program;
    let err = |m: String| CodegenError::internal(&k.name, m);
    let mut text = SectionText::default();
    for &pos in &g.nodes {
        let kn = &k.plan.nodes[pos];
        let node = &p.nodes[kn.node];
        let mut replace: HashMap<BufferId, (String, Section)> = HashMap::new();
        for (b, kind) in reads_at.get(&pos).into_iter().flatten() {
            let (name, section) = locals.get(b).cloned().ok_or_else(|| err(format!("no local value for {}", p.buffer(*b).name)))?;
            match kind {
                LocalRead::Scalar => replace.insert(*b, (name, Section::Pre)),
                LocalRead::Forwarded => replace.insert(*b, (name, section)),
                LocalRead::Stored => continue,
            };
        }
        let values = Values::new(tmp, D::ASSIGN, D::KERNEL_SECTION, computed.as_deref_mut(), &kn.ranges);
        let mut em = Emitter { d: &mut *d, v: values, replace: &replace };
        let vals = kn.body.visit(&mut em);
        let Emitter { v, .. } = em;
        if let Some(why) = v.unsupported.clone() {
            return Err(CodegenError::unsupported(&k.name, why));
        }
        let store = kn.body.store.as_ref().ok_or_else(|| err("node without a store".into()))?;
        let value = vals[store.value.0 as usize].clone();
        let value_dtype = kn.body.dtype(store.value);
        let out_dtype = d.element_type(p.buffer(node.output).layout.dtype);
        let local = d.local_name(pos);
        let n = NodeValue { kernel: &k.name, kernel_node: kn, node, vals, value, value_dtype, out_dtype, store, local };
        let section = d.node_section(&n, &v);
        let bound = d.cast(&n.value, value_dtype, out_dtype).unwrap_or_else(|| n.value.clone());
        let mut lines = (D::ASSIGN)(&n.local, out_dtype, &bound);
        lines.push_str(&d.store(&n, &v)?);
        text.append(&v.text);
        text.at(section).push_str(&lines);
        locals.insert(node.output, (n.local, section));
    }
    Ok(text)
}

/// Values of a body, written in a dialect but not stored: the text of each section and each
/// value's name (a template computes them inside loops of its own: an attention's bias).
/// `outer_vars`: the variables fixed before the template's inner loop (a bit each).
pub fn write_values<D: Dialect>(
    d: &mut D,
    body: &LoopBody,
    values: &[ValueId],
    ranges: &[i64],
    outer_vars: u64,
    tmp: &mut usize,
) -> Result<(SectionText, Vec<String>), String> {
    let replace = HashMap::new();
    let mut values_of = Values::new(tmp, D::ASSIGN, D::KERNEL_SECTION, None, ranges);
    values_of.outer_vars = outer_vars;
    let mut em = Emitter { d, v: values_of, replace: &replace };
    let vals = body.visit(&mut em);
    let Emitter { v, .. } = em;
    if let Some(why) = v.unsupported {
        return Err(why);
    }
    Ok((v.text, values.iter().map(|x| vals[x.0 as usize].clone()).collect()))
}

/// Each node's reads of in-kernel values (looked up per node: kernels of thousands of nodes).
pub fn local_reads_by_node(k: &FusedKernel) -> HashMap<usize, Vec<(BufferId, LocalRead)>> {
    let mut at: HashMap<usize, Vec<(BufferId, LocalRead)>> = HashMap::new();
    for (r, b, kind) in &k.plan.local_reads {
        at.entry(*r).or_default().push((*b, *kind));
    }
    at
}

/// How a dialect converts values between dtypes, beyond what every dialect writes alike.
pub trait CastRules {
    /// The dialect's own conversion of `v` from `from` to `to`, if it has one.
    fn special(v: &str, from: DType, to: DType) -> Option<String>;
    /// A plain conversion of `v` to `to`.
    fn plain(v: &str, to: DType) -> String;
    /// A float32 `v` rounded to the precision of half type `to` (and computed on in float32).
    fn round_half(v: &str, to: DType) -> String;
}

/// `v` (computed as `from`) as a value of `to`.
pub fn cast<R: CastRules>(v: &str, from: DType, to: DType) -> String {
    if from == to {
        return v.to_string();
    }
    if let Some(e) = R::special(v, from, to) {
        return e;
    }
    match to {
        DType::Bool => format!("({v} != 0)"),
        // half types are computed in float32 already
        DType::F32 if matches!(from, DType::F16 | DType::BF16) => v.to_string(),
        DType::F16 | DType::BF16 => R::round_half(v, to),
        _ => R::plain(v, to),
    }
}

/// Operations whose result is their operand, in every dialect.
fn unary_identity(op: UnaryOp, xd: DType) -> bool {
    match op {
        UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Trunc => !xd.is_float(),
        UnaryOp::Abs | UnaryOp::Sign => xd == DType::Bool,
        _ => false,
    }
}

/// Operators every dialect writes infix, the same way.
fn shared_infix(op: BinaryOp) -> Option<&'static str> {
    Some(match op {
        BinaryOp::Eq => "==",
        BinaryOp::Ne => "!=",
        BinaryOp::Lt => "<",
        BinaryOp::Le => "<=",
        BinaryOp::Gt => ">",
        BinaryOp::Ge => ">=",
        BinaryOp::BitAnd => "&",
        BinaryOp::BitOr => "|",
        BinaryOp::BitXor => "^",
        _ => return None,
    })
}

impl<D: Dialect> OpsHandler for Emitter<'_, '_, D> {
    type V = String;

    fn load(&mut self, buf: BufferId, index: &IndexExpr, dtype: DType) -> String {
        if let Some((name, section)) = self.replace.get(&buf) {
            // a scalar of an earlier group (Pre) or a value computed in this group
            self.v.place(name, *section);
            return name.clone();
        }
        self.d.load(&mut self.v, buf, index, dtype)
    }

    fn constant(&mut self, value: Scalar, dtype: DType) -> String {
        let e = self.d.constant(value, dtype);
        self.v.emit(dtype, e, &[])
    }

    fn index_expr(&mut self, e: &IndexExpr, dtype: DType) -> String {
        let value = self.d.index_value(&self.v, e, dtype);
        self.v.emit_in(self.v.index_section(e), dtype, value, &[])
    }

    fn unary(&mut self, op: UnaryOp, x: &String, xd: DType, dtype: DType) -> String {
        // a bitwise not of booleans is the logical not
        let op = if op == UnaryOp::BitwiseNot && xd == DType::Bool { UnaryOp::LogicalNot } else { op };
        let e = if unary_identity(op, xd) { Ok(x.clone()) } else { self.d.unary(op, x, xd, dtype) };
        match e {
            Ok(e) => self.v.emit(dtype, e, &[x]),
            Err(why) => self.v.unsupported(why),
        }
    }

    fn binary(&mut self, op: BinaryOp, a: &String, b: &String, od: DType, dtype: DType) -> String {
        let e = match shared_infix(op) {
            Some(infix) => format!("{a} {infix} {b}"),
            None if matches!(op, BinaryOp::LogicalAnd | BinaryOp::LogicalOr | BinaryOp::LogicalXor) => {
                let logical = D::LOGICAL
                    [[BinaryOp::LogicalAnd, BinaryOp::LogicalOr, BinaryOp::LogicalXor].iter().position(|l| *l == op).unwrap_or(0)];
                format!("{} {logical} {}", self.d.truth(a), self.d.truth(b))
            }
            None => self.d.binary(op, a, b, od, dtype),
        };
        let e = if dtype == DType::Bool || op.is_comparison() { e } else { self.d.convert(&e, dtype) };
        self.v.emit(dtype, e, &[a, b])
    }

    fn where_(&mut self, c: &String, a: &String, b: &String, dtype: DType) -> String {
        let e = self.d.select(c, a, b);
        self.v.emit(dtype, e, &[c, a, b])
    }

    fn cast(&mut self, x: &String, from: DType, to: DType) -> String {
        match self.d.cast(x, from, to) {
            Some(e) => self.v.emit(to, e, &[x]),
            None => x.clone(),
        }
    }

    fn reduce(&mut self, op: ReduceOp, x: &String, dtype: DType, _id: ValueId) -> String {
        self.d.reduce(&mut self.v, op, x, dtype)
    }

    fn arg_reduce(&mut self, op: ReduceOp, value: &String, index: &String, vd: DType) -> String {
        self.d.arg_reduce(&mut self.v, op, value, index, vd)
    }

    fn scan(&mut self, op: ReduceOp, x: &String, dtype: DType) -> String {
        self.d.scan(&mut self.v, op, x, dtype)
    }

    fn random(&mut self, normal: bool, seed: &String, offset: &String) -> String {
        let e = self.d.random(normal, seed, offset);
        self.v.emit(DType::F32, e, &[seed, offset])
    }

    fn load_indirect(&mut self, buf: BufferId, index: &IndexExpr, terms: &[(String, i64)], dtype: DType) -> String {
        self.d.load_indirect(&mut self.v, buf, index, terms, dtype)
    }

    fn check_index(&mut self, value: &String, size: i64, wrap: bool) -> String {
        self.d.check_index(&mut self.v, value, size, wrap)
    }

    fn store(&mut self, _index: &IndexExpr, _terms: &[(String, i64)], _mode: StoreMode, _value: &String, _dtype: DType) {
        // the walk stores the node's result after its body (`write_group`)
    }
}

/// The name of the C++ standard library's math function computing `op` (`std::log`, ...), the
/// vocabulary dialects' math libraries share; `None` for operations it has no function for.
pub fn math_name(op: UnaryOp) -> Option<&'static str> {
    Some(match op {
        UnaryOp::Abs => "abs",
        UnaryOp::Exp => "exp",
        UnaryOp::Exp2 => "exp2",
        UnaryOp::Expm1 => "expm1",
        UnaryOp::Log => "log",
        UnaryOp::Log2 => "log2",
        UnaryOp::Log10 => "log10",
        UnaryOp::Log1p => "log1p",
        UnaryOp::Sqrt => "sqrt",
        UnaryOp::Sin => "sin",
        UnaryOp::Cos => "cos",
        UnaryOp::Tan => "tan",
        UnaryOp::Asin => "asin",
        UnaryOp::Acos => "acos",
        UnaryOp::Atan => "atan",
        UnaryOp::Sinh => "sinh",
        UnaryOp::Cosh => "cosh",
        UnaryOp::Tanh => "tanh",
        UnaryOp::Asinh => "asinh",
        UnaryOp::Acosh => "acosh",
        UnaryOp::Atanh => "atanh",
        UnaryOp::Erf => "erf",
        UnaryOp::Erfc => "erfc",
        UnaryOp::Lgamma => "lgamma",
        UnaryOp::Floor => "floor",
        UnaryOp::Ceil => "ceil",
        UnaryOp::Round => "nearbyint",
        UnaryOp::Trunc => "trunc",
        UnaryOp::IsNan => "isnan",
        UnaryOp::IsInf => "isinf",
        _ => return None,
    })
}
