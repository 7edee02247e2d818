"""Real models built from configs with random weights (nothing is downloaded), at two sizes.

`full`: the published sizes (GPT-2 124M, BERT-base, a TinyLlama-shaped Llama, T5-small, ViT-B/16,
DistilBERT, a small Mixtral, ResNet-50, ResNet-18, MobileNetV3-Large, EfficientNet-B0,
ConvNeXt-T, `nn.TransformerEncoder`) and three blocks of our own at comparable sizes (an MLP, a
masked attention block, a UNet block), for bfloat16 on a GPU. `tiny`: the same architectures a few layers and
channels wide, for float32 on the CPU (CI checks every one for correctness).

Each entry builds a `Case`: the model, its inputs, and a loss module for training steps; `bench/models.py` times them and
`tests/test_models.py` checks them. transformers, timm and torchvision are development
dependencies: a missing one makes its models unavailable (`MissingDependency`), never an error
elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import math
import torch
from torch import nn


class MissingDependency(Exception):
    pass


@dataclass
class Case:
    model: nn.Module
    # a fresh tuple of inputs on the device (ids, masks, pixels)
    make_inputs: Callable[[], tuple]
    # the model's output(s) -> the first tensor worth comparing (logits, hidden states)
    output: Callable[[object], torch.Tensor]
    # a module sharing `model`'s parameters whose forward returns the scalar training loss (the
    # model's own loss where it has one: causal LM, masked LM, classification), and its inputs
    train: nn.Module | None = None
    make_train_inputs: Callable[[], tuple] | None = None


class LossOf(nn.Module):
    """`model(*inputs)`'s own loss (a Hugging Face output's `.loss`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return self.model(*inputs).loss


class ClassifierLoss(nn.Module):
    """Cross entropy of `model(pixels)` against integer class targets."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixels, targets):
        return nn.functional.cross_entropy(_logits(self.model(pixels)).float(), targets)


class MeanSquare(nn.Module):
    """A regression-style loss for models without one: the mean square of the output."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return _logits(self.model(*inputs)).float().pow(2).mean()


def _hf():
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise MissingDependency(f"transformers is not installed ({e})") from e
    import transformers

    return transformers


def _tv():
    try:
        import torchvision  # noqa: F401
    except ImportError as e:
        raise MissingDependency(f"torchvision is not installed ({e})") from e
    import torchvision

    return torchvision


def _logits(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        v = getattr(out, key, None)
        if isinstance(v, torch.Tensor):
            return v
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"no tensor output in {type(out).__name__}")


