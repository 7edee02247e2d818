//! The Triton backend: one `@triton.jit` function per fused kernel, all in one Python source
//! unit (a prelude of helpers, then the kernels) that the wrapper module defines and launches.
//!
//! A program covers `XBLOCK` iterations of the kernel's flattened outer loop `x0`. A kernel with
//! one pointwise group is flat: its whole iteration space is one 1-D range of blocks. Otherwise
//! values are `[XBLOCK, RBLOCK]` blocks and each loop group covers its inner loops along the
//! second axis: in one step when they fit a block (a persistent group), else in a loop of
//! `RBLOCK`-wide steps whose reductions accumulate elementwise and combine after the loop.
//! Index math is int32 only where every index of the kernel provably fits, int64 otherwise.
//! What this backend cannot render yet is a typed `Unsupported` error, never a wrong kernel.

mod attention;
mod bias_split;
mod dialect;
mod template;

use super::writer::{local_reads_by_node, write_group, Computed, Locals, Section, SectionText};
use super::{
    kernel_buffers, kernel_numel, kernel_structure, next_power_of_two, CodegenError, Definitions, KernelBackend, KernelLanguage,
    KernelLaunch, LaunchShape, RenderedKernels, TuneConfig,
};
use crate::graph::{DType, Device};
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, Item, LocalRead, LoopGroup, Schedule};
use crate::symbolic::{IndexExpr, Var};
use dialect::{compute_type, fits_i32, reduction_init, signature_type, Acc, TritonGroup};
use std::collections::{HashMap, HashSet};
use std::fmt::Write;

pub const PRELUDE: &str = include_str!("prelude.py");

/// Groups whose inner iteration space fits this many elements are persistent (one step): a
/// row is read once however many groups use it (softmax, layer_norm). 8192 float32 values are
/// 32 registers a thread at 8 warps; a looped softmax row is read three times. (The split pass
/// counts programs by these figures.)
const PERSISTENT_RBLOCK_MAX: i64 = crate::scheduler::GPU_SPLIT.persistent_max;
/// The step of looped groups.
const LOOPED_RBLOCK: i64 = 1024;
/// Kernels whose memory is contiguous along `x0` rather than the inner loops (a reduction over an
/// outer dim) take narrow steps, so that a program covers more `x0` rows and its loads are
/// coalesced along them: a block row of 128 bytes of the narrowest such load (32 float32 or 64
/// bfloat16 columns; the tile the split pass counts programs in), the step what is left of
/// `MAX_BLOCK_ELEMENTS`, within these bounds. (H200, split column sums: bfloat16 8192x3072 took
/// 14.5 µs in 64x64 blocks, 18.6 in 32x128; float32 16384x4096 65 µs in 32x128 blocks, 76 in
/// 64x64.)
const X_CONTIGUOUS_ROW_BYTES: i64 = crate::scheduler::GPU_SPLIT.outer_tile_bytes;
const X_CONTIGUOUS_RBLOCK_MIN: i64 = 32;
const X_CONTIGUOUS_RBLOCK_MAX: i64 = 128;
/// Elements of one program's `[XBLOCK, RBLOCK]` block, at most.
const MAX_BLOCK_ELEMENTS: i64 = 4096;
const _: () = assert!(MAX_BLOCK_ELEMENTS / LOOPED_RBLOCK == crate::scheduler::GPU_SPLIT.looped_rows_per_program);
const MAX_XBLOCK: i64 = 1024;
/// Elements of one program's block, at most, in a kernel that writes 64-bit values: Triton 3.6
/// (H200) stores wrong values from blocks of 4096 elements or more when a 64-bit value selected
/// by a comparison on index arithmetic (a pad's or a concatenation's bounds) is stored under a
/// partial mask; blocks of 2048 are right (a standalone kernel showed it; fuzz program 0:6565).
const WIDE_STORE_BLOCK_MAX: i64 = 2048;
/// Programs an outer-dim reduction aims for (about two per multiprocessor of an H100/H200), and
/// the narrowest column tile it takes for them.
const TARGET_PROGRAMS: i64 = 256;
const MIN_X_CONTIGUOUS_XBLOCK: i64 = 16;

/// The tile of a flat pointwise kernel whose accesses are contiguous along different loop
/// variables (a transpose): `TILE` rows of `x0` by `TILE` columns of its inner variable, so that
/// each load and store is coalesced along its own contiguous axis (Triton moves values between
/// the two layouts through shared memory).
const TILE: i64 = 64;

pub struct TritonBackend {
    /// Render kernels over CPU tensors too (they run under Triton's interpreter): only when the
    /// Triton backend is forced. Otherwise a CPU kernel in a CUDA graph is unsupported.
    pub cpu_tensors: bool,
}

