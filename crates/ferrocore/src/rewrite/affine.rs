//! Small integer and boolean tensors that a graph builds from `arange` (positions, causal and
//! packed-sequence masks) read as functions of the element's index, so a pass can tell what a
//! mask is without running it. An integer tensor is `constant + Σ coef[d] * i[d]` over its
//! dims; a boolean one is a constant or `affine <= 0`. Anything else (a graph input, a float, an
//! index arithmetic that leaves the forms) is unknown: `None`.

use super::*;

/// `constant + Σ coef[d] * i[d]`, one coefficient per dim of the tensor (0 for dims of size 1).
#[derive(Clone, Debug, PartialEq)]
pub struct Affine {
    pub constant: i64,
    pub coef: Vec<i64>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Form {
    Int(Affine),
    /// A boolean tensor, true where the affine value is at most 0.
    NonPositive(Affine),
    /// A boolean tensor, the same everywhere.
    Bool(bool),
}

impl Affine {
    fn constant(value: i64, rank: usize) -> Affine {
        Affine { constant: value, coef: vec![0; rank] }
    }

    fn is_constant(&self) -> bool {
        self.coef.iter().all(|&c| c == 0)
    }

    fn combine(&self, other: &Affine, sign: i64) -> Option<Affine> {
        let coef = self.coef.iter().zip(&other.coef).map(|(a, b)| a.checked_add(b.checked_mul(sign)?)).collect::<Option<_>>()?;
        Some(Affine { constant: self.constant.checked_add(other.constant.checked_mul(sign)?)?, coef })
    }

    fn scaled(&self, k: i64) -> Option<Affine> {
        let coef = self.coef.iter().map(|c| c.checked_mul(k)).collect::<Option<_>>()?;
        Some(Affine { constant: self.constant.checked_mul(k)?, coef })
    }

    fn shifted(&self, k: i64) -> Option<Affine> {
        Some(Affine { constant: self.constant.checked_add(k)?, coef: self.coef.clone() })
    }

    /// The least and greatest value over a tensor of `shape`.
    fn range(&self, shape: &[i64]) -> Option<(i64, i64)> {
        let (mut lo, mut hi) = (self.constant, self.constant);
        for (&c, &n) in self.coef.iter().zip(shape) {
            let far = c.checked_mul(n.checked_sub(1)?)?;
            if far < 0 {
                lo = lo.checked_add(far)?;
            } else {
                hi = hi.checked_add(far)?;
            }
        }
        Some((lo, hi))
    }
}

impl Form {
    /// The same form with its affine value changed (a boolean constant has none).
    fn map(self, f: impl FnOnce(Affine) -> Option<Affine>) -> Option<Form> {
        Some(match self {
            Form::Int(a) => Form::Int(f(a)?),
            Form::NonPositive(a) => Form::NonPositive(f(a)?),
            b @ Form::Bool(_) => b,
        })
    }

    /// The boolean negation: `not(a <= 0)` is `1 - a <= 0` for integers.
    pub fn negated(self) -> Option<Form> {
        match self {
            Form::Bool(b) => Some(Form::Bool(!b)),
            Form::NonPositive(a) => Some(Form::NonPositive(a.scaled(-1)?.shifted(1)?)),
            Form::Int(_) => None,
        }
    }

    fn int(&self) -> Option<&Affine> {
        match self {
            Form::Int(a) => Some(a),
            _ => None,
        }
    }
}

/// The coefficients of a value shaped `from` seen broadcast to `to` (right-aligned).
fn broadcast_to(a: Affine, from: &[i64], to: &[i64]) -> Option<Affine> {
    let lead = to.len().checked_sub(from.len())?;
    let mut coef = vec![0; to.len()];
    for (d, &n) in from.iter().enumerate() {
        match (n, to[lead + d]) {
            (n, m) if n == m => coef[lead + d] = a.coef[d],
            (1, _) => {}
            _ => return None,
        }
    }
    Some(Affine { constant: a.constant, coef })
}

/// Dims of size 1 read index 0 alone: their coefficients are 0, so equal values compare equal.
fn normal(form: Form, shape: &[i64]) -> Form {
    let clear = |mut a: Affine| {
        for (c, &n) in a.coef.iter_mut().zip(shape) {
            if n == 1 {
                *c = 0;
            }
        }
        a
    };
    match form {
        Form::Int(a) => Form::Int(clear(a)),
        Form::NonPositive(a) => {
            let a = clear(a);
            match a.range(shape) {
                Some((_, hi)) if hi <= 0 => Form::Bool(true),
                Some((lo, _)) if lo > 0 => Form::Bool(false),
                _ => Form::NonPositive(a),
            }
        }
        b => b,
    }
}

/// The forms of a graph's nodes, computed on demand and remembered.
pub struct Forms<'g> {
    g: &'g Graph,
    memo: HashMap<NodeId, Option<Form>>,
}

