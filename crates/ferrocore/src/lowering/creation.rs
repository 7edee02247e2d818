//! Tensor creation: full, full_like, scalar_tensor, fill, arange, linspace, logspace — lazy
//! values with no reads (linspace and logspace may read 0-d bound tensors).

use super::pointwise::PwIn;
use super::*;

impl Ctx<'_> {
    pub(super) fn lower_full(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let out = self.out_meta()?.clone();
        let value = match op {
            AtenOp::Full | AtenOp::FullLike | AtenOp::FillScalar => self.arg(1, "fill_value").or(self.arg(1, "value")),
            // uninitialized memory in eager: zeros are one valid content
            AtenOp::EmptyMemoryFormat | AtenOp::EmptyStrided | AtenOp::EmptyPermuted => Some(&Arg::Int(0)),
            _ => self.arg(0, "s"),
        };
        let value = match value {
            Some(Arg::Int(v)) => Scalar::Int(*v),
            Some(Arg::Float(v)) => Scalar::Float(*v),
            Some(Arg::Bool(v)) => Scalar::Bool(*v),
            Some(Arg::Node(_)) => return unsupported("fill value is a tensor"),
            other => return malformed(format!("fill value must be a number, got {other:?}")),
        };
        if let Some(Arg::Layout(l)) = self.arg(usize::MAX, "layout") {
            if l != "strided" {
                return unsupported(format!("layout {l}"));
            }
        }
        let dt = out.dtype;
        if !holds(value, dt, out.shape.iter().product(), out.device == Device::Cpu) {
            // ATen raises "value cannot be converted to type ... without overflow": the ATen call
            // in the wrapper raises it at every call, as eager does
            return unsupported(format!("{value:?} does not fit {dt:?} (ATen raises)"));
        }
        Ok(TensorValue {
            size: out.shape.clone(),
            dtype: dt,
            device: out.device,
            src: Src::Lazy { f: Rc::new(move |bx: &mut Bx, _idx: &[IndexExpr]| stored_constant(bx, value, dt)), reads: 0, ops: 1 },
        })
    }

    pub(super) fn lower_arange(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let out = self.out_meta()?.clone();
        let num = |a: Option<&Arg>, default: Scalar| -> LResult<Scalar> {
            Ok(match a {
                None | Some(Arg::None) => default,
                Some(Arg::Int(v)) => Scalar::Int(*v),
                Some(Arg::Float(v)) => Scalar::Float(*v),
                Some(Arg::Bool(v)) => Scalar::Int(*v as i64), // Python bools are ints here
                other => return malformed(format!("arange bound must be a number, got {other:?}")),
            })
        };
        let (start, step) = match op {
            AtenOp::Arange => (Scalar::Int(0), Scalar::Int(1)),
            AtenOp::ArangeStart => (num(self.arg(0, "start"), Scalar::Int(0))?, Scalar::Int(1)),
            _ => (num(self.arg(0, "start"), Scalar::Int(0))?, num(self.arg(2, "step"), Scalar::Int(1))?),
        };
        if out.shape.len() != 1 {
            return malformed("arange result must be 1-D");
        }
        // as ATen: a zero step is an error, and so are non-finite bounds
        let end = match op {
            AtenOp::Arange => num(self.arg(0, "end"), Scalar::Int(0))?,
            _ => num(self.arg(1, "end"), Scalar::Int(0))?,
        };
        let value = |s: Scalar| match s {
            Scalar::Int(v) => v as f64,
            Scalar::Float(v) => v,
            Scalar::Bool(v) => f64::from(u8::from(v)),
        };
        if value(step) == 0.0 {
            return malformed("arange step must be nonzero");
        }
        if [start, end, step].iter().any(|&s| !value(s).is_finite()) {
            return malformed(format!(
                "arange bounds must be finite, got start {}, end {}, step {}",
                value(start),
                value(end),
                value(step)
            ));
        }
        let dt = out.dtype;
        // ATen computes start + i*step in double for floating results, in int64 for integers.
        let acc = if dt.is_float() { DType::F64 } else { DType::I64 };
        Ok(TensorValue {
            size: out.shape.clone(),
            dtype: dt,
            device: out.device,
            src: Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    let i = bx.body.index(idx[0].clone(), DType::I64);
                    let i = bx.body.cast(i, acc);
                    let st = bx.body.constant(step, acc);
                    let s0 = bx.body.constant(start, acc);
                    let m = bx.body.binary(BinaryOp::Mul, i, st);
                    let v = bx.body.binary(BinaryOp::Add, m, s0);
                    bx.body.cast(v, dt)
                }),
                reads: 0,
                ops: 3,
            },
        })
    }
}

