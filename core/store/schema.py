"""SQL schema of the trajectory store (SQLAlchemy 2.x declarative models).

Alembic migrations in `core/store/migrations/` are the only DDL: these models describe the schema at head
and `alembic check` (run in the tests) proves the migrations produce exactly this. Times are unix
seconds (float) so that durations are plain subtraction in SQL on every backend. Per-token
arrays are packed little-endian binary columns (see `core.records.pack`), one row per model
call: compact, fast to write, identical on SQLite and PostgreSQL.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    """One job. `stream_head` is the last sequence number handed to an admitted trajectory."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), index=True)  # running|finished|failed|aborted
    pipeline_mode: Mapped[str] = mapped_column(String(16))
    config: Mapped[dict] = mapped_column(JSON)
    config_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str] = mapped_column(String(200), default="")
    pid: Mapped[int | None] = mapped_column(Integer)
    stream_head: Mapped[int] = mapped_column(Integer, default=0)
    summary: Mapped[dict | None] = mapped_column(JSON)


class PolicyVersion(Base):
    """Published weights: the row is written only after the checkpoint is complete on disk."""

    __tablename__ = "policy_versions"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    learner_step: Mapped[int | None] = mapped_column(Integer)
    last_seq: Mapped[int | None] = mapped_column(Integer)  # stream position the weights include
    created_at: Mapped[float] = mapped_column(Float)


