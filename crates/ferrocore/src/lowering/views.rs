//! View ops: every view is an index remapping onto its base, for buffer views and lazy values
//! alike, so views never copy. Strides are recovered from the remapped index where needed.

use super::*;

/// A view of `tv` with `size`, reading the base at `reindex(idx)`.
pub fn apply_view(tv: &TensorValue, size: Vec<i64>, reindex: ReindexFn) -> TensorValue {
    let src = match &tv.src {
        Src::View { buf, index } => {
            let index = index.clone();
            let reindex = reindex.clone();
            Src::View { buf: *buf, index: Rc::new(move |idx: &[IndexExpr], r: &[i64]| index(&reindex(idx, r), r)) }
        }
        Src::Lazy { f, reads, ops } => {
            let f = f.clone();
            Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let i = reindex(idx, &bx.ranges);
                    f(bx, &i)
                }),
                reads: *reads,
                ops: *ops,
            }
        }
    };
    TensorValue { size, dtype: tv.dtype, device: tv.device, src }
}

/// Reshape by flattening the index and splitting it again; the simplifier removes the
/// division and modulo whenever the reshape only merges or splits contiguous dims.
/// A view's size argument (at most one -1, inferred from `numel`; no other negative size) names
/// the shape its result's metadata has.
fn check_view_size(size: &[i64], numel: i64, out_shape: &[i64]) -> LResult<()> {
    let inferred = size.iter().filter(|&&d| d == -1).count();
    if inferred > 1 || size.iter().any(|&d| d < -1) {
        return malformed(format!("view size {size:?}: only one size may be -1 and none other negative"));
    }
    let known: i128 = size.iter().filter(|&&d| d != -1).map(|&d| d as i128).product();
    let resolved: Vec<i64> = if inferred == 1 {
        if known == 0 || numel as i128 % known != 0 {
            return malformed(format!("view size {size:?} does not fit {numel} elements"));
        }
        size.iter().map(|&d| if d == -1 { (numel as i128 / known) as i64 } else { d }).collect()
    } else {
        size.to_vec()
    };
    if resolved != out_shape {
        return malformed(format!("view size {size:?} gives {resolved:?}, but the metadata says {out_shape:?}"));
    }
    Ok(())
}

pub fn reshape(tv: &TensorValue, new_size: Vec<i64>) -> LResult<TensorValue> {
    let old = tv.size.clone();
    if old.iter().product::<i64>() != new_size.iter().product::<i64>() {
        return malformed(format!("cannot view {old:?} as {new_size:?}"));
    }
    if old == new_size {
        return Ok(tv.clone());
    }
    if old.contains(&0) {
        // no elements: any index map will do
        let rank = old.len();
        return Ok(apply_view(tv, new_size, Rc::new(move |_: &[IndexExpr], _: &[i64]| vec![IndexExpr::zero(); rank])));
    }
    let new_strides = contiguous_strides(&new_size);
    let old_strides = contiguous_strides(&old);
    let reindex: ReindexFn = Rc::new(move |idx: &[IndexExpr], r: &[i64]| {
        let mut flat = IndexExpr::zero();
        for (i, s) in idx.iter().zip(&new_strides) {
            flat = flat.add(&i.scale(*s));
        }
        old.iter().zip(&old_strides).map(|(&d, &s)| if d == 1 { IndexExpr::zero() } else { flat.floordiv(s, r).modulo(d, r) }).collect()
    });
    Ok(apply_view(tv, new_size, reindex))
}

pub fn permute(tv: &TensorValue, perm: &[usize]) -> TensorValue {
    let size: Vec<i64> = perm.iter().map(|&p| tv.size[p]).collect();
    let perm = perm.to_vec();
    apply_view(
        tv,
        size,
        Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
            let mut out = vec![IndexExpr::zero(); idx.len()];
            for (i, &p) in perm.iter().enumerate() {
                out[p] = idx[i].clone();
            }
            out
        }),
    )
}

pub fn expand(tv: &TensorValue, size: Vec<i64>) -> LResult<TensorValue> {
    let old = tv.size.clone();
    if size.len() < old.len() {
        return malformed(format!("cannot expand {old:?} to {size:?}"));
    }
    let off = size.len() - old.len();
    let mut target = size.clone();
    for (i, &d) in old.iter().enumerate() {
        let t = &mut target[off + i];
        if *t == -1 {
            *t = d;
        } else if d != 1 && d != *t {
            return malformed(format!("cannot expand {old:?} to {size:?}"));
        }
    }
    Ok(apply_view(
        tv,
        target,
        Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
            old.iter().enumerate().map(|(i, &d)| if d == 1 { IndexExpr::zero() } else { idx[off + i].clone() }).collect()
        }),
    ))
}

