//! `attention`: scaled dot-product attention written out (a batched matmul of queries and
//! transposed keys, scales, additive or -inf-filled boolean masks and casts, a softmax over the
//! keys, a batched matmul with the values) becomes one fused attention call: cuDNN's for
//! half-precision CUDA inputs, the memory-efficient kernel for float32 ones,
//! `_scaled_dot_product_flash_attention_for_cpu` on the CPU (`Kernel`). The scores are never
//! stored, and half-precision inputs that the graph upcast (torch's own math path does) are read
//! as they are.
//!
//! What it keeps exact: the masks become the call's additive bias (the pattern replayed with the
//! scores at zero, so a mask's -inf stays -inf); the scales multiply into the call's `scale`; a
//! finite `masked_fill` value is refused (a row it fills entirely would differ). Rows the mask
//! fills with -inf entirely get eager's result, computed from the bias: NaN after a plain
//! softmax, 0 where the graph spells torch's safe softmax.

use super::affine::{causal_offset, Form, Forms};
use super::*;

/// How the scores change between the first matmul and the softmax, in graph order.
enum Step {
    /// A view between the matmul's `[B*H, M, N]` and `[B, H, M, N]`.
    Reshape,
    Scale(f64),
    Divide(f64),
    Add(NodeId),
    Subtract(NodeId),
    /// `where(cond, scores, fill)` (`scores_if: true`) or `where(cond, fill, scores)`, fill -inf.
    Fill {
        cond: NodeId,
        fill: NodeId,
        scores_if: bool,
    },
    /// A mask with every key open, as Hugging Face's vision models build one (`where(cond,
    /// scores, -inf)` with `cond` true everywhere, or the add of `where(cond, 0, -inf)`): the
    /// scores pass unchanged.
    Open,
    Cast,
}

impl Step {
    /// Whether the step adds to the scores something other than a scale (a mask).
    fn is_mask(&self) -> bool {
        matches!(self, Step::Add(_) | Step::Subtract(_) | Step::Fill { .. })
    }
}

/// A matmul operand traced back to the 4-D tensor it views: `[B, H, rows, cols]`, or its
/// transpose (`flipped`), times `scale`.
struct Operand {
    node: NodeId,
    flipped: bool,
    scale: f64,
    /// The nodes between the matmul and `node`, nearest first: dropped where only the pattern reads them.
    passed: Vec<NodeId>,
}

struct Ctx<'g> {
    g: &'g Graph,
    uses: Vec<usize>,
    users: Vec<Vec<NodeId>>,
    cuda_arch: u32,
    triton_kernels: bool,
    /// A training graph's attention (the call's backward follows).
    differentiable: bool,
}

fn tensor(g: &Graph, id: NodeId) -> Option<&TensorMeta> {
    g.node(id).meta.tensor()
}

fn node_of(a: Option<&Arg>) -> Option<NodeId> {
    match a {
        Some(Arg::Node(n)) => Some(*n),
        _ => None,
    }
}

fn scalar_of(a: Option<&Arg>) -> Option<f64> {
    match a {
        Some(Arg::Float(x)) => Some(*x),
        Some(Arg::Int(i)) => Some(*i as f64),
        _ => None,
    }
}

/// A `_to_copy` that only changes the dtype.
fn is_plain_cast(kwargs: &[(String, Arg)]) -> bool {
    kwargs.iter().all(|(k, a)| {
        k == "dtype" || matches!(a, Arg::None) || (k == "memory_format" && matches!(a, Arg::MemoryFormat(f) if f == "preserve_format"))
    })
}

/// A node whose every element is -inf (a `scalar_tensor`, `full` or `full_like` of -inf).
fn is_minus_infinity(g: &Graph, id: NodeId) -> bool {
    let value = match call(g, id) {
        Some((AtenOp::ScalarTensor, args, _)) => args.first(),
        Some((AtenOp::Full | AtenOp::FullLike, args, _)) => args.get(1),
        _ => None,
    };
    matches!(scalar_of(value), Some(v) if v == f64::NEG_INFINITY)
}

/// Whether a boolean node is true everywhere, as its affine form tells (`affine`).
fn always_true(g: &Graph, id: NodeId) -> bool {
    Forms::new(g).of(id) == Some(Form::Bool(true))
}

/// Whether a node is zero everywhere: a zero constant, or a `where` whose condition always holds
/// choosing one (through broadcasts and casts).
fn always_zero(g: &Graph, id: NodeId, depth: usize) -> bool {
    let Some((op, args, _)) = call(g, id) else { return false };
    if depth > 16 {
        return false;
    }
    let input = |i: usize| node_of(args.get(i)).is_some_and(|n| always_zero(g, n, depth + 1));
    use AtenOp::*;
    match op {
        ScalarTensor => scalar_of(args.first()) == Some(0.0),
        Full | FullLike => scalar_of(args.get(1)) == Some(0.0),
        WhereSelf => node_of(args.first()).is_some_and(|c| always_true(g, c)) && input(1),
        Unsqueeze | Expand | View | UnsafeView | Alias | Clone | Permute | ToCopy => input(0),
        _ => false,
    }
}

/// Whether every value of `id` is a value of the half type `half`, so that the call's bias (of
/// the inputs' type) holds it unrounded: a tensor of that type or boolean, constants it holds
/// exactly, and `where`s, views and casts of those.
fn exact_in(g: &Graph, id: NodeId, half: DType, depth: usize) -> bool {
    if tensor(g, id).is_some_and(|t| t.dtype == half || t.dtype == DType::Bool) {
        return true;
    }
    let Some((op, args, _)) = call(g, id) else { return false };
    if depth > 16 {
        return false;
    }
    let input = |i: usize| match args.get(i) {
        Some(Arg::Node(n)) => exact_in(g, *n, half, depth + 1),
        a => scalar_of(a).is_some_and(|v| holds(half, v)),
    };
    use AtenOp::*;
    match op {
        ScalarTensor => input(0),
        Full | FullLike => input(1),
        WhereSelf => input(1) && input(2),
        Unsqueeze | Expand | View | UnsafeView | Alias | Clone | Permute | ToCopy | Neg => input(0),
        _ => false,
    }
}

/// Whether `id` is computed from positions, constants and graph inputs of fewer than `limit`
/// elements (a mask built with `arange`, or from a document id per position; not a stored
/// mask), as far as 256 nodes tell.
fn computed_mask(g: &Graph, id: NodeId, limit: i64, seen: &mut HashSet<NodeId>) -> bool {
    if !seen.insert(id) {
        return true;
    }
    let NodeKind::Call { args, kwargs, .. } = &g.node(id).kind else {
        return tensor(g, id).is_some_and(|t| t.numel() < limit);
    };
    if seen.len() >= 256 {
        return false;
    }
    args.iter().chain(kwargs.iter().map(|(_, a)| a)).all(|a| computed_arg(g, a, limit, seen))
}

