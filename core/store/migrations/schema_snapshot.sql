CREATE TABLE admission_decisions (
	id INTEGER NOT NULL,
	run_id VARCHAR(64) NOT NULL,
	trajectory_id INTEGER,
	group_id INTEGER,
	decision VARCHAR(16) NOT NULL,
	reason VARCHAR(64) NOT NULL,
	learner_version INTEGER NOT NULL,
	lag INTEGER,
	details JSON,
	created_at FLOAT NOT NULL,
	CONSTRAINT pk_admission_decisions PRIMARY KEY (id),
	CONSTRAINT fk_admission_decisions_group_id_groups FOREIGN KEY(group_id) REFERENCES groups (id),
	CONSTRAINT fk_admission_decisions_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE,
	CONSTRAINT fk_admission_decisions_trajectory_id_trajectories FOREIGN KEY(trajectory_id) REFERENCES trajectories (id)
);

CREATE TABLE alembic_version (
	version_num VARCHAR(32) NOT NULL,
	CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);

CREATE TABLE bias_ledger (
	id INTEGER NOT NULL,
	run_id VARCHAR(64) NOT NULL,
	computed_at FLOAT NOT NULL,
	family VARCHAR(200) NOT NULL,
	difficulty VARCHAR(64) NOT NULL,
	duration_quantile INTEGER,
	generated INTEGER NOT NULL,
	admitted INTEGER NOT NULL,
	excluded_by_reason JSON NOT NULL,
	mean_reward_admitted FLOAT,
	mean_reward_excluded FLOAT,
	mean_duration_admitted FLOAT,
	mean_duration_excluded FLOAT,
	CONSTRAINT pk_bias_ledger PRIMARY KEY (id),
	CONSTRAINT fk_bias_ledger_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);

CREATE TABLE evaluations (
	id INTEGER NOT NULL,
	run_id VARCHAR(64) NOT NULL,
	label VARCHAR(32) NOT NULL,
	policy_version INTEGER NOT NULL,
	split VARCHAR(16) NOT NULL,
	instances INTEGER NOT NULL,
	"distinct" INTEGER NOT NULL,
	solved INTEGER NOT NULL,
	infra_errors INTEGER NOT NULL,
	aborted INTEGER NOT NULL,
	mean_reward FLOAT NOT NULL,
	failures JSON NOT NULL,
	created_at FLOAT NOT NULL,
	CONSTRAINT pk_evaluations PRIMARY KEY (id),
	CONSTRAINT fk_evaluations_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);

CREATE TABLE groups (
	id INTEGER NOT NULL,
	run_id VARCHAR(64) NOT NULL,
	task_instance_id INTEGER NOT NULL,
	size INTEGER NOT NULL,
	status VARCHAR(16) NOT NULL,
	dispatch_version INTEGER NOT NULL,
	created_at FLOAT NOT NULL,
	completed_at FLOAT,
	CONSTRAINT pk_groups PRIMARY KEY (id),
	CONSTRAINT fk_groups_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE,
	CONSTRAINT fk_groups_task_instance_id_task_instances FOREIGN KEY(task_instance_id) REFERENCES task_instances (id)
);

CREATE TABLE learner_steps (
	run_id VARCHAR(64) NOT NULL,
	step INTEGER NOT NULL,
	mode VARCHAR(16) NOT NULL,
	first_seq INTEGER,
	last_seq INTEGER,
	num_samples INTEGER NOT NULL,
	num_tokens INTEGER NOT NULL,
	loss FLOAT NOT NULL,
	policy_version INTEGER,
	mean_lag FLOAT,
	max_lag INTEGER,
	metrics JSON NOT NULL,
	started_at FLOAT NOT NULL,
	finished_at FLOAT NOT NULL,
	CONSTRAINT pk_learner_steps PRIMARY KEY (run_id, step),
	CONSTRAINT fk_learner_steps_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);

CREATE TABLE learner_stream (
	run_id VARCHAR(64) NOT NULL,
	seq INTEGER NOT NULL,
	trajectory_id INTEGER NOT NULL,
	group_id INTEGER,
	reward FLOAT NOT NULL,
	loss_masked BOOLEAN NOT NULL,
	admitted_at FLOAT NOT NULL, weight FLOAT DEFAULT (1.0) NOT NULL,
	CONSTRAINT pk_learner_stream PRIMARY KEY (run_id, seq),
	CONSTRAINT fk_learner_stream_group_id_groups FOREIGN KEY(group_id) REFERENCES groups (id),
	CONSTRAINT fk_learner_stream_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE,
	CONSTRAINT fk_learner_stream_trajectory_id_trajectories FOREIGN KEY(trajectory_id) REFERENCES trajectories (id),
	CONSTRAINT uq_learner_stream_run_id_trajectory_id UNIQUE (run_id, trajectory_id)
);

