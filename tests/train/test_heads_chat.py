"""``specops train heads --chat``: Medusa heads trained on a chat model's own replies.

The heads' targets are the target's greedy tokens k + 1 positions on, at reply positions
only; the engine-written greedy replies line up with the teacher-forced greedy choices; the
benchmark's held-out prompts never reach training; a registered model's heads go to the
cache, where `Decoder.from_pretrained(NAME)` and `bench decode --model NAME` find them; bad
options are one clear usage error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specops.train import heads as heads_module
from specops.train.cli_heads import train_heads_command
from specops.train.heads import IGNORE, ChatData, HeadsTrainConfig, heads_loss, rank_counts, reply_row
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)

NAME = "smollm2-135m-instruct"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_model_folder(folder: Path, *, chat: bool = True) -> Path:
    """A tiny random Llama and a small BPE tokenizer with (or without) a chat template, saved to ``folder``."""
    from tests.train.tiny_assets import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_model("llama", vocab=len(tokenizer), seed=3, context=1024)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def registered_cache(tmp_path: Path, monkeypatch) -> Path:
    """The registered model's cache folder under a scratch $SPECOPS_CACHE_DIR, holding a tiny chat model
    with a manifest that marks the conversion complete (so nothing is pulled)."""
    from specops.models.registry import CONVERTER_VERSION, MANIFEST, REGISTRY, model_dir

    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    folder = chat_model_folder(model_dir(NAME))
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    (folder / MANIFEST).write_text(json.dumps({"name": NAME, "wheel_sha256": REGISTRY[NAME].wheel_sha256,
                                               "converter_version": CONVERTER_VERSION, "files": files}))
    return folder


class GreedyOracle:
    """Stub heads: head k (1-based) at row position t puts all its mass on ``labels[s + k]``, the
    target's greedy token at sequence position s + k + 1 (s = prompt_len - 1 + t the position read),
    written from the rule itself, not from the row; ``offset`` shifts every head's choice."""

    def __init__(self, labels: torch.Tensor, prompt_len: int, num_heads: int, vocab: int, offset: int = 0):
        self.labels, self.prompt_len, self.num_heads, self.vocab, self.offset = labels, prompt_len, num_heads, vocab, offset

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, E] -> [K, B, T, V]
        b, t, _ = hidden.shape
        out = torch.full((self.num_heads, b, t, self.vocab), -30.0)
        for k in range(1, self.num_heads + 1):
            for pos in range(t):
                j = self.prompt_len - 1 + pos + k + self.offset
                if 0 <= j < self.labels.numel():
                    out[k - 1, :, pos, self.labels[j]] = 30.0
        return out


def test_reply_rows_train_head_k_on_the_greedy_token_k_plus_one_on_at_reply_positions_only():
    gen = torch.Generator().manual_seed(0)
    vocab, prompt_len, reply = 40, 6, 9
    tokens = torch.randint(0, vocab, (prompt_len + reply,), generator=gen).tolist()
    labels = torch.randint(0, vocab, (prompt_len + reply,), generator=gen)  # greedy choices unlike the text
    hidden = torch.randn(prompt_len + reply, 4, generator=gen).to(torch.bfloat16)
    row = reply_row(tokens, prompt_len, hidden, labels)
    assert row.tokens.numel() == row.targets.numel() == row.hidden.shape[0] == reply + 2
    assert row.targets[0] == IGNORE and row.targets[1:].tolist() == labels[prompt_len - 1:].tolist()
    batch = (row.hidden[None].float(), row.targets[None], row.tokens[None])
    right = heads_loss(GreedyOracle(labels, prompt_len, 3, vocab), batch[0], batch[1], 0.8, batch[2])
    assert float(right) < 1e-6
    for offset in (-1, 1):
        wrong = heads_loss(GreedyOracle(labels, prompt_len, 3, vocab, offset), batch[0], batch[1], 0.8, batch[2])
        assert float(wrong) > 10.0, offset
        unscored = torch.zeros_like(batch[1], dtype=torch.bool)  # no position's heads are scored
        assert float(heads_loss(GreedyOracle(labels, prompt_len, 3, vocab, offset), *batch[:2], 0.8, batch[2],
                                unscored)) == 0.0
    # every head is scored from the last prompt token on and on reply tokens only: head k on reply - k + 1
    counts = rank_counts(GreedyOracle(labels, prompt_len, 3, vocab), *batch[:1], batch[2], 2, targets=batch[1])
    assert counts[:, 0].tolist() == [reply, reply - 1, reply - 2] and counts[:, 1:].sum() == 0
    with pytest.raises(ValueError, match="prompt_len"):
        reply_row(tokens, len(tokens), hidden, labels)


