//! 2-D pooling as window reductions: each output element reduces over a (kh, kw) window read
//! through clamped indirect loads, with out-of-window positions masked to the reduction's
//! identity. avg_pool2d, max_pool2d_with_indices (values and argmax indices, fused in one
//! kernel) and _adaptive_avg_pool2d (per-output window bounds).

use super::indexing::{and_in_range, clamp_index, strided_base};
use super::*;

#[derive(Clone, Copy, PartialEq)]
enum PoolKind {
    Avg { count_include_pad: bool, divisor: Option<i64> },
    Max,
    Adaptive,
}

/// Per spatial dim: window start of output index `o` and the valid range of the input.
#[derive(Clone)]
struct Window {
    kernel: i64,
    stride: i64,
    pad: i64,
    dilation: i64,
    input: i64,
    output: i64,
}

impl Ctx<'_> {
    pub(super) fn lower_pool2d(&mut self, op: AtenOp) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "self")?;
        let rank = x.size.len();
        if rank < 3 {
            return malformed("2-D pooling needs an input of rank 3 or 4");
        }
        let metas: Vec<TensorMeta> = match self.meta() {
            Meta::Tensor(t) => vec![t.clone()],
            Meta::Tuple(items) => items.iter().filter_map(|m| m.as_ref().and_then(|m| m.tensor().cloned())).collect(),
            _ => return malformed("pooling without tensor metadata"),
        };
        let Some(out) = metas.first().cloned() else { return malformed("pooling without output metadata") };
        let pair = |v: Option<Vec<i64>>, d: i64| -> Vec<i64> {
            match v {
                Some(v) if v.len() == 2 => v,
                Some(v) if v.len() == 1 => vec![v[0], v[0]],
                _ => vec![d, d],
            }
        };
        let (kind, kernel, stride, pad, dil) = match op {
            AtenOp::AdaptiveAvgPool2d => (PoolKind::Adaptive, vec![0, 0], vec![1, 1], vec![0, 0], vec![1, 1]),
            _ => {
                let k = pair(self.ints_arg(1, "kernel_size")?, 1);
                let s = match self.ints_arg(2, "stride")? {
                    Some(s) if !s.is_empty() => pair(Some(s), 1),
                    _ => k.clone(),
                };
                let p = pair(self.ints_arg(3, "padding")?, 0);
                let (kind, d) = if op == AtenOp::AvgPool2d {
                    let cip = self.bool_arg(5, "count_include_pad", true)?;
                    let div = self.int_arg(6, "divisor_override")?;
                    (PoolKind::Avg { count_include_pad: cip, divisor: div }, vec![1, 1])
                } else {
                    (PoolKind::Max, pair(self.ints_arg(4, "dilation")?, 1))
                };
                (kind, k, s, p, d)
            }
        };
        if !x.dtype.is_float() {
            return unsupported("pooling of a non-float tensor");
        }
        let (h, w) = (x.size[rank - 2], x.size[rank - 1]);
        let (oh, ow) = (out.shape[rank - 2], out.shape[rank - 1]);
        if h == 0 || w == 0 || oh == 0 || ow == 0 {
            return unsupported("pooling over an empty plane");
        }
        let win = |d: usize, input: i64, output: i64| Window {
            kernel: if kind == PoolKind::Adaptive { adaptive_max_window(input, output) } else { kernel[d] },
            stride: stride[d],
            pad: pad[d],
            dilation: dil[d],
            input,
            output,
        };
        let wins = vec![win(0, h, oh), win(1, w, ow)];
        let (buf, xs, xoff) = strided_base(self, &x)?;
        let acc = out.dtype.compute();
        let dims: Vec<i64> = out.shape.clone();
        // reduce over the two window dims, appended after the output dims
        let nb = rank - 2;
        let build = |cx: &mut Self, rop: Option<ReduceOp>, arg: bool| -> TensorValue {
            let ranges = dims.clone();
            let reduction_ranges = vec![wins[0].kernel, wins[1].kernel];
            let dtype = if arg { DType::I64 } else { acc };
            let layout = Layout::contiguous(&ranges, dtype, Device::Cpu);
            let obuf = cx.prog.add_buffer(layout.clone(), BufferSource::Computed);
            let mut body = LoopBody::default();
            {
                let all: Vec<i64> = ranges.iter().chain(&reduction_ranges).copied().collect();
                let mut bx = Bx { body: &mut body, ranges: all };
                let out_idx: Vec<IndexExpr> = (0..rank).map(|i| IndexExpr::var(Var(i as u32))).collect();
                let mut base = IndexExpr::constant(xoff);
                for d in 0..nb {
                    base = base.add(&out_idx[d].scale(xs[d]));
                }
                let zero = bx.body.constant(Scalar::Int(0), DType::I64);
                let mut valid: Option<ValueId> = None;
                let mut terms = Vec::new();
                let mut positions = Vec::new();
                for k in 0..2 {
                    let wn = &wins[k];
                    let o = &out_idx[nb + k];
                    let kv = IndexExpr::var(Var((rank + k) as u32));
                    let (start, end) = window_bounds(&mut bx, kind, wn, o);
                    let i = bx.body.index(kv.scale(wn.dilation), DType::I64);
                    let pos = bx.body.binary(BinaryOp::Add, start, i);
                    valid = Some(and_in_range(&mut bx, valid, pos, end));
                    let c = clamp_index(&mut bx, pos, wn.input - 1);
                    terms.push((c, xs[nb + k]));
                    positions.push(c);
                }
                let valid = valid.unwrap_or(zero);
                let v = bx.body.load_indirect(buf, base, terms, x.dtype);
                let v = bx.body.cast(v, acc);
                let result = match (rop, arg) {
                    (_, true) => {
                        let ninf = bx.body.constant(Scalar::Float(f64::NEG_INFINITY), acc);
                        let m = bx.body.where_(valid, v, ninf);
                        let wc = bx.body.constant(Scalar::Int(w), DType::I64);
                        let r = bx.body.binary(BinaryOp::Mul, positions[0], wc);
                        let flat = bx.body.binary(BinaryOp::Add, r, positions[1]);
                        bx.body.arg_reduce(ReduceOp::ArgMax, m, flat)
                    }
                    (Some(ReduceOp::Max), _) => {
                        let ninf = bx.body.constant(Scalar::Float(f64::NEG_INFINITY), acc);
                        let m = bx.body.where_(valid, v, ninf);
                        bx.body.reduce(ReduceOp::Max, m)
                    }
                    _ => {
                        let z = bx.body.constant(Scalar::Float(0.0), acc);
                        let m = bx.body.where_(valid, v, z);
                        let s = bx.body.reduce(ReduceOp::Sum, m);
                        let count = divisor(&mut bx, kind, &wins, &out_idx[nb..]);
                        let cf = bx.body.cast(count, acc);
                        bx.body.binary(BinaryOp::TrueDiv, s, cf)
                    }
                };
                let r = bx.body.cast(result, dtype);
                bx.body.set_store(layout.index_of(&out_idx), r);
            }
            cx.push_node(LoopNode { output: obuf, ranges, reduction_ranges, body, origins: vec![cx.node_name()] });
            view_of_layout(obuf, &layout)
        };
        match kind {
            PoolKind::Max => {
                let vals = build(self, Some(ReduceOp::Max), false);
                let idx = build(self, None, true);
                let v = self.cast_to(vals, &out);
                let i = match metas.get(1) {
                    Some(im) => self.cast_to(idx, im),
                    None => idx,
                };
                Ok(Lowered::Tuple(vec![Some(Lowered::Tensor(v)), Some(Lowered::Tensor(i))]))
            }
            _ => {
                let r = build(self, Some(ReduceOp::Sum), false);
                Ok(Lowered::Tensor(self.cast_to(r, &out)))
            }
        }
    }

    fn cast_to(&mut self, tv: TensorValue, m: &TensorMeta) -> TensorValue {
        if tv.dtype == m.dtype {
            return tv;
        }
        let dt = m.dtype;
        super::pointwise::pointwise(vec![super::pointwise::PwIn::Tensor(tv)], m.shape.clone(), dt, m.device.clone(), dt, move |bx, v| {
            bx.body.cast(v[0], dt)
        })
    }
}

