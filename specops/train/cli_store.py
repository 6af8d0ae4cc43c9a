"""Click command ``specops train ngram-store``: the n-gram drafter's corpus table for a model folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from specops.spec.ngram_store import DEFAULT_MIN_COUNT, DEFAULT_MIN_PROB, STORE_FILE
from specops.models.cli import MODEL_FOLDER


@click.command("ngram-store")
@click.option("--model", "model_path", required=True, type=MODEL_FOLDER,
              help="Model folder the store is for (its tokenizer, or its parent's), or a registered model's name.")
@click.option("--data", "data_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text files to count (repeat the option, or pass a shell glob).")
@click.option("--stdlib", is_flag=True,
              help="Count this interpreter's stdlib training files (its test/ files held out, as `train tiny` "
                   "splits it) instead of --data.")
@click.option("--orders", default="2,3", show_default=True, help="Context lengths to keep, comma-separated.")
@click.option("--min-count", type=click.IntRange(1), default=DEFAULT_MIN_COUNT, show_default=True,
              help="Keep a context only when its most frequent next token was seen this often.")
@click.option("--min-prob", type=click.FloatRange(0, 1, min_open=True), default=DEFAULT_MIN_PROB, show_default=True,
              help="A draft chain stops where the product of its tokens' shares would fall below this.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Tokenizer folder (default: the model folder, then its parent).")
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=None,
              help=f"File or folder to write (default: MODEL/{STORE_FILE}, which `Decoder.from_pretrained` loads).")
def train_store_command(model_path, data_files, stdlib, orders, min_count, min_prob, tokenizer_dir, out_path):
    """Count a corpus into the n-gram drafter's store: the most frequent next token after each
    2- and 3-token context (`specops.spec.ngram_store`)."""
    from specops.spec.ngram_store import NgramStore, tokenizer_digest
    from specops.train.data import encode_stream, read_texts, split_stdlib
    from specops.train.heads import _find_tokenizer

    if stdlib == bool(data_files):
        raise click.UsageError("give --data files or --stdlib (one of them)")
    try:
        order_list = sorted({int(o) for o in orders.split(",") if o.strip()})
    except ValueError:
        raise click.BadParameter(f"want integers like 2,3, got {orders!r}", param_hint="--orders") from None
    if not order_list or order_list[0] < 1 or order_list[-1] > 5:
        raise click.BadParameter(f"orders must lie in 1..5, got {orders!r}", param_hint="--orders")
    try:
        tokenizer = _find_tokenizer(model_path, tokenizer_dir)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    config = json.loads((model_path / "config.json").read_text()) if (model_path / "config.json").is_file() else {}
    vocab_size = int(config.get("vocab_size") or len(tokenizer.get_vocab()))
    started = time.perf_counter()
    files = split_stdlib().train_files if stdlib else list(data_files)
    click.echo(f"reading {len(files)} files ...", err=True)
    texts = read_texts(files)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream = encode_stream(texts, tokenizer, eos_id=eos).numpy()
    click.echo(f"counting {len(stream):,} tokens, orders {order_list} ...", err=True)
    try:
        store = NgramStore.build(stream, vocab_size=vocab_size, orders=order_list, min_count=min_count,
                                 tokenizer=tokenizer_digest(tokenizer), min_prob=min_prob,
                                 meta={"source": "stdlib training files" if stdlib else f"{len(files)} --data files",
                                       "files": len(files)})
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    path = store.save(out_path if out_path is not None else model_path)
    summary = {"out": str(path), "tokens": int(len(stream)), "files": len(files),
               "entries": {str(o): int(len(t.keys)) for o, t in sorted(store.tables.items())},
               "min_count": min_count, "min_prob": min_prob, "bytes": path.stat().st_size,
               "seconds": round(time.perf_counter() - started, 1)}
    click.echo(json.dumps(summary, indent=2))