impl KernelBackend for TritonBackend {
    fn name(&self) -> &'static str {
        "triton"
    }

    fn schedule_options(&self) -> crate::scheduler::ScheduleOptions {
        crate::scheduler::ScheduleOptions {
            row_scratch: None,
            prefix: "triton",
            split: Some(crate::scheduler::GPU_SPLIT),
            complex_as_real: true,
            // rows past a persistent block are looped: one pass instead of two
            welford_min_len: Some(PERSISTENT_RBLOCK_MAX),
        }
    }

    fn render(&self, s: &Schedule) -> Result<RenderedKernels, CodegenError> {
        let mut source = String::from(PRELUDE);
        let mut launches = Vec::new();
        let mut definitions = Definitions::default();
        for it in &s.items {
            if let Item::Kernel(k) = it {
                check_supported(s, k, self.cpu_tensors)?;
                let params = Params::of(s, k)?;
                // the launch, and the definition's writer (run only for a text not yet defined)
                type Write<'w> = Box<dyn FnOnce() -> Result<String, CodegenError> + 'w>;
                let (mut launch, write): (KernelLaunch, Write) = if crate::codegen::attention::is_attention(s, k) {
                    let ak = attention::AttentionKernel::of(s, k, &params)?;
                    (attention::launch(s, k, &params, &ak), Box::new(move || attention::write(s, k, &params, &ak)))
                } else if crate::codegen::product::is_matrix_product(s, k) {
                    let product = template::MatrixProduct::of(s, k, &params)?;
                    (template::launch(s, k, &params, &product), Box::new(move || template::write(s, k, &params, &product)))
                } else {
                    let geo = Geometry::of(s, k, &params);
                    (launch(s, k, &params, &geo), Box::new(move || write_kernel(s, k, &params, &geo)))
                };
                definitions.define(&mut source, "\n\n", kernel_structure(s, k), &mut launch, write)?;
                launches.push(launch);
            }
        }
        Ok(RenderedKernels { language: KernelLanguage::Triton, source, launches })
    }
}

/// The type a kernel addresses a buffer of `dt` in: complex buffers as arrays of their real
/// component type (`scheduler::complex_as_real` rewrote the nodes that move complex values).
fn element_type(dt: DType) -> DType {
    crate::scheduler::component_type(dt).unwrap_or(dt)
}

/// What the Triton backend does not render yet: accumulating scatters `atomic_scatter` does not
/// admit, complex and float8 values, kernels touching buffers of another device (or of the
/// CPU, unless asked to).
fn check_supported(s: &Schedule, k: &FusedKernel, cpu_tensors: bool) -> Result<(), CodegenError> {
    let p = &s.program;
    let unsupported = |m: String| Err(CodegenError::unsupported(&k.name, m));
    let Some(first) = k.plan.nodes.first() else {
        return Err(CodegenError::internal(&k.name, "kernel without nodes"));
    };
    let device = p.buffer(p.nodes[first.node].output).layout.device;
    if device == Device::Cpu && !cpu_tensors {
        return unsupported("its tensors are on the CPU, the graph's kernels on CUDA (a graph mixing devices)".into());
    }
    for kn in &k.plan.nodes {
        let node = &p.nodes[kn.node];
        let out = p.buffer(node.output);
        if let Some(st) = node.body.store.as_ref().filter(|st| st.is_scatter()) {
            if !atomic_scatter(st.mode, out.layout.dtype, device != Device::Cpu) {
                return unsupported(format!(
                    "{} is a {:?} scatter of {} values (no atomic or compare-and-swap form)",
                    out.name,
                    st.mode,
                    out.layout.dtype.torch_name()
                ));
            }
        }
        let mut bufs = vec![node.output];
        bufs.extend(node.reads().into_iter().map(|(b, _)| b));
        for b in bufs {
            let l = &p.buffer(b).layout;
            if l.device != device {
                return unsupported(format!("{} is on {}, the kernel on {device}", p.buffer(b).name, l.device));
            }
            if compute_type(element_type(l.dtype)).is_none() {
                return unsupported(format!("{} holds {} values", p.buffer(b).name, l.dtype.torch_name()));
            }
        }
        for (i, e) in kn.body.exprs.iter().enumerate() {
            if compute_type(kn.body.dtypes[i]).is_none() {
                return unsupported(format!("{} computes {} values", out.name, kn.body.dtypes[i].torch_name()));
            }
            match e {
                Expr::Scan(..)
                | Expr::Load { .. }
                | Expr::Random { .. }
                | Expr::Constant(_)
                | Expr::Index(_)
                | Expr::Unary(..)
                | Expr::Binary(..)
                | Expr::Where(..)
                | Expr::Cast(_)
                | Expr::Reduce(..)
                | Expr::ArgReduce(..)
                | Expr::LoadIndirect { .. }
                | Expr::CheckIndex { .. } => {}
            }
        }
    }
    Ok(())
}

