//! `causal_mask`: a fused attention call whose mask the graph builds from positions alone
//! (Hugging Face decoders build `where(position[key] <= position[query] & same sequence, 0,
//! min)` in every compiled forward) takes `is_causal` instead of reading the mask: the kernel
//! skips the blocks above the diagonal and reads no bias. A mask that keeps every key is
//! dropped.
//!
//! What it keeps exact: the mask must keep, for query `i`, exactly the keys `j <= i` (read by
//! `affine` from the graph, not assumed), over square scores, so no row is closed entirely; a
//! finite fill must be at most `-MIN_FILL`, where a closed key's weight underflows to the same
//! 0 as the kernel's unless a row's scaled scores span more than that.

use super::affine::{causal_offset, Form, Forms};
use super::*;

/// The least magnitude of a finite fill taken as closing a key (exp(-10^4) underflows in
/// float32 by far; Hugging Face fills with the dtype's least value).
const MIN_FILL: f64 = 1e4;

/// The fused attention calls the pass rewrites, and where their mask and `is_causal` go.
fn mask_slots(op: AtenOp) -> Option<(usize, &'static str, usize)> {
    match op {
        AtenOp::CudnnAttention => Some((3, "attn_bias", 6)),
        AtenOp::EfficientAttention => Some((3, "attn_bias", 6)),
        AtenOp::FlashAttentionCpu => Some((5, "attn_mask", 4)),
        _ => None,
    }
}

/// What a mask is, as far as the pass can prove.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MaskKind {
    /// Every key open.
    Open,
    /// Query `i` sees keys `j <= i`.
    Causal,
}

struct Reader<'g> {
    g: &'g Graph,
    forms: Forms<'g>,
}

fn last_two(g: &Graph, id: NodeId) -> Option<[i64; 2]> {
    let s = &g.node(id).meta.tensor()?.shape;
    (s.len() >= 2).then(|| [s[s.len() - 2], s[s.len() - 1]])
}

/// The value of a scalar-valued node (`scalar_tensor`, `full`), through casts and broadcasts.
fn scalar_value(g: &Graph, id: NodeId) -> Option<f64> {
    let (op, args, _) = call(g, id)?;
    let value = |a: Option<&Arg>| match a {
        Some(Arg::Float(x)) => Some(*x),
        Some(Arg::Int(i)) => Some(*i as f64),
        _ => None,
    };
    match op {
        AtenOp::ScalarTensor => value(args.first()),
        AtenOp::Full | AtenOp::FullLike => value(args.get(1)),
        AtenOp::ToCopy | AtenOp::Expand | AtenOp::Unsqueeze | AtenOp::View | AtenOp::Clone => match args.first() {
            Some(Arg::Node(n)) => scalar_value(g, *n),
            _ => None,
        },
        _ => None,
    }
}

impl Reader<'_> {
    /// The mask argument traced through views that keep each `(query, key)` element where it is
    /// (broadcasts, casts, copies, views that keep the last two dims) to a boolean mask and
    /// whether it marks the keys kept; None when the mask is built otherwise.
    fn condition(&mut self, bias: NodeId, scores: [i64; 2]) -> Option<(NodeId, bool)> {
        let g = self.g;
        let mut cur = bias;
        for _ in 0..16 {
            if last_two(g, cur)? != scores {
                return None;
            }
            let t = g.node(cur).meta.tensor()?;
            if t.dtype == DType::Bool {
                // a boolean mask keeps the keys where it is true
                return Some((cur, true));
            }
            let (op, args, _) = call(g, cur)?;
            let Some(Arg::Node(first)) = args.first() else { return None };
            match op {
                AtenOp::Expand | AtenOp::ToCopy | AtenOp::Clone | AtenOp::Alias | AtenOp::View | AtenOp::UnsafeView | AtenOp::Reshape => {
                    cur = *first
                }
                AtenOp::Unsqueeze => cur = *first,
                AtenOp::WhereSelf => {
                    let (Some(Arg::Node(a)), Some(Arg::Node(b))) = (args.get(1), args.get(2)) else { return None };
                    let closes = |v: f64| v == f64::NEG_INFINITY || v <= -MIN_FILL;
                    return match (scalar_value(g, *a), scalar_value(g, *b)) {
                        (Some(x), Some(y)) if x == 0.0 && closes(y) => Some((*first, true)),
                        (Some(x), Some(y)) if y == 0.0 && closes(x) => Some((*first, false)),
                        _ => None,
                    };
                }
                _ => return None,
            }
        }
        None
    }

    fn kind(&mut self, bias: NodeId, scores: [i64; 2]) -> Result<MaskKind, String> {
        let name = &self.g.node(bias).name;
        if scalar_value(self.g, bias) == Some(0.0) {
            return Ok(MaskKind::Open);
        }
        let (cond, keeps) = self.condition(bias, scores).ok_or_else(|| format!("mask {name} is not `where(cond, 0, -inf or min)`"))?;
        let form = self.forms.of(cond).ok_or_else(|| format!("mask {name}: its condition is not built from positions alone"))?;
        let form = match (form, keeps) {
            (f, true) => f,
            (Form::Bool(b), false) => Form::Bool(!b),
            (f, false) => f.negated().ok_or_else(|| format!("mask {name}: an integer condition"))?,
        };
        match form {
            Form::Bool(true) => Ok(MaskKind::Open),
            Form::Bool(false) => Err(format!("mask {name} closes every key")),
            f => match causal_offset(&f) {
                Some(0) if scores[0] == scores[1] => Ok(MaskKind::Causal),
                Some(0) => Err(format!("mask {name}: causal over {}x{} scores (not square)", scores[0], scores[1])),
                Some(k) => Err(format!("mask {name}: causal with diagonal offset {k}")),
                None => Err(format!("mask {name}: not causal")),
            },
        }
    }
}

