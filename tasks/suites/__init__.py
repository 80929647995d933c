"""Built-in task suites: `arith`, `codefix`, `longhaul`, `vault` (entry points in group stalewise.tasks)."""
