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
use serde::{Deserialize, Serialize};

/// Which unaligned GEMMs are padded (`Options::pad_mm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PadMm {
    /// Those the graph names in `padded_matmuls` (measured faster padded).
    #[default]
    Measured,
    /// Every GEMM of 16-bit floats with a dim that is not a multiple of `ALIGN`.
    Always,
    Never,
}

impl PadMm {
    pub const ALL: [PadMm; 3] = [PadMm::Measured, PadMm::Always, PadMm::Never];
}

/// Which GEMMs of a Triton graph are matrix-product kernels (`LoopNode::contraction`) whose
/// pointwise readers fuse into them, rather than library calls (`Options::gemm_template`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum GemmTemplate {
    /// Every GEMM is a library call.
    Never,
    /// Those the graph names in `template_matmuls` from measurements already cached (an earlier
    /// `measured` compile's): nothing is timed while compiling. The default mode's. The lowering
    /// treats it as `Measured`; only the front's choice of what it names differs.
    #[default]
    Cached,
    /// Those the graph names in `template_matmuls` (measured faster with their epilogue fused,
    /// now or earlier: `python/ferrocore/gemm_choice.py`).
    Measured,
    /// Every GEMM a template computes (16- and 32-bit floats, unit scales).
    Always,
}

impl GemmTemplate {
    pub const ALL: [GemmTemplate; 4] = [GemmTemplate::Never, GemmTemplate::Cached, GemmTemplate::Measured, GemmTemplate::Always];
}

/// Elements of a 16-bit float in 16 bytes: cuBLAS's fast kernels want rows aligned to this
/// (`python/ferrocore/padding.py` reads it through the extension, `GEMM_ALIGN`).
pub const ALIGN: i64 = 8;

/// The largest GEMM (multiply-adds) the C++ backend computes itself by default: below it a
/// library call's fixed cost (the wrapper's call into ATen, a separate kernel for the bias or
/// activation) is a large part of the GEMM's time, and the generated kernel is within a few
/// percent of MKL's arithmetic (docs/cpu_gemm.md).
pub const CPU_TEMPLATE_FMAS: i64 = 1 << 21;
/// The longest sum over k a default C++ matrix-product kernel takes (its float32 accumulator
/// adds the terms in order, as MKL's small-matrix kernels do).
pub const CPU_TEMPLATE_K: i64 = 4096;

