//! A matrix product's sizes and operand addressing, read off its contraction node
//! (`Template::MatrixProduct`): what every backend's matrix-product kernel starts from.

use super::writer::{local_reads_by_node, Locals, Section};
use super::CodegenError;
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, LocalRead, Schedule};
use crate::symbolic::{Atom, IndexExpr, Var};
use std::collections::HashMap;

/// Whether the kernel is a matrix product with its epilogue.
pub fn is_matrix_product(s: &Schedule, k: &FusedKernel) -> bool {
    k.plan.nodes.first().is_some_and(|kn| s.program.nodes[kn.node].is_matrix_product())
}

/// One operand's addressing: `offset + batch·b + rows·i + cols·j` for element `[b, i, j]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operand {
    pub buf: BufferId,
    pub offset: i64,
    pub batch: i64,
    pub rows: i64,
    pub cols: i64,
}

/// Where a product's operand comes from: a strided read of a buffer, or a value of the
/// product's body the kernel computes per tile from what it reads (a prologue: a cast, a
/// scaling), over the operand's `[m, k]` or `[k, n]` variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Side {
    Memory(Operand),
    Computed(ValueId),
}

impl Side {
    /// The strided read, where the operand is one.
    pub fn memory(&self) -> Option<&Operand> {
        match self {
            Side::Memory(o) => Some(o),
            Side::Computed(_) => None,
        }
    }
}

/// `[batch x] m x n` products summed over `k`: `a` is `[m, k]`, `b` is `[k, n]`, both of `dtype`.
#[derive(Clone, Debug)]
pub struct ProductShape {
    pub batch: i64,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub a: Side,
    pub b: Side,
    pub dtype: DType,
}

impl ProductShape {
    /// The product heading kernel `k`: its body sums `cast(a) * cast(b)` over k, each side a
    /// load or a computed value (`Side`).
    pub fn of(s: &Schedule, k: &FusedKernel) -> Result<ProductShape, CodegenError> {
        let p = &s.program;
        let node = &p.nodes[k.plan.nodes[0].node];
        let bad = |m: &str| CodegenError::internal(&k.name, format!("matrix product {}: {m}", p.buffer(node.output).name));
        if node.convolution().is_some() {
            return Err(bad("a convolution (ConvShape)"));
        }
        let r = node.ranges.len();
        if !(2..=3).contains(&r) || node.reduction_ranges.len() != 1 {
            return Err(bad("not [batch,] m, n by k"));
        }
        let (vm, vn, vk) = (Var(r as u32 - 2), Var(r as u32 - 1), Var(r as u32));
        let vb = (r == 3).then_some(Var(0));
        let body = &node.body;
        let terms = body.exprs.iter().find_map(|e| match e {
            Expr::Reduce(ReduceOp::Sum, x) => match &body.exprs[x.0 as usize] {
                Expr::Binary(BinaryOp::Mul, u, v) => Some([*u, *v]),
                _ => None,
            },
            _ => None,
        });
        let terms = terms.ok_or_else(|| bad("not a sum of products"))?;
        // each factor is its operand cast to float32 (the same value where it is float32; an
        // operand's own conversion to float32, `x.float()`, is part of the operand)
        let operands = node.product_operands().ok_or_else(|| bad("not a matrix product"))?;
        let factor = |x: ValueId| match &body.exprs[x.0 as usize] {
            Expr::Cast(v) if body.dtype(x) == DType::F32 && body.dtype(*v) == operands => *v,
            _ => x,
        };
        let [u, v] = terms.map(factor);
        let side = |x: ValueId, row: Var, col: Var| -> Option<Side> {
            let other = if row == vm { vn } else { vm };
            if let Expr::Load { buf, index } = &body.exprs[x.0 as usize] {
                if index.terms.iter().all(|(a, _)| matches!(a, Atom::Var(_))) && index.affine_coeff(other) == Some(0) {
                    return Some(Side::Memory(Operand {
                        buf: *buf,
                        offset: index.constant,
                        batch: vb.map_or(Some(0), |v| index.affine_coeff(v))?,
                        rows: index.affine_coeff(row)?,
                        cols: index.affine_coeff(col)?,
                    }));
                }
            }
            (!reads_var(body, x, other)).then_some(Side::Computed(x))
        };
        let (a, b) = match (side(u, vm, vk), side(v, vk, vn)) {
            (Some(a), Some(b)) => (a, b),
            _ => match (side(v, vm, vk), side(u, vk, vn)) {
                (Some(a), Some(b)) => (a, b),
                _ => return Err(bad("operands not addressed as [m, k] and [k, n]")),
            },
        };
        let dtype = operands;
        if body.dtype(u) != dtype || body.dtype(v) != dtype {
            return Err(bad("operands of another type than the product's"));
        }
        let batch = if r == 3 { node.ranges[0] } else { 1 };
        Ok(ProductShape { batch, m: node.ranges[r - 2], n: node.ranges[r - 1], k: node.reduction_ranges[0], a, b, dtype })
    }

