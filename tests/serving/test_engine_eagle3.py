"""The serving engine runs EAGLE-1 drafters only: an EAGLE-3 drafter (intermediate target hidden
states its batched forwards do not return) is refused when the engine is built, and ``specops
serve --eagle PATH`` refuses an EAGLE-3 folder before loading anything, saying what runs one."""

from __future__ import annotations

import sys

import pytest

from specops.decoder import Decoder
from specops.models.eagle_io import drafter_from_state
from specops.models.eagle_model import EagleError
from specops.engine.engine import Engine
from tests.decoder.test_eagle3 import LAYERS, draft_ids_of, eagle3_checkpoint, write_checkpoint
from tests.decoder.tiny_models import tiny_llama


def test_the_engine_refuses_an_eagle3_drafter():
    model = tiny_llama(seed=4, layers=LAYERS)
    config, state = eagle3_checkpoint(model, draft_ids_of(model.config.vocab_size, 48))
    dec = Decoder(model, eagle=drafter_from_state(config, state).bind(model))
    with pytest.raises(EagleError, match=r"EAGLE-1 drafters only.*Decoder.generate\(method='eagle'\)"):
        Engine(dec, max_batch=1, kv_cache_mb=8)


def test_serve_refuses_an_eagle3_folder_naming_the_option(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import specops.server.server as server
    from specops.server.cli import serve_command

    model = tiny_llama(seed=4, layers=LAYERS)
    folder = write_checkpoint(tmp_path / "eagle3", *eagle3_checkpoint(model, draft_ids_of(model.config.vocab_size, 48)))
    started = []
    monkeypatch.setattr(server, "run_server", started.append)
    interval = sys.getswitchinterval()  # the command sets the process's
    try:
        result = CliRunner().invoke(serve_command, ["--port", "0", "--eagle", str(folder)])
    finally:
        sys.setswitchinterval(interval)
    assert result.exit_code == 2 and not started
    text = " ".join(result.output.split())
    assert "--eagle" in text and "EAGLE-3 drafter" in text and "EAGLE-1 drafters only" in text
