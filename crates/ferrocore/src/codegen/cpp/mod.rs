//! The C++/OpenMP backend: one `extern "C"` function per fused kernel, each after a unit mark
//! (`runtime::CPP_UNIT_MARK`) so that a large source can be compiled as parallel units. The flattened outer loop is OpenMP-parallel; innermost loops carry `omp simd` (with
//! reduction clauses) so the C++ compiler vectorizes them. Half types compute in float.

mod attention;
mod dialect;
mod gemm;

use super::product::is_matrix_product;
use super::writer::{local_reads_by_node, write_group, Locals};
use super::{
    kernel_buffers, kernel_numel, kernel_structure, CodegenError, Definitions, KernelBackend, KernelLanguage, KernelLaunch, LaunchShape,
    RenderedKernels,
};
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, Item, KernelPlan, Schedule, Storage};
use dialect::{storage_type, Acc, CppGroup};
use std::collections::{HashMap, HashSet};
use std::fmt::Write;

pub const PRELUDE: &str = include_str!("prelude.h");
const COMPLEX_PRELUDE: &str = include_str!("complex.h");
const GEMM_PRELUDE: &str = include_str!("gemm.h");

/// Kernels smaller than this many elements run on one thread (OpenMP start-up costs more).
const PARALLEL_THRESHOLD: i64 = 32768;

/// Elements a float sum adds in the vector lanes before the partial joins a wider total (see
/// `Acc::chunked`): 32 sequential additions per lane at 8 float lanes (AVX2), 128 at 4 double
/// lanes. Simulated on 1e5..1e8 uniform and normal float32 values, 1024 sums as accurately as
/// ATen's cascade (4096: 2.4x its error on normal values); 256 also keeps a two-pass variance's
/// squared deviations as exact as CPU eager's double Welford (1024: 2.1x its error at 1e5, and
/// layer norm's statistics 3.5x at 1e4), at one horizontal add per 32 vector iterations.
const SUM_CHUNK_F32: i64 = 256;
const SUM_CHUNK_F64: i64 = 512;

fn sum_chunk(dt: DType) -> i64 {
    if dt == DType::F64 {
        SUM_CHUNK_F64
    } else {
        SUM_CHUNK_F32
    }
}

pub struct CppBackend;

impl KernelBackend for CppBackend {
    fn name(&self) -> &'static str {
        "cpp"
    }

    fn schedule_options(&self) -> crate::scheduler::ScheduleOptions {
        crate::scheduler::ScheduleOptions::CPP
    }

    fn render(&self, s: &Schedule) -> Result<RenderedKernels, CodegenError> {
        // one-pass variances are a GPU schedule's (ScheduleOptions::welford), never this one's
        for it in &s.items {
            if let Item::Kernel(k) = it {
                if k.plan.nodes.iter().any(|kn| kn.body.exprs.iter().any(|e| matches!(e, Expr::Reduce(ReduceOp::WelfordM2, _)))) {
                    return Err(CodegenError::internal(&k.name, "a Welford reduction in a C++ schedule"));
                }
            }
        }
        let complex = s.program.buffers.iter().any(|b| b.layout.dtype.is_complex());
        // (attention kernels take their products from the same helpers)
        let gemm =
            s.items.iter().any(|it| matches!(it, Item::Kernel(k) if is_matrix_product(s, k) || super::attention::is_attention(s, k)));
        let mut source = prelude(complex, gemm);
        let mut launches = Vec::new();
        let mut definitions = Definitions::default();
        // the text before the first mark is exactly `prelude`: what every unit repeats
        let separator = format!("{}\n", crate::runtime::CPP_UNIT_MARK);
        for it in &s.items {
            if let Item::Kernel(k) = it {
                let (read, written) = kernel_buffers(s, k);
                let args = read.into_iter().chain(written).collect();
                let checks_indices = k.plan.nodes.iter().any(|kn| s.program.nodes[kn.node].checks_indices());
                let mut launch = KernelLaunch {
                    name: k.name.clone(),
                    args,
                    checks_indices,
                    numel: kernel_numel(k),
                    shape: LaunchShape::Host,
                    signature: Vec::new(),
                    candidates: Vec::new(),
                    arg_numel: Vec::new(),
                    text: 0..0,
                };
                definitions.define(&mut source, &separator, kernel_structure(s, k), &mut launch, || render_kernel(s, k))?;
                launches.push(launch);
            }
        }
        Ok(RenderedKernels { language: KernelLanguage::Cpp, source, launches })
    }
}

