"""SFT warm start on every built-in suite's demonstrations lowers the tiny model's loss."""

from __future__ import annotations

import pytest

from engine.tiny import init_tiny
from learner.config import LearnerConfig, SftConfig
from learner.sft import run_sft
from learner.trainer import Learner
from tasks import demonstration_samples, load_family
from tasks.chat import make_chat_format

SUITES = {"arith": {}, "codefix": {}, "longhaul": {"max_k": 8},
          "tasks.suites.vault:family": {"depths": [6]}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("suite-sft") / "tiny"
    init_tiny(directory, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    return directory


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_sft_lowers_the_loss_on_the_suite_demonstrations(tiny, suite, capsys):
    learner = Learner(tiny, LearnerConfig())
    family = load_family(suite, SUITES[suite])
    samples = demonstration_samples(
        family.demonstrations(8, seed=1), make_chat_format(learner.tokenizer)
    )
    demos = [(s.token_ids, s.loss_mask) for s in samples]
    result = run_sft(learner, demos, SftConfig(steps=12, batch_size=4, micro_batch_size=2, lr=5e-3))
    with capsys.disabled():
        print(
            f"\nSFT on {len(demos)} {suite} demonstrations: loss {result.loss_before:.3f} -> "
            f"{result.loss_after:.3f} nats per loss token"
        )
    assert result.loss_after < 0.8 * result.loss_before
