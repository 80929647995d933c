from learner.cli import app

app()
