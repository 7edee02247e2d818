//! Resampling gathers: bilinear upsampling (upsample_bilinear2d), grid_sampler_2d / _3d
//! (bilinear, nearest and bicubic taps with zeros / border / reflection padding) and col2im
//! (F.fold). Every output element is computed from its index: source positions come from index
//! arithmetic, values from `LoadIndirect` at positions clamped into the input, and taps outside
//! the input are masked to zero. Arithmetic follows ATen's CPU kernels (float32 for half types).

use super::indexing::{and_in_range, clamp_index, strided_base};
use super::*;

/// A float constant of the compute type `ct` (host values are already rounded to it).
fn fconst(bx: &mut Bx, v: f64, ct: DType) -> ValueId {
    bx.body.constant(Scalar::Float(v), ct)
}

/// `v` rounded to the precision ATen computes in (float for everything but double).
fn in_precision(v: f64, ct: DType) -> f64 {
    if ct == DType::F64 {
        v
    } else {
        v as f32 as f64
    }
}

/// ATen's area_pixel_compute_scale, evaluated on the host in the compute precision.
fn area_scale(input: i64, output: i64, align_corners: bool, factor: Option<f64>, ct: DType) -> f64 {
    let div = |a: i64, b: i64| if ct == DType::F64 { a as f64 / b as f64 } else { (a as f32 / b as f32) as f64 };
    if align_corners {
        return if output > 1 { div(input - 1, output - 1) } else { 0.0 };
    }
    match factor {
        Some(s) if s > 0.0 => in_precision(1.0 / s, ct),
        _ => div(input, output),
    }
}

/// One interpolated axis of bilinear upsampling: both source indices and their weights.
struct LinearTaps {
    index: [ValueId; 2],
    weight: [ValueId; 2],
}

/// ATen's compute_source_index_and_lambda for output position `o`; `copy`: the axis is copied.
fn linear_taps(bx: &mut Bx, o: &IndexExpr, input: i64, copy: bool, scale: f64, align_corners: bool, ct: DType) -> LinearTaps {
    let one = fconst(bx, 1.0, ct);
    let zero = fconst(bx, 0.0, ct);
    if copy {
        let i = bx.body.index(o.clone(), DType::I64);
        return LinearTaps { index: [i, i], weight: [one, zero] };
    }
    let oi = bx.body.index(o.clone(), DType::I64);
    let of = bx.body.cast(oi, ct);
    let s = fconst(bx, scale, ct);
    let src = if align_corners {
        bx.body.binary(BinaryOp::Mul, s, of)
    } else {
        let half = fconst(bx, 0.5, ct);
        let c = bx.body.binary(BinaryOp::Add, of, half);
        let p = bx.body.binary(BinaryOp::Mul, s, c);
        let r = bx.body.binary(BinaryOp::Sub, p, half);
        bx.body.binary(BinaryOp::Maximum, r, zero)
    };
    // src >= 0, so truncation is floor
    let t = bx.body.cast(src, DType::I64);
    let i0 = clamp_index(bx, t, input - 1);
    let one_i = bx.body.constant(Scalar::Int(1), DType::I64);
    let n = bx.body.binary(BinaryOp::Add, i0, one_i);
    let i1 = clamp_index(bx, n, input - 1);
    let i0f = bx.body.cast(i0, ct);
    let d = bx.body.binary(BinaryOp::Sub, src, i0f);
    let d = bx.body.binary(BinaryOp::Maximum, d, zero);
    let l1 = bx.body.binary(BinaryOp::Minimum, d, one);
    let l0 = bx.body.binary(BinaryOp::Sub, one, l1);
    LinearTaps { index: [i0, i1], weight: [l0, l1] }
}

/// An integral position on one axis: (index clamped into the axis, whether it lies inside).
type Tap = (ValueId, ValueId);

#[derive(Clone, Copy, PartialEq)]
enum Padding {
    Zeros,
    Border,
    Reflection,
}

/// Which of ATen's grid sampler kernels an axis reproduces: eager differs between them where
/// coordinates are not finite or huge.
#[derive(Clone, Copy, PartialEq)]
enum Flavor {
    /// CPU grid_sampler_2d (vectorized): NaN clips to 0.
    CpuVector,
    /// CPU grid_sampler_3d (scalar): the same maths in another order; NaN clips to the far border.
    CpuScalar,
    /// CUDA (GridSampler.cuh): the scalar maths, NaN clipping to 0 (fmaxf), a reflection count
    /// that saturates, and non-finite or huge positions moved far outside (to -100).
    Cuda,
}

