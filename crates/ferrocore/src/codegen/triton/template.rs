//! Matrix products (`LoopNode::contraction`) as tiled Triton kernels. Each program computes one
//! `BLOCK_M x BLOCK_N` tile of the product with `tl.dot` over `BLOCK_K`-wide steps of k (float32
//! accumulators), then the kernel's epilogue on that tile: the pointwise nodes fusion placed
//! after the product, written by the kernel writer with `x0` the tile's flat output indices (a
//! `[BLOCK_M, BLOCK_N]` block), so a bias, an activation, a residual add or a cast costs no
//! round trip through memory.

use super::dialect::compute_type;
use super::{kernel_numel, launch_args, next_power_of_two, template_group, CodegenError, KernelLaunch, LaunchShape, Params, IDX32_LIMIT};
use crate::codegen::product::{ConvShape, Epilogue, Operand, ProductShape, Side};
use crate::codegen::writer::{write_group, write_values, Computed, Section};
use crate::codegen::{Tile, TuneConfig};
use crate::graph::DType;
use crate::scheduler::{FusedKernel, LoopGroup, Schedule};
use crate::symbolic::Var;
use std::collections::HashMap;
use std::fmt::Write;

/// Programs along m that sweep the columns together, so the tiles of B they read stay in L2.
const GROUP_M: i64 = 8;

/// The product's sizes and operands (`ProductShape`), and how the kernel addresses memory.
pub(super) struct MatrixProduct {
    shape: ProductShape,
    /// A convolution's implicit product: `shape` is its product for one tap.
    conv: Option<ConvShape>,
    /// Offsets in int64 (some buffer or the output space exceeds int32's reach).
    idx64: bool,
}

impl std::ops::Deref for MatrixProduct {
    type Target = ProductShape;
    fn deref(&self) -> &ProductShape {
        &self.shape
    }
}

impl MatrixProduct {
    pub(super) fn of(s: &Schedule, k: &FusedKernel, params: &Params) -> Result<MatrixProduct, CodegenError> {
        let conv = s.program.nodes[k.plan.nodes[0].node].convolution().map(|_| ConvShape::of(s, k)).transpose()?;
        let shape = match &conv {
            Some(c) => c.product(),
            None => ProductShape::of(s, k)?,
        };
        if compute_type(shape.dtype).is_none() {
            return Err(CodegenError::internal(&k.name, "a matrix product of a type Triton does not compute"));
        }
        let p = &s.program;
        let mut idx64 = shape.batch * shape.m * shape.n + (shape.m + shape.n) * 256 >= IDX32_LIMIT;
        // a computed operand's index math spans its [batch, m, k] or [batch, k, n] space
        let computed = shape.a.memory().is_none() || shape.b.memory().is_none();
        idx64 |= computed && shape.batch * (shape.m + shape.n) * shape.k >= IDX32_LIMIT;
        for b in params.read.iter().chain(&params.written) {
            idx64 |= p.buffer(*b).layout.storage_numel() >= IDX32_LIMIT;
        }
        Ok(MatrixProduct { shape, conv, idx64 })
    }

