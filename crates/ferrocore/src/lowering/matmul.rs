//! GEMM library calls (mm, bmm, addmm) and their operand padding (pass `padding`). cuBLAS
//! falls back to slow kernels when a 16-bit operand's or result's rows are not 16-byte aligned:
//! GPT-2's LM head (768 -> 50257) ran a pre-Hopper kernel for 3.3 ms on an H100. A GEMM whose
//! M, K or N is not a multiple of 8 then runs on zero-padded copies of its operands into a padded
//! result, of which the graph reads the unpadded corner. Which GEMMs pay for their copies is
//! measured by the front on the device (`python/ferrocore/padding.py`, cached) and named in the
//! graph (`padded_matmuls`); `pad_mm = always` pads every unaligned 16-bit GEMM (tests).

use super::externs::{capture_hazard, ExternKind};
use super::indexing::{and_in_range, clamp_index, strided_base};
use super::pointwise::{pointwise, PwIn};
use super::*;
use serde::Deserialize;

/// Which unaligned GEMMs are padded (`Options::pad_mm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PadMm {
    /// Those the graph names in `padded_matmuls` (measured faster padded).
    #[default]
    Measured,
    /// Every GEMM of 16-bit floats with a dim that is not a multiple of `ALIGN`.
    Always,
    Never,
}

/// Elements of a 16-bit float in 16 bytes: cuBLAS's fast kernels want rows aligned to this.
const ALIGN: i64 = 8;

fn round_up(x: i64) -> i64 {
    (x + ALIGN - 1) / ALIGN * ALIGN
}