/// Scatter stores rendered: plain stores (duplicate indices: one of the writes wins, as with
/// CUDA's eager kernels), and accumulating adds, maxima, minima and products of these types.
pub fn atomic_scatter(mode: StoreMode, dt: DType, on_gpu: bool) -> bool {
    match mode {
        StoreMode::Set => true,
        // bfloat16 atomic adds: a Hopper instruction, not in Triton's interpreter
        StoreMode::Combine(ReduceOp::Sum) => {
            matches!(dt, DType::F16 | DType::F32 | DType::F64 | DType::I32 | DType::I64) || (dt == DType::BF16 && on_gpu)
        }
        // natively for these; through a compare-and-swap loop on the value's bits for products
        // and 16-bit floats (`cas_combine`)
        StoreMode::Combine(ReduceOp::Max | ReduceOp::Min) => matches!(dt, DType::F32 | DType::I32 | DType::I64 | DType::F16 | DType::BF16),
        StoreMode::Combine(ReduceOp::Prod) => matches!(dt, DType::F16 | DType::BF16 | DType::F32 | DType::F64 | DType::I32 | DType::I64),
        StoreMode::Combine(ReduceOp::Any | ReduceOp::ArgMax | ReduceOp::ArgMin | ReduceOp::WelfordM2) => false,
    }
}

/// Accumulating scatters no atomic instruction performs: products, and 16-bit maxima/minima.
fn cas_combine(op: ReduceOp, dt: DType) -> bool {
    match op {
        ReduceOp::Prod => true,
        ReduceOp::Max | ReduceOp::Min => matches!(dt, DType::F16 | DType::BF16),
        _ => false,
    }
}

/// How one loop group covers its inner loops in a two-dimensional kernel.
struct GroupShape {
    /// Elements of the group's inner loops.
    numel: i64,
    rblock: i64,
    looped: bool,
}

/// `x_itemsize`: for a kernel contiguous along `x0`, its narrowest such load's element size.
fn group_shape(inner: &[i64], x_itemsize: Option<i64>, block_max: i64) -> GroupShape {
    let numel: i64 = inner.iter().product();
    let (persistent_max, step) = match x_itemsize {
        Some(itemsize) => {
            let columns = (X_CONTIGUOUS_ROW_BYTES / itemsize).max(1);
            let step = (MAX_BLOCK_ELEMENTS / columns).clamp(X_CONTIGUOUS_RBLOCK_MIN, X_CONTIGUOUS_RBLOCK_MAX);
            (step, step)
        }
        None => (PERSISTENT_RBLOCK_MAX.min(block_max), LOOPED_RBLOCK),
    };
    if numel <= persistent_max {
        GroupShape { numel, rblock: next_power_of_two(numel), looped: false }
    } else {
        GroupShape { numel, rblock: step, looped: true }
    }
}

/// How many consecutive values of `x0` from 0 (inner variables at 0) step `index` by exactly one
/// element, up to `cap`. A flattened outer index (a split reduction's `[S, C]` outputs read at
/// `16384*(x0 // 64) + x0 % 64`) is contiguous along `x0` in runs this long, though not affine.
fn unit_run(index: &IndexExpr, cap: i64) -> i64 {
    let mut prev = index.eval(&[0]);
    for x in 1..cap {
        let v = index.eval(&[x]);
        if v - prev != 1 {
            return x;
        }
        prev = v;
    }
    cap
}

/// Whether the kernel's loads that vary over inner loops are contiguous along `x0` (stride 1,
/// or in runs of at least a minimal column tile) and none along its innermost inner variable:
/// the narrowest such load's element size, or None.
fn x_contiguous_itemsize(k: &FusedKernel) -> Option<i64> {
    let mut along_x: Option<i64> = None;
    if k.plan.nodes.iter().any(|kn| kn.body.exprs.iter().any(|e| matches!(e, Expr::Scan(..)))) {
        return None; // a scan needs its whole line in one block
    }
    for kn in &k.plan.nodes {
        let innermost = Var(kn.ranges.len().saturating_sub(1) as u32);
        for (i, e) in kn.body.exprs.iter().enumerate() {
            if let Expr::Load { index, .. } | Expr::LoadIndirect { index, .. } = e {
                let mut vs = Vec::new();
                index.vars(&mut vs);
                if !vs.iter().any(|v| v.0 != 0) {
                    continue;
                }
                if index.affine_coeff(innermost) == Some(1) {
                    return None;
                }
                if index.affine_coeff(Var(0)) == Some(1) || unit_run(index, k.plan.outer.min(64)) >= MIN_X_CONTIGUOUS_XBLOCK {
                    let itemsize = element_type(kn.body.dtype(ValueId(i as u32))).itemsize() as i64;
                    along_x = Some(along_x.map_or(itemsize, |s| s.min(itemsize)));
                }
            }
        }
    }
    along_x
}

