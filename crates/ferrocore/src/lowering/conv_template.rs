//! GPU convolutions as implicit-GEMM template kernels (`Template::Convolution`), chosen as GEMM
//! templates are (`gemm_template`: measured with their epilogue by the front, cached, or always):
//! the output's pixels are the rows of a matrix product, its channels the columns, and each
//! tap's input channels a slice of the sum. The pointwise work after the convolution (its bias,
//! an activation, a residual add) joins the kernel as its epilogue, where cuDNN's call would
//! write the convolution out and a separate kernel read it back.

use super::indexing::{and_in_range, clamp_index};
use super::layout::{add_channel_bias, Conv2d};
use super::*;

impl Ctx<'_> {
    /// The current forward convolution as a template kernel where `gemm_template` asks for one:
    /// a Triton graph laid out channels-last (the template writes its result so, in the order of
    /// its rows and columns), a dense 2-D convolution of 16- or 32-bit floats. None leaves it to
    /// the library.
    pub(super) fn convolution_template(&mut self) -> LResult<Option<Lowered>> {
        if self.kernels != KernelLanguage::Triton || !self.channels_last || self.gemm_template == GemmTemplate::Never {
            return Ok(None);
        }
        let Some(g) = self.conv2d()? else { return Ok(None) };
        let out = self.out_meta()?.clone();
        // dense, or depthwise with one filter per channel
        let depthwise = g.groups > 1 && g.groups == g.input[1] && g.groups == g.out[1];
        if (g.groups != 1 && !depthwise) || !matches!(out.dtype, DType::F16 | DType::BF16 | DType::F32) {
            return Ok(None);
        }
        let name = self.node_name();
        let why = match (self.gemm_template, self.graph.template_matmuls.get(&name)) {
            (GemmTemplate::Always, _) => "gemm_template = always".to_string(),
            (_, Some(why)) => why.clone(),
            (_, None) => return Ok(None),
        };
        let conv = self.implicit_gemm(&g, &out, depthwise)?;
        let [_, c, h, w] = g.input;
        self.decisions.push((
            "gemm_template",
            format!(
                "template: {name} {}convolution {c}x{h}x{w} -> {:?} {}x{} {} is {} kernel: {why}",
                if depthwise { "depthwise " } else { "" },
                g.out,
                g.kernel[0],
                g.kernel[1],
                out.dtype.torch_name(),
                if depthwise { "a depthwise" } else { "an implicit-GEMM" }
            ),
        ));
        Ok(Some(Lowered::Tensor(match self.bias()? {
            Some(b) => add_channel_bias(conv, b),
            None => conv,
        })))
    }

    /// The convolution node: its input channels-last (copied when it is not), its weight with
    /// the channels innermost (a tap's slice of the sum is then a contiguous read), the result a
    /// fresh channels-last buffer. A depthwise one sums over the taps alone, reading its input
    /// at the output's channel.
    fn implicit_gemm(&mut self, g: &Conv2d, out: &TensorMeta, depthwise: bool) -> LResult<TensorValue> {
        let (xb, xs, xoff) = self.channels_last_operand(0, "input")?;
        let (wb, ws, woff) = self.channels_last_operand(1, "weight")?;
        let [n, _, h, w] = g.input;
        let [_, o, oh, ow] = g.out;
        let [kh, kw] = g.kernel;
        let c = g.input[1];
        let dt = out.dtype;
        let layout = Layout { size: g.out.to_vec(), stride: channels_last_strides(&g.out), offset: 0, dtype: dt, device: out.device };
        let buf = self.prog.add_buffer(layout.clone(), BufferSource::Computed);
        let v = |i: u32| IndexExpr::var(Var(i));
        // variables: n, oh, ow, o; then kh, kw, c (depthwise: kh, kw; the channel is o's)
        let ranges = vec![n, oh, ow, o];
        let reduction_ranges = if depthwise { vec![kh, kw] } else { vec![kh, kw, c] };
        let channel = if depthwise { v(3) } else { v(6) };
        let mut body = LoopBody::default();
        {
            let mut bx = Bx { body: &mut body, ranges: ranges.iter().chain(&reduction_ranges).copied().collect() };
            let mut inside = None;
            let mut terms = Vec::new();
            for (d, size) in [h, w].into_iter().enumerate() {
                let at = v(1 + d as u32).scale(g.stride[d]).add(&v(4 + d as u32).scale(g.dilation[d])).add_const(-g.pad[d]);
                let i = bx.body.index(at, DType::I64);
                let end = bx.body.constant(Scalar::Int(size), DType::I64);
                inside = Some(and_in_range(&mut bx, inside, i, end));
                terms.push((clamp_index(&mut bx, i, size - 1), xs[2 + d]));
            }
            let base = IndexExpr::constant(xoff).add(&v(0).scale(xs[0])).add(&channel.scale(xs[1]));
            let xv = bx.body.load_indirect(xb, base, terms, dt);
            let xv = bx.body.cast(xv, DType::F32);
            let zero = bx.body.constant(Scalar::Float(0.0), DType::F32);
            let xv = bx.body.where_(inside.expect("two spatial dims"), xv, zero);
            let mut at = IndexExpr::constant(woff).add(&v(3).scale(ws[0])).add(&v(4).scale(ws[2])).add(&v(5).scale(ws[3]));
            if !depthwise {
                at = at.add(&v(6).scale(ws[1]));
            }
            let wv = bx.body.load(wb, at, dt);
            let wv = bx.body.cast(wv, DType::F32);
            let product = bx.body.binary(BinaryOp::Mul, xv, wv);
            let sum = bx.body.reduce(ReduceOp::Sum, product);
            let value = bx.body.cast(sum, dt);
            bx.body.set_store(layout.index_of(&[v(0), v(3), v(1), v(2)]), value);
        }
        let geometry = ConvGeometry { input_hw: [h, w], stride: g.stride, padding: g.pad, dilation: g.dilation, depthwise };
        self.push_node(LoopNode {
            output: buf,
            ranges,
            reduction_ranges,
            body,
            origins: vec![self.node_name()],
            template: Some(Template::Convolution(geometry)),
        });
        Ok(view_of_layout(buf, &layout))
    }

    /// Argument `i` of the current node channels-last (copied so when it is not): its buffer,
    /// strides and offset.
    fn channels_last_operand(&mut self, i: usize, what: &str) -> LResult<(BufferId, Vec<i64>, i64)> {
        let Some(Arg::Node(n)) = self.arg(i, what) else { return malformed(format!("convolution {what} is not a tensor")) };
        match self.channels_last_arg(*n)? {
            ExternArg::View { buf, stride, offset, .. } => Ok((buf, stride, offset)),
            ExternArg::Buffer(buf) => {
                let l = &self.prog.buffer(buf).layout;
                Ok((buf, l.stride.clone(), l.offset))
            }
            _ => malformed(format!("convolution {what} is not a tensor")),
        }
    }
}