/// `value` as an element of a `dt` tensor holds it: rounded to half types (a scalar operand of
/// arithmetic is not rounded, as in ATen, but a filled tensor is).
pub(super) fn stored_constant(bx: &mut Bx, value: Scalar, dt: DType) -> ValueId {
    match dt {
        DType::F16 | DType::BF16 => {
            let wide = bx.body.constant(value, DType::F32);
            bx.body.cast(wide, dt)
        }
        _ => bx.body.constant(value, dt),
    }
}

impl Ctx<'_> {
    /// linspace as ATen's CPU kernel computes it: the bounds are first converted to the result
    /// type (an int64 result truncates 4.3 to 4), the step is `(end - start) / (steps - 1)` in
    /// double for integer results and in the result type otherwise, the first half of the points
    /// counts up from `start`, the second down from `end`. Half types compute in float32 and
    /// round once (ATen's vectorized half kernel rounds per operation, differently per vector
    /// lane: the results agree within an ulp).
    /// Bounds may be 0-d tensors (`Tensor_Tensor` & co.), read as `.item()` reads them.
    ///
    /// logspace (`log`) raises `base` to those points as ATen's CPU loop does: the bounds in the
    /// result type, `end - start` subtracted there, then the step, the points and the power in
    /// double.
    pub(super) fn lower_linspace(&mut self, log: bool) -> LResult<TensorValue> {
        let out = self.out_meta()?.clone();
        if out.shape.len() != 1 {
            return malformed("linspace result must be 1-D");
        }
        let base = match self.arg(3, "base") {
            _ if !log => None,
            None | Some(Arg::None) => Some(10.0),
            Some(Arg::Int(v)) => Some(*v as f64),
            Some(Arg::Float(v)) => Some(*v),
            other => return malformed(format!("logspace base must be a number, got {other:?}")),
        };
        let dt = out.dtype;
        if !dt.is_compilable() || dt == DType::Bool {
            return unsupported(format!("linspace of {dt}"));
        }
        let (start, end) = (self.pw_arg(0, "start")?, self.pw_arg(1, "end")?);
        for b in [&start, &end] {
            if let PwIn::Tensor(t) = b {
                if !t.size.is_empty() {
                    return malformed("linspace bounds must be numbers or 0-d tensors");
                }
            }
        }
        let steps = out.shape[0];
        let step_t = if dt.is_integral() || log { DType::F64 } else { dt.compute() };
        let halfway = steps / 2;
        Ok(TensorValue {
            size: out.shape.clone(),
            dtype: dt,
            device: out.device,
            src: Src::Lazy {
                f: Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                    // a bound as a value of the result type
                    let bound = |bx: &mut Bx, b: &PwIn| match b {
                        PwIn::Scalar(s) => stored_constant(bx, *s, dt),
                        PwIn::Tensor(t) => {
                            let v = t.load(bx, &[]);
                            let wide = bx.body.cast(v, DType::F64);
                            bx.body.cast(wide, dt)
                        }
                    };
                    let arith = |bx: &mut Bx, op: BinaryOp, a: ValueId, b: ValueId| {
                        let (a, b) = (bx.body.cast(a, step_t), bx.body.cast(b, step_t));
                        bx.body.binary(op, a, b)
                    };
                    // logspace: base ** point in double, then stored as the result type
                    let power = |bx: &mut Bx, point: ValueId| match base {
                        None => point,
                        Some(b) => {
                            let b = bx.body.constant(Scalar::Float(b), step_t);
                            let p = bx.body.cast(point, step_t);
                            let v = bx.body.binary(BinaryOp::Pow, b, p);
                            bx.body.cast(v, dt)
                        }
                    };
                    if steps == 1 && base.is_some() {
                        // one point: ATen fills base ** start, start as given (not converted)
                        let s = match &start {
                            PwIn::Scalar(v) => bx.body.constant(*v, DType::F64),
                            PwIn::Tensor(t) => {
                                let v = t.load(bx, &[]);
                                bx.body.cast(v, DType::F64)
                            }
                        };
                        return power(bx, s);
                    }
                    let s = bound(bx, &start);
                    if steps == 1 {
                        return s;
                    }
                    let e = bound(bx, &end);
                    let (sw, ew) = (bx.body.cast(s, step_t), bx.body.cast(e, step_t));
                    let span = if log {
                        // subtracted in the result type (rounded to it), then widened
                        let ct = dt.compute();
                        let (a, b) = (bx.body.cast(e, ct), bx.body.cast(s, ct));
                        let d = bx.body.binary(BinaryOp::Sub, a, b);
                        let d = bx.body.cast(d, dt);
                        bx.body.cast(d, step_t)
                    } else {
                        arith(bx, BinaryOp::Sub, ew, sw)
                    };
                    let n = bx.body.constant(Scalar::Int(steps - 1), step_t);
                    let step = arith(bx, BinaryOp::TrueDiv, span, n);
                    let i = bx.body.index(idx[0].clone(), DType::I64);
                    let up = bx.body.cast(i, step_t);
                    let up = arith(bx, BinaryOp::Mul, step, up);
                    let lo = arith(bx, BinaryOp::Add, sw, up);
                    let rest = bx.body.index(IndexExpr::constant(steps - 1).sub(&idx[0]), DType::I64);
                    let down = bx.body.cast(rest, step_t);
                    let down = arith(bx, BinaryOp::Mul, step, down);
                    let hi = arith(bx, BinaryOp::Sub, ew, down);
                    let h = bx.body.constant(Scalar::Int(halfway), DType::I64);
                    let first = bx.body.binary(BinaryOp::Lt, i, h);
                    let v = bx.body.where_(first, lo, hi);
                    if base.is_some() {
                        return power(bx, v);
                    }
                    bx.body.cast(v, dt)
                }),
                reads: 0,
                ops: 12,
            },
        })
    }
}