/// Whether a flat kernel over `x0` (outer) and one inner variable should be tiled: some access
/// is contiguous along `x0` (stride 1, or runs of at least a minimal column tile: a head's 64
/// features of `x0 % 64`) while striding along the inner variable, so a 1-D block (consecutive
/// inner indices) would read it one element per row.
fn transposed_access(k: &FusedKernel) -> bool {
    let plan = &k.plan;
    if plan.groups.len() != 1 || plan.groups[0].reduction || plan.groups[0].inner.len() != 1 {
        return false;
    }
    if plan.outer < TILE || plan.groups[0].inner[0] < TILE {
        return false;
    }
    let (x, y) = (Var(1), Var(0));
    plan.nodes.iter().any(|kn| {
        let store = kn.body.store.iter().map(|st| &st.index);
        let loads = kn.body.exprs.iter().filter_map(|e| if let Expr::Load { index, .. } = e { Some(index) } else { None });
        store.chain(loads).any(|index| {
            let along_y = index.affine_coeff(y) == Some(1) || unit_run(index, TILE) >= MIN_X_CONTIGUOUS_XBLOCK;
            along_y && !matches!(index.affine_coeff(x), Some(0) | Some(1))
        })
    })
}

fn num_warps(elements: i64) -> u32 {
    match elements {
        e if e >= 2048 => 8,
        e if e >= 512 => 4,
        e if e >= 256 => 2,
        _ => 1,
    }
}

/// Lines defining the inner variables `names[k]` from a flattened index over `inner`.
fn decompose(out: &mut String, pad: &str, flat: &str, inner: &[i64], name: &dyn Fn(usize) -> String) {
    if inner.contains(&0) {
        // no iterations (every lane is masked): the variables only need a value
        for k in 0..inner.len() {
            let _ = writeln!(out, "{pad}{} = {flat} * 0", name(k + 1));
        }
        return;
    }
    for k in 0..inner.len() {
        let stride: i64 = inner[k + 1..].iter().product();
        let mut e = if stride == 1 { flat.to_string() } else { format!("({flat} // {stride})") };
        if k > 0 {
            e = format!("{e} % {}", inner[k]);
        }
        let _ = writeln!(out, "{pad}{} = {e}", name(k + 1));
    }
}

fn indent(text: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    text.lines().map(|l| format!("{pad}{l}\n")).collect()
}

/// The kernel's definition.
fn write_kernel(s: &Schedule, k: &FusedKernel, params: &Params, geo: &Geometry) -> Result<String, CodegenError> {
    let mut out = String::new();
    write_header(&mut out, k, params, geo);
    write_groups(&mut out, s, k, params, geo)?;
    Ok(out)
}

/// A kernel's parameters: buffers read from memory, then buffers written, then the error flag of
/// a kernel that checks gathered indices; and the name its code uses for each buffer.
struct Params {
    read: Vec<BufferId>,
    written: Vec<BufferId>,
    ptr: HashMap<BufferId, String>,
    names: Vec<String>,
    signature: Vec<(String, String)>,
    checks_indices: bool,
}

impl Params {
    fn of(s: &Schedule, k: &FusedKernel) -> Result<Params, CodegenError> {
        let p = &s.program;
        let (read, written) = kernel_buffers(s, k);
        let mut ptr: HashMap<BufferId, String> = HashMap::new();
        let mut names = Vec::new();
        let mut signature = Vec::new();
        for (prefix, bufs) in [("in_ptr", &read), ("out_ptr", &written)] {
            for (i, b) in bufs.iter().enumerate() {
                let name = format!("{prefix}{i}");
                let dt = element_type(p.buffer(*b).layout.dtype);
                let sig = signature_type(dt).ok_or_else(|| CodegenError::unsupported(&k.name, format!("{} values", dt.torch_name())))?;
                names.push(name.clone());
                signature.push((name.clone(), sig.to_string()));
                ptr.insert(*b, name);
            }
        }
        let checks_indices = k.plan.nodes.iter().any(|kn| p.nodes[kn.node].checks_indices());
        if checks_indices {
            names.push("err_ptr".into());
            signature.push(("err_ptr".into(), "*i32".into()));
        }
        Ok(Params { read, written, ptr, names, signature, checks_indices })
    }
}

