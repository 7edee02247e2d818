//! Fused attention (`Template::Attention`) as a Triton kernel in the manner of flash attention:
//! each program holds a `BLOCK_M`-row tile of queries of one (batch, head) and walks the keys
//! `BLOCK_N` at a time, with a running maximum and sum per row (the online softmax) and float32
//! accumulators. The bias is the node's own body written by the kernel writer over the tile
//! (`b`, `h`, the rows `rm[:, None]`, the keys `rn[None, :]`): a mask or score modification is
//! computed where it is used and never stored. Where the bias proves that a query sees only
//! keys in a band around its own position (causal, sliding-window masks: `key_band`), each
//! query tile visits only the key tiles of its band.

use super::bias_split::{split_bias, SplitBias, LOG2E};
use super::template::{cdiv, tile_dim};
use super::{CodegenError, KernelLaunch, Params, IDX32_LIMIT};
use crate::codegen::attention::{AttentionShape, Bound, GradOperands, Operand};
use crate::codegen::writer::write_values;
use crate::codegen::{Tile, TuneConfig};
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, Schedule};
use crate::symbolic::Var;
use std::fmt::Write;

/// What the kernel is written from: the node's shape (`AttentionShape`, which it derefs to),
/// its bias split for the scores, and the index type.
pub(super) struct AttentionKernel {
    shape: AttentionShape,
    /// The bias alone over variables (row, b, h, col, the program's first row), as the scores
    /// take it (`split_bias`): the writer computes what reads the rows alone (`Section::Pre`: a
    /// query's document id) once, before the loop.
    bias: SplitBias,
    idx64: bool,
}

impl std::ops::Deref for AttentionKernel {
    type Target = AttentionShape;
    fn deref(&self) -> &AttentionShape {
        &self.shape
    }
}

impl AttentionKernel {
    pub(super) fn of(s: &Schedule, k: &FusedKernel, params: &Params) -> Result<AttentionKernel, CodegenError> {
        let p = &s.program;
        let shape = AttentionShape::of(s, k)?;
        let [b, h, rows, cols, _] = shape.dims;
        let ranges = [rows, b, h, cols];
        // (the scores are never stored: only the buffers and the bias's addresses bound the offsets)
        let mut idx64 = shape.bias.indices().iter().any(|e| e.bounds(&ranges).1 >= IDX32_LIMIT as i128);
        for buf in params.read.iter().chain(&params.written) {
            idx64 |= p.buffer(*buf).layout.storage_numel() >= IDX32_LIMIT;
        }
        let keys_major = matches!(shape.pass, AttentionPass::GradKeyValue(_));
        let (query, key) = if keys_major { (Var(3), Var(0)) } else { (Var(0), Var(3)) };
        let bad = || CodegenError::internal(&k.name, "attention: a bias without a value");
        let bias = split_bias(&shape.bias, [query, key, Var(4)], &[rows, b, h, cols, rows]).ok_or_else(bad)?;
        Ok(AttentionKernel { shape, bias, idx64 })
    }

