//! Elementwise lowerings: unary math, binary arithmetic and comparisons, where, clamp, casts.
//! All of them build one lazy `TensorValue` over the broadcast output index.

use super::*;
use crate::graph::{result_type, Category, Operand};

/// An elementwise function of a node's input values, in the loop body being built.
type ValueFn = Box<dyn Fn(&mut Bx, &[ValueId]) -> ValueId>;

/// An elementwise operand: a tensor or a Python scalar from the graph.
#[derive(Clone)]
pub enum PwIn {
    Tensor(TensorValue),
    Scalar(Scalar),
}

impl PwIn {
    fn operand(&self) -> Operand {
        match self {
            PwIn::Tensor(t) => Operand::Tensor { dtype: t.dtype, zero_dim: t.size.is_empty() },
            PwIn::Scalar(Scalar::Bool(_)) => Operand::Scalar(Category::Bool),
            PwIn::Scalar(Scalar::Int(_)) => Operand::Scalar(Category::Int),
            PwIn::Scalar(Scalar::Float(_)) => Operand::Scalar(Category::Float),
        }
    }
}

pub fn broadcast_shapes(shapes: &[&[i64]]) -> LResult<Vec<i64>> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1i64; rank];
    for s in shapes {
        let off = rank - s.len();
        for (i, &d) in s.iter().enumerate() {
            let o = &mut out[off + i];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                return malformed(format!("shapes {shapes:?} do not broadcast"));
            }
        }
    }
    Ok(out)
}

/// Index into `size` for an element of the broadcast output index `idx`.
pub fn broadcast_index(size: &[i64], idx: &[IndexExpr]) -> Vec<IndexExpr> {
    let off = idx.len() - size.len();
    size.iter().enumerate().map(|(i, &d)| if d == 1 { IndexExpr::zero() } else { idx[off + i].clone() }).collect()
}

/// A lazy elementwise value: `f` receives each input loaded (tensors) or materialized as a
/// constant of `scalar_dtype` (scalars) and returns the result, which is cast to `out_dtype`.
pub fn pointwise(
    inputs: Vec<PwIn>,
    out_size: Vec<i64>,
    out_dtype: DType,
    device: Device,
    scalar_dtype: DType,
    f: impl Fn(&mut Bx, &[ValueId]) -> ValueId + 'static,
) -> TensorValue {
    let mut reads = 0;
    let mut ops = 1;
    for i in &inputs {
        if let PwIn::Tensor(t) = i {
            let (r, o) = t.cost();
            reads += r;
            ops += o;
        }
    }
    let f = Rc::new(f);
    TensorValue {
        size: out_size,
        dtype: out_dtype,
        device,
        src: Src::Lazy {
            f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                let vals: Vec<ValueId> = inputs
                    .iter()
                    .map(|i| match i {
                        PwIn::Tensor(t) => {
                            let bidx = broadcast_index(&t.size, idx);
                            let v = t.load(bx, &bidx);
                            // a half-type value kept in float is rounded where it meets a wider
                            // type (promotion, an explicit conversion): eager holds it rounded
                            if rounds_half_operand(t.dtype, out_dtype) {
                                bx.body.cast(v, t.dtype)
                            } else {
                                v
                            }
                        }
                        PwIn::Scalar(s) => bx.body.constant(*s, scalar_dtype),
                    })
                    .collect();
                let r = f(bx, &vals);
                // a half-type result stays in float inside the kernel: only stores and explicit
                // conversions round it (ATen's fused kernels and Inductor do the same)
                if out_dtype.compute() != out_dtype && bx.body.dtype(r) == out_dtype.compute() {
                    return r;
                }
                bx.body.cast(r, out_dtype)
            }),
            reads,
            ops,
        },
    }
}

