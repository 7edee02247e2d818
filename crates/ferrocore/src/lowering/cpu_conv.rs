//! CPU convolutions that skip oneDNN where its fixed cost is most of the call (pass `layout`,
//! logged there). A oneDNN convolution costs about 45 us per call on the project's 2-core
//! machine whatever its size (2x8x1x1 to 24 channels: 47 us; 2x24x16x16 5x5 depthwise: 46 us),
//! and MobileNetV3 runs 50 of them per forward. So, forward, on the CPU:
//! - a 1x1 convolution (stride 1, no padding, one group) of at most `MAX_GEMM_MACS`
//!   multiply-adds is a GEMM: one `mm` over the (N*H*W, C) pixels of a channels-last input or a
//!   1x1 map, a `bmm` of the weight against each image of an NCHW one. 2x24x4x4 to 120
//!   channels: 5.6 us against oneDNN's 34 us NHWC; at 8x64x56x56 to 256 oneDNN's 4.7 ms beat
//!   mm's 6.0 ms, hence the bound.
//! - a depthwise convolution (one group per channel, one output channel per group) of at most
//!   `MAX_DEPTHWISE_TAPS` taps and `MAX_DEPTHWISE_MACS` multiply-adds is a generated kernel:
//!   the window unrolled over a zero-padded copy of the input, one load per tap, lanes along
//!   the channels of a channels-last graph, the bias added in it. 2x16x8x8 7x7: 18 against
//!   35 us per compiled call; they break even at 2x32x32x32 3x3 (590K multiply-adds), and
//!   oneDNN is 2x faster at 8x144x28x28 3x3 (its kernels block registers along the rows).
//!
//! `python/ferrocore/conv_layout.py` leaves both kinds out of its layout measurement: they run
//! about as fast either way.

use super::indexing::constant_padded;
use super::layout::{channels_last_strides, Conv2d};
use super::*;

/// The largest 1x1 convolution (N*H*W*C*O multiply-adds) run as a GEMM.
pub const MAX_GEMM_MACS: i64 = 1 << 25;
/// The largest depthwise window (kh*kw) run as a generated kernel: ConvNeXt's 7x7.
pub const MAX_DEPTHWISE_TAPS: i64 = 49;
/// The largest depthwise convolution (output elements x taps) run as a generated kernel.
pub const MAX_DEPTHWISE_MACS: i64 = 1 << 19;

impl Conv2d {
    fn macs(&self) -> i64 {
        self.out.iter().product::<i64>() * self.input[1] / self.groups * self.kernel[0] * self.kernel[1]
    }

    fn is_pointwise(&self) -> bool {
        self.groups == 1 && self.kernel == [1, 1] && self.stride == [1, 1] && self.pad == [0, 0]
    }

    fn is_depthwise(&self) -> bool {
        self.groups > 1 && self.groups == self.input[1] && self.out[1] == self.groups
    }

    fn runs_as_gemm(&self) -> bool {
        self.is_pointwise() && self.macs() <= MAX_GEMM_MACS
    }

    fn runs_as_depthwise_kernel(&self) -> bool {
        self.is_depthwise() && self.kernel[0] * self.kernel[1] <= MAX_DEPTHWISE_TAPS && self.macs() <= MAX_DEPTHWISE_MACS
    }
}

/// Whether the forward 2-D CPU convolution of input `input` (n, c, h, w) and weight `weight`
/// (o, c / groups, kh, kw) runs as a GEMM or a generated kernel instead of oneDNN (the rules
/// above): `python/ferrocore/conv_layout.py` asks this through the extension.
pub fn runs_compiled(input: [i64; 4], weight: [i64; 4], stride: [i64; 2], pad: [i64; 2], dilation: [i64; 2], groups: i64) -> bool {
    let side = |i: usize| (input[2 + i] + 2 * pad[i] - dilation[i] * (weight[2 + i] - 1) - 1).div_euclid(stride[i]) + 1;
    let g = Conv2d { input, out: [input[0], weight[0], side(0), side(1)], kernel: [weight[2], weight[3]], stride, pad, dilation, groups };
    g.runs_as_gemm() || g.runs_as_depthwise_kernel()
}