    /// The tiles the kernel launches with (the first) and an autotuner's candidates:
    /// (BLOCK_M, BLOCK_N, warps, stages).
    fn configs(&self) -> Vec<TuneConfig> {
        let [b, h, m, n, d] = self.dims;
        // (the head dim sets the register load: 8 warps for 128-wide heads; the backward holds
        // two or three accumulators of the program's rows. First: each list's fastest on the
        // H200 at 4k keys, by the autotuner over an ALiBi and a sliding-window bias:
        // docs/triton_kernels.md)
        let shapes: &[(i64, i64, u32, u32)] = match (self.pass, d > 64) {
            // (float32 tiles hold twice the bytes: shorter ones, fewer stages)
            _ if self.dtype == DType::F32 => match (self.pass, d > 64) {
                (AttentionPass::Forward, false) => &[(64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2), (32, 64, 4, 3)],
                (AttentionPass::Forward, true) => &[(32, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2)],
                (AttentionPass::GradQuery(_), false) => &[(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)],
                (AttentionPass::GradQuery(_), true) => &[(64, 32, 4, 2), (32, 32, 4, 2)],
                (AttentionPass::GradKeyValue(_), false) => &[(64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 4, 2)],
                (AttentionPass::GradKeyValue(_), true) => &[(32, 32, 4, 2), (64, 32, 4, 2)],
            },
            (AttentionPass::GradQuery(_), true) => &[(128, 64, 8, 3), (128, 32, 8, 2), (64, 32, 4, 2), (64, 64, 8, 2)],
            (AttentionPass::GradQuery(_), false) => &[(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2), (128, 32, 4, 2)],
            (AttentionPass::GradKeyValue(_), true) => &[(64, 32, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2), (128, 32, 8, 2)],
            (AttentionPass::GradKeyValue(_), false) => &[(64, 64, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 3), (128, 32, 4, 2)],
            (AttentionPass::Forward, true) => &[(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 2)],
            // (a query tile that sees every key skips none: taller tiles read the keys and
            // values half as often; a band or key ranges skip more with shorter ones)
            (AttentionPass::Forward, false) if self.band.is_empty() && self.keys.is_none() => {
                &[(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)]
            }
            (AttentionPass::Forward, false) => {
                &[(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)]
            }
        };
        let mut out: Vec<TuneConfig> = Vec::new();
        for &(bm, bn, warps, stages) in shapes {
            let tile = Tile { m: tile_dim(bm, m), n: tile_dim(bn, n), k: d };
            let grid = b * h * cdiv(m, tile.m);
            let c = TuneConfig { grid, xblock: 0, num_warps: warps, num_stages: stages, tile: Some(tile) };
            if !out.contains(&c) {
                out.push(c);
            }
        }
        out
    }
}

/// The kernel's launch: the first configuration, the others as the autotuner's candidates.
pub(super) fn launch(s: &Schedule, k: &FusedKernel, params: &Params, ak: &AttentionKernel) -> KernelLaunch {
    super::template::tiled_launch(s, k, params, ak.configs())
}

/// The kernel's definition: its program's queries, the loop over the key tiles of their band,
/// the normalized result.
pub(super) fn write(s: &Schedule, k: &FusedKernel, params: &Params, ak: &AttentionKernel) -> Result<String, CodegenError> {
    let ptr = |o: &Operand| params.ptr.get(&o.buf).cloned().ok_or_else(|| CodegenError::internal(&k.name, "an operand without a pointer"));
    let [pq, pk, pv, po] = [ptr(&ak.q)?, ptr(&ak.k)?, ptr(&ak.v)?, ptr(&ak.out)?];
    let keys = ak.keys.as_ref().map(|[first, last]| Ok::<_, CodegenError>([(ptr(first)?, first), (ptr(last)?, last)])).transpose()?;
    let result = |what: AttentionResult| -> Result<Option<(String, &Operand)>, CodegenError> {
        ak.result(what).map(|o| Ok((ptr(o)?, o))).transpose()
    };
    let bias = bias_text(s, k, params, ak)?;
    let mut all = params.names.clone();
    all.extend(["BLOCK_M: tl.constexpr".into(), "BLOCK_N: tl.constexpr".into(), "BLOCK_K: tl.constexpr".into()]);
    let mut out = format!("@ferro_jit\ndef {}({}):\n", k.name, all.join(", "));
    let m = ak.dims[2];
    let grads = match &ak.grads {
        Some(g) => Some((g, [ptr(&g.grad_out)?, ptr(&g.lse)?, ptr(&g.delta)?])),
        None => None,
    };
    match (ak.pass, grads) {
        (AttentionPass::GradKeyValue(_), Some((g, p))) => {
            let (pdv, dv) = result(AttentionResult::GradValue)?.ok_or_else(|| CodegenError::internal(&k.name, "no values' gradient"))?;
            let grad = GradPointers { g, grad_out: &p[0], lse: &p[1], delta: &p[2] };
            write_grad_key_value(&mut out, ak, keys, [&pq, &pk, &pv], &grad, &bias);
            let n = ak.dims[2];
            for (name, (ptr, o)) in [("dk", (&po, &ak.out)), ("dv", (&pdv, dv))] {
                let at = o.at("rn[:, None]", "rd[None, :]");
                let _ =
                    writeln!(out, "    tl.store({ptr} + ({at}), {}, mask=rn[:, None] < {n})", super::dialect::store_conv(name, ak.dtype));
            }
        }
        (AttentionPass::GradQuery(_), Some((g, p))) => {
            let grad = GradPointers { g, grad_out: &p[0], lse: &p[1], delta: &p[2] };
            write_queries(&mut out, ak, &pq, &bias, Some(&grad));
            write_key_loop(&mut out, ak, keys, &pk, &pv, &bias.tile, true);
            let at = ak.out.at("rm[:, None]", "rd[None, :]");
            let _ = writeln!(out, "    dq = dq * {}", super::dialect::float_lit(ak.scale));
            let _ = writeln!(out, "    tl.store({po} + ({at}), {}, mask=rm[:, None] < {m})", super::dialect::store_conv("dq", ak.dtype));
        }
        _ => {
            write_queries(&mut out, ak, &pq, &bias, None);
            write_key_loop(&mut out, ak, keys, &pk, &pv, &bias.tile, false);
            // a row whose keys are all closed gives 0 (the safe softmax's answer)
            out.push_str("    result = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)\n");
            if let Some(q) = &bias.query {
                // the query part the scores left out, per row; where it is not finite, so is
                // every score of the row: -inf closes it (0), +inf or NaN give NaN
                let _ = writeln!(out, "    query_part = {}", query_vector(q, true));
                out.push_str("    finite = (query_part == query_part) & (tl.abs(query_part) != float(\"inf\"))\n");
                out.push_str("    closed = tl.where(query_part == float(\"-inf\"), 0.0, float(\"nan\"))\n");
                out.push_str("    result = tl.where(finite[:, None], result, closed[:, None])\n");
            }
            let at = ak.out.at("rm[:, None]", "rd[None, :]");
            let _ =
                writeln!(out, "    tl.store({po} + ({at}), {}, mask=rm[:, None] < {m})", super::dialect::store_conv("result", ak.dtype));
            if let Some((pl, lse)) = result(AttentionResult::LogSumExp)? {
                // -inf where no key is open (the backward's probabilities are then 0)
                // (natural units, with the query part the scores left out)
                let plus = if bias.query.is_some() { " + query_part" } else { "" };
                let _ = writeln!(
                    out,
                    "    lse = tl.where(l_i > 0, (m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0))) * {}{plus}, float(\"-inf\"))",
                    super::dialect::float_lit(std::f64::consts::LN_2)
                );
                let _ = writeln!(out, "    tl.store({pl} + ({}), lse, mask=rm < {m})", lse.at("rm", "0"));
            }
        }
    }
    Ok(out)
}