/// One spatial axis of a grid sampler: maps grid coordinates in [-1, 1] to input positions.
#[derive(Clone, Copy)]
struct GridAxis {
    size: i64,
    align_corners: bool,
    padding: Padding,
    ct: DType,
    flavor: Flavor,
}

impl GridAxis {
    fn c(&self, bx: &mut Bx, v: f64) -> ValueId {
        fconst(bx, in_precision(v, self.ct), self.ct)
    }

    /// [-1, 1] -> [0, size - 1] (align_corners) or [-0.5, size - 0.5].
    fn unnormalize(&self, bx: &mut Bx, g: ValueId) -> ValueId {
        let one = self.c(bx, 1.0);
        let shifted = bx.body.binary(BinaryOp::Add, g, one);
        if self.flavor != Flavor::CpuVector {
            // ((g + 1) / 2) * (size - 1), or ((g + 1) * size - 1) / 2
            let two = self.c(bx, 2.0);
            return if self.align_corners {
                let h = bx.body.binary(BinaryOp::TrueDiv, shifted, two);
                let m = self.c(bx, (self.size - 1) as f64);
                bx.body.binary(BinaryOp::Mul, h, m)
            } else {
                let n = self.c(bx, self.size as f64);
                let p = bx.body.binary(BinaryOp::Mul, shifted, n);
                let p = bx.body.binary(BinaryOp::Sub, p, one);
                bx.body.binary(BinaryOp::TrueDiv, p, two)
            };
        }
        if self.align_corners {
            let f = self.c(bx, (self.size - 1) as f64 / 2.0);
            bx.body.binary(BinaryOp::Mul, shifted, f)
        } else {
            let f = self.c(bx, self.size as f64 / 2.0);
            let p = bx.body.binary(BinaryOp::Mul, shifted, f);
            let half = self.c(bx, 0.5);
            bx.body.binary(BinaryOp::Sub, p, half)
        }
    }

    /// Clamp into [0, size - 1]; NaN becomes size - 1 in the CPU scalar kernel, else 0.
    fn clip(&self, bx: &mut Bx, x: ValueId) -> ValueId {
        let zero = self.c(bx, 0.0);
        let top = self.c(bx, (self.size - 1) as f64);
        let lo = if self.flavor == Flavor::CpuScalar {
            let neg = bx.body.binary(BinaryOp::Lt, x, zero);
            bx.body.where_(neg, zero, x)
        } else {
            let pos = bx.body.binary(BinaryOp::Gt, x, zero);
            bx.body.where_(pos, x, zero)
        };
        let below = bx.body.binary(BinaryOp::Lt, lo, top);
        bx.body.where_(below, lo, top)
    }

    /// Reflect at the borders (pixel centers with align_corners, pixel edges without).
    fn reflect(&self, bx: &mut Bx, x: ValueId) -> ValueId {
        let (low, twice_span) = if self.align_corners { (0.0, 2.0 * (self.size - 1) as f64) } else { (-0.5, 2.0 * self.size as f64) };
        if twice_span == 0.0 {
            return self.c(bx, 0.0);
        }
        let lowc = self.c(bx, low);
        let rel = if low == 0.0 { x } else { bx.body.binary(BinaryOp::Sub, x, lowc) };
        let a = bx.body.unary(UnaryOp::Abs, rel);
        if self.flavor != Flavor::CpuVector {
            // fmod by the span, flipped back when the number of whole spans is odd
            let span = self.c(bx, twice_span / 2.0);
            let extra = bx.body.binary(BinaryOp::Fmod, a, span);
            let q = bx.body.binary(BinaryOp::TrueDiv, a, span);
            let flips = bx.body.unary(UnaryOp::Floor, q);
            let two = self.c(bx, 2.0);
            let parity = bx.body.binary(BinaryOp::Fmod, flips, two);
            let one = self.c(bx, 1.0);
            let odd = bx.body.binary(BinaryOp::Eq, parity, one);
            // ATen counts flips in an int: past its range the count reads as even on the CPU
            // (x86's conversion gives INT_MIN) and odd on CUDA (the conversion saturates)
            let lim = self.c(bx, 2147483648.0);
            let fits = bx.body.binary(BinaryOp::Lt, flips, lim);
            let odd = bx.body.binary(BinaryOp::LogicalAnd, odd, fits);
            let odd = if self.flavor == Flavor::Cuda {
                let past = bx.body.binary(BinaryOp::Ge, flips, lim);
                bx.body.binary(BinaryOp::LogicalOr, odd, past)
            } else {
                odd
            };
            let even_r = bx.body.binary(BinaryOp::Add, extra, lowc);
            let back = bx.body.binary(BinaryOp::Sub, span, extra);
            let odd_r = bx.body.binary(BinaryOp::Add, back, lowc);
            return bx.body.where_(odd, odd_r, even_r);
        }
        let span = self.c(bx, twice_span);
        let q = bx.body.binary(BinaryOp::TrueDiv, a, span);
        let flips = bx.body.unary(UnaryOp::Trunc, q);
        let m = bx.body.binary(BinaryOp::Mul, flips, span);
        let extra = bx.body.binary(BinaryOp::Sub, a, m);
        let back = bx.body.binary(BinaryOp::Sub, span, extra);
        let r = bx.body.binary(BinaryOp::Minimum, extra, back);
        if low == 0.0 {
            r
        } else {
            bx.body.binary(BinaryOp::Add, r, lowc)
        }
    }

