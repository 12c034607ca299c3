"""Small residual networks with named residual-stream sites, and per-example losses.

Every model here exposes its residual stream through *sites*: module names (as
returned by ``model.named_modules()``) whose forward **output** is the residual
stream tensor at that depth. A forward hook on a site therefore sees the
stream, and inserting a zero-output residual block after a site leaves the
network function unchanged. ``model.site_names()`` lists the sites in depth
order, and the class attribute ``layout`` (a :class:`~depthsat_theory.vocabulary.Layout`)
describes the site tensors:

* ``Layout.VECTOR``: ``(B, d)`` (:class:`ResidualMLP`);
* ``Layout.IMAGE``: ``(B, C, H, W)`` (:class:`ResNetCNN`);
* ``Layout.SEQUENCE``: ``(B, T, d)`` (:class:`CharGPT`).

All models are plain ``torch.nn`` modules that work in float32 and, after
``.to(torch.float64)``, in float64. Loss functions return per-example losses
of shape ``(B,)`` in nats, without reduction over the batch.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from depthsat_theory.vocabulary import Layout

__all__ = [
    "BasicBlock",
    "CausalSelfAttention",
    "CharGPT",
    "GPTBlock",
    "MLPBlock",
    "ResNetCNN",
    "ResidualMLP",
    "classification_loss",
    "token_loss",
]

BLOCK_ACTIVATIONS = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "silu": nn.SiLU,
}


def _make_activation(name: str) -> nn.Module:
    try:
        return BLOCK_ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; valid: {sorted(BLOCK_ACTIVATIONS)}") from None


# ----------------------------------------------------------------------------
# Residual MLP
# ----------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """Pre-LayerNorm residual MLP block ``x + W2(act(W1(LayerNorm(x))))``.

    The block performs the residual addition itself, so its output is the
    residual stream. Setting ``W2`` (weight and bias) to zero makes it exactly
    the identity.

    Args:
        width: stream width ``d``.
        hidden: hidden width of the MLP (default ``2 * width``).
        activation: one of ``"gelu"``, ``"relu"``, ``"tanh"``, ``"silu"``.

    Shapes:
        input and output ``(B, width)``.

    Raises:
        ValueError: on an unknown activation.
    """

    def __init__(self, width: int, hidden: int | None = None, activation: str = "gelu") -> None:
        super().__init__()
        hidden = 2 * width if hidden is None else hidden
        self.ln = nn.LayerNorm(width)
        self.W1 = nn.Linear(width, hidden)
        self.act = _make_activation(activation)
        self.W2 = nn.Linear(hidden, width)

    def residual(self, x: Tensor) -> Tensor:
        """The residual branch ``W2(act(W1(LayerNorm(x))))``, shape ``(B, width)``.

        Args:
            x: the stream ``(B, width)``.

        Returns:
            The branch output ``(B, width)``.
        """
        return self.W2(self.act(self.W1(self.ln(x))))

    def forward(self, x: Tensor) -> Tensor:
        """``x + residual(x)``: ``(B, width)`` in, ``(B, width)`` out.

        Args:
            x: the stream ``(B, width)``.

        Returns:
            ``x + residual(x)``, ``(B, width)``.
        """
        return x + self.residual(x)


class ResidualMLP(nn.Module):
    """Residual MLP classifier for flat inputs (e.g. 64-pixel digits).

    ``embed = Linear(in_dim, width)`` -> ``depth`` :class:`MLPBlock` s ->
    final ``LayerNorm`` -> ``head = Linear(width, n_classes)``.

    Args:
        in_dim: input features.
        width: residual stream width ``d``.
        depth: number of residual blocks.
        n_classes: number of output classes.
        activation: block activation (see :class:`MLPBlock`).

    Shapes:
        input ``(B, in_dim)``, logits ``(B, n_classes)``; sites ``"embed"``,
        ``"blocks.0"``, ..., ``"blocks.{depth-1}"`` output ``(B, width)``.
    """

    layout: ClassVar[Layout] = Layout.VECTOR

    def __init__(
        self,
        in_dim: int = 64,
        width: int = 64,
        depth: int = 4,
        n_classes: int = 10,
        activation: str = "gelu",
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(MLPBlock(width, hidden=2 * width, activation=activation) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, n_classes)

    def site_names(self) -> list[str]:
        """Residual-stream sites in depth order: ``["embed", "blocks.0", ...]``.

        Returns:
            ``["embed", "blocks.0", …]``.
        """
        return ["embed"] + [f"blocks.{i}" for i in range(len(self.blocks))]

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, n_classes)`` of inputs ``(B, in_dim)``.

        Args:
            x: inputs ``(B, in_dim)``.

        Returns:
            Logits ``(B, n_classes)``.
        """
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


