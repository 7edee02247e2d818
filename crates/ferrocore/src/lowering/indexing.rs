//! Gathers: embedding, index_select, gather, advanced indexing (index.Tensor) and constant
//! padding. The gathered tensor is read through `LoadIndirect` at an address built from indices
//! loaded in the same body; user indices go through `CheckIndex`, so a bad index is an
//! IndexError raised by the wrapper, never a read outside the buffer.

use super::*;
use crate::symbolic::Atom;

/// A strided base for indirect loads: (buffer, strides, offset), realizing if needed.
pub(super) fn strided_base(cx: &mut Ctx, tv: &TensorValue) -> LResult<(BufferId, Vec<i64>, i64)> {
    if let Some(s) = tv.strided() {
        return Ok(s);
    }
    let lazy = TensorValue { src: Src::Lazy { f: loader(tv), reads: 1, ops: 0 }, ..tv.clone() };
    let r = cx.realize(&lazy);
    r.strided().ok_or((LowerErrorKind::Malformed, "realized value is not strided".to_string()))
}

impl Ctx<'_> {
    /// `strided_base` of argument `i` (value `tv`): a graph node's value is realized as that
    /// node, once for all its readers and the graph's outputs (a log-softmax both gathered and
    /// saved for the backward is one buffer, not two).
    pub(super) fn strided_arg(&mut self, i: usize, key: &str, tv: &TensorValue) -> LResult<(BufferId, Vec<i64>, i64)> {
        if tv.strided().is_none() {
            if let Some(Arg::Node(n)) = self.arg(i, key) {
                if let Some(s) = self.realized_node(*n, false)?.strided() {
                    return Ok(s);
                }
            }
        }
        strided_base(self, tv)
    }
}

fn loader(tv: &TensorValue) -> LoadFn {
    let t = tv.clone();
    Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| t.load(bx, idx))
}

/// `i` clamped into `[0, hi]`: the address a masked-off lane reads harmlessly.
pub(super) fn clamp_index(bx: &mut Bx, i: ValueId, hi: i64) -> ValueId {
    let zero = bx.body.constant(Scalar::Int(0), DType::I64);
    let top = bx.body.constant(Scalar::Int(hi), DType::I64);
    let c = bx.body.binary(BinaryOp::Maximum, i, zero);
    bx.body.binary(BinaryOp::Minimum, c, top)
}

/// `0 <= i < end`, and-ed onto the conditions gathered so far.
pub(super) fn and_in_range(bx: &mut Bx, so_far: Option<ValueId>, i: ValueId, end: ValueId) -> ValueId {
    let zero = bx.body.constant(Scalar::Int(0), bx.body.dtype(i));
    let ge = bx.body.binary(BinaryOp::Ge, i, zero);
    let lt = bx.body.binary(BinaryOp::Lt, i, end);
    let ok = bx.body.binary(BinaryOp::LogicalAnd, ge, lt);
    match so_far {
        Some(p) => bx.body.binary(BinaryOp::LogicalAnd, p, ok),
        None => ok,
    }
}

/// Index tensor value at `idx`, checked against `size` (negatives wrap when `wrap`).
fn checked_index(bx: &mut Bx, index: &TensorValue, idx: &[IndexExpr], size: i64, wrap: bool) -> ValueId {
    let v = index.load(bx, idx);
    bx.body.check_index(v, size, wrap)
}

/// The checked position along `dim` (of `size`) that output element `idx` reads: gather's index
/// tensor has the output's shape, index_select's one entry per position along `dim`.
fn gathered_position(bx: &mut Bx, ind: &TensorValue, idx: &[IndexExpr], dim: usize, size: i64, gather: bool) -> ValueId {
    if gather {
        return checked_index(bx, ind, idx, size, false);
    }
    let ii = if ind.size.is_empty() { vec![] } else { vec![idx[dim].clone()] };
    checked_index(bx, ind, &ii, size, false)
}

