//! Split reductions (GPU): a reduction with few outputs and a long reduction runs as one program
//! per output row, which leaves most of a GPU idle (a full `x.sum()` over 64M elements would be
//! one program looping 64M times). Such a node becomes two: a first stage reducing `S` chunks of
//! the reduction per output into a partial buffer `[outputs..., S]`, and a second stage combining
//! the `S` partials (and applying the original epilogue, e.g. a mean's division).

use crate::graph::DType;
use crate::loop_ir::*;
use crate::symbolic::{IndexExpr, Var};

/// When to split, in programs: fewer output rows than `min_rows` is too few to fill the device,
/// and the first stage aims for about `target_programs` programs of at least `min_chunk` elements.
#[derive(Clone, Copy, Debug)]
pub struct SplitConfig {
    pub min_rows: i64,
    pub target_programs: i64,
    pub min_chunk: i64,
}

/// For a GPU with about 132 streaming multiprocessors (H100): below two rows per SM the
/// reduction is split, into about 1024 first-stage programs of at least 2048 elements each.
pub const GPU_SPLIT: SplitConfig = SplitConfig { min_rows: 256, target_programs: 1024, min_chunk: 2048 };

/// Splits every reduction node that `config` says is too narrow. Returns one decision per node.
pub fn split_reductions(p: &mut LoopProgram, config: &SplitConfig) -> Vec<String> {
    let mut decisions = Vec::new();
    let steps = p.steps.clone();
    let mut new_steps = Vec::with_capacity(steps.len());
    for step in steps {
        if let Step::Node(n) = step {
            if let Some((first, second, splits)) = plan_split(p, n, config) {
                let (output, ranges, origins) = (p.nodes[n].output, p.nodes[n].ranges.clone(), p.nodes[n].origins.clone());
                let total: i64 = p.nodes[n].reduction_ranges.iter().product();
                let dtype = first.body.dtype(first.body.store.as_ref().map_or(ValueId(0), |s| s.value));
                let mut part_size = ranges.clone();
                part_size.push(splits);
                let device = p.buffer(output).layout.device.clone();
                let partial = p.add_buffer(Layout::contiguous(&part_size, dtype, device), BufferSource::Computed);
                decisions.push(format!(
                    "split: {} reduces {total} elements into {} rows: {splits} partial reductions each ({}), then a combine",
                    p.buffer(output).name,
                    ranges.iter().product::<i64>(),
                    p.buffer(partial).name
                ));
                p.nodes.push(LoopNode { output: partial, origins: origins.clone(), ..first });
                new_steps.push(Step::Node(p.nodes.len() - 1));
                p.nodes[n] = LoopNode { output, ranges, reduction_ranges: vec![splits], body: second(partial), origins };
            }
        }
        new_steps.push(step);
    }
    p.steps = new_steps;
    decisions
}

type SecondStage = Box<dyn FnOnce(BufferId) -> LoopBody>;

