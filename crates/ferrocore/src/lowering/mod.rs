//! ATen graph -> loop IR. Each FX node becomes a `TensorValue`: a strided view of a buffer or a
//! lazily built pointwise function of its index. Pointwise chains stay lazy and are inlined into
//! their consumers; reductions, graph outputs, extern-call inputs and values that are expensive to
//! recompute are realized into buffers. Views never copy: they remap indices. An op we cannot
//! lower becomes a logged ATen fallback call, never an error.

mod attention;
mod conv_template;
mod cpu_conv;
mod creation;
mod externs;
mod indexing;
mod layout;
mod matmul;
mod mutation;
mod pointwise;
mod pooling;
mod random;
mod reduction;
mod sampling;
mod scatter;
mod views;

use crate::codegen::KernelLanguage;
use crate::graph::{Arg, AtenOp, DType, Device, Graph, Meta, NodeId, NodeKind, Target, TensorMeta};
use crate::loop_ir::*;
use crate::symbolic::{IndexExpr, Var};
pub use cpu_conv::runs_compiled as cpu_conv_runs_compiled;
use externs::{is_custom_op, ExternKind};
pub use layout::{channels_last_strides, ConvLayout};
pub use matmul::{GemmTemplate, PadMm, ALIGN as GEMM_ALIGN};
use std::collections::HashSet;
use std::fmt;
use std::rc::Rc;

/// Builds one loop body: the arena plus the ranges of the body's variables.
pub struct Bx<'a> {
    pub body: &'a mut LoopBody,
    pub ranges: Vec<i64>,
}

pub type LoadFn = Rc<dyn Fn(&mut Bx, &[IndexExpr]) -> ValueId>;
pub type IndexFn = Rc<dyn Fn(&[IndexExpr], &[i64]) -> IndexExpr>;
/// Maps an index of a view to the index of its base.
pub type ReindexFn = Rc<dyn Fn(&[IndexExpr], &[i64]) -> Vec<IndexExpr>>;

#[derive(Clone)]
pub enum Src {
    /// Elements live in `buf` at `index(idx)`.
    View { buf: BufferId, index: IndexFn },
    /// Computed from the index; `reads`/`ops` estimate the cost of recomputing it.
    Lazy { f: LoadFn, reads: usize, ops: usize },
}

#[derive(Clone)]
pub struct TensorValue {
    pub size: Vec<i64>,
    pub dtype: DType,
    pub device: Device,
    pub src: Src,
}

impl TensorValue {
    /// A lazily computed value; `reads`/`ops` estimate what recomputing one element costs.
    pub fn lazy(
        size: Vec<i64>,
        dtype: DType,
        device: Device,
        reads: usize,
        ops: usize,
        f: impl Fn(&mut Bx, &[IndexExpr]) -> ValueId + 'static,
    ) -> TensorValue {
        TensorValue { size, dtype, device, src: Src::Lazy { f: Rc::new(f), reads, ops } }
    }
    pub fn load(&self, bx: &mut Bx, idx: &[IndexExpr]) -> ValueId {
        match &self.src {
            Src::View { buf, index } => {
                let i = index(idx, &bx.ranges);
                bx.body.load(*buf, i, self.dtype)
            }
            Src::Lazy { f, .. } => f(bx, idx),
        }
    }
    pub fn cost(&self) -> (usize, usize) {
        match &self.src {
            Src::View { .. } => (1, 0),
            Src::Lazy { reads, ops, .. } => (*reads, *ops),
        }
    }
    pub fn numel(&self) -> i64 {
        self.size.iter().product()
    }
    /// (size, stride, offset) when this is an affine view of a buffer.
    pub fn strided(&self) -> Option<(BufferId, Vec<i64>, i64)> {
        let Src::View { buf, index } = &self.src else { return None };
        let vars: Vec<IndexExpr> = (0..self.size.len()).map(|i| IndexExpr::var(Var(i as u32))).collect();
        let e = index(&vars, &self.size);
        let mut strides = Vec::new();
        for i in 0..self.size.len() {
            strides.push(if self.size[i] == 1 { 0 } else { e.affine_coeff(Var(i as u32))? });
        }
        // torch tensors cannot have negative strides (a flipped view): such views are copied
        if strides.iter().any(|&s| s < 0) {
            return None;
        }
        if e.terms.iter().any(|(a, _)| !matches!(a, crate::symbolic::Atom::Var(_))) {
            return None;
        }
        // size-1 dims: any stride works; use the contiguous one like torch does for fresh views.
        let contiguous = contiguous_strides(&self.size);
        for i in 0..self.size.len() {
            if self.size[i] == 1 {
                strides[i] = contiguous[i];
            }
        }
        Some((*buf, strides, e.constant))
    }
}

#[derive(Clone)]
pub enum Lowered {
    Tensor(TensorValue),
    Tuple(Vec<Option<Lowered>>),
    /// A node whose value is not used by compiled code (e.g. a dropped tuple element).
    Nothing,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LowerErrorKind {
    /// The graph itself is wrong (bad argument types, inconsistent shapes): a user-visible error.
    Malformed,
    /// Valid, but ferrocore has no lowering for this combination: falls back to ATen.
    Unsupported,
}

#[derive(Debug, Clone)]
pub struct LowerError {
    pub node: String,
    pub target: String,
    pub kind: LowerErrorKind,
    pub message: String,
}

impl fmt::Display for LowerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lowering: node '{}' ({}): {}", self.node, self.target, self.message)
    }
}
impl std::error::Error for LowerError {}

/// Result of a lowering function before the node's name is attached.
pub type LResult<T> = Result<T, (LowerErrorKind, String)>;

pub fn unsupported<T>(msg: impl Into<String>) -> LResult<T> {
    Err((LowerErrorKind::Unsupported, msg.into()))
}
pub fn malformed<T>(msg: impl Into<String>) -> LResult<T> {
    Err((LowerErrorKind::Malformed, msg.into()))
}

#[derive(Debug, Clone)]
pub struct Fallback {
    pub node: String,
    pub target: String,
    pub reason: String,
}

