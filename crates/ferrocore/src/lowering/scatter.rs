//! Scatters: scatter / scatter_add / scatter_reduce, index_put, masked_scatter, and the
//! backward ops that are scatters at heart (max-pool indices, embedding). A scatter is a copy of
//! the destination into a fresh buffer followed by scatter nodes whose stores go to addresses
//! computed in the body (`Store::terms`), optionally combining with what is there. Every
//! user index passes `CheckIndex`, so a bad index raises IndexError and never writes outside.

use super::layout::is_channels_last;
use super::pointwise::{broadcast_index, broadcast_shapes};
use super::*;

/// One scatter pass over `ranges`: for each index, (affine part of the destination address,
/// data-dependent terms, value).
pub(super) type ScatterFn = Rc<dyn Fn(&mut Bx, &[IndexExpr]) -> (IndexExpr, Vec<(ValueId, i64)>, ValueId)>;

pub(super) struct ScatterPass {
    pub ranges: Vec<i64>,
    pub f: ScatterFn,
    pub mode: StoreMode,
}

/// The identity of a combining scatter: what an element starts from when `self` is excluded.
fn identity(op: ReduceOp, dt: DType) -> Scalar {
    match op {
        ReduceOp::Prod => Scalar::Int(1),
        ReduceOp::Max if dt.is_float() => Scalar::Float(f64::NEG_INFINITY),
        ReduceOp::Min if dt.is_float() => Scalar::Float(f64::INFINITY),
        ReduceOp::Max => Scalar::Int(dt.int_range().0),
        ReduceOp::Min => Scalar::Int(dt.int_range().1),
        _ => Scalar::Int(0),
    }
}

fn reduce_by_name(name: &str) -> LResult<Option<ReduceOp>> {
    Ok(match name {
        "sum" | "add" => Some(ReduceOp::Sum),
        "prod" | "multiply" => Some(ReduceOp::Prod),
        "amax" => Some(ReduceOp::Max),
        "amin" => Some(ReduceOp::Min),
        "mean" => None,
        other => return malformed(format!("unknown scatter reduction '{other}'")),
    })
}