/// What every source starts with, before its first unit mark: the part every unit repeats.
/// <complex> costs the C++ compiler ~0.2 s: included only when a kernel moves complex values;
/// the matrix-product helpers only when a kernel is a matrix product.
pub fn prelude(complex: bool, gemm: bool) -> String {
    let mut source = String::from(if complex { "#include <complex>\n" } else { "" });
    source.push_str(PRELUDE);
    if complex {
        source.push_str(COMPLEX_PRELUDE);
    }
    if gemm {
        source.push_str(GEMM_PRELUDE);
    }
    source
}

fn render_kernel(s: &Schedule, k: &FusedKernel) -> Result<String, CodegenError> {
    if is_matrix_product(s, k) {
        return gemm::render(s, k);
    }
    if super::attention::is_attention(s, k) {
        return attention::render(s, k);
    }
    let mut params = Params::of(s, k);
    let (rows, row_decls) = scratch_rows(s, k, &mut params.ptr);
    let threads = Threads::of(s, k);
    let (hoisted, codes) = write_groups(s, k, &params, &rows, &threads)?;
    let mut out = String::new();
    // kernels return nonzero when a gathered index was out of range (the wrapper raises)
    let _ = writeln!(out, "extern \"C\" int {}({}) {{", k.name, params.decls.join(", "));
    out.push_str("  int ferro_err = 0;\n");
    let tile = if rows.is_empty() && threads.vectorize { column_tile(&k.plan, &codes) } else { None };
    let region = open_parallel_region(&mut out, k, &threads, &hoisted);
    let n = k.plan.outer;
    if let Some(t) = tile {
        let _ = writeln!(out, "  for (int64_t x0t = 0; x0t < {n}LL; x0t += {t}LL) {{");
        let _ = writeln!(out, "    const int64_t x0n = ferro::min<int64_t>({t}LL, {n}LL - x0t);");
        let mut codes = codes.into_iter().map(|(c, _)| c);
        let mut code = codes.next().ok_or_else(|| CodegenError::internal(&k.name, "a tiled kernel without groups"))?;
        for (gi, later) in codes.enumerate() {
            let _ = writeln!(code.post, "// group {}: loop []", gi + 1);
            code.post.push_str(&later.pre);
            code.post.push_str(&later.inner);
            code.post.push_str(&later.post);
        }
        emit_column_tiled_group(&mut out, &k.plan.groups[0], code, t);
    } else {
        let _ = writeln!(out, "  for (int64_t x0 = 0; x0 < {n}LL; ++x0) {{");
        out.push_str(&row_decls);
        for (gi, (code, split)) in codes.into_iter().enumerate() {
            emit_group(&mut out, gi, &k.plan.groups[gi], code, split, threads.vectorize);
        }
    }
    out.push_str(if region { "  }\n  }\n" } else { "  }\n" });
    out.push_str("  return ferro_err;\n}\n");
    Ok(out)
}

/// A kernel's buffer parameters: buffers read from memory first, then buffers written; and the
/// name its code uses for each buffer.
struct Params {
    read: Vec<BufferId>,
    written: Vec<BufferId>,
    ptr: HashMap<BufferId, String>,
    /// The C++ parameter declarations, in order.
    decls: Vec<String>,
}

