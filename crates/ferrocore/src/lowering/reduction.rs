//! Reductions (sum, mean, amax, amin, prod, any, var) and the normalizations built from them
//! (softmax, log_softmax, layer_norm). Each reduction is one Reduction node writing a buffer of
//! the kept dims; epilogues stay lazy so the scheduler can fuse them after the reduction.

use super::pointwise::{pointwise, PwIn};
use super::views::reshape;
use super::*;

impl Ctx<'_> {
    /// A Reduction node over `dims` of a tensor of `size`. `body(bx, full_idx, kept_idx)` returns
    /// the value stored per kept index (it contains the `Reduce`). Returns the buffer, viewed with
    /// the kept dims (keepdim=False).
    pub fn reduce_node(
        &mut self,
        size: &[i64],
        dims: &[usize],
        dtype: DType,
        device: Device,
        body: impl Fn(&mut Bx, &[IndexExpr], &[IndexExpr]) -> ValueId,
    ) -> TensorValue {
        let kept: Vec<usize> = (0..size.len()).filter(|d| !dims.contains(d)).collect();
        let ranges: Vec<i64> = kept.iter().map(|&d| size[d]).collect();
        let mut reduction_ranges: Vec<i64> = dims.iter().map(|&d| size[d]).collect();
        if reduction_ranges.is_empty() {
            reduction_ranges.push(1); // reducing nothing (a 0-d input): one iteration
        }
        let layout = Layout::contiguous(&ranges, dtype, device);
        let buf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let mut lb = LoopBody::default();
        {
            let all: Vec<i64> = ranges.iter().chain(&reduction_ranges).copied().collect();
            let mut bx = Bx { body: &mut lb, ranges: all };
            let kept_idx: Vec<IndexExpr> = (0..kept.len()).map(|i| IndexExpr::var(Var(i as u32))).collect();
            let mut full = vec![IndexExpr::zero(); size.len()];
            for (i, &d) in kept.iter().enumerate() {
                full[d] = kept_idx[i].clone();
            }
            for (j, &d) in dims.iter().enumerate() {
                full[d] = IndexExpr::var(Var((kept.len() + j) as u32));
            }
            let v = body(&mut bx, &full, &kept_idx);
            let v = bx.body.cast(v, dtype);
            bx.body.set_store(layout.index_of(&kept_idx), v);
        }
        self.push_node(LoopNode { output: buf, ranges, reduction_ranges, body: lb, origins: vec![self.node_name()], template: None });
        view_of_layout(buf, &layout)
    }

    fn reduce_dims(&self, i: usize, key: &str, rank: usize) -> LResult<Vec<usize>> {
        let dims = self.ints_arg(i, key)?.unwrap_or_default();
        if dims.is_empty() {
            return Ok((0..rank).collect());
        }
        let mut out = Vec::new();
        for d in dims {
            let d = norm_dim(d, rank)?;
            if rank == 0 {
                continue;
            }
            if !out.contains(&d) {
                out.push(d);
            }
        }
        out.sort();
        Ok(out)
    }

    pub(super) fn lower_reduction(&mut self, op: AtenOp) -> LResult<TensorValue> {
        use AtenOp as A;
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let rank = x.size.len();
        let dims = match op {
            A::SumDimIntList | A::MeanDim | A::Amax | A::Amin | A::AnyDims => self.reduce_dims(1, "dim", rank)?,
            A::ProdDimInt | A::AnyDim => {
                vec![norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?].into_iter().filter(|_| rank > 0).collect()
            }
            _ => (0..rank).collect(),
        };
        let rop = match op {
            A::SumDimIntList | A::SumDefault | A::MeanDim | A::MeanDefault => ReduceOp::Sum,
            A::Amax | A::MaxDefault => ReduceOp::Max,
            A::Amin | A::MinDefault => ReduceOp::Min,
            A::ProdDefault | A::ProdDimInt => ReduceOp::Prod,
            _ => ReduceOp::Any,
        };
        let count: i64 = dims.iter().map(|&d| x.size[d]).product();
        if matches!(rop, ReduceOp::Max | ReduceOp::Min) && count == 0 {
            return unsupported("max/min over an empty dimension (ATen raises)");
        }
        let mean = matches!(op, A::MeanDim | A::MeanDefault);
        let acc = out.dtype.compute();
        // in bool, a sum is `any` and a product `all` (not any not): ATen's bool accumulation
        // saturates, where bool arithmetic in a kernel would wrap or miscompile
        let (rop, all) = match (rop, acc) {
            (ReduceOp::Sum, DType::Bool) => (ReduceOp::Any, false),
            (ReduceOp::Prod, DType::Bool) => (ReduceOp::Any, true),
            (rop, _) => (rop, false),
        };
        let xs = x.clone();
        let r = self.reduce_node(&x.size, &dims, acc, out.device, move |bx, full, _| {
            let v = xs.load(bx, full);
            let v = if rop == ReduceOp::Any && acc != DType::Bool { v } else { bx.body.cast(v, acc) };
            let v = if all { bx.body.unary(UnaryOp::LogicalNot, v) } else { v };
            let r = bx.body.reduce(rop, v);
            let r = if all { bx.body.unary(UnaryOp::LogicalNot, r) } else { r };
            if mean {
                let n = bx.body.constant(Scalar::Float(count as f64), acc);
                bx.body.binary(BinaryOp::TrueDiv, r, n)
            } else {
                r
            }
        });
        self.finish_reduction(r, &out)
    }

    /// cumsum / cumprod: a Scan node along `dim` writing every element of a full-size buffer.
    pub(super) fn lower_scan(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let rank = x.size.len();
        let dim = if rank == 0 { None } else { Some(norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?) };
        let acc = out.dtype.compute();
        let rop = if op == AtenOp::Cumsum { ReduceOp::Sum } else { ReduceOp::Prod };
        let kept: Vec<usize> = (0..rank).filter(|&d| Some(d) != dim).collect();
        let ranges: Vec<i64> = kept.iter().map(|&d| x.size[d]).collect();
        let reduction_ranges = vec![dim.map_or(1, |d| x.size[d])];
        let layout = Layout::contiguous(&x.size, acc, out.device);
        let buf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let mut body = LoopBody::default();
        {
            let all: Vec<i64> = ranges.iter().chain(&reduction_ranges).copied().collect();
            let mut bx = Bx { body: &mut body, ranges: all };
            let mut full = vec![IndexExpr::zero(); rank];
            for (i, &d) in kept.iter().enumerate() {
                full[d] = IndexExpr::var(Var(i as u32));
            }
            if let Some(d) = dim {
                full[d] = IndexExpr::var(Var(kept.len() as u32));
            }
            let v = x.load(&mut bx, &full);
            let v = bx.body.cast(v, acc);
            let s = bx.body.scan(rop, v);
            bx.body.set_store(layout.index_of(&full), s);
        }
        self.push_node(LoopNode { output: buf, ranges, reduction_ranges, body, origins: vec![self.node_name()], template: None });
        self.finish_reduction(view_of_layout(buf, &layout), &out)
    }

    /// argmax/argmin (dim optional) and max.dim/min.dim (values and indices).
    pub(super) fn lower_arg_reduction(&mut self, op: AtenOp) -> LResult<Lowered> {
        use AtenOp as A;
        let x = self.tensor_arg(0, "self")?;
        let rank = x.size.len();
        let dims: Vec<usize> = match self.int_arg(1, "dim")? {
            Some(d) if rank > 0 => vec![norm_dim(d, rank)?],
            Some(_) => vec![],
            None => (0..rank).collect(),
        };
        let count: i64 = dims.iter().map(|&d| x.size[d]).product();
        if count == 0 {
            return unsupported("arg reduction over an empty dimension (ATen raises)");
        }
        let is_max = matches!(op, A::Argmax | A::MaxDim);
        let aop = if is_max { ReduceOp::ArgMax } else { ReduceOp::ArgMin };
        let metas: Vec<TensorMeta> = match self.meta() {
            Meta::Tensor(t) => vec![t.clone()],
            Meta::Tuple(items) => items.iter().filter_map(|m| m.as_ref().and_then(|m| m.tensor().cloned())).collect(),
            _ => return malformed("arg reduction without tensor metadata"),
        };
        let vd = x.dtype.compute();
        let sizes: Vec<i64> = dims.iter().map(|&d| x.size[d]).collect();
        let strides = contiguous_strides(&sizes);
        let (xs, dims2) = (x.clone(), dims.clone());
        let idx = self.reduce_node(&x.size, &dims, DType::I64, x.device, move |bx, full, _| {
            let v = xs.load(bx, full);
            let v = bx.body.cast(v, vd);
            let mut lin = IndexExpr::zero();
            for (j, &d) in dims2.iter().enumerate() {
                lin = lin.add(&full[d].scale(strides[j]));
            }
            let li = bx.body.index(lin, DType::I64);
            bx.body.arg_reduce(aop, v, li)
        });
        match op {
            A::Argmax | A::Argmin => {
                let m = metas.first().ok_or((LowerErrorKind::Malformed, "argmax without metadata".to_string()))?;
                Ok(Lowered::Tensor(self.finish_reduction(idx, m)?))
            }
            _ => {
                let (Some(vm), Some(im)) = (metas.first(), metas.get(1)) else { return malformed("max.dim returns two tensors") };
                let xs = x.clone();
                let rop = if is_max { ReduceOp::Max } else { ReduceOp::Min };
                let vals = self.reduce_node(&x.size, &dims, vd, x.device, move |bx, full, _| {
                    let v = xs.load(bx, full);
                    let v = bx.body.cast(v, vd);
                    bx.body.reduce(rop, v)
                });
                let v = self.finish_reduction(vals, vm)?;
                let i = self.finish_reduction(idx, im)?;
                Ok(Lowered::Tuple(vec![Some(Lowered::Tensor(v)), Some(Lowered::Tensor(i))]))
            }
        }
    }

    /// Applies keepdim (a reshape to the metadata's shape) and the output dtype.
    pub(super) fn finish_reduction(&mut self, r: TensorValue, out: &TensorMeta) -> LResult<TensorValue> {
        let r = reshape(&r, out.shape.clone())?;
        if r.dtype == out.dtype {
            return Ok(r);
        }
        let dt = out.dtype;
        Ok(pointwise(vec![PwIn::Tensor(r)], out.shape.clone(), dt, out.device, dt, move |bx, v| bx.body.cast(v[0], dt)))
    }

    /// Two-pass variance: a mean node, then Σ(x - mean)² / (N - correction).
    pub(super) fn lower_var(&mut self, op: AtenOp) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "self")?;
        let rank = x.size.len();
        let dims = self.reduce_dims(1, "dim", rank)?;
        let correction = match if op == AtenOp::VarDim { None } else { self.arg(usize::MAX, "correction") } {
            None | Some(Arg::None) => 1.0,
            Some(Arg::Int(v)) => *v as f64,
            Some(Arg::Float(v)) => *v,
            other => return malformed(format!("correction must be a number, got {other:?}")),
        };
        let correction = if op == AtenOp::VarDim { f64::from(u8::from(self.bool_arg(2, "unbiased", true)?)) } else { correction };
        let metas: Vec<TensorMeta> = match self.meta() {
            Meta::Tensor(t) => vec![t.clone()],
            Meta::Tuple(items) => items.iter().filter_map(|m| m.as_ref().and_then(|m| m.tensor().cloned())).collect(),
            _ => return malformed("var without tensor metadata"),
        };
        let Some(vmeta) = metas.first().cloned() else { return malformed("var without tensor metadata") };
        let acc = vmeta.dtype.compute();
        if !acc.is_float() {
            return unsupported("var of a non-float result");
        }
        // CPU eager computes a variance in double (Welford over double accumulators); the C++
        // kernels' chunked float sums (`codegen::cpp::SUM_CHUNK_F32`) are as exact at every size
        let (mean_kept, var) = match self.group_norm_input(&dims)? {
            Some((image, groups)) => {
                let (mean, var) = self.group_moments_of_channels(&image, groups, acc, None)?;
                let count = (x.numel() / (image.size[0] * groups)) as f64;
                (mean, unbias(var, count, correction))
            }
            None => self.variance(&x, &dims, acc, correction),
        };
        let v = self.finish_reduction(var, &vmeta)?;
        if op == AtenOp::VarMeanCorrection {
            let mmeta = metas.get(1).cloned().unwrap_or_else(|| vmeta.clone());
            let m = self.finish_reduction(mean_kept, &mmeta)?;
            return Ok(Lowered::Tuple(vec![Some(Lowered::Tensor(v)), Some(Lowered::Tensor(m))]));
        }
        Ok(Lowered::Tensor(v))
    }

    /// The channels-last image and group count when this `var`'s input is a group norm's view
    /// of it (`view(x, [N, G, C/G, H*W])`, as torch's decomposition writes it for training
    /// graphs) reduced over everything past the groups: its statistics are then read per channel
    /// (`group_moments_of_channels`).
    fn group_norm_input(&self, dims: &[usize]) -> LResult<Option<(TensorValue, i64)>> {
        let Some(Arg::Node(view)) = self.arg(0, "self") else { return Ok(None) };
        let node = self.graph.node(*view);
        let NodeKind::Call { target: Target::Aten(AtenOp::View | AtenOp::UnsafeView | AtenOp::Reshape), args, .. } = &node.kind else {
            return Ok(None);
        };
        let (Some(Arg::Node(src)), Some(shape)) = (args.first(), node.meta.tensor().map(|t| &t.shape)) else { return Ok(None) };
        let Some(Lowered::Tensor(image)) = &self.values[src.0 as usize] else { return Ok(None) };
        if !self.triton_kernels() || !self.nhwc_value(&image.size) || shape.len() < 3 || dims != (2..shape.len()).collect::<Vec<_>>() {
            return Ok(None);
        }
        let (n, c, g) = (image.size[0], image.size[1], shape[1]);
        let grouped = shape[0] == n && g > 0 && c % g == 0 && shape[2..].iter().product::<i64>() * g == image.numel() / n.max(1);
        Ok((grouped && n > 0 && image.numel() > 0).then(|| (image.clone(), g)))
    }

    /// Returns (mean, variance) over `dims`, both with the kept dims.
    fn variance(&mut self, x: &TensorValue, dims: &[usize], acc: DType, correction: f64) -> (TensorValue, TensorValue) {
        self.moments(x, dims, acc, correction, None)
    }

    /// `variance`, or with `rstd_eps` the mean and `1 / sqrt(variance + eps)`, the latter computed
    /// once per reduced row by the reduction itself: a consumer that reads it per element (a group
    /// norm's, whose statistics differ along its channels) then does no square root of its own.
    fn moments(
        &mut self,
        x: &TensorValue,
        dims: &[usize],
        acc: DType,
        correction: f64,
        rstd_eps: Option<f64>,
    ) -> (TensorValue, TensorValue) {
        let count: i64 = dims.iter().map(|&d| x.size[d]).product();
        let xs = x.clone();
        let mean = self.reduce_node(&x.size, dims, acc, x.device, move |bx, full, _| {
            let v = xs.load(bx, full);
            let v = bx.body.cast(v, acc);
            let s = bx.body.reduce(ReduceOp::Sum, v);
            let n = bx.body.constant(Scalar::Float(count as f64), acc);
            bx.body.binary(BinaryOp::TrueDiv, s, n)
        });
        let (xs, m) = (x.clone(), mean.clone());
        let denom = (count as f64 - correction).max(0.0);
        let var = self.reduce_node(&x.size, dims, acc, x.device, move |bx, full, kept| {
            let v = xs.load(bx, full);
            let v = bx.body.cast(v, acc);
            let mu = m.load(bx, kept);
            let d = bx.body.binary(BinaryOp::Sub, v, mu);
            let d2 = bx.body.binary(BinaryOp::Mul, d, d);
            let s = bx.body.reduce(ReduceOp::Sum, d2);
            let n = bx.body.constant(Scalar::Float(denom), acc);
            let var = bx.body.binary(BinaryOp::TrueDiv, s, n);
            match rstd_eps {
                Some(eps) => {
                    let e = bx.body.constant(Scalar::Float(eps), acc);
                    let ve = bx.body.binary(BinaryOp::Add, var, e);
                    bx.body.unary(UnaryOp::Rsqrt, ve)
                }
                None => var,
            }
        });
        (mean, var)
    }

    pub(super) fn lower_softmax(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let rank = x.size.len();
        let dim = if rank == 0 { None } else { Some(norm_dim(self.int_arg(1, "dim")?.unwrap_or(0), rank)?) };
        let acc = promote(out.dtype.compute(), x.dtype.compute());
        let dims: Vec<usize> = dim.into_iter().collect();
        let drop_dim = move |full: &[IndexExpr]| -> Vec<IndexExpr> {
            full.iter().enumerate().filter(|(i, _)| Some(*i) != dim).map(|(_, e)| e.clone()).collect()
        };
        let xs = x.clone();
        let max = self.reduce_node(&x.size, &dims, acc, x.device, move |bx, full, _| {
            let v = xs.load(bx, full);
            let v = bx.body.cast(v, acc);
            bx.body.reduce(ReduceOp::Max, v)
        });
        let log = op == AtenOp::LogSoftmax;
        // exp(x - max), in the accumulation type
        let (xs, m) = (x.clone(), max.clone());
        let shifted_exp = TensorValue::lazy(x.size.clone(), acc, x.device, 2, 3, move |bx, full| {
            let v = xs.load(bx, full);
            let v = bx.body.cast(v, acc);
            let mx = m.load(bx, &drop_dim(full));
            let d = bx.body.binary(BinaryOp::Sub, v, mx);
            bx.body.unary(UnaryOp::Exp, d)
        });
        // C++ kernels store the exponentials once for the sum and the result to read back
        // (Inductor's CPU kernel does the same): an exp costs ~20 vector ops, a store and a load of
        // the row (in L1) two: softmax over 512x512 took 174 us computing it twice, 105 us now.
        // A Triton program keeps the row in registers instead.
        let cpp = !self.triton_kernels();
        let stored_exp = !log && cpp && x.size.iter().product::<i64>() > 0;
        let shifted_exp = if stored_exp { self.realize(&shifted_exp) } else { shifted_exp };
        let e = shifted_exp.clone();
        let sum = self.reduce_node(&x.size, &dims, acc, x.device, move |bx, full, _| {
            let v = e.load(bx, full);
            bx.body.reduce(ReduceOp::Sum, v)
        });
        let (m, s) = (max, sum);
        let out_dtype = out.dtype;
        // ATen's CPU kernel scales by the reciprocal of the sum; its CUDA kernel divides
        let divide = out.device != Device::Cpu;
        Ok(TensorValue {
            size: x.size.clone(),
            dtype: out.dtype,
            device: out.device,
            src: Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let kept = drop_dim(idx);
                    let sm = s.load(bx, &kept);
                    let r = if log {
                        let xv = x.load(bx, idx);
                        let xv = bx.body.cast(xv, acc);
                        let mx = m.load(bx, &kept);
                        let d = bx.body.binary(BinaryOp::Sub, xv, mx);
                        let l = bx.body.unary(UnaryOp::Log, sm);
                        bx.body.binary(BinaryOp::Sub, d, l)
                    } else {
                        let e = shifted_exp.load(bx, idx);
                        if divide {
                            bx.body.binary(BinaryOp::TrueDiv, e, sm)
                        } else {
                            let inv = bx.body.unary(UnaryOp::Reciprocal, sm);
                            bx.body.binary(BinaryOp::Mul, e, inv)
                        }
                    };
                    bx.body.cast(r, out_dtype)
                }),
                reads: 3,
                ops: 4,
            },
        })
    }

    pub(super) fn lower_layer_norm(&mut self) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "input")?;
        let normalized = self.ints_arg(1, "normalized_shape")?.unwrap_or_default();
        let w = match self.arg(2, "weight") {
            Some(Arg::Node(n)) => Some(self.tensor_of(*n)?),
            _ => None,
        };
        let b = match self.arg(3, "bias") {
            Some(Arg::Node(n)) => Some(self.tensor_of(*n)?),
            _ => None,
        };
        let eps = self.float_arg(4, "eps")?.unwrap_or(1e-5);
        let rank = x.size.len();
        let k = normalized.len();
        if k > rank || x.size[rank - k..] != normalized[..] {
            return malformed(format!("normalized_shape {normalized:?} does not match input {:?}", x.size));
        }
        let Meta::Tuple(metas) = self.meta() else { return malformed("native_layer_norm returns a tuple") };
        let metas: Vec<Option<TensorMeta>> = metas.iter().map(|m| m.as_ref().and_then(|m| m.tensor().cloned())).collect();
        let Some(Some(out)) = metas.first().cloned() else { return malformed("native_layer_norm without output metadata") };
        let acc = out.dtype.compute();
        let dims: Vec<usize> = (rank - k..rank).collect();
        let (mean, var) = self.variance(&x, &dims, acc, 0.0);
        let axis = rank - k;
        let (mean2, var2) = (mean.clone(), var.clone());
        let rstd_of = move |bx: &mut Bx, kept: &[IndexExpr]| {
            let v = var2.load(bx, kept);
            let e = bx.body.constant(Scalar::Float(eps), acc);
            let ve = bx.body.binary(BinaryOp::Add, v, e);
            bx.body.unary(UnaryOp::Rsqrt, ve)
        };
        let rstd_of = Rc::new(rstd_of);
        let (xs, r2) = (x.clone(), rstd_of.clone());
        let y = TensorValue {
            size: x.size.clone(),
            dtype: out.dtype,
            device: out.device,
            src: Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let kept = &idx[..axis];
                    let xv = xs.load(bx, idx);
                    let xv = bx.body.cast(xv, acc);
                    let mu = mean2.load(bx, kept);
                    let rs = r2(bx, kept);
                    let d = bx.body.binary(BinaryOp::Sub, xv, mu);
                    let mut y = bx.body.binary(BinaryOp::Mul, d, rs);
                    if let Some(w) = &w {
                        let wv = w.load(bx, &idx[axis..]);
                        let wv = bx.body.cast(wv, acc);
                        y = bx.body.binary(BinaryOp::Mul, y, wv);
                    }
                    if let Some(b) = &b {
                        let bv = b.load(bx, &idx[axis..]);
                        let bv = bx.body.cast(bv, acc);
                        y = bx.body.binary(BinaryOp::Add, y, bv);
                    }
                    bx.body.cast(y, out.dtype)
                }),
                reads: 5,
                ops: 8,
            },
        };
        let mut items = vec![Some(Lowered::Tensor(y))];
        if let Some(Some(mm)) = metas.get(1) {
            items.push(Some(Lowered::Tensor(self.finish_reduction(mean, mm)?)));
        } else {
            items.push(None);
        }
        if let Some(Some(rm)) = metas.get(2) {
            let kept_size: Vec<i64> = x.size[..axis].to_vec();
            let r3 = rstd_of.clone();
            let rstd = TensorValue {
                size: kept_size,
                dtype: acc,
                device: x.device,
                src: Src::Lazy { f: Rc::new(move |bx: &mut Bx, kept: &[IndexExpr]| r3(bx, kept)), reads: 1, ops: 3 },
            };
            items.push(Some(Lowered::Tensor(self.finish_reduction(rstd, rm)?)));
        } else {
            items.push(None);
        }
        Ok(Lowered::Tuple(items))
    }
}