/// How a kernel's iterations map onto programs and blocks.
struct Geometry {
    /// One pointwise group over the whole iteration space, in 1-D blocks.
    flat: bool,
    /// A flat kernel whose programs cover TILE x TILE tiles (a transposing copy).
    tiled: bool,
    /// A reduction over an outer dim: programs cover column tiles of its rows.
    x_contiguous: bool,
    shapes: Vec<GroupShape>,
    /// Iterations the grid covers, and per program.
    xnumel: i64,
    xblock: i64,
    warps: u32,
    grid: i64,
    block_max: i64,
    /// Index math in int32: every index and every buffer provably fits.
    idx32: bool,
}

/// Flat indices an int32 kernel may compute, at most.
const IDX32_LIMIT: i64 = (i32::MAX / 2) as i64;

impl Geometry {
    fn of(s: &Schedule, k: &FusedKernel, params: &Params) -> Geometry {
        let p = &s.program;
        let plan = &k.plan;
        let flat = plan.groups.len() == 1 && !plan.groups[0].reduction;
        let outer = plan.outer;
        let x_itemsize = if flat { None } else { x_contiguous_itemsize(k) };
        let x_contiguous = x_itemsize.is_some();
        let wide_stores = params.written.iter().any(|b| element_type(p.buffer(*b).layout.dtype).itemsize() == 8);
        let block_max = if wide_stores { WIDE_STORE_BLOCK_MAX } else { i64::MAX };
        let shapes: Vec<GroupShape> = plan.groups.iter().map(|g| group_shape(&g.inner, x_itemsize, block_max)).collect();
        // (a TILE x TILE tile is a block of 4096)
        let tiled = flat && !wide_stores && transposed_access(k);
        let cols = shapes[0].numel;
        let (xnumel, xblock, warps) = if tiled {
            // programs cover TILE x TILE tiles: grid = row tiles x column tiles
            (outer * cols, TILE, num_warps(TILE * TILE))
        } else if flat {
            let total = outer * cols;
            let xblock = next_power_of_two(total).min(MAX_XBLOCK);
            (total, xblock, num_warps(xblock))
        } else {
            let rmax = shapes.iter().map(|g| g.rblock).max().unwrap_or(1);
            let mut xblock = next_power_of_two(outer).min((MAX_BLOCK_ELEMENTS.min(block_max) / rmax).max(1)).min(MAX_XBLOCK);
            if x_contiguous {
                // a reduction over an outer dim loops over its rows in every program: narrower
                // column tiles give more programs to fill the GPU (16 floats still fill a sector)
                while xblock > MIN_X_CONTIGUOUS_XBLOCK && outer / xblock < TARGET_PROGRAMS {
                    xblock /= 2;
                }
            }
            (outer, xblock, num_warps(xblock * rmax))
        };
        let grid = if tiled { ((outer + TILE - 1) / TILE) * ((cols + TILE - 1) / TILE) } else { (xnumel + xblock - 1) / xblock };
        // the largest flat index a (masked) lane computes: a tile's rows and columns may overhang
        let reach = if tiled { (outer + TILE) * (cols + TILE) } else { xnumel + xblock };
        let mut idx32 = reach < IDX32_LIMIT && kernel_numel(k) < IDX32_LIMIT;
        for b in params.read.iter().chain(&params.written) {
            idx32 &= p.buffer(*b).layout.storage_numel() < IDX32_LIMIT;
        }
        for kn in &plan.nodes {
            for e in kn.body.indices() {
                idx32 &= fits_i32(e, &kn.ranges);
            }
        }
        Geometry { flat, tiled, x_contiguous, shapes, xnumel, xblock, warps, grid, block_max, idx32 }
    }
}