    /// The tile the kernel launches with before any tuning, then its neighbours an autotuner may
    /// time; each within the product's sizes (a tile dim at least 16, `tl.dot`'s least).
    fn configs(&self) -> Vec<TuneConfig> {
        let wide = self.dtype == DType::F32;
        // (BLOCK_M, BLOCK_N, BLOCK_K for 16-bit operands, warps, stages)
        // (H200: large GEMMs took 128 x 128 x 64 at 4 warps, or 8 when the epilogue is heavy;
        // 768-wide ones 64 x 128; small ones 64 x 64)
        const SHAPES: [(i64, i64, i64, u32, u32); 10] = [
            (128, 128, 64, 4, 3),
            (128, 128, 64, 8, 3),
            (64, 128, 64, 4, 3),
            (128, 64, 64, 4, 3),
            (64, 64, 64, 4, 4),
            (128, 256, 64, 8, 3),
            (256, 128, 64, 8, 3),
            (128, 128, 32, 4, 4),
            (64, 64, 32, 4, 5),
            (32, 64, 128, 4, 3),
        ];
        let mut out: Vec<TuneConfig> = Vec::new();
        for (bm, bn, bk, warps, stages) in SHAPES {
            let bk = if wide { bk / 2 } else { bk };
            let tile = Tile { m: tile_dim(bm, self.m), n: tile_dim(bn, self.n), k: tile_dim(bk, self.k) };
            // small tiles need fewer warps (a warp's share of a 16 x 16 tile is tiny)
            let warps = if tile.m * tile.n <= 64 * 64 { warps.min(4) } else { warps };
            let grid = self.batch * cdiv(self.m, tile.m) * cdiv(self.n, tile.n);
            let c = TuneConfig { grid, xblock: 0, num_warps: warps, num_stages: stages, tile: Some(tile) };
            if !out.contains(&c) {
                out.push(c);
            }
        }
        out
    }
}