    /// The padding mode applied to an input position.
    fn pad(&self, bx: &mut Bx, x: ValueId) -> ValueId {
        let padded = match self.padding {
            Padding::Zeros => x,
            Padding::Border => self.clip(bx, x),
            Padding::Reflection => {
                let r = self.reflect(bx, x);
                self.clip(bx, r)
            }
        };
        if self.flavor != Flavor::Cuda {
            return padded;
        }
        // CUDA's safe_downgrade_to_int_range: outside [INT_MIN, INT_MAX - 1] (compared in the
        // coordinate's type) or not finite -> -100, a position every tap misses
        let lo = self.c(bx, -2147483648.0);
        let hi = self.c(bx, 2147483646.0);
        let ge = bx.body.binary(BinaryOp::Ge, padded, lo);
        let le = bx.body.binary(BinaryOp::Le, padded, hi);
        let ok = bx.body.binary(BinaryOp::LogicalAnd, ge, le);
        let far = self.c(bx, -100.0);
        bx.body.where_(ok, padded, far)
    }

    /// An integral position as (index clamped into the axis, whether it lies inside). The
    /// float is selected to 0 before the cast, so no NaN or huge value is ever converted.
    fn tap(&self, bx: &mut Bx, x: ValueId) -> Tap {
        let lo = self.c(bx, -1.0);
        let hi = self.c(bx, self.size as f64);
        let gt = bx.body.binary(BinaryOp::Gt, x, lo);
        let lt = bx.body.binary(BinaryOp::Lt, x, hi);
        let ok = bx.body.binary(BinaryOp::LogicalAnd, gt, lt);
        let zero = self.c(bx, 0.0);
        let safe = bx.body.where_(ok, x, zero);
        let i = bx.body.cast(safe, DType::I64);
        (clamp_index(bx, i, self.size - 1), ok)
    }
}

/// ATen's cubic convolution weights (A = -0.75) for the taps at -1, 0, 1, 2 from `t`.
fn cubic_weights(bx: &mut Bx, t: ValueId, ct: DType) -> [ValueId; 4] {
    const A: f64 = -0.75;
    let c = |bx: &mut Bx, v: f64| fconst(bx, v, ct);
    // ((A x - 5A) x + 8A) x - 4A for 1 < |x| < 2
    let far = |bx: &mut Bx, x: ValueId| {
        let (a, a5, a8, a4) = (c(bx, A), c(bx, 5.0 * A), c(bx, 8.0 * A), c(bx, 4.0 * A));
        let p = bx.body.binary(BinaryOp::Mul, a, x);
        let p = bx.body.binary(BinaryOp::Sub, p, a5);
        let p = bx.body.binary(BinaryOp::Mul, p, x);
        let p = bx.body.binary(BinaryOp::Add, p, a8);
        let p = bx.body.binary(BinaryOp::Mul, p, x);
        bx.body.binary(BinaryOp::Sub, p, a4)
    };
    // ((A + 2) x - (A + 3)) x x + 1 for |x| <= 1
    let near = |bx: &mut Bx, x: ValueId| {
        let (a2, a3, one) = (c(bx, A + 2.0), c(bx, A + 3.0), c(bx, 1.0));
        let p = bx.body.binary(BinaryOp::Mul, a2, x);
        let p = bx.body.binary(BinaryOp::Sub, p, a3);
        let p = bx.body.binary(BinaryOp::Mul, p, x);
        let p = bx.body.binary(BinaryOp::Mul, p, x);
        bx.body.binary(BinaryOp::Add, p, one)
    };
    let one = c(bx, 1.0);
    let two = c(bx, 2.0);
    let x0 = bx.body.binary(BinaryOp::Add, t, one);
    let x2 = bx.body.binary(BinaryOp::Sub, one, t);
    let x3 = bx.body.binary(BinaryOp::Sub, two, t);
    [far(bx, x0), near(bx, t), near(bx, x2), far(bx, x3)]
}

