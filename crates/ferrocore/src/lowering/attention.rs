//! Fused attention with a computed bias (`_scaled_dot_product_fused_attention_overrideable`,
//! which the `attention` graph pass writes for ferrocore's attention kernels) as `Template::Attention` nodes:
//! the bias stays a lazy value, so its computation (a mask built from positions, a document id
//! gathered per key, an ALiBi slope times a distance) is inlined into the kernels' loops and
//! never stored. A differentiated call also writes each row's log-sum-exp (beside its output,
//! in the same kernel), and its backward is two kernels that recompute the probabilities from
//! it: the queries' gradient, and the keys' and values' together.

use super::pointwise::{broadcast_index, broadcast_shapes};
use super::*;
use crate::symbolic::Atom;

/// What the attention kernels read: the operands (`[B, H, rows, D]`), the bias (broadcast to
/// `[B, H, M, N]`), `dims` = B, H, M, N, D.
struct Inputs {
    q: Operand,
    k: Operand,
    v: Operand,
    bias: TensorValue,
    dims: [i64; 5],
    dtype: DType,
    scale: f64,
}

/// Which attention kernel a node is (`AttentionPass`, before its reads are known).
#[derive(Clone, Copy, PartialEq)]
enum Kernel {
    Forward,
    GradQuery,
    GradKeyValue,
}

/// The backward's further reads: the output's gradient, the forward's log-sum-exp and `delta`
/// (`Σ_d grad_out · out`, computed first).
struct GradInputs {
    grad_out: Operand,
    lse: Operand,
    delta: BufferId,
}

