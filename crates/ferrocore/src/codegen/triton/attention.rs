//! Fused attention (`Template::Attention`) as a Triton kernel in the manner of flash attention:
//! each program holds a `BLOCK_M`-row tile of queries of one (batch, head) and walks the keys
//! `BLOCK_N` at a time, with a running maximum and sum per row (the online softmax) and float32
//! accumulators. The bias is the node's own body written by the kernel writer over the tile
//! (`b`, `h`, the rows `rm[:, None]`, the keys `rn[None, :]`): a mask or score modification is
//! computed where it is used and never stored. Under a causal mask the key loop ends at the
//! diagonal.

use super::dialect::TritonGroup;
use super::{CodegenError, KernelLaunch, Params, IDX32_LIMIT};
use crate::codegen::writer::write_value;
use crate::codegen::{Tile, TuneConfig};
use crate::graph::DType;
use crate::loop_ir::*;
use crate::scheduler::{FusedKernel, Schedule};
use crate::symbolic::{Atom, IndexExpr, Var};
use std::collections::HashSet;
use std::fmt::Write;

/// The kernel's attention node, when it is one.
pub(super) fn attention_of<'s>(s: &'s Schedule, k: &FusedKernel) -> Option<(&'s LoopNode, &'s Attention)> {
    let node = &s.program.nodes[k.plan.nodes.first()?.node];
    node.attention().map(|a| (node, a))
}

/// One operand's addressing: `offset + b·batch + h·heads + row·rows + d·cols`.
struct Operand {
    buf: BufferId,
    offset: i64,
    stride: [i64; 4],
}

/// What the kernel is written from, read off the node.
pub(super) struct AttentionKernel {
    /// B, H, M (query rows), N (keys), D (head dim)
    dims: [i64; 5],
    q: Operand,
    k: Operand,
    v: Operand,
    out: Operand,
    dtype: DType,
    scale: f64,
    /// The bias alone (the node's exprs up to it, its value stored) over variables (m, b, h, n):
    /// the writer computes what reads the rows alone (`Section::Pre`: a query's document id)
    /// once, before the key loop.
    bias: LoopBody,
    /// No key past the query's own is open: the loop stops at the diagonal.
    causal: bool,
    idx64: bool,
}

impl AttentionKernel {
    pub(super) fn of(s: &Schedule, k: &FusedKernel, params: &Params) -> Result<AttentionKernel, CodegenError> {
        let p = &s.program;
        let (node, a) = attention_of(s, k).ok_or_else(|| CodegenError::internal(&k.name, "not an attention"))?;
        let bad = |m: &str| CodegenError::internal(&k.name, format!("attention {}: {m}", p.buffer(node.output).name));
        let (&[b, h, m, d], &[n]) = (&node.ranges[..], &node.reduction_ranges[..]) else { return Err(bad("not [B, H, M, D] by N")) };
        let operand = |value: ValueId, row: u32| -> Result<Operand, CodegenError> {
            let Expr::Load { buf, index } = &node.body.exprs[value.0 as usize] else { return Err(bad("an operand is not a load")) };
            if index.terms.iter().any(|(a, _)| !matches!(a, Atom::Var(_))) {
                return Err(bad("an operand is not strided"));
            }
            let c = |v: u32| index.affine_coeff(Var(v)).unwrap_or(0);
            Ok(Operand { buf: *buf, offset: index.constant, stride: [c(0), c(1), c(row), c(3)] })
        };
        let out_layout = &p.buffer(node.output).layout;
        let store = node.body.store.as_ref().ok_or_else(|| bad("no store"))?;
        let out = Operand {
            buf: node.output,
            offset: store.index.constant,
            stride: [0, 1, 2, 3].map(|v| store.index.affine_coeff(Var(v)).unwrap_or(0)),
        };
        let mut bias = node.body.clone();
        let keep = a.bias.0 as usize + 1;
        bias.exprs.truncate(keep);
        bias.dtypes.truncate(keep);
        bias.set_store(IndexExpr::zero(), a.bias);
        // node variables (b, h, m, d, n) as (1, 2, 0, -, 3)
        let subst: Vec<Option<IndexExpr>> =
            [Some(1), Some(2), Some(0), None, Some(3)].iter().map(|v| v.map(|i| IndexExpr::var(Var(i)))).collect();
        let ranges = [m, b, h, n];
        let bias = bias.rewrite_indices(&|e: &IndexExpr| e.substitute(&subst, &ranges));
        let mut idx64 = b * h * m * n.max(d) >= IDX32_LIMIT;
        for buf in params.read.iter().chain(&params.written) {
            idx64 |= p.buffer(*buf).layout.storage_numel() >= IDX32_LIMIT;
        }
        Ok(AttentionKernel {
            causal: a.causal,
            dims: [b, h, m, n, d],
            q: operand(a.q, 2)?,
            k: operand(a.k, 4)?,
            v: operand(a.v, 4)?,
            out,
            dtype: out_layout.dtype,
            scale: a.scale,
            bias,
            idx64,
        })
    }