def _ids(vocab: int, batch: int, seq: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def _padding_mask(batch: int, seq: int, device) -> torch.Tensor:
    """1 for tokens, 0 for padding: row b keeps its first seq - b * seq // (2 * batch) tokens."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        mask[b, seq - b * seq // (2 * batch):] = 0
    return mask.to(device)


def _hf_model(cls_name: str, config, device, dtype) -> nn.Module:
    tf = _hf()
    config._attn_implementation = "sdpa"
    # no dropout anywhere: training steps must be comparable between backends
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("drop" in key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    model = getattr(tf, cls_name)(config)
    return model.to(device=device, dtype=dtype)


# ---- transformers --------------------------------------------------------------------------------


def gpt2(size: str, device, dtype) -> Case:
    tf = _hf()
    if size == "full":
        cfg, batch, seq = tf.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024), 4, 1024
    else:
        cfg, batch, seq = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=503, n_positions=64), 2, 32
    cfg.use_cache = False
    model = _hf_model("GPT2LMHeadModel", cfg, device, dtype)
    return _causal_lm(model, cfg.vocab_size, batch, seq, device)


def bert(size: str, device, dtype) -> Case:
    tf = _hf()
    if size == "full":
        cfg, batch, seq = tf.BertConfig(), 8, 512
    else:
        cfg, batch, seq = tf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         intermediate_size=128, vocab_size=509, max_position_embeddings=64), 2, 32
    model = _hf_model("BertForMaskedLM", cfg, device, dtype)
    return _masked_lm(model, cfg.vocab_size, batch, seq, device)


def llama(size: str, device, dtype) -> Case:
    tf = _hf()
    if size == "full":
        # TinyLlama-1.1B's shape: grouped-query attention, 32 query heads over 4 key/value heads
        cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
        batch, seq = 2, 1024
    else:
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=257, max_position_embeddings=64)
        batch, seq = 2, 32
    cfg.use_cache = False
    model = _hf_model("LlamaForCausalLM", cfg, device, dtype)
    return _causal_lm(model, cfg.vocab_size, batch, seq, device)


def t5(size: str, device, dtype) -> Case:
    tf = _hf()
    if size == "full":
        cfg, batch, seq = tf.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, vocab_size=32128), 8, 512
    else:
        cfg, batch, seq = tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=311), 2, 32
    cfg.use_cache = False
    model = _hf_model("T5ForConditionalGeneration", cfg, device, dtype)

    def inputs():
        return (_ids(cfg.vocab_size, batch, seq, device), _ids(cfg.vocab_size, batch, seq // 2, device, seed=1))

    def train_inputs():
        return (*inputs(), _ids(cfg.vocab_size, batch, seq // 2, device, seed=2))

    names = ("input_ids", "decoder_input_ids", "labels")
    return Case(_Kw(model, names[:2]), inputs, _logits, LossOf(_Kw(model, names)), train_inputs)


def vit(size: str, device, dtype) -> Case:
    tf = _hf()
    if size == "full":
        cfg, batch, image = tf.ViTConfig(), 32, 224
    else:
        cfg, batch, image = tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, image_size=32, patch_size=8), 2, 32
    model = _hf_model("ViTForImageClassification", cfg, device, dtype)
    return _classifier(model, batch, image, cfg.num_labels, device, dtype)


def distilbert(size: str, device, dtype) -> Case:
    tf = _hf()
    if size == "full":
        cfg, batch, seq = tf.DistilBertConfig(), 8, 512
    else:
        cfg, batch, seq = tf.DistilBertConfig(n_layers=2, dim=64, n_heads=4, hidden_dim=128, vocab_size=401,
                                               max_position_embeddings=64), 2, 32
    model = _hf_model("DistilBertForMaskedLM", cfg, device, dtype)
    return _masked_lm(model, cfg.vocab_size, batch, seq, device)


def mixtral(size: str, device, dtype) -> Case:
    tf = _hf()
    if size == "full":
        cfg = tf.MixtralConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
                               num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                               max_position_embeddings=2048)
        batch, seq = 4, 512
    else:
        cfg = tf.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=257,
                               max_position_embeddings=64)
        batch, seq = 2, 16
    cfg.use_cache = False
    cfg.output_router_logits = False
    model = _hf_model("MixtralForCausalLM", cfg, device, dtype)
    return _causal_lm(model, cfg.vocab_size, batch, seq, device)


# ---- vision ---------------------------------------------------------------------------------------


def _pixels(batch: int, image: int, device, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, image, image, generator=g).to(device=device, dtype=dtype)


def _vision(builder: str, tiny_kwargs: dict, tiny_image: int):
    def make(size: str, device, dtype) -> Case:
        tv = _tv()
        torch.manual_seed(0)
        if size == "full":
            model, batch, image = getattr(tv.models, builder)(), 32, 224
        else:
            model, batch, image = getattr(tv.models, builder)(**tiny_kwargs), 2, tiny_image
        model = model.to(device=device, dtype=dtype)
        return _classifier(model, batch, image, 1000 if size == "full" else 10, device, dtype)

    return make


def _tiny_resnet():
    tv = _tv()
    from torchvision.models.resnet import Bottleneck, ResNet

    class Tiny(ResNet):
        def __init__(self, **kw):
            super().__init__(Bottleneck, [1, 1, 1, 1], width_per_group=16, num_classes=10, **kw)

    return Tiny, tv


def resnet50(size: str, device, dtype) -> Case:
    if size == "full":
        return _vision("resnet50", {}, 0)(size, device, dtype)
    Tiny, _ = _tiny_resnet()
    torch.manual_seed(0)
    model = Tiny().to(device=device, dtype=dtype)
    return _classifier(model, 2, 32, 10, device, dtype)


# 64 pixels: the last stages keep 2x2 positions, so their batch norms are not over 2 values
mobilenet_v3 = _vision("mobilenet_v3_large", {"width_mult": 0.25, "num_classes": 10}, 64)


def efficientnet_b0(size: str, device, dtype) -> Case:
    if size == "full":
        return _vision("efficientnet_b0", {}, 0)(size, device, dtype)
    _tv()
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    torch.manual_seed(0)
    setting, last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
    model = EfficientNet(setting, 0.2, last_channel=last, num_classes=10).to(device=device, dtype=dtype)
    return _classifier(model, 2, 64, 10, device, dtype)


def convnext_t(size: str, device, dtype) -> Case:
    if size == "full":
        return _vision("convnext_tiny", {}, 0)(size, device, dtype)
    tv = _tv()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    blocks = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, 128, 1), CNBlockConfig(128, None, 1)]
    model = ConvNeXt(blocks, num_classes=10).to(device=device, dtype=dtype)
    del tv
    return _classifier(model, 2, 32, 10, device, dtype)


def resnet18(size: str, device, dtype) -> Case:
    if size == "full":
        return _vision("resnet18", {}, 0)(size, device, dtype)
    tv = _tv()
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10).to(device=device, dtype=dtype)
    del tv
    return _classifier(model, 2, 32, 10, device, dtype)


class Mlp(nn.Module):
    """A feed-forward stack: Linear + GELU (tanh) layers with a residual, then a LayerNorm."""

    def __init__(self, d: int, hidden: int, layers: int):
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(d, hidden) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(hidden, d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for up, down in zip(self.ups, self.downs):
            x = x + down(nn.functional.gelu(up(x), approximate="tanh"))
        return self.norm(x)


class MaskedAttention(nn.Module):
    """Multi-head self-attention written out (scores, an additive padding mask and a causal
    boolean mask, softmax, weighted sum) as models before SDPA did, then SiLU-gated projection."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)

    def forward(self, x, padding):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf")) + (1.0 - padding[:, None, None, :]) * -1e4
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        return x + self.out(y) * nn.functional.silu(self.gate(x))


class UNetBlock(nn.Module):
    """One level of a UNet: two conv-BN-ReLU, a max-pool down, a transposed convolution up,
    the skip concatenated, and a conv-BN-ReLU to the output channels."""

    def __init__(self, c_in: int, c: int):
        super().__init__()

        def conv(a, b):
            return nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU())

        self.enc = nn.Sequential(conv(c_in, c), conv(c, c))
        self.mid = nn.Sequential(conv(c, 2 * c), conv(2 * c, 2 * c))
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = conv(2 * c, c)
        self.head = nn.Conv2d(c, c_in, 1)

    def forward(self, x):
        skip = self.enc(x)
        y = self.up(self.mid(nn.functional.max_pool2d(skip, 2)))
        return self.head(self.dec(torch.cat([y, skip], 1)))