def test_packed_batches_never_score_a_head_on_the_next_rows_tokens():
    """Rows of different lengths packed into lines: wherever head k at t is scored (t a source with a
    target at t + k + 2), both positions are the same row's, k + 2 apart, with the row's own
    states and targets; the padding between rows is no source."""
    import random

    from specops.train.heads import ReplyRow, packed_batch

    rows = []
    for i, n in enumerate((3, 5, 9, 14, 30)):
        ids = torch.arange(n) + 1000 * (i + 1)  # row i, position p -> 1000 (i + 1) + p
        rows.append(ReplyRow(tokens=ids, hidden=ids[:, None].repeat(1, 2).to(torch.bfloat16),
                             targets=torch.where(torch.arange(n) == 0, IGNORE, -ids), prompt=i))
    heads = 3
    hidden, targets, tokens, sources = packed_batch(rows, 6, 40, heads, random.Random(0))
    assert hidden.shape == (6, 40, 2) and targets.shape == tokens.shape == sources.shape == (6, 40)
    assert torch.equal(sources, tokens > 0)
    scored = 0
    for line in range(6):
        for t in range(40):
            for k in range(heads):
                j = t + k + 2
                if j < 40 and sources[line, t] and targets[line, j] != IGNORE:
                    scored += 1
                    assert tokens[line, j] - tokens[line, t] == k + 2 and tokens[line, t] // 1000 == tokens[line, j] // 1000
                    assert targets[line, j] == -tokens[line, j]
        real = tokens[line] > 0
        assert torch.equal(hidden[line, real, 0], tokens[line, real].float().to(torch.bfloat16).float())
    assert scored > 6 * 40  # the lines are mostly rows, not padding


@pytest.mark.parametrize("shared", [True, False])
def test_a_shortlist_scores_the_heads_on_its_tokens_only(shared):
    """Over a shortlist the loss is the cross-entropy of the full logits' shortlist columns, targets
    outside it count nowhere, and the rank counts map the shortlist back to token ids."""
    from specops.models.medusa_heads import MedusaHeads

    model = tiny_model("llama", vocab=48, seed=2)
    heads = MedusaHeads.from_model(model, num_heads=2, shared_lm_head=shared)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    hidden = torch.randn(2, 12, 32, generator=gen)
    targets = torch.randint(0, 48, (2, 12), generator=gen)
    targets[:, :3] = IGNORE
    vocab = torch.randperm(48, generator=gen)[:20]
    with torch.no_grad():
        full = heads(hidden[:, :-1])  # [K, B, T-1, V]
    lookup = {int(v): i for i, v in enumerate(vocab)}
    expected = 0.0
    for k in range(2):
        shift = k + 2
        rows = [(b, t) for b in range(2) for t in range(12 - shift) if int(targets[b, t + shift]) in lookup]
        pred = torch.stack([full[k, b, t, vocab] for b, t in rows])
        labels = torch.tensor([lookup[int(targets[b, t + shift])] for b, t in rows])
        expected += 0.8**k * float(torch.nn.functional.cross_entropy(pred, labels))
    with torch.no_grad():
        assert float(heads_loss(heads, hidden, targets, 0.8, vocab=vocab)) == pytest.approx(expected, rel=1e-5)
        assert float(heads_loss(heads, hidden, targets, 0.8, vocab=torch.arange(48))) == pytest.approx(
            float(heads_loss(heads, hidden, targets, 0.8)), rel=1e-5)
    tokens = targets.clamp_min(0)
    counts = rank_counts(heads, hidden, tokens, 3, targets=targets, vocab=vocab)
    for k in range(2):
        shift = k + 2
        hits = sum(int(targets[b, t + shift]) in vocab[full[k, b, t, vocab].topk(3).indices].tolist()
                   for b in range(2) for t in range(12 - shift) if targets[b, t + shift] != IGNORE)
        assert int(counts[k, :3].sum()) == hits
        assert int(counts[k].sum()) == int((targets[:, shift:] != IGNORE).sum())


def test_greedy_replies_from_the_engine_line_up_with_the_teacher_forced_choices(tmp_path, one_thread):
    from specops.decoder import Decoder
    from specops.train.tokenizer import load_tokenizer

    folder = chat_model_folder(tmp_path / "model")
    dec = Decoder.from_pretrained(folder)
    tok = load_tokenizer(folder)
    prompts = [tok.encode(f"<|user|>question {i}: def add(a, b)\n<|assistant|>") for i in range(3)]
    rows = heads_module.collect_replies(dec, prompts, ChatData(new_tokens=10, max_batch=2), eos=None,
                                        budget_s=120.0, positions=None, temperature=0.8, seed=0, desc="test",
                                        size=3, progress=False)
    assert [r.prompt for r in rows] == [0, 1, 2]
    for r, ids in zip(rows, prompts):
        ref = dec.generate(ids, method="ar", max_new_tokens=10).tokens
        assert r.tokens[1:-1].tolist() == ref and r.tokens[0] == ids[-1]
        assert r.targets[1:].tolist() == r.tokens[1:].tolist()  # greedy reply: the target's choices are the reply