/// A slice `[start, start+len)` of `dim`.
pub fn narrow(tv: &TensorValue, dim: usize, start: i64, len: i64) -> TensorValue {
    let mut size = tv.size.clone();
    size[dim] = len;
    apply_view(
        tv,
        size,
        Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
            let mut out = idx.to_vec();
            out[dim] = idx[dim].add_const(start);
            out
        }),
    )
}

impl Ctx<'_> {
    pub(super) fn lower_split(&mut self, op: AtenOp) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "self")?;
        let rank = x.size.len();
        let dim = norm_dim(self.int_arg(2, "dim")?.unwrap_or(0), rank)?;
        let n = x.size[dim];
        let sizes: Vec<i64> = if op == AtenOp::SplitTensor {
            let chunk = self.int_arg(1, "split_size")?.unwrap_or(1).max(1);
            let mut v = Vec::new();
            let mut s = 0;
            while s < n {
                v.push(chunk.min(n - s));
                s += chunk;
            }
            if v.is_empty() {
                v.push(0);
            }
            v
        } else {
            self.ints_arg(1, "split_sizes")?.unwrap_or_default()
        };
        if sizes.iter().sum::<i64>() != n {
            return malformed(format!("split sizes {sizes:?} do not add up to {n}"));
        }
        let mut start = 0;
        let mut items = Vec::new();
        for s in sizes {
            items.push(Some(Lowered::Tensor(narrow(&x, dim, start, s))));
            start += s;
        }
        Ok(Lowered::Tuple(items))
    }

    pub(super) fn lower_view(&mut self, op: AtenOp) -> LResult<TensorValue> {
        use AtenOp as A;
        let x = self.tensor_arg(0, "self")?;
        let rank = x.size.len();
        let out_shape = self.out_meta()?.shape.clone();
        let tv = match op {
            A::View | A::UnsafeView | A::Reshape => {
                // (a size list holding symbols was specialized away; only plain ints are checked)
                if let Ok(Some(size)) = self.ints_arg(1, if op == A::Reshape { "shape" } else { "size" }) {
                    check_view_size(&size, x.size.iter().product(), &out_shape)?;
                }
                reshape(&x, out_shape.clone())?
            }
            A::Alias => x,
            A::Permute => self.permute_view(&x)?,
            A::TransposeInt | A::T if rank == 0 => x,
            // t() of a vector is the vector itself, returned as it is
            A::T if rank < 2 => return Ok(x),
            A::TransposeInt | A::T => self.transpose_view(op, &x)?,
            A::Expand => expand(&x, self.ints_arg(1, "size")?.unwrap_or_default())?,
            A::Unsqueeze | A::SqueezeDim | A::SqueezeDims | A::Squeeze => reshape(&x, out_shape.clone())?,
            A::SliceTensor => self.slice_view(&x)?,
            A::SelectInt => self.select_view(&x)?,
            A::Diagonal => self.diagonal_view(&x)?,
            A::Unfold => self.unfold_view(&x)?,
            _ => return malformed("not a view op"),
        };
        if tv.size != out_shape {
            return malformed(format!("view produced shape {:?}, metadata says {out_shape:?}", tv.size));
        }
        Ok(tv)
    }

    /// permute: the `dims` argument must name every dim once.
    fn permute_view(&self, x: &TensorValue) -> LResult<TensorValue> {
        let rank = x.size.len();
        let dims = self.ints_arg(1, "dims")?.unwrap_or_default();
        let perm = dims.iter().map(|&d| norm_dim(d, rank)).collect::<LResult<Vec<_>>>()?;
        let mut seen = perm.clone();
        seen.sort();
        if seen != (0..rank).collect::<Vec<_>>() {
            return malformed(format!("{dims:?} is not a permutation of {rank} dims"));
        }
        Ok(permute(x, &perm))
    }

    /// transpose.int, or t() of a matrix: a permutation swapping two dims.
    fn transpose_view(&self, op: AtenOp, x: &TensorValue) -> LResult<TensorValue> {
        let rank = x.size.len();
        let (a, b) = if op == AtenOp::T {
            (0, 1)
        } else {
            (norm_dim(self.int_arg(1, "dim0")?.unwrap_or(0), rank)?, norm_dim(self.int_arg(2, "dim1")?.unwrap_or(0), rank)?)
        };
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(a, b);
        Ok(permute(x, &perm))
    }

    /// slice.Tensor: `start` and `end` clamped into the dim as Python slicing does, a positive step.
    fn slice_view(&self, x: &TensorValue) -> LResult<TensorValue> {
        let rank = x.size.len();
        let dim = norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?;
        let n = x.size[dim];
        let step = self.int_arg(4, "step")?.unwrap_or(1);
        if step <= 0 {
            return malformed(format!("slice step must be positive, got {step}"));
        }
        let clampi = |v: i64| -> i64 {
            let v = if v < 0 { v + n } else { v };
            v.clamp(0, n)
        };
        let start = clampi(self.int_arg(2, "start")?.unwrap_or(0));
        let end = clampi(self.int_arg(3, "end")?.unwrap_or(i64::MAX).min(i64::MAX / 2)).max(start);
        let len = if end > start { (end - start - 1) / step + 1 } else { 0 };
        // one element: the step never multiplies an index (and cannot overflow one)
        let step = if len <= 1 { 1 } else { step };
        let mut size = x.size.clone();
        size[dim] = len;
        Ok(apply_view(
            x,
            size,
            Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
                let mut out = idx.to_vec();
                out[dim] = idx[dim].scale(step).add_const(start);
                out
            }),
        ))
    }

    /// select.int: one index of `dim` (negative counts from the end), the dim removed.
    fn select_view(&self, x: &TensorValue) -> LResult<TensorValue> {
        let rank = x.size.len();
        let dim = norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?;
        let n = x.size[dim];
        let mut i = self.int_arg(2, "index")?.unwrap_or(0);
        if i < 0 {
            i += n;
        }
        if i < 0 || i >= n {
            return malformed(format!("select index out of range for size {n}"));
        }
        let mut size = x.size.clone();
        size.remove(dim);
        Ok(apply_view(
            x,
            size,
            Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
                let mut out = idx.to_vec();
                out.insert(dim, IndexExpr::constant(i));
                out
            }),
        ))
    }

    /// diagonal: dims `dim1` and `dim2` replaced by their (offset) diagonal as a new last dim.
    fn diagonal_view(&self, x: &TensorValue) -> LResult<TensorValue> {
        let rank = x.size.len();
        let offset = self.int_arg(1, "offset")?.unwrap_or(0);
        let d1 = norm_dim(self.int_arg(2, "dim1")?.unwrap_or(0), rank)?;
        let d2 = norm_dim(self.int_arg(3, "dim2")?.unwrap_or(1), rank)?;
        if d1 == d2 {
            return malformed("diagonal dims must differ");
        }
        let n = if offset >= 0 { x.size[d1].min(x.size[d2] - offset) } else { (x.size[d1] + offset).min(x.size[d2]) }.max(0);
        let mut size: Vec<i64> = (0..rank).filter(|&d| d != d1 && d != d2).map(|d| x.size[d]).collect();
        size.push(n);
        let (r1, r2) = if offset >= 0 { (0, offset) } else { (-offset, 0) };
        Ok(apply_view(
            x,
            size,
            Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
                let diag = idx[idx.len() - 1].clone();
                let mut rest = idx[..idx.len() - 1].iter();
                (0..rank)
                    .map(|d| {
                        if d == d1 {
                            diag.add_const(r1)
                        } else if d == d2 {
                            diag.add_const(r2)
                        } else {
                            rest.next().cloned().unwrap_or_else(IndexExpr::zero)
                        }
                    })
                    .collect()
            }),
        ))
    }

    /// unfold: windows of `size` every `step` along `dim`, as a new last dim.
    fn unfold_view(&self, x: &TensorValue) -> LResult<TensorValue> {
        let rank = x.size.len();
        let dim = if rank == 0 { 0 } else { norm_dim(self.int_arg(1, "dimension")?.unwrap_or(0), rank)? };
        let size = self.int_arg(2, "size")?.unwrap_or(1);
        let step = self.int_arg(3, "step")?.unwrap_or(1);
        let n = if rank == 0 { 1 } else { x.size[dim] };
        if step <= 0 || size < 0 || size > n {
            return malformed(format!("unfold of size {size} step {step} over a dim of {n}"));
        }
        let count = (n - size) / step + 1;
        let mut shape = x.size.clone();
        if rank > 0 {
            shape[dim] = count;
        }
        shape.push(size);
        Ok(apply_view(
            x,
            shape,
            Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
                let within = idx[idx.len() - 1].clone();
                let mut out = idx[..idx.len() - 1].to_vec();
                if rank > 0 {
                    out[dim] = idx[dim].scale(step).add(&within);
                }
                out
            }),
        ))
    }
}