/// The backward's further operands and their pointers.
struct GradPointers<'a> {
    g: &'a GradOperands,
    grad_out: &'a str,
    lse: &'a str,
    delta: &'a str,
}

impl GradPointers<'_> {
    /// The log-sum-exp and delta of query rows `rows` (a 1-D index), as `lse` and `delta`; a
    /// closed row's -inf log-sum-exp read as 0 (its probabilities are exp(-inf) = 0).
    fn write_rows(&self, out: &mut String, indent: &str, rows: &str, mask: Option<&str>) {
        let masked = |other: &str| mask.map_or(String::new(), |m| format!(", mask={m}, other={other}"));
        let _ = writeln!(out, "{indent}lse = tl.load({} + ({}){})", self.lse, self.g.lse.at(rows, "0"), masked("0.0"));
        let _ = writeln!(out, "{indent}lse = tl.where(lse == float(\"-inf\"), 0.0, lse)");
        let _ = writeln!(out, "{indent}delta = tl.load({} + ({}){})", self.delta, self.g.delta.at(rows, "0"), masked("0.0"));
    }
}

impl Operand {
    /// The offset of element `[off_b, off_h, row, col]`.
    fn at(&self, row: &str, col: &str) -> String {
        let [sb, sh, sr, sc] = self.stride;
        let head = if self.group > 1 { format!("(off_h // {})", self.group) } else { "off_h".to_string() };
        format!("{} + off_b * {sb} + {head} * {sh} + {row} * {sr} + {col} * {sc}", self.offset)
    }
}

impl AttentionKernel {
    /// The products' helpers (plain, and added to an accumulator): float32 operands multiply in
    /// float32, as eager does unless TF32 is allowed.
    fn dots(&self) -> [&'static str; 2] {
        if self.dtype == DType::F32 {
            ["ferro_dot_f32", "ferro_dot_acc_f32"]
        } else {
            ["ferro_dot", "ferro_dot_acc"]
        }
    }

