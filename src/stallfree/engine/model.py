"""A Llama-architecture decoder whose forward pass runs one flat batch against the paged KV cache.

Imports allowed: the standard library, torch, stallfree.engine.

Source: Llama (Touvron et al., 2023): pre-norm RMSNorm (Zhang & Sennrich, 2019), rotary position
embeddings (Su et al., 2021), grouped-query attention (Ainslie et al., 2023), SwiGLU feed-forward
(Shazeer, 2020). Shapes use the dims named in stallfree.engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stallfree.engine.batch import FlatBatch
from stallfree.engine.config import ModelConfig, rope_tables
from stallfree.engine.errors import ModelLoadError
from stallfree.engine.kv_cache import KVCache
from stallfree.engine.lora import LoraStep

__all__ = ["LlamaModel", "prepacking_applies"]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 whatever the dtype (as transformers' LlamaRMSNorm). Shapes: x [T, d] -> [T, d]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a weight pre-packed by oneDNN (see _prepack_linear). Shapes: x [T, in] -> [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _prepack_linear(w: torch.Tensor) -> torch.Tensor:
    """`w` [out, in] reordered once into oneDNN's blocked layout for the CPU's matrix units.

    The hint of 16 rows only tunes the layout; the packed weight serves any row count.
    """
    return torch.ops.mkldnn._reorder_linear_weight(w, 16)


def prepacking_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether LlamaModel pre-packs its weights: bfloat16 on a CPU whose torch has oneDNN, and only if
    a packed matmul gives F.linear's result bit for bit (checked on a small matrix), so packing never
    changes an output.

    Why: oneDNN reorders a plain bf16 weight into its blocked layout on every call; packing once
    removes that. Measured on an Intel CPU with AMX, one thread, 30 distinct [3072, 576] bf16 weights
    in turn: 0.33 ms per matmul packed against 0.52-0.80 ms plain for 1-16 rows, and the LM head
    [49152, 576] at 16 rows 5.4 against 8.8 ms. float32 is left to F.linear (MKL): packing it with
    oneDNN changed results in the last bits and was not faster, and so did float16 (plain float16
    matmuls take another path), so both are left to F.linear (docs/engine.md).
    """
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen).to(dtype)
        x = torch.randn(5, 40, generator=gen).to(dtype)
        return bool(torch.equal(_packed_linear(x, _prepack_linear(w)), F.linear(x, w)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _pre_attention(
    x: torch.Tensor, norm: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, hq: int, hkv: int,
    linear: Callable[..., torch.Tensor] = F.linear, lora: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm, the fused QKV matmul and RoPE on q and k together (one rotation for H + Hkv heads).

    Shapes: x [T, d]; cos, sin [T, 1, D]; returns q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]
    (k and v are views into one buffer, not contiguous). `linear` is F.linear, or _packed_linear
    when the weights are pre-packed. `lora`, when given, is lora(matmul name, input [T, in], output
    [T, out]) -> the output with the step's LoRA deltas added (LoraStep.add for this layer).
    """
    t = x.shape[0]
    h = _rms_norm(x, norm, eps)
    qkv = linear(h, qkv_w, qkv_b)
    if lora is not None:
        qkv = lora("qkv", h, qkv)
    qkv = qkv.view(t, hq + 2 * hkv, -1)
    qk = qkv[:, : hq + hkv]
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk = (qk * cos + rotated * sin).to(x.dtype)
    return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]


def _post_attention(
    x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, norm: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, eps: float, linear: Callable[..., torch.Tensor] = F.linear,
    lora: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The output projection and residual, then RMSNorm, the fused SwiGLU and residual.

    Shapes: x [T, d]; attn [T, H*D]; returns [T, d]. `linear` and `lora` as in _pre_attention.
    """
    if lora is None:
        x = x + linear(attn, o_w)
        gate, up = linear(_rms_norm(x, norm, eps), gate_up).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, down)
    x = x + lora("o", attn, linear(attn, o_w))
    h = _rms_norm(x, norm, eps)
    gate, up = lora("gate_up", h, linear(h, gate_up)).chunk(2, dim=-1)
    m = F.silu(gate) * up
    return x + lora("down", m, linear(m, down))


class _Layer:
    """One decoder layer's weights, with Q/K/V and gate/up fused for one matmul each."""

    __slots__ = ("attn_norm", "qkv", "qkv_bias", "o", "mlp_norm", "gate_up", "down")

    def __init__(self, t: dict[str, torch.Tensor], i: int, dtype: torch.dtype, device: torch.device):
        p = f"model.layers.{i}."

        def get(name: str) -> torch.Tensor:
            try:
                return t[p + name]
            except KeyError:
                raise ModelLoadError(f"checkpoint lacks tensor {p + name!r}") from None

        def put(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=device, dtype=dtype).contiguous()

        self.attn_norm = put(get("input_layernorm.weight"))
        self.qkv = put(torch.cat([get(f"self_attn.{n}_proj.weight") for n in "qkv"]))
        biases = [t.get(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
        self.qkv_bias = put(torch.cat(biases)) if all(b is not None for b in biases) else None
        self.o = put(get("self_attn.o_proj.weight"))
        self.mlp_norm = put(get("post_attention_layernorm.weight"))
        self.gate_up = put(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]))
        self.down = put(get("mlp.down_proj.weight"))


class LlamaModel:
    """The decoder's weights and its forward pass over a FlatBatch.

    It owns the weights and the RoPE tables; it reads and writes the KVCache handed to forward()
    but never allocates blocks (the engine does).

    Args:
        config: the model's shape.
        tensors: float32 tensors with Hugging Face Llama names (see stallfree.engine.weights).
        dtype: compute and weight dtype (torch.float32, torch.bfloat16 or torch.float16).
        device: where weights and activations live.
        compile: wrap the dense part of each layer (RMSNorm, QKV, RoPE; output projection,
            RMSNorm, SwiGLU) in torch.compile (dynamic shapes, one graph each for all layers);
            compiled on the first forward. Off by default: see docs/engine.md for what it gains.

    In bfloat16 on a CPU the projection and LM head weights are pre-packed for oneDNN once at load
    (`prepacked` True; see prepacking_applies): same outputs bit for bit, faster matmuls. Not with
    compile, on a GPU, or in float32 or float16.

    Raises:
        ModelLoadError: a tensor is missing or has the wrong shape.
    """

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        compile: bool = False,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        embed = tensors.get("model.embed_tokens.weight")
        if embed is None or tuple(embed.shape) != (c.vocab_size, c.hidden_size):
            got = None if embed is None else tuple(embed.shape)
            raise ModelLoadError(f"token embedding must be [{c.vocab_size}, {c.hidden_size}], got {got}")
        self.embed = embed.to(device=self.device, dtype=dtype)
        head = tensors.get("lm_head.weight")
        if head is None and not c.tie_embeddings:
            raise ModelLoadError("checkpoint lacks lm_head.weight and does not tie embeddings")
        self.lm_head = self.embed if head is None else head.to(device=self.device, dtype=dtype)
        self.norm = tensors["model.norm.weight"].to(device=self.device, dtype=dtype)
        self.layers = [_Layer(tensors, i, dtype, self.device) for i in range(c.num_layers)]
        q_rows = c.num_heads * c.head_dim
        if self.layers[0].qkv.shape != (q_rows + 2 * c.num_kv_heads * c.head_dim, c.hidden_size):
            raise ModelLoadError(f"q/k/v projections do not match H={c.num_heads}, "
                                 f"Hkv={c.num_kv_heads}, D={c.head_dim}, d={c.hidden_size}")
        cos, sin = rope_tables(c, tensors.get("rope_freqs"))
        self.cos = cos.to(self.device)
        self.sin = sin.to(self.device)
        self.scale = c.head_dim ** -0.5
        self.compiled = bool(compile)
        self._pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = _pre_attention
        self._post: Callable[..., torch.Tensor] = _post_attention
        self._linear: Callable[..., torch.Tensor] = F.linear
        self.prepacked = not compile and prepacking_applies(dtype, self.device)
        if self.prepacked:
            for layer in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    setattr(layer, name, _prepack_linear(getattr(layer, name)))
            self.lm_head = _prepack_linear(self.lm_head)  # a copy: a tied embedding stays plain
            self._linear = _packed_linear
        if compile:
            self._pre = torch.compile(_pre_attention, dynamic=True)
            self._post = torch.compile(_post_attention, dynamic=True)

    def _attention(
        self, q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, batch: FlatBatch,
        masks: list[torch.Tensor], block_size: int,
    ) -> torch.Tensor:
        """Attend every query row to its request's cached keys (this step's already written).

        One SDPA call per attention group (at most two per layer: the one-token entries, then the
        multi-token entries), over keys gathered block by block through the padded block tables.
        A masked key contributes nothing: its score is -inf and the value stored there is one the
        engine wrote (a zero pad block, or a zeroed tail of a request's last block; see KVCache).

        Shapes: q [T, H, D]; layer_k, layer_v [N + block_size, Hkv, D]; masks[g] [E, 1, Q, C]
        additive (0 where seen, -inf where masked) in the model's dtype; returns [T, H*D].
        """
        c = self.config
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        out = q.new_empty(q.shape[0], hq * d)
        kb = layer_k.view(-1, block_size * hkv * d)
        vb = layer_v.view(-1, block_size * hkv * d)
        for g, mask in zip(batch.groups, masks, strict=True):
            e, nb = g.tables.shape
            nq = g.num_queries
            flat = g.tables.reshape(-1)
            k = kb.index_select(0, flat).view(e, nb * block_size, hkv, d).transpose(1, 2)
            v = vb.index_select(0, flat).view(e, nb * block_size, hkv, d).transpose(1, 2)
            qg = q.index_select(0, g.q_rows).view(e, nq, hq, d).transpose(1, 2)  # [E, H, Q, D]
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)
            o = o.transpose(1, 2).reshape(e * nq, hq * d)
            if g.out_index is None:
                out.index_copy_(0, g.q_rows, o)
            else:
                out.index_copy_(0, g.out_rows, o.index_select(0, g.out_index))
        return out

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, kv: KVCache, lora: LoraStep | None = None) -> torch.Tensor:
        """Run one step: write this step's K and V into `kv` and return logits of the asked rows.

        `lora`: the step's LoRA adapters and the rows each applies to (engine/lora.py); the step then
        runs the uncompiled layer functions with each targeted matmul's delta added to its rows.

        Shapes: returns [S, V] float32, S = len(batch.logits_rows). Activations are [T, d];
        q [T, H*D], k and v [T, Hkv*D]; the MLP's inner activations [T, F].
        """
        c = self.config
        hq, hkv, eps = c.num_heads, c.num_kv_heads, c.rms_norm_eps
        bs = kv.block_size
        kv.zero_blocks(batch.zero_blocks)
        # One additive mask per group and step, shared by every layer: SDPA would otherwise turn a
        # boolean mask into an additive one in each call.
        masks = []
        for g in batch.groups:
            keys = torch.arange(g.tables.shape[1] * bs, device=self.device)
            seen = keys[None, None, None, :] <= g.q_pos[:, None, :, None]
            masks.append(torch.zeros(seen.shape, dtype=self.dtype, device=self.device)
                         .masked_fill_(~seen, float("-inf")))
        x = self.embed[batch.token_ids]
        cos = self.cos[batch.positions].to(self.dtype).unsqueeze(1)
        sin = self.sin[batch.positions].to(self.dtype).unsqueeze(1)
        pre, post, linear = self._pre, self._post, self._linear
        if lora is not None:
            pre, post = _pre_attention, _post_attention
        for li, layer in enumerate(self.layers):
            hook = None if lora is None else functools.partial(lora.add, li)
            q, k, v = pre(x, layer.attn_norm, layer.qkv, layer.qkv_bias, cos, sin, eps, hq, hkv, linear,
                          **({} if hook is None else {"lora": hook}))
            kv.k[li].index_copy_(0, batch.slot_mapping, k)
            kv.v[li].index_copy_(0, batch.slot_mapping, v)
            attn = self._attention(q, kv.k[li], kv.v[li], batch, masks, bs)
            x = post(x, attn, layer.o, layer.mlp_norm, layer.gate_up, layer.down, eps, linear,
                     **({} if hook is None else {"lora": hook}))
        h = _rms_norm(x.index_select(0, batch.logits_rows), self.norm, eps)
        return linear(h, self.lm_head).float()
