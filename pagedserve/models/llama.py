"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) over a paged KV cache.

Plain PyTorch modules that read like the equations; the paged-attention kernels come in
as a KernelSet, so the CPU and CUDA paths share every line here. Under tensor parallelism
(models/parallel.py) each rank builds the same modules at its shard's sizes, and the
attention and MLP outputs are all-reduced.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import AttentionMetadata, KernelSet
from pagedserve.models.config import ModelConfig
from pagedserve.models.parallel import TensorParallel


class RMSNorm(nn.Module):
    """Holds the weight; the math is the kernel set's ``rms_norm`` (optionally fused with
    the residual add)."""

    def __init__(self, dim: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    d = config.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type") == "llama3":
        # Llama 3.1: stretch low frequencies, keep high ones, blend in between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, blended, inv_freq)
    elif scaling and scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling:
        raise ValueError(f"unsupported rope scaling {scaling.get('rope_type')!r}")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE tables, cos/sin [max_positions, d/2] in float32, indexed by
    absolute position."""

    def __init__(self, config: ModelConfig, max_positions: int, kernels: KernelSet):
        super().__init__()
        self.config, self.max_positions, self.kernels = config, max_positions, kernels
        # Shapes only under torch.device("meta"); compute_tables() fills them once the model
        # has memory.
        shape = (max_positions, config.head_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        if not self.cos.is_meta:
            self.compute_tables()

    @torch.no_grad()
    def compute_tables(self) -> None:
        """(Re)computes cos/sin in float32 on the buffers' device: after to_empty(), which
        leaves them uninitialized, and after a cast of the model to a narrower dtype, which
        rounds them. Computed on the CPU, so that every device gets the same values."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, rope_inv_freq(self.config))
        self.cos = freqs.cos().to(self.cos.device)
        self.sin = freqs.sin().to(self.sin.device)

    def apply_(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Rotates x [T, heads, d] in place."""
        self.kernels.rotary_(x, positions, self.cos, self.sin)


class PackedLinear(nn.Module):
    """A CPU linear layer whose weight was laid out once, up front, by oneDNN or (float32,
    where the kernel set has one) by the C++ kernels' own packing. Plain F.linear re-lays
    the weight out on every call. bf16: ~1.4x faster matmuls at every batch size,
    bit-identical results. float32 (on an AVX2 EPYC): decode steps ~0.76x the time, the
    lm_head most of the gain, with results that differ from F.linear's in the last bits
    (docs/performance.md §7); the C++ kernel gains more again (docs/performance-linear.md)."""

    def __init__(self, linear: nn.Linear | torch.Tensor, bias: torch.Tensor | None = None,
                 kernels: KernelSet | None = None):
        super().__init__()
        weight = (linear.weight if isinstance(linear, nn.Linear) else linear).detach()
        bias = linear.bias if isinstance(linear, nn.Linear) else bias
        self.out_features = weight.shape[0]
        self.native = None
        if weight.dtype == torch.float32 and kernels is not None and kernels.linear_f32:
            self.native = kernels.linear_f32
            self.register_buffer("packed", kernels.pack_linear_f32(weight))
        else:
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 64))
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native(x, self.packed, self.bias, self.out_features)
        # The overload itself, not the packet: it skips resolving the overload on each call
        # (3-5 us of ~17 for a one-row matmul; 121 calls a decode step).
        return torch.ops.mkldnn._linear_pointwise.default(
            x, self.packed, self.bias, "none", [], "")


def pack_for_cpu(model: nn.Module, kernels: KernelSet | None = None) -> None:
    """Swap every nn.Linear for a PackedLinear (on CPU)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, kernels=kernels))


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read; o_proj's partial sums are
    all-reduced."""

    def __init__(self, config: ModelConfig, kernels: KernelSet, tp: TensorParallel):
        super().__init__()
        self.num_heads = len(tp.q_heads(config))
        self.num_kv_heads = len(tp.kv_heads(config))
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
        self.scale = self.head_dim**-0.5
        self.kernels, self.tp = kernels, tp

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                ) -> torch.Tensor:
        """q [T, heads, d], rotated; the new tokens' K/V rotated and written to the cache
        (attention then reads every key from there)."""
        T, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(T, self.num_kv_heads, d)
        if self.q_norm is None:  # rotate q and k together, in place in the qkv buffer
            qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, d)
            rope.apply_(positions, qk)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:  # Qwen3: RMSNorm over each head of q and k, then RoPE
            q = self.q_norm(q.reshape(-1, d)).view(T, self.num_heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(T, self.num_kv_heads, d)
            rope.apply_(positions, q)
            rope.apply_(positions, k)
        self.kernels.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        return q

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
               v_cache: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, heads, d]: the decode rows' attention, then the prefill chunks'; written into
        ``out``'s first T rows when given."""
        nd, T = meta.num_decode_tokens, q.shape[0]
        if out is None and 0 < nd < T:  # both kinds write their rows of one tensor: no concat
            out = q.new_empty(q.shape)
        decode_out = prefill_out = None  # None: each kernel returns a new tensor
        if out is not None:
            decode_out, prefill_out = out[:nd], out[nd:T]
        if nd:
            result = self.kernels.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale, out=decode_out)
        if nd < T:
            result = self.kernels.paged_prefill_attention(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                meta.prefill_context_lens, self.scale, max_query_len=meta.prefill_max_query_len,
                out=prefill_out)
        return result if out is None else out[:T]

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.o_proj(attn.reshape(attn.shape[0], self.q_size)))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        q = self.project(x, positions, rope, meta.slot_mapping, k_cache, v_cache)
        return self.output(self.attend(q, meta, k_cache, v_cache))