    /// `e` in the kernel's index type.
    fn wide(&self, e: &str) -> String {
        if self.idx64 {
            format!("{e}.to(tl.int64)")
        } else {
            e.to_string()
        }
    }
}

/// The program's (batch, head) and its `BLOCK_M` rows `r{axis}` (queries `m`, or keys `n` for
/// the keys' gradient), and the head dim `rd`.
fn write_program(out: &mut String, ak: &AttentionKernel, axis: char) {
    let [_, h, rows, _, _] = ak.dims;
    let _ = writeln!(out, "    pid = {}", ak.wide("tl.program_id(0)"));
    let _ = writeln!(out, "    tiles_{axis} = ({rows} + BLOCK_M - 1) // BLOCK_M");
    let _ = writeln!(out, "    pid_{axis} = pid % tiles_{axis}\n    off_bh = pid // tiles_{axis}");
    let _ = writeln!(out, "    off_b = off_bh // {h}\n    off_h = off_bh % {h}");
    let _ = writeln!(out, "    r{axis} = pid_{axis} * BLOCK_M + {}", ak.wide("tl.arange(0, BLOCK_M)"));
    let _ = writeln!(out, "    rd = {}", ak.wide("tl.arange(0, BLOCK_K)"));
}

/// The program's (batch, head) and query rows, its queries loaded, the running maximum, sum
/// and accumulator, and the bias's part that reads the rows alone (`rows`).
fn write_queries(out: &mut String, ak: &AttentionKernel, pq: &str, bias: &BiasText, grads: Option<&GradPointers>) {
    let m = ak.dims[2];
    write_program(out, ak, 'm');
    // rows past the edge read the first ones again (their results are not stored)
    let _ = writeln!(out, "    qm = rm % {m}");
    let _ = writeln!(out, "    q = tl.load({pq} + ({}))", ak.q.at("qm[:, None]", "rd[None, :]"));
    if let Some(g) = grads {
        let _ = writeln!(out, "    do = tl.load({} + ({}))", g.grad_out, g.g.grad_out.at("qm[:, None]", "rd[None, :]"));
        g.write_rows(out, "    ", "qm", None);
        out.push_str("    dq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)\n");
    } else {
        out.push_str("    m_i = tl.full([BLOCK_M], float(\"-inf\"), tl.float32)\n");
        out.push_str("    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)\n");
        out.push_str("    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)\n");
    }
    let _ = writeln!(out, "    xmask = rm[:, None] < {m}");
    // (one shape for the whole kernel: Triton keeps a loop-carried name's type)
    out.push_str("    xzero = rm[:, None] * 0 + tl.arange(0, BLOCK_N)[None, :] * 0\n");
    for line in bias.rows.lines() {
        let _ = writeln!(out, "    {line}");
    }
    if grads.is_some() {
        // the scores' base-2 log-sum-exp, less the query part they leave out
        let less = bias.query.as_ref().map_or(String::new(), |q| format!(" - {}", query_vector(q, true)));
        let _ = writeln!(out, "    lse = (lse{less}) * {}", super::dialect::float_lit(LOG2E));
    }
}

