//! 2-D and 3-D pooling as window reductions: each output element reduces over its window read
//! through clamped indirect loads, with out-of-window positions masked to the reduction's
//! identity. avg_pool, max_pool_with_indices (values and argmax indices, fused in one kernel),
//! adaptive avg/max pool (per-output window bounds). The backward ops of avg and adaptive-avg
//! pooling are scatter-adds of each output gradient over its window.

use super::indexing::{and_in_range, clamp_index, strided_base};
use super::scatter::{constant_value, ScatterFn, ScatterPass};
use super::*;

#[derive(Clone, Copy, PartialEq)]
enum PoolKind {
    Avg {
        count_include_pad: bool,
        divisor: Option<i64>,
    },
    Max,
    Adaptive {
        max: bool,
    },
    /// Windows start at pseudo-random offsets derived from per-plane samples (max pooling).
    Fractional,
}

/// One spatial dim of a pooling window.
#[derive(Clone)]
struct Window {
    kernel: i64,
    stride: i64,
    pad: i64,
    dilation: i64,
    input: i64,
    output: i64,
}

/// The pooling geometry of a node: kind, spatial rank and one window per spatial dim.
struct Pool {
    kind: PoolKind,
    nd: usize,
    wins: Vec<Window>,
    /// fractional pooling: the [N, C, nd] samples and, per spatial dim, which sample it uses
    samples: Option<(TensorValue, Vec<usize>)>,
}

impl Pool {
    /// For output spatial indices `o` and window offsets `k`: (in-window test, clamped input
    /// positions per dim).
    fn taps(&self, bx: &mut Bx, lead: &[IndexExpr], o: &[IndexExpr], k: &[IndexExpr]) -> (ValueId, Vec<ValueId>) {
        let mut valid: Option<ValueId> = None;
        let mut positions = Vec::new();
        for (d, wn) in self.wins.iter().enumerate() {
            let (start, end) = match &self.samples {
                Some((samples, slots)) => fractional_start(bx, samples, slots[d], lead, wn, &o[d]),
                None => window_bounds(bx, self.kind, wn, &o[d]),
            };
            let i = bx.body.index(k[d].scale(wn.dilation), DType::I64);
            let pos = bx.body.binary(BinaryOp::Add, start, i);
            valid = Some(and_in_range(bx, valid, pos, end));
            positions.push(clamp_index(bx, pos, wn.input - 1));
        }
        let valid = valid.unwrap_or_else(|| bx.body.constant(Scalar::Bool(true), DType::Bool));
        (valid, positions)
    }

    fn kernel(&self) -> Vec<i64> {
        self.wins.iter().map(|w| w.kernel).collect()
    }
}