pub struct LoweringResult {
    pub program: LoopProgram,
    pub fallbacks: Vec<Fallback>,
    /// Decisions of the lowering's passes (`layout`, `padding`), each with its log channel.
    pub decisions: Vec<(&'static str, String)>,
}

/// What the caller decides about lowering.
#[derive(Clone, Copy, Debug, Default)]
pub struct LowerOptions {
    pub conv_layout: ConvLayout,
    pub pad_mm: PadMm,
    pub gemm_template: GemmTemplate,
    /// The language the driver chose for the graph's kernels.
    pub kernels: KernelLanguage,
}

// Recompute a lazy value in each consumer unless it is expensive (Inductor's thresholds).
const REALIZE_READS_THRESHOLD: usize = 4;
const REALIZE_OPS_THRESHOLD: usize = 30;
const MAX_INLINE_OPS: usize = 200;

pub struct Ctx<'g> {
    pub graph: &'g Graph,
    pub prog: LoopProgram,
    values: Vec<Option<Lowered>>,
    uses: Vec<usize>,
    /// The calls reading each node (the padding pass looks through views to GEMMs).
    users: Vec<Vec<NodeId>>,
    pub fallbacks: Vec<Fallback>,
    /// The node being lowered (for origins and messages).
    pub current: NodeId,
    /// 4-D activations are laid out channels-last (see `layout`): the values shaped as
    /// `conv_shapes`.
    pub channels_last: bool,
    pub conv_shapes: HashSet<Vec<i64>>,
    pub pad_mm: PadMm,
    pub gemm_template: GemmTemplate,
    /// See `LowerOptions::kernels`.
    pub kernels: KernelLanguage,
    /// The device the graph's kernels run on where its tensors are on several (a GPU).
    pub kernel_device: Option<Device>,
    /// Zero-padded GEMM operands made so far (see `matmul::zero_padded`).
    padded: Vec<matmul::PaddedOperand>,
    zero_padded_storage: Vec<matmul::ZeroPaddedStorage>,
    /// Results of padded GEMMs (their rows are longer than the graph's values).
    padded_results: Vec<BufferId>,
    pub decisions: Vec<(&'static str, String)>,
}

pub fn lower_graph(graph: &Graph) -> Result<LoweringResult, LowerError> {
    lower_graph_with(graph, &LowerOptions::default())
}

pub fn lower_graph_with(graph: &Graph, options: &LowerOptions) -> Result<LoweringResult, LowerError> {
    let (channels_last, layout_decision) = layout::choose_layout(graph, options.conv_layout);
    let mut cx = Ctx {
        graph,
        prog: LoopProgram::default(),
        values: vec![None; graph.nodes.len()],
        uses: graph.use_counts(),
        users: graph.users(),
        fallbacks: Vec::new(),
        current: NodeId(0),
        channels_last,
        conv_shapes: if channels_last { layout::conv_activation_shapes(graph) } else { HashSet::new() },
        pad_mm: options.pad_mm,
        gemm_template: options.gemm_template,
        kernels: options.kernels,
        kernel_device: graph.nodes.iter().find_map(|n| match &n.meta {
            Meta::Tensor(t) if t.device != Device::Cpu => Some(t.device),
            _ => None,
        }),
        padded: Vec::new(),
        zero_padded_storage: Vec::new(),
        padded_results: Vec::new(),
        decisions: layout_decision.into_iter().map(|d| ("layout", d)).collect(),
    };
    cx.prog.input_names = graph.inputs.iter().map(|i| graph.node(*i).name.clone()).collect();
    cx.prog.sources = graph.sources.clone();
    for (i, id) in graph.inputs.iter().enumerate() {
        let t = graph.node(*id).meta.tensor().cloned().ok_or_else(|| LowerError {
            node: graph.node(*id).name.clone(),
            target: "placeholder".into(),
            kind: LowerErrorKind::Malformed,
            message: "input without tensor metadata".into(),
        })?;
        // kernels get the tensor's data pointer, which already includes its storage offset
        let layout = Layout { size: t.shape.clone(), stride: t.stride.clone(), offset: 0, dtype: t.dtype, device: t.device };
        let buf = cx.prog.add_buffer(layout.clone(), BufferSource::Input(i));
        cx.prog.inputs.push(buf);
        if graph.donated_inputs.contains(&i) {
            cx.prog.donated.push(buf);
        }
        cx.values[id.0 as usize] = Some(Lowered::Tensor(view_of_layout(buf, &layout)));
    }
    let mut mutations = Vec::new();
    let mut uncompiled_mutations = Vec::new();
    for id in graph.ids() {
        let node = graph.node(id);
        let NodeKind::Call { target, .. } = &node.kind else { continue };
        if matches!(target, Target::Aten(AtenOp::CopyInto)) {
            match cx.defer_mutation(id) {
                Ok(m) => {
                    cx.values[id.0 as usize] = Some(Lowered::Tensor(m.value.clone()));
                    mutations.push(m)
                }
                Err((LowerErrorKind::Unsupported, reason)) => uncompiled_mutations.push((id, reason)),
                Err((kind, message)) => {
                    return Err(LowerError { node: node.name.clone(), target: target.name().to_string(), kind, message })
                }
            }
            continue;
        }
        // dead code; a call without a result (an error check) is there for its effect
        if cx.uses[id.0 as usize] == 0 && !matches!(node.meta, Meta::None) {
            continue;
        }
        cx.current = id;
        let lowered = match cx.lower_node(id, target) {
            Ok(l) => l,
            Err((LowerErrorKind::Unsupported, reason)) => cx.fallback(id, reason).map_err(|(kind, message)| LowerError {
                node: node.name.clone(),
                target: target.name().to_string(),
                kind,
                message,
            })?,
            Err((kind, message)) => return Err(LowerError { node: node.name.clone(), target: target.name().to_string(), kind, message }),
        };
        let lowered = cx.maybe_realize(id, lowered);
        let lowered = if matches!(target, Target::GetItem) { lowered } else { noting_origin(lowered, &node.name) };
        cx.values[id.0 as usize] = Some(lowered);
    }
    cx.lower_outputs().map_err(|(kind, message)| LowerError { node: "output".into(), target: "output".into(), kind, message })?;
    cx.lower_mutations(mutations);
    for (id, reason) in uncompiled_mutations {
        let node = graph.node(id);
        cx.fallback(id, reason).map_err(|(kind, message)| LowerError {
            node: node.name.clone(),
            target: "aten.copy_.default".into(),
            kind,
            message,
        })?;
    }
    Ok(LoweringResult { program: cx.prog, fallbacks: cx.fallbacks, decisions: cx.decisions })
}

/// `l` with each lazy value recording graph node `name` in the bodies that evaluate it, after
/// its inputs (a getitem's element already records the node that made the tuple).
fn noting_origin(l: Lowered, name: &str) -> Lowered {
    match l {
        Lowered::Tensor(TensorValue { size, dtype, device, src: Src::Lazy { f, reads, ops } }) => {
            let name: Rc<str> = name.into();
            let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
                let v = f(bx, idx);
                bx.body.note_inlined(&name);
                v
            });
            Lowered::Tensor(TensorValue { size, dtype, device, src: Src::Lazy { f, reads, ops } })
        }
        Lowered::Tuple(items) => Lowered::Tuple(items.into_iter().map(|i| i.map(|l| noting_origin(l, name))).collect()),
        other => other,
    }
}