fn promote(a: DType, b: DType) -> DType {
    crate::graph::promote_types(a, b)
}

impl Ctx<'_> {
    fn opt_tensor(&self, i: usize, key: &str) -> LResult<Option<TensorValue>> {
        match self.arg(i, key) {
            Some(Arg::Node(n)) => Ok(Some(self.tensor_of(*n)?)),
            None | Some(Arg::None) => Ok(None),
            other => malformed(format!("argument {i} ({key}) must be a tensor or None, got {other:?}")),
        }
    }

    fn tuple_metas(&self) -> LResult<Vec<TensorMeta>> {
        match self.meta() {
            Meta::Tuple(items) => Ok(items.iter().filter_map(|m| m.as_ref().and_then(|m| m.tensor().cloned())).collect()),
            _ => malformed("expected a tuple result"),
        }
    }

    /// (x - mean[c]) * rstd[c] * w[c] + b[c] with c = dim 1, lazily.
    fn normalize_channels(
        x: &TensorValue,
        mean: TensorValue,
        rstd: TensorValue,
        w: Option<TensorValue>,
        b: Option<TensorValue>,
        out: &TensorMeta,
        acc: DType,
    ) -> TensorValue {
        let xs = x.clone();
        let dt = out.dtype;
        TensorValue {
            size: x.size.clone(),
            dtype: dt,
            device: out.device,
            src: Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let c = std::slice::from_ref(&idx[1]);
                    let v = xs.load(bx, idx);
                    let v = bx.body.cast(v, acc);
                    let m = mean.load(bx, c);
                    let m = bx.body.cast(m, acc);
                    let r = rstd.load(bx, c);
                    let r = bx.body.cast(r, acc);
                    let d = bx.body.binary(BinaryOp::Sub, v, m);
                    let mut y = bx.body.binary(BinaryOp::Mul, d, r);
                    if let Some(w) = &w {
                        let wv = w.load(bx, c);
                        let wv = bx.body.cast(wv, acc);
                        y = bx.body.binary(BinaryOp::Mul, y, wv);
                    }
                    if let Some(b) = &b {
                        let bv = b.load(bx, c);
                        let bv = bx.body.cast(bv, acc);
                        y = bx.body.binary(BinaryOp::Add, y, bv);
                    }
                    bx.body.cast(y, dt)
                }),
                reads: 5,
                ops: 8,
            },
        }
    }

    /// Batch norm in eval mode (running statistics) or training without running statistics.
    pub(super) fn lower_batch_norm(&mut self, op: AtenOp) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "input")?;
        let w = self.opt_tensor(1, "weight")?;
        let b = self.opt_tensor(2, "bias")?;
        let metas = self.tuple_metas()?;
        let (Some(out), Some(m1), Some(m2)) = (metas.first(), metas.get(1), metas.get(2)) else {
            return malformed("batch norm returns three tensors");
        };
        if x.size.len() < 2 {
            return malformed("batch norm input needs a channel dim");
        }
        let acc = out.dtype.compute();
        let with_stats = matches!(op, AtenOp::BatchNormLegit | AtenOp::BatchNormFunctional);
        let eps_at = match op {
            AtenOp::BatchNormNoTraining => 6,
            AtenOp::BatchNormNoStats => 5,
            _ => 7,
        };
        let eps = self.float_arg(eps_at, "eps")?.unwrap_or(1e-5);
        let training = match op {
            AtenOp::BatchNormNoTraining => false,
            AtenOp::BatchNormNoStats => true,
            _ => self.bool_arg(5, "training", true)?,
        };
        if op == AtenOp::BatchNormLegit && training {
            // updates running_mean/var in place: functional graphs carry the _functional form
            return unsupported("_native_batch_norm_legit in training mode mutates its running statistics");
        }
        let device = x.device;
        let rstd_of = |var: TensorValue| -> TensorValue {
            let size = var.size.clone();
            super::pointwise::pointwise(vec![super::pointwise::PwIn::Tensor(var)], size, acc, device, acc, move |bx, v| {
                let v = bx.body.cast(v[0], acc);
                let e = bx.body.constant(Scalar::Float(eps), acc);
                let s = bx.body.binary(BinaryOp::Add, v, e);
                bx.body.unary(UnaryOp::Rsqrt, s)
            })
        };
        if !training {
            let mean = self.tensor_arg(3, "running_mean")?;
            let var = self.tensor_arg(4, "running_var")?;
            let rstd = rstd_of(var);
            let y = Self::normalize_channels(&x, mean, rstd, w, b, out, acc);
            // save_mean / save_rstd are empty in eval mode
            let empty = |m: &TensorMeta| self.empty_like_meta(m);
            let mut items = vec![Some(Lowered::Tensor(y)), Some(Lowered::Tensor(empty(m1))), Some(Lowered::Tensor(empty(m2)))];
            if op == AtenOp::BatchNormFunctional {
                // eval mode leaves the running statistics as they were
                items.push(Some(Lowered::Tensor(self.tensor_arg(3, "running_mean")?)));
                items.push(Some(Lowered::Tensor(self.tensor_arg(4, "running_var")?)));
            }
            return Ok(Lowered::Tuple(items));
        }
        let dims: Vec<usize> = (0..x.size.len()).filter(|&d| d != 1).collect();
        let (mean, var) = self.variance(&x, &dims, acc, 0.0);
        let rstd = rstd_of(var.clone());
        let y = Self::normalize_channels(&x, mean.clone(), rstd.clone(), w, b, out, acc);
        let m = self.finish_reduction(mean.clone(), m1)?;
        let r = self.finish_reduction(rstd, m2)?;
        let mut items = vec![Some(Lowered::Tensor(y)), Some(Lowered::Tensor(m)), Some(Lowered::Tensor(r))];
        if with_stats {
            let (Some(rm_meta), Some(rv_meta)) = (metas.get(3), metas.get(4)) else {
                return malformed("_native_batch_norm_legit_functional returns five tensors");
            };
            let momentum = self.float_arg(6, "momentum")?.unwrap_or(0.1);
            let n: i64 = dims.iter().map(|&d| x.size[d]).product();
            // running stats blend in the batch mean and the unbiased batch variance
            let unbias = if n > 1 { n as f64 / (n - 1) as f64 } else { f64::NAN };
            for (k, (stat, meta, scale)) in [(mean, rm_meta, 1.0), (var, rv_meta, unbias)].into_iter().enumerate() {
                let running = self.tensor_arg(3 + k, if k == 0 { "running_mean" } else { "running_var" })?;
                let stat = reshape(&stat, running.size.clone())?;
                let dt = meta.dtype;
                let sdt = dt.compute();
                let v =
                    pointwise(vec![PwIn::Tensor(running), PwIn::Tensor(stat)], meta.shape.clone(), dt, meta.device, sdt, move |bx, v| {
                        let r = bx.body.cast(v[0], sdt);
                        let s = bx.body.cast(v[1], sdt);
                        let keep = bx.body.constant(Scalar::Float(1.0 - momentum), sdt);
                        let take = bx.body.constant(Scalar::Float(momentum * scale), sdt);
                        let a = bx.body.binary(BinaryOp::Mul, r, keep);
                        let b = bx.body.binary(BinaryOp::Mul, s, take);
                        bx.body.binary(BinaryOp::Add, a, b)
                    });
                items.push(Some(Lowered::Tensor(v)));
            }
        }
        Ok(Lowered::Tuple(items))
    }

    fn empty_like_meta(&self, m: &TensorMeta) -> TensorValue {
        let dt = m.dtype;
        TensorValue {
            size: m.shape.clone(),
            dtype: dt,
            device: m.device,
            src: Src::Lazy { f: Rc::new(move |bx: &mut Bx, _: &[IndexExpr]| bx.body.constant(Scalar::Int(0), dt)), reads: 0, ops: 1 },
        }
    }

    /// native_group_norm: statistics per (sample, group) over the group's channels and space.
    pub(super) fn lower_group_norm(&mut self) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "input")?;
        let w = self.opt_tensor(1, "weight")?;
        let b = self.opt_tensor(2, "bias")?;
        let n = self.int_arg(3, "N")?.unwrap_or(0);
        let c = self.int_arg(4, "C")?.unwrap_or(0);
        let hw = self.int_arg(5, "HxW")?.unwrap_or(0);
        let g = self.int_arg(6, "group")?.unwrap_or(1);
        let eps = self.float_arg(7, "eps")?.unwrap_or(1e-5);
        let metas = self.tuple_metas()?;
        let (Some(out), Some(m1), Some(m2)) = (metas.first().cloned(), metas.get(1).cloned(), metas.get(2).cloned()) else {
            return malformed("group norm returns three tensors");
        };
        if g <= 0 || c % g != 0 || n * c * hw != x.numel() || (x.numel() == 0 && n != 0) {
            return unsupported("group norm with these sizes");
        }
        if n == 0 {
            // an empty batch: three empty results (a statistic of an empty group has no element)
            let items = [&out, &m1, &m2].map(|m| Some(Lowered::Tensor(self.empty_like_meta(m))));
            return Ok(Lowered::Tuple(items.into()));
        }
        let acc = out.dtype.compute();
        let channels_last = self.nhwc_value(&x.size);
        let channels_last_cpu = channels_last && self.kernels == KernelLanguage::Cpp;
        let (mean, rstd) = if channels_last && self.triton_kernels() {
            self.group_moments_of_channels(&x, g, acc, Some(eps))?
        } else if channels_last {
            // channels-last: a group's elements lie as rows of C/G channels, one per (h, w); a
            // reduction over the channels within the pixels reads them in memory order, where the
            // logical order would step by C elements
            let grouped = super::views::reshape(&x, vec![n, g, c / g, hw])?;
            let pixels_outer = super::views::permute(&grouped, &[0, 1, 3, 2]);
            self.moments(&pixels_outer, &[2, 3], acc, 0.0, Some(eps))
        } else {
            let grouped = super::views::reshape(&x, vec![n, g, (c / g) * hw])?;
            self.moments(&grouped, &[2], acc, 0.0, Some(eps))
        };
        let (cpg, dt) = (c / g, out.dtype);
        let y = if channels_last_cpu {
            self.group_norm_per_channel(&x, (&mean, &rstd), (w, b), cpg, (acc, dt))
        } else {
            group_norm_per_group(&x, (&mean, &rstd), (w, b), cpg, (acc, dt))
        };
        let m = self.finish_reduction(mean, &m1)?;
        let r = self.finish_reduction(rstd, &m2)?;
        Ok(Lowered::Tuple(vec![Some(Lowered::Tensor(y)), Some(Lowered::Tensor(m)), Some(Lowered::Tensor(r))]))
    }

    /// A channels-last group norm's (mean, variance) per (sample, group), or (mean, rstd) with
    /// `rstd_eps`, from the moments of each
    /// channel over a chunk of the pixels, combined exactly (Chan et al.; the chunks hold equal
    /// counts): the group's mean is the mean of the chunks' means, its variance the mean of
    /// `var_k + (mean_k - mean_g)²`. The chunk moments are a reduction whose rows, consecutive
    /// channels, lie side by side in memory (as a channels-last batch norm's) and are read in
    /// whole lines; reducing a group's elements directly reads C/G channels of every pixel's row
    /// of C (an H100: 14 us a call for 8x128x64x64 bf16 statistics in 32 groups). Two kernels, as the
    /// direct reduction split over the GPU takes.
    fn group_moments_of_channels(
        &mut self,
        x: &TensorValue,
        g: i64,
        acc: DType,
        rstd_eps: Option<f64>,
    ) -> LResult<(TensorValue, TensorValue)> {
        let (n, c, device) = (x.size[0], x.size[1], x.device);
        let (cpg, hw) = (c / g, x.size[2..].iter().product::<i64>());
        let chunks = pixel_chunks(hw);
        let per_chunk = super::views::reshape(x, vec![n, c, chunks, hw / chunks])?;
        let rows = super::views::permute(&per_chunk, &[0, 2, 1, 3]); // [N, chunks, C, pixels]: channels inner
        let (chunk_mean, chunk_var) = self.moments(&rows, &[3], acc, 0.0, None);
        let grouped = [n, g, chunks, cpg];
        let per = Scalar::Float(1.0 / (chunks * cpg) as f64);
        // (sample, group, chunk, k) -> the chunk moments' (sample, chunk, group * C/G + k)
        let at = move |full: &[IndexExpr]| [full[0].clone(), full[2].clone(), full[1].scale(cpg).add(&full[3])];
        let mk = chunk_mean.clone();
        let mean = self.reduce_node(&grouped, &[2, 3], acc, device, move |bx, full, _| {
            let v = mk.load(bx, &at(full));
            let s = bx.body.reduce(ReduceOp::Sum, v);
            let k = bx.body.constant(per, acc);
            bx.body.binary(BinaryOp::Mul, s, k)
        });
        let (mk, vk, mg) = (chunk_mean, chunk_var, mean.clone());
        let second = self.reduce_node(&grouped, &[2, 3], acc, device, move |bx, full, kept| {
            let i = at(full);
            let m = mk.load(bx, &i);
            let v = vk.load(bx, &i);
            let mu = mg.load(bx, kept);
            let d = bx.body.binary(BinaryOp::Sub, m, mu);
            let d2 = bx.body.binary(BinaryOp::Mul, d, d);
            let t = bx.body.binary(BinaryOp::Add, v, d2);
            let s = bx.body.reduce(ReduceOp::Sum, t);
            let k = bx.body.constant(per, acc);
            let var = bx.body.binary(BinaryOp::Mul, s, k);
            let Some(eps) = rstd_eps else { return var };
            let e = bx.body.constant(Scalar::Float(eps), acc);
            let ve = bx.body.binary(BinaryOp::Add, var, e);
            bx.body.unary(UnaryOp::Rsqrt, ve)
        });
        Ok((mean, second))
    }

    /// A channels-last CPU group norm applied as `x * scale + shift`, with `scale` and `shift`
    /// per (sample, channel) written first (N x C values): the kernel over the pixels then reads
    /// them in channel order, where the group statistics would be gathered at `channel / (C / G)`
    /// in its vector loop. Eager's CPU kernel computes the same form.
    fn group_norm_per_channel(
        &mut self,
        x: &TensorValue,
        (mean, rstd): (&TensorValue, &TensorValue),
        (w, b): (Option<TensorValue>, Option<TensorValue>),
        cpg: i64,
        (acc, dt): (DType, DType),
    ) -> TensorValue {
        let (n, c, device) = (x.size[0], x.size[1], x.device);
        let group = move |bx: &Bx, idx: &[IndexExpr]| [idx[0].clone(), idx[1].floordiv(cpg, &bx.ranges)];
        let rs = rstd.clone();
        let scale = TensorValue::lazy(vec![n, c], acc, device, 2, 2, move |bx, idx| {
            let s = rs.load(bx, &group(bx, idx));
            let Some(w) = &w else { return s };
            let wv = w.load(bx, &idx[1..2]);
            let wv = bx.body.cast(wv, acc);
            bx.body.binary(BinaryOp::Mul, s, wv)
        });
        let scale = self.realize(&scale);
        let (mm, sc) = (mean.clone(), scale.clone());
        let shift = TensorValue::lazy(vec![n, c], acc, device, 3, 3, move |bx, idx| {
            let m = mm.load(bx, &group(bx, idx));
            let s = sc.load(bx, idx);
            let ms = bx.body.binary(BinaryOp::Mul, m, s);
            let Some(b) = &b else { return bx.body.unary(UnaryOp::Neg, ms) };
            let bv = b.load(bx, &idx[1..2]);
            let bv = bx.body.cast(bv, acc);
            bx.body.binary(BinaryOp::Sub, bv, ms)
        });
        let shift = self.realize(&shift);
        let xs = x.clone();
        TensorValue::lazy(x.size.clone(), dt, device, 3, 4, move |bx, idx| {
            let per_channel = [idx[0].clone(), idx[1].clone()];
            let v = xs.load(bx, idx);
            let v = bx.body.cast(v, acc);
            let s = scale.load(bx, &per_channel);
            let t = shift.load(bx, &per_channel);
            let o = bx.body.binary(BinaryOp::Mul, v, s);
            let o = bx.body.binary(BinaryOp::Add, o, t);
            bx.body.cast(o, dt)
        })
    }
}

