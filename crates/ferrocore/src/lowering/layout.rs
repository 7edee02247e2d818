//! The layout of a convolution graph's activations (pass `layout`). cuDNN's convolutions run
//! NHWC on tensor cores; handed NCHW tensors, they convert them around every call
//! (`nchwToNhwc`/`nhwcToNchw` kernels), and ATen runs depthwise ones through its own slow NCHW
//! kernel. So a GPU graph built around convolutions keeps its 4-D activations channels-last:
//! every buffer the lowering makes for a 4-D value, every convolution's input and result.
//! Graph inputs and user-visible outputs keep eager's layout; saved activations go to the
//! backward as they are (it is compiled for their strides).
//!
//! Unlike Inductor's heuristic, grouped and depthwise convolutions count for channels-last:
//! Inductor keeps them NCHW (its measured multiplier 1.36), where on an H100 in bfloat16
//! ConvNeXt-T's 7x7 depthwise convolutions took 2.1 ms NCHW (ATen's kernel) against 0.73 ms
//! NHWC (cuDNN).
//!
//! On the CPU the Python front measures the graph's convolutions in both layouts and passes the
//! faster as `conv_layout` (`python/ferrocore/conv_layout.py`). Without that, the rule here: a
//! graph with grouped or depthwise convolutions goes channels-last, since oneDNN runs those 1.5x
//! faster NHWC (2x16x32x32 3x3: 72 against 41 us; 2x128x4x4 7x7: 53 against 36 us, one thread)
//! and converting around them only made the kernels between them transpose (EfficientNet-B0:
//! 2.73 ms against 1.97 ms all channels-last); a graph of dense convolutions keeps eager's
//! layout, since those flip either way by shape (ResNet-50's strided 1x1 layer-4 downsample:
//! 1.3 ms NCHW against 6.3 ms NHWC).

use super::*;
use serde::{Deserialize, Serialize};

/// convolution_backward's `output_mask` argument: which of grad_input, grad_weight and
/// grad_bias to compute.
const OUTPUT_MASK: usize = 10;

/// How convolution graphs lay out their 4-D activations (`Options::conv_layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ConvLayout {
    /// Channels-last for GPU graphs with enough convolutions, eager's layout otherwise.
    #[default]
    Auto,
    /// Channels-last whenever the graph has a 2-D convolution (any device).
    ChannelsLast,
    /// Eager's layout: buffers contiguous, convolutions as traced.
    Contiguous,
}

impl ConvLayout {
    pub const ALL: [ConvLayout; 3] = [ConvLayout::Auto, ConvLayout::ChannelsLast, ConvLayout::Contiguous];
}

/// A graph with fewer than one convolution per this many nodes keeps eager's layout: converting
/// around a lone convolution (a transformer's patch embedding) costs more than it saves.
const NODES_PER_CONVOLUTION: usize = 300;

/// Whether the graph's 4-D activations are channels-last, and the logged decision.
pub fn choose_layout(graph: &Graph, asked: ConvLayout) -> (bool, Option<String>) {
    let mut convs = 0usize;
    let mut grouped = 0usize;
    let mut cuda = false;
    for id in graph.ids() {
        let node = graph.node(id);
        let NodeKind::Call { target: Target::Aten(op @ (AtenOp::Convolution | AtenOp::ConvolutionBackward)), .. } = &node.kind else {
            continue;
        };
        let input = node.arg(if *op == AtenOp::Convolution { 0 } else { 1 }, "input");
        let Some(Arg::Node(x)) = input else { continue };
        let Some(t) = graph.node(*x).meta.tensor() else { continue };
        if t.shape.len() != 4 {
            continue;
        }
        convs += 1;
        cuda |= matches!(t.device, Device::Cuda(_));
        if is_grouped(node, *op) {
            grouped += 1;
        }
    }
    if convs == 0 {
        return (false, None);
    }
    let nodes = graph.nodes.len();
    let why = match asked {
        ConvLayout::Contiguous => {
            return (false, Some("layout: eager's (conv_layout = contiguous: asked for, or measured faster by the front)".into()))
        }
        ConvLayout::ChannelsLast => "conv_layout = channels_last (asked for, or measured faster by the front)".to_string(),
        ConvLayout::Auto if !cuda && grouped == 0 => {
            return (false, Some(format!("layout: eager's: {convs} dense convolutions run on the CPU")));
        }
        ConvLayout::Auto if !cuda => "oneDNN runs grouped and depthwise convolutions faster NHWC".to_string(),
        ConvLayout::Auto if nodes >= NODES_PER_CONVOLUTION * convs => {
            return (false, Some(format!("layout: eager's: {convs} convolution(s) among {nodes} nodes")));
        }
        ConvLayout::Auto => "cuDNN runs NHWC convolutions without layout conversions".to_string(),
    };
    (true, Some(format!("layout: channels-last for 4-D activations: {convs} convolutions ({grouped} grouped or depthwise); {why}")))
}

