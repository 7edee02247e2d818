//! Split reductions (GPU): a reduction with few outputs and a long reduction runs as one program
//! per output row, which leaves most of a GPU idle (a full `x.sum()` over 64M elements would be
//! one program looping 64M times). Such a node becomes two: a first stage reducing `S` chunks of
//! the reduction per output into a partial buffer `[outputs..., S]`, and a second stage combining
//! the `S` partials (and applying the original epilogue, e.g. a mean's division).

use crate::graph::DType;
use crate::loop_ir::*;
use crate::symbolic::{IndexExpr, Var};

/// When to split, in programs. A reduction along its rows (inner) runs a program per row, or per
/// `looped_rows_per_program` rows when a row is longer than `persistent_max` (the Triton
/// writer's looped reductions: a block of 4096 elements in steps of 1024; counted so from two
/// persistent blocks on): fewer such programs
/// than `min_rows` is too few to fill the device, and the first stage aims for about
/// `target_programs` programs of at least `min_chunk` elements. A reduction over an outer
/// dim (its loads contiguous along the output, e.g. a bias gradient summed over tokens) runs a
/// program per column tile of `outer_tile_bytes` (a whole 128-byte line of each row it reads):
/// below `outer_target_programs` such tiles of 4-byte elements (twice as many of 2-byte ones:
/// the same bytes in flight, as a program's block holds a fixed number of elements) it is split
/// into chunks of at least `outer_min_chunk` rows, the split index outermost so loads stay
/// coalesced.
#[derive(Clone, Copy, Debug)]
pub struct SplitConfig {
    pub min_rows: i64,
    pub persistent_max: i64,
    pub looped_rows_per_program: i64,
    pub target_programs: i64,
    pub min_chunk: i64,
    pub outer_tile_bytes: i64,
    pub outer_target_programs: i64,
    pub outer_min_chunk: i64,
}

/// For a GPU with about 132 streaming multiprocessors (H100): below two programs per SM the
/// reduction is split, into about 1024 first-stage programs of at least 2048 elements each.
/// Outer reductions, sums over dim 0 on an H200 against Inductor's kernel time: float32 at 512
/// tiles 1.01 (16384x4096: 64 µs; at 1024 tiles 1.07, at 2048 1.03, unsplit (256) 0.65 of copy
/// bandwidth), bfloat16 at 1024 tiles 0.94 (65536x768: 29 µs against 31; at 512 tiles 1.23, at
/// 2048 1.07). A GroupNorm's statistics over 256 (sample, group) rows of 32768 bfloat16 values
/// (a diffusion UNet's 256 channels at 64x64, batch 8) ran unsplit as 64 looped programs:
/// 34.5 µs on an H100, where Inductor's split reduction took 9.3.
pub const GPU_SPLIT: SplitConfig = SplitConfig {
    min_rows: 256,
    persistent_max: 8192,
    looped_rows_per_program: 4,
    target_programs: 1024,
    min_chunk: 2048,
    outer_tile_bytes: 128,
    outer_target_programs: 512,
    outer_min_chunk: 256,
};

impl SplitConfig {
    /// How many chunks a reduction of `rows` outputs over `total` elements each should be split
    /// into (`outer`: along an outer dim, the size of its narrowest loaded element), or None to
    /// leave it whole.
    pub fn splits(&self, rows: i64, total: i64, outer: Option<i64>) -> Option<i64> {
        if rows <= 0 {
            return None;
        }
        let want = if let Some(itemsize) = outer {
            let columns = (self.outer_tile_bytes / itemsize).max(1);
            let programs = (rows + columns - 1) / columns;
            if total < 2 * self.outer_min_chunk {
                return None;
            }
            let target = self.outer_target_programs * 4 / itemsize.min(4);
            (target / programs).min(total / self.outer_min_chunk)
        } else {
            // (rows shorter than two persistent blocks count a program each: their loop runs at
            // most twice, and split they made the interpreted test cases of 256 rows of 10000
            // take minutes instead of seconds)
            let programs = if total >= 2 * self.persistent_max { rows / self.looped_rows_per_program } else { rows };
            if programs >= self.min_rows || total < 2 * self.min_chunk {
                return None;
            }
            (self.target_programs / rows).min(total / self.min_chunk)
        };
        (want >= 2).then_some(want)
    }
}