fn shape_of(g: &Graph, id: NodeId) -> Option<&[i64]> {
    g.node(id).meta.tensor().map(|t| t.shape.as_slice())
}

fn int_arg(a: Option<&Arg>) -> Option<i64> {
    match a {
        Some(Arg::Int(v)) => Some(*v),
        Some(Arg::Bool(b)) => Some(*b as i64),
        _ => None,
    }
}

fn dim_arg(a: Option<&Arg>, rank: usize) -> Option<usize> {
    let d = int_arg(a)?;
    let d = if d < 0 { d + rank as i64 } else { d };
    (0..rank as i64).contains(&d).then_some(d as usize)
}

impl<'g> Forms<'g> {
    pub fn new(g: &'g Graph) -> Forms<'g> {
        Forms { g, memo: HashMap::new() }
    }

    /// The node's form, or None when it is not one.
    pub fn of(&mut self, id: NodeId) -> Option<Form> {
        if let Some(f) = self.memo.get(&id) {
            return f.clone();
        }
        // (a chain deeper than this is not a mask the graph built for attention)
        if self.memo.len() > 4096 {
            return None;
        }
        self.memo.insert(id, None);
        let shape = shape_of(self.g, id)?.to_vec();
        let form = self.compute(id, &shape).map(|f| normal(f, &shape));
        self.memo.insert(id, form.clone());
        form
    }

    /// An operand's form broadcast to `shape`: a node, or an integer or boolean scalar.
    fn operand(&mut self, a: Option<&Arg>, shape: &[i64]) -> Option<Form> {
        match a? {
            Arg::Node(n) => {
                let from = shape_of(self.g, *n)?.to_vec();
                let f = self.of(*n)?;
                f.map(|a| broadcast_to(a, &from, shape))
            }
            Arg::Int(v) => Some(Form::Int(Affine::constant(*v, shape.len()))),
            Arg::Bool(b) => Some(Form::Bool(*b)),
            _ => None,
        }
    }

    fn input(&mut self, args: &[Arg]) -> Option<(Form, Vec<i64>)> {
        let Some(Arg::Node(n)) = args.first() else { return None };
        Some((self.of(*n)?, shape_of(self.g, *n)?.to_vec()))
    }

    fn compute(&mut self, id: NodeId, shape: &[i64]) -> Option<Form> {
        let node = self.g.node(id);
        let NodeKind::Call { target: Target::Aten(op), args, .. } = &node.kind else { return None };
        let dtype = node.meta.tensor()?.dtype;
        if !matches!(dtype, DType::I64 | DType::I32 | DType::Bool) {
            return None;
        }
        let rank = shape.len();
        use AtenOp::*;
        match op {
            Arange | ArangeStart | ArangeStartStep => {
                let (start, step) = match op {
                    Arange => (0, 1),
                    ArangeStart => (int_arg(args.first())?, 1),
                    _ => (int_arg(args.first())?, int_arg(args.get(2)).unwrap_or(1)),
                };
                Some(Form::Int(Affine { constant: start, coef: vec![step] }))
            }
            Full | ScalarTensor => {
                let value = if *op == Full { args.get(1) } else { args.first() };
                match value? {
                    Arg::Bool(b) if dtype == DType::Bool => Some(Form::Bool(*b)),
                    Arg::Int(v) if dtype != DType::Bool => Some(Form::Int(Affine::constant(*v, rank))),
                    _ => None,
                }
            }
            Clone | Alias => self.input(args).map(|(f, _)| f),
            ToCopy => match self.input(args)? {
                (Form::Int(a), _) if dtype != DType::Bool => Some(Form::Int(a)),
                (Form::Bool(b), _) if dtype == DType::Bool => Some(Form::Bool(b)),
                (Form::Bool(b), _) => Some(Form::Int(Affine::constant(b as i64, rank))),
                _ => None,
            },
            AddTensor | AddScalar | SubTensor | SubScalar => {
                if node.kwarg("alpha").is_some_and(|a| !matches!(a, Arg::Int(1))) {
                    return None;
                }
                let a = self.operand(args.first(), shape)?;
                let b = self.operand(args.get(1), shape)?;
                let sign = if matches!(op, AddTensor | AddScalar) { 1 } else { -1 };
                Some(Form::Int(a.int()?.combine(b.int()?, sign)?))
            }
            MulTensor | MulScalar => {
                let (a, b) = (self.operand(args.first(), shape)?, self.operand(args.get(1), shape)?);
                let (a, b) = (a.int()?, b.int()?);
                match (a.is_constant(), b.is_constant()) {
                    (_, true) => Some(Form::Int(a.scaled(b.constant)?)),
                    (true, _) => Some(Form::Int(b.scaled(a.constant)?)),
                    _ => None,
                }
            }
            Neg => Some(Form::Int(self.input(args)?.0.int()?.scaled(-1)?)),
            LeTensor | LeScalar | LtTensor | LtScalar | GeTensor | GeScalar | GtTensor | GtScalar | EqTensor | EqScalar | NeTensor
            | NeScalar => {
                let a = self.operand(args.first(), shape)?;
                let b = self.operand(args.get(1), shape)?;
                let diff = a.int()?.combine(b.int()?, -1)?;
                Some(match op {
                    LeTensor | LeScalar => Form::NonPositive(diff),
                    LtTensor | LtScalar => Form::NonPositive(diff.shifted(1)?),
                    GeTensor | GeScalar => Form::NonPositive(diff.scaled(-1)?),
                    GtTensor | GtScalar => Form::NonPositive(diff.scaled(-1)?.shifted(1)?),
                    _ if diff.is_constant() => Form::Bool((diff.constant == 0) == matches!(op, EqTensor | EqScalar)),
                    _ => return None,
                })
            }
            LogicalAnd | BitwiseAndTensor | LogicalOr | BitwiseOrTensor => {
                let a = self.operand(args.first(), shape)?;
                let b = self.operand(args.get(1), shape)?;
                let and = matches!(op, LogicalAnd | BitwiseAndTensor);
                match (a, b) {
                    (Form::Bool(x), other) | (other, Form::Bool(x)) if !matches!(other, Form::Int(_)) => {
                        // true is and's identity and or's absorbing value
                        Some(if x == and { other } else { Form::Bool(x) })
                    }
                    (x, y) if x == y && !matches!(x, Form::Int(_)) => Some(x),
                    _ => None,
                }
            }
            LogicalNot | BitwiseNot if dtype == DType::Bool => self.input(args)?.0.negated(),
            Cumsum => {
                let (f, _) = self.input(args)?;
                let d = dim_arg(args.get(1), rank)?;
                let c = match f {
                    Form::Int(a) if a.is_constant() => a.constant,
                    Form::Bool(b) => b as i64,
                    _ => return None,
                };
                // c + c + ... over i[d] + 1 elements
                let mut a = Affine::constant(c, rank);
                a.coef[d] = c;
                Some(Form::Int(a))
            }
            _ => self.view(*op, args, shape),
        }
    }

    /// Views, broadcasts, slices, concatenations and gathers of forms.
    fn view(&mut self, op: AtenOp, args: &[Arg], shape: &[i64]) -> Option<Form> {
        use AtenOp::*;
        match op {
            Cat => return self.cat(args, shape),
            IndexTensor => return self.index(args, shape),
            _ => {}
        }
        let (f, from) = self.input(args)?;
        let rank = shape.len();
        match op {
            Expand => f.map(|a| broadcast_to(a, &from, shape)),
            Unsqueeze => {
                let d = dim_arg(args.get(1), rank)?;
                f.map(|mut a| {
                    a.coef.insert(d, 0);
                    Some(a)
                })
            }
            Squeeze | SqueezeDim | SqueezeDims | View | UnsafeView | Reshape => {
                // only views that add or drop dims of size 1
                let kept = |s: &[i64]| s.iter().copied().enumerate().filter(|&(_, n)| n != 1).collect::<Vec<_>>();
                let (src, dst) = (kept(&from), kept(shape));
                if src.len() != dst.len() || src.iter().zip(&dst).any(|(a, b)| a.1 != b.1) {
                    return None;
                }
                f.map(|a| {
                    let mut coef = vec![0; rank];
                    for (s, d) in src.iter().zip(&dst) {
                        coef[d.0] = a.coef[s.0];
                    }
                    Some(Affine { constant: a.constant, coef })
                })
            }
            Permute => {
                let Some(Arg::List(dims)) = args.get(1) else { return None };
                let dims: Vec<usize> = dims.iter().map(|d| dim_arg(Some(d), rank)).collect::<Option<_>>()?;
                f.map(|a| Some(Affine { constant: a.constant, coef: dims.iter().map(|&d| a.coef[d]).collect() }))
            }
            SliceTensor => {
                let d = dim_arg(Some(args.get(1).unwrap_or(&Arg::Int(0))), rank)?;
                let size = from[d];
                let start = match args.get(2) {
                    None | Some(Arg::None) => 0,
                    a => int_arg(a)?,
                };
                let start = if start < 0 { (start + size).max(0) } else { start.min(size) };
                let step = int_arg(args.get(4)).unwrap_or(1);
                f.map(|mut a| {
                    a.constant = a.constant.checked_add(a.coef[d].checked_mul(start)?)?;
                    a.coef[d] = a.coef[d].checked_mul(step)?;
                    Some(a)
                })
            }
            _ => None,
        }
    }

    /// A concatenation whose pieces continue one another's affine values along the dim.
    fn cat(&mut self, args: &[Arg], shape: &[i64]) -> Option<Form> {
        let Some(Arg::List(pieces)) = args.first() else { return None };
        let rank = shape.len();
        let d = dim_arg(Some(args.get(1).unwrap_or(&Arg::Int(0))), rank)?;
        let mut parts = Vec::new();
        let mut offset = 0i64;
        for p in pieces {
            let Arg::Node(n) = p else { return None };
            let s = shape_of(self.g, *n)?.to_vec();
            let a = self.of(*n)?.int()?.clone();
            parts.push((offset, s[d], a));
            offset += s[d];
        }
        // the coefficient along the dim: a piece's own, or the step between two pieces' starts
        let step = match parts.iter().find(|p| p.1 > 1) {
            Some(p) => p.2.coef[d],
            None if parts.len() >= 2 => {
                let (a, b) = (&parts[0], &parts[1]);
                b.2.constant.checked_sub(a.2.constant)? / (b.0 - a.0).max(1)
            }
            None => 0,
        };
        let mut joined: Option<Affine> = None;
        for (start, len, mut a) in parts {
            if len > 1 && a.coef[d] != step {
                return None;
            }
            // the piece's value at whole-tensor index i is a(i - start)
            a.coef[d] = step;
            a.constant = a.constant.checked_sub(step.checked_mul(start)?)?;
            for (c, &n) in a.coef.iter_mut().zip(shape) {
                if n == 1 {
                    *c = 0;
                }
            }
            match &joined {
                None => joined = Some(a),
                Some(j) if *j == a => {}
                _ => return None,
            }
        }
        joined.map(Form::Int)
    }

    /// `x[i0, i1, ..]` with every index a form: the indices broadcast to the result's leading
    /// dims, `x`'s remaining dims follow.
    fn index(&mut self, args: &[Arg], shape: &[i64]) -> Option<Form> {
        let (Some(Arg::Node(x)), Some(Arg::List(indices))) = (args.first(), args.get(1)) else { return None };
        let xa = self.of(*x)?.int()?.clone();
        let x_rank = xa.coef.len();
        let k = indices.len();
        let lead = shape.len().checked_sub(x_rank.checked_sub(k)?)?;
        let lead_shape = &shape[..lead];
        let mut value = Affine::constant(xa.constant, shape.len());
        for (j, idx) in indices.iter().enumerate() {
            let Arg::Node(n) = idx else { return None };
            let from = shape_of(self.g, *n)?.to_vec();
            let ia = broadcast_to(self.of(*n)?.int()?.clone(), &from, lead_shape)?;
            let mut term = ia.scaled(xa.coef[j])?;
            term.coef.resize(shape.len(), 0);
            value = value.combine(&term, 1)?;
        }
        for j in k..x_rank {
            value.coef[lead + j - k] = value.coef[lead + j - k].checked_add(xa.coef[j])?;
        }
        Some(Form::Int(value))
    }
}

/// Where a boolean mask over scores `[.., M, N]` (broadcast right-aligned) keeps exactly the
/// keys `j <= i + offset` of query `i` and nothing else depends on the other dims: the offset.
pub fn causal_offset(form: &Form) -> Option<i64> {
    let Form::NonPositive(a) = form else { return None };
    let r = a.coef.len();
    if r < 2 || a.coef[..r - 2].iter().any(|&c| c != 0) {
        return None;
    }
    // a*j - a*i + c <= 0  <=>  j <= i - c/a (rounded down)
    let (kj, ki) = (a.coef[r - 1], a.coef[r - 2]);
    if kj <= 0 || ki != -kj {
        return None;
    }
    Some((-a.constant).div_euclid(kj))
}

#[cfg(test)]
mod tests;