impl Ctx<'_> {
    /// Copies `init` into a fresh contiguous buffer of `dtype`, then runs `passes` over it in
    /// order. Unsupported where the graph's kernels are Triton's and a pass combines values no
    /// atomic instruction or compare-and-swap loop of Triton's combines (an int8 sum): the node
    /// then runs in ATen, not its whole graph.
    pub(super) fn scatter_into(&mut self, init: &TensorValue, dtype: DType, passes: Vec<ScatterPass>) -> LResult<TensorValue> {
        self.scatter_into_layout(init, Layout::contiguous(&init.size, dtype, init.device), passes)
    }

    /// `scatter_into` a fresh buffer of `layout` (the passes address it by its strides).
    fn scatter_into_layout(&mut self, init: &TensorValue, layout: Layout, passes: Vec<ScatterPass>) -> LResult<TensorValue> {
        let dtype = layout.dtype;
        if self.triton_kernels() {
            let on_gpu = init.device != Device::Cpu;
            if let Some(p) = passes.iter().find(|p| !crate::codegen::triton::atomic_scatter(p.mode, dtype, on_gpu)) {
                return unsupported(format!(
                    "a {:?} scatter of {} values has no atomic or compare-and-swap form in Triton",
                    p.mode,
                    dtype.torch_name()
                ));
            }
        }
        let dst = self.realize_into(init, layout.clone());
        let Src::View { buf, .. } = dst.src else { return Ok(dst) };
        for pass in passes {
            let mut body = LoopBody::default();
            {
                let mut bx = Bx { body: &mut body, ranges: pass.ranges.clone() };
                let vars: Vec<IndexExpr> = (0..pass.ranges.len()).map(|i| IndexExpr::var(Var(i as u32))).collect();
                let (index, terms, v) = (pass.f)(&mut bx, &vars);
                let v = bx.body.cast(v, dtype);
                bx.body.set_scatter_store(index, terms, v, pass.mode);
            }
            self.push_node(LoopNode {
                output: buf,
                ranges: pass.ranges,
                reduction_ranges: vec![],
                body,
                origins: vec![self.node_name()],
                template: None,
            });
        }
        Ok(view_of_layout(buf, &layout))
    }

    /// scatter.src/.value/.reduce/.value_reduce, scatter_add, scatter_reduce.two.
    pub(super) fn lower_scatter(&mut self, op: AtenOp) -> LResult<TensorValue> {
        use AtenOp as A;
        let x = self.tensor_arg(0, "self")?;
        let index = self.tensor_arg(2, "index")?;
        let out = self.out_meta()?.clone();
        let dt = out.dtype;
        if !matches!(index.dtype, DType::I64 | DType::I32) {
            return malformed(format!("scatter index must be int64, got {}", index.dtype));
        }
        let rank = x.size.len();
        let dim = norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?;
        let src: Option<TensorValue> = match self.arg(3, "src").or(self.arg(3, "value")) {
            Some(Arg::Node(n)) => Some(self.tensor_of(*n)?),
            _ => None,
        };
        let value = match self.arg(3, "value") {
            Some(Arg::Int(v)) => Some(Scalar::Int(*v)),
            Some(Arg::Float(v)) => Some(Scalar::Float(*v)),
            Some(Arg::Bool(v)) => Some(Scalar::Bool(*v)),
            _ => None,
        };
        if src.is_none() && value.is_none() {
            return malformed("scatter needs a src tensor or a value");
        }
        let (reduce, include_self) = match op {
            A::ScatterAdd => (Some(Some(ReduceOp::Sum)), true),
            A::ScatterReduceTwo => {
                let Some(Arg::Str(r)) = self.arg(4, "reduce") else { return malformed("scatter_reduce needs a reduce string") };
                (Some(reduce_by_name(r)?), self.bool_arg(5, "include_self", true)?)
            }
            A::ScatterReduce | A::ScatterValueReduce => {
                let Some(Arg::Str(r)) = self.arg(4, "reduce") else { return malformed("scatter needs a reduce string") };
                match r.as_str() {
                    "add" | "multiply" => (Some(reduce_by_name(r)?), true),
                    other => return malformed(format!("scatter reduce must be 'add' or 'multiply', got '{other}'")),
                }
            }
            _ => (None, true),
        };
        if index.size.len() != rank.max(1) && !(rank == 0 && index.size.is_empty()) {
            return malformed(format!("index rank {} differs from self rank {rank}", index.size.len()));
        }
        let sizes = if rank == 0 { vec![1] } else { x.size.clone() };
        if reduce.is_none() && rank > 0 {
            if let Some(t) = one_per_row_scatter(&x, &index, src.as_ref(), value, dim, dt) {
                return Ok(t);
            }
        }
        let dstride = contiguous_strides(&sizes);
        let n_dim = sizes[dim];
        let ranges = index.size.clone();
        // the address of index element `idx`: its own position, with `dim` replaced by its value
        let addr = {
            let (index, dstride) = (index.clone(), dstride.clone());
            Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| -> (IndexExpr, Vec<(ValueId, i64)>) {
                let raw = index.load(bx, idx);
                let i = bx.body.check_index(raw, n_dim, false);
                let mut base = IndexExpr::zero();
                for (d, e) in idx.iter().enumerate() {
                    if d != dim {
                        base = base.add(&e.scale(dstride[d]));
                    }
                }
                (base, vec![(i, dstride[dim])])
            })
        };
        let src_value = {
            let src = src.clone();
            Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| -> ValueId {
                match (&src, value) {
                    (Some(s), _) => {
                        let v = s.load(bx, idx);
                        bx.body.cast(v, dt)
                    }
                    (None, Some(c)) => bx.body.constant(c, dt),
                    (None, None) => bx.body.constant(Scalar::Int(0), dt),
                }
            })
        };
        let pass = |mode: StoreMode, val: Option<Scalar>| -> ScatterPass {
            let (addr, src_value) = (addr.clone(), src_value.clone());
            ScatterPass {
                ranges: ranges.clone(),
                mode,
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let (base, terms) = addr(bx, idx);
                    let v = match val {
                        Some(c) => bx.body.constant(c, dt),
                        None => src_value(bx, idx),
                    };
                    (base, terms, v)
                }),
            }
        };
        let xv = if rank == 0 { reshaped(&x, vec![1]) } else { x.clone() };
        let result = match reduce {
            None => self.scatter_into(&xv, dt, vec![pass(StoreMode::Set, None)])?,
            Some(Some(rop)) => {
                let mut passes = Vec::new();
                if !include_self {
                    passes.push(pass(StoreMode::Set, Some(identity(rop, dt))));
                }
                passes.push(pass(StoreMode::Combine(rop), None));
                self.scatter_into(&xv, dt, passes)?
            }
            Some(None) => {
                // mean: a sum and a count, divided where anything landed
                let mut passes = Vec::new();
                if !include_self {
                    passes.push(pass(StoreMode::Set, Some(Scalar::Int(0))));
                }
                passes.push(pass(StoreMode::Combine(ReduceOp::Sum), None));
                let sum = self.scatter_into(&xv, dt, passes)?;
                let start = Scalar::Int(include_self as i64);
                let zeros = constant_value(&sizes, dt, start, &x.device);
                let count = self.scatter_into(&zeros, dt, vec![pass(StoreMode::Combine(ReduceOp::Sum), Some(Scalar::Int(1)))])?;
                let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let s = sum.load(bx, idx);
                    let c = count.load(bx, idx);
                    let zero = bx.body.constant(Scalar::Int(0), dt);
                    let one = bx.body.constant(Scalar::Int(1), dt);
                    let none = bx.body.binary(BinaryOp::Eq, c, zero);
                    let c = bx.body.where_(none, one, c);
                    let q = if dt.is_float() { bx.body.binary(BinaryOp::TrueDiv, s, c) } else { bx.body.binary(BinaryOp::FloorDiv, s, c) };
                    bx.body.cast(q, dt)
                });
                TensorValue { size: sizes.clone(), dtype: dt, device: x.device, src: Src::Lazy { f, reads: 2, ops: 6 } }
            }
        };
        Ok(if rank == 0 { reshaped(&result, vec![]) } else { result })
    }

    /// index_put(self, indices, values, accumulate): advanced-indexing assignment. Integer
    /// indices scatter (accumulate adds); a boolean mask with a single value is a `where`.
    pub(super) fn lower_index_put(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let values = self.tensor_arg(2, "values")?;
        let accumulate = self.bool_arg(3, "accumulate", false)?;
        let out = self.out_meta()?.clone();
        let dt = out.dtype;
        let tensors = self.optional_tensor_list(1, "indices")?;
        if tensors.iter().flatten().any(|t| matches!(t.dtype, DType::Bool | DType::U8)) {
            return self.index_put_mask(&x, &tensors, &values, accumulate);
        }
        let adv = AdvancedIndex::new(&x.size, &tensors)?;
        let shape = adv.result_shape(&x.size);
        if broadcast_shapes(&[&values.size, &shape])? != shape {
            return malformed(format!("values of shape {:?} do not broadcast to {shape:?}", values.size));
        }
        let layout = self.fresh_layout(&x.size, dt, x.device);
        let dstride = layout.stride.clone();
        // In a channels-last graph a 4-D scatter over a 4-D result runs with the channels
        // innermost, the order its values and its destination lie in (nearest upsampling's
        // gradient: 0.115 ms on an H100 in NCHW order, at a stride of C elements, for 8M values)
        let nhwc_loop = is_channels_last(&x.size, &dstride) && shape.len() == 4;
        let f: ScatterFn = Rc::new(move |bx: &mut Bx, loop_idx: &[IndexExpr]| {
            let idx = if nhwc_loop {
                vec![loop_idx[0].clone(), loop_idx[3].clone(), loop_idx[1].clone(), loop_idx[2].clone()]
            } else {
                loop_idx.to_vec()
            };
            let (base, terms) = adv.address(bx, &idx, &dstride, 0);
            let vi = broadcast_index(&values.size, &idx);
            let v = values.load(bx, &vi);
            (base, terms, v)
        });
        let ranges = if nhwc_loop { vec![shape[0], shape[2], shape[3], shape[1]] } else { shape };
        let mode = if accumulate { StoreMode::Combine(ReduceOp::Sum) } else { StoreMode::Set };
        self.scatter_into_layout(&x, layout, vec![ScatterPass { ranges, f, mode }])
    }

    /// `self[mask] = values` with one boolean index tensor: the k-th selected element takes
    /// `values.flatten()[k]` (or the single value), found with a running count of the mask.
    fn index_put_mask(
        &mut self,
        x: &TensorValue,
        tensors: &[Option<TensorValue>],
        values: &TensorValue,
        accumulate: bool,
    ) -> LResult<TensorValue> {
        let masks: Vec<(usize, &TensorValue)> = tensors.iter().enumerate().filter_map(|(d, t)| t.as_ref().map(|t| (d, t))).collect();
        let [(first, mask)] = masks.as_slice() else { return unsupported("index_put with a boolean mask and other index tensors") };
        let (first, mask) = (*first, (*mask).clone());
        let k = mask.size.len();
        if first + k > x.size.len() || x.size[first..first + k] != mask.size[..] {
            return unsupported(format!("boolean mask of shape {:?} at dim {first} of {:?}", mask.size, x.size));
        }
        let mask_at = move |idx: &[IndexExpr]| idx[first..first + k].to_vec();
        // x[mask] has shape x[:first] + [selected] + x[first + k:]; values broadcast to it
        let rank = x.size.len();
        let sel_rank = rank - k + 1;
        if values.size.len() > sel_rank {
            return malformed(format!("values of shape {:?} for a boolean index_put on {:?}", values.size, x.size));
        }
        let picked: LoadFn = if values.numel() == 1 {
            let v = values.clone();
            Rc::new(move |bx: &mut Bx, _idx: &[IndexExpr]| {
                let z = vec![IndexExpr::zero(); v.size.len()];
                v.load(bx, &z)
            })
        } else {
            let count = self.running_count(&mask);
            let (vbuf, vstride, voff) = indexing::strided_base(self, values)?;
            let (vsize, vdt) = (values.size.clone(), values.dtype);
            let lead = sel_rank - vsize.len();
            let mstride = contiguous_strides(&mask.size);
            Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                let row = selected_before(bx, count, &idx[first..first + k], &mstride);
                // idx of the selection: idx[:first], row, idx[first + k:]
                let mut base = IndexExpr::constant(voff);
                let mut terms = Vec::new();
                for (j, &n) in vsize.iter().enumerate() {
                    let d = lead + j;
                    if n == 1 {
                        continue;
                    }
                    if d < first {
                        base = base.add(&idx[d].scale(vstride[j]));
                    } else if d == first {
                        terms.push((bx.body.check_index(row, n, false), vstride[j]));
                    } else {
                        base = base.add(&idx[d + k - 1].scale(vstride[j]));
                    }
                }
                bx.body.load_indirect(vbuf, base, terms, vdt)
            })
        };
        let dt = x.dtype;
        let xs = x.clone();
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let m = mask.load(bx, &mask_at(idx));
            let keep = xs.load(bx, idx);
            let v = picked(bx, idx);
            let v = bx.body.cast(v, dt);
            let new = if accumulate { bx.body.binary(BinaryOp::Add, keep, v) } else { v };
            let new = bx.body.cast(new, dt);
            bx.body.where_(m, new, keep)
        });
        Ok(TensorValue { size: x.size.clone(), dtype: dt, device: x.device, src: Src::Lazy { f, reads: 3, ops: 8 } })
    }

    /// The inclusive running count of `mask` in row-major order, as an int64 buffer.
    fn running_count(&mut self, mask: &TensorValue) -> BufferId {
        let numel = mask.numel();
        let layout = Layout::contiguous(&[numel], DType::I64, mask.device);
        let buf = self.prog.add_buffer(layout, BufferSource::Computed);
        let mut body = LoopBody::default();
        {
            let mut bx = Bx { body: &mut body, ranges: vec![numel] };
            let flat = IndexExpr::var(Var(0));
            let idx = unravel(&flat, &mask.size);
            let m = mask.load(&mut bx, &idx);
            let m = bx.body.cast(m, DType::I64);
            let s = bx.body.scan(ReduceOp::Sum, m);
            bx.body.set_store(flat, s);
        }
        self.push_node(LoopNode {
            output: buf,
            ranges: vec![],
            reduction_ranges: vec![numel],
            body,
            origins: vec![self.node_name()],
            template: None,
        });
        buf
    }

    /// For a boolean `mask` of the result's shape: at each selected index, element
    /// `values.flatten()[k]`, k counting the selected elements before it (row-major).
    fn masked_pick(&mut self, mask: &TensorValue, values: &TensorValue) -> LResult<LoadFn> {
        let count = self.running_count(mask);
        let (vbuf, vstride, voff) = indexing::strided_base(self, values)?;
        let vshape = values.size.clone();
        let vnumel = values.numel();
        let vdt = values.dtype;
        let mstride = contiguous_strides(&mask.size);
        Ok(Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            if vnumel == 0 {
                return bx.body.constant(Scalar::Int(0), vdt); // nothing can be selected
            }
            let k = selected_before(bx, count, idx, &mstride);
            let k = bx.body.check_index(k, vnumel, false);
            // the k-th element of `values` in row-major order, through its strides
            let mut terms = Vec::new();
            let mut rem = k;
            let vcontig = contiguous_strides(&vshape);
            for d in 0..vshape.len() {
                let c = bx.body.constant(Scalar::Int(vcontig[d]), DType::I64);
                let q = bx.body.binary(BinaryOp::FloorDiv, rem, c);
                rem = bx.body.binary(BinaryOp::Remainder, rem, c);
                terms.push((q, vstride[d]));
            }
            bx.body.load_indirect(vbuf, IndexExpr::constant(voff), terms, vdt)
        }))
    }

    /// masked_scatter(self, mask, source): selected elements take source's elements in order.
    pub(super) fn lower_masked_scatter(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let mask = self.tensor_arg(1, "mask")?;
        let source = self.tensor_arg(2, "source")?;
        let out = self.out_meta()?.clone();
        let shape = out.shape.clone();
        let bmask = broadcast_to(&mask, &shape);
        let bx_ = broadcast_to(&x, &shape);
        let picked = self.masked_pick(&bmask, &source)?;
        let dt = out.dtype;
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let m = bmask.load(bx, idx);
            let keep = bx_.load(bx, idx);
            let v = picked(bx, idx);
            let v = bx.body.cast(v, dt);
            bx.body.where_(m, v, keep)
        });
        Ok(TensorValue { size: shape, dtype: dt, device: out.device, src: Src::Lazy { f, reads: 3, ops: 10 } })
    }

    /// nonzero_static(x, size, fill_value): the coordinates of the first `size` nonzero elements
    /// (row-major), padded with `fill_value`. Element k of the running count writes row k; the
    /// others write a spare row past the end, which the result does not show.
    pub(super) fn lower_nonzero_static(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let size = self.int_arg(usize::MAX, "size")?.ok_or((LowerErrorKind::Malformed, "nonzero_static needs size".to_string()))?;
        let fill = self.int_arg(usize::MAX, "fill_value")?.unwrap_or(-1);
        let out = self.out_meta()?.clone();
        let ndim = x.size.len() as i64;
        if size < 0 || out.shape != [size, ndim] {
            return malformed(format!("nonzero_static result {:?} for size {size}", out.shape));
        }
        let xs = x.clone();
        let nonzero = TensorValue::lazy(x.size.clone(), DType::Bool, x.device, 1, 1, move |bx, idx| {
            let v = xs.load(bx, idx);
            bx.body.cast(v, DType::Bool)
        });
        let count = self.running_count(&nonzero);
        let mstride = contiguous_strides(&x.size);
        let passes = (0..ndim as usize)
            .map(|d| {
                let (nz, mstride) = (nonzero.clone(), mstride.clone());
                ScatterPass {
                    ranges: x.size.clone(),
                    mode: StoreMode::Set,
                    f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                        let k = selected_before(bx, count, idx, &mstride);
                        let on = nz.load(bx, idx);
                        let lim = bx.body.constant(Scalar::Int(size), DType::I64);
                        let fits = bx.body.binary(BinaryOp::Lt, k, lim);
                        let take = bx.body.binary(BinaryOp::LogicalAnd, on, fits);
                        // a running count is never negative; clamped, the store is provably inside
                        let k = super::indexing::clamp_index(bx, k, size);
                        let row = bx.body.where_(take, k, lim);
                        let v = bx.body.index(idx[d].clone(), DType::I64);
                        (IndexExpr::constant(d as i64), vec![(row, ndim)], v)
                    }) as ScatterFn,
                }
            })
            .collect();
        let init = constant_value(&[size + 1, ndim], DType::I64, Scalar::Int(fill), &x.device);
        let full = self.scatter_into(&init, DType::I64, passes)?;
        let Src::View { buf, .. } = full.src else { return malformed("scatter produced no buffer") };
        let layout = Layout::contiguous(&[size, ndim], DType::I64, x.device);
        Ok(view_of_layout(buf, &layout))
    }

    /// max_pool2d/3d_with_indices_backward: gradients added at the recorded argmax of each window.
    pub(super) fn lower_max_pool_backward(&mut self, op: AtenOp) -> LResult<TensorValue> {
        if let Some(gathered) = self.max_pool_backward_gather(op)? {
            return Ok(gathered);
        }
        let grad = self.tensor_arg(0, "grad_output")?;
        let x = self.tensor_arg(1, "self")?;
        let indices = self.tensor_arg(7, "indices")?;
        let out = self.out_meta()?.clone();
        let rank = x.size.len();
        let nd = if op == AtenOp::MaxPool3dWithIndicesBackward { 3 } else { 2 };
        if !(nd + 1..=nd + 2).contains(&rank) || grad.size.len() != rank || indices.size != grad.size {
            return malformed(format!("max_pool{nd}d backward takes tensors of rank {} or {} with matching shapes", nd + 1, nd + 2));
        }
        let dt = out.dtype;
        // indices count positions within one plane (volume) of the input
        let plane: i64 = x.size[rank - nd..].iter().product();
        let dstride = contiguous_strides(&x.size);
        let granges = grad.size.clone();
        let f: ScatterFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let raw = indices.load(bx, idx);
            let i = bx.body.check_index(raw, plane, false);
            let mut base = IndexExpr::zero();
            for d in 0..rank - nd {
                base = base.add(&idx[d].scale(dstride[d]));
            }
            let g = grad.load(bx, idx);
            (base, vec![(i, 1)], g)
        });
        let zeros = constant_value(&x.size, dt, Scalar::Int(0), &x.device);
        self.scatter_into(&zeros, dt, vec![ScatterPass { ranges: granges, f, mode: StoreMode::Combine(ReduceOp::Sum) }])
    }

    /// histc(self, bins, min, max): counts of the elements in `bins` equal-width bins over
    /// [min, max], in self's dtype; elements outside (and NaN) are not counted. The bin of x is
    /// trunc((x - min) * bins / (max - min)) in self's type (integer arithmetic for integer
    /// inputs, as ATen's CUDA kernel), x == max counting in the last bin; ATen's CPU kernel
    /// computes the same expression. A scatter-add of ones. `min == max` (the data's own range)
    /// is not lowered.
    pub(super) fn lower_histc(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let bins = self.int_arg(1, "bins")?.unwrap_or(100);
        let lo = self.float_arg(2, "min")?.unwrap_or(0.0);
        let hi = self.float_arg(3, "max")?.unwrap_or(0.0);
        if bins <= 0 {
            return malformed(format!("histc needs a positive number of bins, got {bins}"));
        }
        let dt = out.dtype;
        let int = !dt.is_float();
        let (lo, hi) = if int { (lo.trunc(), hi.trunc()) } else { (lo, hi) };
        if lo.partial_cmp(&hi) != Some(std::cmp::Ordering::Less) {
            return unsupported("histc over the data's own range (min == max)");
        }
        let ct = if int { DType::I64 } else { dt.compute() };
        let x = if x.size.is_empty() { reshaped(&x, vec![1]) } else { x };
        let ranges = x.size.clone();
        let f: ScatterFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let v = x.load(bx, idx);
            let v = bx.body.cast(v, ct);
            let scalar = |bx: &mut Bx, f: f64| bx.body.constant(if int { Scalar::Int(f as i64) } else { Scalar::Float(f) }, ct);
            let (lo_v, hi_v, n_v) = (scalar(bx, lo), scalar(bx, hi), scalar(bx, bins as f64));
            let ge = bx.body.binary(BinaryOp::Ge, v, lo_v);
            let le = bx.body.binary(BinaryOp::Le, v, hi_v);
            let inside = bx.body.binary(BinaryOp::LogicalAnd, ge, le);
            let d = bx.body.binary(BinaryOp::Sub, v, lo_v);
            let scaled = bx.body.binary(BinaryOp::Mul, d, n_v);
            let width = bx.body.binary(BinaryOp::Sub, hi_v, lo_v);
            let pos = bx.body.binary(if int { BinaryOp::TruncDiv } else { BinaryOp::TrueDiv }, scaled, width);
            // outside elements add 0 to bin 0, so no NaN or infinity is converted to an integer
            let zero = bx.body.constant(Scalar::Int(0), ct);
            let pos = bx.body.where_(inside, pos, zero);
            let pos = bx.body.cast(pos, DType::I64);
            // a position in range by construction; clamped, the store is provably inside
            let pos = super::indexing::clamp_index(bx, pos, bins - 1);
            let one = bx.body.constant(Scalar::Int(1), dt);
            let nothing = bx.body.constant(Scalar::Int(0), dt);
            let count = bx.body.where_(inside, one, nothing);
            (IndexExpr::zero(), vec![(pos, 1)], count)
        });
        let zeros = constant_value(&[bins], dt, Scalar::Int(0), &out.device);
        self.scatter_into(&zeros, dt, vec![ScatterPass { ranges, f, mode: StoreMode::Combine(ReduceOp::Sum) }])
    }

    /// embedding_dense_backward: rows of the gradient added into the rows their indices name.
    pub(super) fn lower_embedding_backward(&mut self) -> LResult<TensorValue> {
        let grad = self.tensor_arg(0, "grad_output")?;
        let indices = self.tensor_arg(1, "indices")?;
        let num_weights = self.int_arg(2, "num_weights")?.ok_or((LowerErrorKind::Malformed, "num_weights missing".to_string()))?;
        let padding_idx = self.int_arg(3, "padding_idx")?.unwrap_or(-1);
        let by_freq = self.bool_arg(4, "scale_grad_by_freq", false)?;
        let out = self.out_meta()?.clone();
        let dt = out.dtype;
        let k = indices.size.len();
        if grad.size.len() != k + 1 {
            return malformed("embedding backward: grad_output must have one more dim than indices");
        }
        let width = grad.size[k];
        let granges = grad.size.clone();
        let device = grad.device;
        // per-row counts, for scale_grad_by_freq
        let counts = if by_freq {
            let ind = indices.clone();
            let f: ScatterFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                let raw = ind.load(bx, idx);
                let i = bx.body.check_index(raw, num_weights, false);
                let one = bx.body.constant(Scalar::Int(1), DType::I64);
                (IndexExpr::zero(), vec![(i, 1)], one)
            });
            let zeros = constant_value(&[num_weights], DType::I64, Scalar::Int(0), &device);
            Some(self.scatter_into(
                &zeros,
                DType::I64,
                vec![ScatterPass { ranges: indices.size.clone(), f, mode: StoreMode::Combine(ReduceOp::Sum) }],
            )?)
        } else {
            None
        };
        let counts = counts.and_then(|c| c.strided());
        let f: ScatterFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let raw = indices.load(bx, &idx[..k]);
            let i = bx.body.check_index(raw, num_weights, false);
            let mut g = grad.load(bx, idx);
            g = bx.body.cast(g, dt.compute());
            if let Some((cbuf, _, _)) = &counts {
                let c = bx.body.load_indirect(*cbuf, IndexExpr::zero(), vec![(i, 1)], DType::I64);
                let c = bx.body.cast(c, dt.compute());
                g = bx.body.binary(BinaryOp::TrueDiv, g, c);
            }
            if padding_idx >= 0 {
                let p = bx.body.constant(Scalar::Int(padding_idx), DType::I64);
                let is_pad = bx.body.binary(BinaryOp::Eq, i, p);
                let zero = bx.body.constant(Scalar::Int(0), dt.compute());
                g = bx.body.where_(is_pad, zero, g);
            }
            (idx[k].clone(), vec![(i, width)], g)
        });
        let zeros = constant_value(&[num_weights, width], dt, Scalar::Int(0), &device);
        self.scatter_into(&zeros, dt, vec![ScatterPass { ranges: granges, f, mode: StoreMode::Combine(ReduceOp::Sum) }])
    }

    /// A list argument of optional tensors (index / index_put indices).
    pub(super) fn optional_tensor_list(&self, i: usize, key: &str) -> LResult<Vec<Option<TensorValue>>> {
        let Some(Arg::List(items)) = self.arg(i, key) else { return malformed(format!("{key} must be a list of tensors")) };
        items
            .iter()
            .map(|it| match it {
                Arg::Node(n) => Ok(Some(self.tensor_of(*n)?)),
                Arg::None => Ok(None),
                other => malformed(format!("{key} entries must be tensors or None, got {other:?}")),
            })
            .collect()
    }
}