impl Ctx<'_> {
    pub(super) fn lower_gather(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let out = self.out_meta()?.clone();
        let (src, idx_tensors): (TensorValue, Vec<Option<TensorValue>>) = match op {
            AtenOp::Embedding => (self.tensor_arg(0, "weight")?, vec![Some(self.tensor_arg(1, "indices")?)]),
            AtenOp::IndexTensor => (self.tensor_arg(0, "self")?, self.optional_tensor_list(1, "indices")?),
            _ => (self.tensor_arg(0, "self")?, vec![Some(self.tensor_arg(2, "index")?)]),
        };
        for t in idx_tensors.iter().flatten() {
            // index.Tensor reads bool and uint8 indices as masks (data-dependent shapes); the
            // other gathers take indices of any integer type (an empty uint8 index, say)
            let integer = matches!(t.dtype, DType::I64 | DType::I32)
                || (op != AtenOp::IndexTensor && matches!(t.dtype, DType::U8 | DType::I8 | DType::I16));
            if !integer {
                return unsupported(format!("{} indices", t.dtype));
            }
        }
        self.check_gather_shape(op, &src, &idx_tensors, &out.shape)?;
        let weight = if op == AtenOp::Embedding { "weight" } else { "self" };
        if let Some(gathered) = self.gather_computed(op, &src, &idx_tensors, &out)? {
            return Ok(gathered);
        }
        if op == AtenOp::IndexTensor {
            let adv = super::scatter::AdvancedIndex::new(&src.size, &idx_tensors)?;
            if let Some(positions) = adv.exact_positions(&out.shape) {
                return Ok(read_at_positions(src, positions, &out));
            }
        }
        let (buf, stride, offset) = self.strided_arg(0, weight, &src)?;
        let sizes = src.size.clone();
        let rank = sizes.len();
        let dt = src.dtype;
        let f: LoadFn = match op {
            AtenOp::Embedding => {
                if rank != 2 {
                    return malformed("embedding weight must be 2-D");
                }
                let ind = idx_tensors[0].clone().ok_or((LowerErrorKind::Malformed, "no indices".to_string()))?;
                let k = ind.size.len();
                Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let row = checked_index(bx, &ind, &idx[..k], sizes[0], false);
                    let base = idx[k].scale(stride[1]).add_const(offset);
                    bx.body.load_indirect(buf, base, vec![(row, stride[0])], dt)
                })
            }
            AtenOp::IndexSelect | AtenOp::Gather => {
                let dim = if rank == 0 { 0 } else { norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)? };
                let ind = idx_tensors[0].clone().ok_or((LowerErrorKind::Malformed, "no index".to_string()))?;
                let gather = op == AtenOp::Gather;
                if rank == 0 {
                    // one element: every index must be 0 (or -1 for index_select, as in eager)
                    return Ok(TensorValue {
                        size: out.shape.clone(),
                        dtype: out.dtype,
                        device: out.device,
                        src: Src::Lazy {
                            f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                                // index_select's index has one element; gather's has the output's shape
                                let ii = if gather { idx.to_vec() } else { vec![IndexExpr::zero(); ind.size.len()] };
                                let i = checked_index(bx, &ind, &ii, 1, !gather);
                                bx.body.load_indirect(buf, IndexExpr::constant(offset), vec![(i, 0)], dt)
                            }),
                            reads: 2,
                            ops: 3,
                        },
                    });
                }
                Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let i = gathered_position(bx, &ind, idx, dim, sizes[dim], gather);
                    let mut base = IndexExpr::constant(offset);
                    for d in (0..rank).filter(|&d| d != dim) {
                        base = base.add(&idx[d].scale(stride[d]));
                    }
                    bx.body.load_indirect(buf, base, vec![(i, stride[dim])], dt)
                })
            }
            _ => {
                let adv = super::scatter::AdvancedIndex::new(&sizes, &idx_tensors)?;
                Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let (base, terms) = adv.address(bx, idx, &stride, offset);
                    bx.body.load_indirect(buf, base, terms, dt)
                })
            }
        };
        let (reads, ops) = (2, 3);
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads, ops } })
    }

    /// A gather's result is laid out over the metadata's shape and reads its index tensors at
    /// positions of that shape: a shape the inputs do not give would read outside them.
    fn check_gather_shape(&self, op: AtenOp, src: &TensorValue, idx_tensors: &[Option<TensorValue>], shape: &[i64]) -> LResult<()> {
        let rank = src.size.len();
        let first = || idx_tensors.first().cloned().flatten().ok_or((LowerErrorKind::Malformed, "no index".to_string()));
        let expected: Vec<i64> = match op {
            AtenOp::Embedding if rank == 2 => first()?.size.iter().copied().chain([src.size[1]]).collect(),
            AtenOp::Embedding => return malformed("embedding weight must be 2-D"),
            AtenOp::Gather => first()?.size,
            AtenOp::IndexSelect if rank == 0 => return Ok(()), // reads its one index at 0
            AtenOp::IndexSelect => {
                let ind = first()?;
                if ind.size.len() > 1 {
                    return malformed(format!("index_select index of rank {}", ind.size.len()));
                }
                let dim = norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?;
                let mut s = src.size.clone();
                s[dim] = ind.size.iter().product();
                s
            }
            _ => super::scatter::AdvancedIndex::new(&src.size, idx_tensors)?.result_shape(&src.size),
        };
        if expected != shape {
            return malformed(format!("the inputs give a result of shape {expected:?}, metadata says {shape:?}"));
        }
        Ok(())
    }

    /// gather / index_select from a value nothing else reads, computed at the gathered
    /// positions instead of realized whole: a loss's log-softmax over a vocabulary is read at
    /// one position per row (GPT-2: 4096 of 206M elements, an 823 MB buffer otherwise).
    fn gather_computed(
        &mut self,
        op: AtenOp,
        src: &TensorValue,
        idx_tensors: &[Option<TensorValue>],
        out: &TensorMeta,
    ) -> LResult<Option<TensorValue>> {
        let rank = src.size.len();
        if !matches!(op, AtenOp::Gather | AtenOp::IndexSelect) || rank == 0 || src.strided().is_some() {
            return Ok(None);
        }
        match self.arg(0, "self") {
            Some(Arg::Node(n)) if self.uses[n.0 as usize] == 1 => {}
            _ => return Ok(None),
        }
        let Some(ind) = idx_tensors[0].clone() else { return malformed("no index") };
        let dim = norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?;
        let gather = op == AtenOp::Gather;
        let (src, size) = (src.clone(), src.size[dim]);
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let at = gathered_position(bx, &ind, idx, dim, size, gather);
            load_at_runtime_index(bx, &src, idx, dim, at)
        });
        let (reads, ops) = (2, 3);
        Ok(Some(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads, ops } }))
    }

    /// constant_pad_nd: out[i] = in[i - lo] inside the input, `value` outside (negative pads crop).
    pub(super) fn lower_constant_pad(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let pad = self.ints_arg(1, "pad")?.unwrap_or_default();
        let value = match self.arg(2, "value") {
            None | Some(Arg::None) => Scalar::Int(0),
            Some(Arg::Int(v)) => Scalar::Int(*v),
            Some(Arg::Float(v)) => Scalar::Float(*v),
            Some(Arg::Bool(v)) => Scalar::Bool(*v),
            other => return malformed(format!("pad value must be a number, got {other:?}")),
        };
        let rank = x.size.len();
        if pad.len() % 2 != 0 || pad.len() / 2 > rank {
            return malformed(format!("pad {pad:?} for a rank-{rank} tensor"));
        }
        // low pad per dim (the list starts from the last dim)
        let mut lo = vec![0i64; rank];
        for (k, pair) in pad.chunks(2).enumerate() {
            lo[rank - 1 - k] = pair[0];
        }
        let (buf, stride, offset) = self.strided_arg(0, "self", &x)?;
        Ok(constant_padded((buf, stride, offset), &x, lo, &out.shape, value))
    }
}