impl Ctx<'_> {
    /// Reads the pooling arguments of `op` for an input of `in_size` and output of `out_size`.
    fn pool_geometry(&self, op: AtenOp, in_size: &[i64], out_size: &[i64], arg0: usize) -> LResult<Pool> {
        use AtenOp as A;
        let nd = match op {
            A::AvgPool3d
            | A::MaxPool3dWithIndices
            | A::FractionalMaxPool3d
            | A::AdaptiveAvgPool3d
            | A::AdaptiveMaxPool3d
            | A::AvgPool3dBackward
            | A::AdaptiveAvgPool3dBackward
            | A::MaxPool3dWithIndicesBackward => 3,
            // the prim pools as many trailing dims as its kernel has
            A::MaxPoolWithOffsets => self.ints_arg(arg0, "kernel_size")?.map_or(2, |k| k.len()),
            _ => 2,
        };
        let rank = in_size.len();
        if rank < nd + 1 || rank > nd + 2 || out_size.len() != rank {
            return malformed(format!("{nd}-D pooling needs an input of rank {} or {}", nd + 1, nd + 2));
        }
        let spread = |v: Option<Vec<i64>>, d: i64| -> LResult<Vec<i64>> {
            match v {
                Some(v) if v.len() == nd => Ok(v),
                Some(v) if v.len() == 1 => Ok(vec![v[0]; nd]),
                Some(v) if v.is_empty() => Ok(vec![d; nd]),
                None => Ok(vec![d; nd]),
                Some(v) => malformed(format!("pooling parameter {v:?} for {nd} spatial dims")),
            }
        };
        let adaptive = matches!(
            op,
            A::AdaptiveAvgPool2d
                | A::AdaptiveAvgPool3d
                | A::AdaptiveMaxPool2d
                | A::AdaptiveMaxPool3d
                | A::AdaptiveAvgPool2dBackward
                | A::AdaptiveAvgPool3dBackward
        );
        let fractional = matches!(op, A::FractionalMaxPool2d | A::FractionalMaxPool3d);
        let (kind, kernel, stride, pad, dil) = if fractional {
            (PoolKind::Fractional, spread(self.ints_arg(1, "kernel_size")?, 1)?, vec![1; nd], vec![0; nd], vec![1; nd])
        } else if adaptive {
            let max = matches!(op, A::AdaptiveMaxPool2d | A::AdaptiveMaxPool3d);
            (PoolKind::Adaptive { max }, vec![0; nd], vec![1; nd], vec![0; nd], vec![1; nd])
        } else {
            let k = spread(self.ints_arg(arg0, "kernel_size")?, 1)?;
            let s = match self.ints_arg(arg0 + 1, "stride")? {
                Some(s) if !s.is_empty() => spread(Some(s), 1)?,
                _ => k.clone(),
            };
            let p = spread(self.ints_arg(arg0 + 2, "padding")?, 0)?;
            if matches!(op, A::AvgPool2d | A::AvgPool3d | A::AvgPool2dBackward | A::AvgPool3dBackward) {
                let cip = self.bool_arg(arg0 + 4, "count_include_pad", true)?;
                let div = self.int_arg(arg0 + 5, "divisor_override")?;
                (PoolKind::Avg { count_include_pad: cip, divisor: div }, k, s, p, vec![1; nd])
            } else {
                (PoolKind::Max, k, s, p, spread(self.ints_arg(arg0 + 3, "dilation")?, 1)?)
            }
        };
        let sp = rank - nd;
        if in_size[sp..].iter().chain(&out_size[sp..]).any(|&s| s == 0) {
            return unsupported("pooling over an empty plane");
        }
        let wins = (0..nd)
            .map(|d| {
                let (input, output) = (in_size[sp + d], out_size[sp + d]);
                Window {
                    kernel: if adaptive { adaptive_max_window(input, output) } else { kernel[d] },
                    stride: stride[d],
                    pad: pad[d],
                    dilation: dil[d],
                    input,
                    output,
                }
            })
            .collect();
        let samples = if fractional {
            let s = self.tensor_arg(3, "random_samples")?;
            if s.size.len() != 3 || s.size[2] != nd as i64 {
                return malformed(format!("random_samples of shape {:?}", s.size));
            }
            // ATen's sample order: 2-D (W, H), 3-D (T, H, W)
            let slots = if nd == 2 { vec![1, 0] } else { vec![0, 1, 2] };
            Some((s, slots))
        } else {
            None
        };
        Ok(Pool { kind, nd, wins, samples })
    }

    /// avg_pool2d/3d, max_pool2d/3d_with_indices, _adaptive_avg_pool2d/3d, adaptive_max_pool2d/3d.
    pub(super) fn lower_pool(&mut self, op: AtenOp) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "self")?;
        let metas = self.pool_output_metas()?;
        let Some(out) = metas.first().cloned() else { return malformed("pooling without output metadata") };
        let pool = self.pool_geometry(op, &x.size, &out.shape, 1)?;
        if x.dtype == DType::Bool {
            return unsupported("pooling of a bool tensor");
        }
        let (buf, in_strides, in_offset) = strided_base(self, &x)?;
        // small fixed windows are unrolled: a pointwise kernel over the outputs, one load per tap,
        // so lanes run along the output (channels in a channels-last graph) instead of along
        // a window of a few taps; larger, adaptive and fractional windows are reductions over
        // the window dims, appended after the output dims
        let taps: i64 = pool.kernel().iter().product();
        let unroll = taps <= MAX_UNROLLED_TAPS && matches!(pool.kind, PoolKind::Max | PoolKind::Avg { .. });
        let kernel = PoolKernel {
            pool: &pool,
            buf,
            in_strides,
            in_offset,
            in_size: x.size.clone(),
            in_dtype: x.dtype,
            acc: out.dtype.compute(),
            out_shape: out.shape.clone(),
            out_dtype: out.dtype,
            index_dtype: metas.get(1).map_or(DType::I64, |m| m.dtype),
            device: x.device,
            unroll,
        };
        match pool.kind {
            PoolKind::Max | PoolKind::Adaptive { max: true } | PoolKind::Fractional => {
                let arg = if op == AtenOp::MaxPoolWithOffsets { ArgIndex::Window } else { ArgIndex::Plane };
                let vals = kernel.lower(self, Reduce::Max);
                let idx = kernel.lower(self, Reduce::ArgMax(arg));
                let v = self.cast_to(vals, &out);
                let i = match metas.get(1) {
                    Some(im) => self.cast_to(idx, im),
                    None => idx,
                };
                Ok(Lowered::Tuple(vec![Some(Lowered::Tensor(v)), Some(Lowered::Tensor(i))]))
            }
            _ => {
                let r = kernel.lower(self, Reduce::Mean);
                Ok(Lowered::Tensor(self.cast_to(r, &out)))
            }
        }
    }

    /// A pool's output metadata: the values, then (max pools) the indices.
    fn pool_output_metas(&self) -> LResult<Vec<TensorMeta>> {
        Ok(match self.meta() {
            Meta::Tensor(t) => vec![t.clone()],
            Meta::Tuple(items) => items.iter().filter_map(|m| m.as_ref().and_then(|m| m.tensor().cloned())).collect(),
            _ => return malformed("pooling without tensor metadata"),
        })
    }

    /// avg_pool2d_backward / _adaptive_avg_pool2d_backward: each output gradient, divided as the
    /// forward divided its window, is added to every input position of the window.
    pub(super) fn lower_avg_pool_backward(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let grad = self.tensor_arg(0, "grad_output")?;
        let x = self.tensor_arg(1, "self")?;
        let out = self.out_meta()?.clone();
        let pool = self.pool_geometry(op, &x.size, &grad.size, 2)?;
        let rank = x.size.len();
        let sp = rank - pool.nd;
        let dt = out.dtype;
        let acc = dt.compute();
        let dstride = contiguous_strides(&x.size);
        let ranges: Vec<i64> = grad.size.iter().copied().chain(pool.kernel()).collect();
        let f: ScatterFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let (o, k) = idx.split_at(rank);
            let (valid, positions) = pool.taps(bx, &o[..sp], &o[sp..], k);
            let mut base = IndexExpr::zero();
            for d in 0..sp {
                base = base.add(&o[d].scale(dstride[d]));
            }
            let terms = positions.iter().enumerate().map(|(j, p)| (*p, dstride[sp + j])).collect();
            let g = grad.load(bx, o);
            let g = bx.body.cast(g, acc);
            let count = divisor(bx, pool.kind, &pool.wins, &o[sp..]);
            let c = bx.body.cast(count, acc);
            let share = bx.body.binary(BinaryOp::TrueDiv, g, c);
            // taps outside the window add zero at a clamped (harmless) address
            let zero = bx.body.constant(Scalar::Int(0), acc);
            let v = bx.body.where_(valid, share, zero);
            (base, terms, v)
        });
        let zeros = constant_value(&x.size, dt, Scalar::Int(0), &x.device);
        self.scatter_into(&zeros, dt, vec![ScatterPass { ranges, f, mode: StoreMode::Combine(ReduceOp::Sum) }])
    }

    /// max_pool2d/3d_with_indices_backward as a gather, as ATen's CUDA kernel computes it: each
    /// input element sums, in float, the gradients of the few windows that cover it and chose
    /// it. No atomics and no zeroed buffer; the result is a lazy value in the input's layout that
    /// fuses into its readers (a batch norm's backward). None where the windows overlap too much
    /// (dilation, more than `MAX_COVERING` covering windows): the scatter form then.
    pub(super) fn max_pool_backward_gather(&mut self, op: AtenOp) -> LResult<Option<TensorValue>> {
        let grad = self.tensor_arg(0, "grad_output")?;
        let x = self.tensor_arg(1, "self")?;
        let indices = self.tensor_arg(7, "indices")?;
        let out = self.out_meta()?.clone();
        if indices.size != grad.size || grad.size.len() != x.size.len() {
            return Ok(None);
        }
        let pool = self.pool_geometry(op, &x.size, &grad.size, 2)?;
        // covering windows per dim: outputs o with o·s - p <= i <= o·s - p + k - 1
        let cover: Vec<i64> = pool.wins.iter().map(|w| (w.kernel - 1) / w.stride + 1).collect();
        if pool.wins.iter().any(|w| w.dilation != 1) || cover.iter().product::<i64>() > MAX_COVERING {
            return Ok(None);
        }
        let rank = x.size.len();
        let sp = rank - pool.nd;
        let (dt, acc) = (out.dtype, out.dtype.compute());
        let wins = pool.wins.clone();
        // a training graph's indices come from the saved window offsets: compare those with
        // this element's offset in each covering window (small integers, no index arithmetic)
        let offsets = self.window_offsets_behind(7, &wins)?;
        let reads = 2 * cover.iter().product::<i64>() as usize;
        Ok(Some(TensorValue::lazy(x.size.clone(), dt, x.device, reads, 4 * reads, move |bx, idx| {
            let r = bx.ranges.clone();
            // window positions and taps fit in 32 bits whatever the tensor's size
            let small = DType::I32;
            // per dim, the covering outputs in ascending order: (in-range and covering, the
            // output index wrapped into range so that a load stays in bounds, this element's
            // tap in that window)
            let mut per_dim: Vec<Vec<(ValueId, IndexExpr, IndexExpr)>> = Vec::new();
            for (d, w) in wins.iter().enumerate() {
                let i = &idx[sp + d];
                let last = i.add_const(w.pad).floordiv(w.stride, &r);
                let mut cands = Vec::new();
                for j in (0..cover[d]).rev() {
                    let o = last.add_const(-j);
                    let ov = bx.body.index(o.clone(), small);
                    let end = bx.body.constant(Scalar::Int(w.output), small);
                    let valid = and_in_range(bx, None, ov, end);
                    // the tap i - (o·s - p) <= k - 1
                    let tap = i.add_const(w.pad).sub(&o.scale(w.stride));
                    let reach = bx.body.index(tap.clone(), small);
                    let kmax = bx.body.constant(Scalar::Int(w.kernel - 1), small);
                    let inside = bx.body.binary(BinaryOp::Le, reach, kmax);
                    let valid = bx.body.binary(BinaryOp::LogicalAnd, valid, inside);
                    cands.push((valid, o.modulo(w.output, &r), tap));
                }
                per_dim.push(cands);
            }
            // this element's index within its plane (volume), as the indices count
            let mut flat = IndexExpr::zero();
            for d in 0..wins.len() {
                flat = flat.add(&idx[sp + d].scale(wins[d + 1..].iter().map(|w| w.input).product()));
            }
            let zero = bx.body.constant(Scalar::Int(0), acc);
            let mut sum = zero;
            // every combination of covering outputs, the last dim fastest (ATen's order)
            for pick in row_major(&cover) {
                let mut at: Vec<IndexExpr> = idx[..sp].to_vec();
                let mut valid: Option<ValueId> = None;
                // this element's offset in the picked window (taps row-major over the kernel)
                let mut offset = IndexExpr::zero();
                for (d, &c) in pick.iter().enumerate() {
                    let (v, o, tap) = &per_dim[d][c as usize];
                    at.push(o.clone());
                    offset = offset.add(&tap.scale(wins[d + 1..].iter().map(|w| w.kernel).product()));
                    valid = Some(match valid {
                        Some(u) => bx.body.binary(BinaryOp::LogicalAnd, u, *v),
                        None => *v,
                    });
                }
                // the picked window chose this element: its offset is this element's tap there,
                // or its index is this element's flat index
                let (chosen, mine) = match &offsets {
                    Some(offsets) => (offsets.load(bx, &at), bx.body.index(offset, small)),
                    None => (indices.load(bx, &at), bx.body.index(flat.clone(), DType::I64)),
                };
                let chosen = bx.body.cast(chosen, bx.body.dtype(mine));
                let hit = bx.body.binary(BinaryOp::Eq, chosen, mine);
                let hit = match valid {
                    Some(v) => bx.body.binary(BinaryOp::LogicalAnd, v, hit),
                    None => hit,
                };
                let g = grad.load(bx, &at);
                let g = bx.body.cast(g, acc);
                let g = bx.body.where_(hit, g, zero);
                sum = bx.body.binary(BinaryOp::Add, sum, g);
            }
            bx.body.cast(sum, dt)
        })))
    }

    /// The int8 window offsets argument `i` is computed from (by
    /// `_low_memory_max_pool_offsets_to_indices` with the windows `wins`), or None when it is an
    /// index tensor of another origin.
    fn window_offsets_behind(&self, i: usize, wins: &[Window]) -> LResult<Option<TensorValue>> {
        let Some(Arg::Node(n)) = self.arg(i, "indices") else { return Ok(None) };
        let node = self.graph.node(*n);
        let NodeKind::Call { target: Target::Aten(AtenOp::MaxPoolOffsetsToIndices), .. } = &node.kind else { return Ok(None) };
        let ints = |j: usize| match node.arg(j, "") {
            Some(Arg::List(items)) => items.iter().map(|a| if let Arg::Int(v) = a { Some(*v) } else { None }).collect::<Option<Vec<i64>>>(),
            _ => None,
        };
        let same = |j: usize, f: fn(&Window) -> i64| ints(j).is_some_and(|v| v == wins.iter().map(f).collect::<Vec<_>>());
        let matches =
            same(1, |w| w.kernel) && same(2, |w| w.input) && same(3, |w| w.stride) && same(4, |w| w.pad) && same(5, |w| w.dilation);
        match node.arg(0, "") {
            Some(Arg::Node(src)) if matches => self.tensor_of(*src).map(Some),
            _ => Ok(None),
        }
    }

    /// _low_memory_max_pool_offsets_to_indices(offsets, kernel_size, input_size, stride, padding,
    /// dilation): each window offset back to ATen's index within the input plane (volume); the
    /// backward of a training graph computes it from the saved int8 offsets.
    pub(super) fn lower_max_pool_offsets_to_indices(&mut self) -> LResult<TensorValue> {
        let offsets = self.tensor_arg(0, "self")?;
        let [kernel, input, stride, pad, dil] = [(1, "kernel_size"), (2, "input_size"), (3, "stride"), (4, "padding"), (5, "dilation")]
            .map(|(i, key)| self.ints_arg(i, key).map(Option::unwrap_or_default));
        let (kernel, input, stride, pad, dil) = (kernel?, input?, stride?, pad?, dil?);
        let nd = kernel.len();
        let rank = offsets.size.len();
        if nd == 0 || rank < nd || [&input, &stride, &pad, &dil].iter().any(|v| v.len() != nd) {
            return malformed(format!("offsets_to_indices over {nd} dims of a rank-{rank} tensor with input {input:?}, stride {stride:?}, padding {pad:?}, dilation {dil:?}"));
        }
        let sp = rank - nd;
        let size = offsets.size.clone();
        let device = offsets.device;
        Ok(TensorValue::lazy(size, DType::I64, device, 1, 4 * nd, move |bx, idx| {
            let raw = offsets.load(bx, idx);
            let mut rest = bx.body.cast(raw, DType::I64);
            // taps per dim, innermost first
            let mut taps = vec![rest; nd];
            for d in (1..nd).rev() {
                let k = bx.body.constant(Scalar::Int(kernel[d]), DType::I64);
                taps[d] = bx.body.binary(BinaryOp::Remainder, rest, k);
                rest = bx.body.binary(BinaryOp::FloorDiv, rest, k);
            }
            taps[0] = rest;
            let mut flat = bx.body.constant(Scalar::Int(0), DType::I64);
            for d in 0..nd {
                let start = bx.body.index(idx[sp + d].scale(stride[d]).add_const(-pad[d]), DType::I64);
                let step = bx.body.constant(Scalar::Int(dil[d]), DType::I64);
                let k = bx.body.binary(BinaryOp::Mul, taps[d], step);
                let pos = bx.body.binary(BinaryOp::Add, start, k);
                let inner = bx.body.constant(Scalar::Int(input[d + 1..].iter().product()), DType::I64);
                let t = bx.body.binary(BinaryOp::Mul, pos, inner);
                flat = bx.body.binary(BinaryOp::Add, flat, t);
            }
            flat
        }))
    }

    fn cast_to(&mut self, tv: TensorValue, m: &TensorMeta) -> TensorValue {
        if tv.dtype == m.dtype {
            return tv;
        }
        let dt = m.dtype;
        super::pointwise::pointwise(vec![super::pointwise::PwIn::Tensor(tv)], m.shape.clone(), dt, m.device, dt, move |bx, v| {
            bx.body.cast(v[0], dt)
        })
    }
}