fn computed_arg(g: &Graph, a: &Arg, limit: i64, seen: &mut HashSet<NodeId>) -> bool {
    match a {
        Arg::Node(n) => computed_mask(g, *n, limit, seen),
        Arg::List(items) => items.iter().all(|i| computed_arg(g, i, limit, seen)),
        _ => true,
    }
}

/// Whether `half` (float16 or bfloat16) represents `v` exactly.
fn holds(half: DType, v: f64) -> bool {
    if v == 0.0 || v.is_infinite() {
        return true;
    }
    let f = v as f32;
    if f as f64 != v || !f.is_finite() {
        return false;
    }
    match half {
        DType::BF16 => f.to_bits() & 0xffff == 0,
        // 11 significant bits, exponents from -14 (subnormals below, spaced 2^-24)
        DType::F16 => {
            let a = v.abs();
            let step = if a < 2f64.powi(-14) { 2f64.powi(-24) } else { 2f64.powi(a.log2().floor() as i32 - 10) };
            a <= 65504.0 && (a / step).fract() == 0.0
        }
        _ => true,
    }
}

const FLOATS: [DType; 3] = [DType::F16, DType::BF16, DType::F32];

impl Ctx<'_> {
    fn single_use(&self, id: NodeId) -> bool {
        self.uses[id.0 as usize] == 1
    }

    /// Whether `id` is reached from a batched matmul through score steps alone (which operand
    /// of a binary step carries the scores).
    fn carries_scores(&self, id: NodeId, depth: usize) -> bool {
        if depth > 32 {
            return false;
        }
        let Some((op, args, _)) = call(self.g, id) else { return false };
        use AtenOp::*;
        match op {
            Bmm => true,
            View | UnsafeView | ToCopy | MulTensor | MulScalar | DivTensor | DivScalar | AddTensor | SubTensor => {
                node_of(args.first()).is_some_and(|n| self.carries_scores(n, depth + 1))
                    || (matches!(op, AddTensor | MulTensor) && node_of(args.get(1)).is_some_and(|n| self.carries_scores(n, depth + 1)))
            }
            WhereSelf => [1, 2].iter().any(|&i| node_of(args.get(i)).is_some_and(|n| self.carries_scores(n, depth + 1))),
            _ => false,
        }
    }

    /// The steps from the first matmul to the softmax's input `x`, in graph order, with the
    /// nodes they pass (the matmul last).
    fn score_steps(&self, x: NodeId) -> Result<(NodeId, Vec<Step>, Vec<NodeId>), String> {
        let shape = |id: NodeId| tensor(self.g, id).map(|t| t.shape.clone());
        let mut cur = x;
        let (mut steps, mut passed) = (Vec::new(), Vec::new());
        loop {
            let node = self.g.node(cur);
            let Some((op, args, kwargs)) = call(self.g, cur) else { return Err(format!("{} is not an ATen call", node.name)) };
            if cur != x && !self.single_use(cur) {
                return Err(format!("{} is read outside the attention", node.name));
            }
            passed.push(cur);
            if op == AtenOp::Bmm {
                steps.reverse();
                return Ok((cur, steps, passed));
            }
            if steps.len() > 32 {
                return Err("more than 32 steps between the scores and the softmax".into());
            }
            use AtenOp::*;
            let first = node_of(args.first());
            let (next, step) = match op {
                View | UnsafeView => (first, Step::Reshape),
                ToCopy if is_plain_cast(kwargs) => (first, Step::Cast),
                MulTensor | MulScalar => match (first, scalar_of(args.get(1)), scalar_of(args.first()), node_of(args.get(1))) {
                    (Some(n), Some(c), _, _) => (Some(n), Step::Scale(c)),
                    (_, _, Some(c), Some(n)) => (Some(n), Step::Scale(c)),
                    _ => return Err(format!("{} multiplies the scores by a tensor", node.name)),
                },
                DivTensor | DivScalar => match scalar_of(args.get(1)) {
                    Some(c) => (first, Step::Divide(c)),
                    None => return Err(format!("{} divides the scores by a tensor", node.name)),
                },
                AddTensor | SubTensor => {
                    if scalar_of(node.kwarg("alpha")).is_some_and(|a| a != 1.0) {
                        return Err(format!("{} adds with alpha", node.name));
                    }
                    let (a, b) = (first, node_of(args.get(1)));
                    let (Some(a), Some(b)) = (a, b) else { return Err(format!("{} adds a scalar to the scores", node.name)) };
                    let (scores, other) = if self.carries_scores(a, 0) { (a, b) } else { (b, a) };
                    if op == SubTensor && scores != a {
                        return Err(format!("{} subtracts the scores", node.name));
                    }
                    // the mask broadcasts into the scores, never the scores into the mask
                    if shape(scores) != shape(cur) {
                        return Err(format!("{} broadcasts the scores", node.name));
                    }
                    let step = match op {
                        _ if always_zero(self.g, other, 0) => Step::Open,
                        AddTensor => Step::Add(other),
                        _ => Step::Subtract(other),
                    };
                    (Some(scores), step)
                }
                WhereSelf => {
                    let (cond, a, b) = (node_of(args.first()), node_of(args.get(1)), node_of(args.get(2)));
                    let (Some(cond), Some(a), Some(b)) = (cond, a, b) else { return Err(format!("{} has a scalar operand", node.name)) };
                    let (scores, fill, scores_if) = if is_minus_infinity(self.g, b) {
                        (a, b, true)
                    } else if is_minus_infinity(self.g, a) {
                        (b, a, false)
                    } else {
                        return Err(format!("{} fills with a value other than -inf", node.name));
                    };
                    if shape(scores) != shape(cur) {
                        return Err(format!("{} broadcasts the scores", node.name));
                    }
                    let open = scores_if && always_true(self.g, cond);
                    (Some(scores), if open { Step::Open } else { Step::Fill { cond, fill, scores_if } })
                }
                _ => return Err(format!("{} ({}) between the scores and the softmax", node.name, op.name())),
            };
            steps.push(step);
            cur = next.ok_or_else(|| format!("{} has no tensor operand", node.name))?;
        }
    }

    /// The matmul operand `start` traced back through views, copies, transposes of the last two
    /// dims, scalar scales and upcasts to the deepest node shaped `[B, H, rows, cols]` (or its
    /// transpose); None when no node on the way has that shape.
    fn operand(&self, start: NodeId, want: [i64; 4], start_flipped: bool) -> Option<Operand> {
        let [b, h, r, c] = want;
        let (mut cur, mut flipped, mut scale) = (start, start_flipped, 1.0);
        let mut passed = Vec::new();
        let mut best = None;
        for _ in 0..32 {
            let t = tensor(self.g, cur)?;
            let target = if flipped { [b, h, c, r] } else { [b, h, r, c] };
            if t.shape == target {
                best = Some(Operand { node: cur, flipped, scale, passed: passed.clone() });
            }
            let Some((op, args, kwargs)) = call(self.g, cur) else { break };
            let first = node_of(args.first());
            let input = first.and_then(|n| tensor(self.g, n));
            use AtenOp::*;
            let next = match op {
                // (each keeps the elements' row-major order: between two nodes of the target
                // shape they are the identity; FlexAttention's key and value pass an unsqueeze,
                // an expand and a clone for grouped-query heads even when the groups are of one)
                View | UnsafeView | Clone | Alias | Unsqueeze => first,
                Expand if input.is_some_and(|i| i.shape == t.shape) => first,
                Permute if matches!(args.get(1), Some(Arg::List(d)) if *d == [Arg::Int(0), Arg::Int(1), Arg::Int(3), Arg::Int(2)]) => {
                    flipped = !flipped;
                    first
                }
                TransposeInt
                    if t.shape.len() == 4 && {
                        let d: Vec<i64> =
                            [args.get(1), args.get(2)].iter().filter_map(|a| scalar_of(*a)).map(|d| (d as i64).rem_euclid(4)).collect();
                        d == [2, 3] || d == [3, 2]
                    } =>
                {
                    flipped = !flipped;
                    first
                }
                MulTensor | MulScalar if scalar_of(args.get(1)).is_some() => {
                    scale *= scalar_of(args.get(1))?;
                    first
                }
                DivTensor | DivScalar if scalar_of(args.get(1)).is_some() => {
                    scale /= scalar_of(args.get(1))?;
                    first
                }
                ToCopy if is_plain_cast(kwargs) && t.dtype == DType::F32 && input.is_some_and(|i| FLOATS.contains(&i.dtype)) => first,
                _ => None,
            };
            match next {
                Some(n) => {
                    passed.push(cur);
                    cur = n;
                }
                None => break,
            }
        }
        best
    }
}