/// The strided value `x` (at `base`: buffer, strides, offset) padded to `out_size`: out[i] =
/// x[i - lo] inside it, `value` outside (a negative `lo` crops).
pub(super) fn constant_padded(
    base: (BufferId, Vec<i64>, i64),
    x: &TensorValue,
    lo: Vec<i64>,
    out_size: &[i64],
    value: Scalar,
) -> TensorValue {
    let (buf, stride, offset) = base;
    let rank = x.size.len();
    let sizes = x.size.clone();
    let dt = x.dtype;
    let padded: Vec<usize> = (0..rank).filter(|&d| lo[d] != 0 || out_size[d] != sizes[d]).collect();
    let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
        let mut base = IndexExpr::constant(offset);
        let mut terms = Vec::new();
        let mut inside: Option<ValueId> = None;
        for d in 0..rank {
            let src = idx[d].add_const(-lo[d]);
            if !padded.contains(&d) {
                base = base.add(&src.scale(stride[d]));
                continue;
            }
            // clamp into the input (the value is discarded outside) and remember the bounds test
            let i = bx.body.index(src, DType::I64);
            let n = bx.body.constant(Scalar::Int(sizes[d]), DType::I64);
            inside = Some(and_in_range(bx, inside, i, n));
            terms.push((clamp_index(bx, i, sizes[d] - 1), stride[d]));
        }
        let v = if sizes.contains(&0) {
            super::creation::stored_constant(bx, value, dt) // nothing to read
        } else {
            bx.body.load_indirect(buf, base, terms, dt)
        };
        match inside {
            Some(ok) => {
                let pv = super::creation::stored_constant(bx, value, dt);
                bx.body.where_(ok, v, pv)
            }
            None => v,
        }
    });
    TensorValue { size: out_size.to_vec(), dtype: x.dtype, device: x.device, src: Src::Lazy { f, reads: 1, ops: 6 } }
}