class CausalSelfAttention(nn.Module):
    """Causal self-attention as nanoGPT-style code writes it: `q @ k^T`, a scale, a boolean
    causal mask from a registered buffer filled with -inf, softmax, `@ v`."""

    def __init__(self, d: int, heads: int, max_seq: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("causal", torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.causal[:, :, :s, :s] == 0, float("-inf"))
        y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, s, d))


class PreNormBlocks(nn.Module):
    """Pre-LayerNorm transformer blocks (hand-written causal attention, a GELU MLP)."""

    def __init__(self, d: int, heads: int, layers: int, max_seq: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({
                "ln1": nn.LayerNorm(d), "attn": CausalSelfAttention(d, heads, max_seq),
                "ln2": nn.LayerNorm(d), "up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d),
            }) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln1"](x))
            x = x + blk["down"](nn.functional.gelu(blk["up"](blk["ln2"](x))))
        return self.norm(x)


class TimeResBlock(nn.Module):
    """A diffusion UNet's residual block: GroupNorm, SiLU, 3x3 convolution, the timestep
    embedding added per channel, again, and a 1x1 skip where the channels change."""

    def __init__(self, c_in: int, c_out: int, temb: int, groups: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(temb, c_out)
        self.norm2, self.conv2 = nn.GroupNorm(groups, c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x, t):
        h = self.conv1(nn.functional.silu(self.norm1(x)))
        h = h + self.emb(nn.functional.silu(t))[:, :, None, None]
        h = self.conv2(nn.functional.silu(self.norm2(h)))
        return self.skip(x) + h


class UNetLevel(nn.Module):
    """One level of a diffusion UNet: a sinusoidal timestep embedding and its MLP, residual
    blocks, a strided convolution down, nearest upsampling and a convolution up, the skip
    concatenated, GroupNorm/SiLU and a convolution out."""

    def __init__(self, c: int, groups: int):
        super().__init__()
        self.c, temb = c, 4 * c
        self.time = nn.Sequential(nn.Linear(c, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.conv_in = nn.Conv2d(3, c, 3, padding=1)
        self.enc = TimeResBlock(c, c, temb, groups)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.mid = TimeResBlock(c, 2 * c, temb, groups)
        self.up = nn.Conv2d(2 * c, c, 3, padding=1)
        self.dec = TimeResBlock(2 * c, c, temb, groups)
        self.norm_out, self.conv_out = nn.GroupNorm(groups, c), nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x, steps):
        half = self.c // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angles = steps.float()[:, None] * freqs[None]
        t = self.time(torch.cat([angles.sin(), angles.cos()], dim=-1).to(x.dtype))
        skip = self.enc(self.conv_in(x), t)
        h = self.mid(self.down(skip), t)
        h = self.up(nn.functional.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = self.dec(torch.cat([h, skip], dim=1), t)
        return self.conv_out(nn.functional.silu(self.norm_out(h)))


def mlp(size: str, device, dtype) -> Case:
    d, hidden, layers, rows = (1024, 4096, 4, 2048) if size == "full" else (64, 256, 2, 64)
    torch.manual_seed(0)
    model = Mlp(d, hidden, layers).to(device=device, dtype=dtype)

    def inputs():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(rows, d, generator=g).to(device=device, dtype=dtype),)

    return Case(model, inputs, _logits, MeanSquare(model), inputs)


def attention_block(size: str, device, dtype) -> Case:
    d, heads, batch, seq = (768, 12, 8, 512) if size == "full" else (64, 4, 2, 32)
    torch.manual_seed(0)
    model = MaskedAttention(d, heads).to(device=device, dtype=dtype)

    def inputs():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, seq, d, generator=g).to(device=device, dtype=dtype)
        return (x, _padding_mask(batch, seq, device).to(dtype))

    return Case(model, inputs, _logits, MeanSquare(model), inputs)


def unet_block(size: str, device, dtype) -> Case:
    c, batch, image = (64, 16, 128) if size == "full" else (8, 2, 32)
    torch.manual_seed(0)
    model = UNetBlock(3, c).to(device=device, dtype=dtype)

    def inputs():
        return (_pixels(batch, image, device, dtype),)

    return Case(model, inputs, _logits, MeanSquare(model), inputs)


def prenorm_block(size: str, device, dtype) -> Case:
    d, heads, layers, batch, seq = (1024, 16, 4, 8, 1024) if size == "full" else (64, 4, 2, 2, 32)
    torch.manual_seed(0)
    model = PreNormBlocks(d, heads, layers, seq).to(device=device, dtype=dtype)

    def inputs():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(batch, seq, d, generator=g).to(device=device, dtype=dtype),)

    return Case(model, inputs, _logits, MeanSquare(model), inputs)


def unet_level(size: str, device, dtype) -> Case:
    c, groups, batch, image = (128, 32, 8, 64) if size == "full" else (16, 4, 2, 16)
    torch.manual_seed(0)
    model = UNetLevel(c, groups).to(device=device, dtype=dtype)

    def inputs():
        g = torch.Generator().manual_seed(1)
        return (_pixels(batch, image, device, dtype), torch.randint(0, 1000, (batch,), generator=g).to(device))

    return Case(model, inputs, _logits, MeanSquare(model), inputs)


def _timm():
    try:
        import timm  # noqa: F401
    except ImportError as e:
        raise MissingDependency(f"timm is not installed ({e})") from e
    import timm

    return timm


def timm_mobilenetv3(size: str, device, dtype) -> Case:
    timm = _timm()
    torch.manual_seed(0)
    if size == "full":
        model, batch, image, classes = timm.create_model("mobilenetv3_large_100"), 32, 224, 1000
    else:
        model, batch, image, classes = timm.create_model("mobilenetv3_small_050", num_classes=10), 2, 64, 10
    return _classifier(model.to(device=device, dtype=dtype), batch, image, classes, device, dtype)


def transformer_encoder(size: str, device, dtype) -> Case:
    d, heads, layers, ff, batch, seq = (512, 8, 6, 2048, 16, 256) if size == "full" else (64, 4, 2, 128, 2, 16)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(device=device, dtype=dtype)

    def inputs():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(batch, seq, d, generator=g).to(device=device, dtype=dtype),)

    return Case(model, inputs, _logits, MeanSquare(model), inputs)