/// The loop body writing `tv` into a buffer of `layout` (loops in the layout's order, so the
/// store runs contiguous), and its ranges.
fn write_body(tv: &TensorValue, layout: &Layout) -> (LoopBody, Vec<i64>) {
    let mut body = LoopBody::default();
    let order = loop_order(layout);
    let ranges: Vec<i64> = order.iter().map(|&d| tv.size[d]).collect();
    let mut vars = vec![IndexExpr::zero(); order.len()];
    for (i, &d) in order.iter().enumerate() {
        vars[d] = IndexExpr::var(Var(i as u32));
    }
    {
        let mut bx = Bx { body: &mut body, ranges: ranges.clone() };
        let v = tv.load(&mut bx, &vars);
        let v = bx.body.cast(v, layout.dtype);
        let idx = layout.index_of(&vars);
        bx.body.set_store(idx, v);
    }
    (body, ranges)
}

/// The dims of `layout` from the largest stride to the smallest (ties in dim order): the loop
/// order under which its store is contiguous.
pub fn loop_order(layout: &Layout) -> Vec<usize> {
    let mut order: Vec<usize> = (0..layout.size.len()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(if layout.size[d] == 1 { i64::MAX } else { layout.stride[d] }));
    order
}

/// A view covering a whole buffer layout.
pub fn view_of_layout(buf: BufferId, l: &Layout) -> TensorValue {
    let stride = l.stride.clone();
    let offset = l.offset;
    TensorValue {
        size: l.size.clone(),
        dtype: l.dtype,
        device: l.device,
        src: Src::View {
            buf,
            index: Rc::new(move |idx: &[IndexExpr], _r: &[i64]| {
                let mut e = IndexExpr::constant(offset);
                for (i, s) in idx.iter().zip(&stride) {
                    e = e.add(&i.scale(*s));
                }
                e
            }),
        },
    }
}

impl<'g> Ctx<'g> {
    /// Whether the graph's loops run in Triton kernels (on a GPU, or CPU tensors under Triton's
    /// interpreter) rather than C++ loops.
    pub fn triton_kernels(&self) -> bool {
        self.kernels == KernelLanguage::Triton
    }

    pub fn node_name(&self) -> String {
        self.graph.node(self.current).name.clone()
    }