/// The 4-D shapes convolutions read and write as activations (inputs, results, gradients). In a
/// channels-last graph only values of these shapes are laid out NHWC: a 4-D value of another
/// shape is no image (ConvNeXt's `[N, H, W, C]` MLP activations, after its permute), and NHWC
/// strides over it made every view of it a transposing copy (ConvNeXt-T's training step: 4 ms of
/// such copies on an H100).
pub fn conv_activation_shapes(graph: &Graph) -> HashSet<Vec<i64>> {
    let mut shapes = HashSet::new();
    let mut add = |m: Option<&TensorMeta>| {
        if let Some(t) = m.filter(|t| t.shape.len() == 4) {
            shapes.insert(t.shape.clone());
        }
    };
    for id in graph.ids() {
        let node = graph.node(id);
        let NodeKind::Call { target: Target::Aten(op @ (AtenOp::Convolution | AtenOp::ConvolutionBackward)), .. } = &node.kind else {
            continue;
        };
        let activations: &[usize] = if *op == AtenOp::Convolution { &[0] } else { &[0, 1] };
        for &i in activations {
            if let Some(Arg::Node(x)) = node.arg(i, "input") {
                add(graph.node(*x).meta.tensor());
            }
        }
        match &node.meta {
            Meta::Tuple(items) => add(items.first().and_then(|m| m.as_ref()).and_then(Meta::tensor)),
            m => add(m.tensor()),
        }
    }
    shapes
}

/// Whether a convolution (or its backward) node has more than one group.
fn is_grouped(node: &crate::graph::Node, op: AtenOp) -> bool {
    let groups_at = if op == AtenOp::Convolution { 8 } else { 9 };
    matches!(node.arg(groups_at, "groups"), Some(Arg::Int(g)) if *g > 1)
}

/// NHWC strides of an NCHW-indexed 4-D size.
pub fn channels_last_strides(size: &[i64]) -> Vec<i64> {
    let (c, h, w) = (size[1].max(1), size[2].max(1), size[3].max(1));
    vec![h * w * c, 1, w * c, c]
}

/// Whether `stride` lays out a 4-D `size` channels-last (size-1 dims take any stride).
pub fn is_channels_last(size: &[i64], stride: &[i64]) -> bool {
    size.len() == 4 && same_strides(size, stride, &channels_last_strides(size))
}

