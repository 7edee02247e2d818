//! Fused attention (`Template::Attention`) as a C++ kernel: threads take tiles of rows (queries
//! of one batch and head; keys for the keys' gradient), and each tile walks the columns its
//! rows may see a block at a time, the block's products from gemm.h's register-blocked
//! `ferro::gemm_f32` into float32 scratch tiles. The bias is the node's own body written by the
//! kernel writer at (row `x0`, batch `x1`, head `x2`, column `x3`) over the block: a mask or
//! score modification is computed where it is used and never stored. A tile visits the union of
//! its rows' columns of the band the bias proves (`key_band`: causal, sliding window) and,
//! where the bias reads tensors (a document id per position), of those between each row's
//! first and last open one (`KeyRange`); the bias closes the rest.

use super::dialect::{Acc, CppGroup};
use super::{indent, Params};
use crate::codegen::attention::{AttentionShape, GradOperands, Operand};
use crate::codegen::writer::write_values;
use crate::codegen::CodegenError;
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, Schedule};
use std::collections::HashSet;
use std::fmt::Write;

/// Multiply-adds above which a kernel's tiles spread over threads.
const PARALLEL_FMAS: i64 = 1 << 16;
/// Rows per tile, and columns per step (a multiple of the products' micro tile).
const TILE_M: i64 = 32;
const TILE_N: i64 = 64;

/// The kernel's definition.
pub(super) fn render(s: &Schedule, k: &FusedKernel) -> Result<String, CodegenError> {
    let a = AttentionShape::of(s, k)?;
    if a.dtype != DType::F32 {
        return Err(CodegenError::unsupported(&k.name, format!("a C++ attention of {}", a.dtype.torch_name())));
    }
    let params = Params::of(s, k);
    let bias = write_bias(s, k, &params, &a)?;
    let [b, h, rows, _, d] = a.dims;
    let tm = rows.min(TILE_M);
    let tiles = (rows + tm - 1) / tm;
    let tile = Tile { a: &a, params: &params, kernel: &k.name, bias: &bias, tm, d, scale: super::dialect::float_lit(a.scale, DType::F32) };
    let mut body = tile.head(tiles)?;
    match (a.pass, &a.grads) {
        (AttentionPass::Forward, _) => tile.forward(&mut body)?,
        (AttentionPass::GradQuery(_), Some(g)) => tile.grad_query(&mut body, g)?,
        (AttentionPass::GradKeyValue(_), Some(g)) => tile.grad_key_value(&mut body, g)?,
        _ => return Err(CodegenError::internal(&k.name, "an attention backward without its reads")),
    }
    for acc in &bias.accs {
        let _ = writeln!(body, "if ({}) {{\n  #pragma omp atomic write\n  ferro_err = 1;\n}}", acc.name);
    }
    let mut out = String::new();
    let _ = writeln!(out, "extern \"C\" int {}({}) {{", k.name, params.decls.join(", "));
    out.push_str("  int ferro_err = 0;\n");
    let fmas = a.dims.iter().fold(1i64, |f, &x| f.saturating_mul(x));
    if fmas >= PARALLEL_FMAS && b * h * tiles > 1 {
        // (the tiles of a band or a document see different numbers of columns)
        out.push_str("  #pragma omp parallel for schedule(dynamic, 1)\n");
    }
    let _ = writeln!(out, "  for (int64_t t = 0; t < {}LL; ++t) {{", b * h * tiles);
    out.push_str(&indent(&body, 4));
    out.push_str("  }\n  return ferro_err;\n}\n");
    Ok(out)
}

/// What one tile's code is written from.
struct Tile<'a> {
    a: &'a AttentionShape,
    params: &'a Params,
    kernel: &'a str,
    bias: &'a BiasCode,
    tm: i64,
    d: i64,
    scale: String,
}

/// A product operand: its pointer expression, its stride across the product's rows (A) or
/// columns (B), and its stride along k.
type Strided = (String, String, String);