/// A biased variance of `count` elements as one with `correction` (`var * n / (n - correction)`).
fn unbias(var: TensorValue, count: f64, correction: f64) -> TensorValue {
    if correction == 0.0 {
        return var;
    }
    let k = count / (count - correction).max(0.0);
    let (size, dt, device) = (var.size.clone(), var.dtype, var.device);
    pointwise(vec![PwIn::Tensor(var)], size, dt, device, dt, move |bx, v| {
        let c = bx.body.constant(Scalar::Float(k), dt);
        bx.body.binary(BinaryOp::Mul, v[0], c)
    })
}

/// Pixels of a channels-last group norm's chunk: the most chunks that divide the pixels and
/// keep at least `CHUNK_PIXELS` in each (a row of the chunk moments' reduction long enough to
/// loop over; their number gives the GPU its programs).
const CHUNK_PIXELS: i64 = 256;

fn pixel_chunks(hw: i64) -> i64 {
    (1..=hw / CHUNK_PIXELS).rev().find(|&k| hw % k == 0).unwrap_or(1)
}

/// A group norm applied with the group statistics read per element: `(x - mean) * rstd`, then
/// the channel's weight and bias.
fn group_norm_per_group(
    x: &TensorValue,
    (mean, rstd): (&TensorValue, &TensorValue),
    (w, b): (Option<TensorValue>, Option<TensorValue>),
    cpg: i64,
    (acc, dt): (DType, DType),
) -> TensorValue {
    let (xs, mm, rs) = (x.clone(), mean.clone(), rstd.clone());
    TensorValue::lazy(x.size.clone(), dt, x.device, 5, 8, move |bx, idx| {
        let ch = idx[1].clone();
        let grp = [idx[0].clone(), ch.floordiv(cpg, &bx.ranges)];
        let v = xs.load(bx, idx);
        let v = bx.body.cast(v, acc);
        let m = mm.load(bx, &grp);
        let s = rs.load(bx, &grp);
        let d = bx.body.binary(BinaryOp::Sub, v, m);
        let mut o = bx.body.binary(BinaryOp::Mul, d, s);
        if let Some(w) = &w {
            let wv = w.load(bx, std::slice::from_ref(&ch));
            let wv = bx.body.cast(wv, acc);
            o = bx.body.binary(BinaryOp::Mul, o, wv);
        }
        if let Some(b) = &b {
            let bv = b.load(bx, std::slice::from_ref(&ch));
            let bv = bx.body.cast(bv, acc);
            o = bx.body.binary(BinaryOp::Add, o, bv);
        }
        bx.body.cast(o, dt)
    })
}

