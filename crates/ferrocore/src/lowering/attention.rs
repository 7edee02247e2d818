//! Fused attention with a computed bias (`_scaled_dot_product_fused_attention_overrideable`,
//! which the `attention` graph pass writes for Triton graphs) as one `Template::Attention` node:
//! the bias stays a lazy value, so its computation (a mask built from positions, a document id
//! gathered per key, an ALiBi slope times a distance) is inlined into the kernel's key loop and
//! never stored.

use super::pointwise::{broadcast_index, broadcast_shapes};
use super::*;
use crate::symbolic::Atom;

impl Ctx<'_> {
    /// The call as an attention node, or None where no template takes it (the library call runs).
    pub(super) fn lower_attention_template(&mut self) -> LResult<Option<Lowered>> {
        if !self.triton_kernels() || self.float_arg(4, "dropout_p")?.unwrap_or(0.0) != 0.0 {
            return Ok(None);
        }
        if matches!(self.arg(5, "is_causal"), Some(Arg::Bool(true))) {
            return Ok(None); // (the attention pass writes every mask into the bias)
        }
        let Some(Arg::Node(bias_node)) = self.arg(3, "attn_bias").cloned() else { return Ok(None) };
        let Meta::Tuple(items) = self.meta() else { return malformed("fused attention returns a tuple") };
        let Some(Some(Meta::Tensor(out))) = items.first() else { return malformed("fused attention has no output") };
        let [b, h, m, d] = out.shape[..] else { return malformed("fused attention's output is not 4-D") };
        let mut operands = Vec::new();
        for (i, key) in [(0, "query"), (1, "key"), (2, "value")] {
            let Some(Arg::Node(n)) = self.arg(i, key).cloned() else { return malformed(format!("{key} is not a tensor")) };
            let Some(t) = self.graph.node(n).meta.tensor() else { return malformed(format!("{key} has no metadata")) };
            if t.shape.len() != 4 || t.dtype != out.dtype || t.shape[3] != d || t.shape[0] != b || t.shape[1] != h {
                return malformed(format!("{key} shaped {:?} ({}) for an output {:?}", t.shape, t.dtype, out.shape));
            }
            let rows = t.shape[2];
            let operand = match self.read_in_place(n, [b, h, rows, d])? {
                Some(tv) => Operand::Read(tv),
                None => Operand::Stored(self.extern_tensor(n, false)?),
            };
            operands.push((operand, rows));
        }
        let n_keys = operands[1].1;
        if operands[2].1 != n_keys || operands[0].1 != m {
            return malformed("query, key and value rows disagree");
        }
        let bias = self.tensor_of(bias_node)?;
        if broadcast_shapes(&[&bias.size, &[b, h, m, n_keys]])? != [b, h, m, n_keys] {
            return malformed(format!("a bias shaped {:?} for scores [{b}, {h}, {m}, {n_keys}]", bias.size));
        }
        let scale = self.float_arg(7, "scale")?.unwrap_or(1.0 / (d as f64).sqrt());

        // variables: b, h, m, d over the output, then the key n
        let var = |i: u32| IndexExpr::var(Var(i));
        let mut body = LoopBody::default();
        let mut bx = Bx { body: &mut body, ranges: vec![b, h, m, d, n_keys] };
        let bias_value = bias.load(&mut bx, &broadcast_index(&bias.size, &[var(0), var(1), var(2), var(4)]));
        let bias_value = bx.body.cast(bias_value, DType::F32);
        let mut loads = Vec::new();
        for ((operand, _), row) in operands.iter().zip([var(2), var(4), var(4)]) {
            let (buf, stride, offset) = match operand {
                Operand::Read(tv) => {
                    loads.push(tv.load(&mut bx, &[var(0), var(1), row, var(3)]));
                    continue;
                }
                Operand::Stored(ExternArg::Buffer(buf)) => {
                    let l = &self.prog.buffer(*buf).layout;
                    (*buf, l.stride.clone(), l.offset)
                }
                Operand::Stored(ExternArg::View { buf, stride, offset, .. }) => (*buf, stride.clone(), *offset),
                _ => return malformed("an attention operand is not a tensor"),
            };
            let index =
                [var(0), var(1), row, var(3)].iter().zip(&stride).fold(IndexExpr::constant(offset), |e, (v, st)| e.add(&v.scale(*st)));
            let value = bx.body.load(buf, index, out.dtype);
            loads.push(value);
        }
        let keys = self.key_range(&bias, [b, h, m, n_keys])?.map(|[first, last]| KeyRange {
            first: bx.body.load(first.0, first.1.clone(), DType::I32),
            last: bx.body.load(last.0, last.1.clone(), DType::I32),
        });
        // the stand-in the scheduler sees: every read, summed over the keys
        let mut wide: Vec<ValueId> = loads.iter().map(|&l| bx.body.cast(l, DType::F32)).collect();
        if let Some(k) = keys {
            wide.extend([k.first, k.last].map(|x| bx.body.cast(x, DType::F32)));
        }
        let product = wide.iter().fold(bias_value, |acc, &x| bx.body.binary(BinaryOp::Mul, acc, x));
        let sum = bx.body.reduce(ReduceOp::Sum, product);
        let value = bx.body.cast(sum, out.dtype);
        let layout = Layout { size: out.shape.clone(), stride: out.stride.clone(), offset: 0, dtype: out.dtype, device: out.device };
        body.set_store(layout.index_of(&[var(0), var(1), var(2), var(3)]), value);
        let buf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let template = Template::Attention(Attention { scale, bias: bias_value, q: loads[0], k: loads[1], v: loads[2], keys });
        self.push_node(LoopNode {
            output: buf,
            ranges: vec![b, h, m, d],
            reduction_ranges: vec![n_keys],
            body,
            origins: vec![self.node_name()],
            template: Some(template),
        });
        self.decisions.push((
            "attention",
            format!(
                "template: {} [{b}, {h}, {m}, {d}] over {n_keys} keys is an attention kernel, its bias computed inside",
                self.node_name()
            ),
        ));
        let mut tuple = vec![Some(Lowered::Tensor(view_of_layout(buf, &layout)))];
        tuple.resize(items.len(), None);
        Ok(Some(Lowered::Tuple(tuple)))
    }

    /// Node `n`'s value where reading it is one load of a buffer at (b, h, row, d) strided, the
    /// head possibly divided (grouped-query attention's keys, repeated per query head: the kernel
    /// reads the shared head instead of a copy); None where it must be stored first.
    fn read_in_place(&mut self, n: NodeId, dims: [i64; 4]) -> LResult<Option<TensorValue>> {
        let tv = self.tensor_of(n)?;
        let var = |i: u32| IndexExpr::var(Var(i));
        let mut probe = LoopBody::default();
        let mut bx = Bx { body: &mut probe, ranges: dims.to_vec() };
        tv.load(&mut bx, &[var(0), var(1), var(2), var(3)]);
        let plain = match probe.exprs.as_slice() {
            [Expr::Load { index, .. }] => index.terms.iter().all(|(a, _)| match a {
                Atom::Var(_) => true,
                Atom::FloorDiv(e, _) => *e.as_ref() == var(1),
                Atom::Mod(..) => false,
            }),
            _ => false,
        };
        Ok(plain.then_some(tv))
    }

    /// Where the bias reads tensors no larger than one head's scores (a document id gathered
    /// per query and per key) and may close keys, two reductions over the keys: each query
    /// row's first and last open key (`KeyRange`), so the kernel visits only the key tiles
    /// between them (a packed document's). They are computed once for every batch and head the
    /// bias does not vary over. Returns each buffer with the attention's index of it (over b,
    /// h, m = variables 0, 1, 2).
    fn key_range(&mut self, bias: &TensorValue, dims: [i64; 4]) -> LResult<Option<[(BufferId, IndexExpr); 2]>> {
        let [b, h, m, n] = dims;
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
        let layout = Layout::contiguous(&[rb, rh, m], DType::I32, bias.device);
        let index = layout.index_of(&[at(0, rb), at(1, rh), var(2)]);
        let mut out = Vec::new();
        for (op, none) in [(ReduceOp::Min, n), (ReduceOp::Max, -1)] {
            let mut body = LoopBody::default();
            let mut bx = Bx { body: &mut body, ranges: vec![rb, rh, m, n] };
            let value = bias.load(&mut bx, &broadcast_index(&bias.size, &[at(0, rb), at(1, rh), var(2), var(3)]));
            let value = bx.body.cast(value, DType::F32);
            let closed = bx.body.constant(Scalar::Float(f64::NEG_INFINITY), DType::F32);
            let open = bx.body.binary(BinaryOp::Ne, value, closed);
            let key = bx.body.index(var(3), DType::I32);
            let none = bx.body.constant(Scalar::Int(none), DType::I32);
            let key = bx.body.where_(open, key, none);
            let reduced = bx.body.reduce(op, key);
            body.set_store(layout.index_of(&[var(0), var(1), var(2)]), reduced);
            let buf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
            self.push_node(LoopNode {
                output: buf,
                ranges: vec![rb, rh, m],
                reduction_ranges: vec![n],
                body,
                origins: vec![self.node_name()],
                template: None,
            });
            out.push((buf, index.clone()));
        }
        self.decisions.push((
            "attention",
            format!(
                "template: {} reads tensors for its bias: each query row's first and last open key computed over [{rb}, {rh}, {m}] by {n} keys",
                self.node_name()
            ),
        ));
        Ok(out.try_into().ok())
    }
}

/// An attention operand: read where it lies (a view, possibly of fewer heads), or stored first.
enum Operand {
    Read(TensorValue),
    Stored(ExternArg),
}