impl Ctx<'_> {
    pub fn pw_arg(&self, i: usize, key: &str) -> LResult<PwIn> {
        match self.arg(i, key) {
            Some(Arg::Node(n)) => Ok(PwIn::Tensor(self.tensor_of(*n)?)),
            Some(Arg::Int(v)) => Ok(PwIn::Scalar(Scalar::Int(*v))),
            Some(Arg::Float(v)) => Ok(PwIn::Scalar(Scalar::Float(*v))),
            Some(Arg::Bool(v)) => Ok(PwIn::Scalar(Scalar::Bool(*v))),
            other => malformed(format!("argument {i} ({key}) must be a tensor or number, got {other:?}")),
        }
    }

    fn out_shape_of(&self, inputs: &[PwIn]) -> LResult<Vec<i64>> {
        let shapes: Vec<&[i64]> = inputs
            .iter()
            .filter_map(|i| match i {
                PwIn::Tensor(t) => Some(t.size.as_slice()),
                PwIn::Scalar(_) => None,
            })
            .collect();
        let shape = broadcast_shapes(&shapes)?;
        if let Some(m) = self.meta().tensor() {
            if m.shape != shape {
                return malformed(format!("broadcast shape {shape:?} differs from metadata {:?}", m.shape));
            }
        }
        Ok(shape)
    }

    pub(super) fn lower_unary(&mut self, op: AtenOp) -> LResult<TensorValue> {
        use AtenOp as A;
        let x = self.pw_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let size = self.out_shape_of(std::slice::from_ref(&x))?;
        let cd = out.dtype.compute();
        let in_dtype = match &x {
            PwIn::Tensor(t) => t.dtype,
            PwIn::Scalar(_) => cd,
        };
        let simple = |u: UnaryOp| -> ValueFn {
            Box::new(move |bx: &mut Bx, v: &[ValueId]| {
                let x = bx.body.cast(v[0], cd);
                bx.body.unary(u, x)
            })
        };
        let f: ValueFn = match op {
            A::Abs => simple(UnaryOp::Abs),
            A::Neg => simple(UnaryOp::Neg),
            A::Exp => simple(UnaryOp::Exp),
            A::Exp2 => simple(UnaryOp::Exp2),
            A::Expm1 => simple(UnaryOp::Expm1),
            A::Log => simple(UnaryOp::Log),
            A::Log2 => simple(UnaryOp::Log2),
            A::Log10 => simple(UnaryOp::Log10),
            A::Log1p => simple(UnaryOp::Log1p),
            A::Sqrt => simple(UnaryOp::Sqrt),
            A::Rsqrt => simple(UnaryOp::Rsqrt),
            A::Sin => simple(UnaryOp::Sin),
            A::Cos => simple(UnaryOp::Cos),
            A::Tan => simple(UnaryOp::Tan),
            A::Asin => simple(UnaryOp::Asin),
            A::Acos => simple(UnaryOp::Acos),
            A::Atan => simple(UnaryOp::Atan),
            A::Sinh => simple(UnaryOp::Sinh),
            A::Cosh => simple(UnaryOp::Cosh),
            A::Tanh => simple(UnaryOp::Tanh),
            A::Asinh => simple(UnaryOp::Asinh),
            A::Acosh => simple(UnaryOp::Acosh),
            A::Atanh => simple(UnaryOp::Atanh),
            A::Sigmoid => simple(UnaryOp::Sigmoid),
            A::Relu => simple(UnaryOp::Relu),
            A::Erf => simple(UnaryOp::Erf),
            A::Erfc => simple(UnaryOp::Erfc),
            A::Lgamma => simple(UnaryOp::Lgamma),
            A::SpecialErfcx => simple(UnaryOp::Erfcx),
            A::Floor => simple(UnaryOp::Floor),
            A::Ceil => simple(UnaryOp::Ceil),
            A::Round => {
                if self.arg(1, "decimals").is_some() {
                    return unsupported("round with decimals");
                }
                simple(UnaryOp::Round)
            }
            A::Trunc => simple(UnaryOp::Trunc),
            A::Sign => simple(UnaryOp::Sign),
            A::Reciprocal => simple(UnaryOp::Reciprocal),
            A::BitwiseNot => simple(UnaryOp::BitwiseNot),
            A::LogicalNot => Box::new(|bx: &mut Bx, v: &[ValueId]| bx.body.unary(UnaryOp::LogicalNot, v[0])),
            A::IsNan => Box::new(|bx: &mut Bx, v: &[ValueId]| bx.body.unary(UnaryOp::IsNan, v[0])),
            A::IsInf => Box::new(|bx: &mut Bx, v: &[ValueId]| bx.body.unary(UnaryOp::IsInf, v[0])),
            A::Silu => Box::new(move |bx: &mut Bx, v: &[ValueId]| {
                let x = bx.body.cast(v[0], cd);
                let s = bx.body.unary(UnaryOp::Sigmoid, x);
                bx.body.binary(BinaryOp::Mul, x, s)
            }),
            A::Gelu => {
                let approx = match self.arg(1, "approximate") {
                    None | Some(Arg::None) => "none".to_string(),
                    Some(Arg::Str(s)) => s.clone(),
                    other => return malformed(format!("gelu approximate must be a string, got {other:?}")),
                };
                match approx.as_str() {
                    "none" => Box::new(move |bx: &mut Bx, v: &[ValueId]| {
                        let x = bx.body.cast(v[0], cd);
                        let half = bx.body.constant(Scalar::Float(0.5), cd);
                        let inv_sqrt2 = bx.body.constant(Scalar::Float(std::f64::consts::FRAC_1_SQRT_2), cd);
                        let one = bx.body.constant(Scalar::Float(1.0), cd);
                        let t = bx.body.binary(BinaryOp::Mul, x, inv_sqrt2);
                        let e = bx.body.unary(UnaryOp::Erf, t);
                        let e1 = bx.body.binary(BinaryOp::Add, e, one);
                        let hx = bx.body.binary(BinaryOp::Mul, x, half);
                        bx.body.binary(BinaryOp::Mul, hx, e1)
                    }),
                    "tanh" => Box::new(move |bx: &mut Bx, v: &[ValueId]| {
                        let x = bx.body.cast(v[0], cd);
                        let c = |bx: &mut Bx, f: f64| bx.body.constant(Scalar::Float(f), cd);
                        let k = c(bx, (2.0 / std::f64::consts::PI).sqrt());
                        let a = c(bx, 0.044715);
                        let half = c(bx, 0.5);
                        let one = c(bx, 1.0);
                        let x2 = bx.body.binary(BinaryOp::Mul, x, x);
                        let x3 = bx.body.binary(BinaryOp::Mul, x2, x);
                        let ax3 = bx.body.binary(BinaryOp::Mul, x3, a);
                        let inner = bx.body.binary(BinaryOp::Add, x, ax3);
                        let kin = bx.body.binary(BinaryOp::Mul, inner, k);
                        let t = bx.body.unary(UnaryOp::Tanh, kin);
                        let t1 = bx.body.binary(BinaryOp::Add, t, one);
                        let hx = bx.body.binary(BinaryOp::Mul, x, half);
                        bx.body.binary(BinaryOp::Mul, hx, t1)
                    }),
                    other => return unsupported(format!("gelu approximate='{other}'")),
                }
            }
            _ => return malformed("not a unary op"),
        };
        if matches!(op, A::BitwiseNot) && in_dtype.is_float() {
            return malformed("bitwise_not of a float tensor");
        }
        Ok(pointwise(vec![x], size, out.dtype, out.device, cd, f))
    }

    pub(super) fn lower_binary(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let (a, b) = self.binary_operands(op)?;
        let out = self.out_meta()?.clone();
        let size = self.out_shape_of(&[a.clone(), b.clone()])?;
        let rt = result_type(&[a.operand(), b.operand()]);
        check_binary_dtype(op, rt, &[a.operand(), b.operand()], out.dtype)?;
        let compute = binary_compute_dtype(op, rt, out.dtype);
        let alpha = self.binary_alpha(op)?;
        let bop = self.binary_op_of(op)?;
        check_binary_op_dtype(bop, compute)?;
        // ATen's CPU mul/div read a Python scalar (or a 0-dim tensor of a wider float type) as a
        // float; its other CPU binary kernels first convert it to the tensor's half type
        // (measured against eager): round those scalars the same. Its CUDA kernels keep every
        // scalar in float (opmath).
        let half = out.dtype.compute() != out.dtype && out.dtype.is_float() && out.device == Device::Cpu;
        let scalar_like = |p: &PwIn| match p {
            PwIn::Scalar(_) => true,
            PwIn::Tensor(t) => t.size.is_empty() && t.dtype.is_float() && t.dtype != out.dtype,
        };
        let round = |p: &PwIn| half && scalar_like(p) && !matches!(bop, BinaryOp::Mul | BinaryOp::TrueDiv);
        // an integer tensor meeting a half-typed one is converted to the half type first (ATen
        // casts every operand to the common dtype): 32767 is 32768 in bfloat16
        let through_half = |p: &PwIn| rt.is_float() && rt.compute() != rt && matches!(p, PwIn::Tensor(t) if t.dtype.is_integral());
        let body = BinaryBody {
            bop,
            compute,
            promoted: rt,
            half_dtype: out.dtype,
            alpha,
            rsub: matches!(op, AtenOp::RsubScalar),
            round_scalar: [round(&a), round(&b)],
            through_half: [through_half(&a), through_half(&b)],
            special_pow: special_pow_exponent(op, &b, compute, &out),
            round_square: out.dtype == DType::BF16 || (out.dtype == DType::F16 && out.device != Device::Cpu),
        };
        // scalars enter in the computation type; comparisons then round them to a half type
        // like ATen's common-dtype cast, arithmetic keeps them exact like ATen's opmath
        Ok(pointwise(vec![a, b], size, out.dtype, out.device, compute.compute(), move |bx, v| body.emit(bx, v)))
    }

    /// The (self, other) operands of a binary op; pow names its second one `exponent`.
    fn binary_operands(&self, op: AtenOp) -> LResult<(PwIn, PwIn)> {
        let mut a = self.pw_arg(0, "self")?;
        let mut b = self.pw_arg(1, "other")?;
        if matches!(op, AtenOp::PowTensorScalar) {
            b = self.pw_arg(1, "exponent")?;
        }
        if matches!(op, AtenOp::PowScalar) {
            a = self.pw_arg(0, "self")?;
            b = self.pw_arg(1, "exponent")?;
        }
        Ok((a, b))
    }

    /// add/sub/rsub's `alpha`, None where it is absent or 1.
    fn binary_alpha(&self, op: AtenOp) -> LResult<Option<Scalar>> {
        use AtenOp as A;
        Ok(match op {
            A::AddTensor | A::AddScalar | A::SubTensor | A::SubScalar | A::RsubScalar => match self.arg(2, "alpha") {
                None | Some(Arg::None) => None,
                Some(Arg::Int(1)) | Some(Arg::Bool(true)) => None,
                Some(Arg::Int(v)) => Some(Scalar::Int(*v)),
                Some(Arg::Bool(false)) => Some(Scalar::Bool(false)),
                Some(Arg::Float(v)) => Some(Scalar::Float(*v)),
                other => return malformed(format!("alpha must be a number, got {other:?}")),
            },
            _ => None,
        })
    }

    /// The loop-IR operation of a binary op (div.Tensor_mode's by its `rounding_mode`).
    fn binary_op_of(&self, op: AtenOp) -> LResult<BinaryOp> {
        use AtenOp as A;
        let mode = match op {
            A::DivTensorMode | A::DivScalarMode => match self.arg(2, "rounding_mode") {
                None | Some(Arg::None) => None,
                Some(Arg::Str(s)) if s == "trunc" || s == "floor" => Some(s.clone()),
                other => return unsupported(format!("rounding_mode {other:?}")),
            },
            _ => None,
        };
        Ok(match op {
            A::AddTensor | A::AddScalar => BinaryOp::Add,
            A::SubTensor | A::SubScalar | A::RsubScalar => BinaryOp::Sub,
            A::MulTensor | A::MulScalar => BinaryOp::Mul,
            A::DivTensor | A::DivScalar => BinaryOp::TrueDiv,
            A::DivTensorMode | A::DivScalarMode => match mode.as_deref() {
                None => BinaryOp::TrueDiv,
                Some("trunc") => BinaryOp::TruncDiv,
                _ => BinaryOp::FloorDiv,
            },
            A::PowTensorTensor | A::PowTensorScalar | A::PowScalar => BinaryOp::Pow,
            A::Maximum => BinaryOp::Maximum,
            A::Minimum => BinaryOp::Minimum,
            A::FmodTensor | A::FmodScalar => BinaryOp::Fmod,
            A::RemainderTensor | A::RemainderScalar => BinaryOp::Remainder,
            A::Atan2 => BinaryOp::Atan2,
            A::EqTensor | A::EqScalar => BinaryOp::Eq,
            A::NeTensor | A::NeScalar => BinaryOp::Ne,
            A::LtTensor | A::LtScalar => BinaryOp::Lt,
            A::LeTensor | A::LeScalar => BinaryOp::Le,
            A::GtTensor | A::GtScalar => BinaryOp::Gt,
            A::GeTensor | A::GeScalar => BinaryOp::Ge,
            A::LogicalAnd => BinaryOp::LogicalAnd,
            A::LogicalOr => BinaryOp::LogicalOr,
            A::LogicalXor => BinaryOp::LogicalXor,
            A::BitwiseAndTensor | A::BitwiseAndScalar => BinaryOp::BitAnd,
            A::BitwiseOrTensor | A::BitwiseOrScalar => BinaryOp::BitOr,
            A::BitwiseXorTensor | A::BitwiseXorScalar => BinaryOp::BitXor,
            A::LshiftTensor | A::LshiftScalar | A::BitwiseLeftShift => BinaryOp::LShift,
            A::RshiftTensor | A::RshiftScalar | A::BitwiseRightShift => BinaryOp::RShift,
            _ => return malformed("not a binary op"),
        })
    }

    /// A pointwise op of the node's first arguments `keys` (tensors or numbers), `f` of their
    /// values and the output's compute type.
    fn lower_args_pointwise(&mut self, keys: &[&str], f: impl Fn(&mut Bx, &[ValueId], DType) -> ValueId + 'static) -> LResult<TensorValue> {
        let inputs = keys.iter().enumerate().map(|(i, key)| self.pw_arg(i, key)).collect::<LResult<Vec<_>>>()?;
        let out = self.out_meta()?.clone();
        let size = self.out_shape_of(&inputs)?;
        let cd = out.dtype.compute();
        Ok(pointwise(inputs, size, out.dtype, out.device, cd, move |bx, v| f(bx, v, cd)))
    }

    pub(super) fn lower_where(&mut self) -> LResult<TensorValue> {
        self.lower_args_pointwise(&["condition", "self", "other"], |bx, v, cd| {
            let x = bx.body.cast(v[1], cd);
            let y = bx.body.cast(v[2], cd);
            bx.body.where_(v[0], x, y)
        })
    }

    /// prims.fma (what dynamo makes of `addcmul_`/`addcdiv_` with a value, and of `add_` with a
    /// tensor alpha: the optimizers' updates) as its definition `(a * b) + c` in the compute
    /// type: C++ rounds the product first, as CPU eager's addcmul does; Triton contracts it into
    /// one FMA, as nvcc does for CUDA eager's.
    pub(super) fn lower_fma(&mut self) -> LResult<TensorValue> {
        self.lower_args_pointwise(&["a", "b", "c"], |bx, v, cd| {
            let [a, b, c] = [v[0], v[1], v[2]].map(|x| bx.body.cast(x, cd));
            let ab = bx.body.binary(BinaryOp::Mul, a, b);
            bx.body.binary(BinaryOp::Add, ab, c)
        })
    }

    pub(super) fn lower_clamp(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let x = self.pw_arg(0, "self")?;
        let (lo, hi) = match op {
            AtenOp::Hardtanh => (
                Some(self.opt_pw(1, "min_val")?.unwrap_or(PwIn::Scalar(Scalar::Float(-1.0)))),
                Some(self.opt_pw(2, "max_val")?.unwrap_or(PwIn::Scalar(Scalar::Float(1.0)))),
            ),
            AtenOp::ClampMin => (self.opt_pw(1, "min")?, None),
            AtenOp::ClampMax => (None, self.opt_pw(1, "max")?),
            _ => (self.opt_pw(1, "min")?, self.opt_pw(2, "max")?),
        };
        let out = self.out_meta()?.clone();
        // An integer bound past the type's range on its own side bounds nothing (eager keeps
        // uint8's values under min=-1); cast to the type it would wrap (-1 -> 255).
        let lo = lo.filter(|b| !int_bound_beyond(b, out.dtype, false));
        let hi = hi.filter(|b| !int_bound_beyond(b, out.dtype, true));
        let mut inputs = vec![x];
        inputs.extend(lo.clone());
        inputs.extend(hi.clone());
        let size = self.out_shape_of(&inputs)?;
        let cd = out.dtype.compute();
        let (has_lo, has_hi) = (lo.is_some(), hi.is_some());
        Ok(pointwise(inputs, size, out.dtype, out.device, cd, move |bx, v| {
            let mut r = bx.body.cast(v[0], cd);
            let mut k = 1;
            // torch.clamp propagates NaN from the input and applies min before max.
            if has_lo {
                let l = bx.body.cast(v[k], cd);
                r = bx.body.binary(BinaryOp::Maximum, r, l);
                k += 1;
            }
            if has_hi {
                let h = bx.body.cast(v[k], cd);
                r = bx.body.binary(BinaryOp::Minimum, r, h);
            }
            r
        }))
    }

    fn opt_pw(&self, i: usize, key: &str) -> LResult<Option<PwIn>> {
        match self.arg(i, key) {
            None | Some(Arg::None) => Ok(None),
            _ => self.pw_arg(i, key).map(Some),
        }
    }

    /// _conj / _conj_physical: the complex conjugate (materialized: ferrocore has no conj bit);
    /// real tensors are returned as they are.
    pub(super) fn lower_conj(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        if !x.dtype.is_complex() {
            return Ok(x);
        }
        let size = x.size.clone();
        let (dt, device) = (x.dtype, x.device);
        Ok(pointwise(vec![PwIn::Tensor(x)], size, dt, device, dt, move |bx, v| bx.body.unary(UnaryOp::Conj, v[0])))
    }

    /// view_as_real: a trailing dim of 2 holding the real and imaginary parts. Computed, not
    /// aliased (buffers have one dtype); graph outputs still get eager's strides.
    pub(super) fn lower_view_as_real(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        if !x.dtype.is_complex() {
            return malformed("view_as_real of a real tensor");
        }
        let rank = x.size.len();
        let xs = x.clone();
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let v = xs.load(bx, &idx[..rank]);
            let re = bx.body.unary(UnaryOp::Real, v);
            let im = bx.body.unary(UnaryOp::Imag, v);
            let part = bx.body.index(idx[rank].clone(), DType::I64);
            let zero = bx.body.constant(Scalar::Int(0), DType::I64);
            let is_re = bx.body.binary(BinaryOp::Eq, part, zero);
            bx.body.where_(is_re, re, im)
        });
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads: 1, ops: 4 } })
    }

    /// Whether `t` is a whole computed or returned buffer (never a graph input) laid out as
    /// `out`, of its size and dtype.
    fn holds_as_laid_out(&self, t: &TensorValue, out: &TensorMeta) -> bool {
        let Some((buf, stride, offset)) = t.strided() else { return false };
        let b = self.prog.buffer(buf);
        t.size == out.shape
            && t.dtype == out.dtype
            && offset == 0
            && out.storage_offset == 0
            && !matches!(b.source, BufferSource::Input(_))
            && b.layout.offset == 0
            && b.layout.size == out.shape
            && (0..stride.len()).all(|i| out.shape[i] == 1 || (stride[i] == out.stride[i] && b.layout.stride[i] == stride[i]))
    }

    /// Whether the copy is the only reader of `src` and no other value lowered so far lies in
    /// its buffer: the copy then takes the buffer over without two values sharing a storage (a
    /// caller writing into one returned tensor would change the other).
    fn only_reader_of_buffer(&self, t: &TensorValue) -> bool {
        let (Some(Arg::Node(src)), Some((buf, _, _))) = (self.arg(1, "src"), t.strided()) else { return false };
        self.uses[src.0 as usize] == 1
            && self.values.iter().enumerate().all(|(i, v)| {
                i == src.0 as usize || !matches!(v, Some(Lowered::Tensor(o)) if o.strided().is_some_and(|(b, _, _)| b == buf))
            })
    }

    pub(super) fn lower_copy(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let out = self.out_meta()?.clone();
        let src = match op {
            AtenOp::Copy => self.pw_arg(1, "src")?,
            _ => self.pw_arg(0, "self")?,
        };
        // a kernel copies within one device; a transfer is ATen's
        let from = match &src {
            PwIn::Tensor(t) => Some(t.device),
            PwIn::Scalar(_) => None,
        };
        let to = match self.arg(usize::MAX, "device") {
            Some(Arg::Device(d)) => *d,
            _ => out.device,
        };
        if to != out.device || from.is_some_and(|f| f != to) {
            return unsupported("copy to another device");
        }
        if let Some(Arg::Layout(l)) = self.arg(usize::MAX, "layout") {
            if l != "strided" {
                return unsupported(format!("layout {l}"));
            }
        }
        let size = out.shape.clone();
        if let PwIn::Tensor(t) = &src {
            broadcast_shapes(&[&t.size, &size])?;
            if op == AtenOp::Copy && self.holds_as_laid_out(t, &out) && self.only_reader_of_buffer(t) {
                // `copy(empty_strided(..), x)` (FlexAttention's output, traced `out.copy_(x)`)
                // where x is already a whole buffer of that layout: the buffer is the copy
                return Ok(t.clone());
            }
        }
        let cd = out.dtype;
        Ok(pointwise(vec![src], size, out.dtype, out.device, cd, move |bx, v| bx.body.cast(v[0], cd)))
    }
}