/// Whether ATen's checked conversion of a fill value into `dt` succeeds (c10's `overflows`),
/// as each device's fill kernel applies it (measured on x86 and on an H100):
/// - integers within the type's range; unsigned types also take negatives down to -max (they
///   wrap);
/// - floats into integers: never NaN or infinite, at least the lowest value, and at most the
///   largest (on the GPU), below the largest + 1 (the CPU's fill truncates before it compares);
/// - finite values into float32 and the half types within their range, except that the CPU's
///   one-element fill of a half type converts unchecked (to inf); double and bool take anything.
pub(super) fn holds(value: Scalar, dt: DType, numel: i64, cpu: bool) -> bool {
    let int_range = |dt: DType| -> Option<(i128, i128)> {
        Some(match dt {
            DType::U8 => (0, u8::MAX as i128),
            DType::I8 => (i8::MIN as i128, i8::MAX as i128),
            DType::I16 => (i16::MIN as i128, i16::MAX as i128),
            DType::I32 => (i32::MIN as i128, i32::MAX as i128),
            DType::I64 => (i64::MIN as i128, i64::MAX as i128),
            _ => return None,
        })
    };
    let unchecked_half = cpu && numel == 1;
    let float_max = match dt {
        DType::F32 => Some(f32::MAX as f64),
        DType::F16 if !unchecked_half => Some(65504.0),
        DType::BF16 if !unchecked_half => Some(3.3895313892515355e38),
        _ => None,
    };
    match value {
        Scalar::Bool(_) => true,
        Scalar::Int(v) => match (int_range(dt), float_max) {
            (Some((_, max)), _) if dt == DType::U8 => (-max..=max).contains(&(v as i128)),
            (Some((lo, hi)), _) => (lo..=hi).contains(&(v as i128)),
            (None, Some(max)) => (v as f64).abs() <= max,
            (None, None) => true,
        },
        Scalar::Float(f) => match (int_range(dt), float_max) {
            (Some((lo, hi)), _) if cpu => f.is_finite() && f >= lo as f64 && f < hi as f64 + 1.0,
            (Some((lo, hi)), _) => f.is_finite() && f >= lo as f64 && f <= hi as f64,
            (None, Some(max)) => !f.is_finite() || f.abs() <= max,
            (None, None) => true,
        },
    }
}