# ----------------------------------------------------------------------------
# ResNet CNN
# ----------------------------------------------------------------------------


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision-style ResNet basic block: ``relu(shortcut(x) + F(x))``.

    ``F = conv3x3 -> BN -> ReLU -> conv3x3 -> BN``; the shortcut is the
    identity, or ``conv1x1 -> BN`` (attribute ``downsample``) when the stride
    or channel count changes. The block's output is the residual stream.

    Args:
        c_in: input channels.
        c_out: output channels.
        stride: stride of the first convolution and of the shortcut.

    Shapes:
        input ``(B, c_in, H, W)``, output ``(B, c_out, ceil(H/stride), ceil(W/stride))``.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(c_in, c_out, stride)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.conv2 = _conv3x3(c_out, c_out)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(c_out),
            )

    def forward(self, x: Tensor) -> Tensor:
        """``relu(shortcut(x) + F(x))``: ``(B, c_in, H, W)`` in, ``(B, c_out, ceil(H/stride), ceil(W/stride))`` out.

        Args:
            x: images ``(B, c_in, H, W)``.

        Returns:
            ``(B, c_out, ceil(H/stride), ceil(W/stride))``.
        """
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(identity + out)


class ResNetCNN(nn.Module):
    """Small ResNet for 8x8 single-channel digit images.

    Stem ``conv3x3 -> BN -> ReLU``, then one stage per entry of ``channels``
    with ``blocks_per_stage`` :class:`BasicBlock` s each (stride 2 in the first
    block of every stage after the first), global average pooling and a linear
    head. BatchNorm layers make the function depend on the mode: use
    ``model.eval()`` for analysis and ``model.train()`` only for training.

    Args:
        in_channels: input channels.
        channels: output channels of each stage.
        blocks_per_stage: basic blocks per stage.
        n_classes: number of output classes.

    Shapes:
        input ``(B, in_channels, 8, 8)`` (a flat ``(B, in_channels * 64)`` input
        is reshaped to that), logits ``(B, n_classes)``. Sites are the basic
        blocks ``"blocks.0"``, ``"blocks.1"``, ...; each outputs
        ``(B, C, H, W)`` (for the defaults: ``(B, 16, 8, 8)`` twice, then
        ``(B, 32, 4, 4)`` twice).
    """

    layout: ClassVar[Layout] = Layout.IMAGE

    def __init__(
        self,
        in_channels: int = 1,
        channels: tuple[int, ...] = (16, 32),
        blocks_per_stage: int = 2,
        n_classes: int = 10,
    ) -> None:
        super().__init__()
        if not channels or blocks_per_stage < 1:
            raise ValueError("need at least one stage and one block per stage")
        self.in_channels = in_channels
        self.stem = nn.Sequential(
            _conv3x3(in_channels, channels[0]),
            nn.BatchNorm2d(channels[0]),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        c_prev = channels[0]
        for stage, c in enumerate(channels):
            for j in range(blocks_per_stage):
                stride = 2 if (stage > 0 and j == 0) else 1
                blocks.append(BasicBlock(c_prev, c, stride))
                c_prev = c
        self.blocks = nn.ModuleList(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c_prev, n_classes)

    def site_names(self) -> list[str]:
        """Residual-stream sites in depth order: every basic block's name.

        Returns:
            ``["blocks.0", …]``.
        """
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, n_classes)`` of images ``(B, in_channels, H, W)``.

        A flat input ``(B, in_channels * side²)`` is first reshaped to square images.

        Args:
            x: images ``(B, in_channels, H, W)`` or flat ``(B, in_channels * side²)``.

        Returns:
            Logits ``(B, n_classes)``.
        """
        if x.dim() == 2:
            side = math.isqrt(x.shape[1] // self.in_channels)
            x = x.reshape(x.shape[0], self.in_channels, side, side)
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(torch.flatten(self.pool(h), 1))


# ----------------------------------------------------------------------------
# Character-level GPT
# ----------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with explicit q, k, v, out projections.

    ``softmax(q k^T / sqrt(d_head) + causal mask) v`` per head, heads
    concatenated and projected by ``out``.

    Args:
        d_model: stream width.
        n_heads: number of heads (must divide ``d_model``).
        seq_len: maximum sequence length (size of the causal mask).

    Shapes:
        input and output ``(B, T, d_model)`` with ``T <= seq_len``.

    Raises:
        ValueError: if ``n_heads`` does not divide ``d_model``.
    """

    causal_mask: Tensor

    def __init__(self, d_model: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """Causal self-attention of ``x``, ``(B, T, d_model)`` in and out.

        Args:
            x: the stream ``(B, T, d_model)``.

        Returns:
            The attention output ``(B, T, d_model)`` (after the output projection).

        Raises:
            ValueError: if ``T`` exceeds the ``seq_len`` the module was built for.
        """
        B, T, D = x.shape
        if self.causal_mask.shape[0] < T:
            raise ValueError(f"sequence length {T} exceeds seq_len={self.causal_mask.shape[0]}")

        def heads(t: Tensor) -> Tensor:
            return t.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, dh)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)  # (B, H, T, T)
        scores = scores.masked_fill(~self.causal_mask[:T, :T], float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(B, T, D)
        return self.out(y)


class GPTBlock(nn.Module):
    """Pre-LN transformer block ``x + Attn(LN1(x))`` then ``x + MLP(LN2(x))``.

    Args:
        d_model: stream width.
        n_heads: attention heads.
        seq_len: maximum sequence length.
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.

    Shapes:
        input and output ``(B, T, d_model)``; the output is the residual stream.
    """

    def __init__(self, d_model: int, n_heads: int, seq_len: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model),
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x + Attn(LN1(x))``, then ``+ MLP(LN2(·))``: ``(B, T, d_model)`` in and out.

        Args:
            x: the stream ``(B, T, d_model)``.

        Returns:
            The updated stream ``(B, T, d_model)``.
        """
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Small decoder-only character language model.

    Token embedding plus learned position embedding, ``n_layers``
    :class:`GPTBlock` s, final LayerNorm and a linear head to vocabulary logits.

    Args:
        vocab_size: number of tokens ``V``.
        d_model: stream width ``d``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        seq_len: maximum context length.

    Shapes:
        input ``(B, T)`` long token ids with ``T <= seq_len``; logits
        ``(B, T, V)``; sites ``"blocks.0"``, ... output ``(B, T, d)``.
    """

    layout: ClassVar[Layout] = Layout.SEQUENCE

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, seq_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def site_names(self) -> list[str]:
        """Residual-stream sites in depth order: ``["blocks.0", ...]``.

        Returns:
            ``["blocks.0", …, "blocks.<L−1>"]``.
        """
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def forward(self, idx: Tensor) -> Tensor:
        """Next-token logits ``(B, T, V)`` of long token ids ``idx`` of shape ``(B, T)``.

        Args:
            idx: token ids ``(B, T)``, long.

        Returns:
            Logits ``(B, T, V)``.

        Raises:
            ValueError: if ``T`` exceeds ``seq_len``.
        """
        T = idx.shape[1]
        if self.seq_len < T:
            raise ValueError(f"sequence length {T} exceeds seq_len={self.seq_len}")
        pos = torch.arange(T, device=idx.device)
        h = self.tok_emb(idx) + self.pos_emb(pos)[None]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


# ----------------------------------------------------------------------------
# Per-example losses
# ----------------------------------------------------------------------------


def classification_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Per-example cross-entropy.

    Args:
        logits: ``(B, C)`` floating logits.
        y: ``(B,)`` long class labels.

    Returns:
        ``(B,)`` losses in nats (no reduction over the batch).
    """
    return F.cross_entropy(logits, y, reduction="none")


def token_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Per-example mean next-token cross-entropy.

    Args:
        logits: ``(B, T, V)`` floating logits.
        y: ``(B, T)`` long target tokens.

    Returns:
        ``(B,)`` losses in nats: for each example, the mean over its own ``T``
        tokens of the token cross-entropy.
    """
    B, T, V = logits.shape
    per_token = F.cross_entropy(logits.reshape(B * T, V), y.reshape(B * T), reduction="none")
    return per_token.view(B, T).mean(dim=1)
