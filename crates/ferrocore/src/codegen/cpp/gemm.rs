//! Matrix products (`LoopNode::contraction`) as C++ kernels with their epilogue. The kernel walks
//! the output in tiles of `TILE_M x TILE_N` (threads take tiles when the product is large); each
//! tile's product goes into a float32 scratch tile through the prelude's register-blocked
//! `ferro::gemm_f32` (gemm.h). Then the pointwise nodes fusion placed after the product run over
//! the tile, written by the kernel writer with `x0` the output's row, `x1` its column and the
//! product's value read from the scratch tile: a bias, an activation or a residual add costs no
//! pass over memory and no library call.

use super::dialect::CppGroup;
use super::{indent, simd_clause, Params};
use crate::codegen::product::{Epilogue, Operand, ProductShape};
use crate::codegen::writer::write_group;
use crate::codegen::CodegenError;
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, LoopGroup, Schedule};
use crate::symbolic::{IndexExpr, Var};
use std::collections::HashSet;
use std::fmt::Write;

/// Output rows per tile: ten micro tiles of 6 rows and one of 4.
const TILE_M: i64 = 64;
/// Output columns per tile (a multiple of the micro tile's 16 or 32 columns).
const TILE_N: i64 = 256;
/// Multiply-adds above which a product's tiles spread over threads (about 10 us on one core).
const PARALLEL_FMAS: i64 = 1 << 20;

/// The kernel's definition: tiles of the product, each followed by its epilogue.
pub(super) fn render(s: &Schedule, k: &FusedKernel) -> Result<String, CodegenError> {
    let mp = ProductShape::of(s, k)?;
    if mp.dtype != DType::F32 {
        return Err(CodegenError::unsupported(&k.name, format!("a C++ matrix product of {}", mp.dtype.torch_name())));
    }
    let params = Params::of(s, k);
    let ptr = |b: BufferId| params.ptr.get(&b).cloned().ok_or_else(|| CodegenError::internal(&k.name, "operand without a pointer"));
    let (a, b) = mp.in_memory().ok_or_else(|| CodegenError::unsupported(&k.name, "a C++ matrix product of a computed operand"))?;
    let (pa, pb) = (ptr(a.buf)?, ptr(b.buf)?);
    let (hoisted, epilogue, accs) = write_epilogue(s, k, &params, &mp)?;

    let (tm, tn) = (mp.m.min(TILE_M), mp.n.min(TILE_N));
    let tiles = mp.batch * cdiv(mp.m, tm) * cdiv(mp.n, tn);
    let parallel = tiles > 1 && [mp.m, mp.n, mp.k].iter().fold(mp.batch, |f, &d| f.saturating_mul(d)) >= PARALLEL_FMAS;
    let mut out = String::new();
    let _ = writeln!(out, "extern \"C\" int {}({}) {{", k.name, params.decls.join(", "));
    out.push_str("  int ferro_err = 0;\n");
    let region = parallel && !hoisted.is_empty();
    if region {
        out.push_str("  #pragma omp parallel\n  {\n");
        out.push_str(&indent(&hoisted, 2));
        out.push_str("  #pragma omp for\n");
    } else {
        out.push_str(&indent(&hoisted, 2));
        if parallel {
            out.push_str("  #pragma omp parallel for\n");
        }
    }
    write_tile_product(&mut out, &mp, (tm, tn), [(&pa, a), (&pb, b)]);
    for a in &accs {
        let _ = writeln!(out, "    {}", a.declare(""));
    }
    out.push_str("    for (int64_t i = 0; i < mt; ++i) {\n");
    let _ = writeln!(out, "      #pragma omp simd{}", simd_clause(&accs, ""));
    out.push_str("      for (int64_t j = 0; j < nt; ++j) {\n");
    let _ = writeln!(out, "        const int64_t x0 = zb * {}LL + i0 + i;", mp.m);
    out.push_str("        const int64_t x1 = j0 + j;\n");
    out.push_str("        const float acc = tile[i * ld + j];\n");
    out.push_str(&indent(&epilogue, 8));
    out.push_str("      }\n    }\n");
    for a in &accs {
        let _ = writeln!(out, "    if ({}) {{\n      #pragma omp atomic write\n      ferro_err = 1;\n    }}", a.name);
    }
    out.push_str(if region { "  }\n  }\n" } else { "  }\n" });
    out.push_str("  return ferro_err;\n}\n");
    Ok(out)
}