impl Ctx<'_> {
    /// reflection_pad{1,2,3}d / replication_pad{2,3}d: the last k dims read the input at a
    /// reflected or clamped index, always inside it.
    pub(super) fn lower_edge_pad(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let pad = self.ints_arg(1, "padding")?.unwrap_or_default();
        let rank = x.size.len();
        let k = pad.len() / 2;
        if pad.len() % 2 != 0 || k > rank {
            return malformed(format!("padding {pad:?} for a rank-{rank} tensor"));
        }
        let reflect = matches!(op, AtenOp::ReflectionPad1d | AtenOp::ReflectionPad2d | AtenOp::ReflectionPad3d);
        let mut lo = vec![0i64; rank];
        for (j, pair) in pad.chunks(2).enumerate() {
            lo[rank - 1 - j] = pair[0];
        }
        if x.size.contains(&0) {
            return unsupported("edge padding of an empty tensor (ATen raises)");
        }
        let (buf, stride, offset) = self.strided_arg(0, "self", &x)?;
        let sizes = x.size.clone();
        let dt = x.dtype;
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let mut base = IndexExpr::constant(offset);
            let mut terms = Vec::new();
            for d in 0..rank {
                let src = idx[d].add_const(-lo[d]);
                if d < rank - k {
                    base = base.add(&src.scale(stride[d]));
                    continue;
                }
                let n = sizes[d];
                let i = bx.body.index(src, DType::I64);
                let j = if reflect {
                    // reflect at both edges: |i|, then 2(n-1) - that past the end
                    let neg = bx.body.unary(UnaryOp::Neg, i);
                    let a = bx.body.binary(BinaryOp::Maximum, i, neg);
                    let two_top = bx.body.constant(Scalar::Int(2 * (n - 1)), DType::I64);
                    let r = bx.body.binary(BinaryOp::Sub, two_top, a);
                    bx.body.binary(BinaryOp::Minimum, a, r)
                } else {
                    i
                };
                terms.push((clamp_index(bx, j, n - 1), stride[d]));
            }
            bx.body.load_indirect(buf, base, terms, dt)
        });
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads: 1, ops: 6 } })
    }

    /// select_scatter / slice_scatter: `src` where the index falls in the selection, else `x`.
    pub(super) fn lower_scatter_view(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let src = self.tensor_arg(1, "src")?;
        let out = self.out_meta()?.clone();
        let rank = x.size.len();
        let dim = norm_dim(self.int_arg(2, "dim")?.unwrap_or(0), rank)?;
        let n = x.size[dim];
        let (start, step, len) = if op == AtenOp::SelectScatter {
            let mut i = self.int_arg(3, "index")?.unwrap_or(0);
            if i < 0 {
                i += n;
            }
            (i, 1, 1)
        } else {
            let clampi = |v: i64| (if v < 0 { v + n } else { v }).clamp(0, n);
            let start = clampi(self.int_arg(3, "start")?.unwrap_or(0));
            let end = clampi(self.int_arg(4, "end")?.unwrap_or(i64::MAX / 2).min(i64::MAX / 2)).max(start);
            let step = self.int_arg(5, "step")?.unwrap_or(1).max(1);
            (start, step, if end > start { (end - start - 1) / step + 1 } else { 0 })
        };
        if len == 0 {
            return Ok(x);
        }
        let select = op == AtenOp::SelectScatter;
        let (sbuf, sstride, soff) = self.strided_arg(1, "src", &src)?;
        let cd = out.dtype;
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let keep = x.load(bx, idx);
            let keep = bx.body.cast(keep, cd);
            // position along `dim` inside the slice, clamped so the load stays in `src`
            let rel = bx.body.index(idx[dim].add_const(-start), DType::I64);
            let zero = bx.body.constant(Scalar::Int(0), DType::I64);
            let stepc = bx.body.constant(Scalar::Int(step), DType::I64);
            let lastc = bx.body.constant(Scalar::Int(len - 1), DType::I64);
            let q = bx.body.binary(BinaryOp::FloorDiv, rel, stepc);
            let r = bx.body.binary(BinaryOp::Remainder, rel, stepc);
            let ge = bx.body.binary(BinaryOp::Ge, rel, zero);
            let on = bx.body.binary(BinaryOp::Eq, r, zero);
            let le = bx.body.binary(BinaryOp::Le, q, lastc);
            let in1 = bx.body.binary(BinaryOp::LogicalAnd, ge, on);
            let inside = bx.body.binary(BinaryOp::LogicalAnd, in1, le);
            let c = clamp_index(bx, q, len - 1);
            let mut base = IndexExpr::constant(soff);
            let mut sd = 0usize;
            for (d, i) in idx.iter().enumerate().take(rank) {
                if d == dim {
                    if !select {
                        sd += 1; // the sliced dim is indexed through `c`
                    }
                    continue;
                }
                base = base.add(&i.scale(sstride[sd]));
                sd += 1;
            }
            let terms = if select { vec![] } else { vec![(c, sstride[dim])] };
            let v = bx.body.load_indirect(sbuf, base, terms, src.dtype);
            let v = bx.body.cast(v, cd);
            bx.body.where_(inside, v, keep)
        });
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads: 2, ops: 12 } })
    }

    /// as_strided_scatter(self, src, size, stride, offset): `self` with the as_strided view of
    /// its storage replaced by `src` (what autograd makes of an as_strided's gradient). Each
    /// output element finds whether the view covers its storage position: when the view's dims
    /// nest (by decreasing stride, each stride at least the span of the smaller ones), the view
    /// index follows greedily, largest stride first, so the op is a gather like slice_scatter.
    /// Overlapping or interleaved views are not lowered.
    pub(super) fn lower_as_strided_scatter(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let src = self.tensor_arg(1, "src")?;
        let out = self.out_meta()?.clone();
        let size = self.ints_arg(2, "size")?.ok_or((LowerErrorKind::Malformed, "as_strided_scatter needs a size".to_string()))?;
        let stride = self.ints_arg(3, "stride")?.ok_or((LowerErrorKind::Malformed, "as_strided_scatter needs strides".to_string()))?;
        let offset = self.int_arg(4, "storage_offset")?.unwrap_or(0);
        if size.len() != stride.len() || src.size != size {
            return malformed(format!("as_strided_scatter: src {:?} does not match the view {size:?} / {stride:?}", src.size));
        }
        if size.contains(&0) {
            return Ok(x);
        }
        if !is_dense(&out.shape, &out.stride) || stride.iter().any(|&s| s < 0) {
            return unsupported("as_strided_scatter into a non-dense result");
        }
        let mut dims: Vec<usize> = (0..size.len()).filter(|&d| size[d] > 1).collect();
        dims.sort_by_key(|&d| std::cmp::Reverse(stride[d]));
        let mut span = 1i64;
        for &d in dims.iter().rev() {
            if stride[d] < span {
                return unsupported("as_strided_scatter of an overlapping or interleaved view");
            }
            span += stride[d] * (size[d] - 1);
        }
        let (sbuf, sstride, soff) = self.strided_arg(1, "src", &src)?;
        let ostride = out.stride.clone();
        let cd = out.dtype;
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let keep = x.load(bx, idx);
            let keep = bx.body.cast(keep, cd);
            let mut pos = IndexExpr::constant(-offset);
            for (i, s) in idx.iter().zip(&ostride) {
                pos = pos.add(&i.scale(*s));
            }
            let mut rem = bx.body.index(pos, DType::I64);
            let zero = bx.body.constant(Scalar::Int(0), DType::I64);
            let mut inside = bx.body.binary(BinaryOp::Ge, rem, zero);
            let mut terms = Vec::new();
            for &d in &dims {
                let st = bx.body.constant(Scalar::Int(stride[d]), DType::I64);
                let q = bx.body.binary(BinaryOp::FloorDiv, rem, st);
                let used = bx.body.binary(BinaryOp::Mul, q, st);
                rem = bx.body.binary(BinaryOp::Sub, rem, used);
                let n = bx.body.constant(Scalar::Int(size[d]), DType::I64);
                let fits = bx.body.binary(BinaryOp::Lt, q, n);
                inside = bx.body.binary(BinaryOp::LogicalAnd, inside, fits);
                terms.push((clamp_index(bx, q, size[d] - 1), sstride[d]));
            }
            let exact = bx.body.binary(BinaryOp::Eq, rem, zero);
            inside = bx.body.binary(BinaryOp::LogicalAnd, inside, exact);
            let v = bx.body.load_indirect(sbuf, IndexExpr::constant(soff), terms, src.dtype);
            let v = bx.body.cast(v, cd);
            bx.body.where_(inside, v, keep)
        });
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads: 2, ops: 20 } })
    }
}