/// Σ values[i] · weights[i], summed left to right as ATen does.
fn weighted_sum(bx: &mut Bx, values: &[ValueId], weights: &[ValueId]) -> ValueId {
    let mut acc = bx.body.binary(BinaryOp::Mul, values[0], weights[0]);
    for (v, w) in values.iter().zip(weights).skip(1) {
        let p = bx.body.binary(BinaryOp::Mul, *v, *w);
        acc = bx.body.binary(BinaryOp::Add, acc, p);
    }
    acc
}

/// Σ over the 4 taps of the next axis of weight · (the same sum over the following axes),
/// the innermost axis (x) summing masked input values: ATen's separable cubic order.
fn cubic_sum(
    bx: &mut Bx,
    prefix: &mut Vec<Tap>,
    taps: &[Vec<Tap>],
    weights: &[[ValueId; 4]],
    value: &dyn Fn(&mut Bx, &[Tap]) -> ValueId,
) -> ValueId {
    let j = prefix.len();
    let mut parts = Vec::with_capacity(4);
    for &t in &taps[j] {
        prefix.push(t);
        parts.push(if j + 1 == taps.len() { value(bx, prefix) } else { cubic_sum(bx, prefix, taps, weights, value) });
        prefix.pop();
    }
    weighted_sum(bx, &parts, &weights[j])
}

/// A grid sampler's checked arguments.
struct GridSamplerArgs {
    /// spatial dims: 2 or 3
    k: usize,
    x: TensorValue,
    grid: TensorValue,
    out: TensorMeta,
    /// 0 bilinear (trilinear in 3-D), 1 nearest, 2 bicubic
    mode: i64,
    padding: Padding,
    align_corners: bool,
}

/// One output element of a grid sampler, in the loop body being built: where its input plane
/// starts and the grid coordinates it samples at.
struct GridSite<'a> {
    buf: BufferId,
    /// the (n, c) plane's first element
    base: IndexExpr,
    stride: &'a [i64],
    dt: DType,
    ct: DType,
    /// the spatial axes, input order
    axes: &'a [GridAxis],
    /// the grid coordinates, one per axis (input order), in the compute type
    coords: Vec<ValueId>,
}