impl Ctx<'_> {
    /// elu and leaky_relu: a select between the identity and a scaled negative branch.
    pub(super) fn lower_activation(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let x = self.pw_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let size = self.out_shape_of(std::slice::from_ref(&x))?;
        let cd = out.dtype.compute();
        if !cd.is_float() {
            return unsupported("activation of a non-float tensor");
        }
        let num = |v: Option<f64>, d: f64| v.unwrap_or(d);
        Ok(match op {
            AtenOp::LeakyRelu => {
                let slope = num(self.float_arg(1, "negative_slope")?, 0.01);
                pointwise(vec![x], size, out.dtype, out.device, cd, move |bx, v| {
                    let x = bx.body.cast(v[0], cd);
                    let zero = bx.body.constant(Scalar::Float(0.0), cd);
                    let s = bx.body.constant(Scalar::Float(slope), cd);
                    let pos = bx.body.binary(BinaryOp::Gt, x, zero);
                    let neg = bx.body.binary(BinaryOp::Mul, x, s);
                    bx.body.where_(pos, x, neg)
                })
            }
            _ => {
                let alpha = num(self.float_arg(1, "alpha")?, 1.0);
                let scale = num(self.float_arg(2, "scale")?, 1.0);
                let input_scale = num(self.float_arg(3, "input_scale")?, 1.0);
                pointwise(vec![x], size, out.dtype, out.device, cd, move |bx, v| {
                    // x > 0 ? scale·x : scale·alpha·(exp(input_scale·x) − 1)
                    let x = bx.body.cast(v[0], cd);
                    let c = |bx: &mut Bx, f: f64| bx.body.constant(Scalar::Float(f), cd);
                    let zero = c(bx, 0.0);
                    let is = c(bx, input_scale);
                    let sa = c(bx, scale * alpha);
                    let sc = c(bx, scale);
                    let pos = bx.body.binary(BinaryOp::Gt, x, zero);
                    let xs = bx.body.binary(BinaryOp::Mul, x, is);
                    let em = bx.body.unary(UnaryOp::Expm1, xs);
                    let neg = bx.body.binary(BinaryOp::Mul, em, sa);
                    let p = bx.body.binary(BinaryOp::Mul, x, sc);
                    bx.body.where_(pos, p, neg)
                })
            }
        })
    }
}