impl Params {
    fn of(s: &Schedule, k: &FusedKernel) -> Params {
        let p = &s.program;
        let (read, written) = kernel_buffers(s, k);
        let mut ptr: HashMap<BufferId, String> = HashMap::new();
        let mut decls = Vec::new();
        for (i, b) in read.iter().enumerate() {
            let name = format!("in_ptr{i}");
            decls.push(format!("const {}* __restrict__ {name}", storage_type(p.buffer(*b).layout.dtype)));
            ptr.insert(*b, name);
        }
        for (i, b) in written.iter().enumerate() {
            let name = format!("out_ptr{i}");
            decls.push(format!("{}* __restrict__ {name}", storage_type(p.buffer(*b).layout.dtype)));
            ptr.insert(*b, name);
        }
        Params { read, written, ptr, decls }
    }
}

/// How a kernel spreads over the CPU's threads and vector lanes.
struct Threads {
    parallel: bool,
    /// Threads split the outer loop (else, when parallel, each group's inner loops).
    outer_parallel: bool,
    vectorize: bool,
}

impl Threads {
    fn of(s: &Schedule, k: &FusedKernel) -> Threads {
        let p = &s.program;
        let plan = &k.plan;
        // a scatter kernel holds one node (the scheduler never fuses one): its stores may collide
        let scatter = plan.nodes.iter().find_map(|kn| kn.body.store.as_ref().filter(|st| st.is_scatter()));
        let scatter_dtype = plan.nodes.first().map(|kn| p.buffer(p.nodes[kn.node].output).layout.dtype);
        let parallel = kernel_numel(k) >= PARALLEL_THRESHOLD && scatter.is_none_or(|st| scatter_parallel(st.mode, scatter_dtype));
        Threads { parallel, outer_parallel: parallel && plan.outer > 1, vectorize: scatter.is_none() }
    }
}

/// Buffers kept in a scratch row (`Storage::Row`): one array per outer iteration, indexed by
/// the position in the writing group's loops (readers read back at the same positions). Returns
/// them and their declarations; each is named in `ptr`.
fn scratch_rows(s: &Schedule, k: &FusedKernel, ptr: &mut HashMap<BufferId, String>) -> (HashSet<BufferId>, String) {
    let p = &s.program;
    let mut rows: HashSet<BufferId> = HashSet::new();
    let mut decls = String::new();
    for kn in &k.plan.nodes {
        let b = p.nodes[kn.node].output;
        if s.storage[b.0 as usize] == Storage::Row && rows.insert(b) {
            let len: i64 = k.plan.groups[kn.group].inner.iter().product();
            let name = format!("row{}", rows.len() - 1);
            let _ = writeln!(decls, "    {} {name}[{len}];", storage_type(p.buffer(b).layout.dtype));
            ptr.insert(b, name);
        }
    }
    (rows, decls)
}

/// Writes each loop group's code through the kernel writer: the loop-invariant code of the
/// whole kernel, and per group its code and whether its loops split across threads.
fn write_groups(
    s: &Schedule,
    k: &FusedKernel,
    params: &Params,
    rows: &HashSet<BufferId>,
    threads: &Threads,
) -> Result<(String, Vec<(GroupCode, bool)>), CodegenError> {
    let p = &s.program;
    // loop-invariant values are computed once, before every loop, from buffers only read here
    let read_only: HashSet<BufferId> = params.read.iter().filter(|b| !params.written.contains(b) && !rows.contains(b)).copied().collect();
    let reads_at = local_reads_by_node(k);
    let mut locals = Locals::new();
    let mut tmp = 0usize;
    let mut hoisted = String::new();
    let mut codes = Vec::new();
    for g in &k.plan.groups {
        // a scan carries a dependence along its loop: that loop never splits across threads
        let has_scan = g.nodes.iter().any(|&pos| p.nodes[k.plan.nodes[pos].node].kind() == NodeKind::Scan);
        let split = threads.parallel && !threads.outer_parallel && !g.inner.is_empty() && !has_scan;
        let reduction_len = (g.reduction && !has_scan).then(|| g.inner.iter().product::<i64>());
        let mut group = CppGroup {
            program: p,
            storage: &s.storage,
            ptr: &params.ptr,
            split,
            chunk_sums_above: reduction_len.map(|r| (r, sum_chunk as dialect::ChunkLen)),
            rows,
            row_position: row_position(&g.inner),
            read_only: &read_only,
            accs: Vec::new(),
        };
        let text = write_group(&mut group, s, k, g, &mut locals, &reads_at, &mut tmp, None)?;
        hoisted.push_str(&text.kernel);
        codes.push((GroupCode { pre: text.pre, inner: text.inner, post: text.post, accs: group.accs }, split));
    }
    Ok((hoisted, codes))
}