/// How many elements the mask selects before the one at `idx` (clamped at 0 where none is
/// selected yet: the value is unused there), from the running count `count`.
fn selected_before(bx: &mut Bx, count: BufferId, idx: &[IndexExpr], mstride: &[i64]) -> ValueId {
    let mut flat = IndexExpr::zero();
    for (e, s) in idx.iter().zip(mstride) {
        flat = flat.add(&e.scale(*s));
    }
    let c = bx.body.load(count, flat, DType::I64);
    let one = bx.body.constant(Scalar::Int(1), DType::I64);
    let k = bx.body.binary(BinaryOp::Sub, c, one);
    indexing::clamp_index(bx, k, i64::MAX)
}

/// Row-major coordinates of flat index `flat` in `shape`.
pub(super) fn unravel(flat: &IndexExpr, shape: &[i64]) -> Vec<IndexExpr> {
    let strides = contiguous_strides(shape);
    let numel: i64 = shape.iter().product();
    if numel == 0 {
        // no element to address (a size-0 dim would be a modulo by 0)
        return vec![IndexExpr::zero(); shape.len()];
    }
    let ranges = [numel];
    shape.iter().zip(&strides).map(|(&n, &s)| flat.floordiv(s, &ranges).modulo(n, &ranges)).collect()
}

