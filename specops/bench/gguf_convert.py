"""Convert a Hugging Face Llama folder to GGUF, so llama.cpp can run the same model.

Written against the ``gguf`` package's ``GGUFWriter`` (the ``peers`` extra). What it
handles, and refuses with a `GGUFConvertError` otherwise:

* **Architecture:** ``LlamaForCausalLM`` (``model_type: llama``) with SiLU gated MLP,
  no attention / MLP biases, plain RoPE (``rope_type: default``), grouped-query
  attention allowed, tied or untied LM head, safetensors weights (one file or an
  index of shards).
* **Tokenizer:** a ``tokenizer.json`` byte-level BPE (``ByteLevel`` pre-tokenizer with
  its regex on, i.e. GPT-2's split), no normalizer. In GGUF that is
  ``tokenizer.ggml.model = "gpt2"`` with pre-tokenizer ``"gpt-2"``, the vocabulary as
  byte-level strings in id order, merges as ``"left right"`` strings in rank order,
  and token types NORMAL / CONTROL (special added tokens) / USER_DEFINED (other added
  tokens) / UNUSED (padding rows when the embedding has more rows than the vocab).

Two layout facts carry the conversion:

* GGUF stores a tensor with its dimensions in reverse order of numpy's, so a
  transformers ``Linear`` weight ``[out, in]`` is written as is and reads in ggml as
  ``ne = [in, out]`` — exactly llama.cpp's ``{n_embd, n_ff}``-style shapes.
* transformers' Llama applies RoPE to the halves of each head (dimension ``i`` pairs
  with ``i + hd/2``, "rotate_half"); llama.cpp's Llama graph rotates adjacent pairs
  (``2i`` with ``2i+1``). Reordering the rows of ``q_proj`` / ``k_proj`` within each head
  so that row ``2i`` is old row ``i`` and row ``2i+1`` is old row ``i + hd/2`` makes the
  two computations identical (`interleave_rope_rows`).

`ensure_gguf` caches the file next to the model (``model-<type>.gguf``) or, when that
folder is not writable or is specops' own bundled assets, under ``$SPECOPS_CACHE_DIR``
(default ``~/.cache/specops``).
The file records a fingerprint of its sources and of this converter; a stale file is
rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specops.models.registry import BF16_SUBDIR

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1
FINGERPRINT_KEY = "specops.source_fingerprint"
OUT_TYPES = ("float32", "float16", "bfloat16")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class GGUFConvertError(ValueError):
    """The model folder cannot be converted (unsupported architecture, tokenizer or files)."""


@dataclass(frozen=True)
class LlamaShape:
    """The hyper-parameters llama.cpp's Llama graph needs, read from ``config.json``."""

    vocab_size: int         # V: rows of the embedding
    hidden_size: int        # D
    intermediate_size: int  # F
    num_layers: int         # L
    num_heads: int          # H
    num_kv_heads: int       # H_kv
    head_dim: int           # hd
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    tied_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def read_llama_config(model_dir: Path) -> LlamaShape:
    """Parse ``config.json``; raise `GGUFConvertError` for anything the converter does not handle."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise GGUFConvertError(f"no config.json in {model_dir}")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if model_type != "llama" or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise GGUFConvertError(
            f"cannot convert {model_dir} to GGUF: architecture {', '.join(archs) or '?'} (model_type "
            f"{model_type!r}) is not supported; the converter handles {', '.join(SUPPORTED_ARCHITECTURES)} only")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise GGUFConvertError(f"cannot convert {model_dir} to GGUF: {flag}=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise GGUFConvertError(f"cannot convert {model_dir} to GGUF: hidden_act {cfg['hidden_act']!r} (only silu)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise GGUFConvertError(f"cannot convert {model_dir} to GGUF: rope_type {rope_type!r} (only plain RoPE)")
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if head_dim % 2:
        raise GGUFConvertError(f"cannot convert {model_dir} to GGUF: odd head_dim {head_dim}")

    def token_id(key: str) -> int | None:
        value = cfg.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        return None if value is None else int(value)

    return LlamaShape(
        vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=token_id("bos_token_id"), eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("pad_token_id"),
    )


@dataclass(frozen=True)
class BPEVocab:
    """A byte-level BPE vocabulary in GGUF's terms."""

    tokens: list[str]       # index = token id
    token_types: list[int]  # gguf.TokenType values, index = token id
    merges: list[str]       # "left right", in rank order
    add_bos: bool