/// The most a GEMM operand computed in the graph may cost per element (loads, operations) to be
/// recomputed in the product's kernel rather than stored first (`prologue_operand`).
const PROLOGUE_READS: usize = 2;
const PROLOGUE_OPS: usize = 8;

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
        if plain_addmm && self.takes_template(a, b, &out) {
            return self.template_gemm(op, a, b, &out).map(Lowered::Tensor);
        }
        let padded = if plain_addmm { self.padding_for(a, b)? } else { None };
        let gemm = if op == AtenOp::Bmm { AtenOp::Bmm } else { AtenOp::Mm };
        // a padded addmm of one bias row adds it in the library's epilogue, on the padded bias:
        // its result is the padded GEMM's, which a graph output returns as a view
        let row_bias = match self.arg(0, "self") {
            Some(Arg::Node(c)) if op == AtenOp::Addmm => {
                let c = *c;
                let n = out.shape.last().copied();
                self.graph.node(c).meta.tensor().filter(|m| m.shape.len() == 1 && Some(m.shape[0]) == n && m.dtype == out.dtype).map(|_| c)
            }
            _ => None,
        };
        let product = match padded {
            Some(pad) if row_bias.is_some() => return Ok(Lowered::Tensor(self.padded_gemm(AtenOp::Addmm, a, b, row_bias, &pad, &out)?)),
            Some(pad) => self.padded_gemm(gemm, a, b, None, &pad, &out)?,
            None if op == AtenOp::Addmm && plain_addmm && out.device != Device::Cpu && matches!(out.dtype, DType::F32 | DType::F64) => {
                let args = vec![self.extern_tensor(a, false)?, self.extern_tensor(b, false)?];
                let Lowered::Tensor(p) =
                    self.push_extern(Self::callee(gemm), args, vec![], &Meta::Tensor(out.clone()), Self::gemm_kind())?
                else {
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
        Ok(Lowered::Tensor(pointwise(
            vec![PwIn::Tensor(product), PwIn::Tensor(bias)],
            out.shape.clone(),
            dt,
            out.device,
            dt,
            move |bx, v| {
                let p = bx.body.cast(v[0], dt);
                let c = bx.body.cast(v[1], dt);
                bx.body.binary(BinaryOp::Add, p, c)
            },
        )))
    }

    /// Whether this GEMM is a matrix-product kernel: asked for (Triton), or small enough that
    /// the library call's overhead outweighs its speed (C++, float32), floats of one type.
    fn takes_template(&self, a: NodeId, b: NodeId, out: &TensorMeta) -> bool {
        if self.kernels == KernelLanguage::Cpp {
            return self.takes_cpu_template(a, b, out);
        }
        match self.gemm_template {
            GemmTemplate::Never => return false,
            GemmTemplate::Cached | GemmTemplate::Measured
                if !self.graph.template_matmuls.contains_key(&self.graph.node(self.current).name) =>
            {
                return false
            }
            GemmTemplate::Cached | GemmTemplate::Measured | GemmTemplate::Always => {}
        }
        matches!(out.dtype, DType::F16 | DType::BF16 | DType::F32) && self.product_terms(a, b, out).is_some()
    }

    /// The length of the GEMM's sums (k) when a matrix-product node can compute it: operands of
    /// the result's type and device, 2-D or batched, nothing empty, a contiguous result.
    fn product_terms(&self, a: NodeId, b: NodeId, out: &TensorMeta) -> Option<i64> {
        let (ma, mb) = (self.graph.node(a).meta.tensor()?, self.graph.node(b).meta.tensor()?);
        let r = out.shape.len();
        let fits = [ma, mb].iter().all(|m| m.dtype == out.dtype && m.device == out.device && m.shape.len() == r)
            && (r == 2 || r == 3)
            && ma.shape[r - 1] > 0
            && out.shape.iter().all(|&d| d > 0)
            && out.stride == contiguous_strides(&out.shape);
        fits.then(|| ma.shape[r - 1])
    }

    /// The C++ backend's choice, for float32 GEMMs: by default (`cached`) a rule, at most
    /// `CPU_TEMPLATE_FMAS` multiply-adds and `CPU_TEMPLATE_K` terms; under max-autotune
    /// (`measured`) those the front timed faster as kernels; all or none with `always`, `never`.
    fn takes_cpu_template(&self, a: NodeId, b: NodeId, out: &TensorMeta) -> bool {
        let Some(k) = self.product_terms(a, b, out).filter(|_| out.dtype == DType::F32) else { return false };
        let fmas = out.shape.iter().product::<i64>().saturating_mul(k);
        match self.gemm_template {
            GemmTemplate::Never => false,
            GemmTemplate::Always => true,
            // the front timed each float32 GEMM both ways (`python/ferrocore/gemm_choice.py`)
            GemmTemplate::Measured => k <= CPU_TEMPLATE_K && self.graph.template_matmuls.contains_key(&self.graph.node(self.current).name),
            GemmTemplate::Cached => fmas <= CPU_TEMPLATE_FMAS && k <= CPU_TEMPLATE_K,
        }
    }

    /// `a @ b` (plus addmm's bias, a pointwise node over the product that fuses into its kernel)
    /// as a contraction node: sums of products over k, computed in float32, cast to the result's
    /// type once, as cuBLAS does. addmm's product stays in float32 (its one reader is the bias
    /// add, in its kernel): the sum with the bias is rounded once, as eager's addmm rounds it.
    fn template_gemm(&mut self, op: AtenOp, a: NodeId, b: NodeId, out: &TensorMeta) -> LResult<TensorValue> {
        let operand = |cx: &mut Self, n: NodeId| -> LResult<(BufferId, Vec<i64>, i64)> {
            Ok(match cx.extern_tensor(n, false)? {
                ExternArg::Buffer(buf) => {
                    let l = &cx.prog.buffer(buf).layout;
                    (buf, l.stride.clone(), l.offset)
                }
                ExternArg::View { buf, stride, offset, .. } => (buf, stride, offset),
                _ => return malformed("a GEMM operand is not a tensor"),
            })
        };
        let r = out.shape.len();
        let k = self.graph.node(a).meta.tensor().map_or(0, |m| m.shape[r - 1]);
        let dt = out.dtype;
        let product_dt = if op == AtenOp::Addmm { DType::F32 } else { dt };
        let var = |i: usize| IndexExpr::var(Var(i as u32));
        // variables: [batch,] m, n, then k
        let (m, n, kv) = (var(r - 2), var(r - 1), var(r));
        let batch: Vec<IndexExpr> = if r == 3 { vec![var(0)] } else { Vec::new() };
        let mut ranges = out.shape.clone();
        ranges.push(k);
        let mut body = LoopBody::default();
        let mut sides = Vec::new();
        for (node, (row, col)) in [(a, (&m, &kv)), (b, (&kv, &n))] {
            let value = match self.prologue_operand(node)? {
                // recomputed per tile: rounded to the operand's type, as eager stores it
                Some(tv) => {
                    let mut bx = Bx { body: &mut body, ranges: ranges.clone() };
                    let idx: Vec<IndexExpr> = batch.iter().chain([row, col]).cloned().collect();
                    let v = tv.load(&mut bx, &idx);
                    let v = body.cast(v, dt);
                    self.decisions
                        .push(("gemm_template", format!("prologue: {} computed in the product's kernel", self.graph.node(node).name)));
                    v
                }
                None => {
                    let (buf, st, off) = operand(self, node)?;
                    let mut index = IndexExpr::constant(off).add(&row.scale(st[r - 2])).add(&col.scale(st[r - 1]));
                    if r == 3 {
                        index = index.add(&var(0).scale(st[0]));
                    }
                    body.load(buf, index, dt)
                }
            };
            sides.push(value);
        }
        let layout = Layout::contiguous(&out.shape, product_dt, out.device);
        let buf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let (ca, cb) = (body.cast(sides[0], DType::F32), body.cast(sides[1], DType::F32));
        let product = body.binary(BinaryOp::Mul, ca, cb);
        let sum = body.reduce(ReduceOp::Sum, product);
        let value = body.cast(sum, product_dt);
        let out_index: Vec<IndexExpr> = (0..r).map(var).collect();
        body.set_store(layout.index_of(&out_index), value);
        let node = LoopNode {
            output: buf,
            ranges: out.shape.clone(),
            reduction_ranges: vec![k],
            body,
            origins: vec![self.node_name()],
            template: Some(Template::MatrixProduct { operands: dt }),
        };
        self.push_node(node);
        let name = &self.graph.node(self.current).name;
        let why = match self.graph.template_matmuls.get(name) {
            Some(w) => w.clone(),
            None if self.kernels == KernelLanguage::Cpp && self.gemm_template == GemmTemplate::Cached => {
                format!("{} multiply-adds, at most {CPU_TEMPLATE_FMAS} (the C++ rule)", out.shape.iter().product::<i64>() * k)
            }
            None => "gemm_template = always".to_string(),
        };
        self.decisions.push((
            "gemm_template",
            format!("template: {name} {:?} x {k} {} is a matrix-product kernel: {why}", out.shape, dt.torch_name()),
        ));
        let product = view_of_layout(buf, &layout);
        if op != AtenOp::Addmm {
            return Ok(product);
        }
        let bias = self.tensor_arg(0, "self")?;
        Ok(pointwise(vec![PwIn::Tensor(product), PwIn::Tensor(bias)], out.shape.clone(), dt, out.device, DType::F32, |bx, v| {
            let c = bx.body.cast(v[1], DType::F32);
            bx.body.binary(BinaryOp::Add, v[0], c)
        }))
    }

    /// Operand `n` as a value the product's kernel computes from what it reads (its prologue: a
    /// cast, a scaling, a transpose of either), when only this GEMM reads it and recomputing it
    /// is cheap: every column tile of the product reads each element again. None: read from
    /// memory, realized first if it is computed. Triton's template only (the C++ kernel packs
    /// its operands from memory).
    fn prologue_operand(&mut self, n: NodeId) -> LResult<Option<TensorValue>> {
        if self.kernels != KernelLanguage::Triton || self.uses[n.0 as usize] != 1 {
            return Ok(None);
        }
        let tv = self.tensor_of(n)?;
        match tv.src {
            Src::Lazy { reads, ops, .. } if reads <= PROLOGUE_READS && ops <= PROLOGUE_OPS => {}
            _ => return Ok(None),
        }
        // a view of a value that something else reads too is realized once (`realized_node`)
        let (base, chain) = self.view_chain(n, |op| {
            use AtenOp::*;
            matches!(
                op,
                View | UnsafeView | Reshape | Permute | Expand | Unsqueeze | SqueezeDim | SqueezeDims | Squeeze | TransposeInt | T | Alias
            )
        });
        if !chain.is_empty() && self.uses[base.0 as usize] > 1 {
            return Ok(None);
        }
        Ok(Some(tv))
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
            format!(
                "pad: {node} {:?} x {:?} {} runs as {:?} x {:?}: {why}",
                ma.shape,
                mb.shape,
                ma.dtype,
                [round_up(m), round_up(k)],
                [round_up(k), round_up(n)]
            ),
        ));
        Ok(Some(sizes))
    }

    /// The GEMM on zero-padded copies of its operands (`pad` = [.., M', K', N']; addmm's bias
    /// row padded to N'), into a padded result; returns the view of its unpadded corner.
    fn padded_gemm(
        &mut self,
        op: AtenOp,
        a: NodeId,
        b: NodeId,
        bias: Option<NodeId>,
        pad: &[i64],
        out: &TensorMeta,
    ) -> LResult<TensorValue> {
        let r = pad.len();
        let lead = &pad[..r - 3];
        let (mp, kp, np) = (pad[r - 3], pad[r - 2], pad[r - 1]);
        let a_size: Vec<i64> = lead.iter().copied().chain([mp, kp]).collect();
        let b_size: Vec<i64> = lead.iter().copied().chain([kp, np]).collect();
        let mut args = Vec::new();
        if let Some(c) = bias {
            args.push(self.zero_padded(c, &[np])?);
        }
        args.push(self.zero_padded(a, &a_size)?);
        args.push(self.zero_padded(b, &b_size)?);
        let size: Vec<i64> = lead.iter().copied().chain([mp, np]).collect();
        let padded = TensorMeta { shape: size.clone(), stride: contiguous_strides(&size), ..out.clone() };
        let Lowered::Tensor(full) = self.push_extern(Self::callee(op), args, vec![], &Meta::Tensor(padded), Self::gemm_kind())? else {
            return malformed("a GEMM produced no tensor");
        };
        let Src::View { buf, .. } = full.src else { return malformed("a GEMM result is not a buffer") };
        self.padded_results.push(buf);
        let layout = Layout { size: out.shape.clone(), stride: contiguous_strides(&size), offset: 0, dtype: out.dtype, device: out.device };
        Ok(view_of_layout(buf, &layout))
    }

    /// Node `n`'s value zero-padded to `size` (each dim at least its own), as a GEMM operand.
    /// One padded buffer serves every GEMM that reads the same elements, whatever the view (a
    /// gradient feeds `g @ w` and `g.T @ h`); a value not yet in memory is computed straight into
    /// padded storage and its other readers take the corner (no unpadded copy).
    fn zero_padded(&mut self, n: NodeId, size: &[i64]) -> LResult<ExternArg> {
        let mut tv = self.tensor_of(n)?;
        if matches!(tv.src, Src::Lazy { .. }) && self.view_of_realized(n) {
            // a transpose lowered before its source was realized: read that buffer instead
            let graph = self.graph;
            let NodeKind::Call { target, .. } = &graph.node(n).kind else { return malformed("a view without a call") };
            let again = self.as_node(n, |cx| cx.lower_node(n, target));
            if let Ok(Lowered::Tensor(t)) = again {
                self.values[n.0 as usize] = Some(Lowered::Tensor(t.clone()));
                tv = t;
            }
        }
        if tv.size == size {
            // nothing to pad: the operand as an unpadded GEMM takes it (a copy of BERT's last
            // hidden state was live beside the logits GEMM, 6 MB of the training peak)
            return self.extern_tensor(n, false);
        }
        if let Some((buf, st, off)) = tv.strided() {
            if let Some(arg) = self.padded_view(buf, &st, off, &tv.size, size) {
                return Ok(arg);
            }
        }
        if matches!(tv.src, Src::Lazy { .. }) && tv.size.len() == size.len() {
            return Ok(ExternArg::Buffer(self.realize_in_padded_storage(n, &tv, size)?));
        }
        self.padded_copy(n, size)
    }

    /// Node `id`'s value realized with its rows padded to an aligned stride (zeros in the
    /// padding) when a GEMM the padding pass pads reads it, directly or through views: the GEMM
    /// then reads it in place (as Inductor pads the strides of such buffers). None otherwise.
    pub(super) fn realize_row_padded(&mut self, id: NodeId, tv: &TensorValue) -> Option<TensorValue> {
        let r = tv.size.len();
        let cols = *tv.size.last()?;
        if r < 2 || cols % ALIGN == 0 || cols < ALIGN || !matches!(tv.dtype, DType::F16 | DType::BF16) || !self.feeds_padded_gemm(id, 0) {
            return None;
        }
        let mut storage = tv.size.clone();
        storage[r - 1] = round_up(cols);
        self.realize_in_padded_storage(id, tv, &storage).ok()?;
        let node = &self.graph.node(id).name;
        self.decisions
            .push(("padding", format!("pad: {node} {:?} is stored with rows of {} for the GEMMs that read it", tv.size, storage[r - 1])));
        self.tensor_of(id).ok()
    }

    /// Whether a GEMM that the padding pass pads reads node `id`, directly or through views.
    fn feeds_padded_gemm(&self, id: NodeId, depth: usize) -> bool {
        if depth > 4 {
            return false;
        }
        self.users[id.0 as usize].iter().any(|&u| {
            let node = self.graph.node(u);
            let NodeKind::Call { target: Target::Aten(op), .. } = &node.kind else { return false };
            match op {
                AtenOp::Mm | AtenOp::Bmm | AtenOp::Addmm => match self.pad_mm {
                    PadMm::Never => false,
                    PadMm::Always => true,
                    PadMm::Measured => self.graph.padded_matmuls.contains_key(&node.name),
                },
                AtenOp::View | AtenOp::UnsafeView | AtenOp::Permute | AtenOp::TransposeInt | AtenOp::T => {
                    self.feeds_padded_gemm(u, depth + 1)
                }
                _ => false,
            }
        })
    }

    /// Whether node `n` is a view op whose source node's value is now in memory.
    fn view_of_realized(&self, n: NodeId) -> bool {
        let node = self.graph.node(n);
        let NodeKind::Call { target, args, .. } = &node.kind else { return false };
        let is_view =
            matches!(target, Target::Aten(AtenOp::View | AtenOp::UnsafeView | AtenOp::Permute | AtenOp::TransposeInt | AtenOp::T));
        let source = match args.first() {
            Some(Arg::Node(s)) => *s,
            _ => return false,
        };
        is_view && matches!(&self.values[source.0 as usize], Some(Lowered::Tensor(t)) if t.strided().is_some())
    }

    /// A view of an earlier padded buffer holding exactly these elements, padded to `size`.
    fn padded_view(&self, buf: BufferId, st: &[i64], off: i64, own: &[i64], size: &[i64]) -> Option<ExternArg> {
        if size.iter().any(|&d| d < 2) {
            return None; // a size-1 dim's stride says nothing about which dim it is
        }
        if let Some(arg) = self.zero_padded_storage.iter().find(|z| z.buf == buf).and_then(|z| z.view(st, off, own, size)) {
            return Some(arg);
        }
        self.padded.iter().find_map(|e| {
            if e.source != buf || e.offset != off || e.dims.len() != st.len() {
                return None;
            }
            let stride: Option<Vec<i64>> = st
                .iter()
                .zip(size)
                .map(|(s, n)| e.dims.iter().find(|(src, _, padded)| src == s && padded == n).map(|(_, p, _)| *p))
                .collect();
            Some(ExternArg::View { buf: e.padded, size: size.to_vec(), stride: stride?, offset: 0 })
        })
    }

    /// `tv` computed into the corner of a zero-filled buffer of `storage` size (each dim at least
    /// its own); node `n` now reads that corner, and padded GEMMs read the buffer as it is.
    fn realize_in_padded_storage(&mut self, n: NodeId, tv: &TensorValue, storage: &[i64]) -> LResult<BufferId> {
        let layout = Layout::contiguous(storage, tv.dtype, tv.device);
        let own = tv.size.clone();
        let corner = Layout { size: own.clone(), ..layout.clone() };
        let buf = self.as_node(n, |cx| {
            let (buf, _, _) = cx.realize_into(tv, corner.clone()).strided()?;
            // the padding: for each padded dim d, the elements whose first out-of-range dim is d
            for d in (0..storage.len()).filter(|&d| storage[d] > own[d]) {
                let ranges: Vec<i64> = (0..storage.len())
                    .map(|e| {
                        if e < d {
                            own[e]
                        } else if e == d {
                            storage[d] - own[d]
                        } else {
                            storage[e]
                        }
                    })
                    .collect();
                let mut body = LoopBody::default();
                let mut idx: Vec<IndexExpr> = (0..storage.len()).map(|e| IndexExpr::var(Var(e as u32))).collect();
                idx[d] = idx[d].add(&IndexExpr::constant(own[d]));
                let zero = body.constant(Scalar::Int(0), tv.dtype);
                body.set_store(layout.index_of(&idx), zero);
                cx.push_node(LoopNode {
                    output: buf,
                    ranges,
                    reduction_ranges: vec![],
                    body,
                    origins: vec![cx.node_name()],
                    template: None,
                });
            }
            Some(buf)
        });
        let buf = buf.ok_or((LowerErrorKind::Malformed, "a padded realization produced no buffer".to_string()))?;
        // the storage holds the padding too (the corner's layout would end short of the last row's)
        self.prog.buffers[buf.0 as usize].layout = layout;
        self.values[n.0 as usize] = Some(Lowered::Tensor(view_of_layout(buf, &corner)));
        self.zero_padded_storage.extend(ZeroPaddedStorage::of(buf, storage, &own));
        Ok(buf)
    }

    /// A zero-padded copy of node `n`'s value in memory, in the orientation its view has (a
    /// transposed weight stays column-major).
    fn padded_copy(&mut self, n: NodeId, size: &[i64]) -> LResult<ExternArg> {
        let tv = self.realized_node(n, false)?;
        let r = size.len();
        let (buf, st, offset) = strided_base(self, &tv)?;
        let column_major = r >= 2 && st[r - 2] == 1 && st[r - 1] != 1;
        let own = tv.size.clone();
        let dt = tv.dtype;
        let src_strides = st.clone();
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
        let lazy = TensorValue::lazy(size.to_vec(), dt, tv.device, 1, 4, f);
        // [.., rows, cols], stored with rows contiguous when the operand was (a transposed weight)
        let mut order: Vec<i64> = size.to_vec();
        if column_major {
            order.swap(r - 2, r - 1);
        }
        let mut stride = contiguous_strides(&order);
        if column_major {
            stride.swap(r - 2, r - 1);
        }
        let layout = Layout { size: size.to_vec(), stride: stride.clone(), offset: 0, dtype: dt, device: tv.device };
        let (r, arg) = self.realize_arg(n, &lazy, layout)?;
        if let Some((padded, _, _)) = r.strided() {
            let dims = src_strides.iter().zip(&stride).zip(size).map(|((s, p), n)| (*s, *p, *n)).collect();
            self.padded.push(PaddedOperand { source: buf, offset, dims, padded });
        }
        Ok(arg)
    }
}