CREATE TABLE model_calls (
	id INTEGER NOT NULL,
	trajectory_id INTEGER NOT NULL,
	turn INTEGER NOT NULL,
	segment INTEGER NOT NULL,
	context_len INTEGER NOT NULL,
	num_tokens INTEGER NOT NULL,
	prompt_token_ids BLOB NOT NULL,
	token_ids BLOB NOT NULL,
	sampler_logprobs BLOB NOT NULL,
	weights_versions BLOB NOT NULL,
	kv_versions BLOB NOT NULL,
	time_offsets BLOB NOT NULL,
	topk INTEGER NOT NULL,
	topk_ids BLOB,
	topk_logprobs BLOB,
	sampling JSON NOT NULL,
	engine_id VARCHAR(200) NOT NULL,
	finish_reason VARCHAR(16) NOT NULL,
	cached_prompt_tokens INTEGER NOT NULL,
	started_at FLOAT NOT NULL,
	finished_at FLOAT NOT NULL,
	CONSTRAINT pk_model_calls PRIMARY KEY (id),
	CONSTRAINT fk_model_calls_trajectory_id_trajectories FOREIGN KEY(trajectory_id) REFERENCES trajectories (id) ON DELETE CASCADE
);

CREATE TABLE policy_versions (
	run_id VARCHAR(64) NOT NULL,
	version INTEGER NOT NULL,
	path TEXT NOT NULL,
	learner_step INTEGER,
	last_seq INTEGER,
	created_at FLOAT NOT NULL,
	CONSTRAINT pk_policy_versions PRIMARY KEY (run_id, version),
	CONSTRAINT fk_policy_versions_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);

CREATE TABLE runs (
	id VARCHAR(64) NOT NULL,
	name VARCHAR(200) NOT NULL,
	status VARCHAR(16) NOT NULL,
	pipeline_mode VARCHAR(16) NOT NULL,
	config JSON NOT NULL,
	config_hash VARCHAR(64) NOT NULL,
	created_at FLOAT NOT NULL,
	finished_at FLOAT,
	error TEXT,
	host VARCHAR(200) NOT NULL,
	pid INTEGER,
	stream_head INTEGER NOT NULL,
	summary JSON,
	CONSTRAINT pk_runs PRIMARY KEY (id)
);

CREATE TABLE sandboxes (
	id INTEGER NOT NULL,
	run_id VARCHAR(64) NOT NULL,
	trajectory_id INTEGER,
	backend VARCHAR(16) NOT NULL,
	container_id VARCHAR(100) NOT NULL,
	image VARCHAR(200) NOT NULL,
	acquired_at FLOAT NOT NULL,
	acquire_s FLOAT NOT NULL,
	released_at FLOAT,
	status VARCHAR(16) NOT NULL,
	error TEXT,
	CONSTRAINT pk_sandboxes PRIMARY KEY (id),
	CONSTRAINT fk_sandboxes_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE,
	CONSTRAINT fk_sandboxes_trajectory_id_trajectories FOREIGN KEY(trajectory_id) REFERENCES trajectories (id)
);

CREATE TABLE task_instances (
	id INTEGER NOT NULL,
	run_id VARCHAR(64) NOT NULL,
	family VARCHAR(200) NOT NULL,
	"key" VARCHAR(200) NOT NULL,
	content_hash VARCHAR(64) NOT NULL,
	difficulty VARCHAR(64) NOT NULL,
	prompt TEXT NOT NULL,
	meta JSON,
	CONSTRAINT pk_task_instances PRIMARY KEY (id),
	CONSTRAINT fk_task_instances_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE,
	CONSTRAINT uq_task_instances_run_id_family_key UNIQUE (run_id, family, "key")
);