/// Opens the kernel's OpenMP region, if it runs on several threads, with the loop-invariant
/// code; returns whether a `{` region was opened (closed after the loops).
fn open_parallel_region(out: &mut String, k: &FusedKernel, threads: &Threads, hoisted: &str) -> bool {
    let groups = &k.plan.groups;
    let single_flat = groups.len() == 1 && groups[0].inner.is_empty() && !groups[0].reduction;
    let worksharing = if single_flat && threads.parallel {
        Some(if threads.vectorize { "for simd" } else { "for" })
    } else if !single_flat && threads.outer_parallel {
        Some("for")
    } else {
        None
    };
    // loop-invariant values are computed by each thread inside the parallel region: values
    // shared into it are opaque to the compiler (constants no longer fold)
    let region = worksharing.is_some() && !hoisted.is_empty();
    match worksharing {
        Some(w) if region => {
            out.push_str("  #pragma omp parallel\n  {\n");
            out.push_str(&indent(hoisted, 2));
            let _ = writeln!(out, "  #pragma omp {w}");
        }
        Some(w) => {
            let _ = writeln!(out, "  #pragma omp parallel {w}");
        }
        None => out.push_str(&indent(hoisted, 2)),
    }
    region
}

/// The position of the current element in a group's loops (`x1..`, row-major): where a scratch
/// row holds it.
fn row_position(inner: &[i64]) -> String {
    let mut terms = Vec::new();
    let mut stride = 1i64;
    for (d, size) in inner.iter().enumerate().rev() {
        terms.push(if stride == 1 { format!("x{}", d + 1) } else { format!("{stride}LL * x{}", d + 1) });
        stride *= size;
    }
    if terms.is_empty() {
        return "0".into();
    }
    terms.reverse();
    terms.join(" + ")
}

/// The code of one loop group's nodes, by where it runs relative to the group's loops.
struct GroupCode {
    pre: String,
    inner: String,
    post: String,
    accs: Vec<Acc>,
}

