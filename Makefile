.PHONY: setup setup-real setup-all demo demo-long demo-real test test-fast bench clean lock

# What the demos need: .venv, a Docker engine, the sandbox base image.
setup:
	bash scripts/setup.sh

# What demo-real needs as well: the GGUF reader and SmolLM2-135M-Instruct in var/models.
setup-real:
	bash scripts/setup.sh --real

# Everything the tests need as well: chat fixtures, Chromium, SmolLM2, .venv-vllm, the MCP SDK.
setup-all:
	bash scripts/setup.sh --all

# The main job: tiny model, SFT warm start, RL in inflight mode with real Docker sandboxes.
# `make demo SEED=1` runs the same job with another seed (run.seed).
SEED ?= 0
demo: setup
	.venv/bin/stalewise run configs/demo.toml --set run.seed=$(SEED)

# The long-horizon job: the vault suite (6-12 stateful tool calls), inflight with retained KV.
# `make demo-long SEED=1` runs it with another seed.
demo-long: setup
	.venv/bin/stalewise run configs/long.toml --set run.seed=$(SEED)

# A real model: SmolLM2-135M-Instruct, a short SFT warm start on `story` word problems, RL in
# inflight mode, bfloat16 where the CPU has bfloat16 instructions (README: its gain over seeds).
demo-real: setup-real
	.venv/bin/stalewise run configs/demo-real.toml --set run.seed=$(SEED)

# The suite on TEST_WORKERS processes (pytest-xdist). Tests that share a session fixture or a
# heavy server stay on one worker (tests/conftest.py names them). TEST_WORKERS=0 runs it serially.
TEST_WORKERS ?= 2
test: setup-all
	bash scripts/ensure_postgres.sh
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --durations=40

# Unit tests only (no Docker, no PostgreSQL, nothing slow).
test-fast:
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) -m "not docker and not postgres and not slow"

bench: setup
	.venv/bin/python bench/store.py
	.venv/bin/python bench/sandbox.py
	.venv/bin/python bench/engine.py
	.venv/bin/python bench/learner.py
	.venv/bin/python bench/orchestrator.py
	.venv/bin/python bench/pipeline.py

clean:
	rm -rf var .pytest_cache

# Re-resolve the dependencies and rewrite requirements.lock (commit the result).
lock:
	bash scripts/lock.sh
