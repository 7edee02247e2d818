//! One-pass variances (for a backend that asks): lowering computes a variance in two passes, a
//! mean node `Σx / n` and a second node `Σ(x - mean)² / d` that reads the mean. Where a row is
//! too long to stay in registers, that second node reads `x` again after the first finished.
//! This pass rewrites it to `WelfordM2(x - x₀) / d` (Welford's running mean and M2): it no
//! longer reads the mean, so both nodes fuse into one loop over `x`. `x₀` is the row's first
//! element (M2 does not move when every term is shifted): in float32, a running mean near 1000
//! kept only 7 digits of a variance near 1 (32x eager's error over 10^7 elements).

use super::split::{outer_reduction_itemsize, SplitConfig};
use super::variance::one_pass_form;
use crate::loop_ir::*;

/// Rewrites every variance's second pass over more than `min_len` elements, except those the
/// split pass will split (it takes their chunks' Welford M2s and sums itself). One decision each.
pub fn welford_variances(p: &mut LoopProgram, min_len: i64, split: Option<&SplitConfig>) -> Vec<String> {
    let mut decisions = Vec::new();
    for n in 0..p.nodes.len() {
        let node = &p.nodes[n];
        let len: i64 = node.reduction_ranges.iter().product();
        if !takes_one_pass(node, min_len, split) {
            continue;
        }
        let Some((mean_buf, _, body, _)) = one_pass_form(p, n) else { continue };
        decisions.push(format!(
            "welford: {} takes its variance in one pass over {len} elements (no longer reads {})",
            p.buffer(p.nodes[n].output).name,
            p.buffer(mean_buf).name
        ));
        p.nodes[n].body = body;
    }
    decisions
}

/// Whether `node`, if a variance's second pass, is rewritten by the `welford` pass: its row is
/// longer than `min_len` and the split pass (`split`) leaves it whole.
fn takes_one_pass(node: &LoopNode, min_len: i64, split: Option<&SplitConfig>) -> bool {
    let len: i64 = node.reduction_ranges.iter().product();
    let rows: i64 = node.ranges.iter().product();
    len > min_len && split.is_none_or(|c| c.splits(rows, len, outer_reduction_itemsize(node)).is_none())
}