impl Ctx<'_> {
    /// native_layer_norm_backward: with x̂ = (x − mean)·rstd and g = dy·w over the N normalized
    /// elements of a row, dx = rstd/N · (N·g − Σg − x̂·Σ(g·x̂)); dw = Σ_rows dy·x̂; db = Σ_rows dy.
    pub(super) fn lower_layer_norm_backward(&mut self) -> LResult<Lowered> {
        let dy = self.tensor_arg(0, "grad_out")?;
        let x = self.tensor_arg(1, "input")?;
        let normalized = self.ints_arg(2, "normalized_shape")?.unwrap_or_default();
        let mean = self.tensor_arg(3, "mean")?;
        let rstd = self.tensor_arg(4, "rstd")?;
        let w = self.opt_tensor(5, "weight")?;
        let metas: Vec<Option<TensorMeta>> = match self.meta() {
            Meta::Tuple(items) => items.iter().map(|m| m.as_ref().and_then(|m| m.tensor().cloned())).collect(),
            _ => return malformed("native_layer_norm_backward returns a tuple"),
        };
        let rank = x.size.len();
        let k = normalized.len();
        if k > rank || x.size[rank - k..] != normalized[..] || dy.size != x.size {
            return malformed("layer norm backward shapes do not match");
        }
        let axis = rank - k;
        let n: i64 = normalized.iter().product();
        let acc = x.dtype.compute();
        let stat_idx = move |idx: &[IndexExpr]| -> Vec<IndexExpr> {
            idx.iter().enumerate().map(|(d, e)| if d < axis { e.clone() } else { IndexExpr::zero() }).collect()
        };
        // x̂ and g as lazy values over the full index
        let (xs, ms, rs) = (x.clone(), mean.clone(), rstd.clone());
        let xhat = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| -> ValueId {
            let s = stat_idx(idx);
            let v = xs.load(bx, idx);
            let v = bx.body.cast(v, acc);
            let m = ms.load(bx, &s);
            let m = bx.body.cast(m, acc);
            let r = rs.load(bx, &s);
            let r = bx.body.cast(r, acc);
            let d = bx.body.binary(BinaryOp::Sub, v, m);
            bx.body.binary(BinaryOp::Mul, d, r)
        });
        let (dys, ws) = (dy.clone(), w.clone());
        let g = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| -> ValueId {
            let d = dys.load(bx, idx);
            let d = bx.body.cast(d, acc);
            match &ws {
                Some(w) => {
                    let wv = w.load(bx, &idx[axis..]);
                    let wv = bx.body.cast(wv, acc);
                    bx.body.binary(BinaryOp::Mul, d, wv)
                }
                None => d,
            }
        });
        let row_dims: Vec<usize> = (axis..rank).collect();
        let col_dims: Vec<usize> = (0..axis).collect();
        let mut items: Vec<Option<Lowered>> = vec![None, None, None];
        if let Some(Some(m0)) = metas.first() {
            let g1 = g.clone();
            let s1 = self.reduce_node(&x.size, &row_dims, acc, x.device, move |bx, full, _| {
                let v = g1(bx, full);
                bx.body.reduce(ReduceOp::Sum, v)
            });
            let (g2, xh2) = (g.clone(), xhat.clone());
            let s2 = self.reduce_node(&x.size, &row_dims, acc, x.device, move |bx, full, _| {
                let a = g2(bx, full);
                let b = xh2(bx, full);
                let p = bx.body.binary(BinaryOp::Mul, a, b);
                bx.body.reduce(ReduceOp::Sum, p)
            });
            let (g3, xh3, rs3, dt) = (g.clone(), xhat.clone(), rstd.clone(), m0.dtype);
            let dx = TensorValue {
                size: x.size.clone(),
                dtype: dt,
                device: x.device,
                src: Src::Lazy {
                    f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                        let rows = &idx[..axis];
                        let gv = g3(bx, idx);
                        let xh = xh3(bx, idx);
                        let a = s1.load(bx, rows);
                        let b = s2.load(bx, rows);
                        let st: Vec<IndexExpr> =
                            idx.iter().enumerate().map(|(d, e)| if d < axis { e.clone() } else { IndexExpr::zero() }).collect();
                        let r = rs3.load(bx, &st);
                        let r = bx.body.cast(r, acc);
                        let nn = bx.body.constant(Scalar::Float(n as f64), acc);
                        let t = bx.body.binary(BinaryOp::Mul, gv, nn);
                        let t = bx.body.binary(BinaryOp::Sub, t, a);
                        let xb = bx.body.binary(BinaryOp::Mul, xh, b);
                        let t = bx.body.binary(BinaryOp::Sub, t, xb);
                        let scale = bx.body.binary(BinaryOp::TrueDiv, r, nn);
                        let o = bx.body.binary(BinaryOp::Mul, t, scale);
                        bx.body.cast(o, dt)
                    }),
                    reads: 6,
                    ops: 16,
                },
            };
            items[0] = Some(Lowered::Tensor(dx));
        }
        if let Some(Some(m1)) = metas.get(1) {
            let (dys, xh) = (dy.clone(), xhat.clone());
            let dw = self.reduce_node(&x.size, &col_dims, acc, x.device, move |bx, full, _| {
                let d = dys.load(bx, full);
                let d = bx.body.cast(d, acc);
                let h = xh(bx, full);
                let p = bx.body.binary(BinaryOp::Mul, d, h);
                bx.body.reduce(ReduceOp::Sum, p)
            });
            items[1] = Some(Lowered::Tensor(self.finish_reduction(dw, m1)?));
        }
        if let Some(Some(m2)) = metas.get(2) {
            let dys = dy.clone();
            let db = self.reduce_node(&x.size, &col_dims, acc, x.device, move |bx, full, _| {
                let d = dys.load(bx, full);
                let d = bx.body.cast(d, acc);
                bx.body.reduce(ReduceOp::Sum, d)
            });
            items[2] = Some(Lowered::Tensor(self.finish_reduction(db, m2)?));
        }
        Ok(Lowered::Tuple(items))
    }
}