/// Whether a float16/bfloat16 operand (kept in float inside the kernel) is rounded to its type
/// before use: wherever its value leaves the half type (promotion to a wider float, a
/// conversion, a comparison's bool), eager holds it rounded; a chain within the half type stays
/// unrounded (the documented half-precision chains).
fn rounds_half_operand(operand: DType, out: DType) -> bool {
    operand.is_float() && operand.compute() != operand && out != operand
}

/// Whether a scalar clamp bound lies past an integer `dtype`'s range on the side it bounds
/// (above the largest value for a max, below the smallest for a min).
fn int_bound_beyond(bound: &PwIn, dtype: DType, is_max: bool) -> bool {
    if !dtype.is_integral() || dtype == DType::Bool {
        return false;
    }
    let (min, max) = dtype.int_range();
    // a float bound too (hardtanh's -1.0 on uint8 made every 0 a 1)
    let v = match bound {
        PwIn::Scalar(Scalar::Int(v)) => *v as f64,
        PwIn::Scalar(Scalar::Float(v)) => *v,
        _ => return false,
    };
    if is_max {
        v > max as f64
    } else {
        v < min as f64
    }
}

/// `eq`, `ne`, `lt`, `le`, `gt` and `ge`, of a tensor or a scalar.
fn is_comparison(op: AtenOp) -> bool {
    use AtenOp as A;
    matches!(
        op,
        A::EqTensor
            | A::EqScalar
            | A::NeTensor
            | A::NeScalar
            | A::LtTensor
            | A::LtScalar
            | A::LeTensor
            | A::LeScalar
            | A::GtTensor
            | A::GtScalar
            | A::GeTensor
            | A::GeScalar
    )
}

