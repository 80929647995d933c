#!/usr/bin/env bash
# GPU smoke test of the vLLM backend (not run in CI; needs an NVIDIA GPU and vLLM: the project's
# .venv-vllm, which scripts/setup_vllm.sh builds with the GPU build where a GPU answers, or a
# `vllm` on PATH, or STALEWISE_VLLM_PYTHON).
#
#   bash scripts/gpu_smoke.sh [WORKDIR]
#
# 1. creates the tiny model (v0) and a perturbed copy (v1) under WORKDIR (default: a temp dir);
# 2. starts `vllm serve` on it through orchestrator.engines.launch.VllmProcess (processed log-probs, the
#    stalewise worker extension, development routes);
# 3. runs a short job through the orchestrator's engine client (backend="vllm"): 16 concurrent
#    sequences at temperature 1, with an in-flight weight update (v0 -> v1, kv=recompute) while
#    they stream, then 8 sequences at T=0.7/top-k 20/top-p 0.9;
# 4. prints, per weights version, how far vLLM's recorded log-probs are from the learner's own
#    recomputation (plain transformers forward, float32), and checks the processed ones too.
#
# 5. then runs the vLLM tests of the CPU suite (pytest -m vllm) against the GPU build
#    (STALEWISE_SMOKE_PYTEST=0 skips this step).
#
# STALEWISE_SMOKE_DRY_RUN=1 runs the same job against the embedded CPU engine (which serves the
# same vLLM routes) to check this script without a GPU.
#
# Exit status 0 when every sequence finished, versions are monotone, and the mean absolute
# log-prob difference is below STALEWISE_SMOKE_TOL (default 1e-3 for --dtype float32; with
# bf16/fp16 expect about 1e-2 and raise the tolerance).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKDIR="${1:-$(mktemp -d -t stalewise-gpu-smoke-XXXX)}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export STALEWISE_SMOKE_TOL="${STALEWISE_SMOKE_TOL:-1e-3}"
export STALEWISE_VLLM_DTYPE="${STALEWISE_VLLM_DTYPE:-float32}"

export STALEWISE_SMOKE_DRY_RUN="${STALEWISE_SMOKE_DRY_RUN:-0}"
if [ "$STALEWISE_SMOKE_DRY_RUN" != "1" ]; then
  "$PYTHON" -c "from orchestrator.engines.launch import vllm_python; vllm_python()" || {
    echo "error: vLLM is not installed (bash scripts/setup_vllm.sh)" >&2; exit 2; }
  command -v nvidia-smi >/dev/null || { echo "error: no NVIDIA GPU (nvidia-smi missing)" >&2; exit 2; }
fi
echo "workdir: $WORKDIR"

"$PYTHON" - "$WORKDIR" <<'PY'
import os
import sys
from pathlib import Path

import anyio
import torch

from engine.checkpoint import load_model
from orchestrator.engines.launch import EngineProcess, VllmProcess
from config.engine import EngineServerConfig
from engine.sampling import processed_logprobs
from engine.tiny import init_tiny
from orchestrator.engines.embedded import engine_client
from core.engine_api import GenerateRequest, SamplingParams

workdir = Path(sys.argv[1])
tol = float(os.environ["STALEWISE_SMOKE_TOL"])
v0 = init_tiny(workdir / "v0", initializer_range=0.2)
model = load_model(v0)
with torch.no_grad():
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.add_(0.02 * torch.randn(p.shape, generator=generator))
v1 = workdir / "v1"
model.save_pretrained(str(v1), safe_serialization=True)
reference = {0: load_model(v0), 1: load_model(v1)}
prompts = [[10 + (11 * i + 3 * j) % 90 for j in range(6 + i % 7)] for i in range(16)]


def raw_logprobs(version, prompt, sampled):
    ids = torch.tensor([prompt + sampled])
    with torch.no_grad():
        logits = reference[version](ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(sampled)], -1)


async def job(url: str) -> int:
    failures = 0
    async with engine_client(url, backend="vllm", ignore_eos=True) as client:
        results = [None] * len(prompts)

        async def one(i):
            results[i] = await client.generate(GenerateRequest(prompts[i], SamplingParams(max_tokens=200)))

        async with anyio.create_task_group() as group:
            for i in range(len(prompts)):
                group.start_soon(one, i)
            await anyio.sleep(0.5)
            report = await client.update_weights(str(v1), 1, mode="inflight", kv="recompute")
            print(f"update: pause {report.pause_s * 1e3:.1f} ms")
        diffs = {0: [], 1: []}
        for prompt, result in zip(prompts, results):
            t = result.tokens
            if result.finish_reason != "length" or len(t) != 200:
                print(f"FAIL: a sequence ended with {result.finish_reason} after {len(t)} tokens")
                failures += 1
            if (t.weights_versions[1:] < t.weights_versions[:-1]).any():
                print("FAIL: weights version went backwards")
                failures += 1
            for version in (0, 1):
                mask = t.weights_versions == version
                if mask.any():
                    raw = raw_logprobs(version, prompt, t.token_ids.tolist())
                    want = raw.gather(1, torch.tensor(t.token_ids.tolist()).unsqueeze(1)).squeeze(1)
                    got = torch.from_numpy(t.sampler_logprobs.copy())
                    diffs[version] += (got - want).abs()[torch.from_numpy(mask)].tolist()
        for version, d in diffs.items():
            if d:
                d = torch.tensor(d)
                print(f"v{version}: {len(d)} tokens, |vLLM - learner| mean {d.mean():.2e} max {d.max():.2e}")
                failures += int(d.mean() > tol)
        spanning = sum(len(set(r.tokens.weights_versions.tolist())) > 1 for r in results)
        print(f"{spanning}/{len(results)} sequences continued across the update")

        params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=50)
        processed = []
        for prompt in prompts[:8]:
            result = await client.generate(GenerateRequest(prompt, params))
            sampled = result.tokens.token_ids.tolist()
            raw = raw_logprobs(1, prompt, sampled)
            n = len(sampled)
            want = processed_logprobs(raw, torch.full((n,), 0.7), torch.full((n,), 20),
                                      torch.full((n,), 0.9)).gather(1, torch.tensor(sampled).unsqueeze(1))
            processed += (torch.from_numpy(result.tokens.sampler_logprobs.copy()) - want.squeeze(1)).abs().tolist()
        d = torch.tensor(processed)
        print(f"processed (T=0.7, top-k 20, top-p 0.9): |vLLM - recomputed| mean {d.mean():.2e} max {d.max():.2e}")
        failures += int(d.mean() > tol)
    return failures


if os.environ["STALEWISE_SMOKE_DRY_RUN"] == "1":
    print("dry run: embedded CPU engine instead of vllm serve")
    server = EngineProcess.start(v0, EngineServerConfig(served_model_name="tiny"),
                                 log_path=workdir / "engine.log")
else:
    server = VllmProcess.start(v0, served_model_name="tiny", log_path=workdir / "vllm.log",
                               extra_args=("--dtype", os.environ["STALEWISE_VLLM_DTYPE"],
                                           "--max-model-len", "2048", "--enforce-eager"))
with server:
    failures = anyio.run(job, server.url)
print("PASS" if failures == 0 else f"FAIL ({failures} checks)")
sys.exit(1 if failures else 0)
PY

if [ "$STALEWISE_SMOKE_DRY_RUN" != "1" ] && [ "${STALEWISE_SMOKE_PYTEST:-1}" = "1" ]; then
  cd "$ROOT" && "$PYTHON" -m pytest -q -m vllm tests/engine/test_vllm_backend.py
fi