impl GridSite<'_> {
    /// (the input at one tap per axis, whether every tap lies inside)
    fn sample(&self, bx: &mut Bx, taps: &[Tap]) -> (ValueId, ValueId) {
        let terms = taps.iter().enumerate().map(|(j, t)| (t.0, self.stride[2 + j])).collect();
        let v = bx.body.load_indirect(self.buf, self.base.clone(), terms, self.dt);
        let v = bx.body.cast(v, self.ct);
        let ok = taps.iter().skip(1).fold(taps[0].1, |a, t| bx.body.binary(BinaryOp::LogicalAnd, a, t.1));
        (v, ok)
    }

    /// The input at the taps, zero where one lies outside.
    fn masked(&self, bx: &mut Bx, taps: &[Tap]) -> ValueId {
        let (v, ok) = self.sample(bx, taps);
        let zero = fconst(bx, 0.0, self.ct);
        bx.body.where_(ok, v, zero)
    }

    /// The point after unnormalizing and padding, per axis.
    fn points(&self, bx: &mut Bx) -> Vec<ValueId> {
        (0..self.axes.len())
            .map(|j| {
                let u = self.axes[j].unnormalize(bx, self.coords[j]);
                self.axes[j].pad(bx, u)
            })
            .collect()
    }

    /// Nearest: the point rounded half to even, like ATen's nearbyint.
    fn nearest(&self, bx: &mut Bx) -> ValueId {
        let p = self.points(bx);
        let taps: Vec<_> = (0..self.axes.len())
            .map(|j| {
                let r = bx.body.unary(UnaryOp::Round, p[j]);
                self.axes[j].tap(bx, r)
            })
            .collect();
        self.masked(bx, &taps)
    }

    /// 2-D bilinear: the four surrounding taps weighted by the opposite areas.
    fn bilinear(&self, bx: &mut Bx) -> ValueId {
        let axes = self.axes;
        let p = self.points(bx);
        let (py, px) = (p[0], p[1]);
        let (west, north) = (bx.body.unary(UnaryOp::Floor, px), bx.body.unary(UnaryOp::Floor, py));
        let one = fconst(bx, 1.0, self.ct);
        let east = bx.body.binary(BinaryOp::Add, west, one);
        let south = bx.body.binary(BinaryOp::Add, north, one);
        // distances to the west / north taps, and their complements
        let dw = bx.body.binary(BinaryOp::Sub, px, west);
        let de = bx.body.binary(BinaryOp::Sub, one, dw);
        let dn = bx.body.binary(BinaryOp::Sub, py, north);
        let ds = bx.body.binary(BinaryOp::Sub, one, dn);
        let weights = [
            bx.body.binary(BinaryOp::Mul, ds, de),
            bx.body.binary(BinaryOp::Mul, ds, dw),
            bx.body.binary(BinaryOp::Mul, dn, de),
            bx.body.binary(BinaryOp::Mul, dn, dw),
        ];
        let (tw, te) = (axes[1].tap(bx, west), axes[1].tap(bx, east));
        let (tn, ts) = (axes[0].tap(bx, north), axes[0].tap(bx, south));
        let values = [self.masked(bx, &[tn, tw]), self.masked(bx, &[tn, te]), self.masked(bx, &[ts, tw]), self.masked(bx, &[ts, te])];
        weighted_sum(bx, &values, &weights)
    }

    /// Bicubic: padding applies to each integral tap, not to the point; the cubic runs along x
    /// first, then y (then z).
    fn bicubic(&self, bx: &mut Bx) -> ValueId {
        let k = self.axes.len();
        let mut taps = Vec::with_capacity(k);
        let mut weights = Vec::with_capacity(k);
        for (j, a) in self.axes.iter().enumerate() {
            let u = a.unnormalize(bx, self.coords[j]);
            let fl = bx.body.unary(UnaryOp::Floor, u);
            let t = bx.body.binary(BinaryOp::Sub, u, fl);
            weights.push(cubic_weights(bx, t, self.ct));
            let axis_taps: Vec<Tap> = (-1..3)
                .map(|d| {
                    let dc = fconst(bx, d as f64, self.ct);
                    let p = if d == 0 { fl } else { bx.body.binary(BinaryOp::Add, fl, dc) };
                    let p = a.pad(bx, p);
                    a.tap(bx, p)
                })
                .collect();
            taps.push(axis_taps);
        }
        cubic_sum(bx, &mut Vec::with_capacity(k), &taps, &weights, &|bx: &mut Bx, t: &[Tap]| self.masked(bx, t))
    }

    /// 3-D trilinear, as ATen's scalar kernel: in-bounds taps add value · weight.
    fn trilinear(&self, bx: &mut Bx) -> ValueId {
        let k = self.axes.len();
        let p = self.points(bx);
        let one = fconst(bx, 1.0, self.ct);
        let mut taps = Vec::with_capacity(k);
        let mut factors = Vec::with_capacity(k);
        for (&pj, axis) in p.iter().zip(self.axes) {
            let lo = bx.body.unary(UnaryOp::Floor, pj);
            let hi = bx.body.binary(BinaryOp::Add, lo, one);
            factors.push([bx.body.binary(BinaryOp::Sub, hi, pj), bx.body.binary(BinaryOp::Sub, pj, lo)]);
            taps.push([axis.tap(bx, lo), axis.tap(bx, hi)]);
        }
        let zero = fconst(bx, 0.0, self.ct);
        let mut acc = zero;
        for corner in 0..8usize {
            let side = [(corner >> 2) & 1, (corner >> 1) & 1, corner & 1]; // (z, y, x)
            let w = bx.body.binary(BinaryOp::Mul, factors[2][side[2]], factors[1][side[1]]);
            let w = bx.body.binary(BinaryOp::Mul, w, factors[0][side[0]]);
            let (v, ok) = self.sample(bx, &[taps[0][side[0]], taps[1][side[1]], taps[2][side[2]]]);
            let t = bx.body.binary(BinaryOp::Mul, v, w);
            let t = bx.body.where_(ok, t, zero);
            acc = bx.body.binary(BinaryOp::Add, acc, t);
        }
        acc
    }
}