/// The longest adaptive window: max over outputs of ceil((o+1)·in/out) − floor(o·in/out).
fn adaptive_max_window(input: i64, output: i64) -> i64 {
    (0..output).map(|o| ((o + 1) * input + output - 1) / output - (o * input) / output).max().unwrap_or(1).max(1)
}

/// (first input position of the window, end of the valid positions) for output index `o`.
fn window_bounds(bx: &mut Bx, kind: PoolKind, wn: &Window, o: &IndexExpr) -> (ValueId, ValueId) {
    let r = bx.ranges.clone();
    match kind {
        PoolKind::Adaptive => {
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

/// Number the window sum is divided by, as ATen's avg_pool2d / adaptive_avg_pool2d define it.
fn divisor(bx: &mut Bx, kind: PoolKind, wins: &[Window], out_idx: &[IndexExpr]) -> ValueId {
    let r = bx.ranges.clone();
    let mut count: Option<ValueId> = None;
    for (k, wn) in wins.iter().enumerate() {
        let o = &out_idx[k];
        let len = match kind {
            PoolKind::Avg { divisor: Some(d), .. } => return bx.body.constant(Scalar::Int(d), DType::I64),
            PoolKind::Adaptive => {
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
            PoolKind::Max => bx.body.constant(Scalar::Int(1), DType::I64),
        };
        count = Some(match count {
            Some(c) => bx.body.binary(BinaryOp::Mul, c, len),
            None => len,
        });
    }
    count.unwrap_or_else(|| bx.body.constant(Scalar::Int(1), DType::I64))
}