impl Ctx<'_> {
    /// native_group_norm_backward: with x viewed as [N, G, D, HxW], x̂ = (x − mean)·rstd and
    /// g = dy·w, dx = rstd·(g − mean_group(g) − x̂·mean_group(g·x̂)); dw and db sum dy·x̂ and dy
    /// over samples and space.
    pub(super) fn lower_group_norm_backward(&mut self) -> LResult<Lowered> {
        let dy = self.tensor_arg(0, "grad_out")?;
        let x = self.tensor_arg(1, "input")?;
        let mean = self.tensor_arg(2, "mean")?;
        let rstd = self.tensor_arg(3, "rstd")?;
        let w = self.opt_tensor(4, "weight")?;
        let n = self.int_arg(5, "N")?.unwrap_or(0);
        let c = self.int_arg(6, "C")?.unwrap_or(0);
        let hw = self.int_arg(7, "HxW")?.unwrap_or(0);
        let g = self.int_arg(8, "group")?.unwrap_or(1);
        let metas: Vec<Option<TensorMeta>> = match self.meta() {
            Meta::Tuple(items) => items.iter().map(|m| m.as_ref().and_then(|m| m.tensor().cloned())).collect(),
            _ => return malformed("native_group_norm_backward returns a tuple"),
        };
        if g <= 0 || c % g != 0 || n * c * hw != x.numel() || dy.size != x.size {
            return malformed("group norm backward shapes do not match");
        }
        if n * c * hw == 0 {
            return unsupported("group norm backward of an empty tensor");
        }
        let d = c / g;
        let shape4 = vec![n, g, d, hw];
        let x4 = reshape(&x, shape4.clone())?;
        let dy4 = reshape(&dy, shape4.clone())?;
        let acc = x.dtype.compute();
        let stat = move |bx: &mut Bx, t: &TensorValue, idx: &[IndexExpr]| -> ValueId {
            let v = t.load(bx, &idx[..2]);
            bx.body.cast(v, acc)
        };
        let (xs, ms, rs) = (x4.clone(), mean.clone(), rstd.clone());
        let xhat = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| -> ValueId {
            let v = xs.load(bx, idx);
            let v = bx.body.cast(v, acc);
            let m = stat(bx, &ms, idx);
            let r = stat(bx, &rs, idx);
            let t = bx.body.binary(BinaryOp::Sub, v, m);
            bx.body.binary(BinaryOp::Mul, t, r)
        });
        let (dys, ws) = (dy4.clone(), w.clone());
        let gw = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| -> ValueId {
            let v = dys.load(bx, idx);
            let v = bx.body.cast(v, acc);
            match &ws {
                Some(w) => {
                    let ch = idx[1].scale(d).add(&idx[2]);
                    let wv = w.load(bx, &[ch]);
                    let wv = bx.body.cast(wv, acc);
                    bx.body.binary(BinaryOp::Mul, v, wv)
                }
                None => v,
            }
        });
        let mut items: Vec<Option<Lowered>> = vec![None, None, None];
        if let Some(Some(m0)) = metas.first() {
            let g1 = gw.clone();
            let s1 = self.reduce_node(&shape4, &[2, 3], acc, x.device, move |bx, full, _| {
                let v = g1(bx, full);
                bx.body.reduce(ReduceOp::Sum, v)
            });
            let (g2, xh2) = (gw.clone(), xhat.clone());
            let s2 = self.reduce_node(&shape4, &[2, 3], acc, x.device, move |bx, full, _| {
                let a = g2(bx, full);
                let b = xh2(bx, full);
                let p = bx.body.binary(BinaryOp::Mul, a, b);
                bx.body.reduce(ReduceOp::Sum, p)
            });
            let (g3, xh3, rs3, dt) = (gw.clone(), xhat.clone(), rstd.clone(), m0.dtype);
            let count = (d * hw) as f64;
            let dx4 = TensorValue {
                size: shape4.clone(),
                dtype: dt,
                device: x.device,
                src: Src::Lazy {
                    f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                        let gv = g3(bx, idx);
                        let xh = xh3(bx, idx);
                        let a = s1.load(bx, &idx[..2]);
                        let b = s2.load(bx, &idx[..2]);
                        let r = stat(bx, &rs3, idx);
                        let nn = bx.body.constant(Scalar::Float(count), acc);
                        let ma = bx.body.binary(BinaryOp::TrueDiv, a, nn);
                        let mb = bx.body.binary(BinaryOp::TrueDiv, b, nn);
                        let t = bx.body.binary(BinaryOp::Sub, gv, ma);
                        let xb = bx.body.binary(BinaryOp::Mul, xh, mb);
                        let t = bx.body.binary(BinaryOp::Sub, t, xb);
                        let o = bx.body.binary(BinaryOp::Mul, t, r);
                        bx.body.cast(o, dt)
                    }),
                    reads: 6,
                    ops: 16,
                },
            };
            items[0] = Some(Lowered::Tensor(reshape(&dx4, x.size.clone())?));
        }
        // per-channel sums over samples and space: reduce [N, G, D, HxW] over N and HxW
        if let Some(Some(m1)) = metas.get(1) {
            let (dys, xh) = (dy4.clone(), xhat.clone());
            let dw = self.reduce_node(&shape4, &[0, 3], acc, x.device, move |bx, full, _| {
                let v = dys.load(bx, full);
                let v = bx.body.cast(v, acc);
                let h = xh(bx, full);
                let p = bx.body.binary(BinaryOp::Mul, v, h);
                bx.body.reduce(ReduceOp::Sum, p)
            });
            items[1] = Some(Lowered::Tensor(self.finish_reduction(dw, m1)?));
        }
        if let Some(Some(m2)) = metas.get(2) {
            let dys = dy4.clone();
            let db = self.reduce_node(&shape4, &[0, 3], acc, x.device, move |bx, full, _| {
                let v = dys.load(bx, full);
                let v = bx.body.cast(v, acc);
                bx.body.reduce(ReduceOp::Sum, v)
            });
            items[2] = Some(Lowered::Tensor(self.finish_reduction(db, m2)?));
        }
        Ok(Lowered::Tuple(items))
    }
}