/// col2im's block coordinate along one axis for output position `o` and kernel offset `k`:
/// (block index clamped into [0, blocks), whether the kernel tap really lands on `o`).
fn fold_block(bx: &mut Bx, o: &IndexExpr, k: i64, pad: i64, dil: i64, stride: i64, blocks: i64) -> Tap {
    let num = bx.body.index(o.add_const(pad - k * dil), DType::I64);
    let end = bx.body.constant(Scalar::Int(blocks), DType::I64);
    if stride == 1 {
        let ok = and_in_range(bx, None, num, end);
        return (clamp_index(bx, num, blocks - 1), ok);
    }
    let s = bx.body.constant(Scalar::Int(stride), DType::I64);
    let q = bx.body.binary(BinaryOp::FloorDiv, num, s);
    let r = bx.body.binary(BinaryOp::Remainder, num, s);
    let zero = bx.body.constant(Scalar::Int(0), DType::I64);
    let on_grid = bx.body.binary(BinaryOp::Eq, r, zero);
    let inside = and_in_range(bx, None, q, end);
    let ok = bx.body.binary(BinaryOp::LogicalAnd, on_grid, inside);
    (clamp_index(bx, q, blocks - 1), ok)
}

// Kernels with more taps than this would unroll into very large bodies: left to ATen.
const MAX_FOLD_TAPS: i64 = 256;