/// The loop over the key tiles the query tile may see: the bias over the tile (`tile`), the
/// scores, the online softmax's update, the values' product. No branch skips a closed tile
/// inside the loop: Triton pipelines the loads of a loop without one (a branch made an ALiBi
/// bias 2.6x slower on the H200).
fn write_key_loop(
    out: &mut String,
    ak: &AttentionKernel,
    keys: Option<[(String, &Operand); 2]>,
    pk: &str,
    pv: &str,
    tile: &str,
    grad: bool,
) {
    let [_, _, m, n, _] = ak.dims;
    let (start, end) = band_text(&ak.band, n);
    out.push_str("    m_first = pid_m * BLOCK_M\n    m_last = m_first + BLOCK_M - 1\n");
    let _ = writeln!(out, "    start = {start}\n    end = {end}");
    if let Some(keys) = keys {
        write_open_range(out, keys, "rm", [m, n], "key");
    }
    let _ = writeln!(out, "    rn = start + {}", ak.wide("tl.arange(0, BLOCK_N)"));
    let _ = writeln!(out, "    k_ptrs = {pk} + ({})", ak.k.at("rn[None, :]", "rd[:, None]"));
    let _ = writeln!(out, "    v_ptrs = {pv} + ({})", ak.v.at("rn[:, None]", "rd[None, :]"));
    out.push_str("    for n0 in range(start, end, BLOCK_N):\n");
    let _ = writeln!(out, "        rn = n0 + {}", ak.wide("tl.arange(0, BLOCK_N)"));
    let _ = writeln!(out, "        key_mask = rn[None, :] < {n}");
    out.push_str("        tile_mask = xmask & key_mask\n");
    for line in tile.lines() {
        let _ = writeln!(out, "        {line}");
    }
    // keys past the edge: -inf, and not read (a constexpr test: only where the keys do not fill
    // the tiles)
    let _ = writeln!(out, "        if {n} % BLOCK_N != 0:");
    let _ = writeln!(out, "            bias = tl.where(rn[None, :] < {n}, bias, float(\"-inf\"))");
    let _ = writeln!(out, "            kt = tl.load(k_ptrs, mask=rn[None, :] < {n}, other=0.0)");
    let _ = writeln!(out, "            vt = tl.load(v_ptrs, mask=rn[:, None] < {n}, other=0.0)");
    out.push_str("        else:\n            kt = tl.load(k_ptrs)\n            vt = tl.load(v_ptrs)\n");
    // (scores in base 2: one exp2 each, the scale and log2(e) one factor; the kernels compile
    // without FMA contraction, so the multiply-adds are written as such)
    let [dot, dot_acc] = ak.dots();
    let _ = writeln!(out, "        s = tl.fma({dot}(q, kt), {}, bias)", super::dialect::float_lit(ak.scale * LOG2E));
    if grad {
        // the probabilities again, from the forward's log-sum-exp; dS = P * (dP - delta)
        out.push_str("        p = ferro_exp2_ftz(s - lse[:, None])\n");
        let _ = writeln!(out, "        dp = {dot}(do, tl.trans(vt))");
        out.push_str("        ds = p * (dp - delta[:, None])\n");
        let _ = writeln!(out, "        dq = {dot_acc}(ds.to(kt.dtype), tl.trans(kt), dq)");
    } else {
        out.push_str("        m_new = tl.maximum(m_i, tl.max(s, 1))\n");
        // (a row with no open key yet keeps -inf: its terms are exp(-inf) = 0, not NaN)
        out.push_str("        m_use = tl.where(m_new == float(\"-inf\"), 0.0, m_new)\n");
        out.push_str("        p = ferro_exp2_ftz(s - m_use[:, None])\n        alpha = ferro_exp2_ftz(m_i - m_use)\n");
        out.push_str("        l_i = tl.fma(l_i, alpha, tl.sum(p, 1))\n");
        let _ = writeln!(out, "        acc = {dot_acc}(p.to(vt.dtype), vt, acc * alpha[:, None])\n        m_i = m_new");
    }
    let _ = writeln!(out, "        k_ptrs += BLOCK_N * {}", ak.k.stride[2]);
    let _ = writeln!(out, "        v_ptrs += BLOCK_N * {}", ak.v.stride[2]);
}