def read_bpe_tokenizer(tokenizer_json: Path, vocab_size: int) -> BPEVocab:
    """Read a byte-level BPE ``tokenizer.json``; pad to ``vocab_size`` embedding rows."""
    from gguf import TokenType

    if not tokenizer_json.is_file():
        raise GGUFConvertError(f"no tokenizer.json at {tokenizer_json} (only fast tokenizers are supported)")
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFConvertError(f"tokenizer {tokenizer_json}: model type {model.get('type')!r} (only BPE)")
    pre = spec.get("pre_tokenizer") or {}
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex", True)):
        raise GGUFConvertError(f"tokenizer {tokenizer_json}: pre-tokenizer {pre.get('type')!r} is not GPT-2's "
                               "byte-level split (ByteLevel with use_regex)")
    if pre.get("add_prefix_space"):
        raise GGUFConvertError(f"tokenizer {tokenizer_json}: add_prefix_space=true is not supported")
    if spec.get("normalizer") is not None:
        raise GGUFConvertError(f"tokenizer {tokenizer_json}: a normalizer is not supported")

    by_id: dict[int, str] = {int(i): tok for tok, i in model["vocab"].items()}
    types: dict[int, int] = {i: int(TokenType.NORMAL) for i in by_id}
    for added in spec.get("added_tokens") or []:
        i = int(added["id"])
        by_id[i] = added["content"]
        types[i] = int(TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED)
    n = max(by_id) + 1
    if n > vocab_size:
        raise GGUFConvertError(f"tokenizer {tokenizer_json} has {n} tokens, more than the model's {vocab_size} rows")
    tokens, token_types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            token_types.append(types[i])
        else:  # an id with no token (gap or padding row): llama.cpp needs one entry per embedding row
            tokens.append(f"[PAD{i}]")
            token_types.append(int(TokenType.UNUSED))

    merges = []
    for merge in model.get("merges") or []:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        if " " in left or " " in right:
            raise GGUFConvertError(f"tokenizer {tokenizer_json}: merge {merge!r} contains a space")
        merges.append(f"{left} {right}")

    post = spec.get("post_processor") or {}
    single = (post.get("single") or []) if post.get("type") == "TemplateProcessing" else []
    add_bos = bool(single) and "SpecialToken" in single[0]
    return BPEVocab(tokens=tokens, token_types=token_types, merges=merges, add_bos=add_bos)


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows from rotate-half pairing to adjacent pairing (module docstring).

    weight: [num_heads * hd, D] -> [num_heads * hd, D]; row h*hd + 2i + j <- row h*hd + j*hd/2 + i.
    """
    rows, cols = weight.shape
    if rows % (2 * num_heads):
        raise GGUFConvertError(f"projection with {rows} rows does not split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    raise GGUFConvertError(f"no safetensors weights in {model_dir} (model.safetensors or its .index.json)")


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    return state


def _to_numpy(t: torch.Tensor, out_type: str) -> tuple[np.ndarray, object]:
    """A tensor as the array GGUFWriter stores, and its raw GGML type (None: inferred from numpy)."""
    from gguf import GGMLQuantizationType

    t = t.detach().to("cpu")
    if t.dim() == 1 or out_type == "float32":  # norms stay f32 in every file type (llama.cpp's convention)
        return t.to(torch.float32).contiguous().numpy(), None
    if out_type == "float16":
        return t.to(torch.float16).contiguous().numpy(), None
    bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return bits, GGMLQuantizationType.BF16


def llama_tensors(state: dict[str, torch.Tensor], shape: LlamaShape) -> list[tuple[str, torch.Tensor]]:
    """transformers Llama weights -> (GGUF name, tensor) in llama.cpp's order, with RoPE rows interleaved."""
    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise GGUFConvertError(f"weight {name!r} missing from the checkpoint")
        return state[name]

    out = [("token_embd.weight", take("model.embed_tokens.weight"))]  # [V, D]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out += [
            (f"blk.{i}.attn_norm.weight", take(p + "input_layernorm.weight")),  # [D]
            (f"blk.{i}.attn_q.weight", interleave_rope_rows(take(p + "self_attn.q_proj.weight"), shape.num_heads)),
            (f"blk.{i}.attn_k.weight", interleave_rope_rows(take(p + "self_attn.k_proj.weight"), shape.num_kv_heads)),
            (f"blk.{i}.attn_v.weight", take(p + "self_attn.v_proj.weight")),  # [H_kv*hd, D]
            (f"blk.{i}.attn_output.weight", take(p + "self_attn.o_proj.weight")),  # [D, H*hd]
            (f"blk.{i}.ffn_norm.weight", take(p + "post_attention_layernorm.weight")),  # [D]
            (f"blk.{i}.ffn_gate.weight", take(p + "mlp.gate_proj.weight")),  # [F, D]
            (f"blk.{i}.ffn_up.weight", take(p + "mlp.up_proj.weight")),  # [F, D]
            (f"blk.{i}.ffn_down.weight", take(p + "mlp.down_proj.weight")),  # [D, F]
        ]
    out.append(("output_norm.weight", take("model.norm.weight")))  # [D]
    if not shape.tied_embeddings:  # tied: llama.cpp reuses token_embd as the output projection
        out.append(("output.weight", take("lm_head.weight")))  # [V, D]
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}" for i in range(shape.num_layers) for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
    extra = sorted(k for k in state if k not in expected and k != "lm_head.weight" and "rotary_emb" not in k)
    if extra:
        raise GGUFConvertError(f"checkpoint has weights the Llama converter does not know: {', '.join(extra[:5])}")
    return out