/// Whether node `n` reduces over an outer dim: some load it reduces is contiguous along the
/// innermost output variable and strided along the innermost reduction variable. Returns the
/// narrowest such load's element size.
pub fn outer_reduction_itemsize(node: &LoopNode) -> Option<i64> {
    let nk = node.ranges.len();
    let nr = node.reduction_ranges.len();
    if nk == 0 || nr == 0 {
        return None;
    }
    let (kept, red) = (Var(nk as u32 - 1), Var((nk + nr) as u32 - 1));
    (node.body.exprs.iter().enumerate())
        .filter(|(_, e)| match e {
            Expr::Load { index, .. } if index.uses_vars_from(nk) => {
                index.affine_coeff(kept) == Some(1) && index.affine_coeff(red).is_some_and(|c| c.abs() > 1)
            }
            _ => false,
        })
        .map(|(i, _)| node.body.dtype(ValueId(i as u32)).itemsize() as i64)
        .min()
}

/// Splits every reduction node that `config` says is too narrow. Returns one decision per node.
pub fn split_reductions(p: &mut LoopProgram, config: &SplitConfig) -> Vec<String> {
    let mut decisions = Vec::new();
    let steps = p.steps.clone();
    let mut new_steps = Vec::with_capacity(steps.len());
    // variances are matched against their mean nodes before those are split themselves
    let mut one_pass_splits: Vec<Option<Split>> = (0..p.nodes.len()).map(|n| plan_welford_split(p, n, config)).collect();
    for step in steps {
        if let Step::Node(n) = step {
            let welford = one_pass_splits[n].take();
            let one_pass = welford.is_some();
            if let Some(Split { firsts, second, splits, part_size, outer }) = welford.or_else(|| plan_split(p, n, config)) {
                let (output, ranges, origins) = (p.nodes[n].output, p.nodes[n].ranges.clone(), p.nodes[n].origins.clone());
                let total: i64 = p.nodes[n].reduction_ranges.iter().product();
                let device = p.buffer(output).layout.device;
                let mut partials = Vec::new();
                for first in firsts {
                    let dtype = first.body.dtype(first.body.store.as_ref().map_or(ValueId(0), |s| s.value));
                    let partial = p.add_buffer(Layout::contiguous(&part_size, dtype, device), BufferSource::Computed);
                    partials.push(partial);
                    p.nodes.push(LoopNode { output: partial, origins: origins.clone(), ..first });
                    new_steps.push(Step::Node(p.nodes.len() - 1));
                }
                let names: Vec<&str> = partials.iter().map(|b| p.buffer(*b).name.as_str()).collect();
                decisions.push(format!(
                    "split: {} reduces {total} elements into {} rows{}: {splits} partial reductions each ({}), then a combine{}",
                    p.buffer(output).name,
                    ranges.iter().product::<i64>(),
                    if outer { " (over an outer dim: the split index outermost)" } else { "" },
                    names.join(", "),
                    if one_pass { " (a variance: each chunk's sum and Welford M2 in one pass, combined by Chan's formula)" } else { "" }
                ));
                p.nodes[n] = LoopNode { output, ranges, reduction_ranges: vec![splits], body: second(&partials), origins, template: None };
            }
        }
        new_steps.push(step);
    }
    p.steps = new_steps;
    decisions
}

type SecondStage = Box<dyn FnOnce(&[BufferId]) -> LoopBody>;

/// A planned split: the first stages (each storing one partial per chunk; their outputs still
/// the original's), a builder of the second stage's body given the partial buffers, the number
/// of chunks, the partial buffers' size and whether the reduction runs over an outer dim.
struct Split {
    firsts: Vec<LoopNode>,
    second: SecondStage,
    splits: i64,
    part_size: Vec<i64>,
    outer: bool,
}

/// The split of node `n`, or None when the node is not worth or not able to split.
fn plan_split(p: &LoopProgram, n: usize, config: &SplitConfig) -> Option<Split> {
    let node = &p.nodes[n];
    if node.template.is_some() {
        return None; // a template tiles its kernel itself
    }
    let (rid, op, operand) = single_reduction(&node.body)?;
    if matches!(op, ReduceOp::WelfordM2) {
        return None;
    }
    let shape = SplitShape::of(node, config, false)?;
    let (first, part) = first_stage(node, rid, op, operand, &shape)?;
    let live = epilogue(node, rid)?;
    // The second stage copies the live epilogue, the reduction now over the partials.
    let old = node.body.clone();
    let dtype = first.body.dtype(first.body.store.as_ref().map_or(ValueId(0), |s| s.value));
    let part_index = part.index.clone();
    let second: SecondStage = Box::new(move |partials: &[BufferId]| {
        second_stage(&old, &live, rid, |sb| {
            let loaded = sb.load(partials[0], part_index, dtype);
            sb.reduce(op, loaded)
        })
    });
    Some(Split { firsts: vec![first], second, splits: shape.splits, part_size: part.size, outer: shape.outer })
}