impl Ctx<'_> {
    /// mm(a, b), bmm(a, b), addmm(bias, a, b): a library call, on padded operands where the
    /// padding pass says so. addmm with unit scales on a GPU in float32/float64 (or padded) is
    /// the GEMM plus a bias add that fuses into the next kernel, as Inductor does: cuBLAS picked
    /// slower kernels for addmm's bias form at GPT-2's shapes in float32 (about 1 ms of 25 per
    /// forward on an H100).
    pub(super) fn lower_matmul(&mut self, op: AtenOp) -> LResult<Lowered> {
        let out = self.out_meta()?.clone();
        let (ia, ib) = if op == AtenOp::Addmm { (1, 2) } else { (0, 1) };
        let (Some(Arg::Node(a)), Some(Arg::Node(b))) = (self.arg(ia, "mat1"), self.arg(ib, "mat2")) else {
            return malformed(format!("{} takes two tensors", op.name()));
        };
        let (a, b) = (*a, *b);
        let unit = |v: Option<f64>| v.is_none_or(|x| x == 1.0);
        let plain_addmm = op != AtenOp::Addmm || (unit(self.float_arg(3, "beta")?) && unit(self.float_arg(4, "alpha")?));
        let padded = if plain_addmm { self.padding_for(a, b)? } else { None };
        let gemm = if op == AtenOp::Bmm { AtenOp::Bmm } else { AtenOp::Mm };
        let product = match padded {
            Some(pad) => self.padded_gemm(gemm, a, b, &pad, &out)?,
            None if op == AtenOp::Addmm && plain_addmm && out.device != Device::Cpu && matches!(out.dtype, DType::F32 | DType::F64) => {
                let args = vec![self.extern_tensor(a, false)?, self.extern_tensor(b, false)?];
                let Lowered::Tensor(p) = self.push_extern(Self::callee(gemm), args, vec![], &Meta::Tensor(out.clone()), Self::gemm_kind())? else {
                    return malformed("mm produced no tensor");
                };
                p
            }
            None => return self.lower_extern(op),
        };
        if op != AtenOp::Addmm {
            return Ok(Lowered::Tensor(product));
        }
        let bias = self.tensor_arg(0, "self")?;
        let dt = out.dtype;
        Ok(Lowered::Tensor(pointwise(vec![PwIn::Tensor(product), PwIn::Tensor(bias)], out.shape.clone(), dt, out.device.clone(), dt, move |bx, v| {
            let p = bx.body.cast(v[0], dt);
            let c = bx.body.cast(v[1], dt);
            bx.body.binary(BinaryOp::Add, p, c)
        })))
    }

    fn callee(op: AtenOp) -> String {
        format!("torch.ops.{}", op.name())
    }

    fn gemm_kind() -> ExternKind {
        ExternKind::Library { hazard: capture_hazard(AtenOp::Mm), exact_strides: false }
    }

    /// The padded sizes [.., M, K, N] of a GEMM of `a` by `b` the padding pass asks for, logged;
    /// None when it runs as traced.
    fn padding_for(&mut self, a: NodeId, b: NodeId) -> LResult<Option<Vec<i64>>> {
        let (Some(ma), Some(mb)) = (self.graph.node(a).meta.tensor(), self.graph.node(b).meta.tensor()) else {
            return malformed("GEMM operands without tensor metadata");
        };
        let (ra, rb) = (ma.shape.len(), mb.shape.len());
        if ra < 2 || ra != rb {
            return malformed(format!("GEMM of shapes {:?} and {:?}", ma.shape, mb.shape));
        }
        let (m, k, n) = (ma.shape[ra - 2], ma.shape[ra - 1], mb.shape[rb - 1]);
        let unaligned = [m, k, n].iter().any(|d| d % ALIGN != 0);
        let half = matches!(ma.dtype, DType::F16 | DType::BF16) && ma.dtype == mb.dtype;
        if !unaligned || !half || m == 0 || k == 0 || n == 0 {
            return Ok(None);
        }
        let node = &self.graph.node(self.current).name;
        let why = match self.pad_mm {
            PadMm::Never => return Ok(None),
            PadMm::Always => "pad_mm = always".to_string(),
            PadMm::Measured => match self.graph.padded_matmuls.get(node) {
                Some(why) => why.clone(),
                None => return Ok(None),
            },
        };
        let mut sizes = ma.shape[..ra - 2].to_vec();
        sizes.extend([round_up(m), round_up(k), round_up(n)]);
        self.decisions.push((
            "padding",
            format!("pad: {node} {:?} x {:?} {} runs as {:?} x {:?}: {why}", ma.shape, mb.shape, ma.dtype, [round_up(m), round_up(k)], [round_up(k), round_up(n)]),
        ));
        Ok(Some(sizes))
    }

    /// The GEMM on zero-padded copies of its operands (`pad` = [.., M', K', N']), into a padded
    /// result; returns the view of its unpadded corner.
    fn padded_gemm(&mut self, op: AtenOp, a: NodeId, b: NodeId, pad: &[i64], out: &TensorMeta) -> LResult<TensorValue> {
        let r = pad.len();
        let lead = &pad[..r - 3];
        let (mp, kp, np) = (pad[r - 3], pad[r - 2], pad[r - 1]);
        let a_size: Vec<i64> = lead.iter().copied().chain([mp, kp]).collect();
        let b_size: Vec<i64> = lead.iter().copied().chain([kp, np]).collect();
        let args = vec![self.zero_padded(a, &a_size)?, self.zero_padded(b, &b_size)?];
        let size: Vec<i64> = lead.iter().copied().chain([mp, np]).collect();
        let padded = TensorMeta { shape: size.clone(), stride: contiguous_strides(&size), ..out.clone() };
        let Lowered::Tensor(full) = self.push_extern(Self::callee(op), args, vec![], &Meta::Tensor(padded), Self::gemm_kind())? else {
            return malformed("a GEMM produced no tensor");
        };
        let Src::View { buf, .. } = full.src else { return malformed("a GEMM result is not a buffer") };
        let layout = Layout { size: out.shape.clone(), stride: contiguous_strides(&size), offset: 0, dtype: out.dtype, device: out.device.clone() };
        Ok(view_of_layout(buf, &layout))
    }

    /// Node `n`'s value zero-padded to `size` (each dim at least its own), realized in the
    /// orientation its view has (a transposed weight stays column-major).
    fn zero_padded(&mut self, n: NodeId, size: &[i64]) -> LResult<ExternArg> {
        // realized once for every GEMM that reads it (a gradient feeds two)
        let tv = self.realized_node(n, false)?;
        let r = size.len();
        let (buf, st, offset) = strided_base(self, &tv)?;
        let column_major = st[r - 2] == 1 && st[r - 1] != 1;
        let own = tv.size.clone();
        let dt = tv.dtype;
        let f = move |bx: &mut Bx, idx: &[IndexExpr]| -> ValueId {
            let mut inside: Option<ValueId> = None;
            let mut base = IndexExpr::constant(offset);
            let mut terms = Vec::new();
            for (d, i) in idx.iter().enumerate() {
                if own[d] >= 1 && i.bounds(&bx.ranges).1 < own[d] as i128 {
                    base = base.add(&i.scale(st[d]));
                    continue;
                }
                let iv = bx.body.index(i.clone(), DType::I64);
                let end = bx.body.constant(Scalar::Int(own[d]), DType::I64);
                inside = Some(and_in_range(bx, inside, iv, end));
                // padded positions read the last real element (in bounds), then are zeroed
                terms.push((clamp_index(bx, iv, own[d] - 1), st[d]));
            }
            let v = bx.body.load_indirect(buf, base, terms, dt);
            match inside {
                Some(c) => {
                    let zero = bx.body.constant(Scalar::Int(0), dt.compute());
                    bx.body.where_(c, v, zero)
                }
                None => v,
            }
        };
        let lazy = TensorValue::lazy(size.to_vec(), dt, tv.device.clone(), 1, 4, f);
        // [.., rows, cols], stored with rows contiguous when the operand was (a transposed weight)
        let mut order: Vec<i64> = size.to_vec();
        if column_major {
            order.swap(r - 2, r - 1);
        }
        let mut stride = contiguous_strides(&order);
        if column_major {
            stride.swap(r - 2, r - 1);
        }
        let layout = Layout { size: size.to_vec(), stride, offset: 0, dtype: dt, device: tv.device.clone() };
        Ok(self.realize_arg(n, &lazy, layout)?.1)
    }
}