/// Scores below which the CPU keeps the matmuls and its generated softmax: at 2 threads (causal
/// mask, float32) the fused call took 0.072 against 0.050 ms at 2x4x32x32 scores and 0.326
/// against 0.252 at 2x4x128x128, and won from 2x8x256x256 (2.41 against 2.81 ms; 4x8x512x512:
/// 16.5 against 37.5).
const CPU_MIN_SCORES: i64 = 1 << 19;

/// The fused call a device, dtype and GPU get: on Hopper cuDNN's attention ran 2.7 times faster
/// than the memory-efficient kernel with a mask (H200, bf16, B=8 H=16 S=1024 head 64: 0.146
/// against 0.397 ms) and takes any mask alignment; it has no float32 kernel, and it was measured
/// on Hopper only: other or unknown GPUs get the memory-efficient kernel (every CUDA GPU torch
/// supports has it).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kernel {
    Cudnn,
    Efficient,
    FlashCpu,
    /// ferrocore's own attention kernel (`_scaled_dot_product_fused_attention_overrideable`, the
    /// backend's hook, lowered to `Template::Attention`): the bias is computed inside it, in
    /// float32, tile by tile, and tiles it closes entirely are skipped.
    Template,
}

impl Kernel {
    fn for_inputs(device: Device, dtype: DType, cuda_arch: u32) -> Option<Kernel> {
        match device {
            Device::Cuda(_) if dtype == DType::F32 || cuda_arch < 90 => Some(Kernel::Efficient),
            Device::Cuda(_) => Some(Kernel::Cudnn),
            Device::Cpu => Some(Kernel::FlashCpu),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    fn op(self) -> AtenOp {
        match self {
            Kernel::Cudnn => AtenOp::CudnnAttention,
            Kernel::Efficient => AtenOp::EfficientAttention,
            Kernel::FlashCpu => AtenOp::FlashAttentionCpu,
            Kernel::Template => AtenOp::FusedAttention,
        }
    }
}

/// One written-out attention, matched.
struct Match {
    bmm1: NodeId,
    softmax: NodeId,
    steps: Vec<Step>,
    q: Operand,
    k: Operand,
    v: Operand,
    /// `[B, H, M, N, K, Kv]`
    dims: [i64; 6],
    /// The node the fused call's result replaces, and whether its layout is 4-D.
    root: NodeId,
    root_4d: bool,
    /// torch's safe softmax (fully masked rows are 0).
    safe: bool,
    /// The step that masks the keys after each query's own (a causal `tril` built in the graph,
    /// proven), which the kernel applies itself (`is_causal`).
    causal: Option<usize>,
    /// No row can be masked entirely (the causal mask is the only one): no fix-up of such rows.
    rows_open: bool,
    kernel: Kernel,
    root_is_output: bool,
    dtype: DType,
    device: Device,
    dead: Vec<NodeId>,
}

/// The graph with every written-out attention it can prove equal to a fused call replaced by
/// one; a line per softmax saying what it did or why not.
pub fn fuse_attention(g: Graph, options: &PassOptions) -> (Graph, Vec<String>) {
    fuse_attention_at(g, options, None)
}

/// `fuse_attention`, of the attention at softmax `at` whose result is `root` alone when given.
pub fn fuse_attention_at(g: Graph, options: &PassOptions, at: Option<(NodeId, NodeId)>) -> (Graph, Vec<String>) {
    let root = at.map(|(_, r)| r);
    let cx = Ctx {
        g: &g,
        uses: g.use_counts(),
        users: g.users(),
        cuda_arch: options.cuda_arch,
        triton_kernels: options.triton_kernels,
        differentiable: options.differentiable,
    };
    let mut edit = GraphEdit::new(&g);
    let mut decisions = Vec::new();
    let mut claimed: HashSet<NodeId> = HashSet::new();
    for id in g.ids() {
        if !matches!(call(&g, id), Some((AtenOp::Softmax, _, _))) || at.is_some_and(|(softmax, _)| softmax != id) {
            continue;
        }
        let name = &g.node(id).name;
        match cx.match_at(id) {
            Ok(m) if root.is_some_and(|r| r != m.root) => {
                decisions.push(format!("softmax {name}: not fused here: its result is not {}", g.node(root.unwrap()).name))
            }
            Ok(m) if m.dead.iter().any(|d| claimed.contains(d)) => {
                decisions.push(format!("softmax {name}: not fused: overlaps another attention"))
            }
            Ok(m) => {
                claimed.extend(m.dead.iter().copied());
                let text = emit(&g, &mut edit, &m, options.differentiable);
                decisions.push(format!("softmax {name}: fused: {text}"));
            }
            Err(why) => decisions.push(format!("softmax {name}: not fused: {why}")),
        }
    }
    edit.finish(g, decisions)
}

impl Ctx<'_> {
    fn match_at(&self, softmax: NodeId) -> Result<Match, String> {
        let g = self.g;
        let (_, args, _) = call(g, softmax).ok_or("not a call")?;
        let x = node_of(args.first()).ok_or("no input")?;
        let scores = tensor(g, softmax).ok_or("not a tensor")?.clone();
        let dim = scalar_of(args.get(1)).ok_or("no dim")? as i64;
        // (3-D attention, never viewed as [B, H, M, N], is left to the matmuls for now)
        if scores.shape.len() != 4 || dim.rem_euclid(4) != 3 {
            return Err("not over the last dim of 4-D scores".into());
        }
        if matches!(args.get(2), Some(Arg::Bool(true))) {
            return Err("half_to_float".into());
        }
        let (bmm1, steps, mut dead) = self.score_steps(x)?;
        let [b, h, m, n] = scores.shape[..] else { unreachable!("4-D scores") };
        if let Some(bias) = bias_shape(g, &steps) {
            let mut padded = vec![1; 4usize.saturating_sub(bias.len())];
            padded.extend(&bias);
            if padded.len() != 4 || broadcast(&padded, &scores.shape).as_deref() != Some(&scores.shape[..]) || padded[3] != n {
                return Err(format!("a mask shaped {bias:?} for scores shaped {:?}", scores.shape));
            }
        }
        if steps.iter().take_while(|s| !matches!(s, Step::Reshape)).any(Step::is_mask) {
            return Err("a mask applied to the 3-D scores".into());
        }
        // after the softmax: torch's safe softmax, casts, views, then the second matmul
        let (p, safe) = self.safe_softmax(softmax, x, &mut dead)?;
        let bmm2 = self.second_matmul(p, scores.numel(), &mut dead)?;
        let (_, a1, _) = call(g, bmm1).ok_or("no matmul")?;
        let (_, a2, _) = call(g, bmm2).ok_or("no matmul")?;
        let (query, key, value) = match (node_of(a1.first()), node_of(a1.get(1)), node_of(a2.get(1))) {
            (Some(q), Some(k), Some(v)) => (q, k, v),
            _ => return Err("a matmul operand is no node".into()),
        };
        let kdim = tensor(g, query).and_then(|t| t.shape.get(2).copied()).ok_or("no 3-D query")?;
        let kv = tensor(g, value).and_then(|t| t.shape.get(2).copied()).ok_or("no 3-D value")?;
        let q = self.operand(query, [b, h, m, kdim], false).ok_or("no 4-D query")?;
        let k = self.operand(key, [b, h, n, kdim], true).ok_or("no 4-D key")?;
        let v = self.operand(value, [b, h, n, kv], false).ok_or("no 4-D value")?;
        let dtype = tensor(g, q.node).ok_or("no query")?.dtype;
        let device = scores.device;
        if [&k, &v].iter().any(|o| tensor(g, o.node).map(|t| t.dtype) != Some(dtype)) || !FLOATS.contains(&dtype) {
            return Err("query, key and value differ in dtype or are not floating".into());
        }
        if kdim != kv {
            return Err(format!("head dims differ (keys {kdim}, values {kv})"));
        }
        // the library calls' bias has the inputs' type: a wider bias would be rounded there (an
        // ALiBi score_mod's slope x distance moved bfloat16 outputs by 2.4 at 1024 keys)
        let mut wide_bias = None;
        if matches!(dtype, DType::F16 | DType::BF16) {
            for step in &steps {
                if let Step::Add(o) | Step::Subtract(o) = step {
                    if !exact_in(g, *o, dtype, 0) {
                        let wide = tensor(g, *o).map_or(DType::F32, |t| t.dtype);
                        wide_bias = Some(format!("{} adds {wide} values that {dtype} would round", g.node(*o).name));
                    }
                }
            }
        }
        let (root, root_4d) = self.result_root(bmm2, [b, h, m, kv], dtype, &mut dead)?;
        for o in [&q, &k, &v] {
            dead.extend(o.passed.iter().take_while(|&&p| self.single_use(p)));
        }
        let causal = causal_fill(g, &steps, [m, n]);
        let rows_open = causal.is_some() && steps.iter().filter(|s| s.is_mask()).count() == 1;
        // masks the kernel computes per tile (from positions, or a document id per position;
        // not a stored mask, which a library call reads as fast)
        let fills: Vec<NodeId> = steps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| if let Step::Fill { cond, .. } = s { (Some(i) != causal).then_some(*cond) } else { None })
            .collect();
        let computed = !fills.is_empty() && fills.iter().all(|c| computed_mask(g, *c, m * n, &mut HashSet::new()));
        // a float32 bias computed from positions (ALiBi's slope x distance): a library call
        // would read it stored, as large as the scores
        let terms: Vec<NodeId> =
            steps.iter().filter_map(|s| if let Step::Add(o) | Step::Subtract(o) = s { Some(*o) } else { None }).collect();
        let computed_terms =
            dtype == DType::F32 && !terms.is_empty() && terms.iter().all(|o| computed_mask(g, *o, m * n, &mut HashSet::new()));
        // (a bias that differs between queries: one the same for every query, a padding mask, is
        // stored small and the CPU's library call reads it as fast)
        let per_query = bias_shape(g, &steps).is_some_and(|s| s.len() >= 2 && s[s.len() - 2] > 1);
        let wanted = wide_bias.is_some() || computed || computed_terms;
        let template = self.template(device, dtype, [b, h, m, n, kdim], wanted, per_query, computed);
        let kernel = match (template, wide_bias) {
            (Ok(()), _) => Kernel::Template,
            (Err(why), Some(wide)) => return Err(format!("{wide}, and no attention template: {why}")),
            (Err(_), None) => self.kernel(device, dtype, [b, h, m, n, kdim], !rows_open && steps.iter().any(Step::is_mask))?,
        };
        let root_is_output = g.outputs.contains(&Arg::Node(root));
        Ok(Match {
            bmm1,
            softmax,
            steps,
            q,
            k,
            v,
            dims: [b, h, m, n, kdim, kv],
            root,
            root_4d,
            safe,
            causal,
            rows_open,
            kernel,
            root_is_output,
            dtype,
            device,
            dead,
        })
    }

