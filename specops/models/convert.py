"""GGUF (llama.cpp's file) -> a transformers Llama folder the decoding runtime loads.

What it writes into the output folder:

* ``config.json``: a ``LlamaConfig`` from the GGUF's ``llama.*`` metadata (sizes, heads,
  RMSNorm epsilon, RoPE base, context length; tied embeddings when the file has no
  ``output.weight``; BOS / EOS / pad ids from the tokenizer metadata);
* ``model.safetensors``: every tensor dequantized to float32 (``gguf.quants.dequantize``
  handles F32, F16, BF16, Q4_0, Q4_1, Q8_0, the K-quants, ...), with GGUF's names mapped
  to transformers' and the RoPE row order of ``attn_q`` / ``attn_k`` put back;
* ``bf16/``: the same model with bfloat16 weights (config, tokenizer and
  ``model.safetensors``), which `Decoder.from_pretrained(..., dtype=torch.bfloat16)`
  loads for a registered name;
* the tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the GGUF's chat
  template), built by transformers' own GGUF tokenizer converter.

Two layout facts carry the weights (the reverse of `specops.bench.gguf_convert`):

* GGUF lists a tensor's dimensions fastest-first (``ne = [in, out]``); the array
  `gguf` returns is already numpy's ``[out, in]``, transformers' ``Linear`` layout.
* llama.cpp's Llama rotates adjacent pairs (``2i``, ``2i+1``) of each head; transformers'
  rotates halves (``i``, ``i + hd/2``). In the file, row ``h*hd + 2i + j`` of ``attn_q`` /
  ``attn_k`` holds transformers' row ``h*hd + j*hd/2 + i`` (`deinterleave_rope_rows`).

The tokenizer: a GGUF ``gpt2`` (byte-level BPE) vocabulary names its pre-tokenizer in
``tokenizer.ggml.pre``; llama.cpp's ``smollm`` splits every digit apart before GPT-2's
byte-level split, so the converted tokenizer gets a ``Digits(individual_digits=True)`` step
in front (`PRE_TOKENIZER_DIGITS`). Other names keep transformers' GPT-2 split.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)

PRE_TOKENIZER_DIGITS = frozenset({"smollm"})
"""GGUF ``tokenizer.ggml.pre`` values whose split isolates every digit before the byte-level regex."""

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFImportError(ValueError):
    """The GGUF file is not a model this converter handles (one readable line)."""


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise GGUFImportError("reading a GGUF file needs the `gguf` package: pip install gguf "
                              "(it comes with specops[runtime])") from exc
    try:
        return GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise GGUFImportError(f"{path} is not a readable GGUF file: {exc}") from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def llama_config(reader) -> dict[str, Any]:
    """``config.json`` for the GGUF's Llama (a plain dict, as ``LlamaConfig(**d).to_dict()`` would read it)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"GGUF architecture {arch!r} is not supported (only llama)")
    p = "llama."

    def need(key: str):
        value = _field(reader, p + key)
        if value is None:
            raise GGUFImportError(f"GGUF metadata {p + key} is missing")
        return value

    if _field(reader, p + "rope.scaling.type") not in (None, "none"):
        raise GGUFImportError(f"GGUF RoPE scaling {_field(reader, p + 'rope.scaling.type')!r} is not supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFImportError("GGUF with rope_freqs (scaled RoPE) is not supported")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(_field(reader, p + "attention.key_length", hidden // heads))
    rope_dims = int(_field(reader, p + "rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFImportError(f"partial RoPE ({rope_dims} of {head_dim} dimensions) is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, p + "vocab_size", len(tokens) if tokens is not None else 0))
    if vocab <= 0:
        raise GGUFImportError("GGUF has neither llama.vocab_size nor a token list")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0))},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "dtype": "float32",
    }
    for gguf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
        value = _field(reader, "tokenizer.ggml." + gguf_key)
        if value is not None:
            config[key] = int(value)
    return config