impl Ctx<'_> {
    /// flip, repeat and as_strided: index maps onto the input, no copies.
    pub(super) fn lower_data_movement(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let rank = x.size.len();
        let tv = match op {
            AtenOp::Flip => {
                let dims = self.ints_arg(1, "dims")?.unwrap_or_default();
                let dims = dims.iter().map(|&d| norm_dim(d, rank)).collect::<LResult<Vec<_>>>()?;
                let size = x.size.clone();
                apply_view(
                    &x,
                    size.clone(),
                    Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
                        idx.iter()
                            .enumerate()
                            .map(|(d, e)| if dims.contains(&d) { IndexExpr::constant(size[d] - 1).sub(e) } else { e.clone() })
                            .collect()
                    }),
                )
            }
            AtenOp::Repeat => {
                let reps = self.ints_arg(1, "repeats")?.unwrap_or_default();
                if reps.len() < rank {
                    return malformed(format!("repeat needs at least {rank} repeats, got {reps:?}"));
                }
                let off = reps.len() - rank;
                let in_size = x.size.clone();
                let size: Vec<i64> = reps.iter().enumerate().map(|(i, r)| r * if i < off { 1 } else { in_size[i - off] }).collect();
                apply_view(
                    &x,
                    size,
                    Rc::new(move |idx: &[IndexExpr], r: &[i64]| {
                        in_size
                            .iter()
                            .enumerate()
                            .map(|(d, &n)| if n <= 1 { IndexExpr::zero() } else { idx[off + d].modulo(n, r) })
                            .collect()
                    }),
                )
            }
            _ => self.lower_as_strided(&x)?,
        };
        if tv.size != out.shape {
            return malformed(format!("{} produced shape {:?}, metadata says {:?}", op.name(), tv.size, out.shape));
        }
        Ok(tv)
    }
}