    pub fn meta(&self) -> &'g Meta {
        &self.graph.node(self.current).meta
    }
    pub fn out_meta(&self) -> LResult<&'g TensorMeta> {
        match self.graph.node(self.current).meta.tensor() {
            Some(t) => Ok(t),
            None => malformed("expected a tensor result in node metadata"),
        }
    }

    fn lower_node(&mut self, id: NodeId, target: &Target) -> LResult<Lowered> {
        let node = self.graph.node(id);
        // Types we do not compile never reach a lowering.
        let op = match target {
            Target::GetItem => return self.lower_getitem(id),
            Target::Unknown(name) if is_custom_op(name) => return self.lower_custom_op(name),
            Target::Unknown(name) => return unsupported(format!("no lowering for {name}")),
            Target::Aten(op) => *op,
        };
        // complex values only move: copies, views, pads, concatenation, conjugation
        let movable = moves_data(op);
        let ok = |dt: DType| if movable { dt.is_movable() } else { dt.is_compilable() };
        // a node's tensors all live on one device (any: CPU tensors get C++ kernels, CUDA tensors
        // Triton kernels); a node mixing devices (e.g. a CPU scalar tensor in a CUDA op) runs in ATen
        let device = match &node.meta {
            Meta::Tensor(t) => Some(t.device),
            Meta::Tuple(items) => items.iter().flatten().find_map(|m| if let Meta::Tensor(t) = m { Some(t.device) } else { None }),
            _ => None,
        };
        let bad_meta = |m: &Meta| -> bool {
            let bad = |t: &TensorMeta| !ok(t.dtype) || device.is_some_and(|d| t.device != d);
            match m {
                Meta::Tensor(t) => bad(t),
                Meta::Tuple(items) => items.iter().flatten().any(|m| matches!(m, Meta::Tensor(t) if bad(t))),
                _ => false,
            }
        };
        if bad_meta(&node.meta) && !is_library_call(op) {
            return unsupported("dtype or device not compiled by ferrocore");
        }
        // one kernel language per graph (Triton where any tensor is on a GPU): a CPU result of a
        // GPU graph (`torch.arange(n)` beside CUDA tensors) is ATen's, never a GPU kernel's
        // writing host memory
        if let (Some(d), Some(k)) = (device, self.kernel_device) {
            if d != k && !is_library_call(op) {
                return unsupported(format!("a {d} result in a graph whose kernels run on {k}"));
            }
        }
        if let NodeKind::Call { args, kwargs, .. } = &node.kind {
            for a in args.iter().chain(kwargs.iter().map(|(_, a)| a)) {
                let mut refs = Vec::new();
                collect_refs(a, &mut refs);
                for r in refs {
                    if bad_meta(&self.graph.node(r).meta) && !is_library_call(op) {
                        return unsupported("an input's dtype or device is not compiled by ferrocore");
                    }
                }
            }
        }
        self.dispatch(op)
    }

    /// The registry: every known overload maps to its lowering.
    fn dispatch(&mut self, op: AtenOp) -> LResult<Lowered> {
        use AtenOp::*;
        let t = Lowered::Tensor;
        Ok(match op {
            Abs | Neg | Exp | Exp2 | Expm1 | Log | Log2 | Log10 | Log1p | Sqrt | Rsqrt | Sin | Cos | Tan | Asin | Acos | Atan | Sinh
            | Cosh | Tanh | Asinh | Acosh | Atanh | Sigmoid | Relu | Erf | Erfc | Lgamma | SpecialErfcx | Floor | Ceil | Round | Trunc
            | Sign | Reciprocal | BitwiseNot | LogicalNot | IsNan | IsInf | Gelu | Silu => t(self.lower_unary(op)?),
            AddTensor | AddScalar | SubTensor | SubScalar | RsubScalar | MulTensor | MulScalar | DivTensor | DivScalar | DivTensorMode
            | DivScalarMode | PowTensorTensor | PowTensorScalar | PowScalar | Maximum | Minimum | FmodTensor | FmodScalar
            | RemainderTensor | RemainderScalar | Atan2 | EqTensor | EqScalar | NeTensor | NeScalar | LtTensor | LtScalar | LeTensor
            | LeScalar | GtTensor | GtScalar | GeTensor | GeScalar | LogicalAnd | LogicalOr | LogicalXor | BitwiseAndTensor
            | BitwiseAndScalar | BitwiseOrTensor | BitwiseOrScalar | BitwiseXorTensor | BitwiseXorScalar | LshiftTensor | LshiftScalar
            | RshiftTensor | RshiftScalar | BitwiseLeftShift | BitwiseRightShift => t(self.lower_binary(op)?),
            WhereSelf => t(self.lower_where()?),
            Fma => t(self.lower_fma()?),
            Conj | ConjPhysical => t(self.lower_conj()?),
            ViewAsReal => t(self.lower_view_as_real()?),
            Clamp | ClampTensor | ClampMin | ClampMax | Hardtanh => t(self.lower_clamp(op)?),
            ToCopy | Clone | Copy | LiftFreshCopy => t(self.lower_copy(op)?),
            // input writes are lowered after the outputs (`mutation`)
            CopyInto => return malformed("copy_ lowered out of order"),
            Full | FullLike | ScalarTensor | FillScalar | EmptyMemoryFormat | EmptyStrided | EmptyPermuted => t(self.lower_full(op)?),
            ArangeStartStep | ArangeStart | Arange => t(self.lower_arange(op)?),
            Linspace | LinspaceTensorTensor | LinspaceTensorScalar | LinspaceScalarTensor => t(self.lower_linspace(false)?),
            Logspace | LogspaceTensorTensor | LogspaceTensorScalar | LogspaceScalarTensor => t(self.lower_linspace(true)?),
            SumDimIntList | SumDefault | MeanDim | MeanDefault | Amax | Amin | ProdDefault | ProdDimInt | AnyDefault | AnyDim | AnyDims
            | MaxDefault | MinDefault => t(self.lower_reduction(op)?),
            VarCorrection | VarMeanCorrection | VarDim => self.lower_var(op)?,
            Argmax | Argmin | MaxDim | MinDim => self.lower_arg_reduction(op)?,
            Cumsum | Cumprod => t(self.lower_scan(op)?),
            Rand | Randn | RandLike | RandnLike | BernoulliP => t(self.lower_random(op)?),
            NativeDropout => self.lower_dropout()?,
            RreluWithNoise => self.lower_rrelu()?,
            Softmax | LogSoftmax => t(self.lower_softmax(op)?),
            NativeLayerNorm => self.lower_layer_norm()?,
            NativeLayerNormBackward => self.lower_layer_norm_backward()?,
            BatchNormNoTraining | BatchNormNoStats | BatchNormLegit | BatchNormFunctional => self.lower_batch_norm(op)?,
            NativeGroupNorm => self.lower_group_norm()?,
            NativeGroupNormBackward => self.lower_group_norm_backward()?,
            Trilinear => t(self.lower_trilinear()?),
            UpsampleNearest2d => t(self.lower_upsample_nearest()?),
            AvgPool2d | MaxPool2dWithIndices | AdaptiveAvgPool2d | AvgPool3d | MaxPool3dWithIndices | AdaptiveAvgPool3d
            | AdaptiveMaxPool2d | AdaptiveMaxPool3d | FractionalMaxPool2d | FractionalMaxPool3d | MaxPoolWithOffsets => {
                self.lower_pool(op)?
            }
            MaxPoolOffsetsToIndices => t(self.lower_max_pool_offsets_to_indices()?),
            AvgPool2dBackward | AdaptiveAvgPool2dBackward | AvgPool3dBackward | AdaptiveAvgPool3dBackward => {
                t(self.lower_avg_pool_backward(op)?)
            }
            UpsampleBilinear2dVec | UpsampleBilinear2d => t(self.lower_upsample_bilinear(op)?),
            GridSampler2d | GridSampler3d | CudnnGridSampler => t(self.lower_grid_sampler(op)?),
            Col2im => t(self.lower_col2im()?),
            View | UnsafeView | Reshape | Permute | Expand | Unsqueeze | SqueezeDim | SqueezeDims | Squeeze | SliceTensor | SelectInt
            | TransposeInt | T | Alias | Diagonal | Unfold => t(self.lower_view(op)?),
            SplitWithSizes | SplitTensor => self.lower_split(op)?,
            Cat => t(self.lower_cat()?),
            AsStridedScatter => t(self.lower_as_strided_scatter()?),
            Histc => t(self.lower_histc()?),
            Convolution | ConvolutionBackward => self.lower_convolution(op)?,
            Mm | Bmm | Addmm => self.lower_matmul(op)?,
            FusedAttention => match self.lower_attention_template()? {
                Some(lowered) => lowered,
                None => self.lower_extern(op)?,
            },
            FusedAttentionBackward => match self.lower_attention_backward()? {
                Some(lowered) => lowered,
                None => self.lower_extern(op)?,
            },
            Sort | SortStable | Topk | Randperm | FftR2c | FftC2r | CdistForward | PdistForward | EmbeddingBag | AddmmActivation => {
                self.lower_extern(op)?
            }
            FftC2c
            | Nonzero
            | FlashAttentionCpu
            | FlashAttentionCpuBackward
            | FlashAttention
            | FlashAttentionBackward
            | EfficientAttention
            | EfficientAttentionBackward
            | CudnnAttention
            | CudnnAttentionBackward
            | GroupedMm
            | TransformerEncoderLayer
            | Searchsorted
            | SearchsortedScalar
            | LinalgSvd
            | LinalgQr
            | LinalgSlogdet
            | LinalgDet
            | LinalgEigh
            | LinalgEig
            | LinalgEigvals
            | LinalgCholeskyEx
            | LinalgInvEx
            | LinalgSolveEx
            | LinalgLu
            | LinalgLuFactorEx
            | LinalgLuSolve
            | TriangularSolve
            | LinalgSolveTriangular
            | LinalgHouseholderProduct
            | Geqrf
            | LinalgPinv
            | CholeskySolve
            | CholeskyInverse
            | LinalgLdlFactorEx
            | LinalgLdlSolve
            | Ormqr
            | LinalgMatrixExp
            | LinalgCheckErrors
            | AssertAsync
            | AssertAsyncMsg => self.lower_extern(op)?,
            Elu | LeakyRelu => t(self.lower_activation(op)?),
            Flip | Repeat | AsStrided => t(self.lower_data_movement(op)?),
            Embedding | IndexSelect | Gather | IndexTensor => t(self.lower_gather(op)?),
            ConstantPadNd => t(self.lower_constant_pad()?),
            ReflectionPad1d | ReflectionPad2d | ReflectionPad3d | ReplicationPad2d | ReplicationPad3d => t(self.lower_edge_pad(op)?),
            SelectScatter | SliceScatter => t(self.lower_scatter_view(op)?),
            ScatterSrc | ScatterValue | ScatterReduce | ScatterValueReduce | ScatterAdd | ScatterReduceTwo => t(self.lower_scatter(op)?),
            IndexPut => t(self.lower_index_put()?),
            MaskedScatter => t(self.lower_masked_scatter()?),
            NonzeroStatic => t(self.lower_nonzero_static()?),
            MaxPool2dWithIndicesBackward | MaxPool3dWithIndicesBackward => t(self.lower_max_pool_backward(op)?),
            EmbeddingDenseBackward => t(self.lower_embedding_backward()?),
        })
    }

    fn lower_getitem(&mut self, id: NodeId) -> LResult<Lowered> {
        let node = self.graph.node(id);
        let (Some(Arg::Node(src)), Some(Arg::Int(i))) = (node.arg(0, ""), node.arg(1, "")) else {
            return malformed("getitem takes (node, int)");
        };
        // borrowed, not cloned: a split into 10,000 pieces has 10,000 getitems of one tuple
        match &self.values[src.0 as usize] {
            Some(Lowered::Tuple(items)) => match items.get(*i as usize) {
                Some(Some(l)) => Ok(l.clone()),
                // an item the op's metadata leaves empty (a size, an undefined tensor)
                Some(None) if matches!(node.meta, Meta::None | Meta::Scalar(_)) => Ok(Lowered::Nothing),
                _ => malformed(format!("getitem index {i} out of range or empty")),
            },
            _ => malformed("getitem of a node that is not a tuple"),
        }
    }

    // ----- argument access -----

    pub fn arg(&self, i: usize, key: &str) -> Option<&'g Arg> {
        self.graph.node(self.current).arg(i, key)
    }
    pub fn tensor_arg(&self, i: usize, key: &str) -> LResult<TensorValue> {
        match self.arg(i, key) {
            Some(Arg::Node(n)) => self.tensor_of(*n),
            other => malformed(format!("argument {i} ({key}) must be a tensor, got {other:?}")),
        }
    }
    pub fn tensor_of(&self, n: NodeId) -> LResult<TensorValue> {
        match &self.values[n.0 as usize] {
            Some(Lowered::Tensor(t)) => Ok(t.clone()),
            _ => malformed(format!("'{}' has no tensor value", self.graph.node(n).name)),
        }
    }
    pub fn int_arg(&self, i: usize, key: &str) -> LResult<Option<i64>> {
        match self.arg(i, key) {
            None | Some(Arg::None) => Ok(None),
            Some(Arg::Int(v)) => Ok(Some(*v)),
            Some(Arg::Bool(b)) => Ok(Some(*b as i64)),
            other => malformed(format!("argument {i} ({key}) must be an int, got {other:?}")),
        }
    }
    pub fn ints_arg(&self, i: usize, key: &str) -> LResult<Option<Vec<i64>>> {
        match self.arg(i, key) {
            None | Some(Arg::None) => Ok(None),
            Some(Arg::Int(v)) => Ok(Some(vec![*v])),
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Int(v) => Ok(*v),
                    other => malformed(format!("argument {i} ({key}) must be a list of ints, got {other:?}")),
                })
                .collect::<LResult<Vec<i64>>>()
                .map(Some),
            other => malformed(format!("argument {i} ({key}) must be a list of ints, got {other:?}")),
        }
    }
    pub fn bool_arg(&self, i: usize, key: &str, default: bool) -> LResult<bool> {
        match self.arg(i, key) {
            None | Some(Arg::None) => Ok(default),
            Some(Arg::Bool(b)) => Ok(*b),
            Some(Arg::Int(v)) => Ok(*v != 0),
            other => malformed(format!("argument {i} ({key}) must be a bool, got {other:?}")),
        }
    }
    pub fn float_arg(&self, i: usize, key: &str) -> LResult<Option<f64>> {
        match self.arg(i, key) {
            None | Some(Arg::None) => Ok(None),
            Some(Arg::Float(v)) => Ok(Some(*v)),
            Some(Arg::Int(v)) => Ok(Some(*v as f64)),
            other => malformed(format!("argument {i} ({key}) must be a float, got {other:?}")),
        }
    }

    // ----- realization -----

    /// Writes a value into a fresh buffer with `layout` and returns a view of it.
    pub fn realize_into(&mut self, tv: &TensorValue, layout: Layout) -> TensorValue {
        let buf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let (body, ranges) = write_body(tv, &layout);
        self.push_node(LoopNode { output: buf, ranges, reduction_ranges: vec![], body, origins: vec![self.node_name()], template: None });
        view_of_layout(buf, &layout)
    }

    pub fn realize(&mut self, tv: &TensorValue) -> TensorValue {
        if matches!(tv.src, Src::View { .. }) {
            return tv.clone();
        }
        let layout = self.fresh_layout(&tv.size, tv.dtype, tv.device);
        self.realize_into(tv, layout)
    }

    /// `tv` written into a fresh buffer of `layout` on behalf of node `n` (its name in the kernel
    /// origins), as a library-call argument.
    pub fn realize_arg(&mut self, n: NodeId, tv: &TensorValue, layout: Layout) -> LResult<(TensorValue, ExternArg)> {
        let r = self.as_node(n, |cx| cx.realize_into(tv, layout));
        match r.src {
            Src::View { buf, .. } => Ok((r, ExternArg::Buffer(buf))),
            Src::Lazy { .. } => malformed("realize produced no buffer"),
        }
    }

    /// Runs `f` as the lowering of node `n` (the origin its loop nodes are named after).
    pub fn as_node<T>(&mut self, n: NodeId, f: impl FnOnce(&mut Self) -> T) -> T {
        let saved = self.current;
        self.current = n;
        let r = f(self);
        self.current = saved;
        r
    }

    /// Adds a loop node; its origins become the nodes its body inlined, then its own.
    pub fn push_node(&mut self, mut node: LoopNode) -> usize {
        let own = std::mem::take(&mut node.origins);
        let mut origins = std::mem::take(&mut node.body.inlined);
        for o in own {
            if !origins.contains(&o) {
                origins.push(o);
            }
        }
        node.origins = origins;
        let i = self.prog.nodes.len();
        self.prog.nodes.push(node);
        self.prog.steps.push(Step::Node(i));
        i
    }

    fn maybe_realize(&mut self, id: NodeId, l: Lowered) -> Lowered {
        let Lowered::Tensor(tv) = &l else { return l };
        let (reads, ops) = tv.cost();
        let users = self.uses[id.0 as usize];
        let over = |reads: usize, ops: usize| reads > REALIZE_READS_THRESHOLD || ops > REALIZE_OPS_THRESHOLD;
        if !matches!(tv.src, Src::Lazy { .. }) {
            return l;
        }
        // the running estimate counts a buffer once per path to it; the body counts it once
        if ops > MAX_INLINE_OPS || (users > 1 && over(reads, ops) && over_measured(tv, &over)) {
            if let Some(t) = self.realize_before_widening(id, tv) {
                return Lowered::Tensor(t);
            }
            if let Some(t) = self.realize_row_padded(id, tv) {
                return Lowered::Tensor(t);
            }
            return Lowered::Tensor(self.realize(tv));
        }
        l
    }

    /// A widening float conversion (`_to_copy` of a bfloat16 value to float32: a batch norm's
    /// backward upcasts its incoming gradient) realized as its narrow source, the conversion
    /// recomputed in each reader: the same values at half the bytes written and read.
    fn realize_before_widening(&mut self, id: NodeId, tv: &TensorValue) -> Option<TensorValue> {
        let node = self.graph.node(id);
        let NodeKind::Call { target: Target::Aten(AtenOp::ToCopy), args, .. } = &node.kind else { return None };
        let Some(Arg::Node(src)) = args.first() else { return None };
        let narrow = self.tensor_of(*src).ok()?;
        let widens = narrow.dtype.is_float() && tv.dtype.is_float() && narrow.dtype.itemsize() < tv.dtype.itemsize();
        if !widens || narrow.size != tv.size || narrow.device != tv.device || !matches!(narrow.src, Src::Lazy { .. }) {
            return None;
        }
        let stored = self.realized_node(*src, false).ok()?;
        let dt = tv.dtype;
        Some(TensorValue::lazy(tv.size.clone(), dt, tv.device, 1, 1, move |bx, idx| {
            let v = stored.load(bx, idx);
            bx.body.cast(v, dt)
        }))
    }

    /// Makes a node's value a buffer view (for extern calls), updating the node's value so
    /// that its other users read the buffer instead of recomputing.
    pub fn realized_node(&mut self, n: NodeId, exact: bool) -> LResult<TensorValue> {
        let tv = self.tensor_of(n)?;
        if matches!(tv.src, Src::View { .. }) {
            return Ok(tv);
        }
        if let Some(view) = self.view_of_shared_base(n)? {
            return Ok(view);
        }
        let tv = self.tensor_of(n)?; // over the shared base's buffer, if there is one now
        let layout = if exact { self.eager_layout(n, &tv) } else { self.preferred_layout(n, &tv) };
        let r = self.as_node(n, |cx| cx.realize_into(&tv, layout));
        self.values[n.0 as usize] = Some(Lowered::Tensor(r.clone()));
        Ok(r)
    }

    /// Node `n` as a view of a buffer, when `n` is a chain of reshapes, permutes and broadcasts
    /// of a computed value that something else reads too (an attention's softmax, multiplied
    /// with the values and saved for the backward): that value realized once, as its own node,
    /// and the chain lowered again over the buffer. Realizing `n` itself would leave the value
    /// to be computed a second time for its other reader.
    fn view_of_shared_base(&mut self, n: NodeId) -> LResult<Option<TensorValue>> {
        use AtenOp::*;
        let reshapes = |op: AtenOp| {
            matches!(
                op,
                View | UnsafeView | Reshape | Permute | Expand | Unsqueeze | SqueezeDim | SqueezeDims | Squeeze | TransposeInt | T | Alias
            )
        };
        let (base, chain) = self.view_chain(n, reshapes);
        if chain.is_empty() || self.uses[base.0 as usize] < 2 || !matches!(self.tensor_of(base)?.src, Src::Lazy { .. }) {
            return Ok(None);
        }
        self.realized_node(base, false)?;
        self.lower_chain_again(&chain)?;
        let tv = self.tensor_of(n)?;
        Ok(tv.strided().is_some().then_some(tv))
    }

    /// (the first node up `n`'s chain of first operands that is not one of the `view` ops, the
    /// chain's (node, op) from `n` up to it).
    pub(super) fn view_chain(&self, n: NodeId, view: impl Fn(AtenOp) -> bool) -> (NodeId, Vec<(NodeId, AtenOp)>) {
        let mut chain = Vec::new();
        let mut base = n;
        while let NodeKind::Call { target: Target::Aten(op), args, .. } = &self.graph.node(base).kind {
            match args.first() {
                Some(Arg::Node(src)) if view(*op) => {
                    chain.push((base, *op));
                    base = *src;
                }
                _ => break,
            }
        }
        (base, chain)
    }

    /// Lowers a `view_chain` again, base first, after its base's value changed.
    pub(super) fn lower_chain_again(&mut self, chain: &[(NodeId, AtenOp)]) -> LResult<()> {
        for &(v, op) in chain.iter().rev() {
            let lowered = self.as_node(v, |cx| cx.lower_node(v, &Target::Aten(op)))?;
            self.values[v.0 as usize] = Some(lowered);
        }
        Ok(())
    }

    /// The layout ferrocore gives node `n`'s value when it is free to choose: channels-last for
    /// a convolution graph's 4-D activations, else eager's.
    pub fn preferred_layout(&self, n: NodeId, tv: &TensorValue) -> Layout {
        if self.nhwc_value(&tv.size) {
            return self.fresh_layout(&tv.size, tv.dtype, tv.device);
        }
        self.eager_layout(n, tv)
    }

    /// The layout eager gives node `n`'s value (its metadata's strides, when dense), else
    /// contiguous: library calls see the layouts they would see in eager (some require them:
    /// grouped GEMMs align their groups along the strided dim).
    pub fn eager_layout(&self, n: NodeId, tv: &TensorValue) -> Layout {
        match self.graph.node(n).meta.tensor() {
            Some(m) if m.shape == tv.size && is_dense(&m.shape, &m.stride) => {
                Layout { size: tv.size.clone(), stride: m.stride.clone(), offset: 0, dtype: tv.dtype, device: tv.device }
            }
            _ => Layout::contiguous(&tv.size, tv.dtype, tv.device),
        }
    }

    fn lower_outputs(&mut self) -> LResult<()> {
        let graph = self.graph;
        let mut outputs = Vec::new();
        for (pos, a) in graph.outputs.iter().enumerate() {
            let out = match a {
                Arg::None => OutputValue::None,
                Arg::Node(n) => {
                    let node = graph.node(*n);
                    let Some(meta) = node.meta.tensor() else {
                        return malformed(format!("output '{}' is not a tensor", node.name));
                    };
                    let tv = self.tensor_of(*n)?;
                    if tv.size != meta.shape {
                        return malformed(format!("output '{}' has shape {:?}, metadata says {:?}", node.name, tv.size, meta.shape));
                    }
                    self.current = *n;
                    if graph.free_layout_outputs.contains(&pos) {
                        self.free_output_value(*n, &tv, meta)
                    } else {
                        self.output_value(&tv, meta)
                    }
                }
                other => return malformed(format!("unsupported output {other:?}")),
            };
            outputs.push(out);
        }
        self.prog.outputs = outputs;
        Ok(())
    }

    /// An output whose layout is ours to choose: a buffer or an affine view of one as it is
    /// (no copy), anything else realized in the layout a buffer of this node would get.
    fn free_output_value(&mut self, n: NodeId, tv: &TensorValue, meta: &TensorMeta) -> OutputValue {
        if let Some((buf, stride, offset)) = tv.strided() {
            let l = &self.prog.buffer(buf).layout;
            if l.dtype == meta.dtype {
                if l.size == tv.size && l.stride == stride && l.offset == offset {
                    return OutputValue::Buffer(buf);
                }
                return OutputValue::View { buf, size: tv.size.clone(), stride, offset };
            }
        }
        let layout = self.preferred_layout(n, tv);
        match self.realize_into(tv, layout).src {
            Src::View { buf, .. } => OutputValue::Buffer(buf),
            Src::Lazy { .. } => OutputValue::None,
        }
    }

    /// Graph outputs keep eager's strides: views of buffers are returned as views when their
    /// strides match, everything else is written into a buffer with the metadata's strides.
    /// The one exception: the unpadded corner of a padded GEMM's result is returned as a view
    /// (padded rows), as Inductor returns it; a copy would cost as much as the GEMM's output.
    fn output_value(&mut self, tv: &TensorValue, meta: &TensorMeta) -> OutputValue {
        if let Some((buf, stride, offset)) = tv.strided() {
            let l = &self.prog.buffer(buf).layout;
            if self.padded_results.contains(&buf) && l.dtype == meta.dtype {
                let name = &self.graph.node(self.current).name;
                self.decisions.push((
                    "padding",
                    format!("output {name} returned as a view of its padded GEMM result: strides {stride:?}, eager's {:?}", meta.stride),
                ));
                return OutputValue::View { buf, size: tv.size.clone(), stride, offset };
            }
            let eager_strides = same_strides(&tv.size, &stride, &meta.stride);
            if l.size == tv.size && l.stride == stride && l.offset == offset && l.dtype == meta.dtype && eager_strides {
                return OutputValue::Buffer(buf);
            }
            if eager_strides && l.dtype == meta.dtype {
                return OutputValue::View { buf, size: tv.size.clone(), stride, offset };
            }
        }
        let stride = if is_dense(&meta.shape, &meta.stride) { meta.stride.clone() } else { contiguous_strides(&meta.shape) };
        let layout = Layout { size: meta.shape.clone(), stride, offset: 0, dtype: meta.dtype, device: meta.device };
        let r = self.realize_into(tv, layout);
        match r.src {
            Src::View { buf, .. } => OutputValue::Buffer(buf),
            Src::Lazy { .. } => OutputValue::None,
        }
    }
}