class MLP(nn.Module):
    """This rank's columns of gate/up and the matching rows of down, all-reduced."""

    def __init__(self, config: ModelConfig, kernels: KernelSet, tp: TensorParallel):
        super().__init__()
        width = len(tp.mlp_columns(config))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * width, bias=config.mlp_bias)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=config.mlp_bias)
        self.kernels, self.tp = kernels, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: KernelSet, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, kernels, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = MLP(config, kernels, tp)

    def forward(self, x, residual, positions, rope, meta, k_cache, v_cache):
        """(x, residual) -> (x', residual'): the residual stream is x + residual; each
        norm first adds its input into the residual, in place (one pass instead of two)."""
        h = self.input_layernorm(x, residual)
        if residual is None:  # first layer: x (the embeddings) starts the residual stream
            residual = x
        h = self.self_attn(h, positions, rope, meta, k_cache, v_cache)
        return self.after_attention(h, residual), residual

    def after_attention(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The MLP half of the layer, from the attention block's output; residual += h."""
        return self.mlp(self.post_attention_layernorm(h, residual))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, kernels: KernelSet, max_positions: int,
                 tp: TensorParallel | None = None):
        super().__init__()
        tp = tp or TensorParallel()
        self.config, self.tp, self.kernels = config, tp, kernels
        tp.check(config)
        vocab = len(tp.vocab_rows(config)) if tp.size > 1 else config.vocab_size
        # Given a weight, nn.Embedding skips its random init; on the meta device that init
        # alone imported torch._dynamo (and triton): seconds of every start.
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size,
                                         _weight=torch.empty(vocab, config.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(config, kernels, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.rope = RotaryEmbedding(config, max_positions, kernels)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        k_caches: torch.Tensor,  # [L, num_blocks, block_size, H_kv, d]
        v_caches: torch.Tensor,
    ) -> torch.Tensor:
        x, residual = self.tp.embed(self.embed_tokens, input_ids, self.config), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rope, meta, k_caches[i], v_caches[i])
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in the model's dtype (the sampler widens them only where it must); under
        tensor parallelism gathered on rank 0, None on the other ranks."""
        if self.lm_head is None:  # tied: the embedding matrix is the output projection
            return self.tp.gather_logits(F.linear(hidden, self.embed_tokens.weight), self.config)
        return self.tp.gather_logits(self.lm_head(hidden), self.config)

    def pack_for_cpu(self) -> None:
        pack_for_cpu(self.layers, self.kernels)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head = PackedLinear(weight, kernels=self.kernels)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights (this rank's shard of them: loader.shard_weight),
        fusing q/k/v and gate/up into one matmul each."""
        p = "model.layers.{}."
        params = dict(self.named_parameters())
        fused = {
            "self_attn.qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"],
            "self_attn.qkv_proj.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                        "self_attn.v_proj.bias"],
            "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
            "mlp.gate_up_proj.bias": ["mlp.gate_proj.bias", "mlp.up_proj.bias"],
        }
        for name, param in params.items():
            if name.startswith("layers."):
                idx, rest = name.split(".", 2)[1:]
                parts = fused.get(rest, [rest])
                tensor = torch.cat([weights[p.format(idx) + part] for part in parts])
            elif name == "lm_head.weight":
                tensor = weights["lm_head.weight"]
            else:
                tensor = weights["model." + name]
            if tensor.shape != param.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} "
                                 f"!= model shape {tuple(param.shape)}")
            param.copy_(tensor)