CREATE TABLE tool_calls (
	id INTEGER NOT NULL,
	trajectory_id INTEGER NOT NULL,
	turn INTEGER NOT NULL,
	"index" INTEGER NOT NULL,
	name VARCHAR(200) NOT NULL,
	arguments TEXT NOT NULL,
	observation TEXT NOT NULL,
	exit_code INTEGER,
	error_type VARCHAR(32),
	timed_out BOOLEAN NOT NULL,
	truncated BOOLEAN NOT NULL,
	output_bytes INTEGER NOT NULL,
	started_at FLOAT NOT NULL,
	duration_s FLOAT NOT NULL, reward FLOAT,
	CONSTRAINT pk_tool_calls PRIMARY KEY (id),
	CONSTRAINT fk_tool_calls_trajectory_id_trajectories FOREIGN KEY(trajectory_id) REFERENCES trajectories (id) ON DELETE CASCADE
);

CREATE TABLE trainer_logprobs (
	id INTEGER NOT NULL,
	run_id VARCHAR(64) NOT NULL,
	model_call_id INTEGER NOT NULL,
	learner_step INTEGER NOT NULL,
	policy_version INTEGER,
	num_tokens INTEGER NOT NULL,
	logprobs BLOB NOT NULL,
	created_at FLOAT NOT NULL,
	CONSTRAINT pk_trainer_logprobs PRIMARY KEY (id),
	CONSTRAINT fk_trainer_logprobs_model_call_id_model_calls FOREIGN KEY(model_call_id) REFERENCES model_calls (id) ON DELETE CASCADE,
	CONSTRAINT fk_trainer_logprobs_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE
);

CREATE TABLE trajectories (
	id INTEGER NOT NULL,
	run_id VARCHAR(64) NOT NULL,
	group_id INTEGER,
	task_instance_id INTEGER,
	sample_index INTEGER NOT NULL,
	purpose VARCHAR(8) NOT NULL,
	attempt INTEGER NOT NULL,
	status VARCHAR(16) NOT NULL,
	stop_reason VARCHAR(32),
	reward FLOAT,
	reward_breakdown JSON,
	error TEXT,
	queued_at FLOAT NOT NULL,
	started_at FLOAT,
	finished_at FLOAT,
	engine_s FLOAT NOT NULL,
	tools_s FLOAT NOT NULL,
	waiting_s FLOAT NOT NULL,
	dispatch_version INTEGER NOT NULL,
	min_version INTEGER,
	max_version INTEGER,
	min_kv_version INTEGER,
	num_turns INTEGER NOT NULL,
	num_model_calls INTEGER NOT NULL,
	num_tool_calls INTEGER NOT NULL,
	num_malformed INTEGER NOT NULL,
	num_sampled_tokens INTEGER NOT NULL,
	num_segments INTEGER NOT NULL,
	CONSTRAINT pk_trajectories PRIMARY KEY (id),
	CONSTRAINT fk_trajectories_group_id_groups FOREIGN KEY(group_id) REFERENCES groups (id),
	CONSTRAINT fk_trajectories_run_id_runs FOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE,
	CONSTRAINT fk_trajectories_task_instance_id_task_instances FOREIGN KEY(task_instance_id) REFERENCES task_instances (id)
);

CREATE INDEX ix_admission_decisions_group_id ON admission_decisions (group_id);

CREATE INDEX ix_admission_decisions_run_decision ON admission_decisions (run_id, decision);

CREATE INDEX ix_admission_decisions_trajectory_id ON admission_decisions (trajectory_id);

CREATE INDEX ix_bias_ledger_run_computed ON bias_ledger (run_id, computed_at);

CREATE INDEX ix_evaluations_run_id ON evaluations (run_id);

CREATE INDEX ix_groups_run_id ON groups (run_id);

CREATE INDEX ix_groups_task_instance_id ON groups (task_instance_id);

CREATE INDEX ix_model_calls_trajectory_turn ON model_calls (trajectory_id, turn);

CREATE INDEX ix_runs_status ON runs (status);

CREATE INDEX ix_sandboxes_run_id ON sandboxes (run_id);

CREATE INDEX ix_sandboxes_trajectory_id ON sandboxes (trajectory_id);

CREATE INDEX ix_task_instances_run_id ON task_instances (run_id);

CREATE INDEX ix_tool_calls_trajectory_turn ON tool_calls (trajectory_id, turn);

CREATE INDEX ix_trainer_logprobs_model_call_id ON trainer_logprobs (model_call_id);

CREATE INDEX ix_trainer_logprobs_run_id ON trainer_logprobs (run_id);

CREATE INDEX ix_trajectories_group_id ON trajectories (group_id);

CREATE INDEX ix_trajectories_run_status ON trajectories (run_id, status);