/// A scatter that writes one element per row along `dim` (the index has size 1 there and
/// covers every other dim) as a pointwise select: `out[.., j, ..] = j == index[.., 0, ..] ? src :
/// self`. No copy of `self` is materialized (a cross entropy's backward scatters -1 into a zero
/// tensor of the logits' size, then multiplies it). Out-of-range indices still raise.
fn one_per_row_scatter(
    x: &TensorValue,
    index: &TensorValue,
    src: Option<&TensorValue>,
    value: Option<Scalar>,
    dim: usize,
    dt: DType,
) -> Option<TensorValue> {
    let covers = index.size.iter().zip(&x.size).enumerate().all(|(d, (&i, &n))| if d == dim { i == 1 } else { i == n });
    if !covers || x.size[dim] == 0 {
        return None;
    }
    let parts = [Some(x), Some(index), src];
    let reads = parts.iter().flatten().map(|t| t.cost().0).sum();
    let ops = 3 + parts.iter().flatten().map(|t| t.cost().1).sum::<usize>();
    let (x, index, src) = (x.clone(), index.clone(), src.cloned());
    let n_dim = x.size[dim];
    Some(TensorValue::lazy(x.size.clone(), dt, x.device, reads, ops, move |bx, idx| {
        let mut row = idx.to_vec();
        row[dim] = IndexExpr::zero();
        let raw = index.load(bx, &row);
        let target = bx.body.check_index(raw, n_dim, false);
        let here = bx.body.index(idx[dim].clone(), DType::I64);
        let hit = bx.body.binary(BinaryOp::Eq, target, here);
        let written = match (&src, value) {
            (Some(s), _) => {
                let v = s.load(bx, &row);
                bx.body.cast(v, dt)
            }
            (None, Some(c)) => bx.body.constant(c, dt),
            (None, None) => bx.body.constant(Scalar::Int(0), dt),
        };
        let kept = x.load(bx, idx);
        let kept = bx.body.cast(kept, dt);
        bx.body.where_(hit, written, kept)
    }))
}