impl Ctx<'_> {
    /// _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim): each input gets size-1 dims
    /// inserted at its `expand` positions, the three are multiplied with broadcasting and the
    /// product is summed over `sumdim` (those dims are dropped).
    pub(super) fn lower_trilinear(&mut self) -> LResult<TensorValue> {
        let ins = [self.tensor_arg(0, "i1")?, self.tensor_arg(1, "i2")?, self.tensor_arg(2, "i3")?];
        let expands = [
            self.ints_arg(3, "expand1")?.unwrap_or_default(),
            self.ints_arg(4, "expand2")?.unwrap_or_default(),
            self.ints_arg(5, "expand3")?.unwrap_or_default(),
        ];
        let sumdim = self.ints_arg(6, "sumdim")?.unwrap_or_default();
        let out = self.out_meta()?.clone();
        let total = ins[0].size.len() + expands[0].len();
        let mut shaped = Vec::new();
        for (t, ex) in ins.iter().zip(&expands) {
            if t.size.len() + ex.len() != total {
                return malformed("_trilinear inputs do not expand to one rank");
            }
            let mut size = Vec::with_capacity(total);
            let mut it = t.size.iter();
            for d in 0..total as i64 {
                size.push(if ex.contains(&d) { 1 } else { *it.next().unwrap_or(&1) });
            }
            shaped.push(reshape(t, size)?);
        }
        let shapes: Vec<&[i64]> = shaped.iter().map(|t| t.size.as_slice()).collect();
        let full = super::pointwise::broadcast_shapes(&shapes)?;
        let dims: Vec<usize> = sumdim.iter().map(|&d| norm_dim(d, total)).collect::<LResult<_>>()?;
        let acc = out.dtype.compute();
        let prod = self.reduce_node(&full, &dims, acc, out.device, move |bx, idx, _| {
            let mut p: Option<ValueId> = None;
            for t in &shaped {
                let v = t.load(bx, &super::pointwise::broadcast_index(&t.size, idx));
                let v = bx.body.cast(v, acc);
                p = Some(match p {
                    Some(q) => bx.body.binary(BinaryOp::Mul, q, v),
                    None => v,
                });
            }
            let p = p.unwrap_or_else(|| bx.body.constant(Scalar::Int(1), acc));
            bx.body.reduce(ReduceOp::Sum, p)
        });
        self.finish_reduction(prod, &out)
    }
}