/// Writes one loop group: accumulators, the code before the loops, the loop nest (its innermost
/// loop `omp simd`; a long float sum's innermost loop in chunks, see `Acc::chunked`), thread-local
/// partial results merged when the group's loops are split across threads, the code after.
fn emit_group(out: &mut String, gi: usize, g: &crate::scheduler::LoopGroup, code: GroupCode, split: bool, vectorize: bool) {
    let GroupCode { pre, inner, post, accs } = code;
    let _ = writeln!(out, "    // group {gi}: {} {:?}", if g.reduction { "reduction" } else { "loop" }, g.inner);
    for a in &accs {
        let _ = writeln!(out, "      {}", a.declare(""));
    }
    out.push_str(&indent(&pre, 6));
    let depth = g.inner.len();
    let suffix = if split { "_local" } else { "" };
    if split {
        out.push_str("      #pragma omp parallel\n      {\n");
        for a in &accs {
            let _ = writeln!(out, "        {}", a.declare("_local"));
        }
        out.push_str("        #pragma omp for nowait\n");
    }
    let chunk = accs.iter().filter(|a| a.chunked).map(|a| sum_chunk(a.dtype)).min();
    let has_arg = accs.iter().any(|a| a.value_dtype.is_some() || a.scan);
    let base = if split { 8 } else { 6 };
    let mut level = 0; // open braces of the nest
    for (d, &size) in g.inner.iter().enumerate() {
        let var = format!("x{}", d + 1);
        let innermost = d + 1 == depth;
        if let (true, Some(ch)) = (innermost, chunk) {
            // the chunk loop takes the `omp for` when the group is one loop split across threads
            open_chunk_loop(out, &" ".repeat(base + 2 * level), &var, size, ch);
            level += 1;
            let pad = " ".repeat(base + 2 * level);
            for a in accs.iter().filter(|a| a.chunked) {
                let _ = writeln!(out, "{pad}{}", a.declare_part());
            }
            if !has_arg && vectorize {
                let _ = writeln!(out, "{pad}#pragma omp simd{}", simd_clause(&accs, suffix));
            }
            let (from, to) = if size > ch { (format!("{var}b"), format!("{var}e")) } else { ("0".to_string(), format!("{size}LL")) };
            let _ = writeln!(out, "{pad}for (int64_t {var} = {from}; {var} < {to}; ++{var}) {{");
        } else {
            let pad = " ".repeat(base + 2 * level);
            if innermost && !(split && depth == 1) && !has_arg && vectorize {
                let _ = writeln!(out, "{pad}#pragma omp simd{}", simd_clause(&accs, suffix));
            }
            let _ = writeln!(out, "{pad}for (int64_t {var} = 0; {var} < {size}LL; ++{var}) {{");
        }
        level += 1;
    }
    out.push_str(&indent(&inner, base + 2 * level));
    for d in (0..depth).rev() {
        level -= 1;
        let _ = writeln!(out, "{}}}", " ".repeat(base + 2 * level));
        if d + 1 == depth && chunk.is_some() {
            let pad = " ".repeat(base + 2 * level);
            for a in accs.iter().filter(|a| a.chunked) {
                let _ = writeln!(out, "{pad}{}", a.absorb_part(suffix));
            }
            level -= 1;
            let _ = writeln!(out, "{}}}", " ".repeat(base + 2 * level));
        }
    }
    if split {
        out.push_str("        #pragma omp critical\n        {\n");
        for a in &accs {
            let _ = writeln!(out, "          {}", a.merge("", "_local"));
        }
        out.push_str("        }\n      }\n");
    }
    for line in accs.iter().filter_map(Acc::finish) {
        let _ = writeln!(out, "      {line}");
    }
    out.push_str(&indent(&post, 6));
    for a in accs.iter().filter(|a| a.index_check) {
        let _ = writeln!(out, "      if ({}) {{\n        #pragma omp atomic write\n        ferro_err = 1;\n      }}", a.name);
    }
}

/// Columns an outer reduction's kernel reduces together (see `column_tile`).
const COLUMN_TILE: i64 = 64;
/// The tile when the kernel has too few columns for many tiles of `COLUMN_TILE`.
const NARROW_COLUMN_TILE: i64 = 16;

/// The tile width when the kernel is one reduction over an outer dim (a column sum: its loads
/// are contiguous along `x0` and strided along the innermost reduction loop), optionally
/// followed by code per column. Such a kernel walks `x0` in tiles, keeps one accumulator per
/// column of the tile, and puts the tile's columns innermost, so the vector lanes take
/// consecutive columns instead of gathering one column's strided elements. None for any other
/// kernel.
fn column_tile(plan: &KernelPlan, codes: &[(GroupCode, bool)]) -> Option<i64> {
    let (Some(g), Some((code, split))) = (plan.groups.first(), codes.first()) else {
        return None;
    };
    // the groups after the reduction are code per column (an epilogue), no loops
    let epilogue = plan.groups[1..].iter().zip(&codes[1..]).all(|(g, (c, _))| !g.reduction && g.inner.is_empty() && c.accs.is_empty());
    if !epilogue
        || !g.reduction
        || g.inner.is_empty()
        || *split
        || !code.pre.is_empty()
        || code.accs.is_empty()
        || plan.outer < NARROW_COLUMN_TILE
    {
        return None;
    }
    if code.accs.iter().any(|a| a.scan || a.index_check || a.value_dtype.is_some()) {
        return None;
    }
    let (column, red) = (crate::symbolic::Var(0), crate::symbolic::Var(g.inner.len() as u32));
    let mut strided = false;
    for e in plan.nodes.iter().flat_map(|kn| &kn.body.exprs) {
        if let Expr::Load { index, .. } = e {
            let along_column = index.affine_coeff(column);
            match index.affine_coeff(red) {
                // contiguous along the reduction for each column: a row reduction
                Some(1 | -1) if along_column != Some(0) => return None,
                Some(c) if c != 0 && along_column == Some(1) => strided = true,
                _ => {}
            }
        }
    }
    strided.then_some(if plan.outer >= 16 * COLUMN_TILE { COLUMN_TILE } else { NARROW_COLUMN_TILE })
}

