"""`python -m engine serve ...`: the engine CLI without the rest of `stalewise` (used by the launcher)."""

from engine.cli import engine_app

if __name__ == "__main__":
    engine_app(prog_name="python -m engine")