    /// The second matmul, reached from the probabilities `p` through casts and views (each read
    /// by the next alone), which join `dead`.
    fn second_matmul(&self, p: NodeId, numel: i64, dead: &mut Vec<NodeId>) -> Result<NodeId, String> {
        let g = self.g;
        let mut cur = p;
        loop {
            if !self.single_use(cur) {
                return Err(format!("{} is read outside the attention", g.node(cur).name));
            }
            // (a single use that is no call: the graph returns it)
            let Some(&user) = self.users[cur.0 as usize].first() else { return Err(format!("the graph returns {}", g.node(cur).name)) };
            dead.push(user);
            match call(g, user) {
                Some((AtenOp::ToCopy, _, kw)) if is_plain_cast(kw) => cur = user,
                Some((AtenOp::View | AtenOp::UnsafeView | AtenOp::Expand, _, _)) if tensor(g, user).map(|t| t.numel()) == Some(numel) => {
                    cur = user
                }
                Some((AtenOp::Bmm, a, _)) if node_of(a.first()) == Some(cur) => return Ok(user),
                _ => return Err(format!("the probabilities reach {}", g.node(user).name)),
            }
        }
    }

    /// The node the fused call replaces: the second matmul, or its 4-D view (`[B, H, M, Kv]`;
    /// then true), or a cast of either back to the inputs' dtype; the nodes passed join `dead`.
    fn result_root(&self, bmm2: NodeId, shape: [i64; 4], dtype: DType, dead: &mut Vec<NodeId>) -> Result<(NodeId, bool), String> {
        let g = self.g;
        let (mut root, mut root_4d) = (bmm2, false);
        if let [view] = self.users[bmm2.0 as usize].as_slice() {
            if self.single_use(bmm2)
                && matches!(call(g, *view), Some((AtenOp::View | AtenOp::UnsafeView, _, _)))
                && tensor(g, *view).is_some_and(|t| t.shape == shape)
            {
                dead.push(bmm2);
                (root, root_4d) = (*view, true);
            }
        }
        let root_dtype = tensor(g, root).ok_or("the result is no tensor")?.dtype;
        if root_dtype != dtype {
            match self.users[root.0 as usize].as_slice() {
                [cast]
                    if self.single_use(root)
                        && matches!(call(g, *cast), Some((AtenOp::ToCopy, _, kw)) if is_plain_cast(kw))
                        && tensor(g, *cast).is_some_and(|t| t.dtype == dtype) =>
                {
                    dead.push(root);
                    root = *cast;
                }
                _ => return Err(format!("the result stays {root_dtype} where the inputs are {dtype}")),
            }
        }
        dead.retain(|&d| d != root);
        Ok((root, root_4d))
    }