def test_chat_training_into_the_cache_is_found_by_from_pretrained_and_the_bench(tmp_path, monkeypatch, one_thread):
    from specops.bench.chat_suite import chat_model_suite
    from specops.bench.decode import BenchConfig, BenchError, load_models
    from specops.decoder import Decoder
    from specops.models.medusa_heads import default_dir
    from specops.train.eagle import prompt_texts
    from specops.train.tokenizer import load_tokenizer

    folder = registered_cache(tmp_path, monkeypatch)
    with pytest.raises(BenchError, match=f"specops train heads --model {NAME} --chat"):
        load_models(BenchConfig(model=NAME, methods=["ar", "medusa"], progress=False))
    calls = []
    real = heads_module.collect_replies

    def spy(decoder, prompts, data, **kwargs):
        calls.append((kwargs["desc"], [tuple(p) for p in prompts]))
        return real(decoder, prompts, data, **kwargs)

    monkeypatch.setattr(heads_module, "collect_replies", spy)
    result = CliRunner().invoke(train_heads_command, [
        "--model", NAME, "--chat", "--minutes", "1", "--tokens", "2000", "--self-prompts", "0", "--steps", "4",
        "--batch-size", "2", "--seq-len", "16", "--shortlist", "64", "--threads", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    out = default_dir(NAME)
    assert out == tmp_path / "cache" / "medusa" / NAME
    report = json.loads((out / "train_report.json").read_text())
    assert report["mode"] == "chat" and report["steps"] == 4 and report["shared_lm_head"] is True
    assert len(report["greedy_top1"]) == 3 and report["replies"] > 0 and report["heldout_replies"] > 0
    assert report["shortlist"] == 64 and 0 < report["shortlist_coverage"] <= 1
    assert report["artifact_bytes"] < 3 * 4 * (32 * 32 + 32) + 4096  # residual blocks only (fp16), no LM head
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "held-out replies: vs base greedy top-1" in result.output
    # the benchmark's held-out prompts are the held-out replies' and never training's
    tok = load_tokenizer(folder)
    _, heldout = prompt_texts(tok)
    held_ids = {tuple(tok.encode(t, add_special_tokens=False)) for t in heldout}
    (held_desc, held_prompts), (train_desc, train_prompts) = calls
    assert "held-out" in held_desc and set(held_prompts) == held_ids
    assert train_prompts and not set(train_prompts) & held_ids
    first = {tuple(tok.encode(p.text, add_special_tokens=False)) for p in chat_model_suite("mixed", tok)[:16]}
    assert first <= held_ids
    # found where decoding looks for a registered model's heads
    dec = Decoder.from_pretrained(NAME)
    assert dec.medusa is not None and dec.medusa.config.head_topk_accuracy == report_rank(out)
    assert dec.medusa.config.shortlist_size == 64
    ids = tok.encode("<|user|>def add(a, b)\n<|assistant|>")
    assert dec.generate(ids, method="medusa", max_new_tokens=12).tokens == \
        dec.generate(ids, method="ar", max_new_tokens=12).tokens
    models = load_models(BenchConfig(model=NAME, methods=["ar", "medusa"], progress=False))
    assert models.medusa is not None and models.medusa.config.base_model == NAME


def report_rank(folder: Path) -> list[list[float]]:
    return json.loads((folder / "medusa_config.json").read_text())["head_topk_accuracy"]


@pytest.mark.parametrize("args, message", [
    ([], "--chat for the model's own chat replies"),
    (["--chat", "--stdlib"], "one of them"),
    (["--chat", "--self-distill"], "--self-distill only applies with --data / --stdlib"),
    (["--chat", "--heldout", "{data}"], "--heldout only applies with --data / --stdlib"),
    (["--data", "{data}", "--minutes", "3"], "--minutes only applies with --chat"),
    (["--data", "{data}", "--self-prompts", "3"], "--self-prompts only applies with --chat"),
    (["--chat", "--minutes", "0"], "--minutes"),
    (["--chat", "--heads", "6", "--seq-len", "8"], "too short"),
])
def test_bad_options_are_one_usage_error(tmp_path, args, message):
    data = tmp_path / "d.txt"
    data.write_text("x = 1\n")
    args = [a.replace("{data}", str(data)) for a in args]
    result = CliRunner().invoke(train_heads_command, ["--model", str(tmp_path), "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_chat_needs_a_chat_template_and_a_folder_needs_out(tmp_path):
    plain = chat_model_folder(tmp_path / "plain", chat=False)
    result = CliRunner().invoke(train_heads_command, ["--model", str(plain), "--chat", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "has no chat template" in result.output and "Traceback" not in result.output
    no_out = CliRunner().invoke(train_heads_command, ["--model", str(plain), "--chat"])
    assert no_out.exit_code == 2 and "give --out DIR for a model folder" in no_out.output


def test_chat_config_validation():
    with pytest.raises(ValueError, match="minutes"):
        ChatData(minutes=0).validate()
    with pytest.raises(ValueError, match="self_prompts"):
        ChatData(self_prompts=-1).validate()
    with pytest.raises(ValueError, match="steps must be a positive int"):
        HeadsTrainConfig(steps=0).validate()
    HeadsTrainConfig(steps=None).validate()  # a time budget instead of a step count