/// The keys' and values' gradient: each program holds a `BLOCK_M` tile of keys of one (batch,
/// head) and walks the queries that may see them, `BLOCK_N` at a time, with the transposed
/// scores recomputed from the forward's log-sum-exp: `dV += Pᵀ·dO`, `dK += (Pᵀ∘(dPᵀ - delta))·Q`.
fn write_grad_key_value(
    out: &mut String,
    ak: &AttentionKernel,
    ranges: Option<[(String, &Operand); 2]>,
    [pq, pk, pv]: [&str; 3],
    g: &GradPointers,
    bias: &BiasText,
) {
    let [_, _, n, m, _] = ak.dims;
    out.push_str("    # (BLOCK_M: the program's keys; BLOCK_N: the queries of one step)\n");
    write_program(out, ak, 'n');
    let _ = writeln!(out, "    kn = rn % {n}");
    let _ = writeln!(out, "    kk = tl.load({pk} + ({}))", ak.k.at("kn[:, None]", "rd[None, :]"));
    let _ = writeln!(out, "    vv = tl.load({pv} + ({}))", ak.v.at("kn[:, None]", "rd[None, :]"));
    out.push_str("    dk = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)\n");
    out.push_str("    dv = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)\n");
    let _ = writeln!(out, "    xmask = rn[:, None] < {n}");
    out.push_str("    xzero = rn[:, None] * 0 + tl.arange(0, BLOCK_N)[None, :] * 0\n");
    for line in bias.rows.lines() {
        let _ = writeln!(out, "    {line}");
    }
    out.push_str("    n_first = pid_n * BLOCK_M\n    n_last = n_first + BLOCK_M - 1\n");
    let (start, end) = query_band_text(&ak.band, m);
    let _ = writeln!(out, "    start = {start}\n    end = {end}");
    if let Some(queries) = ranges {
        write_open_range(out, queries, "rn", [n, m], "query");
    }
    let _ = writeln!(out, "    rm = start + {}", ak.wide("tl.arange(0, BLOCK_N)"));
    let _ = writeln!(out, "    q_ptrs = {pq} + ({})", ak.q.at("rm[None, :]", "rd[:, None]"));
    let _ = writeln!(out, "    do_ptrs = {} + ({})", g.grad_out, g.g.grad_out.at("rm[None, :]", "rd[:, None]"));
    out.push_str("    for m0 in range(start, end, BLOCK_N):\n");
    let _ = writeln!(out, "        rm = m0 + {}", ak.wide("tl.arange(0, BLOCK_N)"));
    let _ = writeln!(out, "        query_mask = rm[None, :] < {m}");
    out.push_str("        tile_mask = xmask & query_mask\n");
    for line in bias.tile.lines() {
        let _ = writeln!(out, "        {line}");
    }
    // queries past the edge: -inf, and not read (only where the queries do not fill the tiles)
    let _ = writeln!(out, "        if {m} % BLOCK_N != 0:");
    let _ = writeln!(out, "            bias = tl.where(rm[None, :] < {m}, bias, float(\"-inf\"))");
    let _ = writeln!(out, "            qt = tl.load(q_ptrs, mask=rm[None, :] < {m}, other=0.0)");
    let _ = writeln!(out, "            dot = tl.load(do_ptrs, mask=rm[None, :] < {m}, other=0.0)");
    g.write_rows(out, "            ", "rm", Some(&format!("rm < {m}")));
    out.push_str("        else:\n            qt = tl.load(q_ptrs)\n            dot = tl.load(do_ptrs)\n");
    g.write_rows(out, "            ", "rm", None);
    let less = bias.query.as_ref().map_or(String::new(), |q| format!(" - {}", query_vector(q, false)));
    let _ = writeln!(out, "        lse = (lse{less}) * {}", super::dialect::float_lit(LOG2E));
    let [dot, dot_acc] = ak.dots();
    let _ = writeln!(out, "        st = tl.fma({dot}(kk, qt), {}, bias)", super::dialect::float_lit(ak.scale * LOG2E));
    out.push_str("        pt = ferro_exp2_ftz(st - lse[None, :])\n");
    let _ = writeln!(out, "        dv = {dot_acc}(pt.to(qt.dtype), tl.trans(dot), dv)");
    let _ = writeln!(out, "        dpt = {dot}(vv, dot)");
    out.push_str("        dst = pt * (dpt - delta[None, :])\n");
    let _ = writeln!(out, "        dk = {dot_acc}(dst.to(qt.dtype), tl.trans(qt), dk)");
    let _ = writeln!(out, "        q_ptrs += BLOCK_N * {}", ak.q.stride[2]);
    let _ = writeln!(out, "        do_ptrs += BLOCK_N * {}", g.g.grad_out.stride[2]);
    let _ = writeln!(out, "    dk = dk * {}", super::dialect::float_lit(ak.scale));
}