    /// The fused call for these inputs, or why none takes them (`dims`: B, H, M, N, head dim).
    fn kernel(&self, device: Device, dtype: DType, dims: [i64; 5], masked: bool) -> Result<Kernel, String> {
        let [b, h, m, n, kdim] = dims;
        let kernel = Kernel::for_inputs(device, dtype, self.cuda_arch).ok_or("not on the CPU or CUDA")?;
        match kernel {
            Kernel::FlashCpu if b * h * m * n < CPU_MIN_SCORES => {
                Err(format!("{} scores: the CPU's generated kernels are faster below {CPU_MIN_SCORES}", b * h * m * n))
            }
            Kernel::Cudnn if kdim % 8 != 0 || kdim > 128 => Err(format!("head dim {kdim} (cuDNN takes multiples of 8 up to 128)")),
            Kernel::Efficient if kdim % 8 != 0 => Err(format!("head dim {kdim} is not a multiple of 8")),
            Kernel::Efficient if masked && n % 16 != 0 => {
                Err(format!("a float32 mask over {n} keys (the CUDA kernel wants rows of a multiple of 16)"))
            }
            _ => Ok(kernel),
        }
    }

    /// Whether ferrocore's attention kernel takes these inputs (`Kernel::Template`), or why not:
    /// half-precision or float32 CUDA inputs whose scores take a float32 bias no library call
    /// holds (an ALiBi slope x distance: wider than half types, or as large as the scores when
    /// stored for a float32 call), which would otherwise run unfused or stored, or a
    /// mask computed from positions (or a document id per position) that closes keys other
    /// than a causal one: the kernel computes the mask per tile of keys (a library call reads
    /// it stored, over every tile), and visits only the key tiles of a band the mask proves (a
    /// sliding window: 0.72x to 0.77x of Inductor's block-sparse FlexAttention on the H200
    /// over 1k to 8k keys, where cuDNN with the stored mask ran at 0.18x to 0.03x) or, for a
    /// mask read from tensors, the keys between each row's first and last open one. On the CPU
    /// the C++ kernel takes float32 inputs of at least `CPU_MIN_SCORES` scores whose bias differs
    /// between queries (in a training graph, a mask that closes keys).
    fn template(&self, device: Device, dtype: DType, dims: [i64; 5], wanted: bool, per_query: bool, masked: bool) -> Result<(), String> {
        let [b, h, m, n, kdim] = dims;
        if !wanted {
            return Err("no mask a library call cannot take as well".into());
        }
        if device == Device::Cpu && !self.triton_kernels {
            // the C++ kernel (`codegen::cpp::attention`): one row at a time, so only where it
            // skips columns or computes a bias the library call would read stored
            return match () {
                _ if dtype != DType::F32 => Err(format!("{dtype} inputs (the CPU's attention kernel takes float32)")),
                _ if b * h * m * n < CPU_MIN_SCORES => {
                    Err(format!("{} scores: the CPU's generated kernels are faster below {CPU_MIN_SCORES}", b * h * m * n))
                }
                _ if !per_query => Err("a mask the same for every query, which the library call reads stored".into()),
                // (the C++ backward recomputes the scores in both its kernels: over every key,
                // 1.9x the library call's time, 2x8x1024x1024 with ALiBi at 2 threads)
                _ if self.differentiable && !masked => Err("a training graph's bias that closes no keys".into()),
                _ => Ok(()),
            };
        }
        // (CPU tensors whose loops are Triton kernels run it in Triton's interpreter)
        let gpu = match device {
            Device::Cuda(_) => self.cuda_arch >= 80,
            _ => self.triton_kernels,
        };
        if !gpu || !self.triton_kernels || !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
            return Err("not half-precision or float32 inputs of Triton kernels on a GPU of sm_80 or later".into());
        }
        if ![16, 32, 64, 128].contains(&kdim) {
            return Err(format!("head dim {kdim} (the kernel takes 16, 32, 64 or 128)"));
        }
        Ok(())
    }

    /// The softmax's consumer: itself, or torch's safe softmax around it (`where(row all -inf,
    /// 0, softmax)`), whose nodes join `dead`.
    fn safe_softmax(&self, softmax: NodeId, x: NodeId, dead: &mut Vec<NodeId>) -> Result<(NodeId, bool), String> {
        let g = self.g;
        let users = &self.users[softmax.0 as usize];
        dead.push(softmax);
        if self.uses[softmax.0 as usize] == 1 {
            if self.uses[x.0 as usize] != 1 {
                return Err("the scores are read outside the attention".into());
            }
            return Ok((softmax, false));
        }
        let (Some(&zeros), Some(&select)) = (
            users.iter().find(|&&u| matches!(call(g, u), Some((AtenOp::FullLike, a, _)) if scalar_of(a.get(1)) == Some(0.0))),
            users.iter().find(|&&u| matches!(call(g, u), Some((AtenOp::WhereSelf, _, _)))),
        ) else {
            return Err("the probabilities are read outside the attention".into());
        };
        let (_, wargs, _) = call(g, select).unwrap();
        let cond = node_of(wargs.first()).ok_or("no condition")?;
        if users.len() != 2
            || self.uses[softmax.0 as usize] != 2
            || node_of(wargs.get(1)) != Some(zeros)
            || node_of(wargs.get(2)) != Some(softmax)
            || !self.single_use(zeros)
        {
            return Err("the probabilities are read outside the attention".into());
        }
        // cond = not(any(not(x == -inf), -1, keepdim))
        let mut chain = Vec::new();
        let mut cur = cond;
        for want in [AtenOp::LogicalNot, AtenOp::AnyDim, AtenOp::LogicalNot, AtenOp::EqScalar] {
            let Some((op, a, _)) = call(g, cur) else { return Err("an unknown row condition".into()) };
            if op != want || !self.single_use(cur) {
                return Err("an unknown row condition".into());
            }
            if op == AtenOp::EqScalar && (node_of(a.first()) != Some(x) || scalar_of(a.get(1)) != Some(f64::NEG_INFINITY)) {
                return Err("an unknown row condition".into());
            }
            chain.push(cur);
            if op != AtenOp::EqScalar {
                cur = node_of(a.first()).ok_or("an unknown row condition")?;
            }
        }
        if self.uses[x.0 as usize] != 2 {
            return Err("the scores are read outside the attention".into());
        }
        dead.extend(chain);
        dead.extend([zeros, select]);
        Ok((select, true))
    }
}