impl Ctx<'_> {
    /// Whether a value of `size` is laid out channels-last: in a channels-last graph, a 4-D
    /// value of a shape some convolution reads or writes.
    pub fn nhwc_value(&self, size: &[i64]) -> bool {
        self.channels_last && size.len() == 4 && self.conv_shapes.contains(size)
    }

    /// The layout of a fresh buffer for a value of `size`: channels-last for a convolution
    /// graph's 4-D activations (`nhwc_value`), contiguous otherwise.
    pub fn fresh_layout(&self, size: &[i64], dtype: DType, device: Device) -> Layout {
        if self.nhwc_value(size) {
            return Layout { size: size.to_vec(), stride: channels_last_strides(size), offset: 0, dtype, device };
        }
        Layout::contiguous(size, dtype, device)
    }

    /// Node `n`'s value as a channels-last library-call argument: as it is when it already is
    /// (or is not 4-D), else copied out channels-last.
    pub(super) fn channels_last_arg(&mut self, n: NodeId) -> LResult<ExternArg> {
        let tv = self.tensor_of(n)?;
        if tv.size.len() != 4 {
            return self.extern_tensor(n, false);
        }
        let nhwc = channels_last_strides(&tv.size);
        if let Some((buf, stride, offset)) = tv.strided() {
            if is_channels_last(&tv.size, &stride) {
                // size-1 dims too take NHWC's strides: oneDNN reads (128, 1, 1, 1) as NCHW and
                // runs a 2x128x1x1 depthwise convolution 5x slower than at (128, 1, 128, 128)
                return Ok(ExternArg::View { buf, size: tv.size.clone(), stride: nhwc, offset });
            }
        }
        let layout = Layout { size: tv.size.clone(), stride: nhwc, offset: 0, dtype: tv.dtype, device: tv.device };
        Ok(self.realize_arg(n, &tv, layout)?.1)
    }

    /// convolution / convolution_backward. In a channels-last graph the activations go in
    /// channels-last (copied when they are not) and the activation results come out so; cuDNN
    /// and oneDNN then pick their NHWC kernels (on the CPU the weights are copied channels-last
    /// by a generated kernel, on a GPU ATen converts them). On a GPU a
    /// convolution's bias is added by the kernels after it (`peeled_bias`), not by ATen's separate add.
    pub(super) fn lower_convolution(&mut self, op: AtenOp) -> LResult<Lowered> {
        if op == AtenOp::Convolution {
            if let Some(l) = self.convolution_template()? {
                return Ok(l);
            }
            if let Some(l) = self.cpu_convolution()? {
                return Ok(l);
            }
        }
        let node = self.graph.node(self.current);
        let NodeKind::Call { args, kwargs, .. } = &node.kind else { return malformed("not a call") };
        let activations: &[usize] = if op == AtenOp::Convolution { &[0] } else { &[0, 1] };
        let four_d =
            |a: Option<&Arg>| matches!(a, Some(Arg::Node(n)) if self.graph.node(*n).meta.tensor().is_some_and(|t| t.shape.len() == 4));
        let nhwc_call = self.channels_last && activations.iter().all(|&i| four_d(args.get(i)));
        let bias = self.peeled_bias(op)?;
        let bias_grad = self.peeled_bias_grad(op)?;
        // on the CPU the weight too: ATen's own conversion (`contiguous(channels_last)` inside
        // mkldnn_convolution) costs about 13 us a call in dispatch for a 2 us copy
        let nhwc_weight = nhwc_call && op == AtenOp::Convolution && self.out_meta()?.device == Device::Cpu;
        if !nhwc_call && bias.is_none() && bias_grad.is_none() {
            return self.lower_extern(op);
        }
        let needs_call = |m: Option<&Arg>| matches!(m, Some(Arg::List(mask)) if mask.iter().take(2).any(|m| matches!(m, Arg::Bool(true))));
        if let Some(grad) = &bias_grad {
            if !needs_call(args.get(OUTPUT_MASK)) {
                return Ok(Lowered::Tuple(vec![None, None, Some(Lowered::Tensor(grad.clone()))]));
            }
        }
        let mut eargs = Vec::new();
        for (i, a) in args.iter().enumerate() {
            eargs.push(match a {
                Arg::Node(n) if nhwc_call && (activations.contains(&i) || (i == 1 && nhwc_weight)) => self.channels_last_arg(*n)?,
                Arg::Node(_) if i == 2 && bias.is_some() => ExternArg::Literal(Literal::None),
                Arg::List(mask) if i == OUTPUT_MASK && bias_grad.is_some() => ExternArg::List(
                    (mask.iter().enumerate())
                        .map(|(j, m)| ExternArg::Literal(Literal::Bool(j != 2 && matches!(m, Arg::Bool(true)))))
                        .collect(),
                ),
                _ => self.extern_arg(a, false)?,
            });
        }
        let ekwargs = kwargs.iter().map(|(k, a)| Ok((k.clone(), self.extern_arg(a, false)?))).collect::<LResult<Vec<_>>>()?;
        // the result activation (convolution's output, the backward's grad_input) channels-last
        let nhwc = |m: &Meta| -> Meta {
            match m {
                Meta::Tensor(t) if nhwc_call && t.shape.len() == 4 => {
                    Meta::Tensor(TensorMeta { stride: channels_last_strides(&t.shape), ..t.clone() })
                }
                other => other.clone(),
            }
        };
        let meta = match &node.meta {
            Meta::Tuple(items) if op == AtenOp::ConvolutionBackward => {
                let mut items = items.clone();
                if let Some(Some(first)) = items.first_mut() {
                    *first = nhwc(first);
                }
                if bias_grad.is_some() {
                    items[2] = None;
                }
                Meta::Tuple(items)
            }
            m => nhwc(m),
        };
        let kind = ExternKind::Library { hazard: externs::capture_hazard(op), exact_strides: false };
        let result = self.push_extern(format!("torch.ops.{}", op.name()), eargs, ekwargs, &meta, kind)?;
        match (bias, bias_grad, result) {
            (Some(bias), _, Lowered::Tensor(conv)) => Ok(Lowered::Tensor(add_channel_bias(conv, bias))),
            (_, Some(grad), Lowered::Tuple(mut items)) => {
                items[2] = Some(Lowered::Tensor(grad));
                Ok(Lowered::Tuple(items))
            }
            (_, _, result) => Ok(result),
        }
    }

    /// A GPU convolution backward's bias gradient, which the lowering sums itself over the
    /// gradient's batch and spatial dims: ATen sums it in a reduction kernel of its own, 0.31 ms
    /// of a diffusion UNet level's 2.3 ms training step on an H100 (channels-last gradients,
    /// 14 convolutions), where a generated reduction splits over the GPU and shares its reads of
    /// the gradient with the norm backward's sums. Inductor's decomposition does the same.
    fn peeled_bias_grad(&mut self, op: AtenOp) -> LResult<Option<TensorValue>> {
        if op != AtenOp::ConvolutionBackward {
            return Ok(None);
        }
        let Some(Arg::List(mask)) = self.arg(OUTPUT_MASK, "output_mask") else { return Ok(None) };
        let Meta::Tuple(items) = self.meta() else { return Ok(None) };
        let (Some(Arg::Bool(true)), Some(Some(Meta::Tensor(out)))) = (mask.get(2), items.get(2)) else { return Ok(None) };
        let out = out.clone();
        let grad = self.tensor_arg(0, "grad_output")?;
        // (not over a 1x1 map, as for the forward's bias: there ATen's sum is N x C elements)
        let spatial: i64 = grad.size.iter().skip(2).product();
        if out.device == Device::Cpu || grad.size.len() < 3 || spatial <= 1 || out.shape.as_slice() != &grad.size[1..2] {
            return Ok(None);
        }
        let dims: Vec<usize> = (0..grad.size.len()).filter(|&d| d != 1).collect();
        let acc = out.dtype.compute();
        let g = grad.clone();
        let sum = self.reduce_node(&grad.size, &dims, acc, grad.device, move |bx, full, _| {
            let v = g.load(bx, full);
            let v = bx.body.cast(v, acc);
            bx.body.reduce(ReduceOp::Sum, v)
        });
        Ok(Some(self.finish_reduction(sum, &out)?))
    }

    /// A GPU convolution's bias tensor, which the lowering adds itself: ATen adds it in a
    /// kernel of its own after cuDNN's (a strided pass over the whole result, 0.23 ms of
    /// ConvNeXt-T's 2.5 ms forward on an H100), where the add fuses into the next kernel (the
    /// LayerNorm after a depthwise convolution). Inductor peels it the same way. Not over a 1x1
    /// map (squeeze-and-excitation's convolutions): ATen's add there is N x C elements, and the
    /// small sum, saved for the backward, joined the large kernels that read it and slowed them
    /// (EfficientNet-B0's training step: 4.5 ms more on an H100).
    fn peeled_bias(&mut self, op: AtenOp) -> LResult<Option<TensorValue>> {
        if op != AtenOp::Convolution {
            return Ok(None);
        }
        let out = self.out_meta()?;
        if out.device == Device::Cpu || out.shape.iter().skip(2).product::<i64>() <= 1 {
            return Ok(None);
        }
        match self.arg(2, "bias") {
            Some(Arg::Node(_)) => {
                let bias = self.tensor_arg(2, "bias")?;
                if bias.size.len() != 1 || Some(&bias.size[0]) != out.shape.get(1) {
                    return malformed(format!("convolution bias of size {:?} for a result of {:?}", bias.size, out.shape));
                }
                Ok(Some(bias))
            }
            _ => Ok(None),
        }
    }
}