/// The kernel's signature and the program's position: `x0` (and a flat kernel's inner
/// variables), `xmask`, `xzero`.
fn write_header(out: &mut String, k: &FusedKernel, params: &Params, geo: &Geometry) {
    let plan = &k.plan;
    let outer = plan.outer;
    let mut all_params = params.names.clone();
    all_params.push("XBLOCK: tl.constexpr".into());
    let _ = writeln!(out, "@ferro_jit\ndef {}({}):", k.name, all_params.join(", "));
    let pid = if geo.idx32 { "tl.program_id(0)" } else { "tl.program_id(0).to(tl.int64)" };
    let xnumel = geo.xnumel;
    if geo.tiled {
        // XBLOCK columns of the inner variable by TILE rows of x0 (XBLOCK == TILE)
        let cols = geo.shapes[0].numel;
        let col_tiles = (cols + TILE - 1) / TILE;
        let _ = writeln!(out, "    pid = {pid}");
        let _ = writeln!(out, "    yoffset = (pid // {col_tiles}) * {TILE}");
        let _ = writeln!(out, "    xoffset = (pid % {col_tiles}) * XBLOCK");
        let _ = writeln!(out, "    x0 = yoffset + tl.arange(0, {TILE})[:, None]");
        let _ = writeln!(out, "    x1 = xoffset + tl.arange(0, XBLOCK)[None, :]");
        let _ = writeln!(out, "    xmask = (x0 < {outer}) & (x1 < {cols})");
        let _ = writeln!(out, "    xindex = x0 * {cols} + x1");
    } else if geo.flat {
        let _ = writeln!(out, "    xoffset = {pid} * XBLOCK");
        let _ = writeln!(out, "    xindex = xoffset + tl.arange(0, XBLOCK)");
        let _ = writeln!(out, "    xmask = xindex < {xnumel}");
        let inner = &plan.groups[0].inner;
        let r = geo.shapes[0].numel;
        let _ = writeln!(out, "    x0 = {}", if r > 1 { format!("xindex // {r}") } else { "xindex".into() });
        if !inner.is_empty() {
            let _ = writeln!(out, "    xinner = xindex % {r}");
            decompose(out, "    ", "xinner", inner, &|k| format!("x{k}"));
        }
    } else {
        let _ = writeln!(out, "    xoffset = {pid} * XBLOCK");
        let _ = writeln!(out, "    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]");
        let _ = writeln!(out, "    xmask = xindex < {xnumel}");
        out.push_str("    x0 = xindex\n");
    }
    out.push_str("    xzero = xindex * 0\n");
}

/// Writes each loop group through the kernel writer, then lays it out (persistent, looped or
/// flat).
fn write_groups(out: &mut String, s: &Schedule, k: &FusedKernel, params: &Params, geo: &Geometry) -> Result<(), CodegenError> {
    let p = &s.program;
    let plan = &k.plan;
    let reads_at = local_reads_by_node(k);
    let mut locals = Locals::new();
    let mut tmp = 0usize;
    let empty: HashSet<BufferId> = params.read.iter().copied().filter(|b| p.buffer(*b).layout.numel() == 0).collect();
    // values computed at the kernel's top level by earlier groups (persistent groups, and what
    // looped groups compute outside their loop): later groups reuse them, loads included (their
    // buffers are read-only in the kernel), except loads of buffers the kernel writes
    let mut shared: Computed = HashMap::new();
    for (gi, g) in plan.groups.iter().enumerate() {
        let shape = &geo.shapes[gi];
        // persistent groups over the same inner loops share their inner variables' names (so
        // that their loads are the same expressions); looped ones bind theirs inside the loop
        let rp = if geo.flat || shape.looped {
            gi
        } else {
            (0..gi).find(|&h| !geo.shapes[h].looped && plan.groups[h].inner == g.inner).unwrap_or(gi)
        };
        let flat = geo.flat;
        let var_name = move |v: Var| -> String {
            match (v.0, flat) {
                (0, _) => "x0".to_string(),
                (i, true) => format!("x{i}"),
                (i, false) => format!("r{rp}_{i}"),
            }
        };
        // a group without inner loops needs no second axis
        let full_mask = if flat || g.inner.is_empty() { "xmask".to_string() } else { format!("xmask & r{rp}mask") };
        let mut group = TritonGroup {
            storage: &s.storage,
            ptr: &params.ptr,
            var_name: &var_name,
            two_d: !flat,
            looped: shape.looped,
            // a reduction over an outer dim (column tiles: a float64 tile doubles its registers,
            // and its speed fell by 40%) adds along columns as CUDA eager does: float32
            terms_per_lane: if shape.looped && !geo.x_contiguous { (shape.numel + shape.rblock - 1) / shape.rblock } else { 1 },
            rblock: shape.rblock,
            full_mask,
            err_ptr: params.checks_indices.then_some("err_ptr"),
            empty: empty.clone(),
            // (a row's weights, read by every row of the block: one row of loads, as Inductor's)
            row_free_mask: (!flat && !g.inner.is_empty()).then(|| (Var(0), format!("r{rp}mask"))),
            accs: Vec::new(),
        };
        // computed before this group: available from its start, like a per-row scalar
        let mut computed: Computed = shared.iter().map(|(k, (v, _))| (k.clone(), (v.clone(), Section::Pre))).collect();
        let code = write_group(&mut group, s, k, g, &mut locals, &reads_at, &mut tmp, Some(&mut computed))?;
        for (text, (name, section)) in computed {
            let visible = !shape.looped || section != Section::Inner;
            if visible && !text.starts_with("tl.load(out_ptr") {
                shared.insert(text, (name, section));
            }
        }
        let stored_read = g.nodes.iter().any(|&pos| plan.local_reads.iter().any(|(r, _, kind)| *r == pos && *kind == LocalRead::Stored));
        lay_out_group(out, gi, g, rp, geo, stored_read, &code, &group.accs);
    }
    Ok(())
}