/// A tensor filled with `value`.
pub(super) fn constant_value(size: &[i64], dt: DType, value: Scalar, device: &Device) -> TensorValue {
    TensorValue::lazy(size.to_vec(), dt, *device, 0, 1, move |bx, _idx| bx.body.constant(value, dt))
}

/// The same elements under another shape with equal numel (0-d <-> [1]).
fn reshaped(t: &TensorValue, size: Vec<i64>) -> TensorValue {
    let inner = t.clone();
    let rank = t.size.len();
    TensorValue::lazy(size, t.dtype, t.device, 1, 0, move |bx, _idx| inner.load(bx, &vec![IndexExpr::zero(); rank]))
}

/// `t` read at the trailing-aligned broadcast of an index of `shape`.
fn broadcast_to(t: &TensorValue, shape: &[i64]) -> TensorValue {
    let inner = t.clone();
    TensorValue::lazy(shape.to_vec(), t.dtype, t.device, 1, 0, move |bx, idx| inner.load(bx, &broadcast_index(&inner.size, idx)))
}

/// Advanced indexing with integer index tensors: the indexed dims are replaced by the broadcast
/// shape of the index tensors, placed where the first indexed dim was when the indexed dims are
/// adjacent, else in front (numpy's rule).
#[derive(Clone)]
pub(super) struct AdvancedIndex {
    tensors: Vec<Option<TensorValue>>,
    indexed: Vec<usize>,
    rest: Vec<usize>,
    /// Number of unindexed dims before the broadcast block in the result.
    before: usize,
    b: Vec<i64>,
    sizes: Vec<i64>,
}