def _causal_lm(model: nn.Module, vocab: int, batch: int, seq: int, device) -> Case:
    def inputs():
        return (_ids(vocab, batch, seq, device),)

    def train_inputs():
        ids = inputs()[0]
        return (ids, ids)  # labels: the inputs, shifted inside the model

    return Case(model, inputs, _logits, LossOf(_Kw(model, ("input_ids", "labels"))), train_inputs)


def _masked_lm(model: nn.Module, vocab: int, batch: int, seq: int, device) -> Case:
    def inputs():
        return (_ids(vocab, batch, seq, device), _padding_mask(batch, seq, device))

    def train_inputs():
        ids, mask = inputs()
        # every 7th token is a prediction target, padding never is
        labels = torch.where((torch.arange(seq, device=device) % 7 == 0) & (mask > 0), ids, -100)
        return (ids, mask, labels)

    names = ("input_ids", "attention_mask", "labels")
    return Case(_Kw(model, names[:2]), inputs, _logits, LossOf(_Kw(model, names)), train_inputs)


def _classifier(model: nn.Module, batch: int, image: int, classes: int, device, dtype) -> Case:
    def inputs():
        return (_pixels(batch, image, device, dtype),)

    def train_inputs():
        g = torch.Generator().manual_seed(1)
        return (*inputs(), torch.randint(0, classes, (batch,), generator=g).to(device))

    return Case(model, inputs, _logits, ClassifierLoss(model), train_inputs)


class _Kw(nn.Module):
    """Calls a Hugging Face model with keyword inputs from positional ones (so every harness
    passes a tuple)."""

    def __init__(self, model: nn.Module, names: tuple):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args)))


MODELS: dict[str, Callable[[str, object, torch.dtype], Case]] = {
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "t5": t5,
    "vit": vit,
    "distilbert": distilbert,
    "mixtral": mixtral,
    "resnet50": resnet50,
    "resnet18": resnet18,
    "mobilenet_v3": mobilenet_v3,
    "efficientnet_b0": efficientnet_b0,
    "convnext_t": convnext_t,
    "transformer_encoder": transformer_encoder,
    "mlp": mlp,
    "attention_block": attention_block,
    "unet_block": unet_block,
    "prenorm_block": prenorm_block,
    "unet_level": unet_level,
    "timm_mobilenetv3": timm_mobilenetv3,
}


def build(name: str, size: str, device, dtype) -> Case:
    """The model `name` in eval mode with dropout off (training keeps the same numerics), its
    inputs and output selector."""
    case = MODELS[name](size, torch.device(device), dtype)
    for m in case.model.modules():
        # dropout and stochastic depth off: runs must be comparable between backends
        if isinstance(m, nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0
    case.model.eval()
    return case