impl Ctx<'_> {
    /// upsample_bilinear2d (.vec and .default): each output reads its 2x2 neighbourhood.
    pub(super) fn lower_upsample_bilinear(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, if op == AtenOp::UpsampleBilinear2dVec { "input" } else { "self" })?;
        let out = self.out_meta()?.clone();
        if x.size.len() != 4 || out.shape.len() != 4 || out.shape[..2] != x.size[..2] {
            return malformed(format!("upsample_bilinear2d of {:?} into {:?}", x.size, out.shape));
        }
        if !x.dtype.is_float() {
            return unsupported(format!("bilinear upsampling of {}", x.dtype));
        }
        if x.size[2..].iter().chain(&out.shape[2..]).any(|&s| s == 0) {
            return unsupported("bilinear upsampling of an empty plane (ATen raises)");
        }
        let align_corners = self.bool_arg(2, "align_corners", false)?;
        let factors: [Option<f64>; 2] = if op == AtenOp::UpsampleBilinear2dVec {
            match self.arg(3, "scale_factors") {
                None | Some(Arg::None) => [None, None],
                Some(Arg::List(items)) if items.len() == 2 => {
                    let f = |a: &Arg| match a {
                        Arg::Float(v) => Ok(Some(*v)),
                        Arg::Int(v) => Ok(Some(*v as f64)),
                        other => malformed(format!("scale factor must be a number, got {other:?}")),
                    };
                    [f(&items[0])?, f(&items[1])?]
                }
                other => return malformed(format!("scale_factors must be two numbers, got {other:?}")),
            }
        } else {
            [self.float_arg(3, "scales_h")?, self.float_arg(4, "scales_w")?]
        };
        let ct = x.dtype.compute();
        let (ins, outs) = (x.size.clone(), out.shape.clone());
        let scales: Vec<f64> = (0..2).map(|k| area_scale(ins[2 + k], outs[2 + k], align_corners, factors[k], ct)).collect();
        // ATen's CPU kernel copies along each axis whose size is unchanged (whatever the scale
        // factor says); its CUDA kernel copies only when both are, and otherwise interpolates
        let same = [ins[2] == outs[2], ins[3] == outs[3]];
        let copy = if matches!(x.device, Device::Cuda(_)) { [same[0] && same[1]; 2] } else { same };
        let (buf, stride, offset) = strided_base(self, &x)?;
        let dt = x.dtype;
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let base = IndexExpr::constant(offset).add(&idx[0].scale(stride[0])).add(&idx[1].scale(stride[1]));
            let h = linear_taps(bx, &idx[2], ins[2], copy[0], scales[0], align_corners, ct);
            let w = linear_taps(bx, &idx[3], ins[3], copy[1], scales[1], align_corners, ct);
            let mut rows = Vec::with_capacity(2);
            for &hi in &h.index {
                let vals: Vec<ValueId> = w
                    .index
                    .iter()
                    .map(|&wi| {
                        let v = bx.body.load_indirect(buf, base.clone(), vec![(hi, stride[2]), (wi, stride[3])], dt);
                        bx.body.cast(v, ct)
                    })
                    .collect();
                rows.push(weighted_sum(bx, &vals, &w.weight));
            }
            let r = weighted_sum(bx, &rows, &h.weight);
            bx.body.cast(r, dt)
        });
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads: 4, ops: 40 } })
    }

    /// grid_sampler_2d / grid_sampler_3d: input [N, C, (D,) H, W] sampled at a grid
    /// [N, (Do,) Ho, Wo, k] whose last dim holds (x, y(, z)) in [-1, 1].
    pub(super) fn lower_grid_sampler(&mut self, op: AtenOp) -> LResult<TensorValue> {
        let GridSamplerArgs { k, x, grid, out, mode, padding, align_corners } = self.grid_sampler_args(op)?;
        let ct = x.dtype.compute();
        // input order (D,) H, W; the grid lists the same axes reversed (x first)
        let flavor = match (&x.device, k) {
            (Device::Cuda(_), _) => Flavor::Cuda,
            (_, 3) => Flavor::CpuScalar,
            _ => Flavor::CpuVector,
        };
        let axes: Vec<GridAxis> = (0..k).map(|j| GridAxis { size: x.size[2 + j], align_corners, padding, ct, flavor }).collect();
        let (buf, stride, offset) = strided_base(self, &x)?;
        let dt = x.dtype;
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let base = IndexExpr::constant(offset).add(&idx[0].scale(stride[0])).add(&idx[1].scale(stride[1]));
            let coords: Vec<ValueId> = (0..k)
                .map(|j| {
                    let mut gi = vec![idx[0].clone()];
                    gi.extend_from_slice(&idx[2..2 + k]);
                    gi.push(IndexExpr::constant((k - 1 - j) as i64));
                    let g = grid.load(bx, &gi);
                    bx.body.cast(g, ct)
                })
                .collect();
            let site = GridSite { buf, base, stride: &stride, dt, ct, axes: &axes, coords };
            let r = match (k, mode) {
                (_, 1) => site.nearest(bx),
                (2, 0) => site.bilinear(bx),
                (_, 2) => site.bicubic(bx),
                _ => site.trilinear(bx),
            };
            bx.body.cast(r, dt)
        });
        let (reads, ops) = match (k, mode) {
            (_, 1) => (1 + k, 15 * k),
            (2, 0) => (6, 60),
            (2, 2) => (18, 300),
            (_, 2) => (67, 1100),
            _ => (11, 120),
        };
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads, ops } })
    }

    /// Reads a grid sampler's arguments and checks them against its input, grid and output.
    fn grid_sampler_args(&self, op: AtenOp) -> LResult<GridSamplerArgs> {
        let k = if op == AtenOp::GridSampler3d { 3 } else { 2 };
        let x = self.tensor_arg(0, "input")?;
        let grid = self.tensor_arg(1, "grid")?;
        let out = self.out_meta()?.clone();
        // cudnn_grid_sampler (what F.grid_sample becomes on CUDA when cuDNN takes it) is the
        // bilinear, zero-padded, align_corners=True case
        let cudnn = op == AtenOp::CudnnGridSampler;
        let mode = if cudnn { 0 } else { self.int_arg(2, "interpolation_mode")?.unwrap_or(0) };
        let padding = match if cudnn { 0 } else { self.int_arg(3, "padding_mode")?.unwrap_or(0) } {
            0 => Padding::Zeros,
            1 => Padding::Border,
            2 => Padding::Reflection,
            p => return malformed(format!("invalid grid_sampler padding mode {p}")),
        };
        if !(0..=2).contains(&mode) {
            return malformed(format!("invalid grid_sampler interpolation mode {mode}"));
        }
        let align_corners = cudnn || self.bool_arg(4, "align_corners", false)?;
        if x.size.len() != k + 2 || grid.size.len() != k + 2 || grid.size[k + 1] != k as i64 || grid.size[0] != x.size[0] {
            return malformed(format!("{} of {:?} at a grid of {:?}", op.name(), x.size, grid.size));
        }
        let mut expect = vec![x.size[0], x.size[1]];
        expect.extend_from_slice(&grid.size[1..=k]);
        if out.shape != expect {
            return malformed(format!("{} output {:?} for grid {:?}", op.name(), out.shape, grid.size));
        }
        if !x.dtype.is_float() || grid.dtype != x.dtype {
            return unsupported(format!("grid sampling of {} at a {} grid", x.dtype, grid.dtype));
        }
        if x.size[2..].contains(&0) {
            return unsupported("grid sampling of an empty input (ATen raises)");
        }
        Ok(GridSamplerArgs { k, x, grid, out, mode, padding, align_corners })
    }

    /// col2im (F.fold): [N?, C·kh·kw, L] -> [N?, C, H, W]; each output pixel sums, in kernel
    /// order, the column entries of every (kernel offset, block) that covers it.
    pub(super) fn lower_col2im(&mut self) -> LResult<TensorValue> {
        let x = self.tensor_arg(0, "self")?;
        let out = self.out_meta()?.clone();
        let pair = |cx: &Self, i: usize, key: &str| -> LResult<[i64; 2]> {
            match cx.ints_arg(i, key)? {
                Some(v) if v.len() == 2 => Ok([v[0], v[1]]),
                Some(v) if v.len() == 1 => Ok([v[0], v[0]]), // an int[2] given as one int
                other => malformed(format!("col2im {key} must have two entries, got {other:?}")),
            }
        };
        let size = pair(self, 1, "output_size")?;
        let kernel = pair(self, 2, "kernel_size")?;
        let dil = pair(self, 3, "dilation")?;
        let pad = pair(self, 4, "padding")?;
        let stride = pair(self, 5, "stride")?;
        if kernel.iter().chain(&dil).chain(&stride).chain(&size).any(|&v| v <= 0) || pad.iter().any(|&p| p < 0) {
            return malformed(format!("col2im kernel {kernel:?} dilation {dil:?} padding {pad:?} stride {stride:?}"));
        }
        let batched = match x.size.len() {
            3 => true,
            2 => false,
            r => return malformed(format!("col2im takes a 2-D or 3-D input, got rank {r}")),
        };
        let nb = batched as usize;
        let taps = kernel[0] * kernel[1];
        let blocks: Vec<i64> = (0..2).map(|d| (size[d] + 2 * pad[d] - dil[d] * (kernel[d] - 1) - 1) / stride[d] + 1).collect();
        let rows = x.size[nb];
        if rows % taps != 0 || blocks.iter().any(|&b| b <= 0) || x.size[nb + 1] != blocks[0] * blocks[1] {
            return malformed(format!("col2im input {:?} does not match {blocks:?} blocks of kernel {kernel:?}", x.size));
        }
        let mut expect: Vec<i64> = x.size[..nb].to_vec();
        expect.extend([rows / taps, size[0], size[1]]);
        if out.shape != expect {
            return malformed(format!("col2im output {:?}, expected {expect:?}", out.shape));
        }
        if !x.dtype.is_float() {
            return unsupported(format!("col2im of {}", x.dtype));
        }
        if taps > MAX_FOLD_TAPS {
            return unsupported(format!("col2im with {taps} kernel taps"));
        }
        if x.numel() == 0 {
            return unsupported("col2im of an empty input");
        }
        let (buf, xs, offset) = strided_base(self, &x)?;
        let (dt, ct) = (x.dtype, x.dtype.compute());
        let f: LoadFn = Rc::new(move |bx: &mut Bx, idx: &[IndexExpr]| {
            let mut base = IndexExpr::constant(offset);
            if batched {
                base = base.add(&idx[0].scale(xs[0]));
            }
            // first input row of channel c
            base = base.add(&idx[nb].scale(taps * xs[nb]));
            let (oh, ow) = (&idx[nb + 1], &idx[nb + 2]);
            let hb: Vec<_> = (0..kernel[0]).map(|k| fold_block(bx, oh, k, pad[0], dil[0], stride[0], blocks[0])).collect();
            let wb: Vec<_> = (0..kernel[1]).map(|k| fold_block(bx, ow, k, pad[1], dil[1], stride[1], blocks[1])).collect();
            let zero = fconst(bx, 0.0, ct);
            let mut acc: Option<ValueId> = None;
            for (ki, &(bh, okh)) in hb.iter().enumerate() {
                for (kj, &(bw, okw)) in wb.iter().enumerate() {
                    let row = (ki as i64) * kernel[1] + kj as i64;
                    let at = base.add_const(row * xs[nb]);
                    let v = bx.body.load_indirect(buf, at, vec![(bh, blocks[1] * xs[nb + 1]), (bw, xs[nb + 1])], dt);
                    let v = bx.body.cast(v, ct);
                    let ok = bx.body.binary(BinaryOp::LogicalAnd, okh, okw);
                    let term = bx.body.where_(ok, v, zero);
                    acc = Some(match acc {
                        Some(a) => bx.body.binary(BinaryOp::Add, a, term),
                        None => term,
                    });
                }
            }
            let r = acc.unwrap_or(zero);
            bx.body.cast(r, dt)
        });
        let reads = taps as usize;
        Ok(TensorValue { size: out.shape.clone(), dtype: out.dtype, device: out.device, src: Src::Lazy { f, reads, ops: 8 * reads } })
    }
}