/// Declares one array of `t` lanes per variable (`<name>_t`) and sets every lane.
fn declare_lanes(out: &mut String, pad: &str, vars: &[(String, String, String)], t: i64) {
    if vars.is_empty() {
        return;
    }
    let mut init = String::new();
    for (ty, name, value) in vars {
        let _ = writeln!(out, "{pad}{ty} {name}_t[{t}];");
        let _ = write!(init, " {name}_t[x0j] = {value};");
    }
    let _ = writeln!(out, "{pad}for (int64_t x0j = 0; x0j < {t}LL; ++x0j) {{{init} }}");
}

/// `<type>& <name> = <name>_t[x0j];` for each variable: the loop body's code reads and writes
/// the current column's lane under the scalar names.
fn bind_lanes(vars: &[(String, String, String)]) -> String {
    vars.iter().map(|(ty, name, _)| format!("{ty}& {name} = {name}_t[x0j];\n")).collect()
}

/// Writes the reduction group of a column-tiled kernel (see `column_tile`; `code.post` holds the
/// epilogue groups' code too) inside the loop over tiles (`x0t`, `x0n` columns): per-column
/// accumulator arrays, the reduction loops, the tile's columns innermost under `omp simd`, then
/// the code after the loops per column.
fn emit_column_tiled_group(out: &mut String, g: &crate::scheduler::LoopGroup, code: GroupCode, t: i64) {
    let GroupCode { inner, post, accs, .. } = code;
    let _ = writeln!(out, "    // group 0: reduction {:?}, {t} columns at a time", g.inner);
    let totals: Vec<_> = accs.iter().flat_map(|a| a.totals("")).collect();
    let parts: Vec<_> = accs.iter().filter(|a| a.chunked).map(Acc::part).collect();
    let targets: Vec<_> = accs.iter().map(|a| if a.chunked { a.part() } else { a.totals("").swap_remove(0) }).collect();
    declare_lanes(out, "    ", &totals, t);
    let chunk = accs.iter().filter(|a| a.chunked).map(|a| sum_chunk(a.dtype)).min();
    let depth = g.inner.len();
    let mut level = 0;
    for (d, &size) in g.inner.iter().enumerate() {
        let var = format!("x{}", d + 1);
        let pad = " ".repeat(4 + 2 * level);
        if let (true, Some(ch)) = (d + 1 == depth, chunk) {
            open_chunk_loop(out, &pad, &var, size, ch);
            level += 1;
            let pad = " ".repeat(4 + 2 * level);
            declare_lanes(out, &pad, &parts, t);
            let (from, to) = if size > ch { (format!("{var}b"), format!("{var}e")) } else { ("0".to_string(), format!("{size}LL")) };
            let _ = writeln!(out, "{pad}for (int64_t {var} = {from}; {var} < {to}; ++{var}) {{");
        } else {
            let _ = writeln!(out, "{pad}for (int64_t {var} = 0; {var} < {size}LL; ++{var}) {{");
        }
        level += 1;
    }
    let pad = 4 + 2 * level;
    let mut body = format!("const int64_t x0 = x0t + x0j;\n{}", bind_lanes(&targets));
    body.push_str(&inner);
    let _ = writeln!(out, "{}#pragma omp simd\n{}for (int64_t x0j = 0; x0j < x0n; ++x0j) {{", " ".repeat(pad), " ".repeat(pad));
    out.push_str(&indent(&body, pad + 2));
    let _ = writeln!(out, "{}}}", " ".repeat(pad));
    for d in (0..depth).rev() {
        level -= 1;
        let _ = writeln!(out, "{}}}", " ".repeat(4 + 2 * level));
        if d + 1 == depth && chunk.is_some() {
            let pad = " ".repeat(4 + 2 * level);
            let chunked: Vec<_> = accs.iter().filter(|a| a.chunked).flat_map(|a| a.totals("")).collect();
            let mut absorb = bind_lanes(&chunked) + &bind_lanes(&parts);
            for a in accs.iter().filter(|a| a.chunked) {
                absorb.push_str(&a.absorb_part(""));
                absorb.push('\n');
            }
            let _ = writeln!(out, "{pad}for (int64_t x0j = 0; x0j < x0n; ++x0j) {{");
            out.push_str(&indent(&absorb, 4 + 2 * level + 2));
            let _ = writeln!(out, "{pad}}}");
            level -= 1;
            let _ = writeln!(out, "{}}}", " ".repeat(4 + 2 * level));
        }
    }
    let mut after = format!("const int64_t x0 = x0t + x0j;\n{}", bind_lanes(&totals));
    for line in accs.iter().filter_map(Acc::finish) {
        after.push_str(&line);
        after.push('\n');
    }
    after.push_str(&post);
    out.push_str("    for (int64_t x0j = 0; x0j < x0n; ++x0j) {\n");
    out.push_str(&indent(&after, 6));
    out.push_str("    }\n");
}