    /// Both operands as strided reads (the C++ kernel packs them from memory).
    pub fn in_memory(&self) -> Option<(&Operand, &Operand)> {
        Some((self.a.memory()?, self.b.memory()?))
    }
}

/// Whether value `x` of `body` depends on variable `v` (through an index it reads or computes),
/// or is something a prologue cannot be (a reduction or scan of its own).
fn reads_var(body: &LoopBody, x: ValueId, v: Var) -> bool {
    let mut stack = vec![x];
    let mut seen = std::collections::HashSet::new();
    while let Some(y) = stack.pop() {
        if !seen.insert(y) {
            continue;
        }
        let e = &body.exprs[y.0 as usize];
        match e {
            Expr::Load { index, .. } | Expr::Index(index) | Expr::LoadIndirect { index, .. } if index.uses(v) => return true,
            Expr::Reduce(..) | Expr::Scan(..) | Expr::ArgReduce(..) => return true,
            _ => {}
        }
        stack.extend(e.operands());
    }
    false
}

/// A convolution template's sizes and operands (`Template::Convolution`), read off its node: the
/// implicit product's rows are the output pixels `(n, oh, ow)`, its columns the output channels,
/// its sum the taps `(kh, kw)` by the input channels.
#[derive(Clone, Debug)]
pub struct ConvShape {
    pub images: i64,
    pub out_hw: [i64; 2],
    pub channels_out: i64,
    pub kernel: [i64; 2],
    /// The input channels a result sums over (1 for a depthwise convolution).
    pub channels_in: i64,
    pub geometry: ConvGeometry,
    /// The input's element `(n, c, h, w)` is at `offset + n·s0 + c·s1 + h·s2 + w·s3`.
    pub input: Strided4,
    /// The weight's element `(o, c, kh, kw)`, likewise.
    pub weight: Strided4,
    pub dtype: DType,
}

/// A 4-D operand's buffer, offset and strides.
#[derive(Clone, Copy, Debug)]
pub struct Strided4 {
    pub buf: BufferId,
    pub offset: i64,
    pub stride: [i64; 4],
}