/// One pooling node's kernels (values, or argmax indices): the input they read and the output
/// they write.
struct PoolKernel<'p> {
    pool: &'p Pool,
    buf: BufferId,
    in_strides: Vec<i64>,
    in_offset: i64,
    in_size: Vec<i64>,
    in_dtype: DType,
    /// the accumulation type
    acc: DType,
    out_shape: Vec<i64>,
    out_dtype: DType,
    index_dtype: DType,
    device: Device,
    /// one load per window tap, no reduction loops
    unroll: bool,
}

impl PoolKernel<'_> {
    /// Leading (batch, channel) dims: the spatial dims start here.
    fn spatial_start(&self) -> usize {
        self.in_size.len() - self.pool.nd
    }

    /// The loop node computing `what` for every output element, as a view of its buffer.
    fn lower(&self, cx: &mut Ctx<'_>, what: Reduce) -> TensorValue {
        let rank = self.in_size.len();
        let sp = self.spatial_start();
        let reduction_ranges = if self.unroll { Vec::new() } else { self.pool.kernel() };
        // computed in the accumulation type, stored in the result's (a bfloat16 pool writes
        // bfloat16, not a float32 buffer and a conversion of it)
        let dtype = if matches!(what, Reduce::ArgMax(_)) { self.index_dtype } else { self.out_dtype };
        let layout = cx.fresh_layout(&self.out_shape, dtype, self.device);
        // the output loops follow the layout (channels innermost in a channels-last graph)
        let order = loop_order(&layout);
        let ranges: Vec<i64> = order.iter().map(|&d| self.out_shape[d]).collect();
        let obuf = cx.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let mut body = LoopBody::default();
        {
            let all: Vec<i64> = ranges.iter().chain(&reduction_ranges).copied().collect();
            let mut bx = Bx { body: &mut body, ranges: all };
            let mut out_idx = vec![IndexExpr::zero(); rank];
            for (i, &d) in order.iter().enumerate() {
                out_idx[d] = IndexExpr::var(Var(i as u32));
            }
            let mut base = IndexExpr::constant(self.in_offset);
            for (i, &s) in out_idx[..sp].iter().zip(&self.in_strides) {
                base = base.add(&i.scale(s));
            }
            let result = if self.unroll {
                self.unrolled_window(&mut bx, &out_idx, &base, what)
            } else {
                self.window_reduction(&mut bx, &out_idx, &base, what)
            };
            let r = bx.body.cast(result, dtype);
            bx.body.set_store(layout.index_of(&out_idx), r);
        }
        cx.push_node(LoopNode { output: obuf, ranges, reduction_ranges, body, origins: vec![cx.node_name()], template: None });
        view_of_layout(obuf, &layout)
    }

    /// The smallest value of the accumulation type: a max's identity.
    fn lowest(&self) -> Scalar {
        if self.acc.is_float() {
            Scalar::Float(f64::NEG_INFINITY)
        } else {
            Scalar::Int(self.acc.int_range().0)
        }
    }

    /// One tap at window offsets `k`: (in-window, value in the accumulation type, the argmax's
    /// index of the tap: within the input plane (volume) or within the window, row-major).
    fn tap(&self, bx: &mut Bx, out_idx: &[IndexExpr], base: &IndexExpr, what: Reduce, k: &[IndexExpr]) -> (ValueId, ValueId, ValueId) {
        let sp = self.spatial_start();
        let (valid, positions) = self.pool.taps(bx, &out_idx[..sp], &out_idx[sp..], k);
        let terms = positions.iter().enumerate().map(|(k, p)| (*p, self.in_strides[sp + k])).collect();
        let v = bx.body.load_indirect(self.buf, base.clone(), terms, self.in_dtype);
        let v = bx.body.cast(v, self.acc);
        let index = match what {
            Reduce::ArgMax(ArgIndex::Plane) => {
                let mut flat = bx.body.constant(Scalar::Int(0), DType::I64);
                for (k, p) in positions.iter().enumerate() {
                    let inner: i64 = self.in_size[sp + k + 1..].iter().product();
                    let c = bx.body.constant(Scalar::Int(inner), DType::I64);
                    let t = bx.body.binary(BinaryOp::Mul, *p, c);
                    flat = bx.body.binary(BinaryOp::Add, flat, t);
                }
                flat
            }
            Reduce::ArgMax(ArgIndex::Window) => bx.body.index(window_offset(k, &self.pool.kernel()), DType::I64),
            _ => bx.body.constant(Scalar::Int(0), DType::I64),
        };
        (valid, v, index)
    }

    /// An unrolled window: every tap loaded and combined in turn.
    fn unrolled_window(&self, bx: &mut Bx, out_idx: &[IndexExpr], base: &IndexExpr, what: Reduce) -> ValueId {
        let acc = self.acc;
        let offsets = window_offsets(&self.pool.kernel());
        match what {
            Reduce::Max | Reduce::ArgMax(_) => {
                // ATen's scan: a tap replaces the best when greater or NaN; the
                // argmax starts at the window's first valid tap (a window of -inf)
                let argmax = matches!(what, Reduce::ArgMax(_));
                let mut best = bx.body.constant(self.lowest(), acc);
                let mut arg = bx.body.constant(Scalar::Int(0), DType::I64);
                let mut seen = bx.body.constant(Scalar::Bool(false), DType::Bool);
                for k in &offsets {
                    let (valid, v, index) = self.tap(bx, out_idx, base, what, k);
                    let mut better = bx.body.binary(BinaryOp::Gt, v, best);
                    if acc.is_float() {
                        let nan = bx.body.unary(UnaryOp::IsNan, v);
                        better = bx.body.binary(BinaryOp::LogicalOr, better, nan);
                    }
                    if argmax {
                        let first = bx.body.unary(UnaryOp::LogicalNot, seen);
                        better = bx.body.binary(BinaryOp::LogicalOr, better, first);
                        seen = bx.body.binary(BinaryOp::LogicalOr, seen, valid);
                    }
                    let take = bx.body.binary(BinaryOp::LogicalAnd, valid, better);
                    best = bx.body.where_(take, v, best);
                    if argmax {
                        arg = bx.body.where_(take, index, arg);
                    }
                }
                if argmax {
                    arg
                } else {
                    best
                }
            }
            Reduce::Mean => {
                let z = bx.body.constant(Scalar::Int(0), acc);
                let mut sum = z;
                for k in &offsets {
                    let (valid, v, _) = self.tap(bx, out_idx, base, what, k);
                    let m = bx.body.where_(valid, v, z);
                    sum = bx.body.binary(BinaryOp::Add, sum, m);
                }
                mean_of(bx, self.pool, &out_idx[self.spatial_start()..], sum, acc)
            }
        }
    }

    /// A window as reduction loops over its offsets, after the output loops.
    fn window_reduction(&self, bx: &mut Bx, out_idx: &[IndexExpr], base: &IndexExpr, what: Reduce) -> ValueId {
        let acc = self.acc;
        let rank = self.in_size.len();
        let kvars: Vec<IndexExpr> = (0..self.pool.nd).map(|k| IndexExpr::var(Var((rank + k) as u32))).collect();
        let (valid, v, index) = self.tap(bx, out_idx, base, what, &kvars);
        match what {
            Reduce::ArgMax(_) => {
                let low = bx.body.constant(self.lowest(), acc);
                let m = bx.body.where_(valid, v, low);
                bx.body.arg_reduce(ReduceOp::ArgMax, m, index)
            }
            Reduce::Max => {
                let low = bx.body.constant(self.lowest(), acc);
                let m = bx.body.where_(valid, v, low);
                bx.body.reduce(ReduceOp::Max, m)
            }
            Reduce::Mean => {
                let z = bx.body.constant(Scalar::Int(0), acc);
                let m = bx.body.where_(valid, v, z);
                let s = bx.body.reduce(ReduceOp::Sum, m);
                mean_of(bx, self.pool, &out_idx[self.spatial_start()..], s, acc)
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Reduce {
    Mean,
    Max,
    ArgMax(ArgIndex),
}

/// What a max pool's argmax counts.
#[derive(Clone, Copy, PartialEq)]
enum ArgIndex {
    /// positions in the input plane (volume), row-major: ATen's indices
    Plane,
    /// taps of the window, row-major: the int8 offsets a training graph saves
    Window,
}

/// The row-major number of tap `k` in a window of `kernel` taps per dim.
fn window_offset(k: &[IndexExpr], kernel: &[i64]) -> IndexExpr {
    let mut flat = IndexExpr::zero();
    for (d, kd) in k.iter().enumerate() {
        flat = flat.add(&kd.scale(kernel[d + 1..].iter().product()));
    }
    flat
}

/// A max pool's backward gathers from at most this many covering windows per element.
const MAX_COVERING: i64 = 9;

/// Windows of at most this many taps are unrolled into pointwise code (3x3 and 5x5 pools).
const MAX_UNROLLED_TAPS: i64 = 25;

/// Every offset of a window of `kernel` taps per dim, row-major.
fn window_offsets(kernel: &[i64]) -> Vec<Vec<IndexExpr>> {
    row_major(kernel).into_iter().map(|o| o.into_iter().map(IndexExpr::constant).collect()).collect()
}

/// Every index tuple of `counts` per dim, the last dim fastest.
fn row_major(counts: &[i64]) -> Vec<Vec<i64>> {
    let mut out = vec![Vec::new()];
    for &k in counts {
        out = out.into_iter().flat_map(|o: Vec<i64>| (0..k).map(move |i| [o.clone(), vec![i]].concat())).collect();
    }
    out
}

/// A window sum divided as ATen's avg_pool / adaptive_avg_pool divide it.
fn mean_of(bx: &mut Bx, pool: &Pool, out_spatial: &[IndexExpr], sum: ValueId, acc: DType) -> ValueId {
    let count = divisor(bx, pool.kind, &pool.wins, out_spatial);
    let c = bx.body.cast(count, acc);
    // ATen divides integer sums with C++ integer division
    let div = if acc.is_float() { BinaryOp::TrueDiv } else { BinaryOp::TruncDiv };
    bx.body.binary(div, sum, c)
}

/// The longest adaptive window: max over outputs of ceil((o+1)·in/out) − floor(o·in/out).
fn adaptive_max_window(input: i64, output: i64) -> i64 {
    (0..output).map(|o| ((o + 1) * input + output - 1) / output - (o * input) / output).max().unwrap_or(1).max(1)
}

/// The window start of fractional max pooling for output index `o`, as ATen computes it in the
/// samples' dtype (every step rounded to it): with alpha = (in - k) / (out - 1),
/// start = trunc((o + u)·alpha) - trunc(u·alpha), and the last window ends at the input's end.
fn fractional_start(bx: &mut Bx, samples: &TensorValue, slot: usize, lead: &[IndexExpr], wn: &Window, o: &IndexExpr) -> (ValueId, ValueId) {
    let st = samples.dtype;
    let (n, c) = match lead {
        [c] => (IndexExpr::zero(), c.clone()),
        [n, c] => (n.clone(), c.clone()),
        _ => (IndexExpr::zero(), IndexExpr::zero()),
    };
    let u = samples.load(bx, &[n, c, IndexExpr::constant(slot as i64)]);
    // half types compute in float: round explicitly after each step, as ATen's Half ops do
    let r = |bx: &mut Bx, v: ValueId| {
        let wide = bx.body.cast(v, st.compute());
        bx.body.cast(wide, st)
    };
    let a = bx.body.constant(Scalar::Int(wn.input - wn.kernel), st);
    let b = bx.body.constant(Scalar::Int((wn.output - 1).max(1)), st);
    let alpha = bx.body.binary(BinaryOp::TrueDiv, a, b);
    let alpha = r(bx, alpha);
    let oi = bx.body.index(o.clone(), DType::I64);
    let of = r(bx, oi);
    let t = bx.body.binary(BinaryOp::Add, of, u);
    let t = r(bx, t);
    let t = bx.body.binary(BinaryOp::Mul, t, alpha);
    let t = r(bx, t);
    let first = bx.body.binary(BinaryOp::Mul, u, alpha);
    let first = r(bx, first);
    let ti = bx.body.cast(t, DType::I64);
    let fi = bx.body.cast(first, DType::I64);
    let start = bx.body.binary(BinaryOp::Sub, ti, fi);
    let last = bx.body.constant(Scalar::Int(wn.input - wn.kernel), DType::I64);
    let top = bx.body.constant(Scalar::Int(wn.output - 1), DType::I64);
    let is_last = bx.body.binary(BinaryOp::Eq, oi, top);
    let start = bx.body.where_(is_last, last, start);
    (start, bx.body.constant(Scalar::Int(wn.input), DType::I64))
}

/// (first input position of the window, end of the valid positions) for output index `o`.
fn window_bounds(bx: &mut Bx, kind: PoolKind, wn: &Window, o: &IndexExpr) -> (ValueId, ValueId) {
    let r = bx.ranges.clone();
    match kind {
        PoolKind::Adaptive { .. } => {
            let s = o.scale(wn.input).floordiv(wn.output, &r);
            let e = o.add_const(1).scale(wn.input).add_const(wn.output - 1).floordiv(wn.output, &r);
            (bx.body.index(s, DType::I64), bx.body.index(e, DType::I64))
        }
        _ => {
            let s = o.scale(wn.stride).add_const(-wn.pad);
            (bx.body.index(s, DType::I64), bx.body.constant(Scalar::Int(wn.input), DType::I64))
        }
    }
}

/// Number the window sum is divided by, as ATen's avg_pool / adaptive_avg_pool define it.
fn divisor(bx: &mut Bx, kind: PoolKind, wins: &[Window], out_idx: &[IndexExpr]) -> ValueId {
    let r = bx.ranges.clone();
    let mut count: Option<ValueId> = None;
    for (k, wn) in wins.iter().enumerate() {
        let o = &out_idx[k];
        let len = match kind {
            PoolKind::Avg { divisor: Some(d), .. } => return bx.body.constant(Scalar::Int(d), DType::I64),
            PoolKind::Adaptive { .. } => {
                let s = o.scale(wn.input).floordiv(wn.output, &r);
                let e = o.add_const(1).scale(wn.input).add_const(wn.output - 1).floordiv(wn.output, &r);
                bx.body.index(e.sub(&s), DType::I64)
            }
            PoolKind::Avg { count_include_pad, divisor: None } => {
                let start = o.scale(wn.stride).add_const(-wn.pad);
                let s = bx.body.index(start.clone(), DType::I64);
                let e_raw = bx.body.index(start.add_const(wn.kernel), DType::I64);
                let lim = bx.body.constant(Scalar::Int(wn.input + wn.pad), DType::I64);
                let e = bx.body.binary(BinaryOp::Minimum, e_raw, lim);
                if count_include_pad {
                    bx.body.binary(BinaryOp::Sub, e, s)
                } else {
                    let zero = bx.body.constant(Scalar::Int(0), DType::I64);
                    let n = bx.body.constant(Scalar::Int(wn.input), DType::I64);
                    let s2 = bx.body.binary(BinaryOp::Maximum, s, zero);
                    let e2 = bx.body.binary(BinaryOp::Minimum, e, n);
                    bx.body.binary(BinaryOp::Sub, e2, s2)
                }
            }
            PoolKind::Max | PoolKind::Fractional => bx.body.constant(Scalar::Int(1), DType::I64),
        };
        count = Some(match count {
            Some(c) => bx.body.binary(BinaryOp::Mul, c, len),
            None => len,
        });
    }
    count.unwrap_or_else(|| bx.body.constant(Scalar::Int(1), DType::I64))
}
