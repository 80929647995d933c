"""The `stalewise` command line. Each area owns its sub-app; heavy imports happen inside commands."""

from __future__ import annotations

import typer

from engine.cli import engine_app, model_app
from lab.cli import app as lab_app
from learner.cli import app as learner_app
from sandboxes.cli import app as sandbox_app
from stalewise.commands.audit import app as audit_app
from stalewise.commands.chat import app as chat_app
from stalewise.commands.compare import compare_command
from stalewise.commands.db import app as db_app
from stalewise.commands.run import run_command
from stalewise.commands.tasks import check_command as tasks_check_command
from tasks.cli import app as tasks_app
from viewer.cli import view_command

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="stalewise: RL post-training of LLM agents on long, tool-using tasks.")
app.command("run")(run_command)
app.command("compare")(compare_command)
app.command("view")(view_command)
app.add_typer(db_app, name="db", help="Migrate and check the SQL store.")
app.add_typer(audit_app, name="audit", help="Inspect runs, trajectories and tokens.")
tasks_app.command("check")(tasks_check_command)
app.add_typer(tasks_app, name="tasks", help="Task families: list, show, check, tools.")
app.add_typer(chat_app, name="chat", help="Chat formats: check one against a real template.")
app.add_typer(sandbox_app, name="sandbox", help="Docker sandboxes: build, run, clean up, check.")
app.add_typer(engine_app, name="engine", help="The embedded inference engine.")
app.add_typer(model_app, name="model", help="Create and inspect policy checkpoints.")
app.add_typer(learner_app, name="learner", help="The learner (trainer) process.")
app.add_typer(lab_app, name="lab", help="Update-quality lab: bias and variance of update rules.")


def main() -> None:
    app()
