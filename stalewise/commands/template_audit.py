"""`stalewise audit template`: re-render a run's stored trajectories with its chat template.

For each trajectory of the run, the conversation is rebuilt from the store (the task's prompt
and tools from its family, each model call's sampled ids, the tool results shown after it) and
every prompt the agent loop sent is compared with the run's chat format's render of the
conversation so far (`tasks.chat.conformance.audit_calls`), with the run's own tokenizer,
`chat_format` and `tool_listing`. A trajectory is flagged when what the model saw differs from
the template's tokens; sampled ids that spell the template's text in other tokens are counted
but not flagged (the loop keeps sampled ids as sampled, by design).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.store import audit as queries
from core.store.store import Store


class AuditError(Exception):
    """The run cannot be audited (unknown run, model directory or task family gone)."""


def audit_run(store: Store, run_id: str, *, tokenizer_dir: str | None = None) -> dict[str, Any]:
    from core.tokenizer import load_tokenizer
    from tasks.chat import make_chat_format
    from tasks.chat.conformance import RecordedCall, audit_calls
    from tasks.loading import load_family
    from tasks.messages import ChatMessage

    run = store.run(run_id)
    if run is None:
        raise AuditError(f"no run {run_id!r} in this database; list them with `stalewise audit "
                         "runs`")
    config = run.config or {}
    model = config.get("model") or {}
    directory = Path(tokenizer_dir or model.get("path") or "")
    if not (directory / "tokenizer_config.json").exists() and not (
            directory / "tokenizer.json").exists():
        raise AuditError(f"no tokenizer in {str(directory)!r} (the run's model.path); pass "
                         "--tokenizer DIR")
    tasks = config.get("tasks") or {}
    family = load_family(tasks.get("family", "arith"), tasks.get("options") or {})
    fmt = make_chat_format(load_tokenizer(directory), model.get("chat_format", "auto"),
                           tool_listing=model.get("tool_listing", "json"))
    rows = []
    for trajectory in queries.trajectory_tasks(store, run_id):
        calls = store.model_calls(trajectory["id"])
        if not calls or trajectory["task"] is None:
            continue
        instance = family.by_key(trajectory["task"])
        results: dict[int, list[ChatMessage]] = {}
        for row in store.tool_calls(trajectory["id"]):
            results.setdefault(row.turn, []).append(
                ChatMessage("tool", row.observation, name=row.name or "error"))
        recorded = [RecordedCall(c.turn, c.segment, c.context_len,
                                 tuple(int(i) for i in c.prompt_token_ids),
                                 tuple(int(i) for i in c.tokens.token_ids)) for c in calls]
        verdict = audit_calls(fmt, instance.prompt, instance.tools, recorded, results)
        rows.append(dict(id=trajectory["id"], task=trajectory["task"], status=verdict.status,
                         prompts=verdict.prompts_checked, turn=verdict.turn,
                         difference=verdict.difference,
                         segments=len({c.segment for c in calls}),
                         breaks=[c.sampling.get("segment_break") for c in calls
                                 if c.sampling.get("segment_break")]))
    counts = {status: sum(1 for r in rows if r["status"] == status)
              for status in ("exact", "sampled_noncanonical", "mismatch")}
    return dict(run=run_id, format=getattr(fmt, "name", type(fmt).__name__),
                tokenizer=str(directory), trajectories=rows, counts=counts)