/// `over(distinct buffers read, expressions)` for one element of `tv`, as its body would hold it
/// (common subexpressions merged).
fn over_measured(tv: &TensorValue, over: &dyn Fn(usize, usize) -> bool) -> bool {
    let mut body = LoopBody::default();
    let mut bx = Bx { body: &mut body, ranges: tv.size.clone() };
    let vars: Vec<IndexExpr> = (0..tv.size.len()).map(|i| IndexExpr::var(Var(i as u32))).collect();
    tv.load(&mut bx, &vars);
    let mut bufs: Vec<BufferId> = body
        .exprs
        .iter()
        .filter_map(|e| match e {
            Expr::Load { buf, .. } | Expr::LoadIndirect { buf, .. } => Some(*buf),
            _ => None,
        })
        .collect();
    bufs.sort();
    bufs.dedup();
    let ops = body
        .exprs
        .iter()
        .filter(|e| !matches!(e, Expr::Load { .. } | Expr::LoadIndirect { .. } | Expr::Constant(_) | Expr::Index(_)))
        .count();
    over(bufs.len(), ops)
}

/// Ops whose lowerings only load, store, convert or conjugate values (no arithmetic on them):
/// the ones complex tensors may go through.
fn moves_data(op: AtenOp) -> bool {
    use AtenOp::*;
    matches!(
        op,
        View | UnsafeView
            | Reshape
            | Permute
            | Expand
            | Unsqueeze
            | SqueezeDim
            | SqueezeDims
            | Squeeze
            | SliceTensor
            | SelectInt
            | TransposeInt
            | T
            | Alias
            | Diagonal
            | Unfold
            | SplitWithSizes
            | SplitTensor
            | Clone
            | ToCopy
            | Copy
            | LiftFreshCopy
            | ConstantPadNd
            | Cat
            | Flip
            | Repeat
            | AsStrided
            | Conj
            | ConjPhysical
            | ViewAsReal
            | SelectScatter
            | SliceScatter
    )
}