impl Tile<'_> {
    fn ptr(&self, o: &Operand) -> Result<String, CodegenError> {
        self.params.ptr.get(&o.buf).cloned().ok_or_else(|| CodegenError::internal(self.kernel, "an operand without a pointer"))
    }

    /// Program `t`'s batch `x1`, head `x2` and rows (`i0`, `mt` of them), the bias's constants,
    /// the columns the tile visits (`tile_start` to `tile_end`) and its scratch tiles.
    fn head(&self, tiles: i64) -> Result<String, CodegenError> {
        let (a, tm, d) = (self.a, self.tm, self.d);
        let [_, h, rows, _, _] = a.dims;
        let mut body = String::new();
        let _ = writeln!(body, "const int64_t x1 = t / {}LL;", h * tiles);
        let _ = writeln!(body, "const int64_t x2 = t / {tiles}LL % {h}LL;");
        let _ = writeln!(body, "const int64_t i0 = t % {tiles}LL * {tm}LL;");
        let _ = writeln!(body, "const int64_t mt = ferro::min<int64_t>({tm}LL, {rows}LL - i0);");
        for acc in &self.bias.accs {
            let _ = writeln!(body, "{}", acc.declare(""));
        }
        body.push_str(&self.bias.constants);
        // the tile's columns: from its rows' first to their last
        body.push_str("int64_t tile_start = INT64_MAX, tile_end = 0;\nfor (int64_t x0 = i0; x0 < i0 + mt; ++x0) {\n");
        let mut range = String::new();
        self.write_range(&mut range)?;
        range.push_str(
            "if (start < end) {\n  tile_start = ferro::min<int64_t>(tile_start, start);\n  tile_end = ferro::max<int64_t>(tile_end, end);\n}\n",
        );
        body.push_str(&indent(&range, 2));
        body.push_str("}\n");
        let _ = writeln!(body, "constexpr int64_t ldn = ({TILE_N}LL + ferro::gemm_nr - 1) / ferro::gemm_nr * ferro::gemm_nr;");
        let _ = writeln!(body, "constexpr int64_t ldd = ({d}LL + ferro::gemm_nr - 1) / ferro::gemm_nr * ferro::gemm_nr;");
        let _ = writeln!(body, "alignas(64) float scores[{tm}LL * ldn], product[{tm}LL * ldd];");
        if a.grads.is_some() {
            // (the backward's dP, then dS)
            let _ = writeln!(body, "alignas(64) float grads[{tm}LL * ldn];");
        }
        Ok(body)
    }

    /// `start` and `end`, the columns row `x0` visits: those of the band the bias proves, and
    /// between the row's first and last open one where the bias reads tensors.
    fn write_range(&self, out: &mut String) -> Result<(), CodegenError> {
        let a = self.a;
        let cols = a.dims[3];
        let _ = writeln!(out, "int64_t start = 0, end = {cols}LL;");
        let keys_major = matches!(a.pass, AttentionPass::GradKeyValue(_));
        for bound in &a.band {
            match (keys_major, bound.lower) {
                // key >= slope·query + offset, key <= slope·query + offset
                (false, true) => _ = writeln!(out, "start = ferro::max<int64_t>(start, {}LL * x0 + {}LL);", bound.slope, bound.offset),
                (false, false) => _ = writeln!(out, "end = ferro::min<int64_t>(end, {}LL * x0 + {}LL + 1);", bound.slope, bound.offset),
                // the queries that see key x0 (bounds of slope 1): query <= key - offset, query >= key - offset
                (true, true) if bound.slope == 1 => _ = writeln!(out, "end = ferro::min<int64_t>(end, x0 - {}LL + 1);", bound.offset),
                (true, false) if bound.slope == 1 => _ = writeln!(out, "start = ferro::max<int64_t>(start, x0 - {}LL);", bound.offset),
                _ => {}
            }
        }
        if let Some([first, last]) = &a.keys {
            let _ = writeln!(out, "start = ferro::max<int64_t>(start, (int64_t){});", at_row(&self.ptr(first)?, first, "x0"));
            let _ = writeln!(out, "end = ferro::min<int64_t>(end, (int64_t){} + 1);", at_row(&self.ptr(last)?, last, "x0"));
        }
        Ok(())
    }

    /// Operand `o` from row `row` on: its rows are the product's rows or columns, its head dim
    /// the product's k.
    fn rows_by_d(&self, o: &Operand, row: &str) -> Result<Strided, CodegenError> {
        Ok((format!("{} + {}", self.ptr(o)?, row_offset(o, row)), format!("{}LL", o.stride[2]), format!("{}LL", o.stride[3])))
    }

    /// Operand `o` from row `row` on with its rows along the product's k (its head dim across).
    fn d_by_rows(&self, o: &Operand, row: &str) -> Result<Strided, CodegenError> {
        Ok((format!("{} + {}", self.ptr(o)?, row_offset(o, row)), format!("{}LL", o.stride[3]), format!("{}LL", o.stride[2])))
    }

    /// `c = a · b` by `ferro::gemm_f32` (`m x n` by `k`, `c` rows of `ldc` floats).
    fn gemm(out: &mut String, [m, n, k]: [&str; 3], a: &Strided, b: &Strided, c: &str, ldc: &str) {
        let _ = writeln!(out, "  ferro::gemm_f32({m}, {n}, {k}, {}, {}, {}, {}, {}, {}, {c}, {ldc});", a.0, a.1, a.2, b.0, b.2, b.1);
    }

    /// A scratch tile as a product's A (rows of `ldn` floats, k along a row).
    fn scratch(name: &str) -> Strided {
        (name.to_string(), "ldn".to_string(), "1".to_string())
    }

    /// The loop over the tile's column blocks (`n0`, `nt` columns).
    fn open_blocks(out: &mut String) {
        let _ = writeln!(out, "for (int64_t n0 = tile_start; n0 < tile_end; n0 += {TILE_N}LL) {{");
        let _ = writeln!(out, "  const int64_t nt = ferro::min<int64_t>({TILE_N}LL, tile_end - n0);");
    }

    /// The loop over the block's rows `r` (`x0`, then `per_row`) and columns `j` (`x3`),
    /// `bias` bound, each running `step`.
    fn over_block(&self, out: &mut String, per_row: &str, step: &str) {
        let mut row = String::from("const int64_t x0 = i0 + r;\n");
        row.push_str(&self.bias.row);
        row.push_str(per_row);
        row.push_str("for (int64_t j = 0; j < nt; ++j) {\n");
        row.push_str(&indent(&format!("const int64_t x3 = n0 + j;\n{}{step}", self.bias.column), 2));
        row.push_str("}\n");
        out.push_str("  for (int64_t r = 0; r < mt; ++r) {\n");
        out.push_str(&indent(&row, 4));
        out.push_str("  }\n");
    }

    /// `acc[r][d] += product[r][d]` over the tile's rows.
    fn absorb(out: &mut String, acc: &str, d: i64) {
        let _ = writeln!(
            out,
            "  for (int64_t r = 0; r < mt; ++r)\n    for (int64_t d = 0; d < {d}LL; ++d) {acc}[r * {d}LL + d] += product[r * ldd + d];"
        );
    }

    /// Queries' rows: the scores, each row's online softmax (running maximum and sum), the
    /// probabilities times the values added into float32 accumulators; a row whose keys are all
    /// closed gives 0 (the safe softmax's answer) and a log-sum-exp of -inf.
    fn forward(&self, out: &mut String) -> Result<(), CodegenError> {
        let (a, tm, d, scale) = (self.a, self.tm, self.d, &self.scale);
        let dk = format!("{d}LL");
        let _ = writeln!(out, "float acc[{tm}LL * {d}LL], m_i[{tm}], l_i[{tm}], mx[{tm}];");
        let _ = writeln!(out, "for (int64_t r = 0; r < {tm}LL; ++r) {{ m_i[r] = -__builtin_inff(); l_i[r] = 0.0f; }}");
        let _ = writeln!(out, "for (int64_t e = 0; e < {}LL; ++e) acc[e] = 0.0f;", tm * d);
        Self::open_blocks(out);
        Self::gemm(out, ["mt", "nt", &dk], &self.rows_by_d(&a.q, "i0")?, &self.rows_by_d(&a.k, "n0")?, "scores", "ldn");
        // (scores[r * ldn + j]: the score, then its probability)
        out.push_str("  for (int64_t r = 0; r < mt; ++r) mx[r] = -__builtin_inff();\n");
        let step =
            format!("const float s = scores[r * ldn + j] * {scale} + bias;\nscores[r * ldn + j] = s;\nmx[r] = s > mx[r] ? s : mx[r];\n");
        self.over_block(out, "", &step);
        let mut update = String::from("for (int64_t r = 0; r < mt; ++r) {\n");
        // (a row with no open key yet keeps -inf: its terms are exp(-inf) = 0, not NaN)
        update.push_str("  const float m_new = mx[r] > m_i[r] ? mx[r] : m_i[r];\n  float* srow = scores + r * ldn;\n");
        update.push_str("  if (m_new == -__builtin_inff()) {\n    for (int64_t j = 0; j < nt; ++j) srow[j] = 0.0f;\n    continue;\n  }\n");
        update.push_str("  const float alpha = ferro::exp(m_i[r] - m_new);\n  float sum = 0.0f;\n");
        update.push_str("  for (int64_t j = 0; j < nt; ++j) {\n    const float p = ferro::exp(srow[j] - m_new);\n    srow[j] = p;\n    sum += p;\n  }\n");
        let _ = writeln!(
            update,
            "  l_i[r] = l_i[r] * alpha + sum;\n  m_i[r] = m_new;\n  for (int64_t d = 0; d < {d}LL; ++d) acc[r * {d}LL + d] *= alpha;\n}}"
        );
        out.push_str(&indent(&update, 2));
        Self::gemm(out, ["mt", &dk, "nt"], &Self::scratch("scores"), &self.d_by_rows(&a.v, "n0")?, "product", "ldd");
        Self::absorb(out, "acc", d);
        out.push_str("}\n");
        let mut fin = String::from("const int64_t x0 = i0 + r;\nconst float l = l_i[r];\n");
        let po = self.ptr(&a.out)?;
        let _ = writeln!(fin, "for (int64_t d = 0; d < {d}LL; ++d) {} = l > 0.0f ? acc[r * {d}LL + d] / l : 0.0f;", at(&po, &a.out, "x0"));
        if let Some(lse) = a.result(AttentionResult::LogSumExp) {
            let _ = writeln!(fin, "{} = l > 0.0f ? m_i[r] + ferro::log(l) : -__builtin_inff();", at_row(&self.ptr(lse)?, lse, "x0"));
        }
        out.push_str("for (int64_t r = 0; r < mt; ++r) {\n");
        out.push_str(&indent(&fin, 2));
        out.push_str("}\n");
        Ok(())
    }

    /// The probabilities of the block again, from the forward's log-sum-exp (a closed row's
    /// -inf read as 0: its probabilities are exp(-inf) = 0), into `scores`, and
    /// `dS = P·(dP - delta)` into `grads` (which holds dP). The queries' log-sum-exp and delta
    /// are read at `query` (`x0`: once per row; `x3`: per column).
    fn probabilities(&self, out: &mut String, g: &GradOperands, query: &str) -> Result<(), CodegenError> {
        let reads = format!(
            "float lse = {};\nif (lse == -__builtin_inff()) lse = 0.0f;\nconst float delta = {};\n",
            at_row(&self.ptr(&g.lse)?, &g.lse, query),
            at_row(&self.ptr(&g.delta)?, &g.delta, query)
        );
        let step = format!(
            "const float p = ferro::exp(scores[r * ldn + j] * {} + bias - lse);\n\
             scores[r * ldn + j] = p;\ngrads[r * ldn + j] = p * (grads[r * ldn + j] - delta);\n",
            self.scale
        );
        match query {
            "x0" => self.over_block(out, &reads, &step),
            _ => self.over_block(out, "", &(reads + &step)),
        }
        Ok(())
    }

    /// Queries' rows: `dQ = scale · dS·K` with `dP = dO·Vᵀ`.
    fn grad_query(&self, out: &mut String, g: &GradOperands) -> Result<(), CodegenError> {
        let (a, tm, d) = (self.a, self.tm, self.d);
        let dk = format!("{d}LL");
        let _ = writeln!(out, "float dq[{tm}LL * {d}LL];\nfor (int64_t e = 0; e < {}LL; ++e) dq[e] = 0.0f;", tm * d);
        Self::open_blocks(out);
        Self::gemm(out, ["mt", "nt", &dk], &self.rows_by_d(&a.q, "i0")?, &self.rows_by_d(&a.k, "n0")?, "scores", "ldn");
        Self::gemm(out, ["mt", "nt", &dk], &self.rows_by_d(&g.grad_out, "i0")?, &self.rows_by_d(&a.v, "n0")?, "grads", "ldn");
        self.probabilities(out, g, "x0")?;
        Self::gemm(out, ["mt", &dk, "nt"], &Self::scratch("grads"), &self.d_by_rows(&a.k, "n0")?, "product", "ldd");
        Self::absorb(out, "dq", d);
        out.push_str("}\n");
        let po = self.ptr(&a.out)?;
        let _ = writeln!(
            out,
            "for (int64_t r = 0; r < mt; ++r) {{\n  const int64_t x0 = i0 + r;\n  for (int64_t d = 0; d < {d}LL; ++d) {} = dq[r * {d}LL + d] * {};\n}}",
            at(&po, &a.out, "x0"),
            self.scale
        );
        Ok(())
    }

    /// Keys' rows, walking the queries that see them: `dV = Pᵀ·dO` and `dK = scale · dSᵀ·Q`,
    /// with `dPᵀ = V·dOᵀ`.
    fn grad_key_value(&self, out: &mut String, g: &GradOperands) -> Result<(), CodegenError> {
        let (a, tm, d) = (self.a, self.tm, self.d);
        let dk = format!("{d}LL");
        let dv = a.result(AttentionResult::GradValue).ok_or_else(|| CodegenError::internal(self.kernel, "no values' gradient"))?;
        let _ = writeln!(out, "float dk[{tm}LL * {d}LL], dv[{tm}LL * {d}LL];");
        let _ = writeln!(out, "for (int64_t e = 0; e < {}LL; ++e) {{ dk[e] = 0.0f; dv[e] = 0.0f; }}", tm * d);
        Self::open_blocks(out);
        Self::gemm(out, ["mt", "nt", &dk], &self.rows_by_d(&a.k, "i0")?, &self.rows_by_d(&a.q, "n0")?, "scores", "ldn");
        Self::gemm(out, ["mt", "nt", &dk], &self.rows_by_d(&a.v, "i0")?, &self.rows_by_d(&g.grad_out, "n0")?, "grads", "ldn");
        self.probabilities(out, g, "x3")?;
        Self::gemm(out, ["mt", &dk, "nt"], &Self::scratch("scores"), &self.d_by_rows(&g.grad_out, "n0")?, "product", "ldd");
        Self::absorb(out, "dv", d);
        Self::gemm(out, ["mt", &dk, "nt"], &Self::scratch("grads"), &self.d_by_rows(&a.q, "n0")?, "product", "ldd");
        Self::absorb(out, "dk", d);
        out.push_str("}\n");
        let (po, pdv) = (self.ptr(&a.out)?, self.ptr(dv)?);
        let _ = writeln!(
            out,
            "for (int64_t r = 0; r < mt; ++r) {{\n  const int64_t x0 = i0 + r;\n  for (int64_t d = 0; d < {d}LL; ++d) {{\n    {} = dk[r * {d}LL + d] * {};\n    {} = dv[r * {d}LL + d];\n  }}\n}}",
            at(&po, &a.out, "x0"),
            self.scale,
            at(&pdv, dv, "x0")
        );
        Ok(())
    }
}