pub(super) fn cdiv(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// A tile's extent along a dim of `size`: `block`, or less for a small dim (at least 16,
/// `tl.dot`'s least).
pub(super) fn tile_dim(block: i64, size: i64) -> i64 {
    block.min(next_power_of_two(size).max(16))
}

/// The kernel's launch: the first configuration, the others as the autotuner's candidates.
pub(super) fn launch(s: &Schedule, k: &FusedKernel, params: &Params, mp: &MatrixProduct) -> KernelLaunch {
    tiled_launch(s, k, params, mp.configs())
}

/// A template kernel's launch over tiles (`BLOCK_M`, `BLOCK_N`, `BLOCK_K`): the first of
/// `candidates`, all of them the autotuner's.
pub(super) fn tiled_launch(s: &Schedule, k: &FusedKernel, params: &Params, candidates: Vec<TuneConfig>) -> KernelLaunch {
    let first = candidates[0];
    let (args, arg_numel) = launch_args(&s.program, params);
    KernelLaunch {
        name: k.name.clone(),
        args,
        checks_indices: params.checks_indices,
        numel: kernel_numel(k),
        shape: LaunchShape::Grid {
            grid: first.grid,
            xblock: 0,
            num_warps: first.num_warps,
            num_stages: first.num_stages,
            tile: first.tile,
        },
        signature: params.signature.clone(),
        candidates,
        arg_numel,
        text: 0..0, // placed by `render`
    }
}

/// The kernel's definition: the tile's product, then its epilogue.
pub(super) fn write(s: &Schedule, k: &FusedKernel, params: &Params, mp: &MatrixProduct) -> Result<String, CodegenError> {
    let mut out = String::new();
    // (one counter for the prologues' and the epilogue's names: the loop's are seen after it)
    let mut tmp = 0usize;
    write_product(&mut out, s, k, params, mp, &mut tmp)?;
    write_epilogue(&mut out, s, k, params, &mut tmp)?;
    Ok(out)
}

/// The signature, the program's tile and the loop over k into `acc`; then `x0`, `xmask` and
/// `xzero` over the tile as every kernel has them.
fn write_product(
    out: &mut String,
    s: &Schedule,
    k: &FusedKernel,
    params: &Params,
    mp: &MatrixProduct,
    tmp: &mut usize,
) -> Result<(), CodegenError> {
    let mut all = params.names.clone();
    all.extend(["BLOCK_M: tl.constexpr".into(), "BLOCK_N: tl.constexpr".into(), "BLOCK_K: tl.constexpr".into()]);
    let (m, n) = (mp.m, mp.n);
    let wide = |e: &str| if mp.idx64 { format!("{e}.to(tl.int64)") } else { e.to_string() };
    let _ = writeln!(out, "@ferro_jit\ndef {}({}):", k.name, all.join(", "));
    let _ = writeln!(out, "    pid = {}", wide("tl.program_id(0)"));
    let _ = writeln!(out, "    tiles_m = {}", cdiv_text(m, "BLOCK_M"));
    let _ = writeln!(out, "    tiles_n = {}", cdiv_text(n, "BLOCK_N"));
    if mp.batch > 1 {
        out.push_str("    zb = pid // (tiles_m * tiles_n)\n    pid = pid % (tiles_m * tiles_n)\n");
    } else {
        out.push_str("    zb = 0\n");
    }
    // programs in groups of GROUP_M tile rows, column by column
    let _ = writeln!(out, "    width = {GROUP_M} * tiles_n");
    let _ = writeln!(out, "    first_m = (pid // width) * {GROUP_M}");
    let _ = writeln!(out, "    group_m = tl.minimum(tiles_m - first_m, {GROUP_M})");
    out.push_str("    pid_m = first_m + (pid % width) % group_m\n    pid_n = (pid % width) // group_m\n");
    let _ = writeln!(out, "    rm = pid_m * BLOCK_M + {}", wide("tl.arange(0, BLOCK_M)"));
    let _ = writeln!(out, "    rn = pid_n * BLOCK_N + {}", wide("tl.arange(0, BLOCK_N)"));
    let _ = writeln!(out, "    rk = {}", wide("tl.arange(0, BLOCK_K)"));
    // rows and columns past the edge read the first ones again (their results are not stored)
    let _ = writeln!(out, "    am = rm % {m}");
    let _ = writeln!(out, "    bn = rn % {n}");
    match &mp.conv {
        Some(conv) => {
            let (x, w) = (operand_ptr(k, params, &conv.input.buf)?, operand_ptr(k, params, &conv.weight.buf)?);
            write_conv_steps(out, conv, (&x, &w))
        }
        None => {
            let reads = [StepRead::of(s, k, params, mp, 0, tmp)?, StepRead::of(s, k, params, mp, 1, tmp)?];
            write_matrix_steps(out, mp, &reads)
        }
    }
    let _ = writeln!(out, "    x0 = zb * {} + rm[:, None] * {n} + rn[None, :]", m * n);
    let _ = writeln!(out, "    xmask = (rm[:, None] < {m}) & (rn[None, :] < {n})");
    out.push_str("    xzero = x0 * 0\n");
    Ok(())
}

fn operand_ptr(k: &FusedKernel, params: &Params, buf: &crate::loop_ir::BufferId) -> Result<String, CodegenError> {
    params.ptr.get(buf).cloned().ok_or_else(|| CodegenError::internal(&k.name, "operand without a pointer"))
}

/// How a k step reads one operand's tile: through pointers that move along k, or computed from
/// what the operand's prologue reads (its text, written by the kernel writer with the tile's
/// rows and the step's k as variables, masked by `{a,b}_mask`).
enum StepRead {
    Memory { ptr: String, at: Operand },
    Computed { before: String, step: String, value: String },
}

impl StepRead {
    /// Operand `side` (0: a, 1: b) of the product.
    fn of(
        s: &Schedule,
        k: &FusedKernel,
        params: &Params,
        mp: &MatrixProduct,
        side: usize,
        tmp: &mut usize,
    ) -> Result<StepRead, CodegenError> {
        let value = match if side == 0 { &mp.a } else { &mp.b } {
            Side::Memory(at) => return Ok(StepRead::Memory { ptr: operand_ptr(k, params, &at.buf)?, at: at.clone() }),
            Side::Computed(v) => *v,
        };
        let node = &s.program.nodes[k.plan.nodes[0].node];
        let r = node.ranges.len() as u32;
        let (vm, vn, vk) = (Var(r - 2), Var(r - 1), Var(r));
        let var_name = move |v: Var| -> String {
            match (side, v) {
                (0, v) if v == vm => "am[:, None]".into(),
                (0, v) if v == vk => "ka[None, :]".into(),
                (1, v) if v == vk => "ka[:, None]".into(),
                (1, v) if v == vn => "bn[None, :]".into(),
                _ => "zb".into(),
            }
        };
        let mask = if side == 0 { "a_mask" } else { "b_mask" };
        let mut dialect = template_group(s, params, &var_name, true, mask);
        let mut ranges = node.ranges.clone();
        ranges.extend(&node.reduction_ranges);
        let (body, value) = node.body.value_alone(value);
        let (text, names) =
            write_values(&mut dialect, &body, &[value], &ranges, 0, tmp).map_err(|why| CodegenError::unsupported(&k.name, why))?;
        Ok(StepRead::Computed {
            before: format!("{}{}", text.kernel, text.pre),
            step: format!("{}{}", text.inner, text.post),
            value: names[0].clone(),
        })
    }
}

/// The Triton type a product's operands are multiplied in.
fn operand_type(dt: DType) -> &'static str {
    match dt {
        DType::BF16 => "tl.bfloat16",
        DType::F16 => "tl.float16",
        _ => "tl.float32",
    }
}

