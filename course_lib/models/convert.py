"""The state-dict mapping between `course_lib.models.Llama` and transformers' `LlamaForCausalLM`
(notebook 12).

Both use the half-rotation RoPE layout, so the mapping is a renaming, no permutation of Wq/Wk:

| course_lib (Meta's names)              | transformers                                     |
| -------------------------------------- | ------------------------------------------------ |
| tok_embeddings.weight                  | model.embed_tokens.weight                        |
| layers.i.attention.wq / wk / wv / wo   | model.layers.i.self_attn.q_proj / k_proj / v_proj / o_proj |
| layers.i.feed_forward.w1 / w3 / w2     | model.layers.i.mlp.gate_proj / up_proj / down_proj |
| layers.i.attention_norm / ffn_norm     | model.layers.i.input_layernorm / post_attention_layernorm |
| norm.weight                            | model.norm.weight                                |
| output.weight                          | lm_head.weight                                   |

transformers is optional: only `to_hf`, `from_hf` and `hf_config` import it, on first call.
"""

from __future__ import annotations

import re

import torch

from .llama import Llama, LlamaConfig

_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
    """transformers' name of one of our parameter names, e.g. 'layers.0.attention.wq.weight' ->
    'model.layers.0.self_attn.q_proj.weight'. Raises KeyError for a name it does not know."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.weight"
    raise KeyError(f"no transformers name for parameter {name!r}")


def parameter_names(config: LlamaConfig) -> list[str]:
    """Our parameter names for `config`, in `Llama.state_dict()` order."""
    per_layer = [
        "attention_norm",
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "ffn_norm",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    ]
    names = ["tok_embeddings.weight"]
    names += [f"layers.{i}.{p}.weight" for i in range(config.n_layers) for p in per_layer]
    return names + ["norm.weight", "output.weight"]


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (names as in `Llama.state_dict()`) with transformers' names."""
    return {hf_name(k): v for k, v in state.items()}


def from_hf_state_dict(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """A transformers LlamaForCausalLM state dict renamed to ours. Buffers transformers keeps (the
    rotary inverse frequencies) are dropped; with tied embeddings lm_head may be absent."""
    names = {hf_name(k): k for k in parameter_names(config)}
    out = {}
    for k, v in state.items():
        if k in names:
            out[names[k]] = v
        elif "rotary_emb" not in k:
            raise KeyError(f"from_hf_state_dict: unexpected transformers parameter {k!r}")
    if "tok_embeddings.weight" not in out:
        raise ValueError("from_hf_state_dict: the state dict has no model.embed_tokens.weight")
    if config.tie_embeddings:
        head = out.setdefault("output.weight", out["tok_embeddings.weight"])
        if head is not out["tok_embeddings.weight"] and not torch.equal(head, out["tok_embeddings.weight"]):
            raise ValueError(
                "from_hf_state_dict: the config ties the embeddings, but lm_head.weight differs from "
                "model.embed_tokens.weight (loading would silently replace one by the other); use a config "
                "with tie_embeddings=False"
            )
    return out


def hf_config(config: LlamaConfig, **overrides):
    """transformers.LlamaConfig with our sizes (no bias, half-rotation RoPE, SDPA attention)."""
    import transformers

    kwargs = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        attn_implementation="sdpa",
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def config_from_hf(hf) -> LlamaConfig:
    """Our LlamaConfig from a transformers LlamaConfig. A setting our Llama does not implement is
    refused with a ValueError naming it, never dropped (the logits would differ): RoPE scaling (a
    rope_type other than "default", e.g. Llama 3's "llama3" or "linear"), an activation other than
    SiLU, biases in attention or MLP (attention_bias, mlp_bias), head_dim other than hidden_size / heads."""
    # transformers >= 5 keeps theta and scaling in `rope_parameters`; 4.x in `rope_theta` and `rope_scaling`
    rope = {**(getattr(hf, "rope_scaling", None) or {}), **(getattr(hf, "rope_parameters", None) or {})}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    refused = []
    if rope_type != "default":
        refused.append(f"RoPE scaling rope_type={rope_type!r} (only unscaled RoPE)")
    if getattr(hf, "hidden_act", "silu") not in ("silu", "swish"):
        refused.append(f"hidden_act={hf.hidden_act!r} (only SiLU, SwiGLU)")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(hf, name, False):
            refused.append(f"{name}=True (no biases)")
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and head_dim * hf.num_attention_heads != hf.hidden_size:
        refused.append(
            f"head_dim={head_dim} (ours is hidden_size / num_attention_heads = "
            f"{hf.hidden_size // hf.num_attention_heads})"
        )
    if refused:
        raise ValueError(f"config_from_hf: course_lib's Llama does not implement {'; '.join(refused)}")
    return LlamaConfig(
        vocab_size=hf.vocab_size,
        dim=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads,
        hidden_dim=hf.intermediate_size,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=float(theta),
        norm_eps=hf.rms_norm_eps,
        tie_embeddings=bool(hf.tie_word_embeddings),
    )


def to_hf(model: Llama):
    """A transformers LlamaForCausalLM with `model`'s weights (same device and dtype), SDPA attention."""
    import transformers

    hf = transformers.LlamaForCausalLM(hf_config(model.config))
    p = next(model.parameters())
    hf.to(device=p.device, dtype=p.dtype)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict()), strict=False)
    missing = [
        k
        for k in missing
        if "rotary_emb" not in k and not (k == "lm_head.weight" and model.config.tie_embeddings)
    ]
    if missing or unexpected:
        raise RuntimeError(f"to_hf: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def from_hf(hf, backend: str = "sdpa") -> Llama:
    """Our Llama with the weights of a transformers LlamaForCausalLM (same device and dtype). A config
    our Llama cannot reproduce (RoPE scaling, biases, ...) is refused: `config_from_hf`."""
    config = config_from_hf(hf.config)
    model = Llama(config, backend)
    p = next(hf.parameters())
    model.to(device=p.device, dtype=p.dtype)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), config))
    return model