impl AdvancedIndex {
    pub(super) fn new(sizes: &[i64], tensors: &[Option<TensorValue>]) -> LResult<AdvancedIndex> {
        let rank = sizes.len();
        let indexed: Vec<usize> = (0..tensors.len()).filter(|&d| tensors[d].is_some()).collect();
        if indexed.is_empty() || tensors.len() > rank {
            return unsupported("indexing without index tensors");
        }
        for t in tensors.iter().flatten() {
            if !matches!(t.dtype, DType::I64 | DType::I32) {
                return unsupported(format!("{} indices", t.dtype)); // bool masks have data-dependent shapes
            }
        }
        let shapes: Vec<&[i64]> = tensors.iter().flatten().map(|t| t.size.as_slice()).collect();
        let b = broadcast_shapes(&shapes)?;
        let adjacent = indexed.windows(2).all(|w| w[1] == w[0] + 1);
        let first = if adjacent { indexed[0] } else { 0 };
        let rest: Vec<usize> = (0..rank).filter(|d| !indexed.contains(d)).collect();
        let before = rest.iter().filter(|&&d| d < first).count();
        Ok(AdvancedIndex { tensors: tensors.to_vec(), indexed, rest, before, b, sizes: sizes.to_vec() })
    }

    pub(super) fn result_shape(&self, sizes: &[i64]) -> Vec<i64> {
        let mut s: Vec<i64> = self.rest[..self.before].iter().map(|&d| sizes[d]).collect();
        s.extend(&self.b);
        s.extend(self.rest[self.before..].iter().map(|&d| sizes[d]));
        s
    }