impl ConvShape {
    /// The convolution heading kernel `k`: the body's gather of the input (at the clamped
    /// positions of its two spatial dims) and its load of the weight.
    pub fn of(s: &Schedule, k: &FusedKernel) -> Result<ConvShape, CodegenError> {
        let p = &s.program;
        let node = &p.nodes[k.plan.nodes[0].node];
        let bad = |m: &str| CodegenError::internal(&k.name, format!("convolution {}: {m}", p.buffer(node.output).name));
        let geometry = *node.convolution().ok_or_else(|| bad("not a convolution template"))?;
        let sums = if geometry.depthwise { 2 } else { 3 };
        if node.ranges.len() != 4 || node.reduction_ranges.len() != sums {
            return Err(bad("not [n, oh, ow, o] by [kh, kw, c] (depthwise: [kh, kw])"));
        }
        // (variables n, oh, ow, o = 0..4; kh, kw, c = 4..7; a depthwise input's channel is o)
        let channel = if geometry.depthwise { 3 } else { 6 };
        let only = |index: &IndexExpr, vars: &[u32]| index.terms.iter().all(|(a, _)| matches!(a, Atom::Var(v) if vars.contains(&v.0)));
        let coeff = |index: &IndexExpr, v: u32| index.affine_coeff(Var(v)).unwrap_or(0);
        let mut input = None;
        let mut weight = None;
        for (i, e) in node.body.exprs.iter().enumerate() {
            match e {
                Expr::LoadIndirect { buf, index, terms } if terms.len() == 2 && only(index, &[0, channel]) => {
                    let stride = [coeff(index, 0), coeff(index, channel), terms[0].1, terms[1].1];
                    input = Some((Strided4 { buf: *buf, offset: index.constant, stride }, node.body.dtypes[i]));
                }
                Expr::Load { buf, index } if only(index, &[3, 6, 4, 5]) => {
                    let stride = [coeff(index, 3), coeff(index, 6), coeff(index, 4), coeff(index, 5)];
                    weight = Some((Strided4 { buf: *buf, offset: index.constant, stride }, node.body.dtypes[i]));
                }
                Expr::Load { .. } | Expr::LoadIndirect { .. } => return Err(bad("a read that is neither the input nor the weight")),
                _ => {}
            }
        }
        let ((input, dtype), (weight, wdt)) = input.zip(weight).ok_or_else(|| bad("no input or no weight read"))?;
        if wdt != dtype {
            return Err(bad("operands of two types"));
        }
        let r = &node.ranges;
        let kr = &node.reduction_ranges;
        Ok(ConvShape {
            images: r[0],
            out_hw: [r[1], r[2]],
            channels_out: r[3],
            kernel: [kr[0], kr[1]],
            channels_in: if geometry.depthwise { 1 } else { kr[2] },
            geometry,
            input,
            weight,
            dtype,
        })
    }

    /// The implicit product: rows the output pixels, columns the output channels, and `k` one
    /// tap's slice of the sum (the input channels); `a` and `b` address that slice for tap (0, 0)
    /// without padding.
    pub fn product(&self) -> ProductShape {
        let (x, w) = (&self.input, &self.weight);
        ProductShape {
            batch: 1,
            m: self.images * self.out_hw[0] * self.out_hw[1],
            n: self.channels_out,
            k: self.channels_in,
            a: Side::Memory(Operand { buf: x.buf, offset: x.offset, batch: 0, rows: 0, cols: x.stride[1] }),
            b: Side::Memory(Operand { buf: w.buf, offset: w.offset, batch: 0, rows: w.stride[1], cols: w.stride[0] }),
            dtype: self.dtype,
        }
    }
}

/// What a matrix-product kernel's epilogue is written from: the kernel with the product's node
/// turned into a read of the accumulator `acc` cast to its type (stored where the product is
/// read outside the kernel), the reads of each node served in the kernel (the product's own,
/// forwarded), and `acc` bound as the product's value.
pub struct Epilogue {
    pub kernel: FusedKernel,
    pub reads_at: HashMap<usize, Vec<(BufferId, LocalRead)>>,
    pub locals: Locals,
}

impl Epilogue {
    pub fn of(s: &Schedule, k: &FusedKernel) -> Result<Epilogue, CodegenError> {
        let product = s.program.nodes[k.plan.nodes[0].node].output;
        let mut kernel = k.clone();
        let kn = &mut kernel.plan.nodes[0];
        let store = kn.body.store.clone().ok_or_else(|| CodegenError::internal(&k.name, "a product without a store"))?;
        let dtype = kn.body.dtype(store.value);
        let mut body = LoopBody::default();
        let acc = body.load(product, store.index.clone(), DType::F32);
        let value = body.cast(acc, dtype);
        body.set_store(store.index, value);
        kn.body = body;
        let mut reads_at = local_reads_by_node(&kernel);
        reads_at.entry(0).or_default().push((product, LocalRead::Forwarded));
        let mut locals = Locals::new();
        locals.insert(product, ("acc".to_string(), Section::Pre));
        Ok(Epilogue { kernel, reads_at, locals })
    }
}
