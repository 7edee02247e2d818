//! Random tensors: rand, randn and native_dropout. Each op draws one 64-bit seed from torch's
//! default generator in the wrapper (an extern `torch.randint` call, so `torch.manual_seed`
//! makes runs reproducible) and its kernel computes element i as Philox(seed, i).

use super::*;

impl Ctx<'_> {
    /// A 0-d int64 buffer holding a fresh seed, drawn on `device` (from its default generator)
    /// when the wrapper runs.
    fn seed_buffer(&mut self, device: &Device) -> BufferId {
        let call = self.prog.externs.len();
        let layout = Layout { size: vec![], stride: vec![], offset: 0, dtype: DType::I64, device: *device };
        let buf = self.prog.add_buffer(layout, BufferSource::Extern { call, item: None });
        let lit = ExternArg::Literal;
        self.prog.externs.push(ExternCall {
            callee: "torch.randint".into(),
            args: vec![lit(Literal::Int(i64::MIN)), lit(Literal::Int(i64::MAX)), lit(Literal::Shape(vec![]))],
            kwargs: vec![("dtype".into(), lit(Literal::DType(DType::I64))), ("device".into(), lit(Literal::Str(device.to_string())))],
            outputs: vec![buf],
            fallback: false,
            origin: self.node_name(),
            reason: None,
            // torch's CUDA generator advances its Philox offset at every replay
            capture_hazard: None,
        });
        self.prog.steps.push(Step::Extern(call));
        buf
    }

    /// Uniform [0, 1) or standard-normal values over `size`, one stream element per element.
    fn random_values(&mut self, size: &[i64], normal: bool, device: &Device) -> TensorValue {
        let seed = self.seed_buffer(device);
        let strides = contiguous_strides(size);
        TensorValue {
            size: size.to_vec(),
            dtype: DType::F32,
            device: *device,
            src: Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let s = bx.body.load(seed, IndexExpr::zero(), DType::I64);
                    let mut flat = IndexExpr::zero();
                    for (i, st) in idx.iter().zip(&strides) {
                        flat = flat.add(&i.scale(*st));
                    }
                    let o = bx.body.index(flat, DType::I64);
                    bx.body.random(normal, s, o)
                }),
                reads: 1,
                ops: 30,
            },
        }
    }

    pub(super) fn lower_random(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let out = self.out_meta()?.clone();
        if !out.dtype.is_float() {
            return unsupported(format!("random {} values", out.dtype));
        }
        if self.arg(usize::MAX, "generator").is_some_and(|g| *g != Arg::None) {
            return unsupported("an explicit generator");
        }
        let normal = matches!(op, AtenOp::Randn | AtenOp::RandnLike);
        let r = self.random_values(&out.shape, normal, &out.device);
        let dt = out.dtype;
        // bernoulli(x, p): 1 with probability p
        let p = if op == AtenOp::BernoulliP { Some(self.float_arg(1, "p")?.unwrap_or(0.5)) } else { None };
        let f = match r.src {
            Src::Lazy { f, .. } => f,
            Src::View { .. } => return malformed("random values must be lazy"),
        };
        Ok(TensorValue {
            size: out.shape.clone(),
            dtype: dt,
            device: out.device,
            src: Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let v = f(bx, idx);
                    let v = match p {
                        Some(p) => {
                            let pc = bx.body.constant(Scalar::Float(p), DType::F32);
                            bx.body.binary(BinaryOp::Lt, v, pc)
                        }
                        None => v,
                    };
                    bx.body.cast(v, dt)
                }),
                reads: 1,
                ops: 31,
            },
        })
    }

    /// native_dropout(x, p, train) -> (x·keep/(1-p), keep) with keep = rand >= p.
    pub(super) fn lower_dropout(&mut self) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "input")?;
        let p = self.float_arg(1, "p")?.unwrap_or(0.5);
        let train = self.bool_arg(2, "train", true)?;
        if !train {
            return unsupported("native_dropout with train=False");
        }
        if !x.dtype.is_float() {
            return unsupported("dropout of a non-float tensor");
        }
        let r = self.random_values(&x.size, false, &x.device);
        let cd = x.dtype.compute();
        let scale = if p < 1.0 { 1.0 / (1.0 - p) } else { 0.0 };
        let keep = {
            let r = r.clone();
            TensorValue {
                size: x.size.clone(),
                dtype: DType::Bool,
                device: x.device,
                src: Src::Lazy {
                    f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                        let u = r.load(bx, idx);
                        let pc = bx.body.constant(Scalar::Float(p), DType::F32);
                        bx.body.binary(BinaryOp::Ge, u, pc)
                    }),
                    reads: 1,
                    ops: 32,
                },
            }
        };
        let (k2, xs) = (keep.clone(), x.clone());
        let out = TensorValue {
            size: x.size.clone(),
            dtype: x.dtype,
            device: x.device,
            src: Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let k = k2.load(bx, idx);
                    let v = xs.load(bx, idx);
                    let v = bx.body.cast(v, cd);
                    let s = bx.body.constant(Scalar::Float(scale), cd);
                    let z = bx.body.constant(Scalar::Float(0.0), cd);
                    let kept = bx.body.binary(BinaryOp::Mul, v, s);
                    let r = bx.body.where_(k, kept, z);
                    bx.body.cast(r, xs.dtype)
                }),
                reads: 2,
                ops: 36,
            },
        };
        Ok(Lowered::Tuple(vec![Some(Lowered::Tensor(out)), Some(Lowered::Tensor(keep))]))
    }
}

