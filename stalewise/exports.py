"""A run's data in formats other tools open: one row per sampled token (parquet, JSONL) and
Inspect AI eval logs (one sample per trajectory).

Token rows carry exactly what the store holds, unchanged: ids, the sampler's log-prob, weights
and KV versions, time since the request started, the loss mask and, where the learner recorded
it, the trainer's log-prob (None otherwise). `position` is the token's index in its segment's
full sequence (prompt and sampled tokens), as in `audit show`. pyarrow and inspect-ai are
imported only by the writers that need them.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from core.store import audit
from core.store.reads import task_instances, trajectory_ids
from core.store.store import Store

TOKEN_COLUMNS = ("run_id", "trajectory_id", "turn", "segment", "position", "token_id", "text",
                 "sampler_logprob", "weights_version", "kv_version", "time_s", "trainer_logprob",
                 "loss_mask")
MISSING_EXTRA = ("{what} needs the `{package}` package; install it with: "
                 "pip install 'stalewise[export]'")


def token_rows(store: Store, run_id: str, *, tokenizer_dir: str | None = None,
               batch: int = 64) -> Iterator[dict[str, Any]]:
    """Every sampled token of the run, trajectory by trajectory, in (segment, turn) order."""
    decode = audit.token_decoder(store, run_id, tokenizer_dir)
    ids = trajectory_ids(store, run_id)
    for first in range(0, len(ids), batch):
        calls_by_trajectory = store.model_calls_for(ids[first:first + batch])
        calls = [c for tid in ids[first:first + batch] for c in calls_by_trajectory[tid]]
        learner = audit.trainer_logprobs(store, [c.id for c in calls])
        for call in calls:
            tok, trained = call.tokens, learner.get(call.id)
            start = call.context_len + len(call.prompt_token_ids)
            for i in range(len(tok)):
                tlp = None if trained is None else float(trained[i])
                yield dict(run_id=run_id, trajectory_id=call.trajectory_id, turn=call.turn,
                           segment=call.segment, position=start + i,
                           token_id=int(tok.token_ids[i]),
                           text=decode(tok.token_ids[i]) if decode else None,
                           sampler_logprob=float(tok.sampler_logprobs[i]),
                           weights_version=int(tok.weights_versions[i]),
                           kv_version=int(tok.kv_versions[i]),
                           time_s=float(tok.time_offsets[i]),
                           trainer_logprob=None if tlp is None or math.isnan(tlp) else tlp,
                           loss_mask=1)  # a call's tokens are all sampled (core.samples)


def write_jsonl(store: Store, run_id: str, out: Path, **kw: Any) -> int:
    """One JSON object per line per token; returns the number of rows."""
    n = 0
    with out.open("w", encoding="utf-8") as f:
        for row in token_rows(store, run_id, **kw):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def write_parquet(store: Store, run_id: str, out: Path, **kw: Any) -> int:
    """A parquet file with TOKEN_COLUMNS (float32 log-probs, int32 ids); returns the rows."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeError(MISSING_EXTRA.format(what="parquet export", package="pyarrow")) from None
    schema = pa.schema([("run_id", pa.string()), ("trajectory_id", pa.int64()),
                        ("turn", pa.int32()), ("segment", pa.int32()), ("position", pa.int32()),
                        ("token_id", pa.int32()), ("text", pa.string()),
                        ("sampler_logprob", pa.float32()), ("weights_version", pa.int32()),
                        ("kv_version", pa.int32()), ("time_s", pa.float32()),
                        ("trainer_logprob", pa.float32()), ("loss_mask", pa.uint8())])
    n = 0
    with pq.ParquetWriter(str(out), schema) as writer:
        chunk: list[dict[str, Any]] = []
        for row in token_rows(store, run_id, **kw):
            chunk.append(row)
            if len(chunk) >= 50_000:
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                n, chunk = n + len(chunk), []
        writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
        n += len(chunk)
    return n


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return datetime.fromtimestamp(stamp, tz=timezone.utc).isoformat()


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {"raw": text}
    return value if isinstance(value, dict) else {"value": value}