class TaskInstance(Base):
    __tablename__ = "task_instances"
    __table_args__ = (UniqueConstraint("run_id", "family", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    family: Mapped[str] = mapped_column(String(200))
    key: Mapped[str] = mapped_column(String(200))
    content_hash: Mapped[str] = mapped_column(String(64))
    difficulty: Mapped[str] = mapped_column(String(64), default="")
    prompt: Mapped[str] = mapped_column(Text, default="")
    meta: Mapped[dict | None] = mapped_column(JSON)


class Group(Base):
    """G samples of one task instance; group baselines are computed over its members."""

    __tablename__ = "groups"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    task_instance_id: Mapped[int] = mapped_column(ForeignKey("task_instances.id"), index=True)
    size: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # open|complete|admitted|dropped
    dispatch_version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    completed_at: Mapped[float | None] = mapped_column(Float)


class Trajectory(Base):
    __tablename__ = "trajectories"
    __table_args__ = (Index("ix_trajectories_run_status", "run_id", "status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    group_id: Mapped[int | None] = mapped_column(ForeignKey("groups.id"), index=True)
    task_instance_id: Mapped[int | None] = mapped_column(ForeignKey("task_instances.id"))
    sample_index: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    purpose: Mapped[str] = mapped_column(String(8), default="train")  # train|eval
    # queued|running|completed|truncated|failed|infra_error|aborted
    status: Mapped[str] = mapped_column(String(16))
    stop_reason: Mapped[str | None] = mapped_column(String(32))
    reward: Mapped[float | None] = mapped_column(Float)
    reward_breakdown: Mapped[dict | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    queued_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    engine_s: Mapped[float] = mapped_column(Float, default=0.0)
    tools_s: Mapped[float] = mapped_column(Float, default=0.0)
    waiting_s: Mapped[float] = mapped_column(Float, default=0.0)
    dispatch_version: Mapped[int] = mapped_column(Integer, default=0)
    min_version: Mapped[int | None] = mapped_column(Integer)
    max_version: Mapped[int | None] = mapped_column(Integer)
    min_kv_version: Mapped[int | None] = mapped_column(Integer)
    num_turns: Mapped[int] = mapped_column(Integer, default=0)
    num_model_calls: Mapped[int] = mapped_column(Integer, default=0)
    num_tool_calls: Mapped[int] = mapped_column(Integer, default=0)
    num_malformed: Mapped[int] = mapped_column(Integer, default=0)
    num_sampled_tokens: Mapped[int] = mapped_column(Integer, default=0)
    num_segments: Mapped[int] = mapped_column(Integer, default=0)


class ModelCall(Base):
    """One engine request. The token arrays all hold `num_tokens` entries (checked on write).

    `prompt_token_ids` are only the tokens appended to the segment since the previous call (the
    whole prompt for the first call of a segment); `context_len` counts the tokens before them.
    A segment's full token sequence is therefore the concatenation, in turn order, of each
    call's prompt_token_ids followed by its token_ids.
    """

    __tablename__ = "model_calls"
    __table_args__ = (Index("ix_model_calls_trajectory_turn", "trajectory_id", "turn"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trajectory_id: Mapped[int] = mapped_column(ForeignKey("trajectories.id", ondelete="CASCADE"))
    turn: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer, default=0)
    context_len: Mapped[int] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(Integer)
    prompt_token_ids: Mapped[bytes] = mapped_column(LargeBinary)  # int32
    token_ids: Mapped[bytes] = mapped_column(LargeBinary)  # int32
    sampler_logprobs: Mapped[bytes] = mapped_column(LargeBinary)  # float32
    weights_versions: Mapped[bytes] = mapped_column(LargeBinary)  # int32
    kv_versions: Mapped[bytes] = mapped_column(LargeBinary)  # int32
    time_offsets: Mapped[bytes] = mapped_column(LargeBinary)  # float32, s since started_at
    topk: Mapped[int] = mapped_column(Integer, default=0)
    topk_ids: Mapped[bytes | None] = mapped_column(LargeBinary)  # int32 (T, topk)
    topk_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)  # float32 (T, topk)
    sampling: Mapped[dict] = mapped_column(JSON)
    engine_id: Mapped[str] = mapped_column(String(200))
    finish_reason: Mapped[str] = mapped_column(String(16))
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float] = mapped_column(Float)


class ToolCall(Base):
    __tablename__ = "tool_calls"
    __table_args__ = (Index("ix_tool_calls_trajectory_turn", "trajectory_id", "turn"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trajectory_id: Mapped[int] = mapped_column(ForeignKey("trajectories.id", ondelete="CASCADE"))
    turn: Mapped[int] = mapped_column(Integer)
    index: Mapped[int] = mapped_column(Integer, default=0)
    name: Mapped[str] = mapped_column(String(200))
    arguments: Mapped[str] = mapped_column(Text)  # JSON as the model wrote it
    observation: Mapped[str] = mapped_column(Text)  # what went back to the model
    exit_code: Mapped[int | None] = mapped_column(Integer)
    error_type: Mapped[str | None] = mapped_column(String(32))
    timed_out: Mapped[bool] = mapped_column(Boolean, default=False)
    truncated: Mapped[bool] = mapped_column(Boolean, default=False)
    output_bytes: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[float] = mapped_column(Float)
    duration_s: Mapped[float] = mapped_column(Float)
    reward: Mapped[float | None] = mapped_column(Float)  # the task's per-turn reward, if any


class SandboxRow(Base):
    __tablename__ = "sandboxes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    trajectory_id: Mapped[int | None] = mapped_column(ForeignKey("trajectories.id"), index=True)
    backend: Mapped[str] = mapped_column(String(16))
    container_id: Mapped[str] = mapped_column(String(100), default="")
    image: Mapped[str] = mapped_column(String(200))
    acquired_at: Mapped[float] = mapped_column(Float)
    acquire_s: Mapped[float] = mapped_column(Float, default=0.0)
    released_at: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16))  # live|released|failed|orphaned
    error: Mapped[str | None] = mapped_column(Text)


class AdmissionDecision(Base):
    """Why a trajectory (or a whole group) was admitted, dropped, requeued or masked."""

    __tablename__ = "admission_decisions"
    __table_args__ = (Index("ix_admission_decisions_run_decision", "run_id", "decision"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    trajectory_id: Mapped[int | None] = mapped_column(ForeignKey("trajectories.id"), index=True)
    group_id: Mapped[int | None] = mapped_column(ForeignKey("groups.id"), index=True)
    decision: Mapped[str] = mapped_column(String(16))  # admit|drop|requeue|mask
    reason: Mapped[str] = mapped_column(String(64))
    learner_version: Mapped[int] = mapped_column(Integer)  # the version expected to train it
    lag: Mapped[int | None] = mapped_column(Integer)  # learner_version - oldest token version
    details: Mapped[dict | None] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)


class StreamEntry(Base):
    """The admission log the learner consumes: one row per admitted trajectory, `seq` 1, 2, ...

    A row is inserted in the same transaction as its admit decision, with `seq` taken from
    `runs.stream_head`, so sequence numbers are contiguous and each trajectory appears once.
    """

    __tablename__ = "learner_stream"
    __table_args__ = (UniqueConstraint("run_id", "trajectory_id"),)

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    trajectory_id: Mapped[int] = mapped_column(ForeignKey("trajectories.id"))
    group_id: Mapped[int | None] = mapped_column(ForeignKey("groups.id"))
    reward: Mapped[float] = mapped_column(Float)  # the reward trained with (after admission rules)
    loss_masked: Mapped[bool] = mapped_column(Boolean, default=False)  # baselines only, no loss
    admitted_at: Mapped[float] = mapped_column(Float)
    # selection-bias weight (core/selection.py; 1 unless [admission] reweight is on): the
    # learner multiplies the trajectory's advantage by it
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1.0"))


class LearnerStep(Base):
    __tablename__ = "learner_steps"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    mode: Mapped[str] = mapped_column(String(16))  # rl|sft
    first_seq: Mapped[int | None] = mapped_column(Integer)
    last_seq: Mapped[int | None] = mapped_column(Integer)
    num_samples: Mapped[int] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float] = mapped_column(Float)
    policy_version: Mapped[int | None] = mapped_column(Integer)  # version trained from
    mean_lag: Mapped[float | None] = mapped_column(Float)
    max_lag: Mapped[int | None] = mapped_column(Integer)
    metrics: Mapped[dict] = mapped_column(JSON)
    started_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float] = mapped_column(Float)


class BiasLedgerRow(Base):
    """Generated vs admitted, per task family and difficulty bucket (and duration quantile)."""

    __tablename__ = "bias_ledger"
    __table_args__ = (Index("ix_bias_ledger_run_computed", "run_id", "computed_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    computed_at: Mapped[float] = mapped_column(Float)
    family: Mapped[str] = mapped_column(String(200))
    difficulty: Mapped[str] = mapped_column(String(64))
    duration_quantile: Mapped[int | None] = mapped_column(Integer)
    generated: Mapped[int] = mapped_column(Integer)
    admitted: Mapped[int] = mapped_column(Integer)
    excluded_by_reason: Mapped[dict] = mapped_column(JSON)
    mean_reward_admitted: Mapped[float | None] = mapped_column(Float)
    mean_reward_excluded: Mapped[float | None] = mapped_column(Float)
    mean_duration_admitted: Mapped[float | None] = mapped_column(Float)
    mean_duration_excluded: Mapped[float | None] = mapped_column(Float)


class TrainerLogprobs(Base):
    """The log-probs the learner's forward computed for one model call's sampled tokens.

    `logprobs` is float32 little-endian, one entry per sampled token of the call (the same
    length as `model_calls.token_ids`), NaN where the learner did not train the token
    (loss mask 0). Written after the learner step that computed them; a step redone after a
    learner crash adds a new row, and readers take the latest (highest id)."""

    __tablename__ = "trainer_logprobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    model_call_id: Mapped[int] = mapped_column(
        ForeignKey("model_calls.id", ondelete="CASCADE"), index=True)
    learner_step: Mapped[int] = mapped_column(Integer)
    policy_version: Mapped[int | None] = mapped_column(Integer)  # weights of the forward pass
    num_tokens: Mapped[int] = mapped_column(Integer)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)  # float32 (num_tokens,)
    created_at: Mapped[float] = mapped_column(Float)


class EvaluationRow(Base):
    """One evaluation of a run as numbers (`core.evaluation.Evaluation`): every reader — the
    job summary, report.md, the viewer, `compare` — takes its figures from here. Infrastructure
    errors and aborted trajectories are failures in `solved`'s rate and are counted beside it."""

    __tablename__ = "evaluations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    label: Mapped[str] = mapped_column(String(32))  # before | after
    policy_version: Mapped[int] = mapped_column(Integer)
    split: Mapped[str] = mapped_column(String(16))  # the family split it read (test)
    instances: Mapped[int] = mapped_column(Integer)  # trajectories started
    distinct: Mapped[int] = mapped_column(Integer)  # different task identities among them
    solved: Mapped[int] = mapped_column(Integer)
    infra_errors: Mapped[int] = mapped_column(Integer)
    aborted: Mapped[int] = mapped_column(Integer)
    mean_reward: Mapped[float] = mapped_column(Float)
    failures: Mapped[dict] = mapped_column(JSON)  # failure mode -> unsolved trajectories
    created_at: Mapped[float] = mapped_column(Float)