impl Ctx<'_> {
    /// upsample_nearest2d: src = min(floor(dst · scale), in − 1) in float32, as ATen computes it.
    pub(super) fn lower_upsample_nearest(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "input")?;
        let out = self.out_meta()?.clone();
        let rank = x.size.len();
        if rank != 4 || out.shape.len() != 4 {
            return malformed("upsample_nearest2d takes a 4-D input");
        }
        let factors = match self.arg(2, "scale_factors") {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Float(f) => Ok(Some(*f)),
                    Arg::Int(i) => Ok(Some(*i as f64)),
                    _ => malformed("scale factors must be numbers"),
                })
                .collect::<LResult<Vec<_>>>()?,
            _ => vec![None, None],
        };
        let (buf, stride, offset) = self.strided_arg(0, "input", &x)?;
        let ins = x.size.clone();
        let outs = out.shape.clone();
        let scales: Vec<f32> = (0..2)
            .map(|k| match factors.get(k).copied().flatten() {
                Some(f) if f > 0.0 => (1.0 / f) as f32,
                _ => ins[2 + k] as f32 / outs[2 + k] as f32,
            })
            .collect();
        let dt = x.dtype;
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let mut base = IndexExpr::constant(offset).add(&idx[0].scale(stride[0])).add(&idx[1].scale(stride[1]));
            let mut terms = Vec::new();
            for (k, scale) in scales.iter().enumerate() {
                let d = 2 + k;
                if outs[d] == ins[d] {
                    base = base.add(&idx[d].scale(stride[d]));
                    continue;
                }
                let o = bx.body.index(idx[d].clone(), DType::I64);
                let of = bx.body.cast(o, DType::F32);
                let s = bx.body.constant(Scalar::Float(*scale as f64), DType::F32);
                let p = bx.body.binary(BinaryOp::Mul, of, s);
                let fl = bx.body.unary(UnaryOp::Floor, p);
                let i = bx.body.cast(fl, DType::I64);
                terms.push((clamp_index(bx, i, ins[d] - 1), stride[d]));
            }
            bx.body.load_indirect(buf, base, terms, dt)
        });
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads: 1, ops: 8 } })
    }
}