/// Writes one group's code: a flat or persistent group in one step, a looped one as its
/// accumulators, a loop of `RBLOCK`-wide steps, and the code after the loop.
#[allow(clippy::too_many_arguments)]
fn lay_out_group(
    out: &mut String,
    gi: usize,
    g: &LoopGroup,
    rp: usize,
    geo: &Geometry,
    stored_read: bool,
    code: &SectionText,
    accs: &[Acc],
) {
    let shape = &geo.shapes[gi];
    let kind = if g.reduction { "reduction" } else { "loop" };
    let how = if geo.flat {
        "flat"
    } else if shape.looped {
        "looped"
    } else {
        "persistent"
    };
    let _ = writeln!(out, "    # group {gi}: {kind} over {:?} ({how})", g.inner);
    if stored_read {
        // reads what an earlier group of this program stored: other threads wrote it
        out.push_str("    tl.debug_barrier()\n");
    }
    let rbase = format!("tl.arange(0, {})[None, :]{}", shape.rblock, if geo.idx32 { "" } else { ".to(tl.int64)" });
    let rvar = |k: usize| format!("r{rp}_{k}");
    if geo.flat || !shape.looped {
        if !geo.flat && !g.inner.is_empty() && rp == gi {
            let _ = writeln!(out, "    r{rp}index = {rbase}");
            let _ = writeln!(out, "    r{rp}mask = r{rp}index < {}", shape.numel);
            decompose(out, "    ", &format!("r{rp}index"), &g.inner, &rvar);
        }
        out.push_str(&indent(&code.pre, 4));
        out.push_str(&indent(&code.inner, 4));
        out.push_str(&indent(&code.post, 4));
        return;
    }
    out.push_str(&indent(&code.pre, 4));
    declare_accumulators(out, accs, shape.rblock);
    let _ = writeln!(out, "    r{gi}base = {rbase}");
    let _ = writeln!(out, "    for r{gi}offset in range(0, {}, {}):", shape.numel, shape.rblock);
    let _ = writeln!(out, "        r{gi}index = r{gi}offset + r{gi}base");
    let _ = writeln!(out, "        r{gi}mask = r{gi}index < {}", shape.numel);
    decompose(out, "        ", &format!("r{gi}index"), &g.inner, &rvar);
    out.push_str(&indent(&code.inner, 8));
    out.push_str(&indent(&code.post, 4));
}

/// A looped group's accumulators, one lane per block column, at their identity.
fn declare_accumulators(out: &mut String, accs: &[Acc], rb: i64) {
    for Acc { acc: a, carry, wide } in accs {
        let t = compute_type(a.dtype).unwrap_or("tl.float32");
        match a.value_dtype {
            None if a.op == ReduceOp::WelfordM2 => {
                for part in ["mean", "m2", "w"] {
                    let _ = writeln!(out, "    {}_{part} = tl.zeros([XBLOCK, {rb}], {t})", a.name);
                }
            }
            Some(vd) => {
                let vt = compute_type(vd).unwrap_or("tl.float32");
                let _ = writeln!(out, "    {}_val = tl.full([XBLOCK, {rb}], {}, {vt})", a.name, reduction_init(a.op, vd));
                let _ = writeln!(out, "    {} = tl.full([XBLOCK, {rb}], {}, tl.int64)", a.name, i64::MAX);
            }
            None => {
                let width = if *carry { 1 } else { rb };
                let t = if *wide { "tl.float64" } else { t };
                let _ = writeln!(out, "    {} = tl.full([XBLOCK, {width}], {}, {t})", a.name, reduction_init(a.op, a.dtype));
            }
        }
    }
}