    /// Per source dim, its position as an index expression in the result's loop variables,
    /// where every index tensor computes one that lies in its dim (nearest upsampling's
    /// `(arange(H_out) * 0.5).to(int64)`, `i // 2`): the gather is then a plain read of the
    /// source at those positions, which a lazy source computes there (nothing realized, nothing
    /// checked). Evaluated on a scratch body over `shape`, the result's.
    pub(super) fn exact_positions(&self, shape: &[i64]) -> Option<Vec<IndexExpr>> {
        let mut body = LoopBody::default();
        let mut bx = Bx { body: &mut body, ranges: shape.to_vec() };
        let idx: Vec<IndexExpr> = (0..shape.len()).map(|i| IndexExpr::var(Var(i as u32))).collect();
        let nb = self.b.len();
        let mut at: Vec<Option<ValueId>> = vec![None; self.sizes.len()];
        for &d in &self.indexed {
            let t = self.tensors[d].as_ref()?;
            at[d] = Some(t.load(&mut bx, &broadcast_index(&t.size, &idx[self.before..self.before + nb])));
        }
        let positions = body.positions(shape);
        let mut out = Vec::with_capacity(self.sizes.len());
        for (d, &size) in self.sizes.iter().enumerate() {
            let e = match at[d] {
                Some(v) => positions[v.0 as usize].clone().filter(|e| {
                    let (lo, hi) = e.bounds(shape);
                    lo >= 0 && hi < size as i128
                })?,
                None => {
                    let pos = self.rest.iter().position(|&r| r == d)?;
                    idx[if pos < self.before { pos } else { pos + nb }].clone()
                }
            };
            out.push(e);
        }
        Some(out)
    }

    /// The address in a tensor with `stride`/`offset` of result element `idx`: the affine part
    /// and one checked index term per index tensor (negative indices wrap).
    pub(super) fn address(&self, bx: &mut Bx, idx: &[IndexExpr], stride: &[i64], offset: i64) -> (IndexExpr, Vec<(ValueId, i64)>) {
        let nb = self.b.len();
        let bidx = &idx[self.before..self.before + nb];
        let mut base = IndexExpr::constant(offset);
        for (pos, &d) in self.rest.iter().enumerate() {
            let o = if pos < self.before { pos } else { pos + nb };
            base = base.add(&idx[o].scale(stride[d]));
        }
        let mut terms = Vec::new();
        for &d in &self.indexed {
            if let Some(t) = &self.tensors[d] {
                let ti = broadcast_index(&t.size, bidx);
                let v = t.load(bx, &ti);
                terms.push((bx.body.check_index(v, self.sizes[d], true), stride[d]));
            }
        }
        (base, terms)
    }
}
