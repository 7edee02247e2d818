//! A fused attention's kernel as every backend reads it off its node (`Template::Attention`):
//! the operands' addressing, the further results and the backward's reads, the bias alone over
//! the kernel's (row, batch, head, column) variables, and what the bias proves of the keys each
//! query may see (`key_band`). The Triton and C++ attention kernels start from it.

use super::CodegenError;
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, Schedule};
use crate::symbolic::{Atom, IndexExpr, Var};

/// Whether the kernel is a fused attention.
pub fn is_attention(s: &Schedule, k: &FusedKernel) -> bool {
    attention_of(s, k).is_some()
}

/// The kernel's attention node, when it is one.
fn attention_of<'s>(s: &'s Schedule, k: &FusedKernel) -> Option<(&'s LoopNode, &'s Attention)> {
    let node = &s.program.nodes[k.plan.nodes.first()?.node];
    node.attention().map(|a| (node, a))
}

/// One operand's addressing: `offset + b·batch + (h // group)·heads + row·rows + d·cols`
/// (`group` > 1: grouped-query attention's keys and values, one head for `group` query heads).
pub struct Operand {
    pub buf: BufferId,
    pub offset: i64,
    pub stride: [i64; 4],
    pub group: i64,
}

/// The backward's further operands (`Grads`): each at (b, h, query row).
pub struct GradOperands {
    pub grad_out: Operand,
    pub lse: Operand,
    pub delta: Operand,
}

/// A fused attention's kernel, read off its node.
pub struct AttentionShape {
    /// B, H, the kernel's rows (queries; keys for the keys' gradient), what each row's loop
    /// walks (keys; queries), D (head dim)
    pub dims: [i64; 5],
    pub pass: AttentionPass,
    pub q: Operand,
    pub k: Operand,
    pub v: Operand,
    pub out: Operand,
    pub grads: Option<GradOperands>,
    /// The kernel's further results (`Template::AttentionResult`) and where each is stored.
    pub results: Vec<(AttentionResult, Operand)>,
    pub dtype: DType,
    pub scale: f64,
    /// The bias alone (its value stored at 0), over variables (row, b, h, column), its gathers
    /// at positions read directly and its index arithmetic narrowed.
    pub bias: LoopBody,
    /// What the bias proves of the keys it leaves open (`key_band`, over queries and keys).
    pub band: Vec<Bound>,
    /// Each row's first and last open column, where the bias reads tensors (`KeyRange`):
    /// addressed as `[b, h, row]`.
    pub keys: Option<[Operand; 2]>,
}

impl AttentionShape {
    pub fn of(s: &Schedule, k: &FusedKernel) -> Result<AttentionShape, CodegenError> {
        let p = &s.program;
        let (node, a) = attention_of(s, k).ok_or_else(|| CodegenError::internal(&k.name, "not an attention"))?;
        let bad = |m: &str| CodegenError::internal(&k.name, format!("attention {}: {m}", p.buffer(node.output).name));
        let (&[b, h, rows, d], &[cols]) = (&node.ranges[..], &node.reduction_ranges[..]) else { return Err(bad("not [B, H, M, D] by N")) };
        let keys_major = matches!(a.pass, AttentionPass::GradKeyValue(_));
        // the variables of the query and the key rows
        let (qrow, krow) = if keys_major { (4, 2) } else { (2, 4) };
        let operand = |value: ValueId, row: u32| -> Result<Operand, CodegenError> {
            let Expr::Load { buf, index } = &node.body.exprs[value.0 as usize] else { return Err(bad("an operand is not a load")) };
            let mut group = (1, 0);
            for (a, c) in &index.terms {
                match a {
                    Atom::Var(_) => {}
                    Atom::FloorDiv(e, g) if **e == IndexExpr::var(Var(1)) && group.0 == 1 => group = (*g, *c),
                    _ => return Err(bad("an operand is not strided")),
                }
            }
            if group.0 > 1 && index.terms.iter().any(|(a, _)| *a == Atom::Var(Var(1))) {
                return Err(bad("an operand reads the head twice"));
            }
            let c = |v: u32| index.affine_coeff(Var(v)).unwrap_or(0);
            let heads = if group.0 > 1 { group.1 } else { c(1) };
            Ok(Operand { buf: *buf, offset: index.constant, stride: [c(0), heads, c(row), c(3)], group: group.0 })
        };
        let stored = |node: &LoopNode| -> Result<Operand, CodegenError> {
            let store = node.body.store.as_ref().ok_or_else(|| bad("no store"))?;
            let stride = [0, 1, 2, 3].map(|v| store.index.affine_coeff(Var(v)).unwrap_or(0));
            Ok(Operand { buf: node.output, offset: store.index.constant, stride, group: 1 })
        };
        let out = stored(node)?;
        let mut results = Vec::new();
        for kn in &k.plan.nodes[1..] {
            let other = &p.nodes[kn.node];
            let Some((_, result)) = other.attention_result() else { return Err(bad("a node that is no attention result joined it")) };
            results.push((result, stored(other)?));
        }
        let grads = match a.pass {
            AttentionPass::Forward => None,
            AttentionPass::GradQuery(g) | AttentionPass::GradKeyValue(g) => {
                Some(GradOperands { grad_out: operand(g.grad_out, qrow)?, lse: operand(g.lse, qrow)?, delta: operand(g.delta, qrow)? })
            }
        };
        let mut bias = node.body.clone();
        let keep = a.bias.0 as usize + 1;
        bias.exprs.truncate(keep);
        bias.dtypes.truncate(keep);
        bias.set_store(IndexExpr::zero(), a.bias);
        // node variables (b, h, row, d, col) as (1, 2, 0, -, 3): the kernel's rows and columns
        let var = |i: u32| Some(IndexExpr::var(Var(i)));
        let ranges = [rows, b, h, cols];
        let text = bias.rewrite_indices(&|e: &IndexExpr| e.substitute(&[var(1), var(2), var(0), None, var(3)], &ranges));
        let text = text.with_direct_reads(&ranges).unwrap_or(text).with_narrow_index_arithmetic(&ranges);
        // and as (query, b, h, key), which the band is proven over
        let band = if keys_major {
            let forward = [cols, b, h, rows];
            let body = bias.rewrite_indices(&|e: &IndexExpr| e.substitute(&[var(1), var(2), var(3), None, var(0)], &forward));
            key_band(&body.with_direct_reads(&forward).unwrap_or(body).with_narrow_index_arithmetic(&forward))
        } else {
            key_band(&text)
        };
        let keys = a.keys.map(|k| Ok::<_, CodegenError>([operand(k.first, 2)?, operand(k.last, 2)?])).transpose()?;
        Ok(AttentionShape {
            dims: [b, h, rows, cols, d],
            pass: a.pass,
            q: operand(a.q, qrow)?,
            k: operand(a.k, krow)?,
            v: operand(a.v, krow)?,
            out,
            grads,
            results,
            dtype: p.buffer(node.output).layout.dtype,
            scale: a.scale,
            bias: text,
            band,
            keys,
        })
    }