/// The kernel's launch: its grid, the configurations an autotuner may try, its arguments.
fn launch(s: &Schedule, k: &FusedKernel, params: &Params, geo: &Geometry) -> KernelLaunch {
    let p = &s.program;
    let looped = geo.shapes.iter().any(|g| g.looped);
    let rmax = geo.shapes.iter().map(|g| g.rblock).max().unwrap_or(1);
    let space = Space {
        tiled: geo.tiled,
        flat: geo.flat,
        looped,
        xnumel: geo.xnumel,
        rmax,
        block_max: geo.block_max,
        idx32_reach: geo.idx32.then_some(IDX32_LIMIT),
    };
    let base = TuneConfig { grid: geo.grid, xblock: geo.xblock, num_warps: geo.warps, num_stages: 1, tile: None };
    let (args, arg_numel) = launch_args(p, params);
    KernelLaunch {
        name: k.name.clone(),
        args,
        checks_indices: params.checks_indices,
        numel: kernel_numel(k),
        shape: LaunchShape::Grid { grid: geo.grid, xblock: geo.xblock, num_warps: geo.warps, num_stages: 1, tile: None },
        signature: params.signature.clone(),
        candidates: candidates(&space, base),
        arg_numel,
        text: 0..0, // placed by `render`
    }
}

/// A kernel's buffer arguments in parameter order, and the elements each spans (in its
/// signature's element type; the error flag's one last).
fn launch_args(p: &LoopProgram, params: &Params) -> (Vec<BufferId>, Vec<i64>) {
    let args: Vec<BufferId> = params.read.iter().chain(&params.written).copied().collect();
    let mut arg_numel: Vec<i64> = args
        .iter()
        .map(|b| {
            let l = &p.buffer(*b).layout;
            l.storage_numel().max(1) * if l.dtype.is_complex() { 2 } else { 1 }
        })
        .collect();
    if params.checks_indices {
        arg_numel.push(1);
    }
    (args, arg_numel)
}

/// The dialect a template writes the graph's part of its kernel in (a product's epilogue, an
/// attention's bias): one pass over the template's own block, no loop of its own; `full_mask`
/// masks the block, and buffers without elements are never read.
fn template_group<'a>(
    s: &'a Schedule,
    params: &'a Params,
    var_name: &'a dyn Fn(Var) -> String,
    two_d: bool,
    full_mask: &str,
) -> TritonGroup<'a> {
    let p = &s.program;
    TritonGroup {
        storage: &s.storage,
        ptr: &params.ptr,
        var_name,
        two_d,
        looped: false,
        terms_per_lane: 1,
        rblock: 1,
        full_mask: full_mask.into(),
        err_ptr: params.checks_indices.then_some("err_ptr"),
        empty: params.read.iter().copied().filter(|b| p.buffer(*b).layout.numel() == 0).collect(),
        row_free_mask: None,
        accs: Vec::new(),
    }
}

/// What bounds a kernel's launch configurations.
struct Space {
    tiled: bool,
    flat: bool,
    looped: bool,
    /// Rows of the flattened outer loop a grid covers (elements, for a flat kernel).
    xnumel: i64,
    /// The widest group's inner block.
    rmax: i64,
    /// Elements of a block, at most, beyond the usual bounds (`WIDE_STORE_BLOCK_MAX` for kernels
    /// writing 64-bit values; otherwise no further bound).
    block_max: i64,
    /// With int32 index math, the bound every lane's index must stay under.
    idx32_reach: Option<i64>,
}

/// The heuristic configuration first, then neighbours an autotuner may time: XBLOCK halved or
/// doubled (not for tiles, whose XBLOCK is the tile), num_warps halved or doubled, and two
/// pipeline stages for looped groups. Every one keeps the kernel's text valid: blocks stay
/// within register budgets and, with int32 index math, every lane's index within range.
fn candidates(s: &Space, base: TuneConfig) -> Vec<TuneConfig> {
    let mut xblocks = vec![base.xblock];
    if !s.tiled {
        for x in [base.xblock / 2, base.xblock * 2] {
            let fits = if s.flat {
                (64..=4096.min(s.block_max)).contains(&x) && x <= next_power_of_two(s.xnumel)
            } else {
                x >= 1 && x * s.rmax <= (2 * MAX_BLOCK_ELEMENTS).min(s.block_max) && x <= next_power_of_two(s.xnumel)
            };
            if fits && s.idx32_reach.is_none_or(|limit| s.xnumel + x < limit) {
                xblocks.push(x);
            }
        }
    }
    let mut out = vec![base];
    for &x in &xblocks {
        let w0 = if s.tiled || x == base.xblock { base.num_warps } else { num_warps(if s.flat { x } else { x * s.rmax }) };
        let grid = if s.tiled { base.grid } else { (s.xnumel + x - 1) / x };
        for w in [w0 / 2, w0, w0 * 2] {
            if !(1..=16).contains(&w) {
                continue;
            }
            let stages: &[u32] = if s.looped && x == base.xblock { &[1, 2] } else { &[1] };
            for &st in stages {
                let c = TuneConfig { grid, xblock: x, num_warps: w, num_stages: st, tile: None };
                if !out.contains(&c) {
                    out.push(c);
                }
            }
        }
    }
    out
}