/// Ops that always run as ATen library calls (see docs/externs.md): they take and return any
/// dtype torch supports, since no generated kernel touches their data directly.
pub fn is_library_call(op: AtenOp) -> bool {
    use AtenOp::*;
    matches!(
        op,
        Mm | Bmm
            | Addmm
            | AddmmActivation
            | Convolution
            | ConvolutionBackward
            | Sort
            | SortStable
            | Topk
            | Randperm
            | FftR2c
            | FftC2r
            | CdistForward
            | PdistForward
            | EmbeddingBag
            | FftC2c
            | Nonzero
            | FlashAttentionCpu
            | FlashAttentionCpuBackward
            | FlashAttention
            | FlashAttentionBackward
            | EfficientAttention
            | EfficientAttentionBackward
            | CudnnAttention
            | CudnnAttentionBackward
            | FusedAttention
            | FusedAttentionBackward
            | GroupedMm
            | TransformerEncoderLayer
            | Searchsorted
            | SearchsortedScalar
            | LinalgSvd
            | LinalgQr
            | LinalgSlogdet
            | LinalgDet
            | LinalgEigh
            | LinalgEig
            | LinalgEigvals
            | LinalgCholeskyEx
            | LinalgInvEx
            | LinalgSolveEx
            | LinalgLu
            | LinalgLuFactorEx
            | LinalgLuSolve
            | TriangularSolve
            | LinalgSolveTriangular
            | LinalgHouseholderProduct
            | Geqrf
            | LinalgPinv
            | CholeskySolve
            | CholeskyInverse
            | LinalgLdlFactorEx
            | LinalgLdlSolve
            | Ormqr
            | LinalgMatrixExp
            | LinalgCheckErrors
            | AssertAsync
            | AssertAsyncMsg
    )
}

