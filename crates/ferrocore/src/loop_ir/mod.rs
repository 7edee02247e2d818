//! The loop-level IR: buffers with layouts, and `LoopNode`s (Pointwise or Reduction) whose body
//! is a small expression program over loop variables. One body is read many ways through the
//! [`OpsHandler`] trait: printed, analysed for dependencies, rendered by each backend.
//! This module does not know about ATen or about any backend.

mod body;
mod bounds;
mod direct;
mod print;
mod verify;

pub use body::*;
pub use bounds::OutOfBounds;

use crate::graph::{DType, Device};
use crate::symbolic::{IndexExpr, Var};

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct BufferId(pub u32);

#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
    pub offset: i64,
    pub dtype: DType,
    pub device: Device,
}

/// Elements a storage must hold for a view of these sizes, strides and offset (0 when empty).
pub fn storage_numel(size: &[i64], stride: &[i64], offset: i64) -> i64 {
    if size.contains(&0) {
        return 0;
    }
    offset + size.iter().zip(stride).map(|(s, st)| (s - 1) * st).sum::<i64>() + 1
}

impl Layout {
    pub fn contiguous(size: &[i64], dtype: DType, device: Device) -> Layout {
        Layout { size: size.to_vec(), stride: contiguous_strides(size), offset: 0, dtype, device }
    }
    pub fn numel(&self) -> i64 {
        self.size.iter().product()
    }
    /// Elements the storage must hold to back this layout.
    pub fn storage_numel(&self) -> i64 {
        storage_numel(&self.size, &self.stride, self.offset)
    }
    /// Index of element `idx` (one expression per dim).
    pub fn index_of(&self, idx: &[IndexExpr]) -> IndexExpr {
        let mut e = IndexExpr::constant(self.offset);
        for (i, st) in idx.iter().zip(&self.stride) {
            e = e.add(&i.scale(*st));
        }
        e
    }
}

pub fn contiguous_strides(size: &[i64]) -> Vec<i64> {
    let mut strides = vec![1; size.len()];
    let mut acc = 1i64;
    for i in (0..size.len()).rev() {
        strides[i] = acc;
        acc *= size[i].max(1);
    }
    strides
}

/// Where a buffer's contents come from.
#[derive(Clone, Debug, PartialEq)]
pub enum BufferSource {
    /// Graph input number `i`.
    Input(usize),
    /// Written by loop nodes (one, or several writing disjoint regions, as for `cat`).
    Computed,
    /// Returned by an extern/fallback call (index in `LoopProgram::externs`), element `item`
    /// of its result when the call returns a tuple.
    Extern { call: usize, item: Option<usize> },
}

#[derive(Clone, Debug)]
pub struct Buffer {
    pub name: String,
    pub layout: Layout,
    pub source: BufferSource,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum NodeKind {
    Pointwise,
    Reduction,
    /// Stores a running combine along its one reduction variable at every step.
    Scan,
}

/// One computed buffer: `ranges` are the output loop variables `v0..vn`, `reduction_ranges`
/// the reduction variables `vn..vn+m`. The body stores exactly once, into `output`.
#[derive(Clone, Debug)]
pub struct LoopNode {
    pub output: BufferId,
    pub ranges: Vec<i64>,
    pub reduction_ranges: Vec<i64>,
    pub body: LoopBody,
    /// FX node names this node computes (for kernel names and logs).
    pub origins: Vec<String>,
    /// A node a backend renders from a template rather than by walking its loops.
    pub template: Option<Template>,
}

/// The templates a loop node may be (`LoopNode::template`).
#[derive(Clone, Debug, PartialEq)]
pub enum Template {
    /// A matrix product: output ranges `[batch.., m, n]`, one reduction variable `k`, and a body
    /// that sums `a[.., m, k] * b[.., k, n]` (two loads, their casts, one product) and casts the
    /// sum to the output's type. Any backend may compute it as written; a GPU backend renders it
    /// as a tiled matrix product (`codegen::triton::template`). Loop passes leave it as built, and
    /// only pointwise nodes over its outputs join its kernel (its epilogue). An operand may be
    /// computed in the body from what it reads (a prologue); `operands` is the type both are
    /// multiplied in, each then cast to float32 (which tells that cast from one the operand's
    /// own computation ends with).
    MatrixProduct {
        operands: DType,
    },
    /// A 2-D convolution as an implicit matrix product: output ranges `[N, OH, OW, O]` (the
    /// order of its channels-last output, stored contiguously in it), reduction ranges
    /// `[KH, KW, C]`, and a body that sums `input[n, c, ih, iw] * weight[o, c, kh, kw]` in
    /// float32 (`ih = oh·stride + kh·dilation - padding`; a read outside the input is 0: a
    /// `LoadIndirect` at the clamped position under a `Where`) and casts the sum to the output's
    /// type. Any backend may compute it as written; a GPU backend renders it as a tiled matrix
    /// product whose rows are output pixels and columns output channels. Loop passes and fusion
    /// treat it as a `MatrixProduct`. A depthwise one (`ConvGeometry::depthwise`) sums over
    /// `[KH, KW]` alone, reading `input[n, o, ih, iw] * weight[o, 0, kh, kw]`.
    Convolution(ConvGeometry),
    Attention(Attention),
    /// A further result of the attention kernel that computes buffer `of` (its head node, which
    /// comes first): the node's body is a stand-in that reads nothing, and only that kernel
    /// writes it (`AttentionResult`). The scheduler places it in the head's kernel.
    AttentionResult {
        of: BufferId,
        result: AttentionResult,
    },
}

/// What a convolution template's body does not say plainly: the input's spatial size and the
/// convolution's stride, padding and dilation (per spatial dim).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConvGeometry {
    pub input_hw: [i64; 2],
    pub stride: [i64; 2],
    pub padding: [i64; 2],
    pub dilation: [i64; 2],
    /// Depthwise: each output channel convolves its own input channel (groups = channels, one
    /// filter per group); the sum runs over the taps alone.
    pub depthwise: bool,
}