/// `start` and `end` narrowed to the columns the program's rows (`row`, `[rows, cols]`) leave
/// open: from the first row's first open column (`ranges`, tile-aligned) to the last row's
/// last (the names bound are `{what}_first` and `{what}_last`).
fn write_open_range(out: &mut String, [(pf, first), (pl, last)]: [(String, &Operand); 2], row: &str, [rows, cols]: [i64; 2], what: &str) {
    let _ = writeln!(out, "    {what}_first = tl.min(tl.load({pf} + ({}), mask={row} < {rows}, other={cols}), 0)", first.at(row, "0"));
    let _ = writeln!(out, "    {what}_last = tl.max(tl.load({pl} + ({}), mask={row} < {rows}, other=-1), 0)", last.at(row, "0"));
    let _ = writeln!(out, "    start = tl.maximum(start, ({what}_first // BLOCK_N) * BLOCK_N)");
    let _ = writeln!(out, "    end = tl.minimum(end, {what}_last + 1)");
}

/// The first query tile (aligned) and the end of the queries a tile of keys (`n_first` to
/// `n_last`) is seen by, from the band's bounds of slope 1 (`key <= query + c`: from the first
/// key's `- c`; `key >= query + c`: to the last key's `- c`).
fn query_band_text(band: &[Bound], m: i64) -> (String, String) {
    let (mut start, mut end) = ("0".to_string(), m.to_string());
    for b in band.iter().filter(|b| b.slope == 1) {
        if b.lower {
            end = format!("tl.minimum({end}, n_last - ({}) + 1)", b.offset);
        } else {
            start = format!("tl.maximum({start}, n_first - ({}))", b.offset);
        }
    }
    if start != "0" {
        start = format!("(({start}) // BLOCK_N) * BLOCK_N");
    }
    (start, end)
}

/// The bias's code: what reads the program's rows alone (before the loop, where `xmask` is
/// `[BLOCK_M, 1]`), and the rest over a tile (`tile_mask`), binding `bias` (base 2); and the
/// name of the query part taken out of the scores (natural units), where one is.
struct BiasText {
    rows: String,
    tile: String,
    query: Option<String>,
}

/// The bias over the tile through the kernel writer.
fn bias_text(s: &Schedule, k: &FusedKernel, params: &Params, ak: &AttentionKernel) -> Result<BiasText, CodegenError> {
    // (the program's rows and the loop's columns: queries and keys, or keys and queries)
    let keys_major = matches!(ak.pass, AttentionPass::GradKeyValue(_));
    let (row, col, col_mask, first) = if keys_major {
        ("rn[:, None]", "rm[None, :]", "query_mask", "(pid_n * BLOCK_M)")
    } else {
        ("rm[:, None]", "rn[None, :]", "key_mask", "(pid_m * BLOCK_M)")
    };
    let var_name = |v: Var| match v.0 {
        0 => row.to_string(),
        1 => "off_b".to_string(),
        2 => "off_h".to_string(),
        3 => col.to_string(),
        _ => first.to_string(),
    };
    let mut dialect = super::template_group(s, params, &var_name, true, "tile_mask");
    dialect.row_free_mask = Some((Var(0), col_mask.into()));
    let [b, h, m, n, _] = ak.dims;
    let mut tmp = 0usize;
    let values: Vec<ValueId> = [Some(ak.bias.scores), ak.bias.query].into_iter().flatten().collect();
    // (the rows, batch, head and first row are fixed before the loop)
    let outer = 0b10111;
    let (text, names) = write_values(&mut dialect, &ak.bias.body, &values, &[m, b, h, n, m], outer, &mut tmp)
        .map_err(|why| CodegenError::unsupported(&k.name, why))?;
    Ok(BiasText {
        rows: format!("{}{}", text.kernel, text.pre),
        tile: format!("{}{}bias = {}\n", text.inner, text.post, names[0]),
        query: names.get(1).cloned(),
    })
}

/// The query part's sum over the kernel's `[BLOCK_M, 1]` rows or `[1, BLOCK_N]` columns, as a
/// vector along them (the writer may give a uniform value as `[1, 1]`).
fn query_vector(name: &str, along_rows: bool) -> String {
    let (shape, axis) = if along_rows { ("[BLOCK_M, 1]", 1) } else { ("[1, BLOCK_N]", 0) };
    format!("tl.sum({name} + tl.zeros({shape}, tl.float32), {axis})")
}