impl Ctx<'_> {
    /// The current convolution node as a GEMM or a generated kernel where the rules above say
    /// so; None leaves it to the library.
    pub(super) fn cpu_convolution(&mut self) -> LResult<Option<Lowered>> {
        if self.out_meta()?.device != Device::Cpu {
            return Ok(None);
        }
        let Some(g) = self.conv2d()? else { return Ok(None) };
        let name = self.node_name();
        if g.runs_as_gemm() {
            let how = if g.out[2] * g.out[3] == 1 || self.channels_last { "mm" } else { "bmm per image" };
            self.decisions
                .push(("layout", format!("convolution: {name} 1x1 {:?} -> {} channels runs as a GEMM ({how})", g.input, g.out[1])));
            return self.conv_as_gemm(&g).map(Some);
        }
        if g.runs_as_depthwise_kernel() {
            self.decisions.push((
                "layout",
                format!("convolution: {name} depthwise {:?} {}x{} runs as a generated kernel", g.input, g.kernel[0], g.kernel[1]),
            ));
            return self.depthwise_kernel(&g).map(Some);
        }
        Ok(None)
    }

    /// A 1x1 convolution as `mm` (pixels x channels against the weight's transpose) or, for an
    /// NCHW input with more than one pixel, `bmm` (the weight against each image's channels x
    /// pixels); the bias is added by the kernels after it.
    fn conv_as_gemm(&mut self, g: &Conv2d) -> LResult<Lowered> {
        let [n, c, h, w] = g.input;
        let o = g.out[1];
        let Some(Arg::Node(x)) = self.arg(0, "input") else { return malformed("convolution input") };
        let x = *x;
        let weight = self.tensor_arg(1, "weight")?;
        let (wb, ws, woff) = self.strided_arg(1, "weight", &weight)?;
        let out = self.out_meta()?.clone();
        let meta = |shape: Vec<i64>| {
            Meta::Tensor(TensorMeta { stride: contiguous_strides(&shape), shape, storage_offset: 0, dtype: out.dtype, device: out.device })
        };
        let (args, product, stride) = if h * w == 1 || self.channels_last {
            let (xb, xoff) = self.pixel_rows(x, h * w == 1)?;
            let rows = ExternArg::View { buf: xb, size: vec![n * h * w, c], stride: vec![c, 1], offset: xoff };
            let wt = ExternArg::View { buf: wb, size: vec![c, o], stride: vec![ws[1], ws[0]], offset: woff };
            (vec![rows, wt], (AtenOp::Mm, vec![n * h * w, o]), channels_last_strides(&g.out))
        } else {
            let tv = self.realized_node(x, false)?;
            let (xb, xs, xoff) = match tv.strided() {
                Some((b, s, off)) if s[2] == s[3] * w => (b, s, off),
                _ => {
                    let l = Layout::contiguous(&tv.size, tv.dtype, tv.device);
                    let r = self.realize_into(&tv, l);
                    r.strided().ok_or((LowerErrorKind::Malformed, "realized input is not strided".to_string()))?
                }
            };
            let images = ExternArg::View { buf: xb, size: vec![n, c, h * w], stride: vec![xs[0], xs[1], xs[3]], offset: xoff };
            let wt = ExternArg::View { buf: wb, size: vec![n, o, c], stride: vec![0, ws[0], ws[1]], offset: woff };
            (vec![wt, images], (AtenOp::Bmm, vec![n, o, h * w]), contiguous_strides(&g.out))
        };
        let kind = ExternKind::Library { hazard: externs::capture_hazard(product.0), exact_strides: false };
        let Lowered::Tensor(p) = self.push_extern(format!("torch.ops.{}", product.0.name()), args, vec![], &meta(product.1), kind)? else {
            return malformed("GEMM produced no tensor");
        };
        let Some((buf, _, _)) = p.strided() else { return malformed("GEMM result is not a buffer") };
        let conv = view_of_layout(buf, &Layout { size: g.out.to_vec(), stride, offset: 0, dtype: out.dtype, device: out.device });
        Ok(Lowered::Tensor(match self.bias()? {
            Some(b) => layout::add_channel_bias(conv, b),
            None => conv,
        }))
    }

    /// Node `x` (4-D) as rows of channels: its buffer and offset, laid out so that pixel p's
    /// channel k is at p * C + k (NHWC; any layout of a 1x1 map whose channels are dense).
    fn pixel_rows(&mut self, x: NodeId, one_pixel: bool) -> LResult<(BufferId, i64)> {
        let tv = self.realized_node(x, false)?;
        if one_pixel {
            if let Some((b, s, off)) = tv.strided() {
                if s[1] == 1 && (tv.size[0] == 1 || s[0] == tv.size[1]) {
                    return Ok((b, off));
                }
            }
        }
        match self.channels_last_arg(x)? {
            ExternArg::View { buf, offset, .. } => Ok((buf, offset)),
            ExternArg::Buffer(buf) => Ok((buf, 0)),
            _ => malformed("convolution input is not a tensor"),
        }
    }

    /// A depthwise convolution as a pointwise kernel over its output: each tap one affine load
    /// of the (zero-padded) input times the channel's weight.
    fn depthwise_kernel(&mut self, g: &Conv2d) -> LResult<Lowered> {
        let x = self.tensor_arg(0, "input")?;
        let x = if g.pad == [0, 0] { x } else { self.plane_padded(g, &x)? };
        let (xb, xs, xoff) = self.strided_arg(0, "input", &x)?;
        let mut weight = self.tensor_arg(1, "weight")?;
        let out = self.out_meta()?.clone();
        let [kh, kw] = g.kernel;
        let ch = g.out[1];
        if self.channels_last {
            // channels innermost, so a tap's weights load as one vector along the lanes
            let l = Layout {
                size: weight.size.clone(),
                stride: vec![1, ch * kh * kw, kw * ch, ch],
                offset: 0,
                dtype: weight.dtype,
                device: weight.device,
            };
            weight = self.realize_into(&weight, l);
        }
        let bias = self.bias()?;
        let acc = out.dtype.compute();
        let layout = self.fresh_layout(&out.shape, out.dtype, out.device);
        let order = loop_order(&layout);
        let ranges: Vec<i64> = order.iter().map(|&d| out.shape[d]).collect();
        let obuf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let mut body = LoopBody::default();
        {
            let mut bx = Bx { body: &mut body, ranges: ranges.clone() };
            let mut idx = vec![IndexExpr::zero(); 4];
            for (i, &d) in order.iter().enumerate() {
                idx[d] = IndexExpr::var(Var(i as u32));
            }
            let mut sum = match &bias {
                Some(b) => {
                    let v = b.load(&mut bx, &idx[1..2]);
                    bx.body.cast(v, acc)
                }
                None => bx.body.constant(Scalar::Float(0.0), acc),
            };
            for i in 0..kh {
                for j in 0..kw {
                    let mut at = IndexExpr::constant(xoff).add(&idx[0].scale(xs[0])).add(&idx[1].scale(xs[1]));
                    for (d, k) in [(0, i), (1, j)] {
                        at = at.add(&idx[2 + d].scale(g.stride[d]).add_const(k * g.dilation[d]).scale(xs[2 + d]));
                    }
                    let v = bx.body.load(xb, at, x.dtype);
                    let v = bx.body.cast(v, acc);
                    let wv = weight.load(&mut bx, &[idx[1].clone(), IndexExpr::zero(), IndexExpr::constant(i), IndexExpr::constant(j)]);
                    let wv = bx.body.cast(wv, acc);
                    let t = bx.body.binary(BinaryOp::Mul, v, wv);
                    sum = bx.body.binary(BinaryOp::Add, sum, t);
                }
            }
            let r = bx.body.cast(sum, out.dtype);
            bx.body.set_store(layout.index_of(&idx), r);
        }
        self.push_node(LoopNode { output: obuf, ranges, reduction_ranges: vec![], body, origins: vec![self.node_name()], template: None });
        Ok(Lowered::Tensor(view_of_layout(obuf, &layout)))
    }

    /// The input with the convolution's zero padding written around each plane: a tap then
    /// reads without a bounds test (g++ left the kernel scalar with one masked select per tap).
    fn plane_padded(&mut self, g: &Conv2d, x: &TensorValue) -> LResult<TensorValue> {
        let base = self.strided_arg(0, "input", x)?;
        let [ph, pw] = g.pad;
        let size = [x.size[0], x.size[1], x.size[2] + 2 * ph, x.size[3] + 2 * pw];
        let padded = constant_padded(base, x, vec![0, 0, ph, pw], &size, Scalar::Int(0));
        // the convolution's own input: channels-last in a channels-last graph, though no
        // convolution of the graph has its padded shape
        let layout = match self.channels_last {
            true => Layout { size: size.to_vec(), stride: channels_last_strides(&size), offset: 0, dtype: x.dtype, device: x.device },
            false => Layout::contiguous(&size, x.dtype, x.device),
        };
        Ok(self.realize_into(&padded, layout))
    }
}