def hf_tensor_name(name: str) -> str:
    """transformers' name for a GGUF Llama tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    stem, _, suffix = name.rpartition(".")
    if suffix != "weight":
        raise GGUFImportError(f"GGUF tensor {name!r} is not a weight this converter knows")
    if stem in TOP_NAMES:
        return TOP_NAMES[stem] + ".weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.weight"
    raise GGUFImportError(f"GGUF tensor {name!r} is not a Llama weight this converter knows")


def deinterleave_rope_rows(weight, num_heads: int):
    """Undo llama.cpp's RoPE row order: row ``h*hd + j*hd/2 + i`` <- file row ``h*hd + 2i + j``.

    weight: numpy [num_heads * hd, D] -> [num_heads * hd, D].
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GGUFImportError(f"projection with {rows} rows does not split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_tensors(reader, config: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(transformers name, float32 numpy array) for every tensor of the GGUF, in file order."""
    from gguf.quants import dequantize

    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(config["num_hidden_layers"]) for n in LAYER_NAMES.values()}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    seen = set()
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name not in expected:
            raise GGUFImportError(f"GGUF tensor {tensor.name!r} ({name}) does not fit the model's "
                                  f"{config['num_hidden_layers']} layers")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise GGUFImportError(f"GGUF tensor {tensor.name!r}: type {tensor.tensor_type.name} cannot be "
                                  f"dequantized: {exc}") from None
        array = array.astype("float32", copy=False).reshape([int(d) for d in reversed(tensor.shape)])
        if ".attn_q." in tensor.name:
            array = deinterleave_rope_rows(array, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            array = deinterleave_rope_rows(array, config["num_key_value_heads"])
        seen.add(name)
        yield name, array
    missing = sorted(expected - seen)
    if missing:
        raise GGUFImportError(f"GGUF lacks {len(missing)} Llama weight(s), e.g. {', '.join(missing[:3])}")


def build_tokenizer(gguf_path: Path, reader):
    """A transformers fast tokenizer from the GGUF's tokenizer metadata (its chat template included).

    transformers' GGUF converter builds the vocabulary, merges and special tokens; added tokens it
    invents past the file's vocabulary (its GPT-2 class adds ``<|endoftext|>`` as the unknown
    token when the file names none) are dropped, and the BOS / EOS / pad / unknown tokens are the
    ones the file names.
    """
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFImportError(f"GGUF tokenizer {model!r} is not supported (only gpt2-style byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    try:
        built = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises ValueError, KeyError, ... for metadata it cannot read
        raise GGUFImportError(f"transformers cannot build a tokenizer from {gguf_path.name}: {exc}") from exc
    spec = json.loads(built.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if t["id"] < len(tokens)]
    backend = Tokenizer.from_str(json.dumps(spec))
    if _field(reader, "tokenizer.ggml.pre") in PRE_TOKENIZER_DIGITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])

    def named(key: str) -> str | None:
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=named("bos"), eos_token=named("eos"),
                                        pad_token=named("padding"), unk_token=named("unknown"))
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def _save_tokenizer(tokenizer, folder: Path) -> None:
    tokenizer.save_pretrained(str(folder))
    template = getattr(tokenizer, "chat_template", None)
    if template:  # also in tokenizer_config.json, where older readers look for it
        path = folder / "tokenizer_config.json"
        data = json.loads(path.read_text())
        data["chat_template"] = template
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(gguf_path: Path | str, out_dir: Path | str, *, progress: bool = True) -> dict[str, int]:
    """Convert ``gguf_path`` into ``out_dir`` (fp32 at the top, bf16 in ``bf16/``).

    Returns {path relative to ``out_dir``: size in bytes} of every file written.
    """
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from specops.models.registry import BF16_SUBDIR

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _reader(gguf_path)
    config = llama_config(reader)
    tokenizer = build_tokenizer(gguf_path, reader)
    if len(tokenizer) > config["vocab_size"]:
        raise GGUFImportError(f"tokenizer has {len(tokenizer)} tokens, more than the model's {config['vocab_size']} rows")
    tokenizer.model_max_length = config["max_position_embeddings"]
    bf16_dir = out_dir / BF16_SUBDIR
    bf16_dir.mkdir(parents=True, exist_ok=True)

    fp32: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(reader.tensors), desc="dequantizing", unit="tensor", disable=not progress)
    for name, array in iter_tensors(reader, config):
        fp32[name] = torch.from_numpy(array.copy())
        bar.update(1)
    bar.close()
    with tqdm(total=2, desc="writing safetensors", unit="file", disable=not progress) as bar:
        save_file(fp32, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        bar.update(1)
        bf16 = {k: v.to(torch.bfloat16) for k, v in fp32.items()}
        del fp32
        save_file(bf16, str(bf16_dir / "model.safetensors"), metadata={"format": "pt"})
        bar.update(1)
    del bf16
    for folder, dtype in ((out_dir, "float32"), (bf16_dir, "bfloat16")):
        (folder / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n")
        (folder / "generation_config.json").write_text(json.dumps(
            {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}, indent=2) + "\n")
        _save_tokenizer(tokenizer, folder)
    files = {}
    for root, _, names in os.walk(out_dir):
        for n in names:
            path = Path(root) / n
            files[str(path.relative_to(out_dir))] = path.stat().st_size
    log.info("converted %s into %s (%d files)", gguf_path, out_dir, len(files))
    return files