impl Ctx<'_> {
    /// as_strided: a view of the operand's storage. Its storage offset is absolute (the
    /// operand's own where none is given); the view is placed relative to the buffer the
    /// operand lives in. A view of an input is checked against the input's storage at run time
    /// (`LoopProgram::input_storage_views`); one that reaches outside a computed buffer runs
    /// through ATen, which raises eager's error.
    fn lower_as_strided(&mut self, x: &TensorValue) -> LResult<TensorValue> {
        let size = self.ints_arg(1, "size")?.unwrap_or_default();
        let stride = self.ints_arg(2, "stride")?.unwrap_or_default();
        if size.len() != stride.len() {
            return malformed("as_strided size and stride differ in rank");
        }
        if size.iter().chain(&stride).any(|&v| v < 0) {
            return malformed(format!("as_strided with a negative size or stride: {size:?} / {stride:?}"));
        }
        let operand_offset = match self.arg(0, "self") {
            Some(Arg::Node(n)) => self.graph.node(*n).meta.tensor().map_or(0, |t| t.storage_offset),
            _ => 0,
        };
        let explicit = self.int_arg(3, "storage_offset")?;
        let mut tv = self.realize(x);
        if !self.lies_as_eager_lays_it(&tv)? {
            tv = self.operand_over_own_storage()?;
        }
        let Src::View { buf, index } = &tv.src else { return malformed("realize produced no buffer") };
        let buf = *buf;
        // where the operand's first element lies in its buffer
        let zeros = vec![IndexExpr::zero(); tv.size.len()];
        let Some(first) = index(&zeros, &tv.size).as_constant() else {
            return unsupported("as_strided of a view whose first element is not at a constant position");
        };
        // the storage position of the buffer's element 0
        let buffer_start = match self.prog.buffer(buf).source {
            BufferSource::Input(i) => self.graph.node(self.graph.inputs[i]).meta.tensor().map_or(0, |t| t.storage_offset),
            BufferSource::Computed => operand_offset - first,
            BufferSource::Extern { .. } => return unsupported("as_strided of an extern result (storage offset unknown)"),
        };
        let offset = explicit.unwrap_or(operand_offset) - buffer_start;
        let l = Layout { size: size.clone(), stride: stride.clone(), offset, dtype: tv.dtype, device: tv.device };
        let reach = l.storage_numel();
        match self.prog.buffer(buf).source {
            BufferSource::Input(_) => {
                let view = InputStorageView { input: buf, size, stride, offset, storage_offset: explicit.map(|_| buffer_start) };
                if !self.prog.input_storage_views.contains(&view) {
                    self.prog.input_storage_views.push(view);
                }
            }
            _ if reach > 0 && (offset < 0 || reach > self.prog.buffer(buf).layout.storage_numel()) => {
                return unsupported(format!(
                    "as_strided view (size {:?}, stride {:?}, offset {offset}) reaches outside the {} elements of its operand's storage",
                    l.size,
                    l.stride,
                    self.prog.buffer(buf).layout.storage_numel()
                ));
            }
            _ => {}
        }
        Ok(view_of_layout(buf, &l))
    }
}