def _messages(detail: dict[str, Any], prompt: str, decode_text) -> list[Any]:
    from inspect_ai.model import ChatMessageAssistant, ChatMessageTool, ChatMessageUser
    from inspect_ai.tool import ToolCall

    messages: list[Any] = [ChatMessageUser(content=prompt)]
    for turn in detail["turns"]:
        ids = [t["id"] for t in turn["tokens"]]
        text = decode_text(ids) if decode_text else " ".join(map(str, ids))
        calls = [(f"t{turn['turn']}-{i}", call) for i, call in enumerate(turn["tool_calls"])]
        messages.append(ChatMessageAssistant(
            content=text, tool_calls=[ToolCall(id=cid, function=call["name"],
                                               arguments=call["arguments"]
                                               if isinstance(call["arguments"], dict)
                                               else _arguments(str(call["arguments"])))
                                      for cid, call in calls] or None))
        for cid, call in calls:
            messages.append(ChatMessageTool(content=call["observation"], tool_call_id=cid,
                                            function=call["name"]))
    return messages


def _sample(store: Store, trajectory_id: int, decode_text, prompts: dict[int, Any]) -> Any:
    from inspect_ai.log import EvalSample
    from inspect_ai.scorer import Score

    detail = audit.trajectory_detail(store, trajectory_id, tokenizer_dir="")
    info = detail["trajectory"]
    task = prompts.get(info["task_instance_id"])
    prompt = task.prompt if task else ""
    last = detail["admission"][-1] if detail["admission"] else None
    metadata = dict(
        trajectory_id=trajectory_id, task_family=task.family if task else None,
        task_key=task.key if task else None, difficulty=task.difficulty if task else None,
        purpose=info["purpose"], status=info["status"], stop_reason=info["stop_reason"],
        group_id=info["group_id"], sample_index=info["sample_index"],
        dispatch_version=info["dispatch_version"], min_version=info["min_version"],
        max_version=info["max_version"], min_kv_version=info["min_kv_version"],
        lag=last["lag"] if last else None, admission=detail["admission"],
        num_sampled_tokens=info["num_sampled_tokens"], error=info["error"])
    return EvalSample(
        id=trajectory_id, epoch=1, input=prompt, target="",
        messages=_messages(detail, prompt, decode_text), metadata=metadata,
        scores={"reward": Score(value=info["reward"] if info["reward"] is not None else 0.0,
                                metadata=info["reward_breakdown"] or {})},
        total_time=(info["finished_at"] - info["started_at"])
        if info["finished_at"] and info["started_at"] else None)


def write_inspect(store: Store, run_id: str, out_dir: Path,
                  tokenizer_dir: str | None = None) -> Path:
    """One Inspect eval log for the run (`OUT_DIR/<run id>.eval`); returns its path."""
    try:
        from inspect_ai.log import EvalConfig, EvalDataset, EvalLog, EvalSpec, write_eval_log
    except ImportError:
        raise RuntimeError(MISSING_EXTRA.format(what="Inspect export",
                                                package="inspect-ai")) from None
    run = store.run(run_id)
    if run is None:
        raise LookupError(f"no run {run_id} in {store.url}; list runs with: stalewise audit runs")
    prompts = task_instances(store, run_id)
    decode_text = audit.text_decoder(store, run_id, tokenizer_dir)
    samples = [_sample(store, tid, decode_text, prompts) for tid in trajectory_ids(store, run_id)]
    families = sorted({p.family for p in prompts.values()}) or ["unknown"]
    model = ((run.config or {}).get("model") or {}).get("path") or "unknown"
    spec = EvalSpec(created=_iso(run.created_at), task=f"stalewise/{'+'.join(families)}",
                    run_id=run_id, dataset=EvalDataset(name="+".join(families),
                                                       samples=len(samples)),
                    model=f"stalewise/{model}", config=EvalConfig(),
                    metadata={"stalewise_run": run_id, "mode": run.pipeline_mode,
                              "status": run.status})
    log = EvalLog(eval=spec, samples=samples,
                  status="success" if run.status == "finished" else "started")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{run_id}.eval"
    write_eval_log(log, str(path))
    return path