impl Ctx<'_> {
    /// Whether the backend writes attention kernels of `dtype`: Triton of every float type, C++
    /// of float32 (`codegen::cpp::attention`).
    fn attention_template_of(&self, dtype: DType) -> bool {
        self.triton_kernels() || dtype == DType::F32
    }

    /// The call as an attention node (and its log-sum-exp where the graph reads it), or None
    /// where no template takes it (the library call runs).
    pub(super) fn lower_attention_template(&mut self) -> LResult<Option<Lowered>> {
        if self.float_arg(4, "dropout_p")?.unwrap_or(0.0) != 0.0 {
            return Ok(None);
        }
        if matches!(self.arg(5, "is_causal"), Some(Arg::Bool(true))) {
            return Ok(None); // (the attention pass writes every mask into the bias)
        }
        let Some(Arg::Node(bias_node)) = self.arg(3, "attn_bias").cloned() else { return Ok(None) };
        let Meta::Tuple(items) = self.meta() else { return malformed("fused attention returns a tuple") };
        let Some(Some(Meta::Tensor(out))) = items.first() else { return malformed("fused attention has no output") };
        let lse = match items.get(1) {
            Some(Some(Meta::Tensor(t))) => Some(t.clone()),
            _ => None,
        };
        if !self.attention_template_of(out.dtype) {
            return Ok(None);
        }
        let n_items = items.len();
        let out = out.clone();
        let scale = self.float_arg(7, "scale")?;
        let operands = [self.arg(0, "query").cloned(), self.arg(1, "key").cloned(), self.arg(2, "value").cloned()];
        let x = self.attention_inputs(operands, bias_node, &out, scale)?;
        let [b, h, m, _, d] = x.dims;
        let keys = self.key_range(&x.bias, [b, h, m, x.dims[3]], false)?;
        let layout = Layout { size: out.shape.clone(), stride: out.stride.clone(), offset: 0, dtype: out.dtype, device: out.device };
        let buf = self.push_attention(&x, keys.as_ref(), None, &layout, Kernel::Forward);
        let mut tuple = vec![Some(Lowered::Tensor(view_of_layout(buf, &layout)))];
        if let Some(lse) = lse {
            if lse.shape != [b, h, m] || lse.dtype != DType::F32 {
                return malformed(format!("a log-sum-exp shaped {:?} ({}) for [{b}, {h}, {m}]", lse.shape, lse.dtype));
            }
            let l = Layout { size: lse.shape.clone(), stride: lse.stride.clone(), offset: 0, dtype: DType::F32, device: lse.device };
            let lse_buf = self.push_result(buf, AttentionResult::LogSumExp, &l);
            tuple.push(Some(Lowered::Tensor(view_of_layout(lse_buf, &l))));
        }
        self.decisions.push((
            "attention",
            format!(
                "template: {} [{b}, {h}, {m}, {d}] over {} keys is an attention kernel, its bias computed inside{}",
                self.node_name(),
                x.dims[3],
                if tuple.len() > 1 { ", its log-sum-exp written beside" } else { "" }
            ),
        ));
        tuple.resize(n_items, None);
        Ok(Some(Lowered::Tuple(tuple)))
    }

    /// The backward of a call lowered as an attention node: `delta` (a reduction over the head
    /// dim), then the queries' gradient, then the keys' and the values' in one kernel. None
    /// where no template takes it.
    pub(super) fn lower_attention_backward(&mut self) -> LResult<Option<Lowered>> {
        if self.float_arg(12, "dropout_p")?.unwrap_or(0.0) != 0.0 {
            return Ok(None);
        }
        if matches!(self.arg(13, "is_causal"), Some(Arg::Bool(true))) {
            return Ok(None);
        }
        let Some(Arg::Node(bias_node)) = self.arg(4, "attn_bias").cloned() else { return Ok(None) };
        if matches!(self.arg(5, "grad_input_mask"), Some(Arg::List(l)) if matches!(l.get(3), Some(Arg::Bool(true)))) {
            return Ok(None); // (the bias's gradient: none of the kernels computes it)
        }
        let Meta::Tuple(items) = self.meta() else { return malformed("fused attention's backward returns a tuple") };
        let grads: Vec<TensorMeta> = items.iter().take(3).filter_map(|i| i.as_ref().and_then(Meta::tensor).cloned()).collect();
        let [gq, gk, gv] = &grads[..] else { return malformed("fused attention's backward has no gradients") };
        if !self.attention_template_of(gq.dtype) {
            return Ok(None);
        }
        let (gq, gk, gv) = (gq.clone(), gk.clone(), gv.clone());
        let n_items = items.len();
        let scale = self.float_arg(16, "scale")?;
        let operands = [self.arg(1, "query").cloned(), self.arg(2, "key").cloned(), self.arg(3, "value").cloned()];
        let x = self.attention_inputs(operands, bias_node, &gq, scale)?;
        let [b, h, m, n, d] = x.dims;
        let node_of = |a: Option<&Arg>, what: &str| match a {
            Some(Arg::Node(id)) => Ok(*id),
            _ => malformed(format!("{what} is not a tensor")),
        };
        let grad_out = node_of(self.arg(0, "grad_out"), "grad_out")?;
        let out = node_of(self.arg(6, "out"), "out")?;
        let lse = node_of(self.arg(7, "logsumexp"), "logsumexp")?;
        let delta = self.attention_delta(grad_out, out, [b, h, m, d])?;
        let g = GradInputs { grad_out: self.operand(grad_out, &[b, h, m, d])?, lse: self.operand(lse, &[b, h, m])?, delta };
        let layout_of =
            |t: &TensorMeta| Layout { size: t.shape.clone(), stride: t.stride.clone(), offset: 0, dtype: t.dtype, device: t.device };
        let (lq, lk, lv) = (layout_of(&gq), layout_of(&gk), layout_of(&gv));
        let keys = self.key_range(&x.bias, [b, h, m, n], false)?;
        let dq = self.push_attention(&x, keys.as_ref(), Some(&g), &lq, Kernel::GradQuery);
        let queries = self.key_range(&x.bias, [b, h, m, n], true)?;
        let dk = self.push_attention(&x, queries.as_ref(), Some(&g), &lk, Kernel::GradKeyValue);
        let dv = self.push_result(dk, AttentionResult::GradValue, &lv);
        self.decisions.push((
            "attention",
            format!(
                "template: {} is the attention kernels' backward: the queries' gradient over [{b}, {h}, {m}, {d}], then the keys' and values' over [{b}, {h}, {n}, {d}]",
                self.node_name()
            ),
        ));
        let mut tuple = vec![
            Some(Lowered::Tensor(view_of_layout(dq, &lq))),
            Some(Lowered::Tensor(view_of_layout(dk, &lk))),
            Some(Lowered::Tensor(view_of_layout(dv, &lv))),
        ];
        tuple.resize(n_items, None);
        Ok(Some(Lowered::Tuple(tuple)))
    }

    /// The operands (query, key, value arguments) and the bias, checked against the output
    /// `out` (`[B, H, M, D]`).
    fn attention_inputs(&mut self, operands: [Option<Arg>; 3], bias_node: NodeId, out: &TensorMeta, scale: Option<f64>) -> LResult<Inputs> {
        let [b, h, m, d] = out.shape[..] else { return malformed("fused attention's output is not 4-D") };
        let mut read = Vec::new();
        for (a, key) in operands.into_iter().zip(["query", "key", "value"]) {
            let Some(Arg::Node(n)) = a else { return malformed(format!("{key} is not a tensor")) };
            let Some(t) = self.graph.node(n).meta.tensor() else { return malformed(format!("{key} has no metadata")) };
            if t.shape.len() != 4 || t.dtype != out.dtype || t.shape[3] != d || t.shape[0] != b || t.shape[1] != h {
                return malformed(format!("{key} shaped {:?} ({}) for an output {:?}", t.shape, t.dtype, out.shape));
            }
            let rows = t.shape[2];
            read.push((self.operand(n, &[b, h, rows, d])?, rows));
        }
        let n_keys = read[1].1;
        if read[2].1 != n_keys || read[0].1 != m {
            return malformed("query, key and value rows disagree");
        }
        let bias = self.tensor_of(bias_node)?;
        if broadcast_shapes(&[&bias.size, &[b, h, m, n_keys]])? != [b, h, m, n_keys] {
            return malformed(format!("a bias shaped {:?} for scores [{b}, {h}, {m}, {n_keys}]", bias.size));
        }
        let mut read = read.into_iter().map(|(o, _)| o);
        let (Some(q), Some(k), Some(v)) = (read.next(), read.next(), read.next()) else { return malformed("three operands") };
        let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
        Ok(Inputs { q, k, v, bias, dims: [b, h, m, n_keys, d], dtype: out.dtype, scale })
    }

    /// An attention node over `layout` (`[B, H, rows, D]`) and its kernel's template. Its
    /// variables are (b, h, row, d, col): the rows are the queries and the reduction the keys,
    /// or for the keys' gradient the other way round. The body computes the bias first (the
    /// kernel computes it from those exprs) and reads everything the kernel reads; the rest is
    /// a stand-in (`Attention`).
    fn push_attention(
        &mut self,
        x: &Inputs,
        range: Option<&[(BufferId, IndexExpr); 2]>,
        g: Option<&GradInputs>,
        layout: &Layout,
        kernel: Kernel,
    ) -> BufferId {
        let [b, h, m, n, d] = x.dims;
        let keys_major = kernel == Kernel::GradKeyValue;
        let (rows, cols) = if keys_major { (n, m) } else { (m, n) };
        let var = |i: u32| IndexExpr::var(Var(i));
        // the query and the key positions among the variables
        let (qv, kv) = if keys_major { (var(4), var(2)) } else { (var(2), var(4)) };
        let mut body = LoopBody::default();
        let mut bx = Bx { body: &mut body, ranges: vec![b, h, rows, d, cols] };
        let bias = x.bias.load(&mut bx, &broadcast_index(&x.bias.size, &[var(0), var(1), qv.clone(), kv.clone()]));
        let bias = bx.body.cast(bias, DType::F32);
        let mut reads = Vec::new();
        let q = x.q.load(&mut bx, &[var(0), var(1), qv.clone(), var(3)], x.dtype);
        let k = x.k.load(&mut bx, &[var(0), var(1), kv.clone(), var(3)], x.dtype);
        let v = x.v.load(&mut bx, &[var(0), var(1), kv, var(3)], x.dtype);
        reads.extend([q, k, v]);
        let keys = range.map(|[first, last]| KeyRange {
            first: bx.body.load(first.0, first.1.clone(), DType::I32),
            last: bx.body.load(last.0, last.1.clone(), DType::I32),
        });
        if let Some(k) = keys {
            reads.extend([k.first, k.last]);
        }
        let pass = match (kernel, g) {
            (Kernel::Forward, _) | (_, None) => AttentionPass::Forward,
            (kernel, Some(g)) => {
                let grad_out = g.grad_out.load(&mut bx, &[var(0), var(1), qv.clone(), var(3)], x.dtype);
                let lse = g.lse.load(&mut bx, &[var(0), var(1), qv.clone()], DType::F32);
                let delta_index = Layout::contiguous(&[b, h, m], DType::F32, layout.device).index_of(&[var(0), var(1), qv.clone()]);
                let delta = bx.body.load(g.delta, delta_index, DType::F32);
                reads.extend([grad_out, lse, delta]);
                let grads = Grads { grad_out, lse, delta };
                if kernel == Kernel::GradQuery {
                    AttentionPass::GradQuery(grads)
                } else {
                    AttentionPass::GradKeyValue(grads)
                }
            }
        };
        // the stand-in the scheduler sees: every read, summed over the reduction
        let wide: Vec<ValueId> = reads.iter().map(|&l| bx.body.cast(l, DType::F32)).collect();
        let product = wide.iter().fold(bias, |acc, &x| bx.body.binary(BinaryOp::Mul, acc, x));
        let sum = bx.body.reduce(ReduceOp::Sum, product);
        let value = bx.body.cast(sum, layout.dtype);
        body.set_store(layout.index_of(&[var(0), var(1), var(2), var(3)]), value);
        let template = Template::Attention(Attention { scale: x.scale, bias, q, k, v, keys, pass });
        self.push_computed(layout, [vec![b, h, rows, d], vec![cols]], body, Some(template))
    }

    /// A fresh buffer of `layout` written by a loop node of this call over `ranges` (output
    /// ranges, reduction ranges).
    fn push_computed(
        &mut self,
        layout: &Layout,
        [ranges, reduction_ranges]: [Vec<i64>; 2],
        body: LoopBody,
        template: Option<Template>,
    ) -> BufferId {
        let output = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        self.push_node(LoopNode { output, ranges, reduction_ranges, body, origins: vec![self.node_name()], template });
        output
    }

    /// A further result of the attention kernel computing `head`, laid out as `layout`.
    fn push_result(&mut self, head: BufferId, result: AttentionResult, layout: &Layout) -> BufferId {
        let mut body = LoopBody::default();
        let zero = body.constant(Scalar::Float(0.0), layout.dtype);
        let vars: Vec<IndexExpr> = (0..layout.size.len() as u32).map(|i| IndexExpr::var(Var(i))).collect();
        body.set_store(layout.index_of(&vars), zero);
        self.push_computed(layout, [layout.size.clone(), vec![]], body, Some(Template::AttentionResult { of: head, result }))
    }

    /// `delta[b, h, m] = Σ_d grad_out · out` in float32 (the backward's correction of each row).
    fn attention_delta(&mut self, grad_out: NodeId, out: NodeId, [b, h, m, d]: [i64; 4]) -> LResult<BufferId> {
        let (go, o) = (self.tensor_of(grad_out)?, self.tensor_of(out)?);
        for t in [&go, &o] {
            if t.size != [b, h, m, d] {
                return malformed(format!("an output gradient shaped {:?} for [{b}, {h}, {m}, {d}]", t.size));
            }
        }
        let var = |i: u32| IndexExpr::var(Var(i));
        let all = [var(0), var(1), var(2), var(3)];
        let mut body = LoopBody::default();
        let mut bx = Bx { body: &mut body, ranges: vec![b, h, m, d] };
        let a = go.load(&mut bx, &all);
        let a = bx.body.cast(a, DType::F32);
        let c = o.load(&mut bx, &all);
        let c = bx.body.cast(c, DType::F32);
        let product = bx.body.binary(BinaryOp::Mul, a, c);
        let sum = bx.body.reduce(ReduceOp::Sum, product);
        let layout = Layout::contiguous(&[b, h, m], DType::F32, go.device);
        body.set_store(layout.index_of(&[var(0), var(1), var(2)]), sum);
        Ok(self.push_computed(&layout, [vec![b, h, m], vec![d]], body, None))
    }

    /// Node `n` (shaped `dims`) as the kernels read it: in place where one strided load reads
    /// it, stored first otherwise.
    fn operand(&mut self, n: NodeId, dims: &[i64]) -> LResult<Operand> {
        if let Some(tv) = self.read_in_place(n, dims)? {
            return Ok(Operand::Read(tv));
        }
        Ok(match self.extern_tensor(n, false)? {
            ExternArg::Buffer(buf) => {
                let l = &self.prog.buffer(buf).layout;
                Operand::Strided { buf, stride: l.stride.clone(), offset: l.offset }
            }
            ExternArg::View { buf, stride, offset, .. } => Operand::Strided { buf, stride, offset },
            _ => return malformed("an attention operand is not a tensor"),
        })
    }

    /// Node `n`'s value where reading it is one load of a buffer at (b, h, row, ..) strided, the
    /// head possibly divided (grouped-query attention's keys, repeated per query head: the kernel
    /// reads the shared head instead of a copy); None where it must be stored first.
    fn read_in_place(&mut self, n: NodeId, dims: &[i64]) -> LResult<Option<TensorValue>> {
        let tv = self.tensor_of(n)?;
        let vars: Vec<IndexExpr> = (0..dims.len() as u32).map(|i| IndexExpr::var(Var(i))).collect();
        let mut probe = LoopBody::default();
        let mut bx = Bx { body: &mut probe, ranges: dims.to_vec() };
        tv.load(&mut bx, &vars);
        let plain = match probe.exprs.as_slice() {
            [Expr::Load { index, .. }] => index.terms.iter().all(|(a, _)| match a {
                Atom::Var(_) => true,
                Atom::FloorDiv(e, _) => *e.as_ref() == vars[1],
                Atom::Mod(..) => false,
            }),
            _ => false,
        };
        Ok(plain.then_some(tv))
    }

    /// Where the bias reads tensors no larger than one head's scores (a document id gathered
    /// per query and per key) and may close keys, two reductions: each query row's first and
    /// last open key (`KeyRange`), so the kernel visits only the key tiles between them (a
    /// packed document's); with `per_key`, each key's first and last query that sees it (the
    /// keys' gradient visits only those query tiles). They are computed once for every batch
    /// and head the bias does not vary over. Returns each buffer with the attention's index of
    /// it (over b, h, row = variables 0, 1, 2).
    fn key_range(&mut self, bias: &TensorValue, dims: [i64; 4], per_key: bool) -> LResult<Option<[(BufferId, IndexExpr); 2]>> {
        let [b, h, m, n] = dims;
        // (the rows the ranges are of, and what they range over)
        let (rows, cols) = if per_key { (n, m) } else { (m, n) };
        let at_bias = |b: IndexExpr, h: IndexExpr, row: IndexExpr, col: IndexExpr| {
            let index = if per_key { [b, h, col, row] } else { [b, h, row, col] };
            broadcast_index(&bias.size, &index)
        };
        let var = |i: u32| IndexExpr::var(Var(i));
        let mut probe = LoopBody::default();
        let mut bx = Bx { body: &mut probe, ranges: vec![b, h, m, n] };
        bias.load(&mut bx, &broadcast_index(&bias.size, &[var(0), var(1), var(2), var(3)]));
        let mut read = false;
        for e in &probe.exprs {
            if let Expr::Load { buf, .. } | Expr::LoadIndirect { buf, .. } = e {
                if self.prog.buffer(*buf).layout.storage_numel() >= m * n {
                    return Ok(None); // (a stored mask: the kernel reads it per tile)
                }
                read = true;
            }
        }
        let closes = probe.exprs.iter().any(|e| matches!(e, Expr::Constant(Scalar::Float(f)) if *f == f64::NEG_INFINITY));
        if !read || !closes {
            return Ok(None);
        }
        let mut vars = Vec::new();
        for ix in probe.indices() {
            ix.vars(&mut vars);
        }
        let varies = |v: u32| vars.contains(&Var(v));
        let (rb, rh) = (if varies(0) { b } else { 1 }, if varies(1) { h } else { 1 });
        let at = |v: u32, extent: i64| if extent > 1 { var(v) } else { IndexExpr::zero() };
        let layout = Layout::contiguous(&[rb, rh, rows], DType::I32, bias.device);
        let index = layout.index_of(&[at(0, rb), at(1, rh), var(2)]);
        let mut out = Vec::new();
        for (op, none) in [(ReduceOp::Min, cols), (ReduceOp::Max, -1)] {
            let mut body = LoopBody::default();
            let mut bx = Bx { body: &mut body, ranges: vec![rb, rh, rows, cols] };
            let value = bias.load(&mut bx, &at_bias(at(0, rb), at(1, rh), var(2), var(3)));
            let value = bx.body.cast(value, DType::F32);
            let closed = bx.body.constant(Scalar::Float(f64::NEG_INFINITY), DType::F32);
            let open = bx.body.binary(BinaryOp::Ne, value, closed);
            let key = bx.body.index(var(3), DType::I32);
            let none = bx.body.constant(Scalar::Int(none), DType::I32);
            let key = bx.body.where_(open, key, none);
            let reduced = bx.body.reduce(op, key);
            body.set_store(layout.index_of(&[var(0), var(1), var(2)]), reduced);
            let buf = self.push_computed(&layout, [vec![rb, rh, rows], vec![cols]], body, None);
            out.push((buf, index.clone()));
        }
        self.decisions.push((
            "attention",
            format!(
                "template: {} reads tensors for its bias: each {}'s first and last open {} computed over [{rb}, {rh}, {rows}] by {cols}",
                self.node_name(),
                if per_key { "key" } else { "query row" },
                if per_key { "query" } else { "key" }
            ),
        ));
        Ok(out.try_into().ok())
    }
}

/// An attention operand: read where it lies (a view, possibly of fewer heads), or a strided
/// buffer it was stored into first.
enum Operand {
    Read(TensorValue),
    Strided { buf: BufferId, stride: Vec<i64>, offset: i64 },
}

impl Operand {
    /// One element's load, at `index` (one expression per dim).
    fn load(&self, bx: &mut Bx, index: &[IndexExpr], dtype: DType) -> ValueId {
        match self {
            Operand::Read(tv) => tv.load(bx, index),
            Operand::Strided { buf, stride, offset } => {
                let at = index.iter().zip(stride).fold(IndexExpr::constant(*offset), |e, (v, st)| e.add(&v.scale(*st)));
                bx.body.load(*buf, at, dtype)
            }
        }
    }
}
