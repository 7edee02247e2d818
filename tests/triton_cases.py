"""End-to-end cases for the Triton backend, run on CPU tensors under Triton's interpreter.

`python tests/triton_cases.py OUT.json` runs every case with the Triton backend forced
(`FERROCORE_BACKEND=triton`, `TRITON_INTERPRET=1`, both set before triton is imported) and writes
per case whether the compiled result matched eager (values, shapes, strides, dtypes), plus the
wrapper modules it generated. tests/test_triton_backend.py runs it in one subprocess and asserts
on each case, so the interpreter's setting never leaks into the other test modules.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.argv[1:2] != ["--aot"]:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["FERROCORE_BACKEND"] = "triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CASES: dict = {}


def case(name: str, atol: float = 1e-5, rtol: float = 1e-5, raises=None, fallback: bool = False, options=None,
         training: bool = False, externs: int | None = None):
    """`training`: the floating inputs require grad; the inputs' gradients (of the output's sum
    weighted by a fixed random tensor) are compared too. `externs`: the library calls the
    compiled graphs make, where the case asserts them."""
    def register(make):
        CASES[name] = dict(make=make, atol=atol, rtol=rtol, raises=raises, fallback=fallback, options=options or {},
                           training=training, externs=externs)
        return make

    return register


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=_g(seed)).to(dtype)


@case("pointwise_chain")
def _():
    return (lambda a, b: torch.sigmoid(torch.relu(a + 1) * b) - a.abs()), (randn(8, 33), randn(8, 33, seed=1))


@case("reduction_over_an_empty_dim")
def _():
    # the input has no elements (its pointer may point nowhere): no load may be issued
    return (lambda a: (torch.prod(a, 0), a.sum(0) + 1)), (randn(1, 6).expand(0, 6),)


@case("negative_constants_of_unsigned_type")
def _():
    # -7 and -1 as uint8 constants wrap (Triton's compiler rejects them unwrapped)
    x = torch.randint(0, 16, (4, 3), generator=_g(2)).to(torch.uint8)
    m = torch.rand(4, 3, generator=_g(3)) < 0.5
    return (lambda a, b: (a.masked_fill(b, -7), torch.where(a > -1, a, 3), a >> 2, torch.square(a))), (x, m)


@case("repeated_layer")
def _():
    # the same bias+gelu kernel between matmuls, three times: defined once, launched thrice
    w = randn(16, 16, seed=3) * 0.3

    def f(x, b):
        for _ in range(3):
            x = F.gelu(x @ w + b)
        return x

    return f, (randn(8, 16), randn(16, seed=1))


@case("broadcasting")
def _():
    return (lambda a, b, c: a + b * c), (randn(8, 1), randn(1, 16, seed=1), randn(16, seed=2))


TEMPLATE = {"gemm_template": "always"}


@case("gemm_template_addmm_relu_residual", atol=1e-4, rtol=1e-4, options=TEMPLATE)
def _():
    # odd sizes (edge tiles, k steps with a remainder); bias, relu and residual in the epilogue
    return (lambda x, w, b, r: torch.relu(torch.addmm(b, x, w)) + r), (
        randn(37, 70), randn(70, 45, seed=1), randn(45, seed=2), randn(37, 45, seed=3))


@case("gemm_template_bf16_linear_gelu", atol=2e-2, rtol=2e-2, options=TEMPLATE)
def _():
    # a 3-D linear layer in bfloat16
    return (lambda x, w, b: F.gelu(F.linear(x, w, b))), (
        randn(2, 9, 48, dtype=torch.bfloat16), randn(24, 48, seed=1, dtype=torch.bfloat16),
        randn(24, seed=2, dtype=torch.bfloat16))


@case("gemm_template_addmm_rounds_once", atol=0, rtol=0, options=TEMPLATE)
def _():
    # 256.5 - 256 is 0.5 when the bias is added before rounding to bfloat16 (eager's addmm), 0
    # when the product is rounded first (bfloat16's step at 256 is 2)
    a = torch.tensor([[256.0, 0.5]] * 20, dtype=torch.bfloat16)
    return (lambda c, a, b: torch.addmm(c, a, b)), (
        torch.full((24,), -256.0, dtype=torch.bfloat16), a, torch.ones(2, 24, dtype=torch.bfloat16))


@case("gemm_template_bmm_transposed_softmax", atol=1e-5, rtol=1e-4, options=TEMPLATE)
def _():
    # a batched product of a transposed operand, stored for the softmax that reads its rows
    return (lambda q, k: torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.125, -1)), (
        randn(3, 33, 40), randn(3, 50, 40, seed=1))


@case("gemm_template_product_read_inside_and_outside", atol=1e-4, rtol=1e-4, options=TEMPLATE)
def _():
    # the product is returned and read by the epilogue: stored once, used from registers
    return (lambda x, w: (x @ w, torch.tanh(x @ w) * 2)), (randn(17, 300), randn(300, 19, seed=1))


def _written_out_attention(mask_of, bias_of=None, keys=72):
    """bfloat16 attention as a model writes it: scores in float32, a float32 bias and a boolean
    mask over positions, a softmax, a product with the values."""
    def attend(q, k, v):
        scores = (q @ k.transpose(-1, -2)).float() * 0.25
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        if bias_of is not None:
            scores = scores + bias_of(i, j)
        scores = scores.masked_fill(~mask_of(i, j), float("-inf"))
        return torch.softmax(scores, -1).to(q.dtype) @ v

    return attend, (randn(2, 3, 80, 16, dtype=torch.bfloat16), randn(2, 3, keys, 16, seed=1, dtype=torch.bfloat16),
                    randn(2, 3, keys, 16, seed=2, dtype=torch.bfloat16))


def _slope(i, j):
    return (j - i).float() * 0.37


@case("attention_template_sliding_window", atol=2e-2, rtol=2e-2)
def _():
    # a band of keys built from positions: each query tile visits the key tiles of its band
    return _written_out_attention(lambda i, j: (j <= i) & (i - j < 20))


@case("attention_template_float32_bias_sliding_window", atol=2e-2, rtol=2e-2)
def _():
    # the mask closes whole key tiles (skipped) and parts of others; 80 rows by 72 keys leave
    # partial tiles on both edges
    return _written_out_attention(lambda i, j: (j <= i) & (i - j < 20), _slope)


@case("attention_template_float32_bias", atol=2e-2, rtol=2e-2)
def _():
    # an ALiBi-like slope x distance, float32 as the graph adds it (not rounded to bfloat16)
    return _written_out_attention(lambda i, j: j <= i + 3, _slope)


@case("attention_template_causal_float32_bias", atol=2e-2, rtol=2e-2)
def _():
    # a proven causal mask: the key loop stops at each query tile's diagonal
    return _written_out_attention(lambda i, j: j <= i, _slope, keys=80)


@case("attention_template_row_with_no_key", atol=2e-2, rtol=2e-2)
def _():
    # row 0 has no open key: NaN, as eager's plain softmax gives
    return _written_out_attention(lambda i, j: (j < i) & (i - j < 20), _slope)


def _document_attention(strict: bool):
    """bfloat16 attention whose mask reads a tensor: a document id per position (three packed
    documents over 300 positions), causal within each document."""
    def attend(q, k, v, document):
        scores = (q @ k.transpose(-1, -2)).float() * 0.25
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        causal = (j < i) if strict else (j <= i)
        scores = scores.masked_fill(~((document[i] == document[j]) & causal), float("-inf"))
        return torch.softmax(scores, -1).to(q.dtype) @ v

    document = torch.repeat_interleave(torch.arange(3), torch.tensor([70, 150, 80]))
    return attend, (randn(1, 2, 300, 16, dtype=torch.bfloat16), randn(1, 2, 300, 16, seed=1, dtype=torch.bfloat16),
                    randn(1, 2, 300, 16, seed=2, dtype=torch.bfloat16), document)


@case("attention_template_document_mask", atol=2e-2, rtol=2e-2)
def _():
    # a mask read from a tensor: each query tile visits only the keys between its rows' first
    # and last open one (computed before the kernel, once for both heads)
    return _document_attention(strict=False)


@case("attention_template_document_mask_row_with_no_key", atol=2e-2, rtol=2e-2)
def _():
    # each document's first row has no open key: NaN, as eager's plain softmax gives
    return _document_attention(strict=True)


@case("attention_template_grouped_query", atol=2e-2, rtol=2e-2)
def _():
    # keys and values of 2 heads shared by 6 query heads (expanded, not copied: the kernel reads
    # head h // 3)
    attend, (q, k, v) = _written_out_attention(lambda i, j: (j <= i) & (i - j < 20), _slope)
    q = randn(2, 6, 80, 16, dtype=torch.bfloat16)
    k, v = k[:, :2], v[:, :2]

    def grouped(q, k, v):
        def shared(x):
            return x[:, :, None].expand(2, 2, 3, *x.shape[2:]).reshape(2, 6, *x.shape[2:])
        return attend(q, shared(k), shared(v))

    return grouped, (q, k, v)


@case("attention_template_training_sliding_window", atol=5e-2, rtol=2e-2, training=True)
def _():
    # forward (with each row's log-sum-exp), the queries' gradient, the keys' and values' in one
    # kernel: each visits only the tiles of its band (72 keys: a partial tile of keys)
    return _written_out_attention(lambda i, j: (j <= i) & (i - j < 20), _slope)


@case("attention_template_training_document_mask", atol=5e-2, rtol=2e-2, training=True)
def _():
    # the keys' gradient visits only the queries between each key tile's first and last
    return _document_attention(strict=False)


def _float32_attention():
    """float32 attention with an ALiBi-like bias and a mask: the bias would be stored as large as
    the scores for a library call; the kernel computes it per tile, its products in float32."""
    def attend(q, k, v):
        scores = q @ k.transpose(-1, -2) * 0.25
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        scores = (scores + _slope(i, j)).masked_fill(~(j <= i + 3), float("-inf"))
        return torch.softmax(scores, -1) @ v

    return attend, (randn(2, 3, 80, 16), randn(2, 3, 72, 16, seed=1), randn(2, 3, 72, 16, seed=2))


@case("attention_template_float32", atol=1e-5, rtol=1e-5)
def _():
    return _float32_attention()


@case("attention_template_training_float32", atol=1e-5, rtol=1e-5, training=True)
def _():
    return _float32_attention()


@case("attention_template_rows_closed_by_the_query_part", atol=1e-5, rtol=1e-5)
def _():
    # a bias term that reads the query alone leaves the scores for the log-sum-exp; where it is
    # -inf (rows 0 to 3 here) it closes the row: NaN, as eager's plain softmax gives; float32's
    # least value on every key of rows 4 and 5 averages them, as eager does
    def attend(q, k, v):
        scores = q @ k.transpose(-1, -2) * 0.25
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        closed = torch.where(i < 4, float("-inf"), 0.0)
        least = torch.where((i >= 4) & (i < 6), torch.finfo(torch.float32).min, 0.0)
        scores = (scores + _slope(i, j) + closed + least).masked_fill(~(j <= i + 3), float("-inf"))
        return torch.softmax(scores, -1) @ v

    return attend, (randn(2, 3, 80, 16), randn(2, 3, 72, 16, seed=1), randn(2, 3, 72, 16, seed=2))


@case("attention_template_training_grouped_query", atol=5e-2, rtol=2e-2, training=True)
def _():
    # shared key and value heads: each query head's gradient, summed over the group
    grouped, (q, k, v) = CASES["attention_template_grouped_query"]["make"]()
    return grouped, (q, k, v)


@case("gemm_template_half_vector_times_matrix", atol=1e-2, rtol=1e-2, options=TEMPLATE)
def _():
    # one row, a column-major weight, and a cast out of half precision
    return (lambda x, w: (x @ w.t()).float() + 1), (randn(1, 64, dtype=torch.float16),
                                                   randn(80, 64, seed=1, dtype=torch.float16))


@case("gemm_template_prologue_scale_shift", atol=1e-4, rtol=1e-4, options=TEMPLATE)
def _():
    # the operand computed in the product's kernel (its prologue): x * 0.5 + 1 is 1 where x is
    # masked past k (70 = 2 steps of 32 and a part), so the last step zeroes those lanes
    return (lambda x, w: torch.relu((x * 0.5 + 1) @ w)), (randn(37, 70), randn(70, 45, seed=1))


@case("gemm_template_prologue_weight_cast", atol=2e-2, rtol=2e-2, options=TEMPLATE)
def _():
    # a float32 weight rounded to bfloat16 and transposed, in the kernel that multiplies by it
    return (lambda x, w: x @ w.to(torch.bfloat16).t()), (randn(2, 9, 48, dtype=torch.bfloat16), randn(24, 48, seed=1))


@case("gemm_template_prologue_both_batched", atol=1e-4, rtol=1e-4, options=TEMPLATE)
def _():
    # both operands of a batched product computed in its kernel, one of them transposed
    return (lambda q, k: torch.bmm(q * 0.125, (k + 1).transpose(1, 2))), (randn(3, 33, 40), randn(3, 50, 40, seed=1))


@case("gemm_template_prologue_ends_in_a_conversion", atol=1e-4, rtol=1e-4, options=TEMPLATE)
def _():
    # float32 products of operands converted to float32 in the graph (from bfloat16, and a
    # bfloat16 round trip): the conversion is the operand's, not the product's own
    return (lambda x, y, w: x.float() @ w + y.to(torch.bfloat16).float() @ w), (
        randn(20, 40, dtype=torch.bfloat16), randn(20, 40, seed=1), randn(40, 24, seed=2))


@case("gemm_template_inner_size_one", atol=1e-5, rtol=1e-5, options=TEMPLATE)
def _():
    # k = 1: an outer product
    return (lambda a, b: torch.mm(a, b) - 1), (randn(20, 1), randn(1, 30, seed=1))


CONV_TEMPLATE = {"gemm_template": "always", "conv_layout": "channels_last"}


@case("conv_template_bias_silu_residual", externs=0, atol=1e-4, rtol=1e-4, options=CONV_TEMPLATE)
def _():
    # an implicit-GEMM convolution (padding 1: taps past the edges read zeros), its bias, SiLU
    # and a residual add in the epilogue; 9 x 7 pixels (edge tiles of rows)
    def f(x, w, b, r):
        return F.silu(F.conv2d(x, w, b, padding=1)) + r

    cl = torch.channels_last
    return f, (randn(2, 8, 9, 7).to(memory_format=cl), randn(16, 8, 3, 3, seed=1), randn(16, seed=2),
               randn(2, 16, 9, 7, seed=3).to(memory_format=cl))


@case("conv_template_strided_dilated_odd_channels", externs=0, atol=1e-4, rtol=1e-4, options=CONV_TEMPLATE)
def _():
    # 3 input channels (one masked chunk of 16), stride 2, padding 2, dilation 2, a rectangular
    # kernel; then a 1x1 convolution to 20 channels (edge tiles of columns)
    def f(x, w, w1):
        y = F.conv2d(x, w, stride=2, padding=2, dilation=2)
        return F.conv2d(torch.relu(y), w1)

    return f, (randn(2, 3, 11, 10).to(memory_format=torch.channels_last), randn(5, 3, 3, 2, seed=1),
               randn(20, 5, 1, 1, seed=2))


@case("conv_template_depthwise_hardswish", externs=0, atol=1e-4, rtol=1e-4, options=CONV_TEMPLATE)
def _():
    # a MobileNet block's depthwise convolution of a channels-last input (one filter per
    # channel, stride 2, padding 2 of a 5x5 kernel: taps past the edges read zeros), its bias
    # and hard-swish in the epilogue; 40 channels (edge tiles of columns)
    def f(x, w, b):
        return F.hardswish(F.conv2d(x, w, b, stride=2, padding=2, groups=40))
    x = randn(2, 40, 11, 9).contiguous(memory_format=torch.channels_last)
    return f, (x, randn(40, 1, 5, 5, seed=1) * 0.2, randn(40, seed=2))


@case("conv_template_bf16", externs=0, atol=3e-2, rtol=3e-2, options=CONV_TEMPLATE)
def _():
    # bfloat16 operands, float32 sums, one rounding of the result
    def f(x, w, b):
        return torch.relu(F.conv2d(x, w, b, padding=1))

    bf = torch.bfloat16
    return f, (randn(2, 32, 8, 8, dtype=bf).to(memory_format=torch.channels_last), randn(32, 32, 3, 3, dtype=bf, seed=1) * 0.1,
               randn(32, dtype=bf, seed=2))


@case("nearest_upsampling", options={"conv_layout": "channels_last"})
def _():
    # x2 (source rows `i // 2`, read as plain loads) before a convolution, and x1.5 (a scale
    # with no exact floor division: its indices stay checked)
    def f(x, w):
        up = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), w, padding=1)
        return up, F.interpolate(x, scale_factor=1.5, mode="nearest") * 2

    return f, (randn(2, 4, 6, 5).to(memory_format=torch.channels_last), randn(3, 4, 3, 3, seed=1))


@case("channels_last_group_norm_of_pixel_chunks", atol=1e-9, rtol=1e-9, options={"conv_layout": "channels_last"})
def _():
    # 768 pixels: statistics from three chunks of 256 per channel, combined per group, with an
    # offset far from the spread (mean 50, deviation 3), which a sum of squares would lose; in
    # float64, where eager's float32 error (4e-4 here) does not hide the combination's
    def f(x, gw, gb, w):
        return F.conv2d(F.group_norm(x * 3 + 50, 4, gw, gb), w, padding=1)

    f64, cl = torch.float64, torch.channels_last
    return f, (randn(2, 16, 32, 24, dtype=f64).to(memory_format=cl), randn(16, seed=2, dtype=f64),
               randn(16, seed=3, dtype=f64), randn(4, 16, 3, 3, seed=4, dtype=f64))


@case("channels_last_group_norm_silu", atol=1e-4, rtol=1e-4, options={"conv_layout": "channels_last"})
def _():
    # a convolution graph's group norm over a concatenation of channels-last inputs
    def f(a, b, gw, gb, w):
        x = torch.cat([a, b], 1)
        return F.conv2d(F.silu(F.group_norm(x, 4, gw, gb)), w, padding=1)

    cl = torch.channels_last
    return f, (randn(2, 8, 6, 5).to(memory_format=cl), randn(2, 8, 6, 5, seed=1).to(memory_format=cl),
               randn(16, seed=2), randn(16, seed=3), randn(4, 16, 3, 3, seed=4))


@case("permuted_inputs")
def _():
    return (lambda a, b: (a.t() * 2 + b).exp()), (randn(16, 12), randn(12, 16, seed=1))


@case("transpose_tiled")
def _():
    # ragged 2-D tiles (100 x 70 is no multiple of 64) over a transposed read and a bf16 one
    return (
        lambda a, b, c: (a.t() + b, (c.t().float() * 2).to(torch.bfloat16) + 1)
    ), (randn(70, 100), randn(100, 70, seed=1), randn(70, 100, dtype=torch.bfloat16, seed=2))


@case("head_split_transpose")
def _():
    # attention keys [B, S, H*D] laid out [B, H, D, S]: the read is contiguous along the rows in
    # runs of D = 64 (d = x0 % 64), not along x0 as a whole
    return (lambda k: k.view(2, 70, 2, 64).permute(0, 2, 3, 1).contiguous() * 0.25), (randn(2, 70, 128),)


@case("sum_inner")
def _():
    return (lambda a: (a.relu() + 1).sum(-1)), (randn(8, 32),)


@case("sum_outer")
def _():
    return (lambda a: a.sum(0)), (randn(32, 8),)


@case("sum_outer_looped", atol=1e-4)
def _():
    return (lambda a: (a.sum(0), a.amax(0))), (randn(300, 6),)


@case("sum_all")
def _():
    return (lambda a: a.sum()), (randn(7, 9),)


@case("sum_looped", atol=1e-3)
def _():
    # 256 rows are enough programs: no split, one looped kernel
    return (lambda a: a.sum(-1) + a.amax(-1)), (randn(256, 10000),)


@case("complex_moves")
def _():
    # complex buffers addressed as pairs of reals: a transposed copy, a pad, a conjugate, a
    # widening, real and imaginary parts, a real -> complex32 conversion
    def f(z, r):
        return (z.t().contiguous(), F.pad(z, (1, 2)), torch.conj_physical(z), z.to(torch.complex128),
                z.real * z.imag, torch.view_as_real(z) + 1, r.to(torch.complex32))

    z = torch.complex(randn(4, 6), randn(4, 6, seed=1))
    return f, (z, randn(3, 5, seed=2))


@case("complex_around_a_library_call", atol=1e-4, rtol=1e-4)
def _():
    # fft2 of a padded real input: the pad and the output's copy are kernels, the FFT a call
    return (lambda r: torch.fft.fft2(r, s=(5, 8)).conj() * 1), (randn(3, 4, 6),)


@case("welford_variances", atol=2e-3, rtol=1e-3)
def _():
    # rows longer than a persistent block: the variance's second pass becomes Welford's one-pass
    # update and fuses with the mean into one loop (an offset mean tests its stability)
    def f(x, w):
        return x.var(-1), F.layer_norm(x, (9000,), w), torch.var_mean(x.double(), -1, correction=0)

    return f, (randn(256, 9000) * 3 + 50, randn(9000, seed=1))


@case("split_variances", atol=2e-3, rtol=1e-3)
def _():
    # few columns over many rows (a batch norm's statistics): each chunk of the split takes its
    # sum and Welford M2 in one pass over the data, the combine adds the M2s and the chunk
    # means' deviations from the mean (an offset mean tests its stability)
    def f(x, y):
        return x.var(0), torch.var_mean(x, 0, correction=0), F.batch_norm(y, None, None, training=True)

    y = (randn(32, 16, 16, 16, seed=1) * 2 + 5).to(memory_format=torch.channels_last)
    return f, (randn(4096, 64) * 3 + 50, y)


@case("in_place_beside_a_mask", atol=1e-4)
def _():
    # the doubled GEMM result takes the GEMM's storage; the mask of the GEMM result in the same
    # kernel reads each element before the doubling overwrites it
    w = randn(32, 48, seed=1)

    def f(x):
        h = x @ w
        return (h * 2).view(4, 16, 48), h > 1

    return f, (randn(64, 32),)


@case("split_reductions", atol=1e-3)
def _():
    # few outputs, long reductions: two stages. 100003 is prime (the last chunk is masked);
    # the mean over dim 0 of a 3-column tensor reads strided; amin of int64 takes int64's identity
    def f(a, b, c):
        return a.sum(), a.amax(), b.mean(0), (c % 1000).amin(), (a > 4.0).any(), a.var()

    return f, (randn(100003), randn(60000, 3, seed=1), torch.randint(-10**12, 10**12, (100003,), generator=_g(2)))


@case("looped_reductions_of_each_dtype", atol=1e-3)
def _():
    def f(a):
        i = (a * 10).to(torch.int32)
        return ((a > 2.5).any(-1), (a * 10).long().sum(-1), a.argmax(-1), a.argmin(-1), i.amax(-1), i.amin(-1),
                (a.abs() < 4).all(-1), a.double().sum(-1), a.half().amax(-1))

    return f, (randn(3, 4500),)


@case("softmax")
def _():
    return (lambda a: torch.softmax(a, -1)), (randn(8, 33),)


@case("softmax_looped")
def _():
    return (lambda a: torch.softmax(a, -1)), (randn(2, 10000),)


@case("softmax_persistent_wide")
def _():
    return (lambda a: torch.softmax(a, -1)), (randn(3, 3000),)


@case("layer_norm", atol=1e-4)
def _():
    return (lambda a, w, b: F.layer_norm(a, (64,), w, b)), (randn(8, 64), randn(64, seed=1), randn(64, seed=2))


@case("var_mean", atol=1e-4)
def _():
    return (lambda a: torch.var(a, -1) + a.mean(0).sum()), (randn(8, 40),)


@case("argmax_argmin")
def _():
    a = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, float("nan"), 5.0, 5.0], [-1.0, -1.0, -2.0, -2.0]])
    return (lambda a: torch.stack([a.argmax(-1), a.argmin(-1), a.argmax(0)[:3]])), (a,)


@case("prod_any_max")
def _():
    return (lambda a: torch.stack([a.prod(-1), (a > 1).any(-1).float(), a.amin(-1)])), (randn(4, 6),)


@case("index_select")
def _():
    idx = torch.tensor([3, 0, 7, 7, -1 + 8])
    return (lambda a, i: torch.index_select(a, 0, i) * 2), (randn(8, 5), idx)


@case("embedding_negative_index")
def _():
    return (lambda a, i: a[i] + 1), (randn(8, 4), torch.tensor([[-1, 2], [0, -8]]))


@case("softmax_over_a_gathered_row")
def _():
    # the gathered index depends on the reduction axis alone: its bounds check is one row wide
    # inside a kernel of [rows, reduction] tiles (GPT-2's position lookups beside its softmax)
    return (lambda x, table: torch.softmax(x + table[torch.arange(32)], dim=-1)), (randn(128, 32), randn(40, seed=1))


@case("gather_out_of_range", raises=IndexError)
def _():
    return (lambda a, i: torch.index_select(a, 0, i) + 1), (randn(8, 5), torch.tensor([1, 8]))


@case("half_types", atol=1e-2, rtol=1e-2)
def _():
    return (
        lambda a, b: ((a * 2 + 1).sigmoid(), (b * b).sum(-1), a.float().softmax(-1).half()),
        (randn(4, 24, dtype=torch.float16), randn(4, 24, dtype=torch.bfloat16, seed=1)),
    )


@case("int64_arange_exact", atol=0, rtol=0)
def _():
    return (lambda a: torch.arange(0, 11) * 1000000000 + a), (torch.arange(11, dtype=torch.int64),)


@case("integer_math", atol=0, rtol=0)
def _():
    a = torch.tensor([-7, -3, 0, 5, 9, 12], dtype=torch.int32)
    b = torch.tensor([2, -4, 3, 3, -5, 7], dtype=torch.int32)
    return (
        lambda a, b: (a // b, a % b, a * b - (a >> 1), torch.sign(a), torch.maximum(a, b), a.view(2, 3).argmax(-1),
                      (a * 3).view(3, 2).amin(0), torch.pow(a, b.abs() % 4)),
        (a, b),
    )


@case("math_functions", atol=1e-4, rtol=1e-4)
def _():
    a = randn(64) * 0.9
    return (
        lambda a: (torch.tanh(a), torch.erf(a), torch.expm1(a), torch.log1p(a.abs()), torch.atan2(a, a + 2),
                   torch.pow(a.abs(), 1.5), torch.floor_divide(a, 0.3), torch.remainder(a, 0.4), torch.round(a * 4),
                   torch.asin(a), torch.where(a > 0, a, a * 0.1).clamp(-0.05, 0.5), torch.special.erfcx(a * 3),
                   torch.special.log_ndtr(a * 4), torch.lgamma(a + 1.5)),
        (a,),
    )


@case("mlp_with_mm_externs", atol=1e-4)
def _():
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8), torch.nn.Softmax(-1))
    torch.manual_seed(0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m, (randn(4, 16),)


@case("mlp_backward", atol=1e-4)
def _():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))

    def f(x):
        m.zero_grad()
        x = x.detach().requires_grad_(True)
        loss = m(x).logsumexp(-1).sum()
        loss.backward()
        return loss.detach(), x.grad, m[0].weight.grad.clone(), m[2].weight.grad.clone()

    return f, (randn(5, 8),)


@case("index_add_atomic", atol=2e-3, rtol=2e-3)
def _():
    i = torch.tensor([0, 3, 3, 5, 0, 0])
    return (
        lambda a, i, s, h: (a.index_add(0, i, s) * 2, h.index_add(0, i, h[:6])),
        (randn(6, 5), i, randn(6, 5, seed=1), randn(8, 3, dtype=torch.float16, seed=2)),
    )


@case("embedding_backward", atol=1e-5)
def _():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)

    def f(i):
        emb.zero_grad()
        emb(i).pow(2).sum().backward()
        return emb.weight.grad.clone()

    return f, (torch.tensor([[1, 2, 2], [9, 1, 0]]),)


@case("dropout_and_randn_statistics", atol=0, rtol=0)
def _():
    # different generators than eager: compare properties of the samples, not the samples
    def f(a):
        d = torch.dropout(a, 0.5, True)
        n = torch.randn(64, 64)
        kept = (d != 0).float().mean()
        return (kept - 0.5).abs() < 0.05, ((d == 0) | (d == 2 * a)).all(), n.mean().abs() < 0.1, (n.std() - 1).abs() < 0.1

    return f, (randn(64, 64) + 10,)


@case("scatter_amax_amin_atomics")
def _():
    idx = torch.tensor([[0, 1, 2], [3, 0, 1], [0, 0, 2]])
    return (
        lambda a, i, s, ai: (a.scatter_reduce(0, i, s, "amax"), a.scatter_reduce(0, i, s, "amin", include_self=False),
                             ai.scatter_reduce(0, i, ai[:3] * 3, "amax"))
    ), (randn(4, 3), idx, randn(3, 3, seed=1), torch.arange(12).reshape(4, 3) - 5)


@case("scatter_products", atol=1e-5, rtol=1e-4)
def _():
    # repeated targets multiply through compare-and-swap loops; float32, float64 and int64
    idx = torch.tensor([[0, 1, 2], [3, 0, 1], [0, 0, 2], [0, 1, 2]])
    return (
        lambda a, i, s, ai: (a.scatter_reduce(0, i, s, "prod"), a.double().scatter_reduce(0, i, s.double(), "prod", include_self=False),
                             ai.scatter_reduce(0, i, ai * 0 + 3, "prod"), torch.scatter(a, 0, i, s, reduce="multiply"))
    ), (randn(4, 3), idx, randn(4, 3, seed=1), torch.arange(12).reshape(4, 3) - 5)


@case("scatter_half_combines", atol=1e-3, rtol=1e-3)
def _():
    # 16-bit maxima, minima and products through compare-and-swap loops on the value's bits
    idx = torch.tensor([[0, 1, 2], [3, 0, 1], [0, 0, 2], [0, 1, 2]])
    return (
        lambda a, i, s: (a.scatter_reduce(0, i, s, "amax"), a.scatter_reduce(0, i, s, "amin", include_self=False),
                         a.scatter_reduce(0, i, s, "prod"))
    ), (randn(4, 3, dtype=torch.float16), idx, randn(4, 3, dtype=torch.float16, seed=1))


@case("narrow_scatter_adds_run_in_aten_and_the_rest_compiles")
def _():
    # no atomic add of 8-bit integers or bools (nor a compare-and-swap form): those nodes run in
    # ATen inside the wrapper, the graph's other work in kernels
    idx = torch.tensor([0, 2, 2, 5])
    return (
        lambda a, i, b, m: (a.scatter_add(0, i, b) * 3, torch.index_put(m, (i,), m[:4], accumulate=True).sum())
    ), (torch.arange(6, dtype=torch.int8), idx, torch.ones(4, dtype=torch.int8), torch.tensor([True, False] * 3))


@case("divisions", atol=1e-6, rtol=1e-6)
def _():
    # IEEE division in both float widths (div_rn is float32-only), reciprocals, softmax's divide
    return (
        lambda a, b: (a / b, (a.double() / b.double()).reciprocal(), torch.softmax(a.double(), -1), 1 / a)
    ), (randn(6, 33), randn(6, 33, seed=1) + 3)


@case("integer_division_of_the_minimum_by_minus_one")
def _():
    # the minimum divided by -1 overflows: eager's quotient wraps to the minimum and remainders
    # are 0 (LLVM's sdiv/srem are undefined there; Triton keeps 8- and 16-bit operands narrow)
    def f(*xs):
        out = []
        for a, b in zip(xs[::2], xs[1::2]):
            out += [a // b, a % b, torch.fmod(a, b), torch.div(a, b, rounding_mode="floor")]
            if a.dtype in (torch.int16, torch.int8):  # int32/int64: CPU eager traps (SIGFPE)
                out.append(torch.div(a, b, rounding_mode="trunc"))
        return tuple(out)

    args = []
    for dt in (torch.int64, torch.int32, torch.int16, torch.int8):
        m = torch.iinfo(dt).min
        args += [torch.tensor([m, m, m + 1, 7, -7, m, 5], dtype=dt), torch.tensor([-1, 1, -1, -1, 2, 3, -1], dtype=dt)]
    # uint8 has no -1: 255 is an ordinary divisor
    args += [torch.tensor([200, 255, 0, 7], dtype=torch.uint8), torch.tensor([255, 255, 255, 2], dtype=torch.uint8)]
    return f, tuple(args)


@case("float_to_int_of_nan_inf_and_out_of_range_values")
def _():
    # int8/int16 keep the low bits of the int32 conversion, uint8 those of the int64 one (as
    # eager); under the interpreter the wide conversions give x86's minimum, as CPU eager does
    vals = [float("nan"), float("inf"), float("-inf"), 1e10, -1e10, 3e9, 70000.0, -70000.0, 300.0, -300.0, 255.9,
            -1.5, 0.0, 2.0**63, -(2.0**31) - 1]
    targets = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    return (lambda a, b: tuple((t * 1).to(d) for t in (a, b) for d in targets)), (
        torch.tensor(vals), torch.tensor(vals, dtype=torch.float64))


@case("scans")
def _():
    # along the last dim, along dim 0 (strided lines), integer and product scans, fused epilogues
    return (
        lambda a, b, i: (torch.cumsum(a, -1) * 2, torch.cumsum(b.exp(), 0), torch.cumsum(i, 1),
                         torch.cumprod(a * 0.5 + 1, -1), torch.cumsum(a.bfloat16(), 1))
    ), (randn(5, 37), randn(300, 6, seed=1), torch.arange(-20, 22).reshape(6, 7) ** 3)


@case("long_scans", atol=1e-3, rtol=1e-4)
def _():
    # longer than one block: looped, each step offset by the carry of the steps before
    return (lambda a, i: (torch.cumsum(a, -1) * 2, torch.cumsum(i, 0))), (
        randn(2, 9000), torch.arange(9500 * 2).reshape(9500, 2) % 7 - 3)


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _compare(name, got, exp, atol, rtol):
    got, exp = _flat(got), _flat(exp)
    if len(got) != len(exp):
        return f"{len(got)} outputs, eager has {len(exp)}"
    for i, (g, e) in enumerate(zip(got, exp)):
        if g.dtype != e.dtype or g.shape != e.shape:
            return f"output {i}: {g.dtype}{tuple(g.shape)} vs eager {e.dtype}{tuple(e.shape)}"
        if g.numel() > 1 and g.stride() != e.stride():
            return f"output {i}: strides {g.stride()} vs eager {e.stride()}"
        if e.dtype.is_complex:  # compared as their components
            g, e = torch.view_as_real(g.to(torch.complex128)), torch.view_as_real(e.to(torch.complex128))
        if e.dtype.is_floating_point:
            if not torch.allclose(g.double(), e.double(), atol=atol, rtol=rtol, equal_nan=True):
                return f"output {i}: max abs diff {(g.double() - e.double()).abs().nan_to_num().max().item()}"
        elif not torch.equal(g, e):
            return f"output {i}: {g.tolist()} vs eager {e.tolist()}"
    return None


def _with_gradients(fn, args) -> tuple:
    """`fn`'s output and the gradients of its floating inputs (fresh leaves)."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*leaves)
    out.backward(randn(*out.shape, seed=7, dtype=out.dtype))
    return (out, *[a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad])