/// A buffer holding the elements of `source` (from `offset`) zero-padded for a GEMM: per dim,
/// (stride in the source, stride in the padded buffer, padded size).
#[derive(Clone, Debug)]
pub struct PaddedOperand {
    source: BufferId,
    offset: i64,
    dims: Vec<(i64, i64, i64)>,
    padded: BufferId,
}

/// A buffer whose storage is a matrix of `rows` rows `row_stride` apart, of which the columns
/// from `cols` on and the rows from `real_rows` on hold zeros: a GEMM may read it padded.
#[derive(Clone, Debug)]
pub struct ZeroPaddedStorage {
    buf: BufferId,
    row_stride: i64,
    cols: i64,
    rows: i64,
    real_rows: i64,
}

impl ZeroPaddedStorage {
    /// For a buffer of `storage` size (row-major) holding a value of size `own` in its corner.
    fn of(buf: BufferId, storage: &[i64], own: &[i64]) -> Option<ZeroPaddedStorage> {
        let r = storage.len();
        if r < 2 || own.len() != r || storage[..r - 2] != own[..r - 2] {
            return None;
        }
        let lead: i64 = storage[..r - 2].iter().product();
        let rows = lead * storage[r - 2];
        let real_rows = if lead == 1 {
            own[r - 2]
        } else if own[r - 2] == storage[r - 2] {
            rows
        } else {
            return None;
        };
        Some(ZeroPaddedStorage { buf, row_stride: storage[r - 1], cols: own[r - 1], rows, real_rows })
    }

    /// The 2-D view (strides `st` from offset `off`, of size `own`) padded to `size`, when every
    /// element it adds is one of the zeros.
    fn view(&self, st: &[i64], off: i64, own: &[i64], size: &[i64]) -> Option<ExternArg> {
        if st.len() != 2 || off != 0 {
            return None;
        }
        // which dim walks the columns (unit stride) and which the rows
        let (c, r) = if st[1] == 1 {
            (1, 0)
        } else if st[0] == 1 {
            (0, 1)
        } else {
            return None;
        };
        let cols_ok = own[c] == self.cols && size[c] <= self.row_stride;
        let rows_ok = st[r] == self.row_stride && size[r] <= self.rows && (size[r] == own[r] || own[r] == self.real_rows);
        (cols_ok && rows_ok).then(|| ExternArg::View { buf: self.buf, size: size.to_vec(), stride: st.to_vec(), offset: 0 })
    }
}