/// The step that fills with -inf exactly the keys after each query's own over square scores
/// (a causal mask, proven from how the graph builds it): the kernel's `is_causal` does the same,
/// and keeps every row open.
fn causal_fill(g: &Graph, steps: &[Step], [m, n]: [i64; 2]) -> Option<usize> {
    if m != n {
        return None;
    }
    let mut forms = Forms::new(g);
    steps.iter().position(|s| {
        let Step::Fill { cond, scores_if, .. } = s else { return false };
        let keeps = forms.of(*cond).and_then(|f| if *scores_if { Some(f) } else { f.negated() });
        keeps.as_ref().and_then(causal_offset) == Some(0)
    })
}

/// The shape of the bias the steps add to the scores (every mask operand broadcast), or None
/// when nothing is added.
fn bias_shape(g: &Graph, steps: &[Step]) -> Option<Vec<i64>> {
    let mut shape: Option<Vec<i64>> = None;
    for s in steps {
        let operands: Vec<NodeId> = match s {
            Step::Add(t) | Step::Subtract(t) => vec![*t],
            Step::Fill { cond, fill, .. } => vec![*cond, *fill],
            _ => continue,
        };
        for t in operands {
            let ts = tensor(g, t)?.shape.clone();
            shape = Some(match shape {
                None => ts,
                Some(s) => broadcast(&s, &ts)?,
            });
        }
    }
    shape
}

/// Dense strides for `[.., kv]` in the dim order of `q`'s strides (largest first, ties in dim
/// order): the layout cuDNN gives its output.
fn matching_strides(q: &TensorMeta, kv: i64) -> Vec<i64> {
    let mut shape = q.shape.clone();
    shape[3] = kv;
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(q.stride[i]));
    let mut strides = vec![0; shape.len()];
    let mut next = 1;
    for &i in order.iter().rev() {
        strides[i] = next;
        next *= shape[i].max(1);
    }
    strides
}

fn strided(shape: &[i64], stride: &[i64], dtype: DType, device: Device) -> Meta {
    Meta::Tensor(TensorMeta { shape: shape.to_vec(), stride: stride.to_vec(), storage_offset: 0, dtype, device })
}

/// New nodes for one fused attention, named and sourced after its softmax.
struct Emitter<'g, 'e> {
    g: &'g Graph,
    edit: &'e mut GraphEdit,
    like: NodeId,
    device: Device,
    kernel: Kernel,
}

impl Emitter<'_, '_> {
    fn push(&mut self, name: &str, target: Target, args: Vec<Arg>, kwargs: Vec<(String, Arg)>, meta: Meta) -> Arg {
        let node = Node { name: name.to_string(), kind: NodeKind::Call { target, args, kwargs }, meta };
        Arg::Node(self.edit.push(self.g, self.like, node))
    }

    fn aten(&mut self, name: &str, op: AtenOp, args: Vec<Arg>, meta: Meta) -> Arg {
        self.push(name, Target::Aten(op), args, vec![], meta)
    }

    fn meta(&self, a: &Arg) -> TensorMeta {
        match a {
            Arg::Node(n) => self.edit.meta(self.g, *n).tensor().cloned().expect("attention values are tensors"),
            _ => unreachable!("attention values are nodes"),
        }
    }

    fn dense(&self, shape: &[i64], dtype: DType) -> Meta {
        dense_meta(shape, dtype, self.device)
    }

    fn cast(&mut self, a: Arg, dtype: DType) -> Arg {
        let t = self.meta(&a);
        if t.dtype == dtype {
            return a;
        }
        let meta = self.dense(&t.shape, dtype);
        self.push("mask_cast", Target::Aten(AtenOp::ToCopy), vec![a], vec![("dtype".into(), Arg::DType(dtype))], meta)
    }