/// `tv` at `idx` with dim `dim`'s position the runtime int64 `at` (checked, in range): the value's
/// body is built over a placeholder variable for that position, then copied into `bx` with each
/// address that uses the placeholder read through `at` (an indirect load; the address computed
/// at run time where the placeholder is not a plain term of it).
fn load_at_runtime_index(bx: &mut Bx, tv: &TensorValue, idx: &[IndexExpr], dim: usize, at: ValueId) -> ValueId {
    let p = Var(bx.ranges.len() as u32);
    let mut ranges = bx.ranges.clone();
    ranges.push(tv.size[dim]);
    let mut scratch = LoopBody::default();
    let mut at_p = idx.to_vec();
    at_p[dim] = IndexExpr::var(p);
    let root = {
        let mut sbx = Bx { body: &mut scratch, ranges };
        tv.load(&mut sbx, &at_p)
    };
    let mut map: Vec<Option<ValueId>> = Vec::with_capacity(scratch.exprs.len());
    for (i, e) in scratch.exprs.iter().enumerate() {
        let dtype = scratch.dtypes[i];
        let uses_p = |ix: &IndexExpr| ix.uses(p);
        let v = match e {
            Expr::Load { buf, index } if uses_p(index) => {
                let (rest, term) = runtime_address(bx, index, p, at);
                bx.body.load_indirect(*buf, rest, vec![term], dtype)
            }
            Expr::LoadIndirect { buf, index, terms } if uses_p(index) => {
                let (rest, term) = runtime_address(bx, index, p, at);
                let mut all: Vec<(ValueId, i64)> = terms.iter().map(|(v, c)| (map[v.0 as usize].expect("operand copied"), *c)).collect();
                all.push(term);
                bx.body.load_indirect(*buf, rest, all, dtype)
            }
            Expr::Index(ix) if uses_p(ix) => {
                let v = index_value(bx, ix, p, at);
                bx.body.cast(v, dtype)
            }
            other => bx.body.push_copy(other, dtype, &|v| map[v.0 as usize]).expect("operands copied in order"),
        };
        map.push(Some(v));
    }
    map[root.0 as usize].expect("root copied")
}