/// The loop over k of a matrix product: both operands' tiles move along k by `BLOCK_K` a step,
/// read through pointers or computed by their prologue.
fn write_matrix_steps(out: &mut String, mp: &MatrixProduct, reads: &[StepRead; 2]) {
    let kk = mp.k;
    let computed = reads.iter().any(|r| matches!(r, StepRead::Computed { .. }));
    for (i, read) in reads.iter().enumerate() {
        match read {
            StepRead::Memory { ptr, at } if i == 0 => {
                let _ = writeln!(
                    out,
                    "    a_ptrs = {ptr} + ({} + zb * {} + am[:, None] * {} + rk[None, :] * {})",
                    at.offset, at.batch, at.rows, at.cols
                );
            }
            StepRead::Memory { ptr, at } => {
                let _ = writeln!(
                    out,
                    "    b_ptrs = {ptr} + ({} + zb * {} + rk[:, None] * {} + bn[None, :] * {})",
                    at.offset, at.batch, at.rows, at.cols
                );
            }
            StepRead::Computed { .. } => {}
        }
    }
    if computed {
        // what a prologue reads at a constant index is read once, before the loop
        let _ = writeln!(out, "    xzero = tl.zeros([1, 1], {})", if mp.idx64 { "tl.int64" } else { "tl.int32" });
        out.push_str(
            "    xmask = xzero == 0
",
        );
        for read in reads {
            if let StepRead::Computed { before, .. } = read {
                indent(out, before, 1);
            }
        }
    }
    out.push_str("    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)\n");
    let _ = writeln!(out, "    for k0 in range(0, {kk}, BLOCK_K):");
    if computed {
        out.push_str("        ka = k0 + rk\n");
    }
    let ty = operand_type(mp.dtype);
    // (name, the tile's shape, the masks of a whole and a last partial step, pointer form's)
    let tiles = [
        ("a", "(BLOCK_M, BLOCK_K)", format!("rk[None, :] < {kk} - k0"), "ka[None, :]"),
        ("b", "(BLOCK_K, BLOCK_N)", format!("rk[:, None] < {kk} - k0"), "ka[:, None]"),
    ];
    // (a whole step where k is a multiple of BLOCK_K, else a last partial one)
    for (whole, head) in [(true, format!("if {kk} % BLOCK_K == 0:")), (false, "else:".to_string())] {
        let _ = writeln!(out, "        {head}");
        for ((name, shape, partial, ka), read) in tiles.iter().zip(reads) {
            match read {
                StepRead::Memory { .. } if whole => {
                    let _ = writeln!(out, "            {name} = tl.load({name}_ptrs)");
                }
                StepRead::Memory { .. } => {
                    let _ = writeln!(out, "            {name} = tl.load({name}_ptrs, mask={partial}, other=0.0)");
                }
                StepRead::Computed { step, value, .. } => {
                    // past k the prologue's value need not be zero: the step's lanes there are
                    let mask = if whole { "xmask".to_string() } else { format!("{ka} < {kk}") };
                    let _ = writeln!(out, "            {name}_mask = {mask}");
                    indent(out, step, 3);
                    let v = if whole { value.clone() } else { format!("tl.where({name}_mask, {value}, 0.0)") };
                    let _ = writeln!(out, "            {name} = tl.broadcast_to({v}, {shape}).to({ty})");
                }
            }
        }
    }
    let _ = writeln!(out, "        acc = {}", dot_text(mp.dtype));
    for (read, (name, step)) in reads.iter().zip([("a", mp.a.memory().map(|a| a.cols)), ("b", mp.b.memory().map(|b| b.rows))]) {
        if let (StepRead::Memory { .. }, Some(step)) = (read, step) {
            let _ = writeln!(out, "        {name}_ptrs += BLOCK_K * {step}");
        }
    }
}