impl Ctx<'_> {
    /// rrelu_with_noise_functional(x, noise, lower, upper, training) -> (out, noise'): in
    /// training, each non-positive element is scaled by a uniform draw from [lower, upper),
    /// which is also the new noise (1 elsewhere); in eval, by the mean slope.
    pub(super) fn lower_rrelu(&mut self) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "self")?;
        let noise = self.tensor_arg(1, "noise")?;
        let lower = self.float_arg(2, "lower")?.unwrap_or(1.0 / 8.0);
        let upper = self.float_arg(3, "upper")?.unwrap_or(1.0 / 3.0);
        let training = self.bool_arg(4, "training", false)?;
        if self.arg(usize::MAX, "generator").is_some_and(|g| *g != Arg::None) {
            return unsupported("an explicit generator");
        }
        if !x.dtype.is_float() {
            return unsupported("rrelu of a non-float tensor");
        }
        let cd = x.dtype.compute();
        let dt = x.dtype;
        if !training {
            let slope = (lower + upper) / 2.0;
            let xs = x.clone();
            let out = TensorValue::lazy(x.size.clone(), dt, x.device, 1, 4, move |bx, idx| {
                let v = xs.load(bx, idx);
                let v = bx.body.cast(v, cd);
                let z = bx.body.constant(Scalar::Float(0.0), cd);
                let s = bx.body.constant(Scalar::Float(slope), cd);
                let pos = bx.body.binary(BinaryOp::Gt, v, z);
                let neg = bx.body.binary(BinaryOp::Mul, v, s);
                let r = bx.body.where_(pos, v, neg);
                bx.body.cast(r, dt)
            });
            return Ok(Lowered::Tuple(vec![Some(Lowered::Tensor(out)), Some(Lowered::Tensor(noise))]));
        }
        let u = self.random_values(&x.size, false, &x.device);
        let ndt = noise.dtype;
        // the slope of each element: a draw where x <= 0, 1 elsewhere
        let slope = {
            let (u, xs) = (u.clone(), x.clone());
            Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| -> (ValueId, ValueId) {
                let r = u.load(bx, idx);
                let r = bx.body.cast(r, cd);
                let lo = bx.body.constant(Scalar::Float(lower), cd);
                let span = bx.body.constant(Scalar::Float(upper - lower), cd);
                let r = bx.body.binary(BinaryOp::Mul, r, span);
                let r = bx.body.binary(BinaryOp::Add, r, lo);
                let v = xs.load(bx, idx);
                let v = bx.body.cast(v, cd);
                let z = bx.body.constant(Scalar::Float(0.0), cd);
                let one = bx.body.constant(Scalar::Float(1.0), cd);
                let neg = bx.body.binary(BinaryOp::Le, v, z);
                (v, bx.body.where_(neg, r, one))
            })
        };
        let s1 = slope.clone();
        let out = TensorValue::lazy(x.size.clone(), dt, x.device, 2, 40, move |bx, idx| {
            let (v, s) = s1(bx, idx);
            let r = bx.body.binary(BinaryOp::Mul, v, s);
            bx.body.cast(r, dt)
        });
        let new_noise = TensorValue::lazy(x.size.clone(), ndt, x.device, 2, 40, move |bx, idx| {
            let (_, s) = slope(bx, idx);
            bx.body.cast(s, ndt)
        });
        Ok(Lowered::Tuple(vec![Some(Lowered::Tensor(out)), Some(Lowered::Tensor(new_noise))]))
    }
}