    fn scalar(&mut self, value: f64, dtype: DType) -> Arg {
        let kwargs = vec![("dtype".into(), Arg::DType(dtype)), ("device".into(), Arg::Device(self.device))];
        let meta = self.dense(&[], dtype);
        self.push("scalar", Target::Aten(AtenOp::ScalarTensor), vec![Arg::Float(value)], kwargs, meta)
    }

    /// The operand as `[B, H, rows, head]`: the node itself, or its last two dims swapped back.
    fn operand(&mut self, o: &Operand, name: &str) -> Arg {
        if !o.flipped {
            return Arg::Node(o.node);
        }
        let t = tensor(self.g, o.node).expect("a matched operand is a tensor");
        let (mut shape, mut stride) = (t.shape.clone(), t.stride.clone());
        shape.swap(2, 3);
        stride.swap(2, 3);
        let perm = Arg::List([0, 1, 3, 2].iter().map(|&d| Arg::Int(d)).collect());
        self.aten(name, AtenOp::Permute, vec![Arg::Node(o.node), perm], strided(&shape, &stride, t.dtype, t.device))
    }

    /// The masks replayed on zero scores, in float32 (a -inf stays -inf), step `skip` left out,
    /// and the product of the scales the steps apply to the scores.
    fn replay(&mut self, steps: &[Step], skip: Option<usize>) -> (Option<Arg>, f64) {
        let f32 = DType::F32;
        let (mut bias, mut scale): (Option<Arg>, f64) = (None, 1.0);
        for (i, step) in steps.iter().enumerate() {
            if Some(i) == skip {
                continue;
            }
            match step {
                Step::Reshape | Step::Cast | Step::Open => {}
                Step::Scale(c) | Step::Divide(c) => {
                    let op = if matches!(step, Step::Scale(_)) { AtenOp::MulTensor } else { AtenOp::DivTensor };
                    scale *= if op == AtenOp::MulTensor { *c } else { 1.0 / *c };
                    if let Some(bn) = bias.take() {
                        let meta = self.dense(&self.meta(&bn).shape, f32);
                        bias = Some(self.aten("mask_scaled", op, vec![bn, Arg::Float(*c)], meta));
                    }
                }
                Step::Add(t) | Step::Subtract(t) => {
                    let t = self.cast(Arg::Node(*t), f32);
                    let add = matches!(step, Step::Add(_));
                    bias = Some(match bias.take() {
                        None if add => t,
                        None => {
                            let meta = self.dense(&self.meta(&t).shape, f32);
                            self.aten("mask_neg", AtenOp::Neg, vec![t], meta)
                        }
                        Some(bn) => {
                            let s = broadcast(&self.meta(&bn).shape, &self.meta(&t).shape).expect("checked by the match");
                            let op = if add { AtenOp::AddTensor } else { AtenOp::SubTensor };
                            let meta = self.dense(&s, f32);
                            self.aten("mask_sum", op, vec![bn, t], meta)
                        }
                    });
                }
                Step::Fill { cond, fill, scores_if } => {
                    let fill = self.cast(Arg::Node(*fill), f32);
                    let kept = match bias.take() {
                        Some(bn) => bn,
                        None => self.scalar(0.0, f32),
                    };
                    let cond = Arg::Node(*cond);
                    let s = [&kept, &fill]
                        .iter()
                        .try_fold(self.meta(&cond).shape, |s, a| broadcast(&s, &self.meta(a).shape))
                        .expect("checked by the match");
                    let args = if *scores_if { vec![cond, kept, fill] } else { vec![cond, fill, kept] };
                    let meta = self.dense(&s, f32);
                    bias = Some(self.aten("mask", AtenOp::WhereSelf, args, meta));
                }
            }
        }
        (bias, scale)
    }

    /// The bias with leading dims of 1 up to 4-D.
    fn four_d(&mut self, mut bias: Arg) -> Arg {
        while self.meta(&bias).shape.len() < 4 {
            let t = self.meta(&bias);
            let (mut s, mut st) = (t.shape.clone(), t.stride.clone());
            s.insert(0, 1);
            st.insert(0, t.shape.first().copied().unwrap_or(1) * t.stride.first().copied().unwrap_or(1));
            bias = self.aten("mask_4d", AtenOp::Unsqueeze, vec![bias, Arg::Int(0)], strided(&s, &st, t.dtype, t.device));
        }
        bias
    }

    /// The rows of the whole mask (`[.., rows, 1]`) where every key is -inf, and where `nan`,
    /// the rows it makes NaN (a +inf meeting a -inf): eager's softmax gives NaN in those.
    fn row_fixes(&mut self, full: Arg, nan: bool) -> (Arg, Option<Arg>) {
        let full = self.four_d(full);
        let t = self.meta(&full);
        let mut row = t.shape.clone();
        row[3] = 1;
        let (each_meta, row_meta) = (self.dense(&t.shape, DType::Bool), self.dense(&row, DType::Bool));
        let open = self.aten("mask_open", AtenOp::NeScalar, vec![full.clone(), Arg::Float(f64::NEG_INFINITY)], each_meta.clone());
        let any_open = self.aten("mask_row_open", AtenOp::AnyDim, vec![open, Arg::Int(-1), Arg::Bool(true)], row_meta.clone());
        let closed = self.aten("mask_row_closed", AtenOp::LogicalNot, vec![any_open], row_meta.clone());
        let nan_rows = nan.then(|| {
            let each = self.aten("mask_nan", AtenOp::IsNan, vec![full], each_meta);
            self.aten("mask_row_nan", AtenOp::AnyDim, vec![each, Arg::Int(-1), Arg::Bool(true)], row_meta)
        });
        (closed, nan_rows)
    }

    /// The bias as the call takes it: 4-D, the inputs' dtype, on CUDA the scores' full shape by
    /// zero strides.
    fn call_bias(&mut self, bias: Arg, full: [i64; 4], dtype: DType) -> Arg {
        let mut bias = self.four_d(bias);
        let t = self.meta(&bias);
        bias = self.cast(bias, dtype);
        if self.kernel == Kernel::Efficient && t.shape != full {
            // the memory-efficient kernel takes a bias of the scores' full shape
            let t = self.meta(&bias);
            let stride: Vec<i64> = (0..4).map(|i| if t.shape[i] == full[i] { t.stride[i] } else { 0 }).collect();
            let dims = Arg::List(full.iter().map(|&d| Arg::Int(d)).collect());
            bias = self.aten("mask_full", AtenOp::Expand, vec![bias, dims], strided(&full, &stride, dtype, self.device));
        }
        bias
    }
}