/// `text`'s lines, each indented by `levels` of four spaces.
fn indent(out: &mut String, text: &str, levels: usize) {
    for line in text.lines() {
        let _ = writeln!(out, "{}{line}", "    ".repeat(levels));
    }
}

/// The loop over k of a convolution: one step per tap and `BLOCK_K` input channels (depthwise:
/// per tap, each column's channel times its own filter). A row's pixel reads the input at its
/// tap's position, zero outside the input (the padding).
fn write_conv_steps(out: &mut String, conv: &ConvShape, (px, pw): (&str, &str)) {
    let (x, w, g) = (&conv.input, &conv.weight, &conv.geometry);
    let [oh, ow] = conv.out_hw;
    let [kh, kw] = conv.kernel;
    let c = conv.channels_in;
    let _ = writeln!(out, "    img = am // {}", oh * ow);
    let _ = writeln!(out, "    pix = am % {}", oh * ow);
    let _ = writeln!(out, "    ih0 = (pix // {ow}) * {} - {}", g.stride[0], g.padding[0]);
    let _ = writeln!(out, "    iw0 = (pix % {ow}) * {} - {}", g.stride[1], g.padding[1]);
    let _ = writeln!(out, "    x_rows = {px} + ({} + img * {})", x.offset, x.stride[0]);
    let _ = writeln!(out, "    w_cols = {pw} + ({} + bn * {})", w.offset, w.stride[0]);
    out.push_str("    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)\n");
    if g.depthwise {
        // a row's pixel times each column's own filter, tap by tap (no product of tiles)
        let _ = writeln!(out, "    for tap in range(0, {}):", kh * kw);
    } else {
        let _ = writeln!(out, "    chunks = {}", cdiv_text(c, "BLOCK_K"));
        let _ = writeln!(out, "    for step in range(0, {} * chunks):", kh * kw);
        out.push_str("        tap = step // chunks\n        ck = (step % chunks) * BLOCK_K + rk\n");
    }
    let _ = writeln!(out, "        th = tap // {kw}");
    let _ = writeln!(out, "        tw = tap % {kw}");
    let _ = writeln!(out, "        ih = ih0 + th * {}", g.dilation[0]);
    let _ = writeln!(out, "        iw = iw0 + tw * {}", g.dilation[1]);
    let [h, wd] = g.input_hw;
    let _ = writeln!(out, "        inside = (ih >= 0) & (ih < {h}) & (iw >= 0) & (iw < {wd})");
    let at_tap = format!("x_rows[:, None] + (ih * {} + iw * {})[:, None]", x.stride[2], x.stride[3]);
    if g.depthwise {
        let _ = writeln!(out, "        a = tl.load({at_tap} + bn[None, :] * {}, mask=inside[:, None], other=0.0)", x.stride[1]);
        let _ = writeln!(out, "        b = tl.load(w_cols + (th * {} + tw * {}))", w.stride[2], w.stride[3]);
        out.push_str("        acc = acc + a.to(tl.float32) * b.to(tl.float32)[None, :]\n");
        return;
    }
    let _ = writeln!(out, "        a_ptrs = {at_tap} + ck[None, :] * {}", x.stride[1]);
    let _ =
        writeln!(out, "        b_ptrs = w_cols[None, :] + (th * {} + tw * {}) + ck[:, None] * {}", w.stride[2], w.stride[3], w.stride[1]);
    let partial = [format!("inside[:, None] & (ck[None, :] < {c})"), format!("ck[:, None] < {c}")];
    write_step_product(out, c, [Some("inside[:, None]"), None], &partial, conv.dtype);
}