/// (first stage without its output buffer, a builder of the second stage's body given the
/// partial buffer, the number of splits), or None when the node is not worth or not able to split.
fn plan_split(p: &LoopProgram, n: usize, config: &SplitConfig) -> Option<(LoopNode, SecondStage, i64)> {
    let node = &p.nodes[n];
    let body = &node.body;
    let store = body.store.as_ref()?;
    if store.is_scatter() || node.reduction_ranges.is_empty() {
        return None;
    }
    // exactly one reduction, nothing that reports or scans
    let mut reduce = None;
    for (i, e) in body.exprs.iter().enumerate() {
        match e {
            Expr::Reduce(op, x) if reduce.is_none() && !matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin | ReduceOp::WelfordM2) => {
                reduce = Some((ValueId(i as u32), *op, *x))
            }
            Expr::Reduce(..) | Expr::ArgReduce(..) | Expr::Scan(..) | Expr::CheckIndex { .. } => return None,
            _ => {}
        }
    }
    let (rid, op, operand) = reduce?;
    let rows: i64 = node.ranges.iter().product();
    let total: i64 = node.reduction_ranges.iter().product();
    if rows <= 0 || rows >= config.min_rows || total < 2 * config.min_chunk {
        return None;
    }
    let want = (config.target_programs / rows).min(total / config.min_chunk);
    if want < 2 {
        return None;
    }
    // an exact divisor near the wish needs no mask; else the last chunk is masked
    let splits = (want / 2..=want).rev().find(|s| *s >= 2 && total % s == 0).unwrap_or(want);
    let chunk = (total + splits - 1) / splits;
    let masked = chunk * splits != total;

    // Second stage: what the store needs after the reduction, over kept variables only.
    let nk = node.ranges.len();
    let live = body.live_from(store.value, &|v| (v == rid).then(Vec::new));
    for (i, e) in body.exprs.iter().enumerate() {
        let reads_reduction_vars = match e {
            Expr::Load { index, .. } | Expr::LoadIndirect { index, .. } | Expr::Index(index) => index.uses_vars_from(nk),
            _ => false,
        };
        if live[i] && reads_reduction_vars {
            return None; // the epilogue reads the reduction's own variables
        }
    }
    if store.index.uses_vars_from(nk) {
        return None;
    }

    // First stage: variables [kept..., s, r]; the original reduction variables are recovered
    // from the flat position s·chunk + r (taken modulo the total when the last chunk is masked,
    // so that the masked lanes still load in bounds).
    let mut first_ranges = node.ranges.clone();
    first_ranges.push(splits);
    first_ranges.push(chunk);
    let s = IndexExpr::var(Var(nk as u32));
    let r = IndexExpr::var(Var(nk as u32 + 1));
    let mut flat = s.scale(chunk).add(&r);
    if masked {
        flat = flat.modulo(total, &first_ranges);
    }
    let mut subst: Vec<Option<IndexExpr>> = (0..nk).map(|v| Some(IndexExpr::var(Var(v as u32)))).collect();
    let mut inner = 1i64;
    let mut red_subst = Vec::new();
    for &size in node.reduction_ranges.iter().rev() {
        red_subst.push(flat.floordiv(inner, &first_ranges).modulo(size, &first_ranges));
        inner *= size;
    }
    subst.extend(red_subst.into_iter().rev().map(Some));
    let rewritten = body.rewrite_indices(&|e: &IndexExpr| e.substitute(&subst, &first_ranges));
    let mut fb = LoopBody::default();
    fb.exprs = rewritten.exprs[..rid.0 as usize].to_vec();
    fb.dtypes = rewritten.dtypes[..rid.0 as usize].to_vec();
    let mut x = operand;
    if masked {
        let pos = fb.index(s.scale(chunk).add(&r), DType::I64);
        let end = fb.constant(Scalar::Int(total), DType::I64);
        let inside = fb.binary(BinaryOp::Lt, pos, end);
        let id = fb.constant(identity(op, body.dtype(operand))?, body.dtype(operand));
        x = fb.where_(inside, x, id);
    }
    let partial_value = fb.reduce(op, x);
    let mut kept_idx: Vec<IndexExpr> = (0..nk).map(|v| IndexExpr::var(Var(v as u32))).collect();
    kept_idx.push(s);
    let part_strides = contiguous_strides(&first_ranges[..nk + 1]);
    let part_index = kept_idx.iter().zip(&part_strides).fold(IndexExpr::zero(), |acc, (i, st)| acc.add(&i.scale(*st)));
    fb.set_store(part_index.clone(), partial_value);
    let first = LoopNode {
        output: node.output,
        ranges: first_ranges[..nk + 1].to_vec(),
        reduction_ranges: vec![chunk],
        body: fb,
        origins: Vec::new(),
    };

    // The second stage copies the live epilogue, the reduction now over the partials.
    let old = body.clone();
    let dtype = first.body.dtype(partial_value);
    let second: SecondStage = Box::new(move |partial: BufferId| {
        let mut sb = LoopBody::default();
        let mut map: Vec<Option<ValueId>> = vec![None; old.exprs.len()];
        let loaded = sb.load(partial, part_index, dtype);
        let combined = sb.reduce(op, loaded);
        let combined = sb.cast(combined, old.dtype(rid));
        map[rid.0 as usize] = Some(combined);
        for (i, e) in old.exprs.iter().enumerate() {
            if live[i] && i != rid.0 as usize {
                map[i] = sb.push_copy(e, old.dtypes[i], &|v| map[v.0 as usize]);
            }
        }
        let st = old.store.as_ref().expect("a reduction stores its result");
        let value = map[st.value.0 as usize].expect("the stored value is live");
        sb.set_store(st.index.clone(), value);
        sb
    });
    Some((first, second, splits))
}

/// The value that leaves a combine unchanged, for masked lanes.
fn identity(op: ReduceOp, dtype: DType) -> Option<Scalar> {
    Some(match op {
        ReduceOp::Sum => Scalar::Int(0),
        ReduceOp::Prod => Scalar::Int(1),
        ReduceOp::Any => Scalar::Bool(false),
        ReduceOp::Max if dtype.is_float() => Scalar::Float(f64::NEG_INFINITY),
        ReduceOp::Min if dtype.is_float() => Scalar::Float(f64::INFINITY),
        ReduceOp::Max if dtype.is_integral() => Scalar::Int(dtype.int_range().0),
        ReduceOp::Min if dtype.is_integral() => Scalar::Int(dtype.int_range().1),
        _ => return None,
    })
}