/// Opens the loop over chunks of `ch` elements of loop `var` (bounds `<var>b`..`<var>e`), or a
/// plain block when the loop is one chunk.
fn open_chunk_loop(out: &mut String, pad: &str, var: &str, size: i64, ch: i64) {
    if size > ch {
        let _ = writeln!(out, "{pad}for (int64_t {var}b = 0; {var}b < {size}LL; {var}b += {ch}LL) {{");
        let _ = writeln!(out, "{pad}  const int64_t {var}e = ferro::min<int64_t>({var}b + {ch}LL, {size}LL);");
    } else {
        let _ = writeln!(out, "{pad}{{");
    }
}

/// Scatter-adds of plain C types use `omp atomic`; other combining stores (products, max/min,
/// half types) are read-modify-writes that must not race.
fn atomic_scatter(op: ReduceOp, dt: DType) -> bool {
    op == ReduceOp::Sum && matches!(dt, DType::F32 | DType::F64 | DType::I32 | DType::I64 | DType::I16 | DType::I8 | DType::U8)
}

/// Whether a scatter kernel may run its iterations in parallel. Plain stores run in order, so
/// that the last of several writes to one element wins, as in eager's CPU loops.
fn scatter_parallel(mode: StoreMode, dt: Option<DType>) -> bool {
    match (mode, dt) {
        (StoreMode::Combine(op), Some(dt)) => atomic_scatter(op, dt),
        _ => false,
    }
}

fn simd_clause(accs: &[Acc], suffix: &str) -> String {
    let mut s = String::new();
    for a in accs.iter().filter(|a| !a.scan) {
        let name = a.simd_var(suffix);
        let op = match (a.op, a.dtype) {
            (ReduceOp::Sum, _) => "+",
            (ReduceOp::Prod, _) => "*",
            (ReduceOp::Any, _) => "||",
            (ReduceOp::Max, DType::F32 | DType::F16 | DType::BF16) => "ferro_fmax",
            (ReduceOp::Min, DType::F32 | DType::F16 | DType::BF16) => "ferro_fmin",
            (ReduceOp::Max, DType::F64) => "ferro_dmax",
            (ReduceOp::Min, DType::F64) => "ferro_dmin",
            (ReduceOp::Max, _) => "max",
            (ReduceOp::Min, _) => "min",
            (ReduceOp::ArgMax | ReduceOp::ArgMin | ReduceOp::WelfordM2, _) => continue,
        };
        let _ = write!(s, " reduction({op}:{name})");
    }
    s
}

fn indent(text: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    text.lines().map(|l| format!("{pad}{l}\n")).collect()
}