/// The type a binary op computes in: comparisons and logical ops the promoted type, the rest
/// the result's compute type.
fn binary_compute_dtype(op: AtenOp, promoted: DType, out: DType) -> DType {
    use AtenOp as A;
    match op {
        _ if is_comparison(op) => promoted, // a half-typed scalar is rounded first
        A::LogicalAnd | A::LogicalOr | A::LogicalXor => DType::Bool,
        _ => out.compute(),
    }
}

/// Bitwise ops take no floats, and shifts no bools.
fn check_binary_op_dtype(bop: BinaryOp, compute: DType) -> LResult<()> {
    if matches!(bop, BinaryOp::BitAnd | BinaryOp::BitOr | BinaryOp::BitXor | BinaryOp::LShift | BinaryOp::RShift) && compute.is_float() {
        return malformed("bitwise op on floating-point values");
    }
    if matches!(bop, BinaryOp::LShift | BinaryOp::RShift) && compute == DType::Bool {
        return unsupported("shift of bool values");
    }
    Ok(())
}

/// The exponent of a pow(tensor, scalar) computed without a general pow.
///
/// ATen's pow(tensor, scalar) computes a square and a cube as products and -1 as a
/// reciprocal; also far cheaper than a general pow (GPT-2's tanh GELU cubes its input: 3x
/// the time of a memory-bound kernel). Its cube multiplies in the tensor's type: the
/// square is rounded in bfloat16, and in float16 on the GPU (its CPU float16 kernel
/// computes in float). 0.5 and -0.5 are a square root and its reciprocal (NaN at -inf,
/// -0.0 and -inf at -0.0, where C's pow gives +inf and +0.0), -2 the reciprocal of the
/// square, except in CPU float16, which calls `pow` for every exponent but 2, 3 and -1
fn special_pow_exponent(op: AtenOp, exponent: &PwIn, compute: DType, out: &TensorMeta) -> Option<f64> {
    match (exponent, op) {
        (PwIn::Scalar(Scalar::Float(e)), AtenOp::PowTensorScalar) if compute.is_float() => Some(*e),
        (PwIn::Scalar(Scalar::Int(e)), AtenOp::PowTensorScalar) if compute.is_float() => Some(*e as f64),
        _ => None,
    }
    .filter(|e| [2.0, 3.0, -1.0].contains(e) || (!(out.dtype == DType::F16 && out.device == Device::Cpu) && [0.5, -0.5, -2.0].contains(e)))
}