/// The ops whose result aliases their first operand's storage in eager, one result each.
fn aliases_operand(op: AtenOp) -> bool {
    use AtenOp::*;
    matches!(
        op,
        View | UnsafeView
            | Reshape
            | Permute
            | Expand
            | Unsqueeze
            | SqueezeDim
            | SqueezeDims
            | Squeeze
            | SliceTensor
            | SelectInt
            | TransposeInt
            | T
            | Alias
            | Diagonal
            | Unfold
            | AsStrided
    )
}

impl Ctx<'_> {
    /// Whether the operand (of the as_strided being lowered) sits in its buffer as its
    /// metadata says it sits in its storage: element `i` at `first + Σ stride·i`, and, in an
    /// input, at the input's own storage offset. A value lowered as an index map that is not
    /// an eager view (a flip of an input) does not: eager wrote it to a storage of its own.
    fn lies_as_eager_lays_it(&self, tv: &TensorValue) -> LResult<bool> {
        let Some(Arg::Node(n)) = self.arg(0, "self") else { return Ok(true) };
        let Some(meta) = self.graph.node(*n).meta.tensor() else { return Ok(true) };
        let Src::View { buf, index } = &tv.src else { return Ok(false) };
        if tv.size.contains(&0) {
            return Ok(true);
        }
        if meta.shape != tv.size {
            return Ok(false);
        }
        let vars: Vec<IndexExpr> =
            tv.size.iter().enumerate().map(|(d, &s)| if s == 1 { IndexExpr::zero() } else { IndexExpr::var(Var(d as u32)) }).collect();
        let zeros = vec![IndexExpr::zero(); tv.size.len()];
        let Some(first) = index(&zeros, &tv.size).as_constant() else { return Ok(false) };
        let mut want = IndexExpr::constant(first);
        for (d, v) in vars.iter().enumerate() {
            want = want.add(&v.scale(meta.stride[d]));
        }
        if index(&vars, &tv.size) != want {
            return Ok(false);
        }
        Ok(match self.prog.buffer(*buf).source {
            BufferSource::Input(i) => {
                let start = self.graph.node(self.graph.inputs[i]).meta.tensor().map_or(0, |t| t.storage_offset);
                meta.storage_offset - first == start
            }
            _ => true,
        })
    }

    /// The operand lowered again over its eager storage: the first value up its chain of
    /// aliasing views that eager computes into a storage of its own, written to a buffer laid
    /// out as eager lays it out, and the chain's views lowered over that buffer.
    fn operand_over_own_storage(&mut self) -> LResult<TensorValue> {
        let Some(Arg::Node(operand)) = self.arg(0, "self") else { return malformed("as_strided of a non-tensor") };
        let (base, chain) = self.view_chain(*operand, aliases_operand);
        let dense = self.graph.node(base).meta.tensor().is_some_and(|m| m.storage_offset == 0 && is_dense(&m.shape, &m.stride));
        if matches!(self.graph.node(base).kind, NodeKind::Placeholder) || !dense {
            return unsupported("as_strided of a value whose storage ferrocore does not lay out as eager does");
        }
        let value = self.tensor_of(base)?;
        let layout = self.eager_layout(base, &value);
        let stored = self.as_node(base, |cx| cx.realize_into(&value, layout));
        self.values[base.0 as usize] = Some(Lowered::Tensor(stored));
        self.lower_chain_again(&chain)?;
        let tv = self.tensor_of(*operand)?;
        if !self.lies_as_eager_lays_it(&tv)? {
            return unsupported("as_strided of a view ferrocore does not lay out as eager does");
        }
        Ok(tv)
    }
}