    /// Where the further result `what` is stored, when the kernel writes it.
    pub fn result(&self, what: AttentionResult) -> Option<&Operand> {
        self.results.iter().find(|(r, _)| *r == what).map(|(_, o)| o)
    }
}

/// A bound the bias proves on the keys it leaves open for query `m`: `key >= slope·m + offset`
/// (`lower`), or `key <= slope·m + offset`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound {
    pub lower: bool,
    pub slope: i64,
    pub offset: i64,
}

/// `c + a·m + b·n >= 0` over the query `m` (variable 0) and the key `n` (variable 3).
type Constraint = (i64, i64, i64);

/// An integer value of the bias as `c + a·m + b·n`.
type Affine = (i64, i64, i64);

/// What a float value of the bias is known to need for not being -inf.
enum Open {
    Never,
    /// Every one of these holds where the value is not -inf (none known: it may be anything).
    When(Vec<Constraint>),
}

/// What the walk over the bias knows of each value so far.
#[derive(Default)]
struct Facts {
    affine: Vec<Option<Affine>>,
    /// Necessary conditions for a truth value to be true, and to be false.
    truth: Vec<(Vec<Constraint>, Vec<Constraint>)>,
    open: Vec<Open>,
}

impl Facts {
    fn affine(&self, v: &ValueId) -> Option<Affine> {
        self.affine[v.0 as usize]
    }
    fn truth(&self, v: &ValueId) -> (Vec<Constraint>, Vec<Constraint>) {
        self.truth[v.0 as usize].clone()
    }
    fn open(&self, v: &ValueId) -> Option<Vec<Constraint>> {
        match &self.open[v.0 as usize] {
            Open::Never => None,
            Open::When(c) => Some(c.clone()),
        }
    }
}

/// The bounds on the open keys that the bias proves: it is `where(cond, x, -inf)` (through
/// sums, casts and positive scales), with `cond` a conjunction of comparisons of affine
/// functions of the query and key positions. (A +inf meeting a -inf would give NaN where a tile
/// is skipped; biases do not hold +inf.)
pub fn key_band(body: &LoopBody) -> Vec<Bound> {
    let Some(store) = &body.store else { return Vec::new() };
    let mut facts = Facts::default();
    for (i, e) in body.exprs.iter().enumerate() {
        let dt = body.dtypes[i];
        // (narrower integers wrap)
        let a = if matches!(dt, DType::I32 | DType::I64) { affine_of(e, &facts) } else { None };
        let t = if dt == DType::Bool { truth_of(body, e, &facts) } else { Default::default() };
        let o = if dt.is_float() { open_of(body, e, &facts) } else { Open::When(Vec::new()) };
        facts.affine.push(a.filter(|(c, x, y)| c.abs() < 1 << 40 && x.abs() < 1 << 20 && y.abs() < 1 << 20));
        facts.truth.push(t);
        facts.open.push(o);
    }
    let Some(constraints) = facts.open(&store.value) else { return Vec::new() };
    // c + a·m ± n >= 0: n >= -a·m - c, or n <= a·m + c
    let mut out: Vec<Bound> = Vec::new();
    for (c, a, b) in constraints {
        let bound = match b {
            1 => Bound { lower: true, slope: -a, offset: -c },
            -1 => Bound { lower: false, slope: a, offset: c },
            _ => continue,
        };
        if !out.contains(&bound) {
            out.push(bound);
        }
    }
    out
}