/// The loop body of one binary op: how its operands are rounded and combined.
#[derive(Clone, Copy)]
struct BinaryBody {
    bop: BinaryOp,
    compute: DType,
    /// the operands' promoted type
    promoted: DType,
    /// the result's type, which rounded scalars and pow's square pass through
    half_dtype: DType,
    alpha: Option<Scalar>,
    /// rsub: other - alpha*self
    rsub: bool,
    /// per operand: a scalar rounded to the result's half type first
    round_scalar: [bool; 2],
    /// per operand: an integer tensor converted to the promoted half type first
    through_half: [bool; 2],
    special_pow: Option<f64>,
    /// pow's square is rounded to the result type before a cube or reciprocal
    round_square: bool,
}

impl BinaryBody {
    fn emit(&self, bx: &mut Bx, v: &[ValueId]) -> ValueId {
        if let Some(e) = self.special_pow {
            return self.emit_special_pow(bx, v[0], e);
        }
        let (mut va, mut vb) = (v[0], v[1]);
        if self.round_scalar[0] {
            va = bx.body.cast(va, self.half_dtype);
        }
        if self.round_scalar[1] {
            vb = bx.body.cast(vb, self.half_dtype);
        }
        if self.through_half[0] {
            va = bx.body.cast(va, self.promoted);
        }
        if self.through_half[1] {
            vb = bx.body.cast(vb, self.promoted);
        }
        let x = bx.body.cast(va, self.compute);
        let y = bx.body.cast(vb, self.compute);
        // sub: self - alpha*other; rsub: other - alpha*self.
        let (l, r) = if self.rsub { (y, x) } else { (x, y) };
        let r = match self.alpha {
            Some(al) => {
                let c = bx.body.constant(al, self.compute);
                bx.body.binary(BinaryOp::Mul, r, c)
            }
            None => r,
        };
        bx.body.binary(self.bop, l, r)
    }