/// How the kernels take an op in: what a backward may recompute instead of loading (`joint`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fusion {
    /// Computed per element, in whatever kernel reads it: pointwise ops, copies and casts, an
    /// element of a multi-result node.
    Elementwise,
    /// Indexing only: no code of its own.
    View,
    /// Made from its arguments alone (`arange`, `full`, `empty`).
    Creation,
    /// Reads what it moves at computed positions: gathers, concatenation, padding.
    Gather,
    /// A reduction over dims (recomputing one that shrinks its input much is dear).
    Reduction,
    /// Lowered into loops of its own kind (scans, norms, pools, scatters, ...): not recomputed.
    Other,
    /// A kernel of its own that computes an operand inline where it reads it (ferrocore's
    /// attention kernels: the bias, a mask computed from positions, is never stored).
    Template,
    /// Never recomputed: library calls and ops ferrocore does not lower (nothing fuses them),
    /// and seeded random ops (a recomputation would draw new values).
    Opaque,
}

impl Fusion {
    /// Whether a recomputation fuses into the kernels around it.
    pub fn fuses(self) -> bool {
        matches!(self, Fusion::Elementwise | Fusion::View | Fusion::Creation | Fusion::Gather | Fusion::Reduction)
    }
}

pub fn fusion_of(target: &Target) -> Fusion {
    use AtenOp::*;
    let op = match target {
        Target::GetItem => return Fusion::Elementwise,
        Target::Unknown(_) => return Fusion::Opaque,
        Target::Aten(op) => *op,
    };
    if matches!(op, FusedAttention | FusedAttentionBackward) {
        return Fusion::Template;
    }
    if is_library_call(op) || is_seeded_random(op) {
        return Fusion::Opaque;
    }
    match op {
        Abs | Neg | Exp | Exp2 | Expm1 | Log | Log2 | Log10 | Log1p | Sqrt | Rsqrt | Sin | Cos | Tan | Asin | Acos | Atan | Sinh | Cosh
        | Tanh | Asinh | Acosh | Atanh | Sigmoid | Relu | Erf | Erfc | Lgamma | SpecialErfcx | Floor | Ceil | Round | Trunc | Sign
        | Reciprocal | BitwiseNot | LogicalNot | IsNan | IsInf | Gelu | Silu | AddTensor | AddScalar | SubTensor | SubScalar
        | RsubScalar | MulTensor | MulScalar | DivTensor | DivScalar | DivTensorMode | DivScalarMode | PowTensorTensor
        | PowTensorScalar | PowScalar | Maximum | Minimum | FmodTensor | FmodScalar | RemainderTensor | RemainderScalar | Atan2
        | EqTensor | EqScalar | NeTensor | NeScalar | LtTensor | LtScalar | LeTensor | LeScalar | GtTensor | GtScalar | GeTensor
        | GeScalar | LogicalAnd | LogicalOr | LogicalXor | BitwiseAndTensor | BitwiseAndScalar | BitwiseOrTensor | BitwiseOrScalar
        | BitwiseXorTensor | BitwiseXorScalar | LshiftTensor | LshiftScalar | RshiftTensor | RshiftScalar | BitwiseLeftShift
        | BitwiseRightShift | WhereSelf | Fma | ConjPhysical | Clamp | ClampTensor | ClampMin | ClampMax | Hardtanh | Elu | LeakyRelu
        | ToCopy | Clone | Copy | LiftFreshCopy => Fusion::Elementwise,
        View | Reshape | Permute | Expand | Unsqueeze | SqueezeDim | SqueezeDims | Squeeze | SliceTensor | SelectInt | TransposeInt | T
        | Alias | Diagonal | Unfold | SplitWithSizes | SplitTensor | AsStrided | Conj | ViewAsReal => Fusion::View,
        Full | FullLike | ScalarTensor | EmptyMemoryFormat | EmptyStrided | EmptyPermuted | ArangeStartStep | ArangeStart | Arange
        | Linspace | LinspaceTensorTensor | LinspaceTensorScalar | LinspaceScalarTensor | Logspace | LogspaceTensorTensor
        | LogspaceTensorScalar | LogspaceScalarTensor => Fusion::Creation,
        Cat | ConstantPadNd | IndexTensor | Gather | Embedding => Fusion::Gather,
        SumDimIntList | SumDefault | MeanDim | MeanDefault | Amax | Amin | ProdDimInt | AnyDim | VarCorrection | MaxDim | MinDim => {
            Fusion::Reduction
        }
        _ => Fusion::Other,
    }
}

