"""Built-in task suites: `arith`, `codefix`, `longhaul`, `story`, `vault` (entry points in group stalewise.tasks)."""