    /// `base` to the power `e`, one of the exponents `special_pow_exponent` accepts.
    fn emit_special_pow(&self, bx: &mut Bx, base: ValueId, e: f64) -> ValueId {
        let x = bx.body.cast(base, self.compute);
        match e {
            -1.0 => return bx.body.unary(UnaryOp::Reciprocal, x),
            0.5 => return bx.body.unary(UnaryOp::Sqrt, x),
            -0.5 => return bx.body.unary(UnaryOp::Rsqrt, x),
            _ => {}
        }
        let square = bx.body.binary(BinaryOp::Mul, x, x);
        if e == 2.0 {
            return square;
        }
        let square = if self.round_square {
            let rounded = bx.body.cast(square, self.half_dtype);
            bx.body.cast(rounded, self.compute)
        } else {
            square
        };
        if e == -2.0 {
            return bx.body.unary(UnaryOp::Reciprocal, square);
        }
        bx.body.binary(BinaryOp::Mul, square, x)
    }
}

/// The result dtype of a binary op follows torch's promotion of its operands (`graph::dtype`):
/// comparisons and logical ops give bool, true division and atan2 a float, the others the
/// promoted type. Where the promoted type is a float that no float tensor chose (an integer
/// tensor with a float scalar), torch's default dtype decides it: any float is accepted.
fn check_binary_dtype(op: AtenOp, promoted: DType, operands: &[Operand], out: DType) -> LResult<()> {
    use AtenOp as A;
    let float_tensor = operands.iter().any(|o| matches!(o, Operand::Tensor { dtype, .. } if dtype.is_float()));
    let as_promoted = |d: DType| out == d || (!float_tensor && d.is_float() && out.is_float());
    let ok = match op {
        _ if is_comparison(op) => out == DType::Bool,
        A::LogicalAnd | A::LogicalOr | A::LogicalXor => out == DType::Bool,
        A::DivTensor | A::DivScalar | A::Atan2 => {
            if promoted.is_float() {
                as_promoted(promoted)
            } else {
                out.is_float()
            }
        }
        // without a rounding mode these divide truly
        A::DivTensorMode | A::DivScalarMode => as_promoted(promoted) || out.is_float(),
        // torch's meta function takes bool ** bool to int64 (its kernel keeps bool); the graph
        // was traced with the meta's dtype
        A::PowTensorScalar if promoted == DType::Bool => out == DType::Bool || out == DType::I64,
        _ => as_promoted(promoted),
    };
    if ok {
        Ok(())
    } else {
        malformed(format!("result dtype {out} contradicts the operands' promotion ({promoted}) for {}", op.name()))
    }
}