/// Ops that draw random numbers from the generator's state.
pub fn is_seeded_random(op: AtenOp) -> bool {
    use AtenOp::*;
    matches!(op, Rand | Randn | RandLike | RandnLike | BernoulliP | NativeDropout | RreluWithNoise | Randperm)
}

pub fn collect_refs(a: &Arg, out: &mut Vec<NodeId>) {
    match a {
        Arg::Node(n) => out.push(*n),
        Arg::List(items) => items.iter().for_each(|i| collect_refs(i, out)),
        _ => {}
    }
}

fn same_strides(size: &[i64], a: &[i64], b: &[i64]) -> bool {
    size.iter().zip(a.iter().zip(b)).all(|(s, (x, y))| *s <= 1 || x == y)
}

/// Non-overlapping and dense: some permutation of the dims is contiguous.
pub fn is_dense(size: &[i64], stride: &[i64]) -> bool {
    let mut dims: Vec<usize> = (0..size.len()).filter(|&i| size[i] != 1).collect();
    dims.sort_by_key(|&i| stride[i]);
    let mut expected = 1;
    for i in dims {
        if stride[i] != expected {
            return false;
        }
        expected *= size[i];
    }
    true
}

/// Normalizes a possibly negative dim against `rank`.
pub fn norm_dim(d: i64, rank: usize) -> LResult<usize> {
    let r = rank.max(1) as i64;
    let d2 = if d < 0 { d + r } else { d };
    if d2 < 0 || d2 >= r {
        return malformed(format!("dim {d} out of range for rank {rank}"));
    }
    Ok(d2 as usize)
}

#[cfg(test)]
mod tests;