/// The first key tile (aligned) and the end of the keys a query tile (rows `m_first` to
/// `m_last`) visits.
fn band_text(band: &[Bound], n: i64) -> (String, String) {
    let at = |b: &Bound, m: &str| format!("{} * {m} + {}", b.slope, b.offset);
    let (mut start, mut end) = ("0".to_string(), n.to_string());
    for b in band {
        // the bound over the tile's rows: its loosest end (the bound is linear in the row)
        if b.lower {
            start = format!("tl.maximum({start}, tl.minimum({}, {}))", at(b, "m_first"), at(b, "m_last"));
        } else {
            end = format!("tl.minimum({end}, tl.maximum({}, {}) + 1)", at(b, "m_first"), at(b, "m_last"));
        }
    }
    if start != "0" {
        start = format!("(({start}) // BLOCK_N) * BLOCK_N");
    }
    (start, end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::attention::key_band;
    use crate::symbolic::IndexExpr;

    /// `where(cond, 0, -inf)` over (m, b, h, n) as the attention pass writes a mask, its index
    /// arithmetic narrowed as the kernel computes it.
    fn mask_body(cond: impl Fn(&mut LoopBody, ValueId, ValueId) -> ValueId) -> LoopBody {
        let mut body = LoopBody::default();
        let m = body.index(IndexExpr::var(Var(0)), DType::I64);
        let n = body.index(IndexExpr::var(Var(3)), DType::I64);
        let c = cond(&mut body, m, n);
        let zero = body.constant(Scalar::Float(0.0), DType::F32);
        let closed = body.constant(Scalar::Float(f64::NEG_INFINITY), DType::F32);
        let bias = body.where_(c, zero, closed);
        body.set_store(IndexExpr::zero(), bias);
        body.with_narrow_index_arithmetic(&[1024, 2, 4, 1024])
    }

    #[test]
    fn a_sliding_window_is_a_band_of_keys() {
        // (n <= m) & (m - n < 256)
        let body = mask_body(|b, m, n| {
            let causal = b.binary(BinaryOp::Le, n, m);
            let distance = b.binary(BinaryOp::Sub, m, n);
            let window = b.constant(Scalar::Int(256), DType::I64);
            let near = b.binary(BinaryOp::Lt, distance, window);
            b.binary(BinaryOp::BitAnd, causal, near)
        });
        let band = key_band(&body);
        assert_eq!(band, [Bound { lower: false, slope: 1, offset: 0 }, Bound { lower: true, slope: 1, offset: -255 }]);
        let (start, end) = band_text(&band, 1024);
        assert_eq!(start, "((tl.maximum(0, tl.minimum(1 * m_first + -255, 1 * m_last + -255))) // BLOCK_N) * BLOCK_N");
        assert_eq!(end, "tl.minimum(1024, tl.maximum(1 * m_first + 0, 1 * m_last + 0) + 1)");
    }

    #[test]
    fn a_mask_filled_where_it_fails_is_read_through_its_negation() {
        // masked_fill(~(n <= m), -inf): where(not c, -inf, 0)
        let mut body = LoopBody::default();
        let m = body.index(IndexExpr::var(Var(0)), DType::I64);
        let n = body.index(IndexExpr::var(Var(3)), DType::I64);
        let c = body.binary(BinaryOp::Le, n, m);
        let not = body.unary(UnaryOp::LogicalNot, c);
        let zero = body.constant(Scalar::Float(0.0), DType::F32);
        let closed = body.constant(Scalar::Float(f64::NEG_INFINITY), DType::F32);
        let bias = body.where_(not, closed, zero);
        body.set_store(IndexExpr::zero(), bias);
        assert_eq!(key_band(&body), [Bound { lower: false, slope: 1, offset: 0 }]);
    }

    #[test]
    fn a_mask_with_an_unknown_part_proves_only_what_it_knows() {
        // (n <= m) | (n == 0): a disjunction proves nothing; a mask of another variable neither
        let body = mask_body(|b, m, n| {
            let causal = b.binary(BinaryOp::Le, n, m);
            let zero = b.constant(Scalar::Int(0), DType::I64);
            let first = b.binary(BinaryOp::Eq, n, zero);
            b.binary(BinaryOp::BitOr, causal, first)
        });
        assert_eq!(key_band(&body), []);
        let body = mask_body(|b, _, n| {
            let head = b.index(IndexExpr::var(Var(2)), DType::I64);
            b.binary(BinaryOp::Le, n, head)
        });
        assert_eq!(key_band(&body), []);
    }
}