/// An integer value as an affine function of the query and key positions.
fn affine_of(e: &Expr, f: &Facts) -> Option<Affine> {
    let add = |p: Affine, q: Affine, s: i64| (p.0 + s * q.0, p.1 + s * q.1, p.2 + s * q.2);
    match e {
        Expr::Index(ix) => {
            let mut vs = Vec::new();
            ix.vars(&mut vs);
            let only = vs.iter().all(|v| v.0 == 0 || v.0 == 3) && ix.terms.iter().all(|(a, _)| matches!(a, Atom::Var(_)));
            only.then(|| (ix.constant, ix.affine_coeff(Var(0)).unwrap_or(0), ix.affine_coeff(Var(3)).unwrap_or(0)))
        }
        Expr::Constant(Scalar::Int(c)) => Some((*c, 0, 0)),
        Expr::Cast(x) => f.affine(x),
        Expr::Binary(BinaryOp::Add, x, y) => f.affine(x).zip(f.affine(y)).map(|(p, q)| add(p, q, 1)),
        Expr::Binary(BinaryOp::Sub, x, y) => f.affine(x).zip(f.affine(y)).map(|(p, q)| add(p, q, -1)),
        Expr::Binary(BinaryOp::Mul, x, y) => match (f.affine(x), f.affine(y)) {
            (Some(p), Some((c, 0, 0))) | (Some((c, 0, 0)), Some(p)) => Some((p.0 * c, p.1 * c, p.2 * c)),
            _ => None,
        },
        _ => None,
    }
}

/// A truth value's necessary conditions for being true, and for being false.
fn truth_of(body: &LoopBody, e: &Expr, f: &Facts) -> (Vec<Constraint>, Vec<Constraint>) {
    let is_false = |v: &ValueId| matches!(body.exprs[v.0 as usize], Expr::Constant(Scalar::Int(0) | Scalar::Bool(false)));
    match e {
        Expr::Binary(op @ (BinaryOp::Ge | BinaryOp::Gt | BinaryOp::Le | BinaryOp::Lt), x, y) => match (f.affine(x), f.affine(y)) {
            (Some(p), Some(q)) => {
                // x - y >= 0 (>= and >), or y - x >= 0 (<= and <), less 1 when strict
                let (p, q) = if matches!(op, BinaryOp::Ge | BinaryOp::Gt) { (p, q) } else { (q, p) };
                let d = (p.0 - q.0, p.1 - q.1, p.2 - q.2);
                let strict = matches!(op, BinaryOp::Gt | BinaryOp::Lt) as i64;
                (vec![(d.0 - strict, d.1, d.2)], vec![(strict - d.0 - 1, -d.1, -d.2)])
            }
            _ => Default::default(),
        },
        Expr::Binary(BinaryOp::LogicalAnd | BinaryOp::BitAnd, x, y) => ([f.truth(x).0, f.truth(y).0].concat(), Vec::new()),
        Expr::Binary(BinaryOp::LogicalOr | BinaryOp::BitOr, x, y) => (Vec::new(), [f.truth(x).1, f.truth(y).1].concat()),
        Expr::Binary(BinaryOp::Eq, x, y) if is_false(y) => (f.truth(x).1, f.truth(x).0),
        Expr::Unary(UnaryOp::LogicalNot | UnaryOp::BitwiseNot, x) => (f.truth(x).1, f.truth(x).0),
        Expr::Cast(x) if body.dtypes[x.0 as usize] == DType::Bool => f.truth(x),
        _ => Default::default(),
    }
}

/// What a float value needs for not being -inf.
fn open_of(body: &LoopBody, e: &Expr, f: &Facts) -> Open {
    let positive = |v: &ValueId| matches!(body.exprs[v.0 as usize], Expr::Constant(Scalar::Float(c)) if c > 0.0 && c.is_finite());
    let when = |o: Option<Vec<Constraint>>| o.map_or(Open::Never, Open::When);
    match e {
        Expr::Constant(Scalar::Float(c)) if *c == f64::NEG_INFINITY => Open::Never,
        Expr::Where(c, x, y) => match (f.open(x), f.open(y)) {
            (None, None) => Open::Never,
            (Some(o), None) => Open::When([f.truth(c).0, o].concat()),
            (None, Some(o)) => Open::When([f.truth(c).1, o].concat()),
            _ => Open::When(Vec::new()),
        },
        Expr::Binary(BinaryOp::Add | BinaryOp::Sub, x, y) => when(f.open(x).zip(f.open(y)).map(|(p, q)| [p, q].concat())),
        Expr::Binary(BinaryOp::Mul, x, y) if positive(y) => when(f.open(x)),
        Expr::Binary(BinaryOp::Mul, x, y) if positive(x) => when(f.open(y)),
        Expr::Cast(x) if body.dtypes[x.0 as usize].is_float() => when(f.open(x)),
        _ => Open::When(Vec::new()),
    }
}