/// A variance's second pass `Σ(a - mean)²` over a reduction the split pass divides evenly:
/// each chunk takes its sum and its Welford M2 of `a` in one pass over the data, and the
/// combine adds the chunks' M2s and their means' deviations from the full mean
/// (`Σ M2ₖ + n·(Sₖ/n - mean)²`, Chan's formula for equal chunks). Without it the variance
/// would read its input a second time after the mean.
fn plan_welford_split(p: &LoopProgram, n: usize, config: &SplitConfig) -> Option<Split> {
    // the split's shape first (cheap, and the same for the one-pass form: same loops and loads)
    let shape = SplitShape::of(&p.nodes[n], config, true)?;
    let (mean_buf, mean_index, body, shift) = super::variance::one_pass_form(p, n)?;
    let node = LoopNode { body, ..p.nodes[n].clone() };
    let (rid, _, operand) = single_reduction(&node.body)?;
    let (m2s, part) = first_stage(&node, rid, ReduceOp::WelfordM2, operand, &shape)?;
    let (sums, _) = first_stage(&node, rid, ReduceOp::Sum, operand, &shape)?;
    let live = epilogue(&node, rid)?;
    let old = node.body.clone();
    let dtype = m2s.body.dtype(m2s.body.store.as_ref().map_or(ValueId(0), |s| s.value));
    let sum_dtype = sums.body.dtype(sums.body.store.as_ref().map_or(ValueId(0), |s| s.value));
    let mean_dtype = p.buffer(mean_buf).layout.dtype;
    let chunk = shape.chunk;
    let part_index = part.index.clone();
    let (kept, ranges) = (node.ranges.len(), node.var_ranges());
    if let Some(v) = shift {
        // the combine recomputes the shift: it must be recomputable there
        super::variance::row_first(&old, v, kept, &ranges, &mut LoopBody::default())?;
    }
    let second: SecondStage = Box::new(move |partials: &[BufferId]| {
        second_stage(&old, &live, rid, |sb| {
            let m2 = sb.load(partials[0], part_index.clone(), dtype);
            let sum = sb.load(partials[1], part_index, sum_dtype);
            let sum = sb.cast(sum, dtype);
            let mean = sb.load(mean_buf, mean_index, mean_dtype);
            let mean = sb.cast(mean, dtype);
            // the chunks summed the shifted terms: the mean they deviate from is shifted alike
            let first = shift.and_then(|v| super::variance::row_first(&old, v, kept, &ranges, sb));
            let mean = match first {
                Some(first) => sb.binary(BinaryOp::Sub, mean, first),
                None => mean,
            };
            let n = sb.constant(Scalar::Int(chunk), dtype);
            let chunk_mean = sb.binary(BinaryOp::TrueDiv, sum, n);
            let d = sb.binary(BinaryOp::Sub, chunk_mean, mean);
            let dd = sb.binary(BinaryOp::Mul, d, d);
            let weighted = sb.binary(BinaryOp::Mul, dd, n);
            let term = sb.binary(BinaryOp::Add, m2, weighted);
            sb.reduce(ReduceOp::Sum, term)
        })
    });
    Some(Split { firsts: vec![m2s, sums], second, splits: shape.splits, part_size: part.size, outer: shape.outer })
}

/// The body's one reduction (value id, op, operand), None when it has none, several, or
/// anything that reports or scans.
fn single_reduction(body: &LoopBody) -> Option<(ValueId, ReduceOp, ValueId)> {
    let mut reduce = None;
    for (i, e) in body.exprs.iter().enumerate() {
        match e {
            Expr::Reduce(op, x) if reduce.is_none() && !matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin) => {
                reduce = Some((ValueId(i as u32), *op, *x))
            }
            Expr::Reduce(..) | Expr::ArgReduce(..) | Expr::Scan(..) | Expr::CheckIndex { .. } => return None,
            _ => {}
        }
    }
    reduce
}

/// How a node's reduction divides: chunks, their length, whether the last one is masked and
/// whether it runs over an outer dim.
struct SplitShape {
    splits: i64,
    chunk: i64,
    masked: bool,
    outer: bool,
}