/// The loop over output tiles, each tile's position and extent, and its product computed into
/// the scratch tile `tile` (rows of `ld` floats) by `ferro::gemm_f32`.
fn write_tile_product(out: &mut String, mp: &ProductShape, (tm, tn): (i64, i64), [(pa, a), (pb, b)]: [(&str, &Operand); 2]) {
    let (tiles_m, tiles_n) = (cdiv(mp.m, tm), cdiv(mp.n, tn));
    let _ = writeln!(out, "  for (int64_t t = 0; t < {}LL; ++t) {{", mp.batch * tiles_m * tiles_n);
    let _ = writeln!(out, "    const int64_t zb = t / {}LL;", tiles_m * tiles_n);
    let _ = writeln!(out, "    const int64_t i0 = (t / {tiles_n}LL) % {tiles_m}LL * {tm}LL;");
    let _ = writeln!(out, "    const int64_t j0 = t % {tiles_n}LL * {tn}LL;");
    let _ = writeln!(out, "    const int64_t mt = ferro::min<int64_t>({tm}LL, {}LL - i0);", mp.m);
    let _ = writeln!(out, "    const int64_t nt = ferro::min<int64_t>({tn}LL, {}LL - j0);", mp.n);
    let a_at = address(pa, &[(a.offset, ""), (a.batch, "zb"), (a.rows, "i0")]);
    let b_at = address(pb, &[(b.offset, ""), (b.batch, "zb"), (b.cols, "j0")]);
    // the scratch tile's row length: its columns rounded up to whole micro tiles (`gemm_nr`)
    let _ = writeln!(out, "    constexpr int64_t ld = ({tn}LL + ferro::gemm_nr - 1) / ferro::gemm_nr * ferro::gemm_nr;");
    let _ = writeln!(out, "    alignas(64) float tile[{tm}LL * ld];");
    let _ = writeln!(
        out,
        "    ferro::gemm_f32(mt, nt, {}LL, {a_at}, {}LL, {}LL, {b_at}, {}LL, {}LL, tile, ld);",
        mp.k, a.rows, a.cols, b.rows, b.cols
    );
}

/// `ptr + c0 + c1 * v1 + ...`, leaving out the terms that are zero.
fn address(ptr: &str, terms: &[(i64, &str)]) -> String {
    let mut out = ptr.to_string();
    for &(c, v) in terms.iter().filter(|(c, _)| *c != 0) {
        let _ = if v.is_empty() { write!(out, " + {c}LL") } else { write!(out, " + {v} * {c}LL") };
    }
    out
}

fn cdiv(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// The epilogue through the kernel writer: the loop-invariant code, the code per output
/// element (the product's node a read of `acc`, stored if it is read outside the kernel), and
/// the flags of its index checks.
fn write_epilogue(
    s: &Schedule,
    k: &FusedKernel,
    params: &Params,
    mp: &ProductShape,
) -> Result<(String, String, Vec<super::dialect::Acc>), CodegenError> {
    let p = &s.program;
    let Epilogue { mut kernel, reads_at, mut locals } = Epilogue::of(s, k)?;
    // the flat output index as (row, column): `x0 = x0' * n + x1`, so that a bias row reads at
    // `x1`, not at `x0 % n`
    let (rows_total, n) = (mp.batch * mp.m, mp.n);
    let flat = IndexExpr::var(Var(0)).scale(n).add(&IndexExpr::var(Var(1)));
    let ranges = [rows_total, n];
    for kn in &mut kernel.plan.nodes {
        kn.body = kn.body.rewrite_indices(&|e: &IndexExpr| e.substitute(&[Some(flat.clone())], &ranges));
        kn.ranges = ranges.to_vec();
    }
    let read_only: HashSet<BufferId> = params.read.iter().filter(|b| !params.written.contains(b)).copied().collect();
    let rows = HashSet::new();
    let (mut hoisted, mut code, mut accs) = (String::new(), String::new(), Vec::new());
    let mut tmp = 0usize;
    for g in &kernel.plan.groups {
        // the product's group loops over k: here its node is one read of `acc`
        let group = LoopGroup { inner: Vec::new(), reduction: false, nodes: g.nodes.clone() };
        let mut dialect = CppGroup::of_template(p, &s.storage, &params.ptr, &read_only, &rows);
        let text = write_group(&mut dialect, s, &kernel, &group, &mut locals, &reads_at, &mut tmp, None)?;
        hoisted.push_str(&text.kernel);
        for section in [&text.pre, &text.inner, &text.post] {
            code.push_str(section);
        }
        if let Some(a) = dialect.accs.iter().find(|a| !a.index_check) {
            return Err(CodegenError::internal(&k.name, format!("a reduction ({}) in a matrix product's epilogue", a.name)));
        }
        accs.extend(dialect.accs);
    }
    Ok((hoisted, code, accs))
}