# ferrocore's combine functions (the kernels' prelude) and the numpy reduction each computes:
# NaN-propagating maxima and minima, as `ferro_max` / `ferro_min` are
_NUMPY_REDUCTIONS = {"ferro_sum": "sum", "ferro_max": "max", "ferro_min": "min", "ferro_any": "any"}


def _numpy_reductions_in_the_interpreter() -> None:
    """Triton's interpreter reduces with a combine function that is not Triton's own by calling it
    once per element (64 rows of 4096 took a minute); ferrocore's sums, maxima, minima, `any` and
    Welford merges are numpy calls here. The combine functions themselves still run interpreted where
    the kernels call them directly (a looped reduction's accumulator)."""
    import numpy as np
    from triton.runtime import interpreter

    ops = getattr(interpreter, "ReduceOps", None)
    if ops is None or getattr(ops, "_ferrocore_numpy", False):
        return
    generic = ops.apply_impl

    def welford(self, input):
        # Chan's merge of every (mean, M2, count) partial of a row at once; empty ones are neutral
        mean, m2, w = (t.handle.data for t in input)
        ax = self.axis
        total = w.sum(axis=ax, keepdims=True)
        safe = np.where(total == 0, 1, total)
        mu = np.where(total == 0, 0, (w * mean).sum(axis=ax, keepdims=True) / safe)
        m2 = m2.sum(axis=ax, keepdims=True) + (w * (mean - mu) ** 2).sum(axis=ax, keepdims=True)
        out = (mu, m2, total) if self.keep_dims else (mu.squeeze(ax), m2.squeeze(ax), total.squeeze(ax))
        return [self.to_tensor(np.asarray(o).astype(t.handle.data.dtype), t.dtype) for o, t in zip(out, input)]

    def apply_impl(self, input):
        fn = getattr(getattr(self.combine_fn, "fn", None), "__name__", None)
        if fn == "ferro_welford" and len(input) == 3 and self.axis is not None:
            return welford(self, input)
        op = _NUMPY_REDUCTIONS.get(fn)
        if op is None or len(input) != 1 or self.axis is None:
            return generic(self, input)
        data = input[0].handle.data
        out = getattr(np, op)(data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(np.asarray(out).astype(data.dtype), input[0].dtype)

    ops.apply_impl = apply_impl
    ops._ferrocore_numpy = True


def run_case(name: str) -> dict:
    import ferrocore
    from ferrocore import backend as fc_backend

    if os.environ.get("TRITON_INTERPRET") == "1":
        _numpy_reductions_in_the_interpreter()

    spec = CASES[name]
    torch._dynamo.reset()
    entries = []
    record = fc_backend.metrics.record

    def spy(entry, *more):
        entries.append(entry)
        record(entry, *more)

    fc_backend.metrics.record = spy
    try:
        fn, args = spec["make"]()
        if spec["raises"] is not None:
            try:
                torch.compile(fn, backend="ferrocore")(*args)
            except spec["raises"]:
                return dict(ok=True, entries=entries)
            except Exception as e:  # noqa: BLE001
                return dict(ok=False, detail=f"raised {type(e).__name__}: {e}", entries=entries)
            return dict(ok=False, detail=f"did not raise {spec['raises'].__name__}", entries=entries)
        compiled = torch.compile(fn, backend="ferrocore", options=spec["options"] or None)
        if spec["training"]:
            expected, got = _with_gradients(fn, args), _with_gradients(compiled, args)
        else:
            expected, got = fn(*args), compiled(*args)
        detail = _compare(name, got, expected, spec["atol"], spec["rtol"])
        fell_back = any(e.get("graph_fallback") for e in entries)
        if detail is None and fell_back != spec["fallback"]:
            detail = f"graph_fallback={fell_back}, expected {spec['fallback']}"
        if detail is None and not spec["fallback"]:
            if not entries or any(e.get("backend") != "triton" for e in entries):
                detail = f"not compiled by the Triton backend: {[e.get('backend') for e in entries]}"
            elif sum(e.get("kernels", 0) for e in entries) == 0:
                detail = "no kernels were generated"
            elif spec["externs"] is not None and sum(e.get("externs", 0) for e in entries) != spec["externs"]:
                detail = f"library calls {[e.get('extern_ops') for e in entries]}, expected {spec['externs']}"
        return dict(ok=detail is None, detail=detail, entries=entries)
    except Exception as e:  # noqa: BLE001
        import traceback

        return dict(ok=False, detail=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", entries=entries)
    finally:
        fc_backend.metrics.record = record
        del ferrocore


def main(out_path: str, shard: str = "0/1") -> None:
    """Runs the cases of one shard ("i/n": every n-th case from the i-th) and writes their results."""
    import json

    index, count = map(int, shard.split("/"))
    results = {}
    for name in list(CASES)[index::count]:
        r = run_case(name)
        compiled = [e for e in r.pop("entries") if e.get("module_path")]
        # each wrapper module, and beside it its compiled graph (what the ahead-of-time compile reads)
        results[name] = dict(ok=r["ok"], detail=r.get("detail"), modules=[e["module_path"] for e in compiled],
                             artifacts=[e["artifact_path"] for e in compiled])
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {name} {r.get('detail') or ''}", file=sys.stderr)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def aot_main(results_path: str, out_path: str) -> None:
    """Compiles every kernel of the modules the cases generated ahead of time for sm_90 (PTX and
    cubin, with the bundled ptxas; no GPU needed). Run without TRITON_INTERPRET."""
    import importlib.util
    import json

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ferrocore import artifact

    target = GPUTarget("cuda", 90, 32)
    results = {}
    with open(results_path) as f:
        cases = json.load(f)
    for name, r in cases.items():
        for path, artifact_path in zip(r["modules"], r["artifacts"]):
            spec = importlib.util.spec_from_file_location(f"aot_{len(results)}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            with open(artifact_path) as f:
                compiled = json.load(f)
            for fn, signature, constexprs, launch in artifact.triton_kernels(compiled, module)[0]:
                key = f"{name}:{fn.__name__}"
                sig = dict(signature, **{k: "constexpr" for k in constexprs})
                try:
                    compiled = triton.compile(
                        ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                        target=target,
                        options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]},
                    )
                    ok = bool(compiled.asm.get("cubin")) and ".target sm_90" in compiled.asm.get("ptx", "")
                    results[key] = dict(ok=ok, detail=None if ok else "no sm_90 cubin")
                except Exception as e:  # noqa: BLE001
                    results[key] = dict(ok=False, detail=f"{type(e).__name__}: {str(e)[:2000]}")
                print(f"{'ok  ' if results[key]['ok'] else 'FAIL'} {key}", file=sys.stderr)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--aot":
        aot_main(sys.argv[2], sys.argv[3])
    else:
        main(*sys.argv[1:3])