/// `index` as (the part without the placeholder `p`, (value, coefficient)): `p` a plain term
/// is `at` times its coefficient; inside a division or modulo the whole address is computed.
fn runtime_address(bx: &mut Bx, index: &IndexExpr, p: Var, at: ValueId) -> (IndexExpr, (ValueId, i64)) {
    match index.affine_coeff(p) {
        Some(c) => (index.sub(&IndexExpr::var(p).scale(c)), (at, c)),
        None => (IndexExpr::zero(), (index_value(bx, index, p, at), 1)),
    }
}

/// The int64 value of `e` with the placeholder `p` read as `at` (other variables as indices).
fn index_value(bx: &mut Bx, e: &IndexExpr, p: Var, at: ValueId) -> ValueId {
    let mut sum = bx.body.constant(Scalar::Int(e.constant), DType::I64);
    for (atom, c) in &e.terms {
        let v = match atom {
            Atom::Var(v) if *v == p => at,
            Atom::Var(v) => bx.body.index(IndexExpr::var(*v), DType::I64),
            Atom::FloorDiv(inner, d) | Atom::Mod(inner, d) => {
                let x = index_value(bx, inner, p, at);
                let d = bx.body.constant(Scalar::Int(*d), DType::I64);
                // the index is never negative: floor division and modulo are the truncating ones
                let op = if matches!(atom, Atom::FloorDiv(..)) { BinaryOp::FloorDiv } else { BinaryOp::Remainder };
                bx.body.binary(op, x, d)
            }
        };
        let k = bx.body.constant(Scalar::Int(*c), DType::I64);
        let term = bx.body.binary(BinaryOp::Mul, v, k);
        sum = bx.body.binary(BinaryOp::Add, sum, term);
    }
    sum
}

/// `src` read at `positions` (index expressions in the result's loop variables, one per source
/// dim), substituted with the reader's indices.
fn read_at_positions(src: TensorValue, positions: Vec<IndexExpr>, out: &TensorMeta) -> TensorValue {
    let (reads, ops) = src.cost();
    let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
        let subst: Vec<Option<IndexExpr>> = idx.iter().cloned().map(Some).collect();
        let at: Vec<IndexExpr> = positions.iter().map(|p| p.substitute(&subst, &bx.ranges)).collect();
        src.load(bx, &at)
    });
    TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads, ops } }
}