/// One k step's tiles and their product into `acc`: loaded under the masks `whole` (A's, B's;
/// None for no mask) where `k` is a multiple of `BLOCK_K`, else under `partial` (the last step
/// reads past k).
fn write_step_product(out: &mut String, k: i64, whole: [Option<&str>; 2], partial: &[String; 2], dtype: DType) {
    let load = |ptrs: &str, mask: Option<&str>| match mask {
        Some(m) => format!("tl.load({ptrs}, mask={m}, other=0.0)"),
        None => format!("tl.load({ptrs})"),
    };
    let _ = writeln!(out, "        if {k} % BLOCK_K == 0:");
    let _ = writeln!(out, "            a = {}\n            b = {}", load("a_ptrs", whole[0]), load("b_ptrs", whole[1]));
    out.push_str("        else:\n");
    let _ = writeln!(out, "            a = {}\n            b = {}", load("a_ptrs", Some(&partial[0])), load("b_ptrs", Some(&partial[1])));
    let _ = writeln!(out, "        acc = {}", dot_text(dtype));
}

/// A step's product added into `acc`. float32 operands multiply in float32, as eager does unless
/// TF32 is allowed; the product accumulates in the tensor cores (no separate addition: kernels
/// compile without contraction).
fn dot_text(dtype: DType) -> &'static str {
    if dtype == DType::F32 {
        "tl.dot(a, b, acc, input_precision=\"ieee\")"
    } else {
        "ferro_dot_acc(a, b, acc)"
    }
}

fn cdiv_text(size: i64, block: &str) -> String {
    format!("({size} + {block} - 1) // {block}")
}

/// The product's store (if its result is read outside the kernel) and the epilogue's nodes,
/// through the kernel writer. The product's node is written as a read of `acc`, cast to its type.
fn write_epilogue(out: &mut String, s: &Schedule, k: &FusedKernel, params: &Params, tmp: &mut usize) -> Result<(), CodegenError> {
    let Epilogue { kernel, reads_at, mut locals } = Epilogue::of(s, k)?;
    let var_name = |v: Var| format!("x{}", v.0);
    let mut shared: Computed = HashMap::new();
    for (gi, g) in kernel.plan.groups.iter().enumerate() {
        // the product's group loops over k: here its node is one read of `acc`
        let group = LoopGroup { inner: Vec::new(), reduction: false, nodes: g.nodes.clone() };
        let mut dialect = template_group(s, params, &var_name, false, "xmask");
        let mut computed: Computed = shared.iter().map(|(t, (v, _))| (t.clone(), (v.clone(), Section::Pre))).collect();
        let code = write_group(&mut dialect, s, &kernel, &group, &mut locals, &reads_at, tmp, Some(&mut computed))?;
        for (text, value) in computed {
            if !text.starts_with("tl.load(out_ptr") {
                shared.insert(text, value);
            }
        }
        let _ = writeln!(out, "    # {}", if gi == 0 { "the product, cast to its type" } else { "epilogue" });
        for section in [&code.pre, &code.inner, &code.post] {
            for line in section.lines() {
                let _ = writeln!(out, "    {line}");
            }
        }
    }
    Ok(())
}