/// The results an attention kernel writes beside its head's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AttentionResult {
    /// Each query row's log-sum-exp of its scores (float32 `[B, H, M]`, natural log; -inf for
    /// a row whose keys are all closed), which the backward reads.
    LogSumExp,
    /// The values' gradient `[B, H, N, D]`, beside the keys' (`AttentionPass::GradKeyValue`).
    GradValue,
}

/// Fused attention over output ranges `[B, H, M, D]` and keys `n` (the reduction variable):
/// `out[b, h, m] = softmax_n(q[b, h, m] · k[b, h, n] · scale + bias(b, h, m, n)) · v[b, h, n]`,
/// where the bias (float32, -inf where a mask closes a key) is the body's value `bias`, computed
/// over variables (b, h, m, n) = (0, 1, 2, 4) from the exprs before it. A row whose keys are all
/// closed gives 0. The rest of the body reads q, k and v at (b, h, m, d) and (b, h, n, d) (what
/// the scheduler and the memory plan see of the node) and sums their product with the bias over
/// n: a stand-in, not the node's value; only an attention template (Triton, C++)
/// computes it. Loop passes leave it as built, and nothing joins its kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Attention {
    pub scale: f64,
    pub bias: ValueId,
    pub q: ValueId,
    pub k: ValueId,
    pub v: ValueId,
    /// Where the bias reads tensors (a document id per key), so that no bound on the keys a
    /// query sees follows from positions alone: loads, at (b, h, m), of the first and the last
    /// key the bias leaves open for that row (`KeyRange` nodes compute them before this one).
    pub keys: Option<KeyRange>,
    pub pass: AttentionPass,
}

/// Which of attention's kernels a node is. The backward's two recompute the probabilities from
/// the scores and the forward's log-sum-exp (flash attention's backward).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AttentionPass {
    Forward,
    /// The queries' gradient over `[B, H, M, D]`, summed over the keys: `dq = scale ·
    /// Σ_n p·(dp - delta)·k` with `dp = grad_out · v`.
    GradQuery(Grads),
    /// The keys' gradient over `[B, H, N, D]`, summed over the queries (variables (b, h, n, d)
    /// then m: the bias and the rows are the keys' here), and the values' beside it
    /// (`AttentionResult::GradValue`).
    GradKeyValue(Grads),
}

/// What the backward reads beside the forward's operands: loads of the output's gradient (at
/// the query row), the forward's log-sum-exp and `delta = Σ_d grad_out · out` (each at
/// (b, h, query)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Grads {
    pub grad_out: ValueId,
    pub lse: ValueId,
    pub delta: ValueId,
}

/// The open keys of each query row of an attention: two int32 buffers over `[B', H', M]` (B' is
/// 1 where the bias does not vary over the batch, H' likewise), computed by reductions over the
/// keys of the bias (`min` of the open keys' positions, N where none is open; `max`, -1 where
/// none is), and the attention body's loads of them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KeyRange {
    pub first: ValueId,
    pub last: ValueId,
}