/// What the mask a graph returns (its one output) is to scores of `scores` (queries, keys):
/// open, causal, or, as the error, why neither is proven. The front asks this while it traces a
/// training graph (`python/ferrocore/traced_attention.py`): the backward is traced from the
/// forward's ops, so a mask dropped after the trace would stay in the backward.
pub fn mask_kind(g: &Graph, scores: [i64; 2]) -> Result<MaskKind, String> {
    let [Arg::Node(mask)] = g.outputs.as_slice() else {
        return Err(format!("the mask graph has {} outputs, not one tensor", g.outputs.len()));
    };
    Reader { g, forms: Forms::new(g) }.kind(*mask, scores)
}

/// The graph with every fused attention call whose mask is causal or open calling the kernel
/// without it; a line per call with a mask.
pub fn use_causal_kernels(g: Graph, _options: &PassOptions) -> (Graph, Vec<String>) {
    let mut reader = Reader { g: &g, forms: Forms::new(&g) };
    let mut edit = GraphEdit::new(&g);
    let mut decisions = Vec::new();
    for id in g.ids() {
        let Some((op, args, kwargs)) = call(&g, id) else { continue };
        let Some((mask_pos, mask_key, causal_pos)) = mask_slots(op) else { continue };
        let node = g.node(id);
        let Some(Arg::Node(bias)) = node.arg(mask_pos, mask_key) else { continue };
        if matches!(node.arg(causal_pos, "is_causal"), Some(Arg::Bool(true))) {
            continue;
        }
        let (Some(Arg::Node(q)), Some(Arg::Node(k))) = (args.first(), args.get(1)) else { continue };
        let (Some([m, _]), Some([n, _])) = (last_two(&g, *q), last_two(&g, *k)) else { continue };
        let kind = match reader.kind(*bias, [m, n]) {
            Ok(kind) => kind,
            Err(why) => {
                decisions.push(format!("{} {}: kept: {why}", op.name(), node.name));
                continue;
            }
        };
        // the call again, without the mask (and causal where it was)
        let causal = matches!(kind, MaskKind::Causal);
        let mut new_args = args.to_vec();
        let mut new_kwargs: Vec<(String, Arg)> = kwargs.iter().filter(|(key, _)| key != mask_key && key != "is_causal").cloned().collect();
        if mask_pos < new_args.len() {
            new_args[mask_pos] = Arg::None;
        }
        if causal_pos < new_args.len() {
            new_args[causal_pos] = Arg::Bool(causal);
        } else {
            new_kwargs.push(("is_causal".into(), Arg::Bool(causal)));
        }
        let first = edit.mark();
        let new = Node {
            name: node.name.clone() + "_causal",
            kind: NodeKind::Call { target: Target::Aten(op), args: new_args, kwargs: new_kwargs },
            meta: node.meta.clone(),
        };
        let by = edit.push(&g, id, new);
        edit.replace(id, first, by, []);
        let what = if causal { "is_causal" } else { "no mask (every key open)" };
        decisions.push(format!("{} {}: {what} instead of mask {}", op.name(), node.name, g.node(*bias).name));
    }
    edit.finish(g, decisions)
}