/// Writes the fused call for `m` into `edit`; a line saying what it replaced. `log_sum_exp`: the
/// call is differentiated, so it computes the log-sum-exp its backward reads.
fn emit(g: &Graph, edit: &mut GraphEdit, m: &Match, log_sum_exp: bool) -> String {
    let first = edit.mark();
    let [b, h, rows, keys, _, kv] = m.dims;
    let (dt, dev) = (m.dtype, m.device);
    let kernel = m.kernel;
    let mut e = Emitter { g, edit, like: m.softmax, device: dev, kernel };
    let q = e.operand(&m.q, "query");
    let k = e.operand(&m.k, "key");
    let v = e.operand(&m.v, "value");
    // the library kernels apply a causal mask themselves: their bias is every other mask
    let skip = if kernel == Kernel::Template { None } else { m.causal };
    let (bias, chain_scale) = e.replay(&m.steps, skip);
    let scale = m.q.scale * m.k.scale * chain_scale;
    // rows the mask fills with -inf entirely: eager's softmax gives NaN there (0 under the safe
    // softmax); the kernels give 0 and a log-sum-exp that does not tell (0 on the CPU). Found
    // from the whole mask, the causal one included; where the call leaves the causal mask out
    // of its bias, a +inf it would have met is found there too
    let row_fixes = match (&bias, m.causal) {
        _ if m.rows_open => None,
        // (the template gives such rows 0, as the safe softmax does)
        _ if kernel == Kernel::Template && m.safe => None,
        (Some(bn), _) if kernel == Kernel::Template => Some(e.row_fixes(bn.clone(), false)),
        (_, Some(_)) => e.replay(&m.steps, None).0.map(|full| e.row_fixes(full, true)),
        (Some(bn), None) => Some(e.row_fixes(bn.clone(), false)),
        (None, None) => None,
    };
    let bias = match kernel {
        // (float32, as the graph computes it)
        Kernel::Template => bias.map(|bn| e.four_d(bn)),
        _ => bias.map(|bn| e.call_bias(bn, [b, h, rows, keys], dt)),
    };
    let has_bias = bias.is_some();
    let causal = Arg::Bool(m.causal.is_some());
    // the call; its output is laid out [B, rows, H, head] and seen as [B, H, rows, head]
    // (cuDNN's in the query's dim order); a library result laid out otherwise is copied
    let out_meta = match kernel {
        Kernel::Cudnn | Kernel::Template => strided(&[b, h, rows, kv], &matching_strides(&e.meta(&q), kv), dt, dev),
        _ => strided(&[b, h, rows, kv], &[rows * h * kv, kv, h * kv, 1], dt, dev),
    };
    let scale_kw = ("scale".to_string(), Arg::Float(scale));
    let bias = bias.unwrap_or(Arg::None);
    let (args, kwargs, meta) = match kernel {
        Kernel::Cudnn => {
            let lse = Arg::Bool(log_sum_exp);
            let args = vec![q, k, v, bias, lse, Arg::Float(0.0), causal, Arg::Bool(false)];
            let mut items = vec![Some(out_meta.clone())];
            items.resize(9, None);
            (args, vec![scale_kw], Meta::Tuple(items))
        }
        Kernel::Efficient => {
            let args = vec![q, k, v, bias, Arg::Bool(log_sum_exp), Arg::Float(0.0), causal];
            (args, vec![scale_kw], Meta::Tuple(vec![Some(out_meta.clone()), None, None, None]))
        }
        Kernel::Template => {
            // (the bias holds every mask, the causal one too: the kernel reads its band from it)
            let args = vec![q, k, v, bias, Arg::Float(0.0), Arg::Bool(false), Arg::Bool(false)];
            // the log-sum-exp of each row's scores, which the backward reads (float32, [B, H, M])
            let lse = log_sum_exp.then(|| dense_meta(&[b, h, rows], DType::F32, dev));
            let mut items = vec![Some(out_meta.clone()), lse];
            items.resize(9, None);
            (args, vec![scale_kw], Meta::Tuple(items))
        }
        Kernel::FlashCpu => {
            let args = vec![q, k, v, Arg::Float(0.0), causal];
            let lse = strided(&[b, h, rows], &[rows * h, 1, h], DType::F32, dev);
            (args, vec![("attn_mask".into(), bias), scale_kw], Meta::Tuple(vec![Some(out_meta.clone()), Some(lse)]))
        }
    };
    let callee = kernel.op();
    let call = e.push("attention", Target::Aten(callee), args, kwargs, meta);
    let root_meta = g.node(m.root).meta.clone();
    let result_meta = if m.root_4d { root_meta.clone() } else { dense_meta(&[b, h, rows, kv], dt, dev) };
    let mut result = e.push("attention_out", Target::GetItem, vec![call, Arg::Int(0)], vec![], out_meta.clone());
    if let Some((closed, nan_rows)) = row_fixes {
        if let Some(nan_rows) = nan_rows {
            let nan = e.scalar(f64::NAN, dt);
            result = e.aten("attention_nan_rows", AtenOp::WhereSelf, vec![nan_rows, nan, result], result_meta.clone());
        }
        let fill = e.scalar(if m.safe { 0.0 } else { f64::NAN }, dt);
        result = e.aten("attention_rows", AtenOp::WhereSelf, vec![closed, fill, result], result_meta.clone());
    } else if m.root_4d && m.root_is_output && out_meta != result_meta {
        // a graph output keeps eager's strides
        let kwargs = vec![("memory_format".into(), Arg::MemoryFormat("contiguous_format".into()))];
        result = e.push("attention_dense", Target::Aten(AtenOp::Clone), vec![result], kwargs, result_meta.clone());
    }
    if !m.root_4d {
        let shape = root_meta.tensor().map(|t| t.shape.clone()).unwrap_or_default();
        let dims = Arg::List(shape.iter().map(|&d| Arg::Int(d)).collect());
        result = e.aten("attention_3d", AtenOp::View, vec![result, dims], root_meta);
    }
    let Arg::Node(by) = result else { unreachable!("push returns a node") };
    edit.replace(m.root, first, by, m.dead.iter().copied());
    format!(
        "{} .. {} -> {} (B={b} H={h} M={rows} N={keys}, {dt}, scale {scale}, {}{})",
        g.node(m.bmm1).name,
        g.node(m.root).name,
        callee.name(),
        match (has_bias, m.causal.is_some()) {
            (true, true) => "causal, masked",
            (true, false) => "masked",
            (false, true) => "causal",
            (false, false) => "no mask",
        },
        if m.safe { ", safe softmax" } else { "" }
    )
}

#[cfg(test)]
mod tests;