impl SplitShape {
    /// None when the node is not worth splitting, or (`exact`) does not divide evenly.
    fn of(node: &LoopNode, config: &SplitConfig, exact: bool) -> Option<SplitShape> {
        let store = node.body.store.as_ref()?;
        if store.is_scatter() || node.reduction_ranges.is_empty() {
            return None;
        }
        let rows: i64 = node.ranges.iter().product();
        let total: i64 = node.reduction_ranges.iter().product();
        let outer_itemsize = outer_reduction_itemsize(node);
        let outer = outer_itemsize.is_some();
        let want = config.splits(rows, total, outer_itemsize)?;
        // an exact divisor near the wish needs no mask; else the last chunk is masked
        let exact_split = (want / 2..=want).rev().find(|s| *s >= 2 && total % s == 0);
        let splits = match exact_split {
            Some(s) => s,
            None if exact => return None,
            None => want,
        };
        let chunk = (total + splits - 1) / splits;
        Some(SplitShape { splits, chunk, masked: chunk * splits != total, outer })
    }
}

/// The live values of the epilogue after reduction `rid` (what the store needs), or None when
/// the epilogue reads the reduction's own variables or stores by them.
fn epilogue(node: &LoopNode, rid: ValueId) -> Option<Vec<bool>> {
    let body = &node.body;
    let store = body.store.as_ref()?;
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
    Some(live)
}

/// Where a first stage stores: the partial buffer's size and the second stage's index into it.
struct Partial {
    size: Vec<i64>,
    index: IndexExpr,
}

/// The first stage of a split: `op` of `operand` over each chunk, stored into a partial buffer
/// `[kept..., S]` (`[S, kept...]` over an outer dim), its output still the original's.
fn first_stage(node: &LoopNode, rid: ValueId, op: ReduceOp, operand: ValueId, shape: &SplitShape) -> Option<(LoopNode, Partial)> {
    let body = &node.body;
    let nk = node.ranges.len();
    let SplitShape { splits, chunk, masked, outer } = *shape;
    let total: i64 = node.reduction_ranges.iter().product();
    // Variables [kept..., s, r] ([s, kept..., r] over an outer dim, so that neighbouring
    // programs read neighbouring outputs); the original reduction variables are recovered from
    // the flat position s·chunk + r (taken modulo the total when the last chunk is masked, so
    // that the masked lanes still load in bounds).
    let (s_var, kept_var) = if outer { (0u32, 1u32) } else { (nk as u32, 0u32) };
    let mut first_ranges = node.ranges.clone();
    first_ranges.insert(s_var as usize, splits);
    first_ranges.push(chunk);
    let s = IndexExpr::var(Var(s_var));
    let r = IndexExpr::var(Var(nk as u32 + 1));
    let mut flat = s.scale(chunk).add(&r);
    if masked {
        flat = flat.modulo(total, &first_ranges);
    }
    let mut subst: Vec<Option<IndexExpr>> = (0..nk).map(|v| Some(IndexExpr::var(Var(v as u32 + kept_var)))).collect();
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
    // a float sum's partials are added and kept in double: each chunk's rounding to float would
    // cost the result its last digits (10^8 elements: 2.7x CUDA eager's error); an outer
    // reduction's column tiles add in float, as CUDA eager's do
    if op == ReduceOp::Sum && !outer && matches!(body.dtype(operand), DType::F32 | DType::F16 | DType::BF16) {
        x = fb.cast(x, DType::F64);
    }
    let partial_value = fb.reduce(op, x);
    // the partial buffer is [kept..., S] ([S, kept...] over an outer dim), contiguous
    let part_size = first_ranges[..nk + 1].to_vec();
    let part_strides = contiguous_strides(&part_size);
    let first_index = (0..=nk).fold(IndexExpr::zero(), |acc, v| acc.add(&IndexExpr::var(Var(v as u32)).scale(part_strides[v])));
    fb.set_store(first_index, partial_value);
    let first = LoopNode {
        output: node.output,
        ranges: part_size.clone(),
        reduction_ranges: vec![chunk],
        body: fb,
        origins: Vec::new(),
        template: None,
    };
    // the second stage's variables are [kept..., s]
    let index = (0..nk).fold(IndexExpr::var(Var(nk as u32)).scale(part_strides[s_var as usize]), |acc, v| {
        acc.add(&IndexExpr::var(Var(v as u32)).scale(part_strides[v + kept_var as usize]))
    });
    Some((first, Partial { size: part_size, index }))
}

/// A second stage: `combine` builds the reduction over the partials (variables [kept..., s]);
/// the live epilogue of `old` follows it, as in the unsplit node.
fn second_stage(old: &LoopBody, live: &[bool], rid: ValueId, combine: impl FnOnce(&mut LoopBody) -> ValueId) -> LoopBody {
    let mut sb = LoopBody::default();
    let mut map: Vec<Option<ValueId>> = vec![None; old.exprs.len()];
    let combined = combine(&mut sb);
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
