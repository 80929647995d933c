"""The warm start reads each split only where it belongs: it trains on train demonstrations, and
its checkpoint selection and the check of the kept checkpoint read validation instances, never
test ones. The family used here logs every instance it is asked for."""

from __future__ import annotations

import json

from config.learner import LearnerConfig
from engine.tiny import init_tiny
from learner.warm_start import CHECK_INSTANCES, Formatting, Suite, warm_start
from tasks.api import SPLITS

LOGGING_FAMILY = '''
import json, os
from tasks.suites import arith

def family(log: str, **options):
    inner = arith.family(**options)
    make = inner._make

    def logged(index, split):
        with open(log, "a") as fh:
            fh.write(json.dumps([split, index]) + "\\n")
        return make(index, split)

    inner._make = logged
    return inner
'''


def test_the_warm_start_selects_and_checks_on_validation_and_trains_on_train(tmp_path):
    model = tmp_path / "tiny"
    init_tiny(model, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    (tmp_path / "logged.py").write_text(LOGGING_FAMILY)
    log = tmp_path / "requests.jsonl"
    cfg = LearnerConfig.model_validate({"sft": {
        "enabled": True, "demonstrations": 16, "steps": 4, "batch_size": 4,
        "select_every": 2, "select_instances": 8}})
    suite = Suite(f"{tmp_path / 'logged.py'}:family", {"log": str(log), "max_ops": 1},
                  Formatting("hermes", "none"))
    warm_start(model, tmp_path / "out", cfg, suite=suite, log=lambda line: None)
    asked = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    by_split = {split: {i for s, i in asked if s == split} for split in SPLITS}
    assert by_split["test"] == set()
    assert by_split["train"] == set(range(16))
    assert by_split["validation"] == set(range(8 + CHECK_INSTANCES))
    facts = json.loads((tmp_path / "out" / "stalewise.json").read_text())
    assert facts["validation_instances"] == CHECK_INSTANCES
