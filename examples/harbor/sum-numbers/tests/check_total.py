import json
from pathlib import Path

target = Path("/work/total.txt")
wrote = target.is_file()
correct = wrote and target.read_text().strip() == "52"
print(json.dumps({"reward": 1.0 if correct else 0.0, "wrote_file": 1.0 if wrote else 0.0}))