    /// The tiles the kernel launches with (the first) and an autotuner's candidates:
    /// (BLOCK_M, BLOCK_N, warps, stages).
    fn configs(&self) -> Vec<TuneConfig> {
        let [b, h, m, n, d] = self.dims;
        // (the head dim sets the register load: 8 warps for 128-wide heads)
        let shapes: &[(i64, i64, u32, u32)] = if d > 64 {
            &[(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 2)]
        } else {
            &[(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)]
        };
        let fit = |block: i64, size: i64| block.min(super::next_power_of_two(size).max(16));
        let mut out: Vec<TuneConfig> = Vec::new();
        for &(bm, bn, warps, stages) in shapes {
            let tile = Tile { m: fit(bm, m), n: fit(bn, n), k: d };
            let grid = b * h * cdiv(m, tile.m);
            let c = TuneConfig { grid, xblock: 0, num_warps: warps, num_stages: stages, tile: Some(tile) };
            if !out.contains(&c) {
                out.push(c);
            }
        }
        out
    }
}

fn cdiv(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// The kernel's launch: the first configuration, the others as the autotuner's candidates.
pub(super) fn launch(s: &Schedule, k: &FusedKernel, params: &Params, ak: &AttentionKernel) -> KernelLaunch {
    super::template::tiled_launch(s, k, params, ak.configs())
}

/// The kernel's definition.
pub(super) fn write(s: &Schedule, k: &FusedKernel, params: &Params, ak: &AttentionKernel) -> Result<String, CodegenError> {
    let ptr = |o: &Operand| params.ptr.get(&o.buf).cloned().ok_or_else(|| CodegenError::internal(&k.name, "an operand without a pointer"));
    let (pq, pk, pv, po) = (ptr(&ak.q)?, ptr(&ak.k)?, ptr(&ak.v)?, ptr(&ak.out)?);
    let [_, h, m, n, d] = ak.dims;
    let wide = |e: &str| if ak.idx64 { format!("{e}.to(tl.int64)") } else { e.to_string() };
    let at = |o: &Operand, row: &str, col: &str| {
        let [sb, sh, sr, sc] = o.stride;
        format!("{} + off_b * {sb} + off_h * {sh} + {row} * {sr} + {col} * {sc}", o.offset)
    };
    let mut all = params.names.clone();
    all.extend(["BLOCK_M: tl.constexpr".into(), "BLOCK_N: tl.constexpr".into(), "BLOCK_K: tl.constexpr".into()]);
    let mut out = String::new();
    let _ = writeln!(out, "@ferro_jit\ndef {}({}):", k.name, all.join(", "));
    let _ = writeln!(out, "    pid = {}", wide("tl.program_id(0)"));
    let _ = writeln!(out, "    tiles_m = ({m} + BLOCK_M - 1) // BLOCK_M");
    out.push_str("    pid_m = pid % tiles_m\n    off_bh = pid // tiles_m\n");
    let _ = writeln!(out, "    off_b = off_bh // {h}\n    off_h = off_bh % {h}");
    let _ = writeln!(out, "    rm = pid_m * BLOCK_M + {}", wide("tl.arange(0, BLOCK_M)"));
    let _ = writeln!(out, "    rd = {}", wide("tl.arange(0, BLOCK_K)"));
    // rows past the edge read the first ones again (their results are not stored)
    let _ = writeln!(out, "    qm = rm % {m}");
    let _ = writeln!(out, "    q = tl.load({pq} + ({}))", at(&ak.q, "qm[:, None]", "rd[None, :]"));
    out.push_str("    m_i = tl.full([BLOCK_M], float(\"-inf\"), tl.float32)\n");
    out.push_str("    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)\n");
    out.push_str("    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)\n");
    let bias = bias_text(s, k, params, ak)?;
    let _ = writeln!(out, "    xmask = rm[:, None] < {m}");
    // (one shape for the whole kernel: Triton keeps a loop-carried name's type)
    out.push_str("    xzero = rm[:, None] * 0 + tl.arange(0, BLOCK_N)[None, :] * 0\n");
    for line in bias.rows.lines() {
        let _ = writeln!(out, "    {line}");
    }
    // (no branch skips a closed tile: Triton pipelines the loads of a loop without one, which
    // ran an ALiBi bias 2.6x as fast on the H200 as skipping did; the causal loop stops early)
    let end = if ak.causal { format!("tl.minimum({n}, (pid_m + 1) * BLOCK_M)") } else { n.to_string() };
    let _ = writeln!(out, "    for n0 in range(0, {end}, BLOCK_N):");
    let _ = writeln!(out, "        rn = n0 + {}", wide("tl.arange(0, BLOCK_N)"));
    let _ = writeln!(out, "        tile_mask = xmask & (rn[None, :] < {n})");
    for line in bias.tile.lines() {
        let _ = writeln!(out, "        {line}");
    }
    // (keys past the edge are -inf)
    out.push_str("        bias = tl.where(tile_mask, bias + tl.zeros([BLOCK_M, BLOCK_N], tl.float32), float(\"-inf\"))\n");
    let pad = "        ";
    let _ = writeln!(out, "{pad}kn = rn % {n}");
    let _ = writeln!(out, "{pad}kt = tl.load({pk} + ({}))", at(&ak.k, "kn[None, :]", "rd[:, None]"));
    let _ = writeln!(out, "{pad}s = ferro_dot(q, kt) * {} + bias", super::dialect::float_lit(ak.scale));
    let _ = writeln!(out, "{pad}m_new = tl.maximum(m_i, tl.max(s, 1))");
    // (a row with no open key yet keeps -inf: its terms are exp(-inf) = 0, not NaN)
    let _ = writeln!(out, "{pad}m_use = tl.where(m_new == float(\"-inf\"), 0.0, m_new)");
    let _ = writeln!(out, "{pad}p = tl.exp(s - m_use[:, None])");
    let _ = writeln!(out, "{pad}alpha = tl.exp(m_i - m_use)");
    let _ = writeln!(out, "{pad}l_i = l_i * alpha + tl.sum(p, 1)");
    let _ = writeln!(out, "{pad}vt = tl.load({pv} + ({}))", at(&ak.v, "kn[:, None]", "rd[None, :]"));
    let _ = writeln!(out, "{pad}acc = acc * alpha[:, None] + ferro_dot(p.to(vt.dtype), vt)");
    let _ = writeln!(out, "{pad}m_i = m_new");
    // a row whose keys are all closed gives 0 (the safe softmax's answer)
    out.push_str("    result = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)\n");
    let _ = writeln!(
        out,
        "    tl.store({po} + ({}), {}, mask=rm[:, None] < {m})",
        at(&ak.out, "rm[:, None]", "rd[None, :]"),
        store_value(ak.dtype)
    );
    let _ = d;
    Ok(out)
}

fn store_value(dt: DType) -> String {
    super::dialect::store_conv("result", dt)
}

/// The bias's code: what reads the query rows alone (before the key loop, where `xmask` is
/// `[BLOCK_M, 1]`), and the rest over a tile of keys (`tile_mask`), binding `bias`.
struct BiasText {
    rows: String,
    tile: String,
}

/// The bias over the tile through the kernel writer.
fn bias_text(s: &Schedule, k: &FusedKernel, params: &Params, ak: &AttentionKernel) -> Result<BiasText, CodegenError> {
    let var_name = |v: Var| match v.0 {
        0 => "rm[:, None]".to_string(),
        1 => "off_b".to_string(),
        2 => "off_h".to_string(),
        _ => "rn[None, :]".to_string(),
    };
    let mut dialect = TritonGroup {
        storage: &s.storage,
        ptr: &params.ptr,
        var_name: &var_name,
        two_d: true,
        looped: false,
        terms_per_lane: 1,
        rblock: 1,
        full_mask: "tile_mask".into(),
        err_ptr: params.checks_indices.then_some("err_ptr"),
        empty: HashSet::new(),
        accs: Vec::new(),
    };
    let [b, h, m, n, _] = ak.dims;
    let mut tmp = 0usize;
    let (text, value) =
        write_value(&mut dialect, &ak.bias, &[m, b, h, n], &mut tmp).map_err(|why| CodegenError::unsupported(&k.name, why))?;
    Ok(BiasText { rows: format!("{}{}", text.kernel, text.pre), tile: format!("{}{}bias = {value}\n", text.inner, text.post) })
}
