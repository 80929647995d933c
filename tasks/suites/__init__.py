"""Built-in task suites: `arith`, `codefix`, `longhaul` (entry points in group stalewise.tasks)."""
