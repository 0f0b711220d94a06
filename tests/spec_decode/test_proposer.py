"""One ``Proposer`` per speculative method, chosen from the config; every one answers the same calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config.engine_config import SpeculativeConfig, SpeculativeMethod
from common.engine.model_runner import ModelRunner
from common.model.loader import load_model
from common.spec_decode.proposer import DraftModel, EarlyLayers, LookupFirst, NgramLookup, Proposer


@pytest.mark.parametrize(("config", "kind"), [
    (SpeculativeConfig(SpeculativeMethod.NGRAM), NgramLookup),
    (SpeculativeConfig(SpeculativeMethod.DRAFT_LAYERS, draft_layers=1), EarlyLayers),
    (SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, draft_model="tiny"), DraftModel),
    (SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, draft_model="tiny", ngram_first=True), LookupFirst),
])
def test_the_runner_holds_the_proposer_its_config_names(tiny_model_dir: Path, config: SpeculativeConfig,
                                                        kind: type[Proposer]) -> None:
    model = load_model(tiny_model_dir, dtype="float32")
    draft = model if config.method is SpeculativeMethod.DRAFT_MODEL else None
    runner = ModelRunner(model, block_size=4, num_blocks=16, speculative=config, draft_model=draft)
    assert type(runner.proposer) is kind
    # the same calls on every proposer, stateless ones included
    runner.proposer.accept("r", 0)
    runner.proposer.copy_blocks([(1, 2)])
    runner.forget("r")
    assert (runner.draft is not None) == isinstance(runner.proposer, DraftModel)
    assert runner.ngram_proposals == 0


def test_no_speculation_has_no_proposer(tiny_model_dir: Path) -> None:
    runner = ModelRunner(load_model(tiny_model_dir, dtype="float32"), block_size=4, num_blocks=16)
    assert runner.proposer is None and runner.draft is None
