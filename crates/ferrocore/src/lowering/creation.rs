//! Tensor creation: full, full_like, scalar_tensor, fill, arange — lazy values with no reads.

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
        Ok(TensorValue {
            size: out.shape.clone(),
            dtype: dt,
            device: out.device.clone(),
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
        let dt = out.dtype;
        // ATen computes start + i*step in double for floating results, in int64 for integers.
        let acc = if dt.is_float() { DType::F64 } else { DType::I64 };
        Ok(TensorValue {
            size: out.shape.clone(),
            dtype: dt,
            device: out.device.clone(),
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