/// The bias's code: its constants (once per tile), what reads the row, batch and head alone
/// (once per row of a block), and the rest per column, binding `bias`; and the flags of its
/// index checks.
struct BiasCode {
    constants: String,
    row: String,
    column: String,
    accs: Vec<Acc>,
}

/// Element `d` of the operand's row `row` (of batch `x1`, head `x2`).
fn at(ptr: &str, o: &Operand, row: &str) -> String {
    format!("{ptr}[{} + d * {}LL]", row_offset(o, row), o.stride[3])
}

/// The operand's one value per row (a log-sum-exp, a `delta`, a key range).
fn at_row(ptr: &str, o: &Operand, row: &str) -> String {
    format!("{ptr}[{}]", row_offset(o, row))
}

fn row_offset(o: &Operand, row: &str) -> String {
    let [sb, sh, sr, _] = o.stride;
    let head = if o.group > 1 { format!("(x2 / {}LL)", o.group) } else { "x2".to_string() };
    format!("{}LL + x1 * {sb}LL + {head} * {sh}LL + {row} * {sr}LL", o.offset)
}

/// The bias through the kernel writer.
fn write_bias(s: &Schedule, k: &FusedKernel, params: &Params, a: &AttentionShape) -> Result<BiasCode, CodegenError> {
    let read_only: HashSet<BufferId> = params.read.iter().filter(|b| !params.written.contains(b)).copied().collect();
    let rows = HashSet::new();
    let mut dialect = CppGroup::of_template(&s.program, &s.storage, &params.ptr, &read_only, &rows);
    let [b, h, rows, cols, _] = a.dims;
    let store = a.bias.store.as_ref().ok_or_else(|| CodegenError::internal(&k.name, "attention: a bias without a value"))?;
    let mut tmp = 0usize;
    // (the row, batch and head are fixed for the row: variables 0, 1 and 2)
    let (text, names) = write_values(&mut dialect, &a.bias, &[store.value], &[rows, b, h, cols], 0b0111, &mut tmp)
        .map_err(|why| CodegenError::unsupported(&k.name, why))?;
    let (constants, row) = (text.kernel, text.pre);
    let column = format!("{}{}const float bias = {};\n", text.inner, text.post, names[0]);
    if let Some(acc) = dialect.accs.iter().find(|a| !a.index_check) {
        return Err(CodegenError::internal(&k.name, format!("a reduction ({}) in an attention's bias", acc.name)));
    }
    Ok(BiasCode { constants, row, column, accs: dialect.accs })
}