def source_fingerprint(model_dir: Path, tokenizer_json: Path, out_type: str) -> str:
    """Changes when the config, tokenizer, weights (name, size, mtime) or this converter change."""
    h = hashlib.sha256(f"specops-gguf-v{CONVERTER_VERSION}:{out_type}".encode())
    h.update((model_dir / "config.json").read_bytes())
    h.update(tokenizer_json.read_bytes())
    for path in _weight_files(model_dir):
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def source_gguf(model_dir: Path) -> Path | None:
    """The GGUF a model folder was made from (``specops models pull``'s ``source_gguf``), if any;
    for a pulled model's bfloat16 copy (its ``bf16/`` folder, whose manifest is its parent's),
    the one the whole model was made from."""
    model_dir = Path(model_dir)
    folders = [model_dir] + ([model_dir.parent] if model_dir.name == BF16_SUBDIR else [])
    for folder in folders:
        try:
            manifest = json.loads((folder / "specops-model.json").read_text())
        except (OSError, ValueError):
            continue
        rel = manifest.get("source_gguf") if isinstance(manifest, dict) else None
        path = folder / rel if isinstance(rel, str) else None
        return path if path is not None and path.is_file() else None
    return None


def _copy_tokenizer_fields(writer: Any, source: Path) -> int:
    """Copy every ``tokenizer.*`` key of the GGUF at ``source`` into ``writer`` (the model's own
    vocabulary, pre-tokenizer, special tokens and chat template, whatever their form); returns
    how many keys were copied."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        copied += 1
    return copied


def convert_to_gguf(model_dir: Path | str, out_path: Path | str, *, out_type: str = "float32",
                    tokenizer_json: Path | str | None = None, fingerprint: str | None = None,
                    vocab_from: Path | str | None = None) -> Path:
    """Write ``model_dir`` (HF Llama) as a GGUF file at ``out_path`` (atomically); returns the path.
    ``vocab_from``: a GGUF whose ``tokenizer.*`` keys are copied as they are (a model pulled from
    a GGUF keeps its own tokenizer description, whatever its pre-tokenizer); else the vocabulary
    is built from ``tokenizer_json`` (GPT-2 byte-level BPE only)."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("GGUF conversion needs the `gguf` package: pip install -e \".[peers]\"") from exc
    if out_type not in OUT_TYPES:
        raise GGUFConvertError(f"out_type must be one of {', '.join(OUT_TYPES)}, got {out_type!r}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    tokenizer_json = Path(tokenizer_json) if tokenizer_json else model_dir / "tokenizer.json"
    shape = read_llama_config(model_dir)
    vocab = None if vocab_from is not None else read_bpe_tokenizer(tokenizer_json, shape.vocab_size)
    tensors = llama_tensors(load_state_dict(model_dir), shape)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp_name, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        w.add_name(model_dir.name)
        w.add_file_type({"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                         "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[out_type])
        w.add_vocab_size(shape.vocab_size)
        w.add_context_length(shape.context_length)
        w.add_embedding_length(shape.hidden_size)
        w.add_block_count(shape.num_layers)
        w.add_feed_forward_length(shape.intermediate_size)
        w.add_head_count(shape.num_heads)
        w.add_head_count_kv(shape.num_kv_heads)
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_rope_dimension_count(shape.head_dim)
        w.add_rope_freq_base(shape.rope_theta)
        w.add_layer_norm_rms_eps(shape.rms_norm_eps)

        if vocab is None:
            _copy_tokenizer_fields(w, Path(vocab_from))
        else:
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre("gpt-2")
            w.add_token_list(vocab.tokens)
            w.add_token_types(vocab.token_types)
            w.add_token_merges(vocab.merges)
            for token_id, add in ((shape.bos_token_id, w.add_bos_token_id), (shape.eos_token_id, w.add_eos_token_id),
                                  (shape.pad_token_id, w.add_pad_token_id)):
                if token_id is not None:
                    add(token_id)
            w.add_add_bos_token(vocab.add_bos)
            w.add_add_eos_token(False)
        if fingerprint:
            w.add_string(FINGERPRINT_KEY, fingerprint)

        for name, t in tensors:
            array, raw_dtype = _to_numpy(t, out_type)
            w.add_tensor(name, array, raw_dtype=raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp_name, out_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    log.info("wrote %s (%s, %d tensors)", out_path, out_type, len(tensors))
    return out_path


def _stored_fingerprint(path: Path) -> str | None:
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).get_field(FINGERPRINT_KEY)
    except (OSError, ValueError) as exc:  # truncated or foreign file: rebuild it
        log.warning("ignoring unreadable GGUF %s: %s", path, exc)
        return None
    return None if field is None else field.contents()


def _writable(folder: Path) -> bool:
    """Whether a file can in fact be created in ``folder`` (mode bits say nothing for root or read-only mounts)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECOPS_CACHE_DIR") or Path.home() / ".cache" / "specops")


def gguf_cache_path(model_dir: Path, out_type: str, cache_dir: Path | None = None) -> Path:
    """``model_dir/model-<type>.gguf`` when the folder is writable, else a per-folder path in the cache.

    specops' bundled models count as read-only: they are package data, with a size budget.
    """
    from specops.assets import ASSETS_DIR

    name = f"model-{out_type}.gguf"
    bundled = model_dir.resolve().is_relative_to(ASSETS_DIR)
    if cache_dir is None and not bundled and _writable(model_dir):
        return model_dir / name
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / "gguf" / f"{model_dir.name}-{key}" / name


def ensure_gguf(model_dir: Path | str, *, out_type: str = "float32", cache_dir: Path | str | None = None,
                tokenizer_json: Path | str | None = None) -> Path:
    """The GGUF file for ``model_dir``, converted on first use and whenever its sources change."""
    model_dir = Path(model_dir)
    read_llama_config(model_dir)  # fail early, before any file is written, for unsupported models
    tokenizer_json = Path(tokenizer_json) if tokenizer_json else model_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise GGUFConvertError(f"no tokenizer.json at {tokenizer_json} (only fast tokenizers are supported)")
    vocab_from = source_gguf(model_dir)
    fingerprint = source_fingerprint(model_dir, tokenizer_json, out_type)
    if vocab_from is not None:  # the vocabulary comes from there: a new source makes a new file
        st = vocab_from.stat()
        fingerprint = hashlib.sha256(f"{fingerprint}:{vocab_from.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    path = gguf_cache_path(model_dir, out_type, Path(cache_dir) if cache_dir else None)
    if path.is_file() and _stored_fingerprint(path) == fingerprint:
        return path
    return convert_to_gguf(model_dir, path, out_type=out_type, tokenizer_json=tokenizer_json, fingerprint=fingerprint,
                           vocab_from=vocab_from)