/// `conv + bias`, the bias broadcast along the channel dim (1), in the convolution's dtype.
pub(super) fn add_channel_bias(conv: TensorValue, bias: TensorValue) -> TensorValue {
    let (dt, size, device) = (conv.dtype, conv.size.clone(), conv.device);
    let (r0, o0) = conv.cost();
    let (r1, o1) = bias.cost();
    TensorValue::lazy(size, dt, device, r0 + r1, o0 + o1 + 1, move |bx, idx| {
        let x = conv.load(bx, idx);
        let b = bias.load(bx, &idx[1..2]);
        let b = bx.body.cast(b, dt);
        bx.body.binary(BinaryOp::Add, x, b)
    })
}

/// A forward 2-D convolution: input (n, c, h, w), weight (o, c / groups, kh, kw).
pub(super) struct Conv2d {
    pub input: [i64; 4],
    pub out: [i64; 4],
    pub kernel: [i64; 2],
    pub stride: [i64; 2],
    pub pad: [i64; 2],
    pub dilation: [i64; 2],
    pub groups: i64,
}

impl Ctx<'_> {
    /// The geometry of a forward, non-transposed 2-D convolution in a float dtype.
    pub(super) fn conv2d(&self) -> LResult<Option<Conv2d>> {
        let out = self.out_meta()?;
        let (Some(Arg::Node(x)), Some(Arg::Node(w))) = (self.arg(0, "input"), self.arg(1, "weight")) else { return Ok(None) };
        let (Some(xm), Some(wm)) = (self.graph.node(*x).meta.tensor(), self.graph.node(*w).meta.tensor()) else { return Ok(None) };
        if !out.dtype.is_float() || xm.dtype != out.dtype || wm.dtype != out.dtype {
            return Ok(None);
        }
        if xm.shape.len() != 4 || wm.shape.len() != 4 || out.shape.len() != 4 || self.bool_arg(6, "transposed", false)? {
            return Ok(None);
        }
        let pair = |v: Option<Vec<i64>>| -> Option<[i64; 2]> {
            match v.as_deref() {
                Some([a, b]) => Some([*a, *b]),
                _ => None,
            }
        };
        let (Some(stride), Some(pad), Some(dilation)) =
            (pair(self.ints_arg(3, "stride")?), pair(self.ints_arg(4, "padding")?), pair(self.ints_arg(5, "dilation")?))
        else {
            return Ok(None);
        };
        let groups = self.int_arg(8, "groups")?.unwrap_or(1);
        let dims = |s: &[i64]| [s[0], s[1], s[2], s[3]];
        if out.shape.contains(&0) || xm.shape.contains(&0) || groups < 1 {
            return Ok(None);
        }
        Ok(Some(Conv2d {
            input: dims(&xm.shape),
            out: dims(&out.shape),
            kernel: [wm.shape[2], wm.shape[3]],
            stride,
            pad,
            dilation,
            groups,
        }))
    }

    /// The convolution's bias tensor, if it has one.
    pub(super) fn bias(&self) -> LResult<Option<TensorValue>> {
        match self.arg(2, "bias") {
            Some(Arg::Node(_)) => Ok(Some(self.tensor_arg(2, "bias")?)),
            _ => Ok(None),
        }
    }
}