impl LoopNode {
    pub fn kind(&self) -> NodeKind {
        if self.body.exprs.iter().any(|e| matches!(e, Expr::Scan(..))) {
            NodeKind::Scan
        } else if self.body.exprs.iter().any(|e| matches!(e, Expr::Reduce(..) | Expr::ArgReduce(..))) {
            NodeKind::Reduction
        } else {
            NodeKind::Pointwise
        }
    }
    /// A matrix product, explicit or a convolution's implicit one: a template whose kernel
    /// only pointwise readers of its outputs join.
    pub fn is_matrix_product(&self) -> bool {
        matches!(self.template, Some(Template::MatrixProduct { .. } | Template::Convolution(_)))
    }
    /// The type a matrix product's operands are multiplied in (not a convolution's).
    pub fn product_operands(&self) -> Option<DType> {
        match &self.template {
            Some(Template::MatrixProduct { operands }) => Some(*operands),
            _ => None,
        }
    }
    pub fn convolution(&self) -> Option<&ConvGeometry> {
        match &self.template {
            Some(Template::Convolution(g)) => Some(g),
            _ => None,
        }
    }
    pub fn attention(&self) -> Option<&Attention> {
        match &self.template {
            Some(Template::Attention(a)) => Some(a),
            _ => None,
        }
    }
    /// The attention kernel's head whose kernel writes this node too, and what the node is.
    pub fn attention_result(&self) -> Option<(BufferId, AttentionResult)> {
        match &self.template {
            Some(Template::AttentionResult { of, result }) => Some((*of, *result)),
            _ => None,
        }
    }
    /// Whether the node is part of an attention kernel (its body a stand-in).
    pub fn is_attention_part(&self) -> bool {
        matches!(self.template, Some(Template::Attention(_) | Template::AttentionResult { .. }))
    }
    /// Sizes of all variables, output ranges first.
    pub fn var_ranges(&self) -> Vec<i64> {
        self.ranges.iter().chain(&self.reduction_ranges).copied().collect()
    }
    pub fn reads(&self) -> Vec<(BufferId, IndexExpr)> {
        let mut out = Vec::new();
        for e in &self.body.exprs {
            if let Expr::Load { buf, index } | Expr::LoadIndirect { buf, index, .. } = e {
                if !out.iter().any(|(b, i)| b == buf && i == index) {
                    out.push((*buf, index.clone()));
                }
            }
        }
        out
    }
    /// Whether the body reports out-of-range indices (the kernel's return value).
    pub fn checks_indices(&self) -> bool {
        self.body.exprs.iter().any(|e| matches!(e, Expr::CheckIndex { .. }))
    }
    /// Whether the node updates its (already filled) output at data-dependent places.
    pub fn is_scatter(&self) -> bool {
        self.body.store.as_ref().is_some_and(|s| s.is_scatter())
    }
    pub fn var(i: usize) -> Var {
        Var(i as u32)
    }
}

/// An argument of an extern/fallback call as the wrapper must render it.
#[derive(Clone, Debug, PartialEq)]
pub enum ExternArg {
    Buffer(BufferId),
    /// A strided view of a buffer (size, stride, storage offset).
    View {
        buf: BufferId,
        size: Vec<i64>,
        stride: Vec<i64>,
        offset: i64,
    },
    /// A constant (the wrapper writes it as a Python literal).
    Literal(Literal),
    List(Vec<ExternArg>),
}

/// A constant argument of an extern call, kept as a value: the wrapper writes it through its
/// literal writer, so no text from the graph is ever pasted into the module.
#[derive(Clone, Debug, PartialEq)]
pub enum Literal {
    None,
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    DType(DType),
    Device(Device),
    /// A torch layout / memory format by attribute name (`strided`, `channels_last`).
    Layout(String),
    MemoryFormat(String),
    /// A size, written as a tuple.
    Shape(Vec<i64>),
}

#[derive(Clone, Debug)]
pub struct ExternCall {
    /// Python callable, e.g. `torch.ops.aten.mm.default`.
    pub callee: String,
    pub args: Vec<ExternArg>,
    pub kwargs: Vec<(String, ExternArg)>,
    /// The buffers this call returns (several for tuple results).
    pub outputs: Vec<BufferId>,
    /// Whether this is a fallback (unsupported op), not a deliberate library call.
    pub fallback: bool,
    pub origin: String,
    /// Why this op runs through ATen (fallbacks only).
    pub reason: Option<String>,
    /// Why the call must not be recorded in a CUDA graph (it synchronizes with the host, or its
    /// capture safety is unknown); None when replaying a recording of it is safe.
    pub capture_hazard: Option<String>,
}

impl ExternCall {
    /// Every buffer the call reads, positional and keyword arguments alike.
    pub fn input_buffers(&self) -> Vec<BufferId> {
        fn walk(a: &ExternArg, out: &mut Vec<BufferId>) {
            match a {
                ExternArg::Buffer(b) | ExternArg::View { buf: b, .. } => out.push(*b),
                ExternArg::List(items) => items.iter().for_each(|i| walk(i, out)),
                ExternArg::Literal(_) => {}
            }
        }
        let mut out = Vec::new();
        self.args.iter().chain(self.kwargs.iter().map(|(_, a)| a)).for_each(|a| walk(a, &mut out));
        out
    }

    /// Whether the call's results are always new tensors of their own, never views of its
    /// arguments (GEMMs, convolutions, fused attention): their storage is the program's to
    /// reuse once they die.
    pub fn returns_new_storage(&self) -> bool {
        const FRESH: [&str; 8] = [
            "torch.ops.aten.mm.",
            "torch.ops.aten.addmm.",
            "torch.ops.aten.bmm.",
            "torch.ops.aten.baddbmm.",
            "torch.ops.aten.convolution.",
            "torch.ops.aten.convolution_backward.",
            "torch.ops.aten._scaled_dot_product_",
            "torch.ops.aten._flash_attention",
        ];
        !self.fallback && FRESH.iter().any(|f| self.callee.starts_with(f))
    }
}

/// A graph output as the wrapper returns it.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputValue {
    Buffer(BufferId),
    View { buf: BufferId, size: Vec<i64>, stride: Vec<i64>, offset: i64 },
    None,
}

/// One step of the program in dependency order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Node(usize),
    Extern(usize),
}

/// The whole lowered graph: buffers, loop nodes, extern calls, in program order.
#[derive(Clone, Debug, Default)]
pub struct LoopProgram {
    pub buffers: Vec<Buffer>,
    pub nodes: Vec<LoopNode>,
    pub externs: Vec<ExternCall>,
    pub steps: Vec<Step>,
    pub inputs: Vec<BufferId>,
    pub input_names: Vec<String>,
    pub outputs: Vec<OutputValue>,
    /// Inputs whose storage the program may write once it has read them for the last time
    /// (`Graph::donated_inputs`; the wrapper copies one whose storage something else shares).
    pub donated: Vec<BufferId>,
    /// Donated inputs that results are written over (once each).
    pub donated_writes: Vec<DonatedWrite>,
    /// `as_strided` views of inputs: the wrapper checks at run time that each lies within its
    /// input's storage (only then is the storage's size known).
    pub input_storage_views: Vec<InputStorageView>,
    /// Graph node name -> its model source line (`Graph::sources`), for the module's comments.
    pub sources: std::collections::HashMap<String, String>,
}

/// An `as_strided` view of a graph input, in elements from the input's data pointer.
#[derive(Clone, Debug, PartialEq)]
pub struct InputStorageView {
    pub input: BufferId,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
    pub offset: i64,
    /// The input's storage offset the view was compiled for, where the view names its storage
    /// offset (an absolute position in the storage, not one relative to the input).
    pub storage_offset: Option<i64>,
}

/// A donated input whose storage results take over.
#[derive(Clone, Debug, PartialEq)]
pub struct DonatedWrite {
    pub buffer: BufferId,
    /// Elements its storage must hold from its data pointer (more than its view where a padded
    /// result takes it).
    pub extent: i64,
    /// A buffer that may outlive the call (a graph output, or one a library call may return a
    /// view of) ends up in its storage.
    pub escapes: bool,
}

impl LoopProgram {
    pub fn buffer(&self, id: BufferId) -> &Buffer {
        &self.buffers[id.0 as usize]
    }
    pub fn add_buffer(&mut self, layout: Layout, source: BufferSource) -> BufferId {
        let id = BufferId(self.buffers.len() as u32);
        let name = match source {
            BufferSource::Input(i) => input_buffer_name(i, self.input_names.get(i).map_or("", String::as_str)),
            _ => format!("buf{}", id.0),
        };
        self.buffers.push(Buffer { name, layout, source });
        id
    }
}

/// The name of input `i`'s buffer in the loop IR: the graph's name where it is an identifier
/// that no name the IR makes can be (`buf{n}`, `arg{n}`), else `arg{i}`. The wrapper module
/// takes its own names beside these (`wrapper::names`).
pub fn input_buffer_name(i: usize, graph_name: &str) -> String {
    let generated = |prefix: &str| graph_name.strip_prefix(prefix).is_some_and(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()));
    if crate::graph::names::is_identifier(graph_name) && !generated("buf") && !generated("arg") {
        graph_name.to_string()
    } else {
        format!("arg{i}")
    }
}
